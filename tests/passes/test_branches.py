"""The branch structure of a graph and the stage DAGs cut from it, on graphs built node by node."""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.passes.branches import Parallel, find_branches
from fxpipe.passes.dag_partition import dag_partition, stage_links
from fxpipe.passes.objective import dag_time
from fxpipe.passes.partition import min_max_cuts


class Built:
    """A graph written node by node: `chain` adds tanh nodes, `call` any function."""

    def __init__(self) -> None:
        self.graph = fx.Graph()
        self.x = self.graph.placeholder("x")
        self.weights: dict[fx.Node, float] = {}

    def call(self, target: Any, *args: Any, weight: float = 1.0) -> fx.Node:
        node = self.graph.call_function(target, args)
        self.weights[node] = weight
        return node

    def chain(self, start: fx.Node, length: int, weight: float = 1.0) -> fx.Node:
        for _ in range(length):
            start = self.call(torch.tanh, start, weight=weight)
        return start

    def done(self, out: fx.Node) -> list[fx.Node]:
        self.graph.output(out)
        return [n for n in self.graph.nodes if n.op == "call_function"]


def _towers(lengths: list[int], running_sum: bool = True) -> Built:
    """Towers of `lengths` tanh nodes on x, summed (as `sum(...)` writes it, or stacked), then a head."""
    b = Built()
    ends = [b.chain(b.x, n) for n in lengths]
    if running_sum:
        total = ends[0]
        for end in ends[1:]:
            total = b.call(operator.add, total, end, weight=0.01)
    else:
        total = b.call(torch.sum, b.call(torch.stack, ends, weight=0.01), weight=0.01)
    b.done(b.chain(total, 1))
    return b


def _stages(b: Built, stages: int, chunks: int = 4, force: bool = False) -> list[list[fx.Node]]:
    order = [n for n in b.graph.nodes if n.op == "call_function"]
    runs = dag_partition(order, [b.weights[n] for n in order], stages, chunks, force=force)
    assert runs is not None
    return runs


def test_towers_summed_one_by_one_are_branches_side_by_side_and_the_sum_floats_to_the_head() -> None:
    b = _towers([2, 2, 2, 2])
    order = [n for n in b.graph.nodes if n.op == "call_function"]
    found = find_branches(order, b.weights)
    region = next(found.tree.regions())
    assert len(region.branches) == 4 and all(branch.time == 2 for branch in region.branches)
    assert [j.target for j in found.joins] == [operator.add] * 3  # a running sum chains nothing
    runs = _stages(b, 5)
    assert stage_links(runs) == {(0, 4), (1, 4), (2, 4), (3, 4)}
    assert all(n.target is operator.add for n in runs[4][:3])  # the sum, in the head's stage


def test_a_stacked_sum_is_a_join_too_and_the_dag_beats_the_best_chain() -> None:
    b = _towers([4, 1, 1, 2], running_sum=False)
    runs = _stages(b, 4, chunks=8)
    times = [sum(b.weights[n] for n in run) for run in runs]
    heads = [k for k, run in enumerate(runs) if any(n.target is torch.stack for n in run)]
    assert heads == [3] and max(times) <= 3.02, times  # the towers' 8 nodes in three stages, the head in the last
    order = [n for n in b.graph.nodes if n.op == "call_function"]
    weights = [b.weights[n] for n in order]
    bounds = [0, *min_max_cuts(weights, 4), len(order)]
    chain = [sum(weights[a:e]) for a, e in zip(bounds, bounds[1:])]
    assert dag_time(times, stage_links(runs), 8) < sum(chain) + 7 * max(chain)


def test_a_heavy_branch_is_cut_in_two_and_light_ones_share_a_stage() -> None:
    b = _towers([8, 2, 2, 2])
    runs = _stages(b, 6, chunks=16)
    stage_of = {n: k for k, run in enumerate(runs) for n in run}
    heavy = {stage_of[n] for n in list(b.weights)[:8]}
    light = [{stage_of[n] for n in list(b.weights)[8 + 2 * k : 10 + 2 * k]} for k in range(3)]
    assert len(heavy) >= 2, "the heavy tower spans two stages"
    assert len({s for part in light for s in part}) < 3, "two light towers share a stage"
    times = [sum(b.weights[n] for n in run) for run in runs]
    assert max(times) <= 4.05, times


def test_a_residual_is_no_join_and_a_chain_of_blocks_has_no_region() -> None:
    b = Built()
    h = b.x
    for _ in range(6):
        h = b.call(operator.add, h, b.chain(h, 3))  # x + f(x)
    order = b.done(h)
    found = find_branches(order, b.weights)
    assert found.joins == [] and list(found.tree.regions()) == []
    assert dag_partition(order, [b.weights[n] for n in order], 4, 4) is None


def test_branches_that_merge_in_several_places_are_a_fan_in() -> None:
    """DLRM's shape: a bottom MLP feeds both the interaction and the top; bags feed the interaction."""
    b = Built()
    bottom = b.chain(b.x, 3)
    bags = [b.chain(b.x, 2) for _ in range(3)]
    interaction = b.call(torch.bmm, b.call(torch.stack, [bottom, *bags], weight=0.01), bottom)
    order = b.done(b.chain(b.call(torch.cat, [bottom, interaction], weight=0.01), 2))
    found = find_branches(order, b.weights)
    region = next(found.tree.regions())
    assert sorted(branch.time for branch in region.branches) == [2, 2, 2, 3]


def test_crossing_paths_stay_one_series_in_order() -> None:
    """a feeds p and d; p feeds c and d: no node but a is on every path to the end, and only p
    starts a path from a alone, so nothing runs side by side."""
    b = Built()
    a = b.chain(b.x, 1)
    p = b.call(torch.tanh, a)
    c, d = b.call(torch.tanh, p), b.call(torch.mul, p, a)
    order = b.done(b.call(torch.mul, c, d))
    found = find_branches(order, b.weights)
    assert list(found.tree.regions()) == [] and list(found.tree.nodes()) == order


def test_reading_the_callers_input_ties_no_node_to_another() -> None:
    """The inputs reach every stage from the caller: d reads x besides a, and still runs after a,
    beside c."""
    b = Built()
    a = b.chain(b.x, 1)
    c, d = b.call(torch.tanh, a), b.call(torch.sub, a, b.x)
    order = b.done(b.call(torch.mul, c, d))
    tree = find_branches(order, b.weights).tree
    assert tree.items[0] is a and isinstance(tree.items[1], Parallel) and tree.items[2] is order[-1]


def test_a_chain_of_stages_has_the_chain_formula_and_branches_their_longest_path() -> None:
    times = [3.0, 1.0, 2.0, 4.0]
    assert dag_time(times, {(0, 1), (1, 2), (2, 3)}, 5) == sum(times) + 4 * 4.0
    assert dag_time(times, {(0, 3), (1, 3), (2, 3)}, 5) == 3.0 + 4.0 + 4 * 4.0


@st.composite
def graphs(draw: Any) -> Built:
    """Random graphs: each node a tanh of one earlier value, or an add, cat, stack or mul of two."""
    b = Built()
    values = [b.x]
    for _ in range(draw(st.integers(3, 24))):
        kind = draw(st.sampled_from(["tanh", "tanh", "add", "cat", "stack", "mul"]))
        first = values[draw(st.integers(0, len(values) - 1))]
        second = values[draw(st.integers(0, len(values) - 1))]
        weight = draw(st.sampled_from([0.01, 1.0, 3.0]))
        if kind == "tanh" or first is second:
            values.append(b.call(torch.tanh, first, weight=weight))
        elif kind in ("cat", "stack"):
            values.append(b.call(getattr(torch, kind), [first, second], weight=weight))
        else:
            values.append(b.call(operator.add if kind == "add" else torch.mul, first, second, weight=weight))
    b.done(values[-1] if draw(st.booleans()) else b.call(torch.stack, values[1:], weight=0.01))
    return b


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(b=graphs(), stages=st.integers(2, 6), chunks=st.integers(1, 8))
def test_every_stage_dag_places_each_node_once_and_each_stage_reads_only_stages_before_it(b: Built, stages: int, chunks: int) -> None:
    order = [n for n in b.graph.nodes if n.op == "call_function"]
    if len(order) < stages:
        return
    weights = [b.weights[n] for n in order]
    runs = dag_partition(order, weights, stages, chunks, force=True)
    if runs is None:  # no region of two branches
        assert not list(find_branches(order, b.weights).tree.regions())
        return
    assert len(runs) == stages and all(runs)
    assert sorted(n.name for run in runs for n in run) == sorted(n.name for n in order)
    stage = {n: k for k, run in enumerate(runs) for n in run}
    assert all(stage.get(p, -1) <= stage[n] for n in order for p in n.all_input_nodes)
    for run in runs:  # each stage's nodes in an order that computes them
        seen: set[fx.Node] = set()
        for n in run:
            assert all(p in seen or stage.get(p, -1) < stage[n] for p in n.all_input_nodes)
            seen.add(n)
