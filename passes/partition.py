"""Partitioning: cutting the linear order of nodes into one contiguous, non-empty run per stage."""
from __future__ import annotations

import bisect
import itertools
from typing import Optional, Sequence

import torch.fx as fx


class PartitionError(ValueError):
    """The requested cut is impossible; the message lists every problem and the fix."""


def _fail(problems: list[str], fix: str) -> None:
    if problems:
        raise PartitionError("cannot partition the graph:\n" + "\n".join(f"  - {p}" for p in problems) + f"\n{fix}")


def belongs_to(node: fx.Node, module: str) -> bool:
    """Whether `node` runs inside the module with qualified name `module`."""
    scopes = [str(node.meta.get("scope", ""))]
    if node.op == "call_module":
        scopes.append(str(node.target))
    scopes.extend(path for path, _ in node.meta.get("nn_module_stack", {}).values())
    return any(s == module or s.startswith(module + ".") for s in scopes)


def cuts_from_split_points(order: Sequence[fx.Node], split_points: Sequence[str], stages: int) -> list[int]:
    """Indices into `order` where stages 1.. begin: the first node of each named module."""
    problems = []
    if len(split_points) != stages - 1:
        problems.append(f"{len(split_points)} split points for {stages} stages; give one fewer than the devices")
    cuts = []
    for name in split_points:
        first = next((i for i, node in enumerate(order) if belongs_to(node, name)), None)
        if first is None:
            problems.append(f"split point {name!r} is not a module that runs in the traced graph")
        elif first == 0:
            problems.append(f"split point {name!r} is where the graph begins; stage 0 would be empty")
        else:
            cuts.append(first)
    if not problems and any(b <= a for a, b in zip(cuts, cuts[1:])):
        starts = ", ".join(f"{n!r} at node {c}" for n, c in zip(split_points, cuts))
        problems.append(f"split points are out of order ({starts}); list them in the order the model runs them")
    _fail(problems, "How to fix: name, in forward order, the module at which each stage after the first begins.")
    return cuts


def cuts_from_balance(order: Sequence[fx.Node], balance: Sequence[int], stages: int) -> list[int]:
    """Indices into `order` where stages 1.. begin, from a node count per stage."""
    problems = []
    if len(balance) != stages:
        problems.append(f"balance has {len(balance)} entries for {stages} devices")
    if any(not isinstance(b, int) or b < 1 for b in balance):
        problems.append(f"balance {list(balance)} has an entry below 1; every stage needs a node")
    if sum(balance) != len(order):
        problems.append(f"balance sums to {sum(balance)} but the graph has {len(order)} nodes to place")
    _fail(problems, "How to fix: give one positive node count per device, adding up to the node count.")
    return list(itertools.accumulate(balance))[:-1]


def min_max_cuts(weights: Sequence[float], stages: int) -> list[int]:
    """Cut `weights` into `stages` non-empty contiguous runs whose largest sum is the least possible.

    Bisection on the bottleneck with a greedy probe; each probe takes `stages` binary searches
    over the prefix sums, and each step narrows the bracket to a bottleneck actually achieved, so
    the result is the optimum of the given order.
    """
    prefix = [0.0, *itertools.accumulate(float(w) for w in weights)]

    def greedy(limit: float) -> Optional[list[int]]:
        cuts, start = [], 0
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


def partition(
    order: Sequence[fx.Node],
    stages: int,
    *,
    split_points: Optional[Sequence[str]] = None,
    balance: Optional[Sequence[int]] = None,
) -> list[list[fx.Node]]:
    """Cut the linear order into `stages` runs and write each node's stage into `node.meta`.

    By `split_points` (module names), by `balance` (node counts), or else so that the largest
    stage `size` (parameter plus activation bytes, from `annotate_costs`) is the least possible.
    """
    if len(order) < stages:
        _fail(
            [f"{stages} stages but the graph has only {len(order)} nodes to place"],
            "How to fix: use fewer devices, or trace at a finer grain (fewer leaf_modules).",
        )
    if split_points is not None and balance is not None:
        _fail(["both split_points and balance were given"], "How to fix: give one of them.")
    if split_points is not None:
        cuts = cuts_from_split_points(order, split_points, stages)
    elif balance is not None:
        cuts = cuts_from_balance(order, balance, stages)
    else:
        cuts = min_max_cuts([node.meta.get("size", 1) for node in order], stages)
    bounds = [0, *cuts, len(order)]
    runs = [list(order[a:b]) for a, b in zip(bounds, bounds[1:])]
    for index, run in enumerate(runs):
        for node in run:
            node.meta["stage"] = index
    return runs
