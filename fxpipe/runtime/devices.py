"""Moving values between stage devices: copy streams on CUDA, plain copies on the CPU.

A stage computes on its device's current stream. A tensor bound for another device is copied on
a copy stream, after the producer's stream, and the consumer's stream waits for the copy:

    producer stream  ──[compute]──●                      ● event recorded after compute
    copy stream                   └─wait─[copy]──◆       ◆ event recorded after the copy
    consumer stream                              └─wait─[compute]

so compute on both devices overlaps with the copy. On the CPU every step is synchronous and a
value bound for the same device is not copied at all. Values wait in a `Mailbox` until the task
that receives them takes them.
"""
from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Hashable, Optional, Sequence

import torch

from fxpipe.core.microbatch import map_tensors

_copy_streams: dict[torch.device, "torch.cuda.Stream"] = {}
_streams_lock = threading.Lock()


def copy_stream(device: torch.device) -> "torch.cuda.Stream":
    """The one copy stream of a CUDA device, made on first use."""
    with _streams_lock:
        if device not in _copy_streams:
            _copy_streams[device] = torch.cuda.Stream(device)
        return _copy_streams[device]


def on_device(device: torch.device) -> ContextManager[Any]:
    """Make `device` current for the calling thread (CUDA); nothing to do on the CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


class Parcel:
    """A value on its way to a device; `open()` makes it safe to use there."""

    __slots__ = ("value", "device", "events")

    def __init__(self, value: Any, device: torch.device, events: list[Any]) -> None:
        self.value, self.device, self.events = value, device, events

    def open(self) -> Any:
        for event in self.events:
            if self.device.type != "cuda":
                event.synchronize()  # a copy to host memory: wait for it before the CPU reads it
                continue
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            map_tensors(lambda t: t.record_stream(stream), self.value)
        return self.value


def send(value: Any, device: torch.device, requires_grad: Optional[Callable[[torch.Tensor], bool]] = None) -> Parcel:
    """Copy every tensor of `value` to `device` as a fresh autograd leaf.

    `requires_grad(t)` says whether the leaf made from `t` requires grad (default: never).
    """
    if isinstance(value, torch.Tensor) and value.device == device:  # the common case: no copy, no event
        out = value.detach()
        return Parcel(out.requires_grad_() if requires_grad is not None and requires_grad(value) else out, device, [])
    if value is None:
        return Parcel(None, device, [])
    streams: dict[torch.device, Any] = {}

    def move(t: torch.Tensor) -> torch.Tensor:
        out = t.detach() if t.device == device else _copy(t, device, streams)
        return out.requires_grad_() if requires_grad is not None and requires_grad(t) else out

    with torch.no_grad():
        result = map_tensors(move, value)
    return Parcel(result, device, [stream.record_event() for stream in streams.values()])


def _copy(t: torch.Tensor, device: torch.device, streams: dict[torch.device, Any]) -> torch.Tensor:
    if t.device.type != "cuda" and device.type != "cuda":
        return t.to(device)
    side = device if device.type == "cuda" else t.device
    stream = streams.setdefault(side, copy_stream(side))
    if t.is_cuda:
        stream.wait_stream(torch.cuda.current_stream(t.device))
    with torch.cuda.stream(stream):
        out = t.to(device, non_blocking=True)
    if t.is_cuda:
        t.record_stream(stream)  # the source must outlive the copy, whichever stream frees it
    return out


class Aborted(Exception):
    """Another task failed, or the caller gave up; this one stops waiting."""


class Mailbox:
    """Parcels keyed by (direction, stage, micro-batch, value, ...); `take` waits for its keys.

    A put wakes only the taker waiting for its key: with one condition for all, every put would
    wake every waiting worker (with eight stages, seven threads woken for nothing, each taking
    the interpreter lock on the critical path)."""

    def __init__(self, timeout: Optional[float] = None) -> None:
        self.timeout = timeout  # seconds `take` waits before it reports a hang; None: forever
        self.items: dict[Hashable, Parcel] = {}
        self.lock = threading.Lock()
        self.waiting: dict[Hashable, list[threading.Event]] = {}  # per key not yet put, its takers
        self.aborted = False

    def put(self, key: Hashable, parcel: Parcel) -> None:
        with self.lock:
            self.items[key] = parcel
            takers = self.waiting.pop(key, ())
        for taker in takers:
            taker.set()

    def take(self, keys: Sequence[Hashable]) -> list[Any]:
        return [parcel.value if not parcel.events else parcel.open() for parcel in self._taken(keys)]

    def _taken(self, keys: Sequence[Hashable]) -> list[Parcel]:
        with self.lock:
            if self.aborted:
                raise Aborted()
            items = self.items
            if len(keys) == 1 and keys[0] in items:  # no wait, one value: the common case
                return [items.pop(keys[0])]
            missing = self._missing(keys)
            if not missing:
                return [items.pop(k) for k in keys]
            woken = threading.Event()
            for key in missing:
                self.waiting.setdefault(key, []).append(woken)
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            arrived = woken.wait(left)
            with self.lock:
                woken.clear()  # a put after this sees the key missing no more, or wakes it again
                missing = self._missing(keys)
                if not missing:
                    return [self.items.pop(k) for k in keys]
                if not arrived:
                    for key in missing:
                        self.waiting[key].remove(woken)
                    raise TimeoutError(f"waited {self.timeout} s for {missing}: the pipeline is stuck")

    def _missing(self, keys: Sequence[Hashable]) -> list[Hashable]:
        if self.aborted:
            raise Aborted()
        return [k for k in keys if k not in self.items]

    def abort(self) -> None:
        with self.lock:
            self.aborted = True
            self.items.clear()
            takers = [taker for waiting in self.waiting.values() for taker in waiting]
            self.waiting.clear()
        for taker in takers:
            taker.set()
