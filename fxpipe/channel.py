"""Values between processes: each rank's messages to another, in the order it sends them.

A rank sends a value as one message on `torch.distributed` point-to-point ops: its header (the
step, the key, and the value's structure with each tensor's shape, dtype and requires_grad),
pickled, then each tensor. Shapes are sent with every value, so a step may change the batch
size or the sequence length. Sends are asynchronous; a rank receives on its own thread, when an
action needs a value, reading the sender's messages in the order they were sent and keeping the
ones it does not need yet:

    rank 0 sends   [F0 act]  [F1 act]  [F1 skip]          (each: header, then tensors)
    rank 1 takes   F1 skip ──▶ reads F0 act, F1 act (kept), F1 skip (returned)

No thread waits between steps, and NCCL, which ignores tags, sees each pair's messages in one
order. A rank that fails sends every peer a failure message in place of what it still owed,
so a peer waiting on it raises, names the failure, and passes it on; a rank that dies closes its
connections, and its peers' reads fail at once. A read that waits longer than `timeout` fails.
At the end of a step every rank sends every other a `done` message and reads theirs: no rank
leaves a step that another has failed.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Hashable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

VALUE, FAILED, DONE = "value", "failed", "done"
_TAG = 23  # every message of fxpipe's on a pair; the order on the pair does the rest


@dataclass(frozen=True)
class _TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass(frozen=True)
class Failure:
    """What a failed rank tells the others: where it failed, and the error as text."""

    rank: int
    stage: int
    micro_batch: int
    phase: str
    error: str  # "TypeName: message"

    def describe(self) -> str:
        where = f"stage {self.stage} (rank {self.rank})" if self.stage >= 0 else f"rank {self.rank}"
        if self.micro_batch >= 0:
            where += f" failed on micro-batch {self.micro_batch} in {self.phase}"
        else:
            where += f" failed in {self.phase}"
        return f"{where}: {self.error}"


class RemoteFailure(Exception):
    """Another rank failed in this step (`failure` says where)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.describe())
        self.failure = failure


class PeerLost(RuntimeError):
    """A rank stopped answering: it died, or waited longer than the timeout."""


class Channel:
    """This rank's messages to and from the other ranks of its pipeline group, step by step."""

    def __init__(self, group: Any, ranks: Sequence[int], me: int, device: torch.device, timeout: float) -> None:
        self.group = group
        self.ranks = list(ranks)  # the global rank at each pipeline coordinate
        self.me = me  # this rank's pipeline coordinate
        self.device = device
        self.timeout = timeout
        self.step = 0
        self.kept: dict[int, dict[Hashable, Any]] = {}  # per peer, values read ahead of need
        self.sending: list[tuple[Any, list[torch.Tensor]]] = []  # works, and what they read
        self.failed_peers: dict[int, Failure] = {}
        self.bytes_sent = 0
        self.messages_sent = 0

    # -- sending ---------------------------------------------------------------------------
    def send(self, peer: int, key: Hashable, value: Any, kind: str = VALUE) -> None:
        tensors = [t.detach().contiguous() for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
        skeleton = tree_map_only(torch.Tensor, lambda t: _TensorMeta(tuple(t.shape), t.dtype, t.requires_grad), value)
        header = pickle.dumps((self.step, kind, key, skeleton))
        data = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device)
        length = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        for tensor in (length, data, *tensors):
            work = dist.isend(tensor, self.ranks[peer], group=self.group, tag=_TAG)
            self.sending.append((work, [tensor]))
            self.bytes_sent += tensor.numel() * tensor.element_size()
        self.messages_sent += 1

    def fail(self, failure: Failure) -> None:
        """Tell every peer this step failed here (best effort: a peer may be gone)."""
        for peer in self._peers():
            try:
                self.send(peer, ("failed",), failure, FAILED)
            except Exception:  # noqa: BLE001 - the peer is gone; its own peers hear of it
                pass

    # -- receiving ---------------------------------------------------------------------------
    def take(self, peer: int, key: Hashable, what: str = "") -> Any:
        """The value sent under `key` by `peer` in this step, reading ahead as needed."""
        kept = self.kept.setdefault(peer, {})
        while key not in kept:
            if peer in self.failed_peers:
                raise RemoteFailure(self.failed_peers[peer])
            step, kind, got, value = self._read(peer, what or str(key))
            if step != self.step:
                continue  # left over from a step that failed
            if kind == FAILED:
                self.failed_peers[peer] = value
                raise RemoteFailure(value)
            kept[got] = value
        return kept.pop(key)

    def _read(self, peer: int, what: str) -> tuple[int, str, Hashable, Any]:
        (length,) = self._receive([torch.empty(1, dtype=torch.int64, device=self.device)], peer, what)
        (data,) = self._receive([torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)], peer, what)
        step, kind, key, skeleton = pickle.loads(data.cpu().numpy().tobytes())
        leaves, spec = tree_flatten(skeleton)
        metas = [m for m in leaves if isinstance(m, _TensorMeta)]
        tensors = iter(self._receive([torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in metas], peer, what))
        leaves = [next(tensors).requires_grad_(m.requires_grad) if isinstance(m, _TensorMeta) else m for m in leaves]
        return step, kind, key, tree_unflatten(leaves, spec)

    def _receive(self, buffers: list[torch.Tensor], peer: int, what: str) -> list[torch.Tensor]:
        for buffer in buffers:
            try:
                work = dist.irecv(buffer, self.ranks[peer], group=self.group, tag=_TAG)
                assert work is not None  # this rank is in the group
                work.wait(timedelta(seconds=self.timeout))
            except RuntimeError as e:
                raise PeerLost(
                    f"rank {self.ranks[peer]} (pipeline stage rank {peer}) sent nothing this rank could read while it "
                    f"waited for {what} (timeout {self.timeout:g} s): {e}\nThat rank died or is stuck; see its own "
                    "output. A slow step needs a longer timeout: compile_pipeline(..., timeout=seconds)."
                ) from e
        return buffers

    # -- steps -------------------------------------------------------------------------------
    def begin(self) -> None:
        self.step += 1
        self.kept.clear()
        self.failed_peers.clear()

    def finish(self, payload: Any = None) -> dict[int, Any]:
        """End the step with every peer: send `done` (with `payload`) and read theirs; raises
        RemoteFailure if a peer failed. Returns each peer's payload."""
        for peer in self._peers():
            self.send(peer, ("done", self.me), payload, DONE)
        got = {peer: self.take(peer, ("done", peer), "the end of the step") for peer in self._peers()}
        self.wait_sent()
        return got

    def wait_sent(self) -> None:
        """Every send delivered (their tensors may be freed). After a failed step nothing is
        waited for: a peer reads what is left of it, and drops it, in the next step; until then
        the sends and their tensors are kept, as gloo drops a send whose work is freed."""
        for work, _ in self.sending:
            work.wait(timedelta(seconds=self.timeout))
        self.sending.clear()

    def _peers(self) -> list[int]:
        return [p for p in range(len(self.ranks)) if p != self.me]


class RankMailbox:
    """The mailbox of one step on one rank: values for this rank's stages wait in `local`; a value
    for a stage on another rank is sent there, and taken from the rank that makes it.

    `home(key)` is the coordinate of the rank a key's value is for, and `source(key)` of the rank
    that makes it (see fxpipe/step.py for the keys)."""

    def __init__(self, channel: Channel, local: Any, home: Any, source: Any) -> None:
        self.channel, self.local = channel, local
        self.home, self.source = home, source

    @property
    def aborted(self) -> bool:
        return bool(self.local.aborted)

    def put(self, key: Hashable, parcel: Any) -> None:
        home = self.home(key)
        if home == self.channel.me:
            self.local.put(key, parcel)
        else:
            self.channel.send(home, key, parcel.value)

    def take(self, keys: Sequence[Hashable]) -> list[Any]:
        sources = [self.source(key) for key in keys]
        local = iter(self.local.take([k for k, s in zip(keys, sources) if s == self.channel.me]))
        return [next(local) if s == self.channel.me else self.channel.take(s, k) for k, s in zip(keys, sources)]

    def abort(self) -> None:
        self.local.abort()
