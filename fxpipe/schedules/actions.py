"""Schedules as data: for each worker, the ordered actions of one step, made by a schedule function.

An action is one stage's work on one micro-batch:

    F  forward                 R  recompute (a checkpointed micro-batch, right before its B or I)
    B  backward, whole         I  input gradient: sent upstream at once
                               W  weight gradient: from what I kept, whenever the worker is free

Stage s runs on worker `layout.ranks[s]`; a worker runs its list in order, and an action waits
only for the values it receives. `make_schedule` (fxpipe/schedules/check.py) makes a named
schedule and proves it runs to the end.
For 2 stages and 3 micro-batches (columns are turns, not times):

    gpipe  worker 0: F0 F1 F2 .. .. B2 B1 B0       1f1b  worker 0: F0 F1 B0 F2 B1 B2
           worker 1: .. F0 F1 F2 B2 B1 B0                worker 1: F0 B0 F1 B1 F2 B2
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Container, Iterable, Iterator, Sequence

import networkx as nx

FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD, RECOMPUTE = "F", "B", "I", "W", "R"
# zb-h1: fxpipe/schedules/zero_bubble.py; 2bw: 1F1B within a step, and across the steps of
# `train_steps` with no flush (fxpipe/schedules/two_bw.py).
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "2bw")


@dataclass(frozen=True)
class Action:
    kind: str  # one of F, B, I, W, R
    stage: int
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}@{self.stage}"


@dataclass(frozen=True)
class Layout:
    """What a schedule needs of the plan: where each stage runs, which stages send values to
    which (skip edges included: the stage graph need not be a chain), and which stages make the
    model's output (a loss computed in the pipeline needs all of them)."""

    ranks: tuple[int, ...]  # the worker of each stage
    links: frozenset[tuple[int, int]]  # (producer, consumer) stage pairs
    output_stages: tuple[int, ...]
    # Per stage, seconds per micro-batch of F, I and W (B is I + W), for schedules ordered by
    # time (zb-h1); empty: every action takes one tick.
    costs: tuple[tuple[float, float, float], ...] = ()

    @classmethod
    def of(cls, edges: Iterable[Any], ranks: Sequence[int], costs: Sequence[tuple[float, float, float]] = ()) -> "Layout":
        """From a plan's edges (`src`, `dst`: -1 is the caller, `len(ranks)` the output)."""
        sink = len(ranks)
        return cls(
            ranks=tuple(ranks),
            links=frozenset((e.src, e.dst) for e in edges if e.src >= 0 and e.dst < sink),
            output_stages=tuple(sorted({e.src for e in edges if e.dst == sink and e.src >= 0})),
            costs=tuple(costs),
        )

    @property
    def stages(self) -> int:
        return len(self.ranks)

    @property
    def workers(self) -> int:
        return max(self.ranks) + 1

    @property
    def loss_stage(self) -> int:
        """The stage whose forward computes the loss, once every output of the micro-batch is in."""
        return max(self.output_stages, default=self.stages - 1)

    def producers(self, stage: int) -> list[int]:
        return sorted(src for src, dst in self.links if dst == stage)

    def consumers(self, stage: int) -> list[int]:
        return sorted(dst for src, dst in self.links if src == stage)

    def on_rank(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.ranks) if r == rank]

    def stages_after(self, stage: int) -> int:
        """Stages after `stage` on the longest path from it through the stage graph: in a chain
        n - 1 - stage; a branch that joins the others later counts only the stages it feeds."""
        return self._remaining[stage] - 1

    @property
    def depth(self) -> int:
        """Stages on the longest path of the stage graph (a chain's stage count)."""
        return max(self._remaining, default=0)

    @cached_property
    def levels(self) -> dict[int, int]:
        """Per stage, the stages before it on the longest path that reaches it: stages of one
        level read nothing from each other and run side by side (a chain has one per level)."""
        level = [0] * self.stages
        for src, dst in sorted(self.links):
            level[dst] = max(level[dst], level[src] + 1)
        return dict(enumerate(level))

    @cached_property
    def _remaining(self) -> list[int]:
        """Per stage, the stages on the longest path from it to the end, itself included. Links
        go from a stage to a later one (the cut follows one linear order), so one pass from the
        last stage back suffices."""
        remaining = [1] * self.stages
        for src, dst in sorted(self.links, reverse=True):
            remaining[src] = max(remaining[src], 1 + remaining[dst])
        return remaining


@dataclass(frozen=True)
class Schedule:
    """Per worker, the actions it runs, in order. `loss` says whether a loss computed inside the
    pipeline starts the backward (a train step), or the caller hands in output gradients."""

    name: str
    actions: tuple[tuple[Action, ...], ...]
    micro_batches: int
    loss: bool = True
    slices: int = 1  # per row: micro-batches i and i + 1 of a row pass a carry (fxpipe/schedules/slices.py)

    def __str__(self) -> str:
        return "\n".join(f"worker {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.actions))

    def forward_part(self) -> tuple[tuple[Action, ...], ...]:
        """The leading forwards of every worker (all of them, for GPipe)."""
        return self._parts[0]

    def rest(self) -> tuple[tuple[Action, ...], ...]:
        return self._parts[1]

    @cached_property
    def split(self) -> frozenset[tuple[int, int]]:
        """The (stage, micro-batch) pairs whose backward is split into I and W (the others run B)."""
        return frozenset((a.stage, a.micro_batch) for acts in self.actions for a in acts if a.kind == INPUT_GRAD)

    @cached_property
    def _parts(self) -> tuple[tuple[tuple[Action, ...], ...], tuple[tuple[Action, ...], ...]]:
        head = tuple(tuple(_leading(acts, FORWARD)) for acts in self.actions)
        return head, tuple(acts[len(h) :] for acts, h in zip(self.actions, head))


def _leading(actions: tuple[Action, ...], kind: str) -> Iterator[Action]:
    for action in actions:
        if action.kind != kind:
            return
        yield action


# -- schedule functions ---------------------------------------------------------------------------
def gpipe(layout: Layout, m: int) -> list[list[Action]]:
    """Fill and drain: every forward, then every backward in reverse. Micro-batch i runs on stage
    s at tick i + s, so whatever a forward receives was made at an earlier tick."""
    per_rank: list[list[Action]] = [[] for _ in range(layout.workers)]
    forwards = sorted(((i + s, s, i) for s in range(layout.stages) for i in range(m)))
    for _, s, i in forwards:
        per_rank[layout.ranks[s]].append(Action(FORWARD, s, i))
    for _, s, i in reversed(forwards):
        per_rank[layout.ranks[s]].append(Action(BACKWARD, s, i))
    return per_rank


def one_f_one_b(layout: Layout, m: int, ahead: int = 0) -> list[list[Action]]:
    """PipeDream-flush: stage s runs as many forwards as there are stages after it on the longest
    path of the stage graph (n - 1 - s in a chain), then alternates one forward and one backward,
    then drains; it never holds more micro-batches than that path has stages from it. With
    `ahead`, each stage that has stages after it runs that many forwards more first (and holds
    as many micro-batches more)."""
    one_stage_per_worker(layout, "1f1b")
    n = layout.stages
    per_rank = []
    for s in range(n):
        after = layout.stages_after(s)
        warmup = min(after + (ahead if after else 0), m)
        acts = [Action(FORWARD, s, i) for i in range(warmup)]
        for k in range(m - warmup):
            acts += [Action(FORWARD, s, warmup + k), Action(BACKWARD, s, k)]
        acts += [Action(BACKWARD, s, k) for k in range(m - warmup, m)]
        per_rank.append(acts)
    return per_rank


def interleaved_one_f_one_b(layout: Layout, m: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B: worker d holds stages d, d + D, d + 2D, ...; it runs groups
    of D micro-batches through its first stage, then its second, and so on, and backwards in the
    mirrored order, with 1F1B in between."""
    workers = layout.workers
    per_worker = [layout.on_rank(r) for r in range(workers)]
    v = len(per_worker[0])
    if any(stages != [r + k * workers for k in range(v)] for r, stages in enumerate(per_worker)):
        raise ValueError("interleaved-1f1b needs stages placed round-robin: stage s on worker s % workers")
    if m % workers:
        raise ValueError(
            f"interleaved-1f1b needs the micro-batch count ({m}) to be a multiple of the device count "
            f"({workers}); a batch splits into as many micro-batches as chunks, or as it has samples where it has "
            f"fewer.\nHow to fix: compile with chunks a multiple of {workers} (chunks={max(workers, m - m % workers)}, say) "
            "and give batches of at least chunks samples (drop a smaller last batch: DataLoader(drop_last=True)); "
            "or compile with stages_per_device=1 and schedule='1f1b'."
        )
    per_rank = []
    for d in range(workers):
        total = m * v

        def order(k: int, reverse: bool) -> tuple[int, int]:
            group, within = divmod(k, workers * v)
            chunk = within // workers
            return (v - 1 - chunk if reverse else chunk) * workers + d, group * workers + within % workers

        forwards = [Action(FORWARD, *order(k, False)) for k in range(total)]
        backwards = [Action(BACKWARD, *order(k, True)) for k in range(total)]
        warmup = total if m == workers else min((workers - d - 1) * 2 + (v - 1) * workers, total)
        acts = forwards[:warmup]
        for k in range(total - warmup):
            acts += [forwards[warmup + k], backwards[k]]
        acts += backwards[total - warmup :]
        per_rank.append(acts)
    return per_rank


def one_stage_per_worker(layout: Layout, name: str) -> None:
    if sorted(layout.ranks) != list(range(layout.stages)):
        raise ValueError(f"{name} runs one stage per device; use interleaved-1f1b for several stages per device")


# -- dependencies ---------------------------------------------------------------------------------
def needs(layout: Layout, action: Action, loss: bool, split: Container[tuple[int, int]], checkpointed: int = 0) -> list[Action]:
    """The actions whose values `action` receives (the backward of a (stage, micro-batch) pair in
    `split` is I and W, else B; micro-batches below `checkpointed` recompute before their
    backward): the edges the checker and the simulator add to the workers' own orders."""
    s, i = action.stage, action.micro_batch
    if action.kind == FORWARD:
        deps = [Action(FORWARD, p, i) for p in layout.producers(s)]
        if loss and s == layout.loss_stage:
            deps += [Action(FORWARD, k, i) for k in layout.output_stages if k != s]
        return deps
    if action.kind == RECOMPUTE:
        return [Action(FORWARD, s, i)]
    if action.kind == WEIGHT_GRAD:
        return [Action(INPUT_GRAD, s, i)]
    # B or I: the stage's own activations, and the gradients from every consumer (and the loss)
    deps = [Action(RECOMPUTE if i < checkpointed else FORWARD, s, i)]
    deps += [Action(INPUT_GRAD if (c, i) in split else BACKWARD, c, i) for c in layout.consumers(s)]
    if loss and s in layout.output_stages:
        deps.append(Action(FORWARD, layout.loss_stage, i))
    return deps


def carried(action: Action, slices: int, split: Container[tuple[int, int]]) -> list[Action]:
    """Slices of a sequence (`slices` per row): a slice's forward reads the carry of the one
    before it on its stage, and its backward the gradient of its own carry, from the one after."""
    s, i = action.stage, action.micro_batch
    if slices < 2:
        return []
    if action.kind == FORWARD and i % slices:
        return [Action(FORWARD, s, i - 1)]
    if action.kind in (BACKWARD, INPUT_GRAD) and i % slices != slices - 1:
        return [Action(INPUT_GRAD if (s, i + 1) in split else BACKWARD, s, i + 1)]
    return []


def dependency_graph(schedule: Schedule, layout: Layout, checkpointed: int) -> "nx.DiGraph[Action]":
    """Each worker's order, and an edge from every action to each that `needs` it: the graph the
    checker looks for cycles in and the simulator times."""
    graph: nx.DiGraph[Action] = nx.DiGraph()
    for acts in schedule.actions:
        graph.add_nodes_from(acts)
        graph.add_edges_from(zip(acts, acts[1:]))
    for action in list(graph.nodes):
        for dep in [*needs(layout, action, schedule.loss, schedule.split, checkpointed), *carried(action, schedule.slices, schedule.split)]:
            if dep in graph:
                graph.add_edge(dep, action)
    return graph


def by_rows(per_rank: list[list[Action]], slices: int) -> list[list[Action]]:
    """A schedule of rows made one of their slices: each row's forward runs its slices in order,
    each of its backward steps (B, I or W) in reverse, so that a slice's carry is made before the
    next slice reads it and its gradient before its own backward needs it.

        row schedule (1F1B)   F0 F1 B0 F2 B1 B2
        two slices a row      F0 F1 F2 F3 B1 B0 F4 F5 B3 B2 B5 B4
    """
    if slices < 2:
        return per_rank
    out = []
    for acts in per_rank:
        row: list[Action] = []
        for a in acts:
            order = range(slices) if a.kind == FORWARD else reversed(range(slices))
            row += [Action(a.kind, a.stage, a.micro_batch * slices + k) for k in order]
        out.append(row)
    return out


def with_recompute(per_rank: list[list[Action]], checkpointed: int) -> list[list[Action]]:
    """Put R(i) right before the B or I of each micro-batch i < `checkpointed`: the recompute runs
    while the worker would wait for the gradient."""
    out = []
    for acts in per_rank:
        row = []
        for a in acts:
            if a.kind in (BACKWARD, INPUT_GRAD) and a.micro_batch < checkpointed:
                row.append(Action(RECOMPUTE, a.stage, a.micro_batch))
            row.append(a)
        out.append(row)
    return out


def clock_cycles(micro_batches: int, stages: int) -> Iterator[list[tuple[int, int]]]:
    """Yield, tick by tick, the (micro-batch, stage) pairs of GPipe's forward: micro-batch i runs
    on stage j at tick i + j; the pipeline fills, then drains. For 3 micro-batches on 3 stages:

        tick 0: (0,0)
        tick 1: (1,0) (0,1)
        tick 2: (2,0) (1,1) (0,2)
        tick 3:       (2,1) (1,2)
        tick 4:             (2,2)
    """
    for tick in range(micro_batches + stages - 1):
        yield [(tick - j, j) for j in range(max(0, tick - micro_batches + 1), min(tick + 1, stages))]


CHECKPOINT_MODES = ("always", "except_last", "never")


def checkpoint_stop(mode: str, micro_batches: int) -> int:
    """Micro-batches below this index are checkpointed.

    'except_last' leaves the last one out: its backward comes first, right after the forward,
    so recomputing it would buy no memory.
    """
    return {"always": micro_batches, "except_last": micro_batches - 1, "never": 0}[mode]
