"""The cost of a cut: each stage's time and memory, and the pipeline time a partition minimises.

A stage is a run [s, e) of the linear order. Its time is its nodes' time plus the time to receive
what crosses into it: every value made before s and used in [s, e), activation or stash/pop alike,
once (bytes / bandwidth). Its memory is its parameters (times `param_scale`, for gradients and
optimizer state) plus the activations it holds in flight for the chosen chunks and checkpointing:
as many micro-batches as the schedule holds at once on that stage (`in_flight`), or GPipe's count.
The pipeline's time is `sum(t_i) + (chunks - 1) * max(t_i)` (fill and drain, then the slowest
stage sets the pace); of a stage DAG, the longest path's sum in place of the whole sum.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch.fx as fx


@dataclass
class CrossingValue:
    """A value by the positions that make and use it (-1: the caller's input)."""

    producer: int
    consumers: list[int]
    nbytes: int


@dataclass
class CutModel:
    """Per-position costs of a linear order, and the values that cross between positions."""

    times: list[float]
    params: list[float]
    activations: list[float]
    values: list[CrossingValue]
    bandwidth: Optional[float] = None  # bytes per unit of time; None: receiving is free
    chunks: int = 1
    checkpointed: int = 0  # how many micro-batches drop their activations
    param_scale: float = 1.0
    names: Optional[list[str]] = None  # each position's node, for messages
    # Per stage index, the micro-batches it holds at its peak under the schedule: (whole, held at
    # all; see fxpipe/compiler/in_flight.py). None: GPipe's count on every stage.
    in_flight: Optional[list[tuple[float, float]]] = None
    # Whether `times` are bytes of balance='memory', whose activations weigh as the stage holds them.
    weighs_memory: bool = False
    prefix_times: list[float] = field(init=False, repr=False)
    prefix_params: list[float] = field(init=False, repr=False)
    prefix_activations: list[float] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.prefix_times = [0.0, *itertools.accumulate(self.times)]
        self.prefix_params = [0.0, *itertools.accumulate(self.params)]
        self.prefix_activations = [0.0, *itertools.accumulate(self.activations)]
        self._received: dict[int, list[float]] = {}

    def __len__(self) -> int:
        return len(self.times)

    def received(self, s: int, e: int) -> float:
        """Bytes that a stage [s, e) receives: values made before s and used in [s, e)."""
        return self.received_from(s)[e]

    def received_from(self, s: int) -> list[float]:
        """`received(s, e)` for every end e (cached per start)."""
        if s not in self._received:
            row = [0.0] * (len(self) + 1)
            for value in self.values:
                if value.producer < s:
                    i = bisect.bisect_left(value.consumers, s)
                    if i < len(value.consumers) and value.consumers[i] < len(self):
                        row[value.consumers[i] + 1] += value.nbytes
            self._received[s] = list(itertools.accumulate(row))
        return self._received[s]

    def compute(self, s: int, e: int) -> float:
        return self.prefix_times[e] - self.prefix_times[s]

    def time(self, s: int, e: int) -> float:
        if self.bandwidth is None:
            return self.compute(s, e)
        return self.compute(s, e) + self.received(s, e) / self.bandwidth

    def kept(self, stage: Optional[int] = None) -> tuple[float, float]:
        """The micro-batches stage `stage` holds at its peak: whole, and at all (their inputs).
        GPipe's count without the schedule's: every micro-batch's inputs, and the full activations
        of those not checkpointed and of one being recomputed. No stage given: the fewest any
        stage holds (what a node needs wherever it goes)."""
        if self.in_flight is None:
            return float(kept_micro_batches(self.chunks, self.checkpointed)), float(self.chunks)
        if stage is None:
            return min(whole for whole, _ in self.in_flight), min(held for _, held in self.in_flight)
        return self.in_flight[stage]

    def memory(self, s: int, e: int, stage: Optional[int] = None) -> float:
        """Parameters (scaled), plus the inputs and the full activations of the micro-batches the
        stage holds at its peak (`kept`)."""
        params = self.param_scale * (self.prefix_params[e] - self.prefix_params[s])
        whole, held = self.kept(stage)
        per_micro_batch = (self.prefix_activations[e] - self.prefix_activations[s]) / self.chunks
        return params + self.received(s, e) * held / self.chunks + whole * per_micro_batch

    def stage_time(self, s: int, e: int, stage: Optional[int] = None) -> float:
        """`time`, for the stage at index `stage`: under balance='memory' with the schedule's
        counts, its parameters and the activations that stage holds (no stage given: the least
        any stage would weigh, a bound for the search)."""
        if not self.by_stage():
            return self.time(s, e)
        whole, _ = self.kept(stage)
        params = self.param_scale * (self.prefix_params[e] - self.prefix_params[s])
        return params + whole / self.chunks * (self.prefix_activations[e] - self.prefix_activations[s])

    def by_stage(self) -> bool:
        """Whether a stage's time depends on its index (the memory it holds under the schedule)."""
        return self.weighs_memory and self.in_flight is not None

    def pipeline_time(self, cuts: Sequence[int]) -> float:
        times = self.stage_times(cuts)
        return sum(times) + (self.chunks - 1) * max(times)

    def stage_times(self, cuts: Sequence[int]) -> list[float]:
        bounds = [0, *cuts, len(self)]
        return [self.stage_time(a, b, k) for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]

    def additive(self) -> bool:
        """Whether a stage's time is the plain sum of its nodes' times, whichever its index
        (nothing to receive, no count by stage)."""
        return self.bandwidth is None and not self.by_stage()


def dag_time(times: Sequence[float], links: Iterable[tuple[int, int]], chunks: int) -> float:
    """The pipeline time of stages that form a DAG (`links`: producer, consumer pairs, from a
    stage to a later one): the longest path's time, the fill and drain of its micro-batches,
    plus `(chunks - 1) * max(t_i)`, the slowest stage's pace. A chain gives `pipeline_time`."""
    producers: dict[int, list[int]] = {}
    for src, dst in links:
        producers.setdefault(dst, []).append(src)
    longest: list[float] = []
    for k, t in enumerate(times):
        longest.append(t + max((longest[p] for p in producers.get(k, ())), default=0.0))
    return max(longest, default=0.0) + (chunks - 1) * max(times, default=0.0)


def kept_micro_batches(chunks: int, checkpointed: int) -> int:
    """How many micro-batches' activations a stage holds at its peak under GPipe: those not
    checkpointed, and one being recomputed."""
    return chunks - checkpointed + (1 if checkpointed else 0)


def crossing_values(order: Sequence[fx.Node]) -> list[CrossingValue]:
    """Every value a node of `order` (or the caller) makes and some later node of `order` uses."""
    position = {node: i for i, node in enumerate(order)}
    values = []
    producers = {n for node in order for n in node.all_input_nodes if n.op == "placeholder"}
    for node in [*producers, *order]:
        consumers = sorted(
            position[user] if user in position else len(order) for user in node.users if user.op != "get_attr"
        )
        if consumers:
            values.append(CrossingValue(position.get(node, -1), consumers, int(node.meta.get("bytes", 0))))
    return values
