"""Checked schedules: every action present once, on its stage's worker, and no deadlock.

Workers run their lists in order and an action waits only for what it receives, so a schedule
runs to the end exactly when the graph of "runs after" edges has no cycle:

    worker order:   a ──▶ the next action on the same worker
    values:         F(i) of a producer ──▶ F(i) of each consumer     (skip edges too)
                    B/I(i) of a consumer ──▶ B/I(i) of its producer
                    F(i) ──▶ R(i) ──▶ B/I(i) ──▶ W(i) on one stage
"""
from __future__ import annotations

from collections import Counter
from functools import lru_cache
from typing import Callable

import networkx as nx

from fxpipe.schedules.actions import (
    BACKWARD, FORWARD, INPUT_GRAD, RECOMPUTE, SCHEDULES, WEIGHT_GRAD, Action, Layout, Schedule, by_rows, dependency_graph,
    gpipe, interleaved_one_f_one_b, one_f_one_b, with_recompute,
)
from fxpipe.schedules.two_bw import two_bw_step
from fxpipe.schedules.zero_bubble import zb_h1

MAKERS: dict[str, Callable[[Layout, int], list[list[Action]]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_one_f_one_b,
    "zb-h1": zb_h1,
    "2bw": two_bw_step,  # one step alone; train_steps overlaps the steps (fxpipe/schedules/two_bw.py)
}


class ScheduleError(ValueError):
    """A schedule that would not run to the end, or would not compute the step."""


def expected_actions(layout: Layout, micro_batches: int, split: frozenset[tuple[int, int]], checkpointed: int) -> set[Action]:
    """F, and B or (for a pair in `split`) I and W, of every stage and micro-batch; R of each
    checkpointed one."""
    actions = set()
    for s in range(layout.stages):
        for i in range(micro_batches):
            kinds = [FORWARD, INPUT_GRAD, WEIGHT_GRAD] if (s, i) in split else [FORWARD, BACKWARD]
            actions |= {Action(k, s, i) for k in kinds}
    return actions | {Action(RECOMPUTE, s, i) for s in range(layout.stages) for i in range(min(checkpointed, micro_batches))}


def check(schedule: Schedule, layout: Layout, checkpointed: int) -> None:
    """Raise ScheduleError naming every problem: missing, repeated or misplaced actions, and a
    cycle of waits (a deadlock) if there is one."""
    problems = []
    listed = Counter(a for acts in schedule.actions for a in acts)
    wanted = expected_actions(layout, schedule.micro_batches, schedule.split, checkpointed)
    if len(schedule.actions) != layout.workers:
        problems.append(f"{len(schedule.actions)} worker lists for {layout.workers} workers")
    missing = sorted(wanted - set(listed), key=str)
    if missing:
        problems.append("missing: " + " ".join(map(str, missing)))
    extra = sorted(set(listed) - wanted, key=str)
    if extra:
        problems.append("not part of this step: " + " ".join(map(str, extra)))
    repeated = sorted((a for a, count in listed.items() if count > 1), key=str)
    if repeated:
        problems.append("listed more than once: " + " ".join(map(str, repeated)))
    for rank, acts in enumerate(schedule.actions):
        elsewhere = [a for a in acts if a.stage < layout.stages and layout.ranks[a.stage] != rank]
        if elsewhere:
            problems.append(f"worker {rank} lists actions of other workers' stages: " + " ".join(map(str, elsewhere)))
    if not problems:
        graph = dependency_graph(schedule, layout, checkpointed)
        try:
            cycle = nx.find_cycle(graph)
        except nx.NetworkXNoCycle:
            cycle = []
        if cycle:
            waits = " -> ".join(str(a) for a, _ in cycle) + f" -> {cycle[0][0]}"
            problems.append(f"deadlock: each waits for the next to finish first: {waits}")
    if problems:
        raise ScheduleError(f"schedule {schedule.name!r} is not valid:\n  " + "\n  ".join(problems))


@lru_cache(maxsize=64)
def make_schedule(name: str, layout: Layout, micro_batches: int, checkpointed: int, loss: bool = True, slices: int = 1) -> Schedule:
    """The named schedule, checked: `checkpointed` micro-batches (the first ones) recompute.
    With `slices` per row (slices of a sequence), the schedule of the rows, each made its slices
    (`by_rows`). Cached: a pipeline asks for the same few on every step."""
    if name not in MAKERS:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    per_rank = with_recompute(by_rows(MAKERS[name](layout, micro_batches // slices), slices), checkpointed)
    schedule = Schedule(name, tuple(tuple(acts) for acts in per_rank), micro_batches, loss, slices)
    check(schedule, layout, checkpointed)
    return schedule
