"""Branches: the series-parallel structure of a graph's compute nodes, which stage DAGs are cut from.

The compute nodes form a DAG with one virtual source (the caller's inputs) and one sink (the
output). The nodes that every path from source to sink passes through (the sink's dominators)
cut it into a series; between two of them, the nodes fall apart into independent branches
(weakly connected components), each a smaller graph of the same kind:

    x ─┬─ a1 ─ a2 ─┐                  Series[x, Parallel[Series[a1, a2],
       ├─ b1 ─ b2 ─┼─ cat ─ head                        Series[b1, b2],
       └─ c1 ──────┘                                    Series[c1]], cat, head]

A value that goes straight from the entry to the exit (a residual) is an empty branch and is
left out. Cheap joins of independent values (add, cat, stack of branch outputs) float: they are taken out
of the structure and placed later in the stage of their first consumer, so that `a + b + c`,
written as a running sum, does not chain the branches. A region that is neither series nor
parallel stays a series of its nodes in their order, cut as a chain is.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence, Union

import networkx as nx
import torch
import torch.fx as fx


# What a join may be: it combines branch outputs elementwise or by stacking, and costs little.
JOIN_FUNCTIONS = frozenset({operator.add, torch.add, torch.cat, torch.concat, torch.stack, sum})
JOIN_METHODS = frozenset({"add", "__add__"})
SOURCE, SINK = "source", "sink"


@dataclass
class Parallel:
    """Independent branches between one entry and one exit."""

    branches: list["Series"]
    time: float = 0.0

    def nodes(self) -> Iterator[fx.Node]:
        for branch in self.branches:
            yield from branch.nodes()


@dataclass
class Series:
    """Parts run one after another: single nodes, and parallel regions."""

    items: list[Union[fx.Node, Parallel]] = field(default_factory=list)
    time: float = 0.0

    def nodes(self) -> Iterator[fx.Node]:
        for item in self.items:
            if isinstance(item, Parallel):
                yield from item.nodes()
            else:
                yield item

    def regions(self) -> Iterator[Parallel]:
        """Every parallel region, outermost first."""
        for item in self.items:
            if isinstance(item, Parallel):
                yield item
                for branch in item.branches:
                    yield from branch.regions()


@dataclass
class Branches:
    """The structure of a graph's non-join nodes, the joins that float, and the graph it was
    found on (an edge wherever a non-join node reads another, through joins too)."""

    tree: Series
    joins: list[fx.Node]
    flow: nx.DiGraph


@dataclass(frozen=True)
class _Walk:
    """What the decomposition carries down: each node's place in the order, its weight, and the
    least weight of a part worth looking into."""

    position: dict[fx.Node, int]
    weights: dict[fx.Node, float]
    least: float


def is_join(node: fx.Node, position: dict[fx.Node, int]) -> bool:
    """An add, cat or stack of two values or more that the graph makes independently (none
    made from another: `x + f(x)`, a residual, is no join of branches). `position`: a
    topological order of the compute nodes."""
    combines = (node.op == "call_function" and node.target in JOIN_FUNCTIONS) or (
        node.op == "call_method" and node.target in JOIN_METHODS
    )
    made = sorted({n for n in node.all_input_nodes if n in position}, key=position.__getitem__)
    return combines and len(made) >= 2 and not any(_made_from(b, made[:i], position) for i, b in enumerate(made) if i)


def _made_from(node: fx.Node, earlier: list[fx.Node], position: dict[fx.Node, int]) -> bool:
    """Whether `node` is computed from any of `earlier` (nodes before it in the order): a walk
    back from it that stops at nodes before the first of them."""
    targets, first = set(earlier), position[earlier[0]]
    seen, stack = {node}, [node]
    while stack:
        for n in stack.pop().all_input_nodes:
            if n in targets:
                return True
            if n not in seen and position.get(n, -1) > first:
                seen.add(n)
                stack.append(n)
    return False


def find_branches(order: Sequence[fx.Node], weights: dict[fx.Node, float], least: float = 0.0) -> Branches:
    """The series-parallel structure of `order` (compute nodes in a topological order), each
    part carrying the summed `weights` of its nodes. A part that weighs less than `least` is not
    looked into (it stays a series of its nodes in order): no branch of it could weigh more."""
    position = {node: i for i, node in enumerate(order)}
    joins = [node for node in order if is_join(node, position)]
    graph = _flow_graph(order, set(joins))
    tree = _series(graph, SOURCE, SINK, _Walk(position, weights, least))
    _add_times(tree, weights)
    return Branches(tree, joins, graph)


def _flow_graph(order: Sequence[fx.Node], floating: set[fx.Node]) -> nx.DiGraph:
    """The non-join compute nodes, an edge wherever one reads another (through floating joins
    too), from SOURCE to every node that reads none of them and into SINK from every node the
    output reads (through joins too). A node whose value nothing reads (a shape never used)
    leads nowhere: it belongs to the part that makes its inputs."""
    placed = set(order) - floating
    resolved: dict[fx.Node, set[fx.Node]] = {}  # a join -> the placed nodes it combines
    graph = nx.DiGraph()
    graph.add_nodes_from([SOURCE, SINK])
    for node in order:
        producers: set[fx.Node] = set()
        for n in node.all_input_nodes:
            producers |= resolved.get(n, set()) if n in floating else ({n} if n in placed else set())
        if node in floating:
            resolved[node] = producers
            continue
        graph.add_node(node)
        graph.add_edges_from((p, node) for p in producers)
        if not producers:
            graph.add_edge(SOURCE, node)
    for node in placed:
        if any(user.op == "output" for user in node.users) or (floating & set(node.users) and graph.out_degree(node) == 0):
            graph.add_edge(node, SINK)
    return graph


def _series(graph: nx.DiGraph, entry: Any, exit: Any, walk: _Walk) -> Series:
    """The parts of `graph`, whose nodes all lie on paths from `entry` to `exit` (both left out)."""
    inner = [n for n in graph if n is not entry and n is not exit]
    if not inner:
        return Series()
    work = graph.copy() if graph.has_edge(entry, exit) else graph
    if work is not graph:
        work.remove_edge(entry, exit)  # a value passed straight through: an empty branch
    dominators = nx.immediate_dominators(work, entry)
    points = _dominator_chain(dominators, entry, exit)
    if not points:
        return _parallel_or_flat(work, entry, exit, inner, walk, dominators)
    segments: dict[Any, list[fx.Node]] = {p: [] for p in [entry, *points]}
    marks = set(points)
    for node in inner:
        if node in marks:
            continue
        up = dominators[node]
        while up is not entry and up not in marks:
            up = dominators[up]
        segments[up].append(node)
    items: list[Union[fx.Node, Parallel]] = []
    bounds: list[Any] = [entry, *points, exit]
    for start, end in zip(bounds, bounds[1:]):
        if start is not entry:
            items.append(start)
        nodes = segments[start]
        if nodes and sum(walk.weights[n] for n in nodes) < walk.least:
            items.extend(_in_order(nodes, walk).items)
        elif nodes:
            items.extend(_series(work.subgraph([start, *nodes, end]).copy(), start, end, walk).items)
    return Series(items)


def _dominator_chain(dominators: dict[Any, Any], entry: Any, exit: Any) -> list[fx.Node]:
    """The nodes between `entry` and `exit` that dominate `exit`, in the order they run."""
    chain = []
    node = dominators.get(exit, entry)
    while node is not entry:
        chain.append(node)
        node = dominators[node]
    return chain[::-1]


def _parallel_or_flat(graph: nx.DiGraph, entry: Any, exit: Any, inner: list[fx.Node], walk: _Walk, dominators: dict[Any, Any]) -> Series:
    """No node dominates `exit`: independent branches if the nodes fall apart, else branches
    that start at the entry and merge later (a fan-in), else one series of the nodes in their
    order (a region of crossing paths, cut as a chain)."""
    components = list(nx.weakly_connected_components(graph.subgraph(inner)))
    if len(components) == 1:
        return _fan_in(graph, entry, exit, inner, walk, dominators)
    branches = [_series(graph.subgraph([entry, *part, exit]).copy(), entry, exit, walk) for part in components]
    branches.sort(key=lambda b: min(walk.position[n] for n in b.nodes()))
    return Series([Parallel(branches)])


def _fan_in(graph: nx.DiGraph, entry: Any, exit: Any, inner: list[fx.Node], walk: _Walk, dominators: dict[Any, Any]) -> Series:
    """Branches that start at the entry and merge in several places (DLRM's bottom MLP feeds
    its interaction and its top): each node that reads only the entry roots a branch, the nodes
    it dominates, which read nothing else; the rest, which merges them, runs after them all.

        entry ─┬─ bottom ─────┬────────┐
               ├─ bag 1 ── stack ─ bmm ─ cat ─ top         Series[Parallel[bottom, bag 1, bag 2], stack ...]
               └─ bag 2 ──┘
    """
    roots = [n for n in inner if dominators[n] is entry and set(graph.predecessors(n)) == {entry}]
    if len(roots) < 2:
        return _in_order(inner, walk)
    below: dict[Any, list[fx.Node]] = {}
    for node in inner:
        below.setdefault(dominators[node], []).append(node)
    branches, taken = [], set()
    for root in roots:
        nodes, stack = [root], [root]
        while stack:
            children = below.get(stack.pop(), [])
            nodes += children
            stack += children
        taken.update(nodes)
        end = object()  # where the branch's values leave it
        part = graph.subgraph(nodes).copy()
        part.add_edges_from((n, end) for n in nodes if any(s not in part for s in graph.successors(n)))
        branches.append(Series([root, *_series(part, root, end, walk).items]))
    rest = [n for n in inner if n not in taken]
    start = object()  # where the merging part's inputs come from
    after = graph.subgraph([*rest, exit]).copy()
    after.add_edges_from((start, n) for n in rest if any(p not in after for p in graph.predecessors(n)))
    branches.sort(key=lambda b: min(walk.position[n] for n in b.nodes()))
    return Series([Parallel(branches), *_series(after, start, exit, walk).items])


def _in_order(nodes: list[fx.Node], walk: _Walk) -> Series:
    return Series([node for node in sorted(nodes, key=walk.position.__getitem__)])


def _add_times(part: Union[Series, Parallel], weights: dict[fx.Node, float]) -> float:
    """Set every part's `time`, the sum of its nodes' weights; returns it."""
    total = 0.0
    children = part.branches if isinstance(part, Parallel) else part.items
    for child in children:
        total += _add_times(child, weights) if isinstance(child, (Series, Parallel)) else weights[child]
    part.time = total
    return total
