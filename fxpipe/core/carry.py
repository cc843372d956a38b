"""What a graph rewritten for slices of a sequence calls: the slice's offset, the keys and values carried from earlier slices, and the causal mask of a slice.

A stage runs one slice inside `in_slice(state)`, on its own thread: the graph reads where the
slice starts (`slice_offset`), and each value attention reads as keys gets those of the slices
before it (`with_carry`), which the runtime hands from one slice's task to the next. Outside a
slice (the whole sequence: compiling's runs, a call in one slice) the offset is 0 and nothing is
carried.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch


@dataclass
class SliceState:
    """One slice's task: where it starts, the carries it reads (by index; none for the first
    slice) and those it makes (keys and values up to its last position)."""

    offset: int = 0
    carried: dict[int, torch.Tensor] = field(default_factory=dict)
    made: dict[int, torch.Tensor] = field(default_factory=dict)


_local = threading.local()


def _current() -> Optional[SliceState]:
    return getattr(_local, "state", None)


@contextmanager
def in_slice(state: SliceState) -> Iterator[SliceState]:
    """Run a slice's stage within this block, on this thread."""
    before = _current()
    _local.state = state
    try:
        yield state
    finally:
        _local.state = before


def slice_offset() -> int:
    """Where the slice being run starts in its sequence (0 outside a slice)."""
    state = _current()
    return state.offset if state is not None else 0


def with_carry(index: int, value: torch.Tensor, dim: int) -> torch.Tensor:
    """`value`, this slice's keys (or values), after those of the slices before it (carry
    `index`, along `dim`): every position up to the slice's last. Kept as the carry made."""
    state = _current()
    if state is None:
        return value
    carry = state.carried.get(index)
    out = value if carry is None else torch.cat([carry, value], dim)
    state.made[index] = out
    return out


def causal_mask(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Which keys each query of a slice may read (True), along the last two dims of attention's
    scores: the keys are every position up to the slice's last, the queries the slice's own, its
    last positions. Causal attention's mask, aligned to the lower right."""
    length, seen = queries.size(-2), keys.size(-2)
    return torch.ones(length, seen, dtype=torch.bool, device=queries.device).tril(seen - length)
