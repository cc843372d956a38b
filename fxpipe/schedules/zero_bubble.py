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

from fxpipe.schedules.actions import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action, Layout, needs, one_f_one_b, one_stage_per_worker

Order = list[list[Action]]


def zb_h1(layout: Layout, m: int) -> Order:
    """ZB-H1's order for `m` micro-batches on one stage per worker (see the module's docstring)."""
    one_stage_per_worker(layout, "zb-h1")
    if not layout.costs:
        return _by_ticks(layout, m)
    split, plain = _by_clock(layout, m), one_f_one_b(layout, m)
    return split if makespan(split, layout) <= makespan(plain, layout) * (1 + 1e-9) else plain


def makespan(order: Order, layout: Layout) -> float:
    """When the last action of `order` ends, each worker running its list in turn and each
    action starting once what it receives has arrived, on `layout.costs`."""
    split = frozenset((a.stage, a.micro_batch) for acts in order for a in acts if a.kind == INPUT_GRAD)
    end: dict[Action, float] = {}
    position = [0] * len(order)
    free = [0.0] * len(order)
    left = sum(map(len, order))
    while left:
        moved = False
        for rank, acts in enumerate(order):
            while position[rank] < len(acts):
                action = acts[position[rank]]
                deps = needs(layout, action, True, split)
                if any(d not in end for d in deps):
                    break
                start = max([free[rank], *(end[d] for d in deps)])
                end[action] = free[rank] = start + _seconds(layout, action)
                position[rank] += 1
                left -= 1
                moved = True
        if not moved:
            return math.inf  # cannot happen for an order the checker passes
    return max(free, default=0.0)


def _seconds(layout: Layout, action: Action) -> float:
    forward, input_grad, weight_grad = layout.costs[action.stage]
    return {FORWARD: forward, BACKWARD: input_grad + weight_grad, INPUT_GRAD: input_grad, WEIGHT_GRAD: weight_grad}[action.kind]


def _by_clock(layout: Layout, m: int) -> Order:
    """The list schedule on `layout.costs` (see the module's docstring)."""
    n, depth = layout.stages, layout.depth
    split = {(s, i) for s in range(n) for i in range(m)}
    end: dict[Action, float] = {}
    order: Order = [[] for _ in range(n)]
    free = [0.0] * n
    next_f, next_i, next_w = [0] * n, [0] * n, [0] * n
    while any(w < m for w in next_w):
        choices = [c for s in range(n) if (c := _choice(layout, s, m, depth, split, end, free[s], next_f, next_i, next_w))]
        if not choices:  # cannot happen for a stage graph whose links go forward
            raise RuntimeError("zb-h1 found no order for this stage graph")
        start, _, action = min(choices, key=lambda c: (c[0], c[1], c[2].stage))
        s = action.stage
        order[s].append(action)
        end[action] = free[s] = start + _seconds(layout, action)
        next_f[s] += action.kind == FORWARD
        next_i[s] += action.kind == INPUT_GRAD
        next_w[s] += action.kind == WEIGHT_GRAD
    return order


def _choice(
    layout: Layout, s: int, m: int, depth: int, split: set[tuple[int, int]], end: dict[Action, float], free: float,
    next_f: list[int], next_i: list[int], next_w: list[int],
) -> tuple[float, int, Action] | None:
    """Stage `s`'s next action with the time it can start and its rank among I, F, W; None when
    none of its candidates can start yet (they wait for actions not yet placed)."""

    def ready(action: Action) -> float | None:
        deps = needs(layout, action, True, split)
        return None if any(d not in end for d in deps) else max([free, *(end[d] for d in deps)])

    urgent = []  # I, then F: what the pipeline waits for
    if next_i[s] < next_f[s]:
        urgent.append(Action(INPUT_GRAD, s, next_i[s]))
    if next_f[s] < m and next_f[s] - next_w[s] < depth:
        urgent.append(Action(FORWARD, s, next_f[s]))
    starts = [(t, rank, a) for rank, a in enumerate(urgent) if (t := ready(a)) is not None]
    if next_w[s] < next_i[s]:
        weight = Action(WEIGHT_GRAD, s, next_w[s])
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
    next_f, next_i, w_done = [0] * n, [0] * n, [0] * n
    tick = 0
    while any(w < m for w in w_done):
        chosen: list[Action] = []
        for s in range(n):
            candidates = []
            if next_i[s] < next_f[s]:
                candidates.append(Action(INPUT_GRAD, s, next_i[s]))
            if next_f[s] < m and next_f[s] - w_done[s] < depth:
                candidates.append(Action(FORWARD, s, next_f[s]))
            if w_done[s] < next_i[s]:
                candidates.append(Action(WEIGHT_GRAD, s, w_done[s]))
            action = next((a for a in candidates if all(done.get(d, tick) < tick for d in needs(layout, a, True, split))), None)
            if action is not None:
                chosen.append(action)
        for action in chosen:
            s = action.stage
            per_rank[s].append(action)
            done[action] = tick
            next_f[s] += action.kind == FORWARD
            next_i[s] += action.kind == INPUT_GRAD
            w_done[s] += action.kind == WEIGHT_GRAD
        tick += 1
        if tick > 4 * n * m + 4 * n:  # cannot happen for a stage graph whose links go forward
            raise RuntimeError("zb-h1 found no order for this stage graph")
    return per_rank
