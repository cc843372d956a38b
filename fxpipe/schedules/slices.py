"""Slices of a sequence: how a call's sequence is cut (SliceSpec), and the lengths that minimise a pipeline's time over it, by a dynamic program over predicted slice times.

Slices flow through `stages` stages one after another. With t(i) the time of slice i on a stage
(later slices attend to more positions, so the same length costs more there), the last slice
leaves the last stage after

    sum_i t(i) + (stages - 1) * max_i t(i)

    stage 0 |s0|s1 |s2  |
    stage 1    |s0|s1 |s2  |          the slowest slice paces every stage after the first
    stage 2       |s0|s1 |s2  |

For each bound M on the slowest slice (every time a slice could take, smallest first), the
program finds the cheapest cut whose slices all take at most M; the best M wins. A bound whose
`(stages - 1) * M` plus the least sum of any cut exceeds the best total found ends the search.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional, Union

import numpy as np

# Seconds of one slice on one stage, from its length and the positions before it.
SliceTime = Callable[[int, int], float]


def slice_time(per_position: float, per_pair: float, per_slice: float) -> SliceTime:
    """A slice of `length` positions after `before` ones: position-wise work per position,
    attention's per pair of a query and a key it scores (each query against every key up to the
    slice's last: the masked ones are computed too), and a fixed cost per slice."""

    def time(length: int, before: int) -> float:
        return per_position * length + per_pair * length * (before + length) + per_slice

    return time


def pipeline_time(lengths: list[int], stages: int, time: SliceTime) -> float:
    """The predicted time of `lengths` through `stages` stages (module docstring)."""
    starts = np.cumsum([0, *lengths[:-1]])
    times = [time(length, int(start)) for length, start in zip(lengths, starts)]
    return float(sum(times) + (stages - 1) * max(times))


def best_slices(length: int, stages: int, time: SliceTime, granularity: int = 1, count: Optional[int] = None) -> list[int]:
    """The slice lengths (multiples of `granularity`, but the last) of `length` positions whose
    predicted pipeline time is least; of exactly `count` slices, where given."""
    if length < 1 or stages < 1 or granularity < 1:
        raise ValueError(f"best_slices needs a length, stages and a granularity of 1 or more, not {length}, {stages}, {granularity}")
    points = list(range(0, length, granularity)) + [length]  # where a slice may start or end
    n = len(points) - 1
    if count is not None and not 1 <= count <= n:
        raise ValueError(f"best_slices cannot cut {length} positions into {count} slices at a granularity of {granularity}")
    # cost[i, j]: the slice from points[i] to points[j] (j > i), inf elsewhere.
    cost = np.full((n + 1, n + 1), np.inf)
    for i in range(n):
        for j in range(i + 1, n + 1):
            cost[i, j] = time(points[j] - points[i], points[i])
    best_total, best_cut = np.inf, [0, n]
    floor, _ = _cheapest_under(cost, np.inf, count)  # no bound sums to less
    for bound in np.unique(cost[np.isfinite(cost)]):
        if floor + (stages - 1) * bound >= best_total:
            break
        total, cut = _cheapest_under(cost, bound, count)
        if total + (stages - 1) * bound < best_total:
            best_total, best_cut = total + (stages - 1) * bound, cut
    return [points[j] - points[i] for i, j in zip(best_cut, best_cut[1:])]


def _cheapest_under(cost: np.ndarray, bound: float, count: Optional[int] = None) -> tuple[float, list[int]]:
    """The least sum of slice costs from point 0 to the last with every slice at most `bound`
    (and, given `count`, in exactly that many slices), and the points it cuts at; (inf, []) where
    no cut keeps to the bound."""
    n = cost.shape[0] - 1
    allowed = np.where(cost <= bound, cost, np.inf)
    # best[k, j]: the least sum from point 0 to point j in k slices (any number: one row).
    rows = 1 if count is None else count + 1
    best = np.full((rows, n + 1), np.inf)
    came = np.zeros((rows, n + 1), dtype=int)
    best[0, 0] = 0.0
    for k in range(1 if count is not None else 0, rows):
        before = best[k - 1] if count is not None else best[0]
        for j in range(1, n + 1):
            through = before[:j] + allowed[:j, j]
            came[k, j] = int(np.argmin(through))
            best[k, j] = through[came[k, j]]
    k = rows - 1
    if not np.isfinite(best[k, n]):
        return np.inf, []
    cut, j = [n], n
    while j > 0:
        j = int(came[k, j])
        cut.append(j)
        k -= 1 if count is not None else 0
    return float(best[rows - 1, n]), cut[::-1]


@dataclass(frozen=True)
class SliceSpec:
    """How a pipeline cuts each micro-batch into slices of its sequence: `chunks` (a count, cut
    as evenly as can be, or the lengths), the sequence's dim in each input that holds it and in
    each leaf of each output value (by name; None: a leaf without it), and how many values
    attention carries from slice to slice."""

    chunks: Union[int, str, tuple[int, ...]]
    inputs: dict[str, int]
    outputs: dict[str, tuple[Optional[int], ...]]
    carries: int
    dim: int = 1  # sequence_dim: where a train step's target holds the sequence
    # With chunks='auto': seconds per position, per pair of positions scored and per slice on
    # each stage, and the stages, from which `best_slices` cuts each call's sequence.
    auto: Optional[tuple[float, float, float, int]] = None
    # With chunks='auto': the count of slices every sequence is cut into, where it is fixed (a
    # loop whose steps overlap fixes the count its first batch was cut into); None: any.
    fixed_count: Optional[int] = None

    def count(self) -> Optional[int]:
        """How many slices every sequence is cut into; None for 'auto' with no fixed count,
        which cuts each length its own way."""
        if self.chunks == "auto":
            return self.fixed_count
        return self.chunks if isinstance(self.chunks, int) else len(self.chunks)

    def lengths(self, length: int) -> list[int]:
        """The slice lengths of a sequence of `length` positions."""
        if self.chunks == "auto":
            if self.auto is None:  # before the cost model is known: any cut checks the rewrite
                return slice_lengths(length, self.fixed_count or min(2, length))
            if self.fixed_count is not None and self.fixed_count > length:
                raise ValueError(
                    f"this loop cuts every sequence into {self.fixed_count} slices (sequence_chunks='auto' cut its first "
                    f"batch so), and this call's sequence has {length} positions.\nHow to fix: give every batch of the "
                    "loop sequences of one length, or sequence_chunks as a number of slices."
                )
            return list(_auto_lengths(self.auto, length, self.fixed_count))
        if isinstance(self.chunks, int):
            return slice_lengths(length, self.chunks)
        assert not isinstance(self.chunks, str)
        if sum(self.chunks) != length:
            raise ValueError(
                f"sequence_chunks={list(self.chunks)} cut {sum(self.chunks)} positions, and this call's sequence "
                f"has {length}.\nHow to fix: call it with sequences of {sum(self.chunks)} positions, or compile with "
                "sequence_chunks as lengths that sum to this call's, or as a number of slices (which cuts any length)."
            )
        return list(self.chunks)


@functools.lru_cache(maxsize=64)
def _auto_lengths(auto: tuple[float, float, float, int], length: int, count: Optional[int] = None) -> tuple[int, ...]:
    """The best cut of `length` positions for these costs (SliceSpec.auto), in `count` slices
    where given, once per length: the program takes a fraction of a second, and a call's
    sequence is cut on every call."""
    per_position, per_pair, per_slice, stages = auto
    granularity = max(1, min(length // 64, length // (count or 1)))  # fine enough for `count` slices
    return tuple(best_slices(length, stages, slice_time(per_position, per_pair, per_slice), granularity, count))


def slice_lengths(length: int, chunks: int) -> list[int]:
    """`length` positions in `chunks` slices as even as can be, the longer first."""
    if not 1 <= chunks <= length:
        raise ValueError(f"sequence_chunks={chunks} cannot cut a sequence of {length} positions: give 1 to {length}")
    base, extra = divmod(length, chunks)
    return [base + (i < extra) for i in range(chunks)]
