"""Zero bubble, ZB-H1: each backward split into I and W, ordered from each stage's F, I and W times.

I (the input gradient) is sent upstream at once; W (the weight gradient) fills the time a worker
would otherwise wait. No stage holds more micro-batches (F to W) than the stage graph's depth (1F1B's
first stage in a chain). Without times (`layout.costs` empty) every action takes one tick; with
them, a list schedule on the clock: each worker, when free, starts its I if the gradient is in,
else its next F if the bound allows and its inputs are in, else a W that ends before either could
start (or, with nothing else left or allowed, the oldest W). F, I and W of one second each, two
stages, three micro-batches:

    worker 0: F0 F1 I0 W0 I1 F2 W1 I2 W2
    worker 1: F0 I0 F1 I1 W0 W1 F2 I2 W2

Of that order and 1F1B's, the one the same clock finishes first is kept: where W is nearly empty
(a backward all on the inputs), splitting the backward has little to fill the waits with, and
an order that holds W back can be slower than 1F1B's; it is never taken then.
"""
from __future__ import annotations

import math
from typing import Optional

from fxpipe.schedules.actions import FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action, Layout, Schedule, needs, one_f_one_b, one_stage_per_worker
from fxpipe.schedules.simulate import StageCosts, simulate

Order = list[list[Action]]


def zb_h1(layout: Layout, m: int) -> Order:
    """ZB-H1's order for `m` micro-batches on one stage per worker (see the module's docstring)."""
    one_stage_per_worker(layout, "zb-h1")
    if not layout.costs:
        return _by_ticks(layout, m)
    split, plain = _by_clock(layout, m), one_f_one_b(layout, m)
    return split if _makespan(split, layout, m) <= _makespan(plain, layout, m) * (1 + 1e-9) else plain


def _makespan(order: Order, layout: Layout, m: int) -> float:
    """The simulator's step time of `order` on `layout.costs`."""
    schedule = Schedule("zb-h1", tuple(map(tuple, order)), m)
    return simulate(schedule, layout, [StageCosts.split(*costs) for costs in layout.costs]).timeline.makespan


def _seconds(layout: Layout, action: Action) -> float:
    return StageCosts.split(*layout.costs[action.stage]).seconds(action.kind)


def _next(s: int, m: int, depth: int, next_f: list[int], next_i: list[int], next_w: list[int]) -> tuple[list[Action], Optional[Action]]:
    """Stage `s`'s candidates: what the pipeline waits for (its next I, then its next F while it
    holds fewer micro-batches than `depth`), and its oldest W, if any."""
    urgent = []
    if next_i[s] < next_f[s]:
        urgent.append(Action(INPUT_GRAD, s, next_i[s]))
    if next_f[s] < m and next_f[s] - next_w[s] < depth:
        urgent.append(Action(FORWARD, s, next_f[s]))
    return urgent, Action(WEIGHT_GRAD, s, next_w[s]) if next_w[s] < next_i[s] else None


def _count(action: Action, next_f: list[int], next_i: list[int], next_w: list[int]) -> None:
    next_f[action.stage] += action.kind == FORWARD
    next_i[action.stage] += action.kind == INPUT_GRAD
    next_w[action.stage] += action.kind == WEIGHT_GRAD


def _by_clock(layout: Layout, m: int) -> Order:
    """The list schedule on `layout.costs` (see the module's docstring)."""
    n, depth = layout.stages, layout.depth
    split = {(s, i) for s in range(n) for i in range(m)}
    end: dict[Action, float] = {}
    order: Order = [[] for _ in range(n)]
    free = [0.0] * n
    next_f, next_i, next_w = [0] * n, [0] * n, [0] * n
    while any(w < m for w in next_w):
        choices = [c for s in range(n) if (c := _choice(layout, split, end, free[s], *_next(s, m, depth, next_f, next_i, next_w)))]
        if not choices:  # cannot happen for a stage graph whose links go forward
            raise RuntimeError("zb-h1 found no order for this stage graph")
        start, _, action = min(choices, key=lambda c: (c[0], c[1], c[2].stage))
        order[action.stage].append(action)
        end[action] = free[action.stage] = start + _seconds(layout, action)
        _count(action, next_f, next_i, next_w)
    return order


def _choice(
    layout: Layout, split: set[tuple[int, int]], end: dict[Action, float], free: float, urgent: list[Action], weight: Optional[Action],
) -> Optional[tuple[float, int, Action]]:
    """Of a stage's candidates, the one to run next, with the time it can start and its rank
    among I, F, W; None when none can start yet (they wait for actions not yet placed)."""

    def ready(action: Action) -> Optional[float]:
        deps = needs(layout, action, True, split)
        return None if any(d not in end for d in deps) else max([free, *(end[d] for d in deps)])

    starts = [(t, rank, a) for rank, a in enumerate(urgent) if (t := ready(a)) is not None]
    if weight is not None:
        first = min((t for t, _, _ in starts), default=math.inf)
        # W now if it ends before I or F could start, or if nothing else is left to wait for.
        if free + _seconds(layout, weight) <= first or not urgent:
            return free, 2, weight
    return min(starts, default=None)


def _by_ticks(layout: Layout, m: int) -> Order:
    """The order of a unit-time list schedule: each tick, every stage runs I if it can, else F
    while the depth allows, else the oldest W. With F = I = W it takes 29 ticks for 4 stages and
    8 micro-batches, where 1F1B takes 33."""
    n, depth = layout.stages, layout.depth
    split = {(s, i) for s in range(n) for i in range(m)}  # every backward
    done: dict[Action, int] = {}  # action -> tick it finished
    per_rank: Order = [[] for _ in range(n)]
    next_f, next_i, next_w = [0] * n, [0] * n, [0] * n
    tick = 0
    while any(w < m for w in next_w):
        chosen: list[Action] = []
        for s in range(n):
            urgent, weight = _next(s, m, depth, next_f, next_i, next_w)
            candidates = [*urgent, *([weight] if weight is not None else [])]
            action = next((a for a in candidates if all(done.get(d, tick) < tick for d in needs(layout, a, True, split))), None)
            if action is not None:
                chosen.append(action)
        for action in chosen:
            per_rank[action.stage].append(action)
            done[action] = tick
            _count(action, next_f, next_i, next_w)
        tick += 1
        if tick > 4 * n * m + 4 * n:  # cannot happen for a stage graph whose links go forward
            raise RuntimeError("zb-h1 found no order for this stage graph")
    return per_rank
