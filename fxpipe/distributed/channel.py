"""Values between processes: each rank's messages to another, in the order it sends them.

A rank sends a value as one message on `torch.distributed` point-to-point ops (fxpipe/distributed/wire.py:
a frame with the header and the small tensors, then each large tensor), with every tensor's
shape and dtype, so a step may change the batch size or the sequence length. Sends are
asynchronous. A rank receives on its own thread, when an action needs a value, reading the
sender's messages in the order they were sent and keeping those it does not need yet:

    rank 0 sends   [F0 act]  [F1 act]  [F1 skip]
    rank 1 takes   F1 skip ──▶ reads F0 act, F1 act (kept), F1 skip (returned)

so NCCL, which ignores tags, sees each pair's messages in one order too. A rank that fails
sends every peer a failure message in place of what it still owed: a peer waiting on it raises,
names the failure, and passes it on. A rank that dies closes its connections, and its peers'
reads fail at once; a read that waits longer than `timeout` fails. At the end of a step every
rank sends every other a `done` message and reads theirs: no rank leaves a step another failed.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Hashable, Optional, Sequence

import torch
import torch.distributed as dist

from fxpipe.core.failures import Failure, PeerLost, RemoteFailure
from fxpipe.distributed.wire import FRAME, FrameFull, Message, decode, encode, frame_of, open_frame

VALUE, FAILED, DONE = "value", "failed", "done"
_channels = itertools.count(1)  # each pipeline's messages under a tag of their own
_CALLS = 0  # the tag every pipeline announces its calls under, on the groups pipelines of a mesh share
# The receive of each peer's next announcement, posted (on gloo) as the last one is read, by
# (group, the peer's rank): whichever pipeline of the mesh is called next reads it. Kept with
# its group, whose id then cannot be reused.
_announcements: dict[tuple[int, int], tuple[Any, torch.Tensor, Any]] = {}
# The sends and posted receives of channels that are gone (their pipeline was dropped after a
# failed step, say), kept for the life of the process: gloo drops a send whose work is freed,
# and bytes that arrive for a freed receive stop every later message on that connection, the
# other pipelines' too. A few frames per dropped pipeline.
_left_over: list[tuple[list[Any], dict[int, Any]]] = []


@dataclass
class _Posted:
    """Receives posted for a peer's next message: its frame, and the extras it is expected to have."""

    frame: torch.Tensor
    frame_work: Any
    parts: list[tuple[torch.Tensor, Any]]


class Channel:
    """This rank's messages to and from the other ranks of its pipeline group, step by step.

    A receive is posted before its message is sent, wherever the receiver can know its size:
    gloo then moves the data as it is sent, while both ranks compute, instead of when the
    receiver asks:

        rank 1 reads message k-1 ──▶ posts k: [frame][extras sized as k was in the step before]
        rank 0 sends message k   ──▶ gloo fills the posted buffers (rank 1 computes meanwhile)
        rank 1 takes message k   ──▶ in hand

    A frame has a fixed size. The extras of the k-th message of a step are
    expected to have the sizes of the k-th message of the step before (the schedule repeats);
    after reading a message the receiver posts the next one's frame and expected extras. A
    sender whose message differs from what the peer expects first sends fillers of the expected
    sizes, and the envelope says so. After a failed step neither side expects anything. (On
    gloo; NCCL runs a posted receive as a kernel that holds its stream, so there every receive
    is posted when its message is read.) Each direction of a pair of ranks has a group of its
    own, `directions`: fxpipe/distributed/ranks.py says why.

    Every rank makes its pipelines' channels in the same order (compile_pipeline runs on every
    rank), so the n-th channel of each rank uses the same tag, and one pipeline's posted
    receives never take another's messages.
    """

    def __init__(
        self, group: Any, ranks: Sequence[int], me: int, device: torch.device, timeout: float,
        directions: Optional[dict[tuple[int, int], Any]] = None,
    ) -> None:
        self.ranks = list(ranks)  # the global rank at each pipeline coordinate
        self.me = me  # this rank's pipeline coordinate
        self.device = device
        self.timeout = timeout
        self.tag = next(_channels)
        # Each peer's group and rank in it, for sending to it and for receiving from it (the
        # group of that direction, `directions[(from, to)]`, if any, else `group`): the process
        # group's own send and recv, without `dist.isend`'s checks on every message.
        directions = directions or {}
        self.to = {p: _route(directions.get((me, p), group), self.ranks[p]) for p in self._peers()}
        self.from_ = {p: _route(directions.get((p, me), group), self.ranks[p]) for p in self._peers()}
        self.early = dist.get_backend(group) == "gloo"  # post receives before their messages
        self.step = 0
        self.kept: dict[int, dict[Hashable, Any]] = {}  # per peer, values read ahead of need
        self.sending: list[tuple[Any, torch.Tensor]] = []  # works, and the bytes they read
        # One message at a time: a loop of overlapping steps (2BW) sends from its stage thread,
        # and, when it fails, from the caller's, and a message is several sends in a row.
        self.sending_lock = threading.Lock()
        self.failed_peers: dict[int, Failure] = {}
        self.failed = False  # this step failed here: expect nothing in the next
        self.posted: dict[int, _Posted] = {}
        # Per peer, the extras' sizes of each message of this step, and of the step before.
        self.sent: dict[int, list[list[int]]] = {}
        self.sent_before: dict[int, list[list[int]]] = {}
        self.read: dict[int, list[list[int]]] = {}
        self.read_before: dict[int, list[list[int]]] = {}
        weakref.finalize(self, _left_over.append, (self.sending, self.posted))

    # -- sending ---------------------------------------------------------------------------
    def send(self, peer: int, key: Hashable, value: Any, kind: str = VALUE) -> None:
        with self.sending_lock:
            self._send(peer, key, value, kind)

    def _send(self, peer: int, key: Hashable, value: Any, kind: str) -> None:
        sent = self.sent.setdefault(peer, [])
        expected = _at(self.sent_before.get(peer, []), len(sent)) if self.early else []
        message, frame, sizes = self._framed(kind, key, value, [])
        fillers = [] if sizes == expected else expected
        if fillers:
            message, frame, sizes = self._framed(kind, key, value, fillers)
        sent.append(sizes)
        header = [torch.frombuffer(bytearray(message.header), dtype=torch.uint8)] if len(sizes) > len(message.extras) else []
        for part in [frame, *(torch.empty(n, dtype=torch.uint8) for n in fillers), *header, *message.extras]:
            part = part.to(self.device)
            group, rank = self.to[peer]
            work = group.send([part], rank, self.tag)
            self.sending.append((work, part))

    def _framed(self, kind: str, key: Hashable, value: Any, fillers: list[int]) -> tuple[Message, torch.Tensor, list[int]]:
        """The message and its frame: small tensors in the frame's body, unless their sizes with
        the others' leave it no room."""
        message = encode(self.step, kind, key, value)
        try:
            return (message, *frame_of(message, fillers))
        except FrameFull:
            message = encode(self.step, kind, key, value, body=False)
            return (message, *frame_of(message, fillers))

    def fail(self, failure: Failure) -> None:
        """Tell every peer this step failed here (best effort: a peer may be gone)."""
        for peer in self._peers():
            try:
                self.send(peer, ("failed",), failure, FAILED)
            except Exception:  # noqa: BLE001 - the peer is gone; its own peers hear of it
                pass
        self.failed = True

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
        posted = self.posted.pop(peer, None) or self._post(peer, [])
        frame = self._wait(posted.frame, posted.frame_work, peer, what).cpu()
        step, fillers, sizes, header, body = open_frame(frame)
        incoming = [*fillers, *sizes]
        early = [buffer.numel() for buffer, _ in posted.parts]
        if early != incoming[: len(early)]:
            raise RuntimeError(f"messages from rank {self.ranks[peer]} are out of step: posted {early}, sent {incoming}")
        parts = [self._wait(buffer, work, peer, what) for buffer, work in posted.parts]
        parts += [self._wait(*self._receive(peer, n), peer, what) for n in incoming[len(early) :]]
        extras = parts[len(fillers) :]
        if header is None:
            header, extras = extras[0].cpu().numpy().tobytes(), extras[1:]
        kind, key, value = decode(header, frame, body, extras, self.device)
        current = step == self.step and kind != FAILED
        read = self.read.setdefault(peer, [])
        if current:
            read.append(sizes)
        # The next message: the next of this step, or after `done` the first of the next step.
        after = (read if kind == DONE else self.read_before.get(peer, [])) if current else []
        if self.early:
            self.posted[peer] = self._post(peer, _at(after, 0 if kind == DONE else len(read)))
        return step, kind, key, value

    def _post(self, peer: int, sizes: list[int]) -> _Posted:
        frame, work = self._receive(peer, FRAME)
        return _Posted(frame, work, [self._receive(peer, n) for n in sizes])

    def _receive(self, peer: int, nbytes: int) -> tuple[torch.Tensor, Any]:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        group, rank = self.from_[peer]
        return buffer, group.recv([buffer], rank, self.tag)

    def _wait(self, buffer: torch.Tensor, work: Any, peer: int, what: str) -> torch.Tensor:
        try:
            work.wait(timedelta(seconds=self.timeout))
        except RuntimeError as e:
            raise PeerLost(
                f"rank {self.ranks[peer]} (pipeline stage rank {peer}) sent nothing this rank could read while it "
                f"waited for {what} (timeout {self.timeout:g} s): {e}\nThat rank died or is stuck (see its own "
                "output), or it called another pipeline: every rank must call its pipelines in the same order. A "
                "slow step needs a longer timeout: compile_pipeline(..., timeout=seconds)."
            ) from e
        return buffer

    # -- steps -------------------------------------------------------------------------------
    def begin(self) -> None:
        """Start a step: after `announce`, so that a call refused there leaves no trace."""
        self.announce()
        self.step += 1
        self.kept.clear()
        self.failed_peers.clear()
        self.sent_before, self.read_before = ({}, {}) if self.failed else (self.sent, self.read)
        self.sent, self.read = {}, {}
        self.failed = False

    def announce(self) -> None:
        """Tell every peer which pipeline this rank calls, and read which each calls, under a tag
        all pipelines of the mesh share: a rank that calls another pipeline (two pipelines called
        in another order on each rank) is found at once, where each would wait on its own tag
        for the whole timeout. Every rank raises, and no pipeline has a message left waiting."""
        mine = torch.tensor([self.tag], dtype=torch.int64, device=self.device)
        sending: list[Any] = [self.to[p][0].send([mine], self.to[p][1], _CALLS) for p in self._peers()]
        called = {}
        for peer in self._peers():
            group = self.from_[peer][0]
            posted = _announcements.pop((id(group), self.ranks[peer]), None)
            theirs, work = posted[1:] if posted is not None else self._announcement(peer)
            called[peer] = int(self._wait(theirs, work, peer, "the pipeline it calls").item())
            if self.early:  # the next call's, posted now: its bytes move as they are sent
                _announcements[(id(group), self.ranks[peer])] = (group, *self._announcement(peer))
        for work in sending:
            work.wait(timedelta(seconds=self.timeout))
        others = {peer: tag for peer, tag in called.items() if tag != self.tag}
        if others:
            raise RuntimeError(
                f"the ranks called different pipelines: this rank (rank {self.ranks[self.me]}) called the pipeline "
                f"compiled {_nth(self.tag)} across processes in it, and "
                + ", ".join(f"rank {self.ranks[p]} the one compiled {_nth(tag)}" for p, tag in sorted(others.items()))
                + ".\nHow to fix: call the pipelines in the same order on every rank (every rank compiles them in one "
                "order, and calls each at once)."
            )

    def _announcement(self, peer: int) -> tuple[torch.Tensor, Any]:
        theirs = torch.empty(1, dtype=torch.int64, device=self.device)
        group, rank = self.from_[peer]
        return theirs, group.recv([theirs], rank, _CALLS)

    def exchange(self, what: str, value: Any) -> dict[int, Any]:
        """Send `value` to every peer and read theirs: each peer's value, by coordinate; raises
        RemoteFailure if a peer failed instead."""
        for peer in self._peers():
            self.send(peer, (what, self.me), value)
        return {peer: self.take(peer, (what, peer), f"the {what} of rank {self.ranks[peer]}") for peer in self._peers()}

    def finish(self, payload: Any = None) -> dict[int, Any]:
        """End the step with every peer: send `done` (with `payload`) and read theirs; raises
        RemoteFailure if a peer failed. Returns each peer's payload."""
        for peer in self._peers():
            self.send(peer, ("done", self.me), payload, DONE)
        got = {peer: self.take(peer, ("done", peer), "the end of the step") for peer in self._peers()}
        self.wait_sent()
        return got

    def wait_sent(self) -> None:
        """Every send delivered (their bytes may be freed). After a failed step nothing is
        waited for: a peer reads what is left of it, and drops it, in the next step; until then
        the sends and their bytes are kept, as gloo drops a send whose work is freed."""
        for work, _ in self.sending:
            work.wait(timedelta(seconds=self.timeout))
        self.sending.clear()

    def _peers(self) -> list[int]:
        return [p for p in range(len(self.ranks)) if p != self.me]


def _nth(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _route(group: Any, global_rank: int) -> tuple[Any, int]:
    return group, dist.get_group_rank(group, global_rank)


def _at(history: list[list[int]], index: int) -> list[int]:
    return history[index] if index < len(history) else []


class RankMailbox:
    """The mailbox of one step on one rank: values for this rank's stages wait in `local`; a value
    for a stage on another rank is sent there, and taken from the rank that makes it.

    `home(key)` is the coordinate of the rank a key's value is for, and `source(key)` of the rank
    that makes it (see fxpipe/runtime/step.py for the keys). In a loop whose steps overlap, the
    messages of several batches are in flight at once: each goes under `(batch, key)`."""

    def __init__(self, channel: Channel, local: Any, home: Any, source: Any, batch: Optional[int] = None) -> None:
        self.channel, self.local = channel, local
        self.home, self.source = home, source
        self.batch = batch

    def _sent_as(self, key: Hashable) -> Hashable:
        return key if self.batch is None else (self.batch, key)

    @property
    def aborted(self) -> bool:
        return bool(self.local.aborted)

    def put(self, key: Hashable, parcel: Any) -> None:
        home = self.home(key)
        if home == self.channel.me:
            self.local.put(key, parcel)
        else:
            self.channel.send(home, self._sent_as(key), parcel.value)

    def take(self, keys: Sequence[Hashable]) -> list[Any]:
        sources = [self.source(key) for key in keys]
        local = iter(self.local.take([k for k, s in zip(keys, sources) if s == self.channel.me]))
        return [next(local) if s == self.channel.me else self.channel.take(s, self._sent_as(k)) for k, s in zip(keys, sources)]

    def abort(self) -> None:
        self.local.abort()
