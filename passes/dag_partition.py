"""Partitioning into a stage DAG: branches of the model in stages of their own, side by side.

The chain partitioner cuts one linear order; here the stages follow the branch structure
(passes/branches.py). For a bound B on a stage's time, a series is packed greedily into stages
of at most B; a parallel region that does not fit is opened: a branch heavier than B is packed
on its own (cut in several stages), lighter ones share stages, first fit by decreasing time,
and each of those stages reads from the region's entry and feeds its exit, not each other:

    B = 30:   x ─┬─ [tower a] ─┐
                 ├─ [tower b] ─┼─ [sum, head]        4 + 1 stages, 2 deep
                 ├─ [tower c] ─┤
                 └─ [tower d] ─┘

Each B of a sweep, and each rule (open a region only when it does not fit, or always; what
follows the region in a stage of its own, or in the lightest stage that ends a branch) gives a
cut; stages are then split, the slowest first, until there is one per device; the cut with the
least `dag_time` is kept. The stages come out in a topological order of their graph,
so that the rest of the compiler sees runs of one linear order, as from the chain partitioner.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import networkx as nx
import torch.fx as fx

from fxpipe.passes.branches import Branches, Parallel, Series, find_branches
from fxpipe.passes.objective import dag_time

Group = list[fx.Node]
# A region counts when its second-heaviest branch weighs more than this share of a stage's fair
# share of the time: lighter branches cannot shorten a path by enough to pay for a stage.
SIGNIFICANT = 0.25
SWEEP = 24  # bounds on a geometric grid, besides the times of the regions and their branches
# (open every region, or only one that does not fit; what follows a region may join a branch's stage)
RULES = ((False, False), (True, False), (False, True), (True, True))


def dag_partition(order: Sequence[fx.Node], weights: Sequence[float], stages: int, chunks: int, *, force: bool = False) -> Optional[list[Group]]:
    """The stage DAG of least `dag_time` over `order`'s nodes, `stages` runs in a topological
    order of their graph; None when the graph has no parallel region that counts (with `force`,
    any region of two branches or more counts)."""
    weight = dict(zip(order, weights))
    least = 0.0 if force else SIGNIFICANT * sum(weights) / stages
    found = find_branches(order, weight, least)
    total = found.tree.time
    kept = {id(r) for r in found.tree.regions() if _second_heaviest(r) > least or (force and len(r.branches) > 1)}
    if not kept or len(order) < stages:
        return None
    tree = _flattened(found.tree, kept)
    position = {node: i for i, node in enumerate(order)}
    best: Optional[tuple[float, list[Group]]] = None
    for bound in _bounds(tree, weights, total, stages):
        for rule in RULES:
            groups = _pack(tree, bound, rule, weight)
            if len(groups) > stages:
                continue
            filled = _filled(groups, stages, weight, position)
            runs = None if filled is None else _ordered(filled, found, position)
            if runs is None:
                continue
            value = dag_time([sum(weight[n] for n in run) for run in runs], stage_links(runs), chunks)
            if best is None or value < best[0] * (1 - 1e-9):
                best = (value, runs)
    return None if best is None else best[1]


def stage_links(runs: Sequence[Sequence[fx.Node]]) -> set[tuple[int, int]]:
    """(producer, consumer) stage pairs of `runs`: where a node reads one of another stage."""
    stage = {node: k for k, run in enumerate(runs) for node in run}
    return {(stage[p], k) for k, run in enumerate(runs) for node in run for p in node.all_input_nodes if stage.get(p, k) != k}


def _second_heaviest(region: Parallel) -> float:
    times = sorted((b.time for b in region.branches), reverse=True)
    return times[1] if len(times) > 1 else 0.0


def _flattened(series: Series, kept: set[int]) -> Series:
    """`series` with every parallel region not in `kept` laid out as a series of its nodes,
    branch after branch (cut as a chain)."""
    items: list[Union[fx.Node, Parallel]] = []
    for item in series.items:
        if not isinstance(item, Parallel):
            items.append(item)
        elif id(item) in kept:
            items.append(Parallel([_flattened(b, kept) for b in item.branches], item.time))
        else:
            items.extend(item.nodes())
    return Series(items, series.time)


def _bounds(tree: Series, weights: Sequence[float], total: float, stages: int) -> list[float]:
    """The bounds on a stage's time to try: a geometric grid from the least possible to the
    whole, and every region's and branch's time in between (where a region fits exactly)."""
    low = max(max(weights, default=0.0), total / stages)
    if total <= 0:
        return [0.0]
    grid = {low * (total / low) ** (k / (SWEEP - 1)) for k in range(SWEEP)} if low > 0 else {total}
    for region in tree.regions():
        grid.update(t for t in [region.time, *(b.time for b in region.branches)] if low <= t <= total)
    return sorted(grid)


def _pack(series: Series, bound: float, rule: tuple[bool, bool], weight: dict[fx.Node, float]) -> list[Group]:
    """`series` in stages of at most `bound` (a single node heavier than it, alone). `rule`:
    whether to open every region (or only one that does not fit a stage), and whether what
    follows an opened region may join the lightest stage that ends one of its branches."""
    open_all, join_after = rule
    groups: list[Group] = []
    current: Group = []
    used = 0.0
    for item in series.items:
        if isinstance(item, Parallel):
            if not open_all and used + item.time <= bound:
                current.extend(item.nodes())
                used += item.time
                continue
            if current:
                groups.append(current)
            current, used = [], 0.0
            if not open_all and item.time <= bound:
                current, used = list(item.nodes()), item.time
                continue
            opened, ends = _open(item, bound, rule, weight)
            if join_after and ends:
                last = min(ends, key=lambda k: sum(weight[n] for n in opened[k]))
                current = opened.pop(last)
                used = sum(weight[n] for n in current)
            groups.extend(opened)
            continue
        if current and used + weight[item] > bound:
            groups.append(current)
            current, used = [], 0.0
        current.append(item)
        used += weight[item]
    if current:
        groups.append(current)
    return groups


def _open(region: Parallel, bound: float, rule: tuple[bool, bool], weight: dict[fx.Node, float]) -> tuple[list[Group], list[int]]:
    """A region's branches side by side: a heavy one packed on its own, light ones sharing
    stages, first fit by decreasing time; and which of the stages end a branch."""
    groups: list[Group] = []
    ends: list[int] = []
    bins: list[tuple[float, Group]] = []
    for branch in sorted(region.branches, key=lambda b: -b.time):
        if branch.time > bound:
            groups.extend(_pack(branch, bound, rule, weight))
            ends.append(len(groups) - 1)
            continue
        for k, (used, nodes) in enumerate(bins):
            if used + branch.time <= bound:
                bins[k] = (used + branch.time, [*nodes, *branch.nodes()])
                break
        else:
            bins.append((branch.time, list(branch.nodes())))
    ends += range(len(groups), len(groups) + len(bins))
    return groups + [nodes for _, nodes in bins], ends


def _filled(groups: list[Group], stages: int, weight: dict[fx.Node, float], position: dict[fx.Node, int]) -> Optional[list[Group]]:
    """Split the heaviest splittable group at its most even point until there are `stages`;
    None where every group is one node before that (a chain may still cut that many)."""
    groups = [sorted(g, key=position.__getitem__) for g in groups]
    while len(groups) < stages:
        splittable = [k for k, g in enumerate(groups) if len(g) > 1]
        if not splittable:
            return None
        k = max(splittable, key=lambda i: sum(weight[n] for n in groups[i]))
        group = groups[k]
        prefix, total = 0.0, sum(weight[n] for n in group)
        best, cut = math.inf, 1
        for i in range(1, len(group)):
            prefix += weight[group[i - 1]]
            if max(prefix, total - prefix) < best:
                best, cut = max(prefix, total - prefix), i
        groups[k : k + 1] = [group[:cut], group[cut:]]
    return groups


def _ordered(groups: list[Group], found: Branches, position: dict[fx.Node, int]) -> Optional[list[Group]]:
    """The groups in a topological order of the stage graph, each floating join put in the
    stage of its first consumer (or, feeding only the output, of its last producer); None if
    the groups read each other both ways."""
    stage = {node: k for k, g in enumerate(groups) for node in g}
    graph = nx.DiGraph()
    graph.add_nodes_from(range(len(groups)))
    # The groups read each other where their nodes do, through the floating joins too.
    graph.add_edges_from((stage[p], stage[n]) for p, n in found.flow.edges if p in stage and n in stage and stage[p] != stage[n])
    if not nx.is_directed_acyclic_graph(graph):
        return None
    rank = {k: i for i, k in enumerate(nx.lexicographical_topological_sort(graph, key=lambda k: position[groups[k][0]]))}
    runs: list[Group] = [[] for _ in groups]
    for node, k in stage.items():
        runs[rank[k]].append(node)
    for join, at in _join_stages(found.joins, {n: rank[k] for n, k in stage.items()}).items():
        runs[at].append(join)
    runs = [sorted(run, key=position.__getitem__) for run in runs]
    return runs if _reads_only_back(runs) else None


def _join_stages(joins: list[fx.Node], stage: dict[fx.Node, int]) -> dict[fx.Node, int]:
    """Each join's stage: the first of its consumers', or, with none but the output, the last of
    its producers'."""
    floating = set(joins)
    at: dict[fx.Node, float] = {}
    for join in reversed(joins):  # consumers before producers
        at[join] = min((at[u] if u in floating else stage[u] if u in stage else math.inf for u in join.users), default=math.inf)
    for join in joins:
        if math.isinf(at[join]):
            at[join] = max((at[n] if n in floating else stage.get(n, 0) for n in join.all_input_nodes), default=0)
    return {join: int(k) for join, k in at.items()}


def _reads_only_back(runs: list[Group]) -> bool:
    stage = {node: k for k, run in enumerate(runs) for node in run}
    return all(stage.get(n, -1) <= k for k, run in enumerate(runs) for node in run for n in node.all_input_nodes)
