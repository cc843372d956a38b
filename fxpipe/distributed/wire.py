"""The wire format of one message between ranks: a frame of fixed size, then the parts that did not fit.

    frame (FRAME bytes)   [counts: 5 x int64][sizes: int64 each][header, if it fits][body: small tensors]
    counts                the step, how many fillers, how many extras, the header's length,
                          whether it is in the frame
    sizes                 the byte sizes of the parts that follow the frame: fillers, then extras
    after the frame       each filler (bytes sent only to fill receives the peer had posted,
                          see fxpipe/distributed/channel.py), then each extra: the header when it did not
                          fit, then every tensor that did not

The header is the kind, the key and the value's structure, each tensor in it replaced by its
shape, dtype, requires_grad and place (an offset in the body, or -1: an extra). Every part is
bytes: a receiver posts each receive knowing only its size. A schedule sends the same headers
in every step, so a receiver keeps what each header unpickles to.
"""
from __future__ import annotations

import ctypes
import pickle
import struct
from dataclasses import dataclass
from typing import Any, Hashable, NamedTuple, Optional

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map, tree_unflatten

FRAME = 4 * 1024  # small enough to cost no more than an empty send, on loopback gloo
_HEADER_ROOM = 512  # of the frame, kept for the sizes and the header when tensors are placed in the body
_ALIGN = 16  # body offsets: any dtype can view its bytes there
_COUNTS = struct.Struct("<5q")
_KEPT = 4096  # headers kept by each side (a schedule's messages of one step, many times over)
_EXACT = (int, bool, str, bytes, type(None))  # leaf types whose equal values pickle alike
# The frame is packed and read with struct, and small tensors are copied in and out of it by
# address, not with tensor slices and views: each of those costs microseconds of dispatch, and a
# small message's round trip is only a few of them. A sender keeps each header it pickled, by
# what the header depends on (the receiver keeps what each unpickles to, below).


class FrameFull(ValueError):
    """The sizes, the header and the body of a message do not fit in one frame."""


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

    step: int
    header: bytes
    inline: list[tuple[int, torch.Tensor]]  # (body offset, tensor)
    extras: list[torch.Tensor]  # bytes, each sent as a part of its own

    def extra_sizes(self, header_inline: bool) -> list[int]:
        sizes = [] if header_inline else [len(self.header)]
        return sizes + [t.numel() for t in self.extras]


class SparseParts(NamedTuple):
    """A sparse COO tensor on the wire (a sparse embedding's gradient): its dense parts."""

    indices: torch.Tensor
    values: torch.Tensor
    size: tuple[int, ...]


def _as_parts(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor) and leaf.layout == torch.sparse_coo:
        leaf = leaf.coalesce()
        return SparseParts(leaf.indices(), leaf.values(), tuple(leaf.shape))
    return leaf


def _from_parts(value: Any) -> Any:
    def rebuilt(leaf: Any) -> Any:
        if isinstance(leaf, SparseParts):
            return torch.sparse_coo_tensor(leaf.indices, leaf.values, leaf.size, is_coalesced=True, check_invariants=False)
        return leaf

    return tree_map(rebuilt, value, is_leaf=lambda leaf: isinstance(leaf, SparseParts))


def _holds_sparse(spec: TreeSpec) -> bool:
    return spec.context is SparseParts or any(_holds_sparse(child) for child in spec.children())


def encode(step: int, kind: str, key: Hashable, value: Any, body: bool = True) -> Message:
    """The message of one value; without `body`, every tensor is an extra (for a value with so
    many tensors that their sizes leave no room in the frame). A sparse tensor goes as its
    indices and values (`SparseParts`)."""
    leaves, spec = tree_flatten(value)
    if any(isinstance(leaf, torch.Tensor) and leaf.layout == torch.sparse_coo for leaf in leaves):
        leaves, spec = tree_flatten(tree_map(_as_parts, value))
    tensors = [leaf.detach() for leaf in leaves if isinstance(leaf, torch.Tensor)]
    signature = _signature(kind, key, spec, leaves, body)
    known = _sent_headers.get(signature) if signature is not None else None
    if known is None:
        known = _header(kind, key, spec, leaves, body)
        if signature is not None:
            if len(_sent_headers) >= _KEPT:
                _sent_headers.clear()
            _sent_headers[signature] = known
    header, places = known
    inline = [(at, _dense(t)) for at, t in zip(places, tensors) if at >= 0]
    extras = [as_bytes(t) for at, t in zip(places, tensors) if at < 0]
    return Message(step, header, inline, extras)


def _header(kind: str, key: Hashable, spec: TreeSpec, leaves: list[Any], body: bool) -> tuple[bytes, tuple[int, ...]]:
    """The pickled header, and each tensor's place: an offset in the body, or -1 (an extra)."""
    skeleton, places, end = list(leaves), [], 0
    for i, t in enumerate(leaves):
        if not isinstance(t, torch.Tensor):
            continue
        nbytes, start = t.numel() * t.element_size(), _aligned(end)
        if body and start + nbytes <= FRAME - _HEADER_ROOM:
            end = start + nbytes
        else:
            start = -1
        places.append(start)
        skeleton[i] = _TensorMeta(tuple(t.shape), t.dtype, t.requires_grad, start, _layout(t))
    return pickle.dumps((kind, key, tree_unflatten(skeleton, spec))), tuple(places)


def _signature(kind: str, key: Hashable, spec: TreeSpec, leaves: list[Any], body: bool) -> Optional[Hashable]:
    """What a message's header depends on, or None where that cannot be told by equality (a
    leaf of another type: 1.0 == 1 == True, 0.0 == -0.0, yet each pickles as itself)."""
    parts: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append((leaf.shape, leaf.dtype, leaf.requires_grad, leaf.is_contiguous() or leaf.stride()))
        elif type(leaf) in _EXACT:
            parts.append((type(leaf), leaf))
        else:
            return None
    signature = (kind, key, spec, body, tuple(parts))
    try:
        hash(signature)
    except TypeError:  # a pytree node whose context cannot be hashed
        return None
    return signature


def frame_of(message: Message, fillers: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The frame, and the sizes of the extras that follow it (after `fillers`)."""
    body_end = max((at + t.numel() * t.element_size() for at, t in message.inline), default=0)
    for header_inline in (True, False):
        sizes = message.extra_sizes(header_inline)
        start = _COUNTS.size + 8 * (len(fillers) + len(sizes))
        body = _aligned(start + (len(message.header) if header_inline else 0))
        if body + body_end <= FRAME:
            break
    else:
        raise FrameFull(f"a message's sizes and header ({body} bytes) and body ({body_end} bytes) do not fit in a frame of {FRAME}")
    frame = bytearray(FRAME)
    _COUNTS.pack_into(frame, 0, message.step, len(fillers), len(sizes), len(message.header), header_inline)
    struct.pack_into(f"<{len(fillers) + len(sizes)}q", frame, _COUNTS.size, *fillers, *sizes)
    if header_inline:
        frame[start : start + len(message.header)] = message.header
    framed = torch.frombuffer(frame, dtype=torch.uint8)
    for at, t in message.inline:
        _copy(framed.data_ptr() + body + at, t.data_ptr(), t.numel() * t.element_size())
    return framed, sizes


def open_frame(frame: torch.Tensor) -> tuple[int, list[int], list[int], Optional[bytes], int]:
    """(step, fillers, extras, the header if inline, where the body starts) of a received frame."""
    data = frame.numpy().data
    step, n_fillers, n_extras, header_length, header_inline = _COUNTS.unpack_from(data, 0)
    sizes = list(struct.unpack_from(f"<{n_fillers + n_extras}q", data, _COUNTS.size))
    start = _COUNTS.size + 8 * len(sizes)
    header = data[start : start + header_length].tobytes() if header_inline else None
    return step, sizes[:n_fillers], sizes[n_fillers:], header, _aligned(start + (header_length if header_inline else 0))


def decode(header: bytes, frame: torch.Tensor, body: int, extras: list[torch.Tensor], device: torch.device) -> tuple[str, Hashable, Any]:
    """(kind, key, value) from the header, the frame's body and the tensor extras."""
    kind, key, leaves, spec, sparse = _opened(header)
    parts = iter(extras)

    def tensor(meta: _TensorMeta) -> torch.Tensor:
        if meta.at >= 0 and meta.strides is None:  # the common case: one copy, no views
            values = torch.empty(meta.shape, dtype=meta.dtype)
            _copy(values.data_ptr(), frame.data_ptr() + body + meta.at, _nbytes(meta))
            values = values.to(device)
        else:
            data = frame.narrow(0, body + meta.at, _nbytes(meta)).clone().to(device) if meta.at >= 0 else next(parts)
            values = data.view(meta.dtype).view(meta.shape)
            if meta.strides is not None:
                values = torch.empty_strided(meta.shape, meta.strides, dtype=meta.dtype, device=values.device).copy_(values)
        return values.requires_grad_(meta.requires_grad)

    value = tree_unflatten([tensor(m) if isinstance(m, _TensorMeta) else m for m in leaves], spec)
    return kind, key, _from_parts(value) if sparse else value


_sent_headers: dict[Hashable, tuple[bytes, tuple[int, ...]]] = {}  # signature -> header, places
_opened_headers: dict[bytes, tuple[str, Hashable, list[Any], TreeSpec, bool]] = {}
_IMMUTABLE = (_TensorMeta, int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def _opened(header: bytes) -> tuple[str, Hashable, list[Any], TreeSpec, bool]:
    """The kind, the key, the skeleton's leaves and structure, and whether it holds a sparse
    tensor's parts; kept where no leaf could be changed by whoever takes the value (its structure
    is rebuilt on every call)."""
    opened = _opened_headers.get(header)
    if opened is None:
        kind, key, skeleton = pickle.loads(header)
        leaves, spec = tree_flatten(skeleton)
        opened = (kind, key, leaves, spec, _holds_sparse(spec))
        if all(isinstance(leaf, _IMMUTABLE) for leaf in opened[2]):
            if len(_opened_headers) >= _KEPT:
                _opened_headers.clear()
            _opened_headers[header] = opened
    return opened


def _layout(t: torch.Tensor) -> Optional[tuple[int, ...]]:
    """The tensor's strides, if a fresh tensor can take them (dense, not overlapping: what
    `empty_like` keeps) and they are not the contiguous ones; else None."""
    if t.stride() == _contiguous(t.shape):
        return None  # the common case, without the two tensors below
    strides = torch.empty_like(t, device="meta").stride()
    contiguous = torch.empty(t.shape, device="meta").stride()
    return strides if strides == t.stride() and strides != contiguous else None


def _resolved(t: torch.Tensor) -> torch.Tensor:
    """The tensor with its conjugate and negative bits applied to its values: its bytes are then
    what it holds (and torch views a conjugate view as bytes not at all)."""
    return t.resolve_conj().resolve_neg() if t.is_conj() or t.is_neg() else t


def _dense(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values contiguous in host memory, where they can be copied by address."""
    t = _resolved(t)
    return t if t.device.type == "cpu" and t.is_contiguous() else t.contiguous().cpu()


def _copy(to: int, source: int, nbytes: int) -> None:
    if nbytes:  # a tensor without elements may have no address
        ctypes.memmove(to, source, nbytes)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's data as a flat uint8 tensor (a copy only when it is not contiguous)."""
    return _resolved(t).contiguous().reshape(-1).view(torch.uint8)


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)  # as torch strides a dim of size 0
    return tuple(reversed(strides))


def _nbytes(meta: _TensorMeta) -> int:
    count = 1
    for size in meta.shape:
        count *= size
    return count * meta.dtype.itemsize


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN
