"""Activation memory as a step holds it: the bytes autograd saves for each live micro-batch, per stage.

A micro-batch's bytes at a stage are counted from its forward (and recompute) until its backward
(B, or W) releases them; parameters that autograd saves are not activations and are not counted.
A tensor saved twice (or viewed alike) is counted once. On a CUDA device the allocator's own peak
over the step is read as well (everything the step allocated there, above what it started with).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch

from fxpipe.core.writes import storage_key


class ActivationMeter:
    def __init__(self, stages: int, parameters: Sequence[torch.Tensor], devices: Sequence[torch.device] = ()) -> None:
        self.excluded = {storage_key(p) for p in parameters}  # and every view of them
        self.cuda = sorted({d for d in devices if d.type == "cuda"}, key=str)
        self.base: dict[torch.device, int] = {}
        for device in self.cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.base[device] = torch.cuda.memory_allocated(device)
        self.seen: dict[tuple[int, int], set[tuple[int, int]]] = {}
        self.held: dict[tuple[int, int], int] = {}
        self.now = [0] * stages
        self.peak = [0] * stages
        self.lock = threading.Lock()

    def add(self, i: int, j: int, tensors: Sequence[Any]) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._count(i, j, t)

    def _count(self, i: int, j: int, t: torch.Tensor) -> None:
        if t.device.type == "meta" or storage_key(t) in self.excluded:
            return
        size = t.numel() * t.element_size()
        key = (t.data_ptr(), size)  # a view counts what it spans: micro-batches are views of the batch
        with self.lock:
            seen = self.seen.setdefault((i, j), set())
            if key in seen:
                return
            seen.add(key)
            self.held[(i, j)] = self.held.get((i, j), 0) + size
            self.now[j] += size
            self.peak[j] = max(self.peak[j], self.now[j])

    @contextmanager
    def saving(self, i: int, j: int) -> Iterator[None]:
        """Count what autograd saves while the block runs as micro-batch i's at stage j."""

        def pack(t: torch.Tensor) -> torch.Tensor:
            self._count(i, j, t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield

    def device_peaks(self) -> dict[str, int]:
        """Per CUDA device, the most bytes the step had allocated there at once, above its start."""
        peaks = {}
        for device in self.cuda:
            torch.cuda.synchronize(device)
            peaks[str(device)] = torch.cuda.max_memory_allocated(device) - self.base[device]
        return peaks

    def release(self, i: int, j: int) -> None:
        with self.lock:
            self.now[j] -= self.held.pop((i, j), 0)
            self.seen.pop((i, j), None)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
