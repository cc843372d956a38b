"""The wire format of one message between ranks: a frame of fixed size, then the parts that did not fit.

    frame (FRAME bytes)   [envelope length: int64][envelope, pickled][body: small tensors]
    envelope              (fillers, extras, header or None): the byte sizes of the parts that
                          follow the frame, and the header when it fits in the frame
    after the frame       each filler (bytes sent only to fill receives the peer had posted,
                          see fxpipe/channel.py), then each extra: the header when it did not
                          fit, then every tensor that did not

The header is the step, the kind, the key and the value's structure, each tensor in it replaced
by its shape, dtype, requires_grad and place (an offset in the body, or -1: an extra). Every
part is bytes: a receiver posts each receive knowing only its size.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Hashable, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

FRAME = 4 * 1024  # small enough to cost no more than an empty send, on loopback gloo
_ENVELOPE_ROOM = 512  # of the frame, kept for the envelope when tensors are placed in the body
_ALIGN = 16  # body offsets: any dtype can view its bytes there


class FrameFull(ValueError):
    """The envelope and the body of a message do not fit in one frame."""


@dataclass(frozen=True)
class _TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    at: int  # offset in the frame's body, or -1: sent as an extra
    # The sender's strides where they were not contiguous ones: the receiver puts the values in
    # that layout again, as in one process, where kernels see the layouts the plain model gives them.
    strides: Optional[tuple[int, ...]] = None


@dataclass
class Message:
    """One value, ready to send: the header, the tensors placed in the body, and the extras."""

    header: bytes
    inline: list[tuple[int, torch.Tensor]]  # (body offset, tensor)
    extras: list[torch.Tensor]  # bytes, each sent as a part of its own

    def extra_sizes(self, header_inline: bool) -> list[int]:
        sizes = [] if header_inline else [len(self.header)]
        return sizes + [t.numel() for t in self.extras]


def encode(step: int, kind: str, key: Hashable, value: Any, body: bool = True) -> Message:
    """The message of one value; without `body`, every tensor is an extra (for a value with so
    many tensors that their sizes leave no room in the frame)."""
    originals = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    places, inline, extras, end = [], [], [], 0
    for t in originals:
        data = as_bytes(t.detach())
        start = _aligned(end)
        if body and start + data.numel() <= FRAME - _ENVELOPE_ROOM:
            places.append(start)
            inline.append((start, data))
            end = start + data.numel()
        else:
            places.append(-1)
            extras.append(data)
    metas = iter([_TensorMeta(tuple(t.shape), t.dtype, t.requires_grad, at, _layout(t)) for t, at in zip(originals, places)])
    skeleton = tree_map_only(torch.Tensor, lambda _: next(metas), value)
    return Message(pickle.dumps((step, kind, key, skeleton)), inline, extras)


def frame_of(message: Message, fillers: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The frame, and the sizes of the extras that follow it (after `fillers`)."""
    body_end = max((at + t.numel() for at, t in message.inline), default=0)
    for header_inline in (True, False):
        sizes = message.extra_sizes(header_inline)
        envelope = pickle.dumps((fillers, sizes, message.header if header_inline else None))
        body = _aligned(8 + len(envelope))
        if body + body_end <= FRAME:
            break
    else:
        raise FrameFull(f"a message's envelope ({len(envelope)} bytes) and body ({body_end} bytes) do not fit in a frame of {FRAME}")
    frame = torch.zeros(FRAME, dtype=torch.uint8)
    frame[:8] = torch.tensor([len(envelope)], dtype=torch.int64).view(torch.uint8)
    frame[8 : 8 + len(envelope)] = torch.frombuffer(bytearray(envelope), dtype=torch.uint8)
    for at, data in message.inline:
        frame[body + at : body + at + data.numel()] = data.cpu()
    return frame, sizes


def open_frame(frame: torch.Tensor) -> tuple[list[int], list[int], Optional[bytes], int]:
    """(fillers, extras, the header if inline, where the body starts) of a received frame."""
    length = int(frame[:8].view(torch.int64).item())
    fillers, extras, header = pickle.loads(frame[8 : 8 + length].numpy().tobytes())
    return fillers, extras, header, _aligned(8 + length)


def decode(header: bytes, frame: torch.Tensor, body: int, extras: list[torch.Tensor], device: torch.device) -> tuple[int, str, Hashable, Any]:
    """(step, kind, key, value) from the header, the frame's body and the tensor extras."""
    step, kind, key, skeleton = pickle.loads(header)
    leaves, spec = tree_flatten(skeleton)
    parts = iter(extras)

    def tensor(meta: _TensorMeta) -> torch.Tensor:
        if meta.at >= 0:
            data = frame[body + meta.at : body + meta.at + _nbytes(meta)].clone().to(device)
        else:
            data = next(parts)
        values = data.view(meta.dtype).reshape(meta.shape)
        if meta.strides is not None:
            values = torch.empty_strided(meta.shape, meta.strides, dtype=meta.dtype, device=values.device).copy_(values)
        return values.requires_grad_(meta.requires_grad)

    return step, kind, key, tree_unflatten([tensor(m) if isinstance(m, _TensorMeta) else m for m in leaves], spec)


def _layout(t: torch.Tensor) -> Optional[tuple[int, ...]]:
    """The tensor's strides, if a fresh tensor can take them (dense, not overlapping: what
    `empty_like` keeps) and they are not the contiguous ones; else None."""
    strides = torch.empty_like(t, device="meta").stride()
    contiguous = torch.empty(t.shape, device="meta").stride()
    return strides if strides == t.stride() and strides != contiguous else None


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's data as a flat uint8 tensor (a copy only when it is not contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _nbytes(meta: _TensorMeta) -> int:
    count = 1
    for size in meta.shape:
        count *= size
    return count * torch.empty((), dtype=meta.dtype).element_size()


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN
