"""The plan's stage graph: which stage feeds which, with the values that travel, and its depth."""
from __future__ import annotations

import networkx as nx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxpipe import Plan, compile_pipeline, pipe_split
from helpers import assert_call_and_grads_equal, assert_grads_equal, twin


class Towers(nn.Module):
    """Two towers on the same input, summed, then a head: marked apart, the stages of the two
    towers read only the input, and neither feeds the other."""

    def __init__(self) -> None:
        super().__init__()
        self.a1, self.a2 = nn.Linear(6, 6), nn.Linear(6, 6)
        self.b1, self.b2 = nn.Linear(6, 6), nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a2(torch.tanh(self.a1(x)))
        pipe_split()
        b = self.b2(torch.tanh(self.b1(x)))
        pipe_split()
        return self.head(a + b)


class Skips(nn.Module):
    """A chain whose first layer's output is read again three stages down."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = h = torch.tanh(self.layers[0](x))
        for layer in self.layers[1:]:
            h = torch.tanh(layer(h))
        return h + first


def _edges(plan: Plan) -> dict[tuple[int, int], list[str]]:
    return {(s, t): data["values"] for s, t, data in plan.stage_graph.edges(data=True)}


def test_a_chain_is_its_stages_in_a_row_and_as_deep_as_its_stage_count() -> None:
    pipe = compile_pipeline(nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)]), torch.randn(4, 6), ["cpu"] * 3, chunks=2)
    graph = pipe.plan.stage_graph
    assert sorted(graph.nodes) == [0, 1, 2]  # neither the caller nor the output is a stage
    assert sorted(graph.edges) == [(0, 1), (1, 2)]
    assert all(len(values) == 1 for values in _edges(pipe.plan).values())
    assert pipe.plan.depth == 3
    assert "stage graph: 0->1, 1->2; depth 3 of 3 stages" in pipe.plan.summary()
    pipe.close()


def test_a_skip_is_an_edge_of_its_own_and_names_the_value_it_carries() -> None:
    pipe = compile_pipeline(Skips(), torch.randn(4, 6), ["cpu"] * 4, chunks=2, split_points=["layers.1", "layers.2", "layers.3"])
    edges = _edges(pipe.plan)
    skips = {(e.src, e.dst): e.value for e in pipe.plan.skip_edges}
    assert set(skips) == {(0, 3)}
    assert edges[0, 3] == [skips[0, 3]]  # the stash/pop edge, straight to the stage that reads it
    assert {(0, 1), (1, 2), (2, 3)} <= set(edges)
    assert pipe.plan.depth == 4
    pipe.close()


def test_towers_marked_apart_read_only_the_input_and_the_graph_is_two_deep() -> None:
    model, reference = twin(Towers())
    x = torch.randn(4, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 3, chunks=2)
    assert_call_and_grads_equal(pipe, reference, x)
    graph = pipe.plan.stage_graph
    assert not graph.has_edge(0, 1) and not graph.has_edge(1, 0)  # the towers: side by side
    assert set(graph.predecessors(2)) == {0, 1}
    assert nx.is_directed_acyclic_graph(graph)
    # Tower 0's output jumps over no stage: stage 1 neither reads it nor leads to its reader from
    # it. Before, it was a stash/pop edge by its indices (and drawn dashed).
    assert not pipe.plan.skip_edges and "stash/pop edges: none" in pipe.plan.summary()
    assert {e.kind for e in pipe.plan.edges if e.dst == 2} == {"activation"}
    assert pipe.plan.depth == 2  # each tower, then the sum and the head
    assert "depth 2 of 3 stages" in pipe.plan.summary()
    pipe.close()


def test_one_stage_is_one_deep_with_no_edges() -> None:
    pipe = compile_pipeline(Skips(), torch.randn(4, 6), ["cpu"], chunks=2)
    assert list(pipe.plan.stage_graph.nodes) == [0] and pipe.plan.stage_graph.number_of_edges() == 0
    assert pipe.plan.depth == 1
    pipe.close()


def test_the_stage_graph_is_read_from_the_edges_and_not_kept_in_the_plans_data() -> None:
    """Plans are compared across processes by their data: the graph adds nothing to it."""
    pipe = compile_pipeline(Towers(), torch.randn(4, 6), ["cpu"] * 3, chunks=2)
    assert "stage_graph" not in pipe.plan.to_dict() and "depth" not in pipe.plan.to_dict()
    pipe.close()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_towers_train_exactly_and_1f1b_holds_what_the_depth_needs(schedule: str) -> None:
    """Each tower runs as many micro-batches ahead as the stages after it on the longest path:
    one, not the two a chain's first stage would run."""
    model, reference = twin(Towers())
    x, y = torch.randn(12, 6, dtype=torch.float64), torch.randn(12, 3, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 3, chunks=6, checkpoint="never", schedule=schedule)
    loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    expected = F.mse_loss(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)
    if schedule != "gpipe":
        assert max(pipe.last_most_alive) <= pipe.plan.depth, pipe.last_most_alive
    pipe.close()


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_towers_by_depth_accumulate_recompute_and_recover_from_a_failed_step_as_the_plain_model(schedule: str, checkpoint: str) -> None:
    """Under the depth's warm-up: checkpointed micro-batches, two steps into `.grad`, a step whose
    loss fails in between (nothing added), and the loss alone under no_grad."""
    model, reference = twin(Towers())
    x, y = torch.randn(12, 6, dtype=torch.float64), torch.randn(12, 3, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 3, chunks=6, checkpoint=checkpoint, schedule=schedule)

    def failing(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a loss that fails")

    for step in range(2):
        pipe.train_step(x, target=y, loss_fn=F.mse_loss)
        F.mse_loss(reference(x), y).backward()
        if step == 0:
            with pytest.raises(Exception, match="a loss that fails"):
                pipe.train_step(x, target=y, loss_fn=failing)
    assert_grads_equal(pipe, reference)
    with torch.no_grad():
        loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
        torch.testing.assert_close(loss, F.mse_loss(reference(x), y), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)  # no_grad added nothing
    pipe.close()


class UnevenTowers(nn.Module):
    """Towers of 2 and 4 layers summed, then a head of 3."""

    def __init__(self) -> None:
        super().__init__()
        self.towers = nn.ModuleList(nn.Sequential(*[nn.Linear(16, 16) for _ in range(depth)]) for depth in (2, 4))
        self.head = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(sum(tower(x) for tower in self.towers))


@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b", "gpipe"])
@pytest.mark.parametrize("checkpoint", ["except_last", "never"])
def test_auto_keeps_no_stage_graph_its_plan_predicts_slower_than_the_chain(schedule: str, checkpoint: str) -> None:
    """Before, under zb-h1 'auto' kept a DAG whose plan predicted 2.540 us against the chain's
    2.458: the search ordered zb-h1 without the stages' costs, which the plan's order reads."""
    x = torch.randn(16, 16)
    predicted = {}
    for graph in ("chain", "auto"):
        pipe = compile_pipeline(UnevenTowers(), x, ["cpu"] * 3, chunks=2, schedule=schedule, checkpoint=checkpoint, stage_graph=graph, balance="flops")
        predicted[graph] = pipe.plan.predicted_time()
        pipe.close()
    assert predicted["auto"] <= predicted["chain"] * (1 + 1e-9)
