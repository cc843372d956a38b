"""The passes one by one: plans and edges, partitioning, min-max cuts, codegen, tracing, shapes."""
from __future__ import annotations

import copy
import itertools
import math
import random
from typing import Any, Sequence

import networkx as nx
import pytest
import torch
import torch.fx as fx
from torch import nn

from helpers import assert_grads_equal, twin
from fxpipe import Pipeline, TraceError, compile_pipeline
from fxpipe.passes.linearize import linearize
from fxpipe.passes.partition import PartitionError, belongs_to, min_max_cuts, partition
from fxpipe.passes.shapes import propagate_shapes
from fxpipe.tracing.trace import trace

WIDTH = 4


# -- helpers -------------------------------------------------------------------------------------
def linears(n: int, width: int = WIDTH) -> nn.ModuleList:
    return nn.ModuleList(nn.Linear(width, width) for _ in range(n))


def compiled(model: nn.Module, x: Any, balance: Sequence[int], **kwargs: Any) -> tuple[Pipeline, nn.Module]:
    """The model in float64 cut by `balance`, and an untouched float64 copy for reference."""
    model, reference = twin(model)
    pipe = compile_pipeline(model, x, ["cpu"] * len(balance), balance=list(balance), **kwargs)
    return pipe, reference


def edges_of(pipe: Pipeline, value: str) -> list[tuple[int, int, str]]:
    return [(e.src, e.dst, e.kind) for e in pipe.plan.edges if e.value == value]


def placeholders(gm: fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"]


def assert_same_output(pipe: Pipeline, reference: nn.Module, x: Any, tol: float = 1e-12) -> None:
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=tol)


def x64(batch: int = 5, width: int = WIDTH) -> torch.Tensor:
    return torch.randn(batch, width, dtype=torch.float64)


# -- 1. plans of hand-built models -----------------------------------------------------------------
class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = linears(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class SkipTwice(nn.Module):
    """`a` (stage 0) is used in stages 2 and 3 of 4 with balance [2, 1, 2, 2], not in stage 1."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.l2, self.l3, self.l4 = linears(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.l0(x)
        b = self.l1(a)
        c = self.l2(b)
        d = self.l3(c) + a
        return self.l4(d) * a


class InputTwice(nn.Module):
    """The input `x` is used in stages 0 and 2 of 3 with balance [1, 1, 2]."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.l2 = linears(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.l1(self.l0(x))) + x


class TwoOutputs(nn.Module):
    """Returns the stage-0 intermediate `l0` too, with balance [1, 1, 1]."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.l2 = linears(3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.l0(x)
        return self.l2(self.l1(a)), a


def test_chain_has_only_activation_edges() -> None:
    pipe, reference = compiled(Chain(), x64(), [2, 3, 3])
    assert [len(s.nodes) for s in pipe.plan.stages] == [2, 3, 3]
    assert pipe.plan.skip_edges == []
    kinds = [(e.src, e.dst, e.kind) for e in pipe.plan.edges]
    assert kinds == [(-1, 0, "input"), (0, 1, "activation"), (1, 2, "activation"), (2, 3, "output")]
    assert "stash/pop edges: none" in pipe.plan.summary()
    assert_same_output(pipe, reference, x64())


def test_fan_out_skips_straight_to_each_user() -> None:
    pipe, reference = compiled(SkipTwice(), x64(), [2, 1, 2, 2])
    assert edges_of(pipe, "l0") == [(0, 2, "skip"), (0, 3, "skip")]
    assert [(e.value, e.src, e.dst) for e in pipe.plan.skip_edges] == [("l0", 0, 2), ("l0", 0, 3)]
    middle = pipe.plan.stages[1]
    assert middle.inputs == ["l1"] and middle.outputs == ["l2"]
    assert placeholders(pipe.stages[1]) == ["l1"]
    assert pipe.plan.stages[0].outputs == ["l0", "l1"]
    assert "l0" in placeholders(pipe.stages[2]) and "l0" in placeholders(pipe.stages[3])
    assert "l0 0->2, l0 0->3" in pipe.plan.summary()
    assert_same_output(pipe, reference, x64())


def test_input_goes_only_to_the_stages_that_use_it() -> None:
    pipe, reference = compiled(InputTwice(), x64(), [1, 1, 2])
    assert edges_of(pipe, "x") == [(-1, 0, "input"), (-1, 2, "input")]
    assert "x" not in pipe.plan.stages[1].inputs
    assert placeholders(pipe.stages[1]) == ["l0"]
    assert placeholders(pipe.stages[2]) == ["x", "l1"]
    assert_same_output(pipe, reference, x64())


def test_intermediate_output_is_an_output_edge() -> None:
    pipe, reference = compiled(TwoOutputs(), x64(), [1, 1, 1])
    assert edges_of(pipe, "l0") == [(0, 1, "activation"), (0, 3, "output")]
    assert pipe.plan.stages[0].outputs == ["l0"]
    assert pipe.plan.to_dict()["edges"][-1]["kind"] == "output"
    assert_same_output(pipe, reference, x64())


# -- 2. random DAG models ------------------------------------------------------------------------
class RandomDag(nn.Module):
    """Layer i adds 1-2 earlier values (0 is the input), then applies tanh(Linear)."""

    def __init__(self, picks: list[tuple[int, ...]], returns: tuple[int, ...]) -> None:
        super().__init__()
        self.picks, self.returns = picks, returns
        self.layers = linears(len(picks))

    def forward(self, x: torch.Tensor) -> Any:
        values = [x]
        for layer, pick in zip(self.layers, self.picks):
            h = values[pick[0]]
            for j in pick[1:]:
                h = h + values[j]
            values.append(torch.tanh(layer(h)))
        if len(self.returns) == 1:
            return values[self.returns[0]]
        return tuple(values[i] for i in self.returns)


def random_dag(rng: random.Random) -> RandomDag:
    layers = rng.randint(3, 9)
    picks = [tuple(rng.sample(range(i + 1), min(i + 1, rng.randint(1, 2)))) for i in range(layers)]
    returns = (layers,) if rng.random() < 0.6 else (layers, rng.randint(1, layers - 1))
    return RandomDag(picks, returns)


def random_balance(rng: random.Random, nodes: int, stages: int) -> list[int]:
    cuts = sorted(rng.sample(range(1, nodes), stages - 1))
    bounds = [0, *cuts, nodes]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def stage_of(node: fx.Node, stages: int) -> int:
    if node.op == "placeholder":
        return -1
    return stages if node.op == "output" else int(node.meta["stage"])


@pytest.mark.parametrize("seed", range(30))
def test_random_dag_invariants(seed: int) -> None:
    rng = random.Random(seed)
    model = random_dag(rng)
    x = x64(6)
    nodes = len(linearize(trace(model)))
    stages = rng.randint(1, min(5, nodes))
    pipe, reference = compiled(model, x, random_balance(rng, nodes, stages), chunks=rng.randint(1, 3))
    gm, runs, codes = pipe.program().graph, pipe.program().runs, pipe.program().stages
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for k, (run, code) in enumerate(zip(runs, codes)):
        consumed = {a.name for n in run for a in n.all_input_nodes if a.op != "get_attr" and stage_of(a, stages) != k}
        assert placeholders(pipe.stages[k]) == code.inputs  # no shared tensors in these models
        assert set(code.inputs) == consumed and len(code.inputs) == len(consumed)
        assert code.inputs == pipe.plan.stages[k].inputs and code.outputs == pipe.plan.stages[k].outputs
        used_later = {n.name for n in run if any(stage_of(u, stages) > k for u in n.users)}
        assert set(code.outputs) == used_later
    graph = pipe.plan.stage_graph
    for e in pipe.plan.edges:
        assert e.src < e.dst
        # A skip jumps over a stage: one that e.src feeds and that leads on to e.dst.
        jumps = e.src >= 0 and e.dst < stages and any(nx.has_path(graph, m, e.dst) for m in graph.successors(e.src) if m != e.dst)
        expected = "input" if e.src == -1 else "output" if e.dst == stages else "skip" if jumps else "activation"
        assert e.kind == expected, e
        node = next(n for n in gm.graph.nodes if n.name == e.value)
        assert any(stage_of(u, stages) == e.dst for u in node.users) or (e.dst == stages and node in output.all_input_nodes)
    assert len({(e.value, e.dst) for e in pipe.plan.edges}) == len(pipe.plan.edges)
    assert_same_output(pipe, reference, x)
    pipe.close()


# -- 3. min_max_cuts against brute force ---------------------------------------------------------
def bottleneck(weights: Sequence[float], cuts: Sequence[int]) -> float:
    bounds = [0, *cuts, len(weights)]
    return max(math.fsum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))


def best_bottleneck(weights: Sequence[float], stages: int) -> float:
    return min(bottleneck(weights, cuts) for cuts in itertools.combinations(range(1, len(weights)), stages - 1))


def assert_valid_cuts(cuts: list[int], length: int, stages: int) -> None:
    assert len(cuts) == stages - 1, cuts
    assert all(1 <= c <= length - 1 for c in cuts), cuts
    assert all(a < b for a, b in zip(cuts, cuts[1:])), cuts


@pytest.mark.parametrize("floats", [False, True])
def test_min_max_cuts_matches_brute_force(floats: bool) -> None:
    rng = random.Random(1234 + floats)
    for _ in range(1000):
        length = rng.randint(4, 12)
        stages = rng.randint(2, min(5, length))
        if floats:
            weights: list[float] = [rng.random() * 10 ** rng.uniform(-3, 3) for _ in range(length)]
        else:
            weights = [rng.randint(0, 20) for _ in range(length)]
        cuts = min_max_cuts(weights, stages)
        assert_valid_cuts(cuts, length, stages)
        got, best = bottleneck(weights, cuts), best_bottleneck(weights, stages)
        if floats:
            assert got == pytest.approx(best, rel=1e-12, abs=0), (weights, stages, cuts)
        else:
            assert got == best, (weights, stages, cuts)


@pytest.mark.parametrize(
    "weights,stages,best",
    [
        ([1, 1, 10**6, 1, 1], 3, 10**6),
        ([10**6, 1, 1, 1], 3, 10**6),
        ([1, 2, 3, 10**9], 2, 10**9),
        ([0] * 7, 3, 0),
        ([0, 0, 0, 5], 4, 5),
        ([3, 1, 4, 1, 5], 5, 5),
        ([7] * 9, 9, 7),
    ],
)
def test_min_max_cuts_edge_cases(weights: list[int], stages: int, best: int) -> None:
    cuts = min_max_cuts(weights, stages)
    assert_valid_cuts(cuts, len(weights), stages)
    assert bottleneck(weights, cuts) == best


def test_min_max_cuts_stages_equal_length_cuts_everywhere() -> None:
    assert min_max_cuts([5, 0, 2, 9, 1, 1], 6) == [1, 2, 3, 4, 5]
    assert min_max_cuts([4, 4], 1) == []


# -- 4. partition -------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Blocks(nn.Module):
    """Four blocks of two nodes each (Linear, tanh): eight nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.b0, self.b1, self.b2, self.b3 = (Block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b3(self.b2(self.b1(self.b0(x))))


def blocks_order() -> list[fx.Node]:
    return linearize(trace(Blocks()))


def test_split_points_cut_at_first_node_of_module() -> None:
    order = blocks_order()
    runs = partition(order, 3, split_points=["b1", "b3"])
    assert [len(r) for r in runs] == [2, 4, 2]
    assert runs[1][0].target == "b1.lin" and runs[2][0].target == "b3.lin"
    assert not belongs_to(runs[0][-1], "b1") and belongs_to(runs[1][0], "b1")
    assert [n.meta["stage"] for n in order] == [0, 0, 1, 1, 1, 1, 2, 2]


def test_split_point_may_name_a_nested_module() -> None:
    runs = partition(blocks_order(), 2, split_points=["b2.lin"])
    assert [len(r) for r in runs] == [4, 4] and runs[1][0].target == "b2.lin"


def test_split_points_through_compile_pipeline() -> None:
    model, reference = twin(Blocks())
    pipe = compile_pipeline(model, x64(), ["cpu"] * 2, split_points=["b2"])
    assert pipe.plan.stages[1].nodes == ["b2_lin", "tanh_2", "b3_lin", "tanh_3"]
    assert pipe.plan.stages[1].modules[0] == "b2.lin"
    assert_same_output(pipe, reference, x64())


@pytest.mark.parametrize(
    "stages,kwargs,message",
    [
        (3, {"split_points": ["b3", "b1"]}, r"split points are out of order \('b3' at node 6, 'b1' at node 2\)"),
        (3, {"split_points": ["b1", "b1"]}, r"'b1' named more than once in split_points"),
        (2, {"split_points": ["nope"]}, r"split point 'nope' is not a module that runs in the traced graph"),
        (2, {"split_points": ["b0"]}, r"split point 'b0' is where the graph begins; stage 0 would be empty"),
        (3, {"split_points": ["b1"]}, r"1 split points for 3 stages; give one fewer than the stages"),
        (2, {"balance": [3, 4]}, r"balance sums to 7 but the graph has 8 nodes to place"),
        (3, {"balance": [0, 4, 4]}, r"balance \[0, 4, 4\] has an entry below 1"),
        (2, {"balance": [2, 2, 4]}, r"balance has 3 entries for 2 stages"),
        (2, {"balance": [4, 4], "split_points": ["b2"]}, r"split_points and balance were both given"),
        (9, {}, r"9 stages but the graph has only 8 nodes to place"),
    ],
)
def test_partition_errors_name_the_problem(stages: int, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(PartitionError, match=message):
        partition(blocks_order(), stages, **kwargs)


@pytest.mark.parametrize(
    "devices,kwargs,error,message",
    [
        (2, {"balance": [4, 4], "split_points": ["b2"]}, ValueError, r"split_points and balance were both given"),
        (0, {}, ValueError, r"devices is empty"),
        (2, {"chunks": 0}, ValueError, r"chunks must be a whole number of micro-batches, at least 1 \(got 0\)"),
        (2, {"checkpoint": "sometimes"}, ValueError, r"checkpoint must be one of .* \(got 'sometimes'\)"),
        (3, {"balance": [4, 4]}, ValueError, r"balance has 2 entries for 3 stages"),
        (2, {"split_points": ["b9"]}, PartitionError, r"split point 'b9' is not a module"),
    ],
)
def test_compile_pipeline_argument_errors(devices: int, kwargs: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        compile_pipeline(Blocks(), torch.randn(2, WIDTH), ["cpu"] * devices, **kwargs)


# -- 5. codegen ---------------------------------------------------------------------------------
class InplaceAfterCut(nn.Module):
    """With balance [1, 3], stage 1 starts with an in-place ReLU on the value it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1 = linears(2)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.l1(self.relu(self.l0(x))))


@pytest.mark.parametrize("mode", ["always", "never"])
def test_inplace_on_received_value_is_cloned(mode: str) -> None:
    pipe, reference = compiled(InplaceAfterCut(), x64(), [1, 3], chunks=2, checkpoint=mode)
    assert pipe.program().stages[1].inputs == ["l0"]
    assert "clone_tree(l0)" in pipe.stages[1].code
    assert "clone" not in pipe.stages[0].code
    x = x64(6)
    out, expected = pipe(x), reference(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    assert_grads_equal(pipe, reference, tol=1e-12)


class InplaceOnSkip(nn.Module):
    """`a` is made in stage 0, ReLU'd in place in stage 1, and read (ReLU'd) again in stage 2."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.l2 = linears(3)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.l0(x)
        b = self.relu(a)  # b is a: both hold relu(l0(x)) from here on
        return self.l2(self.l1(b)) + a


def test_inplace_on_received_value_is_seen_by_later_stage() -> None:
    pipe, reference = compiled(InplaceOnSkip(), x64(), [1, 2, 2])
    # The read after the write reads the writer's result, which stage 1 sends on.
    assert edges_of(pipe, "l0") == [(0, 1, "activation")]
    assert edges_of(pipe, "relu") == [(1, 2, "activation")]
    assert_same_output(pipe, reference, x64())


class TiedHead(nn.Module):
    """The head's weight is the embedding's: read in stage 0 and in stage 2 with balance [2, 2, 2]."""

    def __init__(self, vocab: int = 11, width: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.l1, self.l2 = linears(2, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.l1(self.emb(ids))
        h = self.l2(torch.tanh(h))
        return self.head(torch.tanh(h))


@pytest.mark.parametrize("mode", ["always", "never"])
def test_tied_weight_is_shared_and_its_gradient_summed(mode: str) -> None:
    ids = torch.randint(0, 11, (4, 3))
    pipe, reference = compiled(TiedHead(), ids, [2, 2, 2], chunks=2, checkpoint=mode)
    assert isinstance(pipe.emb, nn.Embedding) and isinstance(pipe.head, nn.Linear)
    assert [[t is pipe.emb.weight for t in shared] for shared in pipe.program().shared] == [[True], [], [True]]
    assert placeholders(pipe.stages[2])[-1] == "shared_emb_weight"
    tied = [name for name, p in pipe.named_parameters() if p is pipe.emb.weight]
    assert tied == ["emb.weight"] and pipe.head.weight is pipe.emb.weight
    out, expected = pipe(ids), reference(ids)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    assert_grads_equal(pipe, reference, tol=1e-12)


class ReturnsBuffer(nn.Module):
    scale: torch.Tensor  # a buffer, registered in __init__

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1 = linears(2)
        self.register_buffer("scale", torch.full((WIDTH,), 2.0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.l1(self.l0(x)) * self.scale, self.scale


def test_buffer_returned_as_output() -> None:
    pipe, reference = compiled(ReturnsBuffer(), x64(), [1, 2])
    assert_same_output(pipe, reference, x64())


def test_each_stage_s_code_is_generated_once_after_the_passes_that_rewrite_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a pipeline generates each stage's Python once, with the random-op rewrite in
    it (the rewrite used to generate it a second time), and nothing is left to generate on a
    worker's first call."""
    generated: list[str] = []
    real = fx.GraphModule.recompile

    def counted(gm: fx.GraphModule) -> Any:
        generated.append(gm.__class__.__name__)
        return real(gm)

    monkeypatch.setattr(fx.GraphModule, "recompile", counted)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.3), nn.Linear(WIDTH, WIDTH), nn.Dropout(0.2))
    pipe = compile_pipeline(model, x64().float(), ["cpu"] * 2, balance=[2, 2])
    assert generated.count("Stage0") == 1 and generated.count("Stage1") == 1, generated
    assert all("dropout_module" in stage.code for stage in pipe.stages)
    pipe(x64().float())
    assert generated.count("Stage0") == 1 and generated.count("Stage1") == 1, generated


# -- 6. trace -----------------------------------------------------------------------------------
class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.lin(x)
        return -self.lin(x)


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(WIDTH, WIDTH)
        self.enc = nn.Sequential(nn.Linear(WIDTH, WIDTH), Gate())
        self.post = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(torch.tanh(self.enc(self.pre(x))))


def test_trace_error_names_the_submodule_and_suggests_leaf() -> None:
    with pytest.raises(TraceError, match=r"in module: enc\.1\b") as info:
        trace(Gated())
    assert "leaf_modules=['enc.1']" in str(info.value)
    assert "test_passes.py" in str(info.value) and "x.sum() > 0" in str(info.value)


@pytest.mark.parametrize("leaf", ["enc.1", Gate])
def test_leaf_module_makes_it_traceable(leaf: Any) -> None:
    gm = trace(Gated(), leaf_modules=[leaf])
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["pre", "enc.0", "enc.1", "post"]
    model, reference = twin(Gated())
    # An example whose micro-batches take the whole batch's branch (compiling compares them).
    example = x64().abs() + 5
    pipe = compile_pipeline(model, example, ["cpu"] * 3, leaf_modules=[leaf], chunks=2)
    for sign in (1, -1):  # both branches, decided per micro-batch inside the leaf
        x = sign * (x64(6).abs() + 5)
        assert_same_output(pipe, reference, x)


# -- 7. propagate_shapes ------------------------------------------------------------------------
class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, 6)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.lin(x)
        left, right = h.chunk(2, dim=1)
        idx = right.argmax(dim=1)
        return left.float(), idx, x.size(0)


class Positives(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[x > 0]


def real_values(gm: fx.GraphModule, *args: Any) -> dict[str, Any]:
    values: dict[str, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            values[n.name] = super().run_node(n)
            return values[n.name]

    Recorder(gm).run(*args)
    return values


def test_shapes_dtypes_and_bytes_match_real_outputs() -> None:
    gm = trace(Mixed().double())
    x = x64(5)
    propagate_shapes(gm, (x,))
    meta = {n.name: n.meta for n in gm.graph.nodes}
    assert (meta["x"]["shape"], meta["x"]["dtype"], meta["x"]["bytes"]) == ((5, 4), torch.float64, 160)
    assert (meta["lin"]["shape"], meta["lin"]["dtype"], meta["lin"]["bytes"]) == ((5, 6), torch.float64, 240)
    assert meta["chunk"]["shape"] == ((5, 3), (5, 3)) and meta["chunk"]["bytes"] == 240
    assert meta["chunk"]["dtype"] == (torch.float64, torch.float64)
    assert (meta["argmax"]["shape"], meta["argmax"]["dtype"], meta["argmax"]["bytes"]) == ((5,), torch.int64, 40)
    assert (meta["float_1"]["dtype"], meta["float_1"]["bytes"]) == (torch.float32, 60)
    assert meta["size"]["shape"] is None and meta["size"]["bytes"] == 0
    for name, value in real_values(gm, x).items():
        if isinstance(value, torch.Tensor):
            assert meta[name]["shape"] == tuple(value.shape), name
            assert meta[name]["dtype"] == value.dtype, name
            assert meta[name]["bytes"] == value.numel() * value.element_size(), name


def test_shapes_of_data_dependent_leaf_come_from_a_real_run() -> None:
    gm = trace(nn.Sequential(nn.Identity(), Positives()), leaf_modules=[Positives])
    x = torch.tensor([[1.0, -2.0, 3.0], [-4.0, 5.0, 6.0]], dtype=torch.float64)
    propagate_shapes(gm, (x,))
    node = next(n for n in gm.graph.nodes if n.target == "1")
    assert (node.meta["shape"], node.meta["dtype"], node.meta["bytes"]) == ((4,), torch.float64, 32)


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj(torch.softmax(q * k, dim=-1) * v)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(8), _Attention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x))


def _computes_what_the_model_does(pipe: Pipeline, model: nn.Module, plain: nn.Module, x: torch.Tensor, stages: int, **options: Any) -> None:
    """`pipe` (on `model`) against `plain` in every way a user calls it: a training step, two
    forwards before one backward, autograd.grad, bf16 autocast (a float32 copy compiled with
    `options`: autocast leaves a float64 model as it is), and eval under no_grad (both left in eval)."""
    out, expected = pipe(x), plain(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    out.pow(2).mean().backward()
    expected.pow(2).mean().backward()
    assert_grads_equal(model, plain, tol=1e-12)
    for p in [*model.parameters(), *plain.parameters()]:
        p.grad = None
    first, second = pipe(x), pipe(x * 2)
    (first.sum() + second.pow(2).sum()).backward()
    (plain(x).sum() + plain(x * 2).pow(2).sum()).backward()
    assert_grads_equal(model, plain, tol=1e-12)
    xg, reference_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.testing.assert_close(
        torch.autograd.grad(pipe(xg).sum(), xg)[0], torch.autograd.grad(plain(reference_x).sum(), reference_x)[0], rtol=0, atol=1e-12
    )
    single = copy.deepcopy(plain).float()
    pipe32 = compile_pipeline(copy.deepcopy(single), x.float(), ["cpu"] * stages, chunks=2, **options)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = pipe32(x.float()), single(x.float())
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)
    pipe.eval(), plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), plain(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("stages", [1, 2])
def test_a_stage_reaches_its_submodules_without_module_getattr_and_adds_nothing_to_the_model(
    monkeypatch: pytest.MonkeyPatch, stages: int
) -> None:
    """The generated code reaches each module it calls through the containers the stage owns
    (`getattr(self.blocks, "0").attn.qkv`): each finds its child in its own `__dict__`, not
    through `nn.Module.__getattr__`; the model's modules gain no attribute; a child set again
    afterwards is the one found; and the pipeline computes what the plain model does."""
    torch.manual_seed(0)
    model, plain = twin(nn.Sequential(nn.Linear(8, 8), _Block(), _Block(), nn.Linear(8, 4)))  # paths "1.attn.qkv", ...
    attributes = {id(m): set(vars(m)) for m in model.modules()}
    x = torch.randn(6, 8, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * stages, chunks=2)
    assert {id(m): set(vars(m)) for m in model.modules()} == attributes, "the model's modules gained attributes"
    theirs = {id(m) for m in model.modules()}
    owned = {id(m) for stage in pipe.stages for m in stage.modules() if id(m) not in theirs}
    looked_up: list[str] = []
    original = nn.Module.__getattr__

    def counting(self: nn.Module, name: str) -> Any:
        if id(self) in owned and name in self._modules:
            looked_up.append(name)
        return original(self, name)

    monkeypatch.setattr(nn.Module, "__getattr__", counting)
    out = pipe(x)
    monkeypatch.setattr(nn.Module, "__getattr__", original)
    assert not looked_up, f"children of a stage's own containers found through __getattr__: {looked_up}"
    torch.testing.assert_close(out, plain(x), rtol=0, atol=1e-12)
    _computes_what_the_model_does(pipe, model, plain, x, stages)  # through the same lookups
    # A child set again on a stage's container is the one found: its entry is dropped.
    stage = next(s for s in pipe.stages if any(n.op == "call_module" and n.target == "1.attn.qkv" for n in s.graph.nodes))
    attention = stage.get_submodule("1.attn")
    assert attention is not model[1].attn and "qkv" in vars(attention)
    replacement = nn.Linear(8, 24).double()
    attention.qkv = replacement
    assert "qkv" not in vars(attention) and attention.qkv is replacement


class _Exported(nn.Module):
    """torch.fx cannot trace `*rest`, so torch.export captures it: every op an aten overload."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(_Block(), _Block())
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, *rest: Any) -> torch.Tensor:
        return self.head(self.blocks(x).softmax(-1) * x)


def _bound_names(stage: fx.GraphModule) -> set[str]:
    overloads = {n.target for n in stage.graph.nodes if isinstance(n.target, torch._ops.OpOverload)}
    return {f"{op.namespace}_{op._overloadpacket.__name__}_{op._overloadname}(" for op in overloads}


@pytest.mark.filterwarnings("ignore:torch.fx could not trace")
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_exported_stages_call_their_operators_straight_and_compute_what_the_model_does(
    monkeypatch: pytest.MonkeyPatch, checkpoint: str
) -> None:
    """The generated code calls each aten overload by a global of its own (`aten_add_Tensor(...)`),
    not through `torch.ops.aten.add.Tensor` and `OpOverload.__call__`; the graphs keep their
    overloads; and the pipeline computes what the plain model does, in every way it is called."""
    torch.manual_seed(0)
    model, plain = twin(_Exported())
    x = torch.randn(6, 8, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2, checkpoint=checkpoint)
    for stage in pipe.stages:
        names = _bound_names(stage)
        assert names, "the stage's graph lost its overloads"
        assert "torch.ops." not in stage.code and all(name in stage.code for name in names), stage.code
    _computes_what_the_model_does(pipe, model, plain, x, 2, checkpoint=checkpoint)
    with torch.no_grad():
        twin_pipe = copy.deepcopy(pipe)  # builds its stages again, on the copied model
        assert all("torch.ops." not in stage.code for stage in twin_pipe.stages)
        torch.testing.assert_close(twin_pipe(x), plain(x), rtol=0, atol=1e-12)
    # A torch whose `OpOverload.__call__` does more than forward to `_op` keeps the full path.
    monkeypatch.setattr("fxpipe.passes.codegen._FORWARDS_ONLY", False)
    kept = compile_pipeline(copy.deepcopy(plain), x, ["cpu"] * 2, chunks=2, checkpoint=checkpoint)
    assert all("torch.ops.aten." in stage.code for stage in kept.stages)
    with torch.no_grad():
        torch.testing.assert_close(kept(x), plain(x), rtol=0, atol=1e-12)
