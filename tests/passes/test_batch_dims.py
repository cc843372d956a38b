"""Micro-batches compute what the whole batch does, or compiling refuses; outputs are put back
together along the dim that holds the batch (passes/batch_dims.py)."""
from __future__ import annotations

import copy
import re
import warnings
from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import prune

from helpers import assert_grads_equal, real_tensors_only, twin
from fxpipe import Pipeline, compile_pipeline
from fxpipe.core.microbatch import VARIES
from fxpipe.passes.batch_dims import annotate_batch_dims
from fxpipe.passes.example_runs import run_whole
from fxpipe.passes.shapes import propagate_shapes

X = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))  # fixed whatever was imported first


class Mixer(nn.Module):
    """Two layers around `mix(h, x)`, which may mix samples along the batch dim."""

    def __init__(self, mix: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.mix = mix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.mix(torch.tanh(self.a(x)), x))


MIXING = {
    "centred over the batch": (lambda h, x: h - h.mean(0), r"mean"),
    "divided by the batch size": (lambda h, x: h / x.shape[0], r"getattr_1 = getattr\(x, 'shape'\), \(8, 6\) for the whole example and \(3, 6\) for a part"),
    "a cumulative sum over the batch": (lambda h, x: torch.cumsum(h, 0), r"cumsum"),
    "positions counted over the batch": (lambda h, x: h + torch.arange(x.shape[0], dtype=h.dtype)[:, None], r"\(8, 6\) for the whole example and \(3, 6\) for a part"),
    "normalised over the whole tensor": (lambda h, x: h / h.abs().max(), r"max"),
    "rows in reverse": (lambda h, x: h.flip(0), r"flip"),
    "centred after dropout": (lambda h, x: F.dropout(h, 0.5, True) - h.mean(0), r"mean"),
    # Before, a permutation drawn in the check left the order: the shuffle went unseen.
    "rows shuffled (in-batch negatives)": (lambda h, x: h - h[torch.randperm(x.shape[0])], r"getattr\(x, 'shape'\)"),
    # Before, the halves were copies, whose storage starts at their first row: a micro-batch, a
    # view of the caller's tensor, does not, and read micro-batch 0's rows.
    "rows read from the storage's start": (lambda h, x: h + x.as_strided(x.shape, x.stride(), 0), r"as_strided|getattr"),
}


@pytest.mark.parametrize("case", list(MIXING))
def test_a_model_that_mixes_samples_is_refused_naming_where(case: str) -> None:
    mix, where = MIXING[case]
    with pytest.raises(ValueError, match=r"with chunks=2 the micro-batches would compute otherwise than the whole batch(.|\n)*"
                                         rf"The difference starts at: [^\n]*{where}(.|\n)*How to fix"):  # fmt: skip
        compile_pipeline(Mixer(mix).double(), X, ["cpu", "cpu"], chunks=2)


class _ReadsABuffer(nn.Module):
    """Called whole (it calls a function that takes real tensors only), reading a buffer it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.scale: torch.Tensor
        self.register_buffer("scale", torch.full((6,), 0.5))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return real_tensors_only(h, heads=2) * self.scale


HOLDS_STATE = {
    "a pruned layer": lambda m: prune.l1_unstructured(m.a, "weight", amount=0.3),
    "an orthogonal parametrization": lambda m: nn.utils.parametrizations.orthogonal(m.a),
    "a module called whole with a buffer": lambda m: setattr(m, "mix", _Mixes(_ReadsABuffer())),
}


class _Mixes(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(h)
        return h - h.mean(0)


@pytest.mark.parametrize("case", list(HOLDS_STATE))
def test_a_buffer_the_forward_only_reads_leaves_the_check_on(case: str) -> None:
    """Before, a module holding a buffer it might write (a pruning mask, a parametrization's
    base, a module called whole) turned the comparison of the halves off: a model centred over
    the batch compiled, 0.18 off the plain model."""
    model = Mixer(lambda h, x: h - h.mean(0))
    HOLDS_STATE[case](model)
    with pytest.raises(ValueError, match=r"(?s)the micro-batches would compute otherwise than the whole batch.*starts at"):
        compile_pipeline(model.double(), X, ["cpu", "cpu"], chunks=2)


WRITES_STATE_IN_TRAINING = {
    "spectral_norm": lambda m: nn.utils.parametrizations.spectral_norm(m.a),
    "spectral_norm as a hook": lambda m: nn.utils.spectral_norm(m.a),
}


@pytest.mark.parametrize("case", list(WRITES_STATE_IN_TRAINING))
def test_a_model_whose_training_run_writes_state_is_checked_in_eval_mode(case: str) -> None:
    """Its training run writes state (spectral norm's vectors), after which the halves are no
    measure; before, nothing was compared, and a model centred over the batch ran 0.096 off the
    plain model in eval mode, where nothing is written."""
    model = Mixer(lambda h, x: h - h.mean(0))
    WRITES_STATE_IN_TRAINING[case](model)
    with pytest.raises(ValueError, match=r"(?s)output \w+ in eval mode: the parts' values.*starts at: mean"):
        compile_pipeline(model.double(), X, ["cpu", "cpu"], chunks=2)
    assert model.training and all(m.training for m in model.modules())
    model, reference = twin(Mixer(lambda h, x: h * 2.0))
    WRITES_STATE_IN_TRAINING[case](model), WRITES_STATE_IN_TRAINING[case](reference)
    reference.load_state_dict(model.state_dict())
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)  # per sample: compiles
    pipe.eval(), reference.eval()
    torch.testing.assert_close(pipe(X), reference(X), rtol=0, atol=1e-12)


class AlsoReturns(nn.Module):
    """Two layers, and an integer or bool output `extra(h, x)` beside them."""

    def __init__(self, extra: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.extra = extra

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.a(x))
        return self.b(h), self.extra(h, x)


EXACT_OUTPUTS = {
    "a mask above the batch's mean": (lambda h, x: h > h.mean(0), r"in \d+ of 48 elements(.|\n)*starts at: mean"),
    "positions in the batch": (lambda h, x: torch.arange(x.shape[0]), r"in 5 of 8 elements"),
    "ranks within the batch": (lambda h, x: h.argsort(0), r"starts at: argsort"),
    "row indices of nonzero": (lambda h, x: torch.nonzero(h > 0), r"differ from the whole example's in"),
    "counts down the batch": (lambda h, x: (h > 0).long().cumsum(0), r"starts at: cumsum"),
    # under one element in a hundred, which a rounding may flip, but several samples at one place
    "one mixed column among many": (
        lambda h, x: torch.cat([torch.arange(x.shape[0]).unsqueeze(1) >= x.shape[0] // 2, (h > 0).repeat(1, 40)], 1),
        r"in 3 of 1928 elements, 3 samples at one place",
    ),
}


@pytest.mark.parametrize("case", list(EXACT_OUTPUTS))
def test_an_integer_or_bool_output_that_mixes_samples_is_refused(case: str) -> None:
    """Before, integer and bool outputs were put together from their shapes alone, unchecked: a
    mask over the batch's mean, 8 of 48 elements off, trained a loss reading it on gradients
    0.07 off."""
    extra, where = EXACT_OUTPUTS[case]
    with pytest.raises(ValueError, match=rf"(?s)the micro-batches would compute otherwise.*{where}"):
        compile_pipeline(AlsoReturns(extra).double(), X, ["cpu", "cpu"], chunks=2)


def test_an_integer_output_made_sample_by_sample_is_exact_in_every_mode() -> None:
    model, reference = twin(AlsoReturns(lambda h, x: h.argmax(-1)))
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            for got, expected in zip(pipe(X), reference(X)):
                torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    target = torch.randn(8, 6, dtype=torch.float64)

    def loss_fn(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        return ((out[0] - y) ** 2 * (out[1] > 2)[:, None]).mean()

    loss, outputs = pipe.train_step(X, target=target, loss_fn=loss_fn, return_outputs=True)
    expected_loss = loss_fn(reference(X), target)
    expected_loss.backward()
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=1e-12)
    assert torch.equal(outputs[1], reference(X)[1])
    assert_grads_equal(pipe, reference)


@pytest.mark.parametrize("case", [case for case in MIXING if "dropout" not in case and "shuffled" not in case])  # what draws, aside
def test_the_same_model_with_one_micro_batch_is_the_plain_model(case: str) -> None:
    model, reference = twin(Mixer(MIXING[case][0]))
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=1)
    torch.testing.assert_close(pipe(X), reference(X), rtol=0, atol=1e-12)


def test_a_branch_taken_on_the_whole_batch_is_refused_when_its_micro_batches_take_another() -> None:
    x = torch.cat([torch.full((4, 6), 3.0), torch.full((4, 6), -1.0)]).double()  # sums: 48; 72 and -24
    model = Mixer(lambda h, x: torch.where(x.sum() > 0, h, -h)).double()
    with pytest.raises(ValueError, match=r"The difference starts at: sum_1 = x\.sum\(\)"):
        compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)


class _NormsThenMixes(nn.Module):
    """A BatchNorm, then (`mixes`) a mean over the batch; forward(*rest): torch.export, whose
    graph holds the norm as aten.batch_norm on a bare container of its statistics."""

    def __init__(self, frozen: bool, mixes: bool = True) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 6)
        self.norm.train(not frozen)
        self.mixes = mixes

    def forward(self, x: torch.Tensor, *rest: Any) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(self.a(x))
        return self.b(h - h.mean(0) if self.mixes else h), (self.b.weight * 2).sum()


@pytest.mark.filterwarnings("ignore:torch.fx could not trace")
@pytest.mark.parametrize("frozen", [True, False], ids=["frozen-norm", "training-norm"])
def test_a_batch_norm_in_an_exported_graph_does_not_turn_off_the_check_of_the_micro_batches(frozen: bool) -> None:
    """Before, its statistics counted as other state a forward writes, and the micro-batches went
    unchecked: 0.16 off the plain model, and a value made from parameters alone refused."""
    with pytest.raises(ValueError, match=r"(?s)differ from the whole example's.*The difference starts at: mean"):
        compile_pipeline(_NormsThenMixes(frozen).double(), X, ["cpu", "cpu"], chunks=2)
    model, reference = twin(_NormsThenMixes(frozen, mixes=False))
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    out, penalty = pipe(X)
    expected = [reference(half) for half in X.chunk(2)]
    torch.testing.assert_close(out, torch.cat([e[0] for e in expected]), rtol=0, atol=1e-12)
    torch.testing.assert_close(penalty, expected[0][1], rtol=0, atol=1e-12)  # returned once, as the README says


class _ReturnsItsRunningMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = self.norm.running_mean
        assert mean is not None
        return self.b(self.norm(self.a(x))), mean.sum() + self.b.weight.sum()


def test_a_value_read_from_state_the_forward_writes_is_not_returned_as_the_same_in_every_micro_batch() -> None:
    """Run in turn, each micro-batch reads the running mean the one before left: before, the
    pipeline returned one of them as if all were alike (0.12 off one of the plain model's)."""
    model = _ReturnsItsRunningMean().double()
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2, split_points=["b"])
    state = copy.deepcopy(model.state_dict())
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=r"(?s)the model returns output\[1\], a value made from the whole batch.*How to fix"):
            pipe(X)
        for name, value in model.state_dict().items():  # refused before any stage wrote the running mean
            torch.testing.assert_close(value, state[name], rtol=0, atol=0)
    model, reference = twin(_ReturnsItsRunningMean())
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=1, split_points=["b"])
    for got, expected in zip(pipe(X), reference(X)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


class _ReturnsADraw(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.b(self.a(x)), torch.rand(()) * self.b.weight.sum()


def test_a_value_drawn_in_forward_is_not_returned_as_the_same_in_every_micro_batch() -> None:
    """Each micro-batch draws its own, as the plain model run on them in turn does: before, the
    pipeline returned the first micro-batch's for the whole batch."""
    pipe = compile_pipeline(_ReturnsADraw().double(), X, ["cpu", "cpu"], chunks=2)
    generator = torch.get_rng_state()
    with pytest.raises(ValueError, match=r"the model returns output\[1\], a value made from the whole batch"):
        pipe(X)
    assert torch.equal(torch.get_rng_state(), generator)


PER_SAMPLE = {
    "the batch size given to view": lambda h, x: h.view(x.shape[0], 2, 3).flip(1).reshape(x.shape[0], -1),
    "rows picked by arange over the batch": lambda h, x: h[torch.arange(x.shape[0]), :],
    "zeros the size of the batch": lambda h, x: h + h.new_zeros(x.shape[0], 6),
    "a softmax over features": lambda h, x: F.softmax(h, dim=-1),
}


@pytest.mark.parametrize("case", list(PER_SAMPLE))
@pytest.mark.parametrize("mode", ["train", "eval", "no_grad"])
def test_per_sample_uses_of_the_batch_size_compile_and_match(case: str, mode: str) -> None:
    model, reference = twin(Mixer(PER_SAMPLE[case]))
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    if mode == "no_grad":
        with torch.no_grad():
            torch.testing.assert_close(pipe(X), reference(X), rtol=0, atol=1e-12)
        return
    pipe.train(mode == "train")
    reference.train(mode == "train")
    pipe(X).pow(2).sum().backward()
    reference(X).pow(2).sum().backward()
    assert_grads_equal(pipe, reference)


class Noisy(nn.Module):
    """Dropout, random noise per sample and BatchNorm: per micro-batch by design, not refused."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.drop, self.norm = nn.Dropout(0.3), nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.drop(self.a(x)))
        noise = 0.1 * torch.randn_like(h) if self.training else 0.0
        return self.b(h + noise + F.dropout(h, 0.2, self.training))


def test_random_ops_and_batch_norm_are_not_taken_for_mixing() -> None:
    model, reference = twin(Noisy())
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    pipe.eval(), reference.eval()
    torch.testing.assert_close(pipe(X), reference(X), rtol=0, atol=1e-12)


def test_features_shuffled_alike_in_every_sample_are_not_taken_for_mixing() -> None:
    compile_pipeline(Mixer(lambda h, x: h[:, torch.randperm(h.shape[1])]).double(), X, ["cpu", "cpu"], chunks=2)


def test_compiling_leaves_the_random_state_and_running_statistics_as_they_were() -> None:
    model = Noisy().double()
    statistics = copy.deepcopy(dict(model.named_buffers()))
    state = torch.get_rng_state()
    compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    assert torch.equal(torch.get_rng_state(), state)
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, statistics[name]), name


class WithTable(nn.Module):
    """Returns, besides per-sample values, a tensor made from parameters alone whose dim 0
    happens to be the micro-batch size: it is the same in every micro-batch, not a batch."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.table = nn.Parameter(torch.randn(4, 3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.b(torch.tanh(self.a(x))), self.table * self.a.weight[:4, :3]


def _loss(out: Any) -> torch.Tensor:
    return sum(o.pow(2).sum() for o in out)  # type: ignore[return-value]


def _returned_once(model: nn.Module, checkpoint: str = "except_last") -> tuple[Pipeline, nn.Module]:
    """The table output of a WithTable, once, with the plain model's values and gradients."""
    model, reference = twin(model)
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2, checkpoint=checkpoint)
    out, expected = pipe(X), reference(X)
    assert out[1].shape == (4, 3)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    _loss(out).backward()
    _loss(expected).backward()
    assert_grads_equal(pipe, reference)
    return pipe, reference


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_an_output_made_from_parameters_alone_is_returned_once(checkpoint: str) -> None:
    _returned_once(WithTable(), checkpoint)


class CountingTable(WithTable):
    """WithTable that counts its calls in a buffer: the compile-time check of the micro-batches
    compares no values (each half's run writes the buffer); through torch.export where
    `exported` (a shape check torch.fx cannot trace)."""

    calls: torch.Tensor  # a buffer, registered in __init__

    def __init__(self, exported: bool) -> None:
        super().__init__()
        self.exported = exported
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.exported and x.shape[1] != 6:
            raise ValueError("6 features")
        self.calls.add_(1)
        return super().forward(x)


@pytest.mark.parametrize("exported", [False, True])
def test_an_output_made_from_parameters_alone_by_a_model_that_writes_a_buffer_is_returned_once(exported: bool) -> None:
    """Before, with the values unchecked, it was joined along dim 0, whose size happens to be the
    micro-batch's: twice the plain model's rows, its gradient twice the plain model's."""
    pipe, reference = _returned_once(CountingTable(exported))
    with torch.no_grad():
        torch.testing.assert_close(pipe(X)[1], reference(X)[1], rtol=0, atol=0)


_TABLES = {"reads": WithTable, "writes a buffer": lambda: CountingTable(False), "exported": lambda: CountingTable(True)}


@pytest.mark.parametrize("table", list(_TABLES))
def test_an_output_made_from_parameters_alone_under_autograd_grad_and_accumulation(table: str) -> None:
    model, reference = twin(_TABLES[table]())
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    got = torch.autograd.grad(_loss(pipe(X)), [model.table])[0]
    expected = torch.autograd.grad(_loss(reference(X)), [reference.table])[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    for _ in range(2):
        _loss(pipe(X)).backward()
        _loss(reference(X)).backward()
    assert_grads_equal(pipe, reference)
    assert_buffers_equal(pipe, reference)


def assert_buffers_equal(pipe: nn.Module, reference: nn.Module) -> None:
    """The call counts of a CountingTable: once per micro-batch, as the plain model's on the
    micro-batches in turn (2 each), where the reference ran on whole batches."""
    for (name, buffer), expected in zip(pipe.named_buffers(), reference.buffers()):
        torch.testing.assert_close(buffer, 2 * expected, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("table", list(_TABLES))
def test_train_step_returns_such_an_output_once(table: str) -> None:
    model, reference = twin(_TABLES[table]())
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2, schedule="1f1b")
    y = torch.randn(8, 6, dtype=torch.float64)

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out[0], target) + out[1].pow(2).mean()

    loss, out = pipe.train_step(X, target=y, loss_fn=loss_fn, return_outputs=True)
    expected = reference(X)
    expected_loss = loss_fn(expected, y)
    expected_loss.backward()
    torch.testing.assert_close(loss, expected_loss.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)
    assert_buffers_equal(pipe, reference)


class TimeFirst(nn.Module):
    """Takes (time, batch, features): split along dim 1 by chunk_spec."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.a(x))
        return {"seq": self.b(h), "last": h[-1]}


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_outputs_of_inputs_split_along_dim_1_are_put_together_along_their_batch_dims(schedule: str) -> None:
    model, reference = twin(TimeFirst())
    x = torch.randn(5, 8, 3, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, chunk_spec={"x": 1}, schedule=schedule)
    out, expected = pipe(x), reference(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    _loss(out.values()).backward()
    _loss(expected.values()).backward()
    assert_grads_equal(pipe, reference)
    for p in [*model.parameters(), *reference.parameters()]:
        p.grad = None
    y = torch.randn(8, 3, dtype=torch.float64)

    def loss_fn(out: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out["last"], target) + out["seq"].pow(2).mean()

    loss = pipe.train_step(x, target=y, loss_fn=loss_fn)
    expected_loss = loss_fn(reference(x), y)
    expected_loss.backward()
    torch.testing.assert_close(loss, expected_loss.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)


class Gram(nn.Module):
    """Returns a (batch, batch) similarity matrix: pairs across micro-batches are never made."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return h @ h.T


def test_an_output_made_across_samples_is_refused_when_called() -> None:
    pipe = compile_pipeline(Gram().double(), X, ["cpu", "cpu"], chunks=2)
    with pytest.raises(ValueError, match=r"a value made from the whole batch(.|\n)*How to fix"):
        pipe(X)


def test_a_model_on_the_meta_device_gets_its_dims_from_shapes() -> None:
    """A model too large to run at compile time runs on the meta device: nothing is compared,
    and the dims come from the shapes; an output whose shape does not change is not known."""
    with torch.device("meta"):
        gm = torch.fx.symbolic_trace(WithTable())
        x = torch.randn(8, 6)
    annotate_batch_dims(gm, (x,), chunks=2)
    returned = next(n for n in gm.graph.nodes if n.op == "output").all_input_nodes
    assert [n.meta["batch_dims"] for n in returned] == [[0], [None]]


def test_dims_found_on_the_cpu() -> None:
    gm = torch.fx.symbolic_trace(TimeFirst())
    returned = next(n for n in gm.graph.nodes if n.op == "output").all_input_nodes
    x = torch.randn(5, 8, 3)
    annotate_batch_dims(gm, (x,), chunks=4, dims={id(x): 1})
    assert {n.name: n.meta["batch_dims"] for n in returned} == {"b": [1], "getitem": [0]}  # the sequence, h[-1]
    annotate_batch_dims(gm, (x,), chunks=4)  # split along dim 0: the time, so h[-1] is made from the whole
    assert {n.name: n.meta["batch_dims"] for n in returned} == {"b": [0], "getitem": [VARIES]}


class AttendsAcrossTheBatch(nn.Module):
    """Attention whose sequence is the batch, in a layer that holds a dropout rate: its kernels
    are tagged random, and the check runs them without dropout rather than filling them."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)
        self.attn = nn.MultiheadAttention(8, 2, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).unsqueeze(0)
        return self.b(self.attn(h, h, h, need_weights=False)[0].squeeze(0))


def test_attention_across_the_batch_in_a_layer_with_dropout_is_refused() -> None:
    with pytest.raises(ValueError, match=r"would compute otherwise than the whole batch(.|\n)*self\.attn"):
        compile_pipeline(AttendsAcrossTheBatch().double(), X, ["cpu", "cpu"], chunks=2)


class _WithState(nn.Module):
    """An LSTM given its initial state, whose batch is on dim 1."""

    def __init__(self, hidden: int = 6) -> None:
        super().__init__()
        self.rnn, self.post = nn.LSTM(4, hidden, batch_first=True), nn.Linear(hidden, 4)

    def forward(self, x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor) -> torch.Tensor:
        return self.post(self.rnn(x, (h0, c0))[0])


@pytest.mark.parametrize("hidden", [6, 8])
def test_an_input_with_its_batch_on_another_dim_is_refused_at_compile_time_naming_the_chunk_spec(hidden: int) -> None:
    """With a hidden size a multiple of the batch's (8 of 4), the state was also named as an input
    with a part per sample on its hidden dim (chunk_spec={'h0': 2}), which cuts the features."""
    model, reference = twin(_WithState(hidden))
    args = (torch.randn(4, 3, 4, dtype=torch.float64), torch.randn(1, 4, hidden, dtype=torch.float64), torch.randn(1, 4, hidden, dtype=torch.float64))
    with pytest.raises(ValueError, match=rf"fails on a part of it(.|\n)*h0 \(1, 4, {hidden}\), c0 \(1, 4, {hidden}\)(.|\n)*chunk_spec=\{{'h0': 1, 'c0': 1\}}") as refused:
        compile_pipeline(model, args, ["cpu", "cpu"], chunks=2)
    assert "'h0': 2" not in str(refused.value)
    pipe = compile_pipeline(model, args, ["cpu", "cpu"], chunks=2, chunk_spec={"h0": 1, "c0": 1})
    out = pipe(*args)
    torch.testing.assert_close(out, reference(*args), rtol=0, atol=1e-12)
    out.pow(2).sum().backward()
    reference(*args).pow(2).sum().backward()
    assert_grads_equal(pipe, reference)


class _MaskedAttention(nn.Module):
    """Attention over the positions of each sample, under a (T, T) mask every sample shares."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.q(x)
        return self.o(((h @ h.transpose(1, 2)) / 8 + mask).softmax(-1) @ h)


def test_a_shared_mask_split_for_a_length_equal_to_the_batch_is_named_with_the_chunk_spec_that_keeps_it_whole() -> None:
    model, reference = twin(_MaskedAttention())
    x = torch.randn(4, 4, 8, dtype=torch.float64)  # as many positions as samples
    mask = torch.zeros(4, 4, dtype=torch.float64).masked_fill(torch.ones(4, 4).triu(1).bool(), float("-inf"))
    with pytest.raises(ValueError, match=r"fails on a part of it(.|\n)*split along dim 0(.|\n)*mask \(4, 4\)(.|\n)*chunk_spec=\{'mask': None\}"):
        compile_pipeline(model, (x, mask), ["cpu", "cpu"], chunks=2)
    pipe = compile_pipeline(model, (x, mask), ["cpu", "cpu"], chunks=2, chunk_spec={"mask": None})
    out = pipe(x, mask)
    torch.testing.assert_close(out, reference(x, mask), rtol=0, atol=1e-12)


class _PooledBoxes(nn.Module):
    """Boxes as rows (image index, x0, x1), as roi_align takes them: indices into the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        rows = h[boxes[:, 0].long()]  # each box's image, by its index in the batch
        return self.b(rows * boxes[:, 1:2])


@pytest.mark.parametrize("spec", [None, {"boxes": None}, {"boxes": 0}])
def test_an_input_of_indices_into_the_batch_is_named_as_such_with_the_fix_that_works(spec: Any) -> None:
    """Before, the refusal of splitting the boxes advised keeping them whole, whose refusal
    advised splitting them: only chunks=1 works, and no message said why."""
    x, boxes = torch.randn(4, 8), torch.tensor([[0, 1.0, 0], [1, 0.5, 0], [2, 2.0, 0], [3, 1.5, 0]])
    with pytest.raises(ValueError, match=r"(?s)fails on a part of it.*an input may hold indices into the batch.*use chunks=1 for such a model"):
        compile_pipeline(_PooledBoxes(), (x, boxes), ["cpu", "cpu"], chunks=2, chunk_spec=spec)
    model = _PooledBoxes()
    torch.testing.assert_close(compile_pipeline(model, (x, boxes), ["cpu", "cpu"], chunks=1)(x, boxes), model(x, boxes), rtol=0, atol=0)


class _Table(nn.Module):
    """`table` picks positions that every sample shares; its length is the batch's by chance."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).index_select(1, table).mean(1))


def test_a_table_split_for_its_length_is_named_with_the_chunk_spec_that_keeps_it_whole() -> None:
    torch.manual_seed(0)
    model = _Table().double()
    x, table = torch.randn(4, 6, 8, dtype=torch.float64), torch.tensor([1, 3, 3, 5])
    with pytest.raises(ValueError, match=r"(?s)split along dim 0 as it has the batch's size 4: table \(4,\).*chunk_spec=\{'table': None\}.\nHow to fix"):
        compile_pipeline(model, (x, table), ["cpu", "cpu"], chunks=2)
    pipe = compile_pipeline(model, (x, table), ["cpu", "cpu"], chunks=2, chunk_spec={"table": None})
    assert torch.allclose(pipe(x, table), model(x, table), rtol=0, atol=1e-12)


class _PositionsFirst(nn.Module):
    """Takes a table of positions every sample shares before its batch."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, pos: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x + pos)
        return self.b(((h @ h.transpose(1, 2)).softmax(-1) @ h).relu())


@pytest.mark.parametrize("length", [5, 6], ids=["another length", "the batch's length"])
def test_a_shared_table_passed_first_is_named_with_the_chunk_spec_that_keeps_it_whole(length: int) -> None:
    """Before, the refusal named only `x`, and its chunk_spec advice failed again or went round
    in a loop; `pos`, which sets the batch's size, was never named."""
    model = _PositionsFirst().double()
    pos, x = torch.randn(length, 8, dtype=torch.float64), torch.randn(6, length, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"read from the first input, pos \({length}, 8\), along dim 0.*chunk_spec=\{{'pos': None\}}"):
        compile_pipeline(model, (pos, x), ["cpu", "cpu"], chunks=2)
    pipe = compile_pipeline(model, (pos, x), ["cpu", "cpu"], chunks=2, chunk_spec={"pos": None})
    torch.testing.assert_close(pipe(pos, x), model(pos, x), rtol=0, atol=1e-12)


class _CarriesItsState(nn.Module):
    """A GRU whose state is a buffer of the batch's size, carried from call to call."""

    h: torch.Tensor  # a buffer, registered in __init__

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.inp, self.rnn, self.out = nn.Linear(6, 12), nn.GRU(12, 10, batch_first=True), nn.Linear(10, 5)
        self.register_buffer("h", torch.zeros(1, batch, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, last = self.rnn(torch.tanh(self.inp(x)), self.h)
        self.h.copy_(last.detach())
        return self.out(y)


def test_state_of_the_batch_size_that_micro_batches_cannot_split_is_named() -> None:
    """Before, the refusal blamed the inputs alone, advising a chunk_spec that cannot reach it."""
    with pytest.raises(ValueError, match=r"buffers the model holds have a dim of the batch's size 4: h \(1, 4, 10\)"):
        compile_pipeline(_CarriesItsState(4), torch.randn(4, 7, 6), ["cpu", "cpu"], chunks=2)


class _MixesSamples(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x - x.mean(0))


class _BatchSecond(nn.Module):
    """Returns its batch along dim 1: gathering the micro-batches needs to know where it lies."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).transpose(0, 1)


def test_an_example_of_one_sample_is_checked_on_the_first_call_of_two() -> None:
    """One sample has no halves to check micro-batches against the whole batch on. Before, such
    an example was refused with chunks > 1; now compiling says so in one line, and the first call
    of two samples or more runs the check: a model that mixes samples is refused there, with the
    message compiling gives, and one that does not runs (and gathers along its own batch dim)."""
    mixes = _MixesSamples().double()
    with pytest.warns(UserWarning, match="the example has one sample.*runs on the first call of two samples or more"):
        pipe = compile_pipeline(mixes, torch.randn(1, 4, dtype=torch.float64), ["cpu", "cpu"], chunks=2)
    one = torch.randn(1, 4, dtype=torch.float64)
    torch.testing.assert_close(pipe(one), mixes(one), rtol=0, atol=0)  # one sample: one micro-batch
    with pytest.raises(TypeError, match="call it once with such a batch before copying it"):
        copy.deepcopy(pipe)
    for _ in range(2):  # refused on every call, not only the first
        with pytest.raises(ValueError, match="mix"):
            pipe(torch.randn(4, 4, dtype=torch.float64))
    with pytest.warns(UserWarning, match="the example has one sample"):
        model = _BatchSecond().double()
        pipe = compile_pipeline(model, torch.randn(1, 4, dtype=torch.float64), ["cpu", "cpu"], chunks=2)
    x = torch.randn(6, 4, dtype=torch.float64)
    out = pipe(x)
    torch.testing.assert_close(out, model(x), rtol=0, atol=1e-12)
    out.square().sum().backward()
    reference = copy.deepcopy(model)
    reference.zero_grad()
    reference(x).square().sum().backward()
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12, msg=name)
    copy.deepcopy(pipe)  # checked: copies are fine


class _SqueezesItsScore(nn.Module):
    """A score squeezed to (B,) and stacked: one sample's is 0-dim, and the stack fails; with
    `centred`, it also mixes samples (h - h.mean(0))."""

    def __init__(self, centred: bool) -> None:
        super().__init__()
        self.centred = centred
        self.a, self.b, self.s = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).relu()
        h = self.b(h - h.mean(0) if self.centred else h).relu()
        s = self.s(h).squeeze()
        return torch.stack([s, 2 * s], 1)


@pytest.mark.parametrize("example", [2, 3])
def test_an_example_whose_parts_of_one_sample_fail_is_checked_on_the_first_call_of_four(example: int) -> None:
    """The check's parts of an example of two or three samples hold one each, which a squeeze
    may break where larger calls are fine. Before, such an example compiled with nothing checked,
    and a model that mixes samples gave outputs and gradients 0.05 off on every later batch."""
    torch.manual_seed(0)
    for centred in (True, False):
        model = _SqueezesItsScore(centred).double()
        reference = copy.deepcopy(model)
        with pytest.warns(UserWarning, match=rf"fails on a part of one sample of the example of {example}.*first call of four samples or more"):
            pipe = compile_pipeline(model, torch.randn(example, 4, dtype=torch.float64), ["cpu", "cpu"], chunks=2)
        small = torch.randn(example, 4, dtype=torch.float64)
        torch.testing.assert_close(pipe(small), reference(small), rtol=0, atol=1e-12)  # one micro-batch, not yet checked
        _checked_on(pipe, reference, torch.randn(8, 4, dtype=torch.float64), mixes=centred)


def _checked_on(pipe: nn.Module, reference: nn.Module, batch: torch.Tensor, mixes: bool) -> None:
    """The first call that can be checked: a model that mixes samples is refused, on that call and
    every later one; another computes what the plain model does, forward and backward."""
    if mixes:
        for _ in range(2):  # refused on every call, not only the first
            with pytest.raises(ValueError, match="mix"):
                pipe(batch)
        return
    out = pipe(batch)
    torch.testing.assert_close(out, reference(batch), rtol=0, atol=1e-12)
    out.square().sum().backward()
    reference(batch).square().sum().backward()
    assert_grads_equal(pipe, reference, tol=1e-12)


class _Centred(nn.Module):
    """Token ids embedded and pooled, then centred over the batch: it mixes samples."""

    def __init__(self, centred: bool) -> None:
        super().__init__()
        self.centred = centred
        self.emb, self.a, self.b = nn.Embedding(20, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.a(self.emb(ids).mean(1))
        return self.b(h - h.mean(0) if self.centred else torch.tanh(h))


@pytest.mark.parametrize("example", ["zeros", "one sample repeated"])
def test_an_example_whose_samples_are_alike_is_checked_on_the_first_call_whose_samples_differ(example: str) -> None:
    """A mean over the batch is each half's mean where the halves are alike: before, a model
    that centres over the batch compiled from token ids of zeros without a word, and then gave
    outputs and gradients 0.005 off on every batch."""
    torch.manual_seed(0)
    ids = torch.zeros(8, 6, dtype=torch.long) if example == "zeros" else torch.randint(0, 20, (1, 6)).repeat(8, 1)
    for centred in (True, False):
        model = _Centred(centred).double()
        with pytest.warns(UserWarning, match="the example's samples all hold the same values.*first call of two samples or more whose samples differ"):
            pipe = compile_pipeline(model, ids, ["cpu", "cpu"], chunks=2)
        reference = copy.deepcopy(model)
        torch.testing.assert_close(pipe(ids), reference(ids), rtol=0, atol=1e-12)  # alike again: exact, and not yet checked
        _checked_on(pipe, reference, torch.randint(0, 20, (8, 6)), mixes=centred)
        if not centred:
            copy.deepcopy(pipe)  # checked: copies are fine


class _TiedMaxNorm(nn.Module):
    """An Embedding with max_norm renormalises, in forward, the rows it looks up; the head reads
    every row of the same weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8, max_norm=1.0)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.emb(idx))))


class _MomentumTeacher(_TiedMaxNorm):
    """The same, with a teacher its forward moves towards `mid` under no_grad (as a momentum
    encoder does): a write torch.fx cannot trace, so that the graph is torch.export's."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = nn.Linear(8, 8).requires_grad_(False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.mid.parameters()):
                t.mul_(0.9).add_(s, alpha=0.1)
        h = self.emb(idx)
        return self.head(torch.relu(self.mid(h)) + self.teacher(h))


RENORMED = r"renormalises these parameters in place: (emb|head)\.weight \(an Embedding with max_norm.*max_norm=None"
ONCE_PER_BATCH = r"writes these parameters in place: teacher\.bias, teacher\.weight; with chunks > 1 the write runs once per micro-batch.*after optimizer\.step\(\), or use chunks=1"


@pytest.mark.parametrize("model, expected", [(_TiedMaxNorm, [RENORMED]), (_MomentumTeacher, [RENORMED, ONCE_PER_BATCH])], ids=["renorm", "renorm-and-average"])
def test_a_parameter_written_in_forward_is_named_in_the_refusal_with_why_micro_batches_change_it(model: type, expected: list[str]) -> None:
    torch.manual_seed(0)
    idx = torch.randint(0, 20, (4, 5))
    with pytest.raises(ValueError) as refused, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch.export in place of torch.fx, said)
        compile_pipeline(model().double(), idx, ["cpu", "cpu"], chunks=2)
    for line in expected:
        assert re.search(line, str(refused.value), re.S), str(refused.value)


class ReturnsItsLoss(nn.Module):
    """Logits and their cross-entropy: with a zero-initialised head the loss is ln(classes) for
    any batch, so the example's halves give the whole's, bit for bit, and it is still made from
    the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.head = nn.Linear(6, 6), nn.Linear(6, 5)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(torch.tanh(self.a(x)))
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


@pytest.mark.filterwarnings("ignore:train_step combines the model.s own loss")
def test_a_loss_the_model_returns_is_never_taken_for_a_value_the_same_in_every_micro_batch() -> None:
    """Before, `pipe(x)` returned micro-batch 0's loss as the batch's, and backward sent its
    gradient to micro-batch 0 alone."""
    model, reference = twin(ReturnsItsLoss())
    labels = torch.randint(0, 5, (8,))
    pipe = compile_pipeline(model, (X, labels), ["cpu", "cpu"], chunks=2)
    node = next(n for n in pipe.program().graph.graph.nodes if n.op == "output").all_input_nodes
    assert VARIES in [dim for n in node for dim in n.meta["batch_dims"]]
    with pytest.raises(ValueError, match=r"(?s)returns output\['loss'\], a value made from the whole batch.*How to fix: for a loss, train with pipe.train_step"):
        pipe(X, labels)
    loss = pipe.train_step(X, labels)  # the model's own loss, combined over the micro-batches
    expected = reference(X, labels)["loss"]
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)


class CountsIndices(nn.Module):
    """An embedding scaling each row's gradient by its index's frequency in the batch."""

    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.functional = functional
        self.emb, self.out = nn.Embedding(10, 4, scale_grad_by_freq=True), nn.Linear(4, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(idx, self.emb.weight, scale_grad_by_freq=True) if self.functional else self.emb(idx)
        return self.out(rows.mean(1))


@pytest.mark.parametrize("functional", [False, True], ids=["module", "F.embedding"])
def test_gradients_scaled_by_index_frequency_are_refused_with_micro_batches(functional: bool) -> None:
    # Before, each micro-batch counted its own indices: row 1's gradient was off by 0.41.
    idx = torch.tensor([[1, 2], [1, 3], [1, 4], [1, 5]])
    with pytest.raises(ValueError, match=r"scale_grad_by_freq=True.*\n.*scale_grad_by_freq=False, or chunks=1"):
        compile_pipeline(CountsIndices(functional), idx, ["cpu"] * 2, chunks=2)
    model = CountsIndices(functional).double()
    reference = copy.deepcopy(model)
    pipe = compile_pipeline(model, idx, ["cpu"] * 2, chunks=1)
    pipe(idx).sum().backward()
    reference(idx).sum().backward()
    assert_grads_equal(pipe, reference)


class KeywordOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, bias: Any = None, *, temp: float) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x) + bias) / temp)


@pytest.mark.filterwarnings("ignore:torch.fx could not trace")
def test_an_exported_models_refusal_names_the_argument_not_the_graphs_placeholder() -> None:
    # Before, it advised chunk_spec={'leaves_1': None}, which compile_pipeline then refused.
    x, bias = torch.randn(8, 6), torch.randn(8)
    with pytest.raises(ValueError, match=r"chunk_spec=\{'bias': None\}"):
        compile_pipeline(KeywordOnly(), (x, bias), ["cpu"] * 2, chunks=2, example_kwargs={"temp": 2.0})
    pipe = compile_pipeline(KeywordOnly(), (x, bias), ["cpu"] * 2, chunks=2, example_kwargs={"temp": 2.0}, chunk_spec={"bias": None})
    assert pipe(x, bias, temp=2.0).shape == (8, 4)


def test_a_list_of_per_sample_values_is_refused_naming_it() -> None:
    model = AlsoReturns(lambda h, x: (h > 0).sum(-1).tolist()).double()  # type: ignore[arg-type,return-value]
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    with pytest.raises(ValueError, match=r"(?s)a value that is not a tensor and depends on the batch.*per-sample values \(\.tolist\(\)\).*How to fix") as raised:
        pipe(X)
    notes = getattr(raised.value, "__notes__", [])
    assert any(re.fullmatch(r"\(It is the model's output\[1\]\[\d\]\.\)", note) for note in notes), notes  # the list, an entry that differs


class Drawn(nn.Module):
    """Dropout, attention with dropout, BatchNorm and a random op between matmuls: every kind of
    node the batch-dims runs fix."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.drop, self.b = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.norm(self.a(x))) + torch.rand_like(x[:, :1])
        q = h.view(h.shape[0], 2, 1, 4)
        return self.b(F.scaled_dot_product_attention(q, q, q, dropout_p=0.5).flatten(1))


@pytest.mark.parametrize("exported", [False, True])
def test_the_whole_examples_run_writes_the_shapes_the_shape_pass_writes(exported: bool) -> None:
    """Compiling runs the graph on the whole example once for both passes: what that run writes
    into every node's meta is what the shape pass writes, and the running statistics and the
    random state are left as they were."""
    model = Drawn().double()
    if exported:
        gm: torch.fx.GraphModule = torch.export.export(model, (X,)).module()
    else:
        gm = torch.fx.symbolic_trace(model)
    keys = ("shape", "dtype", "bytes", "flops", "opaque")
    propagate_shapes(gm, (X,))
    expected = {n.name: [n.meta.pop(k) for k in keys] for n in gm.graph.nodes if n.op != "output"}
    buffers, state = copy.deepcopy(dict(gm.named_buffers())), torch.get_rng_state()
    whole = run_whole(gm, (X,))
    assert whole is not None and whole.values
    assert {n.name: [n.meta[k] for k in keys] for n in gm.graph.nodes if n.op != "output"} == expected
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(b, buffers[name]) for name, b in gm.named_buffers())


class _MaskPerHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor, kpm: torch.Tensor, am: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(self.mha(h, h, h, key_padding_mask=kpm, attn_mask=am)[0])


def test_a_mask_of_batch_times_heads_kept_whole_is_named_with_the_chunk_spec_that_splits_it() -> None:
    """Before, the refusal named only the key padding mask (to keep whole), and following it
    named the same mask back (to split): the input to split, along its dim of batch x heads, went
    unnamed."""
    g = torch.Generator().manual_seed(0)
    model = _MaskPerHead().double()
    x, am = torch.randn(8, 5, 8, dtype=torch.float64, generator=g), torch.randn(16, 5, 5, dtype=torch.float64, generator=g)
    kpm = torch.zeros(8, 5, dtype=torch.bool)
    kpm[:, -1] = True
    with pytest.raises(ValueError, match=r"am \(16, 5, 5\) \(dim 0\).*split with chunk_spec=\{'am': 0\}"):
        compile_pipeline(copy.deepcopy(model), (x, kpm, am), ["cpu", "cpu"], chunks=4)
    pipe = compile_pipeline(copy.deepcopy(model), (x, kpm, am), ["cpu", "cpu"], chunks=4, chunk_spec={"am": 0})
    torch.testing.assert_close(pipe(x, kpm, am), model(x, kpm, am), rtol=0, atol=1e-12)


class _Bags(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.e, self.a = nn.EmbeddingBag(20, 6, mode="sum"), nn.Linear(6, 6)

    def forward(self, flat: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.a(torch.tanh(self.e(flat, offsets, per_sample_weights=weights)))


def test_an_embedding_bag_given_flat_indices_and_offsets_is_refused_saying_the_form_cannot_be_split() -> None:
    """Before, the refusal advised keeping the weights whole, then splitting them again."""
    model = _Bags().double()
    flat, offsets = torch.randint(0, 20, (30,), generator=torch.Generator().manual_seed(0)), torch.tensor([0, 3, 5, 9, 14, 20, 22, 27])
    with pytest.raises(ValueError, match=r"e is an EmbeddingBag given flat indices and offsets: its bags cannot be cut into micro-batches"):
        compile_pipeline(model, (flat, offsets, torch.rand(30, dtype=torch.float64)), ["cpu", "cpu"], chunks=4)


class _Returns(nn.Module):
    """Returns the values the output node names in several shapes: nested, repeated, a node
    whose value is a tuple, a constant beside them."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.a(x)
        return {"h": h, "both": [h, torch.tanh(h)], "pair": h.chunk(2, dim=1), "scale": 2.0}


@pytest.mark.parametrize("exported", [False, True])
def test_runs_by_the_graphs_own_code_keep_what_the_node_by_node_runs_do(exported: bool) -> None:
    """The halves' runs keep only what the graph returns: where no node's draws are fixed they run
    the generated code, whose result is paired back with the output's nodes; a graph whose code
    returns another structure (torch.export's) runs node by node."""
    from fxpipe.passes import example_runs

    model = _Returns().double()
    dynamic = ({0: torch.export.Dim("batch")},)
    gm = torch.export.export(model, (X,), dynamic_shapes=dynamic).module() if exported else torch.fx.symbolic_trace(model)
    returned = set(next(n for n in gm.graph.nodes if n.op == "output").all_input_nodes)
    halves = [(X[:4],), (X[4:],)]
    fast = example_runs.run_on(gm, halves, True, keep=returned)
    runners: list[example_runs.ExampleRunner] = []

    class Counted(example_runs.ExampleRunner):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            runners.append(self)

    slow = []
    for half in halves:
        runner = example_runs.ExampleRunner(gm, on_meta=False, keep=returned, fixed=set())
        runner.run(*half)
        slow.append(runner.values)
    for got, expected in zip(fast, slow):
        assert got.keys() == expected.keys() == returned
        for node in returned:
            torch.testing.assert_close(got[node], expected[node], rtol=0, atol=0)
    original = example_runs.ExampleRunner
    example_runs.ExampleRunner = Counted  # type: ignore[misc]
    try:
        example_runs.run_on(gm, halves, True, keep=returned)
    finally:
        example_runs.ExampleRunner = original  # type: ignore[misc]
    assert len(runners) == (2 if exported else 0)


def test_a_dropout_that_draws_nothing_now_runs_without_fixed_draws() -> None:
    """Rate 0, or eval mode: nothing to make alike between the whole example and its halves."""
    from fxpipe.passes.example_runs import drawing_or_normalising

    model = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.0), nn.Linear(6, 6), nn.Dropout(0.2), nn.BatchNorm1d(6))
    gm = torch.fx.symbolic_trace(model)
    assert sorted(n.name for n in drawing_or_normalising(gm)) == ["_3", "_4"]
    gm.eval()
    assert sorted(n.name for n in drawing_or_normalising(gm)) == ["_4"]  # the batch norm: normalised by running statistics


class _GraphConvolution(nn.Module):
    """A GCN over the batch's nodes: each node reads its neighbours through the adjacency."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, adjacency: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(adjacency @ self.a(x)))


@pytest.mark.parametrize("spec", [None, {"adjacency": None}], ids=["split", "whole"])
def test_a_matrix_between_the_samples_is_named_with_chunks_1_as_the_fix(spec: Optional[dict[str, Optional[int]]]) -> None:
    """Before, splitting it was advised where it was kept whole, and keeping it whole where it
    was split: neither computes what the model does."""
    x, adjacency = torch.randn(8, 6), (torch.rand(8, 8) < 0.3).float()
    with pytest.raises(ValueError, match=r"(?s)fails on a part of it.*adjacency \(8, 8\).*If one is a matrix between the samples.*runs with chunks=1"):
        compile_pipeline(_GraphConvolution(), (x, adjacency), ["cpu", "cpu"], chunks=2, chunk_spec=spec)


class _PooledPerCloud(nn.Module):
    """Point clouds stacked along dim 0 with a vector of their ids: each point joined with its
    cloud's mean (a global mean pool, as graph libraries write it)."""

    def __init__(self, clouds: int = 4) -> None:
        super().__init__()
        self.a, self.b, self.clouds = nn.Linear(6, 8), nn.Linear(16, 3), clouds

    def forward(self, x: torch.Tensor, cloud: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        sums = torch.zeros(self.clouds, h.shape[1], dtype=h.dtype).index_add_(0, cloud, h)
        counts = torch.zeros(self.clouds, dtype=h.dtype).index_add_(0, cloud, torch.ones_like(cloud, dtype=h.dtype))
        return self.b(torch.cat([h, (sums / counts.clamp(min=1)[:, None])[cloud]], 1))


@pytest.mark.parametrize("chunks", [2, 3, 4])
def test_samples_pooled_in_groups_the_example_s_halves_line_up_with_are_refused(chunks: int) -> None:
    """Two clouds of 8 points: each half of the example is one cloud. Before, the check ran on
    the halves alone and passed, and the pipeline was 0.06-0.2 off with chunks 3 and 4 on the
    example itself, and with chunks 2 on clouds of other sizes."""
    x, cloud = torch.randn(16, 6, dtype=torch.float64), torch.tensor([0] * 8 + [1] * 8)
    with pytest.raises(ValueError, match=r"(?s)the micro-batches would compute otherwise.*starts at: zeros"):
        compile_pipeline(_PooledPerCloud().double(), (x, cloud), ["cpu", "cpu"], chunks=chunks)


class _CountedAndCentred(nn.Module):
    """Counts its calls in a buffer it never reads, and centres over the batch."""

    calls: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        h = self.a(x)
        return self.b(h - h.mean(0))


def test_an_output_made_without_the_state_forward_writes_is_compared_all_the_same() -> None:
    """Before, a buffer written in forward in every mode turned the check off: the model
    compiled and ran 0.13 off (a gradient 0.72 off)."""
    with pytest.raises(ValueError, match=r"(?s)the micro-batches would compute otherwise.*starts at: mean"):
        compile_pipeline(_CountedAndCentred().double(), X, ["cpu", "cpu"], chunks=2)


def test_an_example_whose_halves_are_alike_but_not_its_samples_is_checked_at_compile_time() -> None:
    """Its halves are alike, its quarters not: before, the check waited for a call, and a call
    whose halves were alike too ran four unchecked micro-batches, 0.06 off."""
    u = torch.randint(0, 20, (4, 6))
    with pytest.raises(ValueError, match=r"(?s)the micro-batches would compute otherwise.*starts at: mean"):
        compile_pipeline(_Centred(True).double(), torch.cat([u, u]), ["cpu", "cpu"], chunks=4)


def test_an_example_of_samples_all_alike_is_refused_where_the_check_cannot_wait() -> None:
    """Across processes every rank must refuse alike at compile time, and the check cannot wait
    for a call: before, such an example compiled, and a model centred over the batch trained on
    other numbers."""
    model = _Centred(True).double()
    gm = torch.fx.symbolic_trace(model)
    ids = torch.zeros(8, 6, dtype=torch.long)
    with pytest.raises(ValueError, match=r"(?s)the example needs samples that differ.*How to fix: pass an example batch of samples that differ"):
        annotate_batch_dims(gm, (ids,), chunks=2)
    assert annotate_batch_dims(gm, (ids,), chunks=2, defer_one_sample=True) is False  # in one process: the check waits


class _WithATable(nn.Module):
    """A per-sample output beside one of parameters alone, and one with its batch on dim 1."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.table = nn.Linear(8, 8), nn.Parameter(torch.randn(3, 3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.a(x)
        return h, self.table.softmax(-1), h.transpose(0, 1)


def test_a_call_whose_samples_are_alike_runs_as_one_micro_batch_while_nothing_is_checked() -> None:
    """Before, compiled on zeros, a call of zeros again ran split with the outputs' batch dims
    unknown, and was refused ('dim 0 is not the batch') where the plain model runs."""
    model = _WithATable().double()
    with pytest.warns(UserWarning, match="samples all hold the same values"):
        pipe = compile_pipeline(model, torch.zeros(4, 3, 8, dtype=torch.float64), ["cpu", "cpu"], chunks=2)
    reference = copy.deepcopy(model)
    for x in (torch.zeros(4, 3, 8, dtype=torch.float64), torch.randn(4, 3, 8, dtype=torch.float64), torch.zeros(4, 3, 8, dtype=torch.float64)):
        for got, expected in zip(pipe(x), reference(x)):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


class _Pairs(nn.Module):
    """Samples come in pairs (two views of one item, stacked): each pair is pooled."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).view(-1, 2, 8)
        return self.b((h + h.mean(1, keepdim=True)).flatten(0, 1))


@pytest.mark.parametrize(("batch", "chunks"), [(8, 2), (16, 4)])
def test_a_model_of_pairs_of_samples_split_into_even_micro_batches_compiles_and_matches(batch: int, chunks: int) -> None:
    """The check's parts (3 and 5 of 8) break the pairs: it checks on the halves then. Refused
    before this was handled."""
    model, reference = twin(_Pairs())
    x = torch.randn(batch, 8, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=chunks)
    torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-12)


class _ReturnsPieces(nn.Module):
    """Returns its batch cut into pieces of two samples (`split`), or into samples (`unbind`)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b, self.how = nn.Linear(4, 8), nn.Linear(8, 3), how

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.b(self.a(x).relu())
        return torch.split(h, 2) if self.how == "split" else h.unbind(0)


@pytest.mark.parametrize("how, batch, chunks", [("split", 6, 3), ("split", 8, 4), ("unbind", 6, 2)])
def test_outputs_whose_structure_follows_the_batch_size_are_refused(how: str, batch: int, chunks: int) -> None:
    """Before, micro-batches' pieces were put together leaf by leaf: a tuple of another length,
    holding other samples than the plain model's, with no error."""
    model = _ReturnsPieces(how).double()
    x = torch.randn(batch, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"(?s)the structure of the outputs follows the batch's size.*return the batch whole"):
        compile_pipeline(model, x, ["cpu", "cpu"], chunks=chunks)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=1)
    for got, expected in zip(pipe(x), model(x), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
