"""Partitioning: cutting the linear order of nodes into one contiguous, non-empty run per stage."""
from __future__ import annotations

import bisect
import difflib
import itertools
import math
from typing import Any, Optional, Sequence

import torch.fx as fx

from fxpipe.passes.objective import CrossingValue, CutModel
from fxpipe.tracing.markers import is_split

# Above this many nodes, the exact search runs over this many runs of nodes of about equal time.
UNITS = 192


class PartitionError(ValueError):
    """The requested cut is impossible; the message lists every problem and the fix."""


class NodeCountError(PartitionError):
    """`balance` counts other than the graph's nodes: counted on another graph (of another kind of call)."""


def refuse(problems: list[str], fix: str, error: type[PartitionError] = PartitionError) -> None:
    """Raise one PartitionError listing every problem, with the fix (nothing when none)."""
    if problems:
        raise error("cannot partition the graph:\n" + "\n".join(f"  - {p}" for p in problems) + f"\n{fix}")


def _scopes(node: fx.Node) -> list[str]:
    """The qualified names of the modules `node` runs inside."""
    scopes = [str(node.meta.get("scope", ""))]
    if node.op == "call_module":
        scopes.append(str(node.target))
    scopes.extend(path for path, _ in node.meta.get("nn_module_stack", {}).values())
    return scopes


def belongs_to(node: fx.Node, module: str) -> bool:
    """Whether `node` runs inside the module with qualified name `module`."""
    return any(s == module or s.startswith(module + ".") for s in _scopes(node))


def _modules_like(order: Sequence[fx.Node], name: str) -> str:
    """A hint naming the modules of the graph closest to `name` (a misspelt or renamed one)."""
    names = {scope for node in order for scope in _scopes(node) if scope}
    close = difflib.get_close_matches(name, sorted(names), n=3)
    return f" (did you mean {', '.join(map(repr, close))}?)" if close else ""


def cuts_from_split_points(order: Sequence[fx.Node], split_points: Sequence[str], stages: int) -> list[int]:
    """Indices into `order` where stages 1.. begin: the first node of each named module."""
    problems = []
    if len(split_points) != stages - 1:
        problems.append(
            f"{len(split_points)} split points for {stages} stages; give one fewer than the stages "
            "(devices times stages_per_device)"
        )
    cuts = []
    twice = sorted({name for name in split_points if split_points.count(name) > 1})
    if twice:
        problems.append(f"{', '.join(map(repr, twice))} named more than once in split_points; each stage begins at a module of its own")
    for name in split_points:
        first = next((i for i, node in enumerate(order) if belongs_to(node, name)), None)
        if name == "":
            problems.append("split point '' is the whole model (its name in named_modules()), where the graph begins")
        elif first is None:
            problems.append(f"split point {name!r} is not a module that runs in the traced graph{_modules_like(order, name)}")
        elif first == 0:
            problems.append(f"split point {name!r} is where the graph begins; stage 0 would be empty")
        else:
            cuts.append(first)
    if not problems and any(b <= a for a, b in zip(cuts, cuts[1:])):
        starts = ", ".join(f"{n!r} at node {c}" for n, c in zip(split_points, cuts))
        problems.append(f"split points are out of order ({starts}); list them in the order the model runs them")
    refuse(problems, "How to fix: name, in forward order, the module at which each stage after the first begins.")
    return cuts


def _checked_cuts(order: Sequence[fx.Node], cuts: Sequence[int], stages: int) -> list[int]:
    """Cuts given as positions (pipe_split marks, with split points): one fewer than the stages,
    and no stage empty."""
    cuts = sorted(set(cuts))
    problems = []
    if len(cuts) != stages - 1:
        problems.append(f"the marks and split points make {len(cuts) + 1} stages, but the pipeline has {stages} (devices times stages_per_device)")
    bounds = [0, *cuts, len(order)]
    empty = [i for i, (a, b) in enumerate(zip(bounds, bounds[1:])) if all(is_split(node) for node in order[a:b])]
    if empty:
        problems.append(f"stage {empty[0]} would be empty: two marks with nothing between them, or one at an end")
    refuse(problems, "How to fix: give one device per stage, and put pipe_split() between the layers of two stages.")
    return cuts


def cuts_from_balance(order: Sequence[fx.Node], balance: Sequence[int], stages: int) -> list[int]:
    """Indices into `order` where stages 1.. begin, from a node count per stage."""
    problems = []
    if len(balance) != stages:
        problems.append(f"balance has {len(balance)} entries for {stages} stages (devices times stages_per_device)")
    if any(not isinstance(b, int) or b < 1 for b in balance):
        problems.append(f"balance {list(balance)} has an entry below 1; every stage needs a node")
    miscounted = sum(balance) != len(order)
    if miscounted:
        problems.append(f"balance sums to {sum(balance)} but the graph has {len(order)} nodes to place")
    refuse(
        problems, "How to fix: give one positive node count per stage (devices times stages_per_device), adding up to the node count.",
        NodeCountError if miscounted else PartitionError,
    )
    return list(itertools.accumulate(balance))[:-1]


def min_max_cuts(weights: Sequence[float], stages: int) -> list[int]:
    """Cut `weights` into `stages` non-empty contiguous runs whose largest sum is the least possible.

    Bisection on the bottleneck with a greedy probe; each probe takes `stages` binary searches
    over the prefix sums, and each step narrows the bracket to a bottleneck actually achieved, so
    the result is the optimum of the given order.
    """
    prefix = [0.0, *itertools.accumulate(float(w) for w in weights)]

    def greedy(limit: float) -> Optional[list[int]]:
        cuts: list[int] = []
        start = 0
        while start < len(weights):
            end = bisect.bisect_right(prefix, prefix[start] + limit, lo=start + 1) - 1
            if end <= start or len(cuts) == stages:
                return None
            cuts.append(end)
            start = end
        return cuts[:-1]

    def bottleneck(cuts: list[int]) -> float:
        bounds = [0, *cuts, len(weights)]
        return max(prefix[b] - prefix[a] for a, b in zip(bounds, bounds[1:]))

    low = max(prefix[i + 1] - prefix[i] for i in range(len(weights))) if weights else 0.0
    best = greedy(prefix[-1]) or []
    high = bottleneck(best)
    found = greedy(low)
    if found is not None:
        best, high = found, low
    while True:
        mid = (low + high) / 2
        if not low < mid < high:
            break
        found = greedy(mid)
        if found is None:
            low = mid
        else:
            high = min(mid, bottleneck(found))
            if bottleneck(found) <= bottleneck(best):
                best = found
    return _fill(best, len(weights), stages)


def _fill(cuts: list[int], length: int, stages: int) -> list[int]:
    """Add cuts until there are `stages` runs: splitting a run never raises the bottleneck."""
    cuts = sorted(cuts)
    for spare in range(length):
        if len(cuts) == stages - 1:
            break
        if spare not in cuts and spare > 0:
            bisect.insort(cuts, spare)
    return cuts


def best_cuts(model: CutModel, stages: int, caps: Optional[Sequence[float]] = None) -> list[int]:
    """The cut of `model`'s order into `stages` non-empty runs with the least pipeline time,
    `sum(t_i) + (chunks - 1) * max(t_i)`, whose stages fit `caps` (bytes per stage); ties go to
    the smaller bottleneck.

    When a stage's time is the sum of its nodes' and nothing caps memory, the sum is the same for
    every cut and the bottleneck alone decides: `min_max_cuts` finds it. Otherwise an exact search
    over (bottleneck, sum) pairs runs on the order, or on `UNITS` runs of it for larger graphs.
    """
    if len(model) < stages:
        refuse([f"{stages} stages but only {len(model)} nodes"], "How to fix: use fewer stages: fewer devices, or a smaller stages_per_device.")
    if caps is None and model.additive():
        return min_max_cuts(model.times, stages)
    limits = list(caps) if caps is not None else [math.inf] * stages
    units = UNITS
    while True:
        coarse, bounds = coarsen(model, units)
        cuts = _pareto_cuts(coarse, stages, limits)
        # A cap may need a cut inside a run of nodes: search finer before calling it impossible.
        if cuts is not None or len(coarse) == len(model):
            break
        units *= 2
    if cuts is None:
        refuse(*_infeasible(model, stages, caps or []))
    return [bounds[c] for c in cuts or []]


Front = list[tuple[float, float, int, int]]  # (bottleneck, sum, previous end, index in its front)


def _pareto(candidates: Front) -> Front:
    kept: Front = []
    for candidate in sorted(candidates):  # by bottleneck, then sum, then the earlier start
        if not kept or candidate[1] < kept[-1][1]:
            kept.append(candidate)
    return kept


def _pareto_cuts(model: CutModel, stages: int, caps: list[float]) -> Optional[list[int]]:
    """Dynamic programme over (stages used, end position), keeping every cut that no other beats
    on both the bottleneck and the sum: the optimum of any objective rising in both is among them."""
    n, chunks = len(model), model.chunks
    capped = any(math.isfinite(cap) for cap in caps)
    # A cut of the order by bottleneck alone bounds the optimum from above; a partial cut whose
    # objective cannot fall below that bound, whatever follows, is dropped (it cannot win).
    guess = min_max_cuts(model.times, stages)
    bound = model.pipeline_time(guess) if not capped else math.inf
    limit = bound * (1 + 1e-9)
    prefix, bandwidth, by_stage = model.prefix_times, model.bandwidth, model.by_stage()
    fronts: list[dict[int, Front]] = [{0: [(0.0, 0.0, -1, -1)]}] + [{} for _ in range(stages)]
    for k in range(1, stages + 1):
        candidates: dict[int, Front] = {}
        for start, front in fronts[k - 1].items():
            received = model.received_from(start)
            # The front is sorted by bottleneck, rising, and sum, falling: its first entry has the
            # least bottleneck and its last the least sum.
            least_top, least_sum = front[0][0], front[-1][1]
            for end in range(max(start + 1, k), n - (stages - k) + 1):
                if by_stage:  # (the stages after weigh at least what the fewest micro-batches held make them)
                    t, rest = model.stage_time(start, end, k - 1), model.stage_time(end, n)
                else:
                    t = prefix[end] - prefix[start] + (received[end] / bandwidth if bandwidth else 0.0)
                    rest = prefix[n] - prefix[end]
                # Both tests only get worse as the stage grows: stop at the first that fails.
                if capped and model.memory(start, end, k - 1) > caps[k - 1]:
                    break
                if least_sum + t + rest + (chunks - 1) * max(least_top, t) > limit:
                    break
                found = candidates.setdefault(end, [])
                for i, (m, s, _, _) in enumerate(front):
                    top, total = max(m, t), s + t
                    if total + rest + (chunks - 1) * top <= limit:
                        found.append((top, total, start, i))
        fronts[k] = {end: _pareto(found) for end, found in sorted(candidates.items()) if found}
    final = fronts[stages].get(n)
    if not final:
        return None
    # The least objective, to a relative 1e-9 (sums of the same numbers in another order differ in
    # the last bits); among those, the least bottleneck.
    objective = [s + (chunks - 1) * m for m, s, _, _ in final]
    least = min(objective)
    index = min((i for i in range(len(final)) if objective[i] <= least + 1e-9 * abs(least)), key=lambda i: final[i][0])
    cuts, end = [], n
    for k in range(stages, 0, -1):
        _, _, start, previous = fronts[k][end][index]
        cuts.append(start)
        end, index = start, previous
    return sorted(cuts)[1:]


def coarsen(model: CutModel, units: int) -> tuple[CutModel, list[int]]:
    """`model` over at most `units` runs of consecutive positions of about equal time, and the
    positions where the runs begin (plus the end)."""
    n = len(model)
    if n <= units:
        return model, list(range(n + 1))
    prefix = [0.0, *itertools.accumulate(t + 1e-12 for t in model.times)]
    total = prefix[-1]
    bounds = sorted({0, n, *(bisect.bisect_left(prefix, total * k / units) for k in range(1, units))})

    return coarsen_at(model, bounds), bounds


def coarsen_at(model: CutModel, bounds: Sequence[int]) -> CutModel:
    """`model` over the runs of positions between consecutive `bounds` (0 and the end included)."""
    unit = [u for u, (a, b) in enumerate(zip(bounds, bounds[1:])) for _ in range(b - a)]
    unit.append(len(bounds) - 1)  # the output, after the last run

    def summed(prefix_sums: list[float]) -> list[float]:
        return [prefix_sums[b] - prefix_sums[a] for a, b in zip(bounds, bounds[1:])]

    values = []
    for value in model.values:
        producer = unit[value.producer] if value.producer >= 0 else -1
        consumers = [c for c in sorted({unit[c] for c in value.consumers}) if c != producer]
        if consumers:
            values.append(CrossingValue(producer, consumers, value.nbytes))
    return CutModel(
        summed(model.prefix_times), summed(model.prefix_params), summed(model.prefix_activations), values,
        model.bandwidth, model.chunks, model.checkpointed, model.param_scale, in_flight=model.in_flight,
        weighs_memory=model.weighs_memory,
    )  # fmt: skip


def _infeasible(model: CutModel, stages: int, caps: Sequence[float]) -> tuple[list[str], str]:
    """Why no cut fits, and the fix: the node that alone exceeds the memory (no number of
    devices helps), or how many devices would do."""
    cap = min(caps) if caps else math.inf
    for position in range(len(model)):
        if model.memory(position, position + 1) > cap:
            name = model.names[position] if model.names is not None else str(position)
            return (
                [f"node {name} alone needs {model.memory(position, position + 1):.0f} bytes, more than {cap:.0f} (the smallest stage's share of its device's memory)"],
                "How to fix: raise device_memory (more devices cannot help: a stage holds one node at least); or have "
                "each node hold less: more chunks (smaller micro-batches), checkpoint='always', or a smaller batch.",
            )
    count, start = 0, 0
    while start < len(model):
        end = start + 1
        while end < len(model) and model.memory(start, end + 1) <= cap:
            end += 1
        count, start = count + 1, end
    return (
        [f"no cut into {stages} stages fits {cap:.0f} bytes per stage (the smallest stage's share of its device's "
         f"memory); about {count} stages of that size would fit the model"],
        "How to fix: use more devices, or raise device_memory.",
    )


def _best_cuts_keeping(model: CutModel, stages: int, caps: Optional[Sequence[float]], together: dict[str, tuple[int, int]]) -> list[int]:
    """`best_cuts` with no cut inside a span of `together`."""
    inside = {c for first, last in together.values() for c in range(first + 1, last + 1)}
    if not inside:
        return best_cuts(model, stages, caps)
    bounds = [c for c in range(len(model) + 1) if c not in inside]
    if len(bounds) - 1 < stages:
        widest = sorted(together, key=lambda what: together[what][0] - together[what][1])[:3]
        refuse(
            [f"{stages} stages, but only {len(bounds) - 1} runs of nodes keep in one stage each of what must stay in one "
             f"(the widest: {'; '.join(what.rstrip(',') for what in widest)})"],
            "How to fix: use fewer stages: fewer devices, or a smaller stages_per_device.",
        )  # fmt: skip
    cuts = best_cuts(coarsen_at(model, bounds), stages, caps)
    return [bounds[c] for c in cuts]


def split_apart(order: Sequence[fx.Node], cuts: Sequence[int], together: dict[str, tuple[int, int]]) -> list[str]:
    """Each span of `together` that a stage boundary of `cuts` falls inside, as a problem."""
    problems = []
    for what, (first, last) in together.items():
        split = [c for c in cuts if first < c <= last]
        if split:
            problems.append(
                f"{what} runs from {order[first].name} to {order[last].name}, and a stage begins between "
                f"them (at {order[split[0]].name}): split across stages it would not compute what the model does"
            )
    return problems


def over_caps(model: CutModel, lengths: Sequence[int], caps: Optional[Sequence[float]]) -> list[str]:
    """Each stage of `lengths` positions of `model`'s order (in turn) that needs more memory than
    its cap, as a problem."""
    problems, start = [], 0
    for index, (length, cap) in enumerate(zip(lengths, caps or [])):
        needs = model.memory(start, start + length, index)
        if needs > cap:
            problems.append(f"stage {index} needs {needs:.0f} bytes, more than device_memory allows it ({cap:.0f})")
        start += length
    return problems


def mark_stages(runs: Sequence[Sequence[fx.Node]]) -> None:
    """Write each node's stage, its run's index, into `node.meta["stage"]`."""
    for index, run in enumerate(runs):
        for node in run:
            node.meta["stage"] = index


def partition(
    order: Sequence[fx.Node],
    stages: int,
    *,
    split_points: Optional[Sequence[str]] = None,
    balance: Optional[Sequence[int]] = None,
    model: Optional[CutModel] = None,
    caps: Optional[Sequence[float]] = None,
    together: Optional[dict[str, tuple[int, int]]] = None,
    cuts: Optional[Sequence[int]] = None,
) -> list[list[fx.Node]]:
    """Cut the linear order into `stages` runs and write each node's stage into `node.meta`.

    By `split_points` (module names), by `balance` (node counts), or else by `best_cuts` on the
    cost `model` (by default: each node weighs its `size`, parameter plus activation bytes).
    `together` names spans of positions [first, last] that must not be cut (one buffer's writes,
    say), each by what it holds.
    """
    together = together or {}
    if not order:
        refuse(
            ["the graph computes nothing: the model returns its inputs, its own tensors or constants as they are, so there is no work to place on a stage"],
            "How to fix: call the model itself; a pipeline is for a forward that computes something from its inputs.",
        )
    if len(order) < stages:
        refuse(
            [f"{stages} stages but the graph has only {len(order)} nodes to place"],
            "How to fix: use fewer stages (fewer devices, or a smaller stages_per_device), or trace at a finer grain (fewer leaf_modules).",
        )
    conflicts = conflicting_options(split_points, balance)
    if conflicts:
        refuse(conflicts, "How to fix: give one of them.")
    if cuts is not None:
        cuts = _checked_cuts(order, cuts, stages)
    elif split_points is not None:
        cuts = cuts_from_split_points(order, split_points, stages)
    elif balance is not None:
        cuts = cuts_from_balance(order, balance, stages)
    else:
        model = model or CutModel([_weight(node) for node in order], [0.0] * len(order), [0.0] * len(order), [])
        cuts = _best_cuts_keeping(model, stages, caps, together)
    refuse(split_apart(order, cuts, together), "How to fix: choose split points or node counts that keep each of these in one stage.")
    bounds = [0, *cuts, len(order)]
    runs = [list(order[a:b]) for a, b in zip(bounds, bounds[1:])]
    mark_stages(runs)
    return runs


def conflicting_options(split_points: Any, balance: Any) -> list[str]:
    """The cut was asked for twice (a problem for the caller's error list), or nothing."""
    if split_points is not None and balance is not None:
        return ["split_points and balance were both given: give one of them"]
    return []


def _weight(node: fx.Node) -> float:
    """What a node weighs without a cost model: its parameters and output bytes (1 if unknown)."""
    if "param_bytes" not in node.meta:
        return 1.0
    return float(node.meta["param_bytes"] + node.meta.get("bytes", 0))
