"""Stage DAGs end to end: the cut stage_graph chooses, and multi-branch models trained as the plain model."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxpipe import PartitionError, compile_pipeline, pipe_split
from helpers import assert_call_and_grads_equal, assert_grads_equal, covering, example_module, twin

branches = example_module("branches")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
MODES = ("always", "except_last", "never")


class Towers(nn.Module):
    """Four towers of Linear layers on one input, summed as `sum(...)` writes it, then a head."""

    def __init__(self, width: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.towers = nn.ModuleList(nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]) for _ in range(4))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(sum(tower(x) for tower in self.towers))


def _model(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A multi-branch model of examples/branches.py in float64, without dropout, and its example."""
    kind = branches.MODELS[name]
    model = kind(dropout=0.0) if name != "dlrm" else kind()
    return model.double(), kind.example(8, torch.float64)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _compiled(model: nn.Module, example: Any, schedule: str = "gpipe", **options: Any) -> Any:
    extra: dict[str, Any] = dict(stages_per_device=2) if schedule == "interleaved-1f1b" else {}
    devices = ["cpu"] * (2 if extra else 4)
    return compile_pipeline(model, example, devices, chunks=4, schedule=schedule, stage_graph="dag", balance="flops", **extra, **options)


def test_auto_runs_four_towers_side_by_side_and_a_chain_for_a_model_without_branches() -> None:
    x = torch.randn(16, 64)
    pipes = {sg: compile_pipeline(Towers(), x, ["cpu"] * 5, chunks=4, balance="flops", stage_graph=sg) for sg in ("auto", "chain")}
    assert pipes["auto"].plan.depth == 2 and pipes["chain"].plan.depth == 5
    assert sorted(pipes["auto"].plan.stage_graph.edges) == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert pipes["auto"].plan.predicted_time() < 0.75 * pipes["chain"].plan.predicted_time()
    mlp = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(8)])
    for model in (mlp, example_module("gpt").make_model(n_layer=4, n_embd=16)):
        example = torch.randn(8, 32) if model is mlp else example_module("gpt").make_batch(8)[0]
        plans = [compile_pipeline(copy.deepcopy(model), example, ["cpu"] * 4, chunks=4, stage_graph=sg).plan for sg in ("auto", "chain", "dag")]
        assert plans[0].to_dict() == plans[1].to_dict()
        assert plans[0].depth == plans[2].depth == 4  # 'dag' finds nothing to run side by side
    for pipe in pipes.values():
        pipe.close()


@pytest.mark.parametrize("name,schedule,mode", covering(sorted(branches.MODELS), [SCHEDULES], MODES))
def test_multi_branch_models_train_as_the_plain_model_under_every_schedule_and_checkpoint_mode(name: str, schedule: str, mode: str) -> None:
    """Two train steps into `.grad` (the second on another batch size), then the output in eval
    mode and under no_grad: each model under every schedule and every mode, and the models
    together in every (schedule, mode)."""
    model, example = _model(name)
    reference = copy.deepcopy(model)
    pipe = _compiled(model, example, schedule, checkpoint=mode)
    if name != "dlrm":  # its bags cost no FLOPs: a chain is as fast, and 'dag' finds one
        assert pipe.plan.depth < len(pipe.plan.stages), pipe.plan.summary()
    kind = branches.MODELS[name]
    for batch in (example, kind.example(12, torch.float64)):
        target = torch.randn(batch[0].shape[0], 1 if name != "multimodal" else 64, dtype=torch.float64)
        loss = pipe.train_step(*batch, target=target, loss_fn=_loss)
        expected = _loss(reference(*batch), target)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-10)
    pipe.eval()
    reference.eval()
    torch.testing.assert_close(pipe(*example), reference(*example), rtol=0, atol=1e-12)
    pipe.train()
    reference.train()
    with torch.no_grad():
        torch.testing.assert_close(pipe(*example), reference(*example), rtol=0, atol=1e-12)
    pipe.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_dag_plan_under_autograd_grad_and_autocast_in_every_checkpoint_mode(mode: str) -> None:
    model, example = _model("candle-uno")
    reference = copy.deepcopy(model)
    pipe = _compiled(model, example, checkpoint=mode)
    assert pipe.plan.depth == 2
    assert_call_and_grads_equal(pipe, reference, *example, tol=1e-10)
    floats = tuple(t.float() for t in example)
    model32, reference32 = copy.deepcopy(reference).float(), copy.deepcopy(reference).float()
    pipe32 = _compiled(model32, floats, checkpoint=mode)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = pipe32(*floats), reference32(*floats)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    pipe.close()
    pipe32.close()


def test_dropout_in_branches_draws_the_same_masks_in_every_checkpoint_mode() -> None:
    """Dropout drawing in three encoders side by side: the pipeline against itself across
    checkpoint modes, bit for bit, and against the same model with p = 0 it does differ."""
    base = branches.MultiModal(dropout=0.2).double()
    example = branches.MultiModal.example(8, torch.float64)
    target = torch.randn(8, 64, dtype=torch.float64)
    results = {}
    for mode in MODES:
        model = copy.deepcopy(base)
        pipe = _compiled(model, example, "1f1b", checkpoint=mode)
        torch.manual_seed(7)
        loss = pipe.train_step(*example, target=target, loss_fn=_loss)
        results[mode] = (loss, [p.grad.clone() for p in pipe.parameters()], [s.nodes for s in pipe.plan.stages])
        pipe.close()
    first = results["always"]
    for mode in MODES[1:]:
        assert results[mode][2] == first[2]
        assert torch.equal(results[mode][0], first[0])
        assert all(torch.equal(a, b) for a, b in zip(results[mode][1], first[1]))
    still = copy.deepcopy(base).eval()
    assert not torch.equal(first[0], _loss(still(*example), target))


def test_tied_weights_across_branches_get_one_gradient_the_plain_models() -> None:
    """The text encoder's embedding is the token head's weight: the branch and the head are on
    different stages, and the gradient is their sum, as in the plain model."""
    model, example = _model("multimodal")
    reference = copy.deepcopy(model)
    pipe = _compiled(model, example, "zb-h1", checkpoint="except_last")
    stage_of = {node: s.index for s in pipe.plan.stages for node, module in zip(s.nodes, s.modules) if module in ("tokens", "text.embed", "token_head")}
    assert len(set(stage_of.values())) == 2, stage_of
    assert_call_and_grads_equal(pipe, reference, *example, tol=1e-10)
    pipe.close()


def test_gradients_accumulate_over_calls_as_in_the_plain_model() -> None:
    model, example = _model("candle-uno")
    reference = copy.deepcopy(model)
    pipe = _compiled(model, example)
    for _ in range(3):
        pipe(*example).square().mean().backward()
        reference(*example).square().mean().backward()
    assert_grads_equal(pipe, reference, tol=1e-10)
    pipe.close()


def test_bad_stage_graph_arguments_are_refused_with_the_fix() -> None:
    x = torch.randn(8, 64)
    with pytest.raises(ValueError, match=r"stage_graph must be one of 'auto', 'chain', 'dag' \(got 'tree'\)"):
        compile_pipeline(Towers(), x, ["cpu"] * 2, stage_graph="tree")
    with pytest.raises(ValueError, match="stage_graph='dag' searches the cut, and split_points gives one by hand"):
        compile_pipeline(Towers(), x, ["cpu"] * 2, stage_graph="dag", split_points=["towers.1"])
    with pytest.raises(ValueError, match=r"stage_graph='dag' searches the cut, and balance \(node counts\)"):
        compile_pipeline(Towers(), x, ["cpu"] * 2, stage_graph="dag", balance=[10, 10])

    class Marked(Towers):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = self.towers[0](x)
            pipe_split()
            return self.head(a + self.towers[1](x))

    with pytest.raises(PartitionError, match=r"pipe_split\(\), and stage_graph='dag' searches the cut"):
        compile_pipeline(Marked(), x, ["cpu"] * 2, stage_graph="dag")


def test_a_graph_whose_writes_need_the_traced_order_is_cut_as_the_chain() -> None:
    """Each tower counts its calls in one shared buffer, and reads the count: the order of the
    writes is the traced one, so the stages follow it, as the chain's do."""

    class Counted(Towers):
        calls: torch.Tensor

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            outs = []
            for tower in self.towers:
                self.calls.add_(1)
                outs.append(tower(x) + self.calls)
            return self.head(torch.stack(outs).sum(0))

    model, reference = twin(Counted())
    x = torch.randn(8, 64, dtype=torch.float64)
    chain = compile_pipeline(copy.deepcopy(model), x, ["cpu"] * 5, stage_graph="chain", balance="flops")
    pipe = compile_pipeline(model, x, ["cpu"] * 5, stage_graph="dag", balance="flops")
    assert pipe.plan.to_dict() == chain.plan.to_dict()
    assert_call_and_grads_equal(pipe, reference, x, tol=1e-10)
    assert torch.equal(model.calls, reference.calls)
    pipe.close()
    chain.close()


def test_the_gantt_chart_puts_workers_of_one_level_in_one_band() -> None:
    model, example = _model("candle-uno")
    pipe = _compiled(model, example, "1f1b")
    pipe.train_step(*example, target=torch.randn(8, 1, dtype=torch.float64), loss_fn=_loss)
    timeline = pipe.timeline()
    assert timeline.levels == {0: 0, 1: 0, 2: 0, 3: 1}
    svg = timeline.to_svg(predicted=pipe.plan.prediction().timeline)
    assert svg.count("· level 0") == 6 and svg.count("· level 1") == 2  # measured and predicted
    assert svg.count('fill="#f2f2f2"') == 2  # one band of three concurrent workers in each chart
    pipe.close()


def test_the_plan_summary_and_picture_show_the_branches() -> None:
    model, example = _model("candle-uno")
    pipe = _compiled(model, example)
    assert "stage graph: 0->3, 1->3, 2->3; depth 2 of 4 stages" in pipe.plan.summary()
    svg = pipe.to_svg()
    assert all(f"stage {k}" in svg for k in range(4))
    pipe.close()



class TwoHeads(nn.Module):
    """A trunk and two heads on it, each an output: the graph fans out and never joins."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.a, self.b = (nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)]) for _ in range(3))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.trunk(x)
        return {"a": self.a(h), "b": self.b(h)}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_two_heads_run_side_by_side_after_the_trunk_and_the_loss_waits_for_both(schedule: str) -> None:
    model, reference = twin(TwoHeads())
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)

    def loss_fn(out: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out["a"], target) + F.mse_loss(out["b"], target)

    pipe = compile_pipeline(model, x, ["cpu"] * 3, chunks=4, stage_graph="dag", balance="flops", schedule=schedule)
    assert sorted(pipe.plan.stage_graph.edges) == [(0, 1), (0, 2)]
    loss = pipe.train_step(x, target=y, loss_fn=loss_fn)
    expected = loss_fn(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)
    pipe.close()


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_two_forwards_before_one_backward_and_a_step_after_a_failed_one_as_the_plain_model(schedule: str) -> None:
    """On the searched DAG: two calls, one backward of their sum; then a train step whose loss
    raises (nothing added to `.grad`), and a second step that adds what the plain model's does."""
    model, example = _model("candle-uno")
    reference = copy.deepcopy(model)
    pipe = _compiled(model, example, schedule, checkpoint="except_last")
    assert pipe.plan.depth < len(pipe.plan.stages)
    other = branches.CandleUno.example(12, torch.float64)
    (pipe(*example).square().mean() + pipe(*other).abs().mean()).backward()
    (reference(*example).square().mean() + reference(*other).abs().mean()).backward()
    assert_grads_equal(pipe, reference, tol=1e-10)

    def failing(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a loss that fails")

    target = torch.randn(8, 1, dtype=torch.float64)
    with pytest.raises(Exception, match="a loss that fails"):
        pipe.train_step(*example, target=target, loss_fn=failing)
    assert_grads_equal(pipe, reference, tol=1e-10)
    loss = pipe.train_step(*example, target=target, loss_fn=_loss)
    expected = _loss(reference(*example), target)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-10)
    pipe.close()


class _SummedTowers(nn.Module):
    """Four towers added one by one (a running sum: nested regions of two branches), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(4))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(sum(t(x) for t in self.towers)) + x[:, :3]


def test_dag_keeps_the_best_stage_graph_the_search_finds_and_2bw_runs_it() -> None:
    """Before, 'dag' kept every region of two branches of the running sum: a depth-3 graph with a
    stage of nothing (predicted 0.232 against 'auto''s 0.143), which 2bw then refused at chunks=2."""
    x = torch.randn(8, 8)
    plans = {graph: compile_pipeline(_SummedTowers(), x, ["cpu"] * 5, chunks=2, stage_graph=graph, balance="flops").plan for graph in ("dag", "auto")}
    assert plans["dag"].depth == plans["auto"].depth == 2
    assert plans["dag"].predicted_time() <= plans["auto"].predicted_time() * (1 + 1e-9)
    model, plain = twin(_SummedTowers().double())
    batches = [(torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)) for _ in range(3)]
    pipe = compile_pipeline(model, batches[0][0], ["cpu"] * 5, chunks=2, schedule="2bw", stage_graph="dag", balance="flops")
    losses = list(pipe.train_steps(batches, loss_fn=F.mse_loss, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.0)))
    torch.testing.assert_close(torch.stack(losses), torch.stack([F.mse_loss(plain(x), y).detach() for x, y in batches]), rtol=0, atol=1e-12)


class _UnevenTowers(nn.Module):
    """Six layers beside one, summed: a chain on five devices is five deep, the DAG four."""

    def __init__(self) -> None:
        super().__init__()

        def tower(n: int) -> nn.Sequential:
            return nn.Sequential(*(m for _ in range(n) for m in (nn.Linear(8, 8), nn.Tanh())))

        self.towers = nn.ModuleList([tower(6), tower(1)])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(sum(t(x) for t in self.towers))


def test_auto_under_2bw_keeps_a_stage_graph_2bw_can_run() -> None:
    """Before, 'auto' kept the chain on a tie of predicted times, five deep, which 2bw refused at
    chunks=4, advising more chunks, where the DAG it found, four deep, runs."""
    model, plain = twin(_UnevenTowers())
    batches = [(torch.randn(16, 8, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)) for _ in range(3)]
    pipe = compile_pipeline(model, batches[0][0], ["cpu"] * 5, chunks=4, schedule="2bw", balance="flops")
    assert pipe.plan.depth == 4
    losses = list(pipe.train_steps(batches, loss_fn=F.mse_loss, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.0)))
    torch.testing.assert_close(torch.stack(losses), torch.stack([F.mse_loss(plain(x), y).detach() for x, y in batches]), rtol=0, atol=1e-12)
    pipe.close()


class _TwoHeadsAdded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.j, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.c(h) + self.j(h)


@pytest.mark.parametrize("stage_graph", ["auto", "dag"])
def test_a_branching_graph_of_as_many_nodes_as_stages_is_cut(stage_graph: str) -> None:
    """Before, the graph search ran out of groups to split and raised its own 'max() arg is an
    empty sequence'."""
    model, reference = twin(_TwoHeadsAdded())
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 4, chunks=4, stage_graph=stage_graph)
    assert_call_and_grads_equal(pipe, reference, x)
