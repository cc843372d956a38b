"""Models that needed a fix of their own, each tried in every way a user calls a model."""
from __future__ import annotations

import copy
import warnings
from typing import Any, cast

import pytest
import torch
import torch.fx
from torch import nn

from fxpipe import compile_pipeline
from helpers import Attends, OwnLoss, ReturnsItsSize, add_low_rank_adapter, prepared_for_qat
from uses import AUTOCAST, EVERY_USE, assert_alike_in_every_use

MODES = ("always", "except_last", "never")
NOT_LOW_PRECISION = tuple(use for use in EVERY_USE if use is not AUTOCAST)


def _squares(out: Any) -> torch.Tensor:
    """A loss on every floating tensor the model returns."""
    leaves = out if isinstance(out, (tuple, list)) else (out,)
    return sum((t.float().square().mean() for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()), torch.zeros(()))


class _SliceWritten(nn.Module):
    """A running mean kept in a slice of a buffer that later stages read."""

    ema: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 5)
        self.register_buffer("ema", torch.zeros(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        with torch.no_grad():
            self.ema[:3].lerp_(h.mean(0)[:3], 0.5)
        return self.c(torch.tanh(self.b(h)) + 2 * self.ema) + self.ema


@pytest.mark.parametrize(("mode", "chunks"), [("always", 1), ("except_last", 2), ("never", 4)])
def test_a_buffer_written_through_a_slice(mode: str, chunks: int) -> None:
    """The plain model runs the micro-batches in turn: each writes the buffer the next reads."""
    torch.manual_seed(0)
    plain = _SliceWritten().double()
    x = torch.randn(8, 5, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the export form says it used torch.export
        pipe = compile_pipeline(copy.deepcopy(plain), x, ["cpu"] * 3, chunks=chunks, checkpoint=mode, split_points=["b", "c"])

    def in_turn(model: nn.Module) -> torch.Tensor:
        return torch.cat([model(piece) for piece in x.tensor_split(chunks)])

    assert_alike_in_every_use(pipe, plain, lambda m: m(x), _squares, NOT_LOW_PRECISION, plain_call=in_turn)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_an_output_none_on_the_example_and_a_tensor_on_the_call(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    plain = Attends().to(dtype)
    x = torch.randn(6, 5, 8, dtype=dtype)
    pipe = compile_pipeline(copy.deepcopy(plain), (x, False), ["cpu", "cpu"], chunks=2, split_points=["attention"])
    uses = NOT_LOW_PRECISION if dtype == torch.float64 else (AUTOCAST,)
    assert_alike_in_every_use(pipe, plain, lambda m: m(x, True), _squares, uses, tol=1e-10 if dtype == torch.float64 else 1e-5)
    assert_alike_in_every_use(pipe, plain, lambda m: m(x, False), _squares, uses, tol=1e-10 if dtype == torch.float64 else 1e-5)


def test_a_size_returned() -> None:
    plain, x = ReturnsItsSize().double(), torch.randn(6, 4, 8, dtype=torch.float64)
    pipe = compile_pipeline(copy.deepcopy(plain), x, ["cpu", "cpu"], chunks=2)
    assert_alike_in_every_use(pipe, plain, lambda m: m(x), _squares, NOT_LOW_PRECISION)


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("as_module", [False, True], ids=["parameters", "a module"])
def test_parameters_added_after_compiling(frozen: bool, as_module: bool) -> None:
    """Before, an adapter added as a module went unseen: autograd.grad gave it None (and wrote
    its .grad), and with the rest frozen backward raised that nothing required a gradient."""
    plain = nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).double()
    x = torch.randn(8, 6, dtype=torch.float64)
    model = copy.deepcopy(plain)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    for m in (model, plain):
        add_low_rank_adapter(cast(nn.Linear, m[2]), as_module)
        for name, p in m.named_parameters():
            p.requires_grad_(not frozen or "lora" in name)
    assert_alike_in_every_use(pipe, plain, lambda m: m(x), _squares, NOT_LOW_PRECISION)


def test_a_model_returning_its_own_loss_called_with_another_string() -> None:
    """Per sample on the call, a mean on the example (a sum comes whole from train_step only)."""
    torch.manual_seed(0)
    plain = OwnLoss().double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 4, (8,))
    pipe = compile_pipeline(copy.deepcopy(plain), (x, y), ["cpu", "cpu"], chunks=2)
    assert_alike_in_every_use(pipe, plain, lambda m: m(x, y, "none"), _squares, NOT_LOW_PRECISION)


def test_a_model_cast_after_compiling() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 3))
    x = torch.randn(8, 6)
    pipe = compile_pipeline(copy.deepcopy(plain), x, ["cpu", "cpu"], chunks=2)
    pipe.double()
    plain.double()
    assert_alike_in_every_use(pipe, plain, lambda m: m(x.double()), _squares, NOT_LOW_PRECISION)


@pytest.mark.parametrize("chunks", [1, 2])
def test_fake_quantisation(chunks: int) -> None:
    """Its observers write their statistics in a fused kernel that bumps no version counter:
    before, compiling with chunks=2 compared the halves as if nothing were written, and refused
    the model as one that mixes samples. Micro-batches observe in turn, as BatchNorm's do."""
    torch.manual_seed(0)
    plain = prepared_for_qat()
    x = torch.randn(8, 6)
    pipe = compile_pipeline(copy.deepcopy(plain), x, ["cpu", "cpu"], chunks=chunks, checkpoint="always")

    def in_turn(model: nn.Module) -> torch.Tensor:
        return torch.cat([model(piece) for piece in x.tensor_split(chunks)])

    assert_alike_in_every_use(pipe, plain, lambda m: m(x), _squares, NOT_LOW_PRECISION, tol=1e-6, plain_call=in_turn)


class _Encoded(nn.Module):
    """A TransformerEncoderLayer called whole, with a BatchNorm-free head: the memory model runs
    it once more with gradients at compile time, which must leave nothing behind."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, 8), nn.Linear(8, 3)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.layer(torch.tanh(self.inp(x))))


def test_a_composite_module_called_whole() -> None:
    torch.manual_seed(0)
    plain = _Encoded().double()
    x = torch.randn(4, 5, 8, dtype=torch.float64)
    pipe = compile_pipeline(copy.deepcopy(plain), x, ["cpu"] * 3, chunks=2, split_points=["layer", "out"])
    assert pipe.plan.stages[1].activation_bytes > 4 * pipe.plan.stages[0].activation_bytes  # what it saves inside counts
    assert_alike_in_every_use(pipe, plain, lambda m: m(x), _squares, NOT_LOW_PRECISION)


class _Counts(nn.Module):
    """A parametrization that writes what it holds in training: it counts its calls."""

    calls: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.float64))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.calls.add_(1)
        return weight * (1 + 0.1 * self.calls)


class _ReadApart(nn.Module):
    """Parametrized tensors read apart from their module's own forward: the root's own
    parameter, and a child's weight read by the parent (torch.fx calls the chain of
    parametrizations in the graph, not inside a module called whole)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.w = nn.Parameter(torch.randn(6, 6) / 3)
        for module, name in ((self, "w"), (self.b, "weight")):
            if kind == "spectral_norm":
                nn.utils.parametrizations.spectral_norm(module, name)
            else:
                nn.utils.parametrize.register_parametrization(module, name, _Counts())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x) @ self.w)
        return torch.nn.functional.linear(h, self.b.weight, self.b.bias)


@pytest.mark.parametrize("compiled_in", ["train", "eval"])
@pytest.mark.parametrize(("mode", "chunks"), [("always", 1), ("except_last", 2), ("never", 2), ("always", 2)])
@pytest.mark.parametrize("kind", ["spectral_norm", "counts"])
def test_a_parametrization_that_writes_read_apart_from_its_module(kind: str, mode: str, chunks: int, compiled_in: str) -> None:
    """Before, its writes went unseen: the recompute wrote again (a count of 5 where the plain
    model counted 3), more than one micro-batch was refused as mixing samples, and compiled in
    eval mode a training call blamed the caller for writing the buffers."""
    torch.manual_seed(0)
    plain = _ReadApart(kind).double().train(compiled_in == "train")
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(copy.deepcopy(plain), x, ["cpu"] * 2, chunks=chunks, checkpoint=mode, split_points=["b"])

    def in_turn(model: nn.Module) -> torch.Tensor:
        return torch.cat([model(piece) for piece in x.tensor_split(chunks)])

    assert_alike_in_every_use(pipe, plain.train(), lambda m: m(x), _squares, NOT_LOW_PRECISION, plain_call=in_turn)


class _NamedLikeThePipeline(nn.Module):
    """Children named like the pipeline's attributes, which the names now give (timm's `stages`)."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.plan, self.checkpoint = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.checkpoint(torch.tanh(self.plan(self.stages(x))))


@pytest.mark.parametrize("mode", MODES)
def test_children_named_like_the_pipeline_s_attributes(mode: str) -> None:
    torch.manual_seed(0)
    plain = _NamedLikeThePipeline().double()
    x = torch.randn(6, 4, dtype=torch.float64)
    pipe = compile_pipeline(copy.deepcopy(plain), x, ["cpu"] * 3, chunks=2, checkpoint=mode)
    assert_alike_in_every_use(pipe, plain, lambda m: m(x), _squares, NOT_LOW_PRECISION)


def test_a_deep_copy_with_hooks_set_on_the_pipeline() -> None:
    """The copy keeps the pipeline's own hooks (a pre-hook scaling the input, a full backward hook
    scaling its gradient), as a copy of the plain model keeps the model's."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 5)).double()
    x = torch.randn(6, 5, dtype=torch.float64)
    pipe = compile_pipeline(copy.deepcopy(plain), x, ["cpu"] * 2, chunks=2)
    for module in (plain, pipe):
        module.register_forward_pre_hook(lambda m, args: (2 * args[0],))
        module.register_full_backward_hook(lambda m, grad_in, grad_out: (3 * grad_in[0],))  # type: ignore[index]
    assert_alike_in_every_use(copy.deepcopy(pipe), copy.deepcopy(plain), lambda m: m(x.clone().requires_grad_()), _squares, NOT_LOW_PRECISION)


class _MadeLikeAndMarked(nn.Module):
    """A constant made like an activation, returned beside an output from an input marked as
    requiring grad in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 1), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.requires_grad_()
        h = torch.tanh(self.a(x))
        return self.c(h) * x, h.new_zeros(())


@pytest.mark.parametrize("mode", MODES)
def test_a_constant_made_like_an_activation_and_an_input_marked_for_grad(mode: str) -> None:
    torch.manual_seed(0)
    plain = _MadeLikeAndMarked().double()
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(copy.deepcopy(plain), x.clone(), ["cpu"] * 2, chunks=2, checkpoint=mode)
    assert_alike_in_every_use(pipe, plain, lambda m: m(x), _squares, NOT_LOW_PRECISION)


class _MaskedPerSample(nn.Module):
    """A mask over each sample's positions, (B, T) or, on the example, (1, T)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)) * mask.unsqueeze(-1))


class _SequenceFirst(nn.Module):
    """Sequence-first, its batch along dim 1 in and out (chunk_spec={"x": 1})."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, b, d = x.shape
        return self.b(torch.tanh(self.a(x.reshape(t * b, d)))).view(t, b, 3) * 2


@pytest.mark.parametrize("mode", MODES)
def test_a_mask_broadcast_on_the_example_and_per_sample_later_and_outputs_cut_along_dim_1(mode: str) -> None:
    torch.manual_seed(0)
    masked = _MaskedPerSample().double()
    x = torch.randn(6, 5, 4, dtype=torch.float64)
    pipe = compile_pipeline(copy.deepcopy(masked), (x, torch.ones(1, 5, dtype=torch.float64)), ["cpu"] * 2, chunks=2, checkpoint=mode)
    mask = (torch.rand(6, 5, generator=torch.Generator().manual_seed(1)) > 0.3).double()
    assert_alike_in_every_use(pipe, masked, lambda m: m(x, mask), _squares)
    first = _SequenceFirst().double()
    x = torch.randn(5, 4, 4, dtype=torch.float64)
    pipe = compile_pipeline(copy.deepcopy(first), x, ["cpu"] * 2, chunks=2, checkpoint=mode, chunk_spec={"x": 1})
    assert_alike_in_every_use(pipe, first, lambda m: m(x), _squares)



class _TableThroughModules(nn.Module):
    """A parameter given to a module as its input in two branches, and read again after them
    as an operand."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.table = nn.Parameter(torch.randn(6, 6) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.tanh(self.l1(x) @ self.l1(self.table))
        b = torch.tanh(self.l2(x) @ self.l2(self.table))
        return self.l3(a * b) @ self.table


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cut", [{"split_points": ["l2", "l3"]}, {"stage_graph": "dag"}], ids=["chain", "dag"])
def test_a_parameter_given_to_a_module_in_several_stages(mode: str, cut: dict[str, Any]) -> None:
    """Before, a stage that gave the parameter to a module did not hold it as a read of its
    own: that stage's part of the gradient was lost (only the last reader's reached `.grad`)."""
    torch.manual_seed(0)
    plain = _TableThroughModules().double()
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(copy.deepcopy(plain), x, ["cpu"] * 3, chunks=2, checkpoint=mode, **cut)
    readers = [s for s, stage in enumerate(pipe.plan.stages) if any("table" in n for n in stage.nodes) or "l1" in stage.nodes or "l2" in stage.nodes]
    assert len(readers) >= 2, pipe.plan.stages
    assert_alike_in_every_use(pipe, plain, lambda m: m(x), _squares, NOT_LOW_PRECISION)


class _Triples(nn.Module):
    """Kept whole: writes its input in place, with no `inplace` flag to say so."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.mul_(3.0)


@torch.fx.wrap
def _triple(h: torch.Tensor) -> None:
    h.mul_(3.0)


class _WrittenUnseen(nn.Module):
    """A value read, then written in place by a call the graph cannot see into, then read again:
    by a module kept whole or by a function torch.fx wraps, its result unused."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.stem, self.w = nn.Linear(6, 6), _Triples()
        self.a, self.b = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)), nn.Sequential(nn.Linear(6, 6), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        g = h + 1.0  # read before the write
        if self.how == "module":
            self.w(h)
        else:
            _triple(h)
        return self.a(h * 1.0) + self.b(g)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("how", "cut"), [
    ("module", {"stage_graph": "dag"}), ("function", {"stage_graph": "chain"}), ("module", {"split_points": ["w"]}),
], ids=["module-dag", "function-chain", "module-heads-a-stage"])  # fmt: skip
def test_an_in_place_write_the_graph_cannot_see(how: str, cut: dict[str, Any], mode: str) -> None:
    """Before, the linear order ran the unseen write before the read (0.14 off on one device),
    and a module kept whole that wrote a value its stage received failed on an autograd leaf."""
    torch.manual_seed(0)
    plain = _WrittenUnseen(how).double()
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(copy.deepcopy(plain), x, ["cpu"] * 2, chunks=2, checkpoint=mode, leaf_modules=[_Triples], **cut)
    assert_alike_in_every_use(pipe, plain, lambda m: m(x), _squares, NOT_LOW_PRECISION)


class _SliceTripled(nn.Module):
    """A module kept whole that writes the slice of a value it is given, read whole after."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d, self.w = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6), _Triples()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x)))
        y = self.w(h[:, :3])
        return self.d(torch.tanh(self.c(h))) + y.sum(1, keepdim=True)


@pytest.mark.parametrize("mode", MODES)
def test_a_slice_written_by_a_call_the_graph_cannot_see(mode: str) -> None:
    """The slice, its write and the value after it stay in one stage; a cut by hand between the
    slice and the write is refused, as one through a view an op writes is. Before, that cut ran
    (0.48 off), the write reaching a copy of the slice alone."""
    torch.manual_seed(0)
    plain = _SliceTripled().double()
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(copy.deepcopy(plain), x, ["cpu"] * 3, chunks=2, checkpoint=mode, leaf_modules=[_Triples])
    assert_alike_in_every_use(pipe, plain, lambda m: m(x), _squares, NOT_LOW_PRECISION)
    with pytest.raises(ValueError, match=r"writes through the view `getitem` made in stage 0"):
        compile_pipeline(copy.deepcopy(plain), x, ["cpu"] * 2, chunks=2, checkpoint=mode, leaf_modules=[_Triples], split_points=["w"])


class _Bumps(nn.Module):
    """Kept whole: counts its calls in a buffer it is given."""

    def forward(self, count: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        count.add_(1)
        return h * 2


class _CountedByAnother(nn.Module):
    count: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.a, self.c, self.w = nn.Linear(6, 6), nn.Linear(6, 6), _Bumps()
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.w(self.count, self.a(x)))


@pytest.mark.parametrize("mode", MODES)
def test_a_buffer_a_call_the_graph_cannot_see_writes_is_cut_with_its_write(mode: str) -> None:
    """Before, the automatic cut could fall between the call and the node that carries its
    write on, and compiling then refused its own cut; and a checkpointed stage took the buffer
    for one its forward only reads, and failed in backward."""
    torch.manual_seed(0)
    plain = _CountedByAnother().double()
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(copy.deepcopy(plain), x, ["cpu"] * 2, chunks=2, checkpoint=mode, leaf_modules=[_Bumps])
    stage = next(s for s in pipe.plan.stages if "w" in s.nodes)
    assert "count_written" in stage.nodes

    def in_turn(model: nn.Module) -> torch.Tensor:
        return torch.cat([model(piece) for piece in x.tensor_split(2)])

    assert_alike_in_every_use(pipe, plain, lambda m: m(x), _squares, NOT_LOW_PRECISION, plain_call=in_turn)
