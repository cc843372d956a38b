"""Buffers written in forward, BatchNorm under recompute, deferred BatchNorm, dropout rates that
change: the model's state after a step is the plain model's on the same micro-batches."""
from __future__ import annotations

import copy
import warnings
from typing import Any, TypeVar, cast

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from helpers import CountingBlock, assert_call_and_grads_equal, assert_grads_equal, grad_of, prepared_for_qat, twin
from fxpipe import Pipeline, StageError, TraceError, compile_pipeline

MODES = ("always", "except_last", "never")
M = TypeVar("M", bound=nn.Module)


def in_turn(model: nn.Module, x: torch.Tensor, chunks: int) -> torch.Tensor:
    """The plain model run on the micro-batches one after another."""
    return torch.cat([model(piece) for piece in torch.tensor_split(x, chunks)])


def compiled(model: M, x: Any, stages: int, **kwargs: object) -> tuple[Pipeline, M]:
    """A pipeline of `model` and an untouched copy, taken before compiling."""
    reference = copy.deepcopy(model)
    pipe = compile_pipeline(model, x, ["cpu"] * stages, **kwargs)  # type: ignore[arg-type]
    return pipe, reference


def assert_state_equal(model: nn.Module, reference: nn.Module, tol: float = 1e-10) -> None:
    ours, theirs = model.state_dict(), reference.state_dict()
    assert list(ours) == list(theirs)
    for name, value in ours.items():
        torch.testing.assert_close(value, theirs[name], rtol=0, atol=tol, msg=lambda m: f"{name}: {m}")


def step_as_in_turn(pipe: Pipeline, reference: nn.Module, x: torch.Tensor, chunks: int, atol: float) -> None:
    """One forward and backward of the pipeline give the outputs, gradients and state of the
    plain model run on the micro-batches in turn."""
    out = pipe(x)
    expected = in_turn(reference, x, chunks)
    torch.testing.assert_close(out, expected, rtol=0, atol=atol)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    assert_grads_equal(pipe, reference)
    assert_state_equal(pipe, reference)


class Counter(nn.Module):
    """Counts its calls in a buffer that a later stage reads, and keeps a running mean."""

    count: torch.Tensor  # buffers, registered in __init__
    mean: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 5)
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("mean", torch.zeros(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        h = torch.tanh(self.a(x))
        self.mean.mul_(0.5).add_(h.detach().mean(0), alpha=0.5)
        h = torch.tanh(self.b(h))
        return self.c(h) + self.count + self.mean


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stages", [1, 3])
def test_buffer_writes_reach_the_model_once_per_micro_batch_in_order(mode: str, stages: int) -> None:
    x = torch.randn(8, 5, dtype=torch.float64)
    pipe, reference = compiled(Counter().double(), x, stages, chunks=4, checkpoint=mode, balance=None)
    step_as_in_turn(pipe, reference, x, 4, atol=1e-10)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), in_turn(reference, x, 4), rtol=0, atol=1e-10)
    assert_state_equal(pipe, reference)


def test_buffers_the_forward_writes_are_said_at_compile_to_be_written_per_micro_batch() -> None:
    """A step counter read by forward counts `chunks` a call, as the plain model run on the
    micro-batches in turn does; before, nothing said so where BatchNorm's statistics were (a
    warm-up factor of step / 10 put the outputs 0.17 apart from the plain model on the whole batch)."""
    x = torch.randn(8, 5, dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"the forward writes buffers \(count, mean\) as it runs: with chunks=4 it writes them once per micro-batch") as said:
        pipe = compile_pipeline(Counter().double(), x, ["cpu"] * 2, chunks=4)
    assert "a step counter counts 4 a call" in str(said[0].message) and "or use chunks=1" in str(said[0].message)
    assert any("writes them once per micro-batch" in note for note in pipe.plan.notes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one micro-batch, or a forward that writes nothing: nothing to say
        compile_pipeline(Counter().double(), x, ["cpu"] * 2, chunks=1)
        compile_pipeline(nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 2)).double(), x, ["cpu"] * 2, chunks=4)


class SliceWritten(nn.Module):
    """Keeps a running mean of half its features in a slice of a buffer, which two later stages
    read by name (each read a node of its own)."""

    ema: torch.Tensor

    def __init__(self, no_grad: bool) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 5)
        self.register_buffer("ema", torch.zeros(5))
        self.no_grad = no_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        with torch.set_grad_enabled(not self.no_grad):
            self.ema[:3].lerp_(h.detach().mean(0)[:3], 0.5)
        h = torch.tanh(self.b(h)) + 2 * self.ema
        return self.c(h) + self.ema


@pytest.mark.parametrize(("mode", "no_grad"), [*((mode, False) for mode in MODES), ("except_last", True)])
def test_a_buffer_written_through_a_slice_reaches_later_stages_as_its_micro_batch_left_it(mode: str, no_grad: bool) -> None:
    x = torch.randn(8, 5, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the export form says it used torch.export
        pipe, reference = compiled(SliceWritten(no_grad).double(), x, 3, chunks=4, checkpoint=mode, split_points=["b", "c"])
    step_as_in_turn(pipe, reference, x, 4, atol=1e-10)
    if not no_grad:  # torch.set_grad_enabled(True) for a part: under the caller's no_grad the plain model turns them on
        with torch.no_grad(), pytest.raises(RuntimeError, match="compiled with gradients on, and its graph for training mode"):
            pipe(x)
    with torch.set_grad_enabled(not no_grad):
        torch.testing.assert_close(pipe(x), in_turn(reference, x, 4), rtol=0, atol=1e-10)
    assert_state_equal(pipe, reference)


def test_fake_quantisation_observes_once_per_micro_batch_whatever_the_checkpointing() -> None:
    """Quantisation-aware training's default observer is one torch function that writes four
    statistics in place: a recompute must not observe a second time, nor backward run on
    statistics its forward did not use."""
    torch.manual_seed(0)
    model = prepared_for_qat()
    pipe, reference = compiled(model, torch.randn(8, 6), 2, chunks=1, checkpoint="always")
    for _ in range(3):
        x = torch.randn(8, 6)
        out, expected = pipe(x), reference(x)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        out.square().sum().backward()
        expected.square().sum().backward()
    assert_grads_equal(pipe, reference, tol=1e-6)
    assert_state_equal(pipe, reference, tol=0)


class Normed(nn.Module):
    def __init__(self, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.bn1, self.bn2 = nn.BatchNorm1d(6, momentum=momentum), nn.BatchNorm1d(6, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.bn1(self.a(x)))
        return self.bn2(self.b(h)) + h


@pytest.mark.parametrize("mode", MODES)
def test_batch_norm_statistics_are_updated_once_whatever_the_checkpointing(mode: str) -> None:
    x = torch.randn(12, 6, dtype=torch.float64)
    pipe, reference = compiled(Normed().double(), x, 2, chunks=4, checkpoint=mode)
    for _ in range(2):
        out = pipe(x)
        expected = in_turn(reference, x, 4)
        out.sum().backward()
        expected.sum().backward()
    assert int(pipe.get_buffer("bn1.num_batches_tracked")) == int(reference.get_buffer("bn1.num_batches_tracked")) == 8
    assert_state_equal(pipe, reference)
    assert_grads_equal(pipe, reference)
    pipe.eval(), reference.eval()
    torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-10)


def test_batch_norm_in_training_mode_over_micro_batches_is_said_at_compile() -> None:
    """Each micro-batch is normalised by its own statistics: the outputs differ from the plain
    model's on the whole batch. Before, nothing said so (0.41 apart in a probe's model)."""
    x = torch.randn(12, 6, dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"BatchNorm in training mode \(bn1, bn2\) normalises each of the chunks=4 micro-batches") as said:
        pipe = compile_pipeline(Normed().double(), x, ["cpu"] * 2, chunks=4)
    assert "GroupNorm or LayerNorm, or chunks=1" in str(said[0].message)
    assert any("normalises each of the chunks=4 micro-batches" in note for note in pipe.plan.notes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one micro-batch, or the model in eval mode: nothing to say
        compile_pipeline(Normed().double(), x, ["cpu"] * 2, chunks=1)
        compile_pipeline(Normed().double().eval(), x, ["cpu"] * 2, chunks=4)


class SharedNorm(nn.Module):
    """One BatchNorm called at three depths: every call updates its running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.bn(self.a(x)))
        h = torch.tanh(self.bn(self.b(h)))
        return self.d(torch.tanh(self.bn(self.c(h))))


@pytest.mark.parametrize("mode", MODES)
def test_a_batch_norm_called_at_several_depths_keeps_its_calls_in_one_stage(mode: str) -> None:
    """Its updates in two stages would interleave the micro-batches otherwise than the plain
    model (and a recompute would write them again): the cut keeps every call in one stage."""
    x = torch.randn(12, 6, dtype=torch.float64)
    pipe, reference = compiled(SharedNorm().double(), x, 3, chunks=3, checkpoint=mode)
    calls = [i for i, stage in enumerate(pipe.plan.stages) if any(n.startswith("bn") for n in stage.nodes)]
    assert len(calls) == 1, pipe.plan.summary()
    for _ in range(2):
        out = pipe(x)
        expected = in_turn(reference, x, 3)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
        out.sum().backward()
        expected.sum().backward()
    assert int(pipe.get_buffer("bn.num_batches_tracked")) == 18
    assert_state_equal(pipe, reference)
    assert_grads_equal(pipe, reference)
    pipe.eval(), reference.eval()
    torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="(?s)the buffer 'bn.running_mean', which forward writes, runs from bn to bn_2.*keep each of these in one stage"):
        compile_pipeline(SharedNorm(), x.float(), ["cpu"] * 2, split_points=["b"])


class ReadEarlyWriteLate(nn.Module):
    """Reads a buffer early in forward and writes it late: the next micro-batch's read must see
    this one's write."""

    acc: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("acc", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x) + self.acc)
        h = torch.tanh(self.c(torch.tanh(self.b(h))))
        self.acc.add_(0.1 * h.detach().sum(0))
        return self.d(h)


@pytest.mark.parametrize("mode", MODES)
def test_a_buffer_read_before_a_later_write_stays_in_the_writing_stage(mode: str) -> None:
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe, reference = compiled(ReadEarlyWriteLate().double(), x, 2, chunks=4, checkpoint=mode)
    for _ in range(2):
        out = pipe(x)
        expected = in_turn(reference, x, 4)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
        out.pow(2).sum().backward()
        expected.pow(2).sum().backward()
    assert_state_equal(pipe, reference)
    assert_grads_equal(pipe, reference)
    with pytest.raises(ValueError, match="the buffer 'acc', which forward writes, runs from add to add_, and a stage begins between them"):
        compile_pipeline(ReadEarlyWriteLate(), x.float(), ["cpu"] * 2, split_points=["c"])


class TwiceCalled(nn.Module):
    """A block kept whole (its dropout inside) and called at two depths: each stage that calls
    it runs a copy of its own, which must follow the block's mode and rate."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5))
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.block(self.a(x)))
        return self.b(torch.tanh(self.block(h)))


def test_a_module_called_in_two_stages_follows_its_mode_and_rate() -> None:
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe, reference = compiled(TwiceCalled().double(), x, 2, chunks=2, leaf_modules=["block"], balance=[2, 4])
    assert [stage.nodes for stage in pipe.plan.stages] == [["a", "block"], ["tanh", "block_1", "tanh_1", "b"]]
    pipe.eval(), reference.eval()
    torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-10)  # no dropout in eval
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-10)
    in_float, reference_in_float = compiled(TwiceCalled().eval(), x.float(), 2, chunks=2, leaf_modules=["block"], balance=[2, 4])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(in_float(x.float()), reference_in_float(x.float()), rtol=0, atol=0)
    pipe.train()
    for dropout in (pipe.get_submodule("block.1"), reference.get_submodule("block.1")):
        assert isinstance(dropout, nn.Dropout)
        dropout.p = 0.0  # as the plain model's: a rate changed takes effect
    out = pipe(x)
    expected = reference(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
    out.sum().backward()
    expected.sum().backward()
    assert_grads_equal(pipe, reference)
    grads = torch.autograd.grad(pipe(x).sum(), list(pipe.parameters()))
    for got, wanted in zip(grads, torch.autograd.grad(reference(x).sum(), list(reference.parameters()))):
        torch.testing.assert_close(got, wanted, rtol=0, atol=1e-10)
    y = torch.randn(8, 6, dtype=torch.float64)
    loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    torch.testing.assert_close(loss, F.mse_loss(reference(x), y).detach(), rtol=0, atol=1e-10)


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("mode", MODES)
def test_deferred_batch_norm_commits_the_full_batch_statistics_once(mode: str, momentum: float | None) -> None:
    """Normalisation per micro-batch (the outputs of the plain model run in turn); running
    statistics of the whole batch (the plain model's BatchNorm on the full batch of its inputs)."""
    model = nn.Sequential(nn.BatchNorm1d(6, momentum=momentum), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).double()
    x = torch.randn(10, 6, dtype=torch.float64) * 3 + 1
    pipe, reference = compiled(model, x, 2, chunks=4, checkpoint=mode, deferred_batch_norm=True)
    full = copy.deepcopy(reference)
    bn = reference[0]
    assert isinstance(bn, nn.BatchNorm1d)
    for _ in range(2):
        out = pipe(x)
        expected = torch.cat([F.batch_norm(p, None, None, bn.weight, bn.bias, True) for p in torch.tensor_split(x, 4)])
        expected = reference[1:](expected)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
        out.sum().backward()
        expected.sum().backward()
        full(x)
    assert_grads_equal(pipe, reference)
    assert int(pipe.get_buffer("0.num_batches_tracked")) == 2
    assert_state_equal(pipe, full)
    pipe.eval(), full.eval()
    torch.testing.assert_close(pipe(x), full(x), rtol=0, atol=1e-10)


class NormedTokens(nn.Module):
    """BatchNorm over the tokens a mask keeps: a micro-batch of padding alone gives it no rows."""

    def __init__(self, momentum: float | None) -> None:
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(6, 6), nn.BatchNorm1d(6, momentum=momentum), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.b(self.bn(self.a(x)[mask]))


class _NormedBody(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(self.a(x)))


@pytest.mark.parametrize("earlier", ["the plain module", "a pipeline that does not defer"])
def test_deferred_batch_norm_commits_without_breaking_an_earlier_call_of_the_same_norm(earlier: str) -> None:
    """Before, the commit wrote the running statistics as versions autograd counts, where torch's
    kernel does not: a call of the same BatchNorm earlier in the graph (which saved them) failed
    backward with "modified by an inplace operation"."""
    torch.manual_seed(0)
    model, reference = twin(_NormedBody())
    x, x2 = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    deferring = compile_pipeline(model, x, ["cpu", "cpu"], chunks=1, deferred_batch_norm=True)
    if earlier == "the plain module":
        out, expected = deferring(model.norm(x)), reference(reference.norm(x))
    else:
        plain_pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=1)
        out, expected = plain_pipe(x2) * deferring(x), reference(x2) * reference(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_grads_equal(model, reference, tol=1e-12)
    torch.testing.assert_close(model.norm.running_mean, reference.norm.running_mean, rtol=0, atol=1e-12)


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("empty", ["one micro-batch", "every micro-batch"])
def test_deferred_batch_norm_counts_a_micro_batch_that_gives_it_no_rows_as_nothing(momentum: float | None, empty: str) -> None:
    """Before, its record (no rows: a NaN mean) made the running statistics NaN, and every
    output in eval mode after it."""
    torch.manual_seed(0)
    model = NormedTokens(momentum).double()
    x = torch.randn(8, 5, 6, dtype=torch.float64)
    example = torch.ones(8, 5, dtype=torch.bool)
    example[:4, 1:] = False
    pipe, reference = compiled(model, (x, example), 2, chunks=2, deferred_batch_norm=True)
    mask = torch.ones(8, 5, dtype=torch.bool)
    mask[: 4 if empty == "one micro-batch" else 8] = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe(x, mask).sum().backward()
    reference(x, mask).sum().backward()
    assert_state_equal(pipe, reference)
    pipe.eval(), reference.eval()
    torch.testing.assert_close(pipe(x, example), reference(x, example), rtol=0, atol=1e-10)


class NormedTwice(nn.Module):
    """One BatchNorm called at two depths."""

    def __init__(self, momentum: float | None) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.bn = nn.BatchNorm1d(6, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.bn(self.a(x)))
        return self.c(torch.tanh(self.bn(self.b(h))))


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("stages", [1, 2])
def test_deferred_batch_norm_called_at_two_depths_commits_each_call(stages: int, momentum: float | None) -> None:
    """Each call's statistics are committed in the calls' order, as the plain model updates
    them at each call. Before, the calls' records were merged into one update: running means
    0.036 off and one batch counted where the plain model counts two, with chunks=1."""
    model, reference = twin(NormedTwice(momentum))
    x, y = torch.randn(12, 6, dtype=torch.float64) * 3 + 1, torch.randn(12, 3, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * stages, chunks=1, deferred_batch_norm=True)
    for _ in range(2):
        loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
        expected = F.mse_loss(reference(x), y)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    pipe(x).sum().backward()
    reference(x).sum().backward()
    assert_grads_equal(pipe, reference)
    assert int(model.get_buffer("bn.num_batches_tracked")) == 6
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(model.bn, name), getattr(reference.bn, name), rtol=0, atol=1e-12)
    assert_call_and_grads_equal(pipe, reference, x)  # two more updates on each
    first, second = pipe(x), pipe(x * 2)  # two forwards before one backward: four more
    (first.sum() + second.pow(2).sum()).backward()
    (reference(x).sum() + reference(x * 2).pow(2).sum()).backward()
    assert_grads_equal(pipe, reference)
    pipe.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-12)
    assert int(model.get_buffer("bn.num_batches_tracked")) == 12
    torch.testing.assert_close(model.bn.running_var, reference.bn.running_var, rtol=0, atol=1e-12)


@pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "per-micro-batch"])
@pytest.mark.parametrize("mode", ["always", "never"])
def test_track_running_stats_changed_after_compiling_is_followed(mode: str, deferred: bool) -> None:
    """Turned off after compiling, running statistics stay as they are, as in the plain model;
    turned on, the pipeline updates them as one compiled with them on does (deferred: the whole
    batch's, once; otherwise each micro-batch's in turn, once, recompute or not)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(6), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).double()
    x = torch.randn(10, 6, dtype=torch.float64) * 3 + 1

    def compiled_tracking(track: bool) -> tuple[Pipeline, nn.BatchNorm1d]:
        copied = copy.deepcopy(model)
        norm = copied.get_submodule("0")
        assert isinstance(norm, nn.BatchNorm1d)
        norm.track_running_stats = track
        pipe = compile_pipeline(copied, x, ["cpu"] * 2, chunks=2, checkpoint=mode, deferred_batch_norm=deferred, balance=[1, 3])
        return pipe, norm

    (as_compiled, _), (turned_off, off), (turned_on, on) = map(compiled_tracking, (True, True, False))
    off.track_running_stats, on.track_running_stats = False, True
    reference = copy.deepcopy(model)
    setattr(reference.get_submodule("0"), "track_running_stats", False)
    for pipe in (as_compiled, turned_off, turned_on):
        pipe(x).sum().backward()
    reference(x).sum().backward()
    assert_state_equal(turned_off, reference)
    assert_state_equal(turned_on, as_compiled)
    assert int(turned_on.get_buffer("0.num_batches_tracked")) == (1 if deferred else 2)


class NormActs(nn.Module):
    """timm's BatchNormAct2d pattern: a BatchNorm subclass outside torch.nn whose forward calls
    F.batch_norm on its own running statistics (torch.fx traces through it); or plain BatchNorm
    modules in a forward that takes **kwargs (torch.export, whose graph holds aten.batch_norm)."""

    def __init__(self, functional: bool) -> None:
        super().__init__()
        norm = _BatchNormAct if functional else nn.BatchNorm1d
        self.a, self.na, self.b, self.nb = nn.Linear(6, 6), norm(6), nn.Linear(6, 6), norm(6)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.nb(self.b(torch.tanh(self.na(self.a(x)))))


class _BatchNormAct(nn.BatchNorm1d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training, self.momentum or 0.1, self.eps))


@pytest.mark.filterwarnings("ignore:torch.fx could not trace")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("functional", [True, False], ids=["F.batch_norm", "aten.batch_norm"])
def test_a_norm_called_as_a_function_updates_its_statistics_once_recomputed_or_not(functional: bool, mode: str) -> None:
    """Before, a recompute wrote the running statistics again: their schema does not say the
    op writes them, and no module called whole did."""
    model = NormActs(functional).double()
    x = torch.randn(8, 6, dtype=torch.float64) * 2 + 1
    pipe, reference = compiled(model, x, 2, chunks=2, checkpoint=mode)
    pipe(x).pow(2).sum().backward()
    in_turn(reference, x, 2).pow(2).sum().backward()
    assert_state_equal(pipe, reference)
    assert_grads_equal(pipe, reference)


class _NormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(6, 6), nn.BatchNorm1d(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x))


@pytest.mark.filterwarnings("ignore:torch.fx could not trace")
@pytest.mark.parametrize(
    "case, found",
    [
        ("F.batch_norm", "1.running_mean, which batch_norm writes"),
        ("aten.batch_norm", "na.running_mean, which batch_norm.default writes"),  # by a subclass's forward
        ("subclass kept whole", "1 (_BatchNormAct), a BatchNorm with a forward of its own"),
        ("block kept whole", "1 (_NormBlock), called whole, with a norm inside"),
        ("instance norm", "1 (InstanceNorm1d), a norm other than BatchNorm"),
        ("sync batch norm", "1 (SyncBatchNorm), a BatchNorm with a forward of its own"),  # (its fix named torch's BatchNorms alike)
    ],
)
def test_deferred_batch_norm_refuses_statistics_it_cannot_defer(case: str, found: str) -> None:
    """Before, these stayed updated per micro-batch without a word, and a BatchNorm subclass
    kept whole lost what its forward adds (the ReLU) to the plain normalisation."""
    x = torch.randn(8, 5, 6, dtype=torch.float64)  # InstanceNorm1d's (batch, channels, length)
    leaves: list[Any] = [_BatchNormAct] if case == "subclass kept whole" else [_NormBlock] if case == "block kept whole" else []
    norms = {"block kept whole": _NormBlock(), "instance norm": nn.InstanceNorm1d(5, track_running_stats=True), "sync batch norm": nn.SyncBatchNorm(5)}
    norm = norms.get(case, _BatchNormAct(5))
    model: nn.Module = nn.Sequential(nn.Linear(6, 6), norm, nn.Linear(6, 6))
    if case == "aten.batch_norm":
        model, x = NormActs(True), x[:, 0]  # forward(**kwargs): torch.export
    model.double()
    with pytest.raises(ValueError, match="deferred_batch_norm cannot defer") as refused:
        compile_pipeline(model, x, ["cpu"] * 2, chunks=2, deferred_batch_norm=True, leaf_modules=leaves)
    assert found in str(refused.value)
    if case == "sync batch norm":
        assert "for a SyncBatchNorm, the BatchNorm of its dims" in str(refused.value)


class _Traced(NormActs):
    """NormActs(False) with a forward torch.fx traces."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)


@pytest.mark.filterwarnings("ignore:torch.fx could not trace")
@pytest.mark.parametrize("mode", MODES)
def test_deferred_batch_norm_in_an_exported_graph_is_torch_fxs(mode: str) -> None:
    """torch.export's graph calls aten.batch_norm on the modules' statistics, in two stages;
    deferred, it normalises and commits as the same modules traced by torch.fx, which the tests
    above hold to the plain model. Before, it was refused as a norm called as a function."""
    exported, x = NormActs(False).double(), torch.randn(10, 6, dtype=torch.float64) * 2 + 1
    traced = _Traced(False).double()
    traced.load_state_dict(exported.state_dict())
    pipes = [compile_pipeline(m, x, ["cpu"] * 2, chunks=4, checkpoint=mode, deferred_batch_norm=True, schedule="1f1b") for m in (exported, traced)]
    assert "torch.export" in pipes[0].plan.notes[0] and "torch.fx" in pipes[1].plan.notes[0]
    for pipe in pipes:
        pipe(x).pow(2).sum().backward()
        pipe.train_step(x, target=torch.zeros_like(x), loss_fn=F.mse_loss)
    assert_grads_equal(pipes[0], pipes[1])
    assert_state_equal(pipes[0], pipes[1])
    assert int(pipes[0].get_buffer("na.num_batches_tracked")) == 2, "counted once per step"
    pipes[0].eval(), pipes[1].eval()
    torch.testing.assert_close(pipes[0](x), pipes[1](x), rtol=0, atol=1e-10)


class CountsWithoutGrad(nn.Module):
    """Counts its calls inside `torch.no_grad()`: torch.export captures the region as a subgraph
    run by a higher-order op, which writes the buffer."""

    steps: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 5)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.steps.add_(1)
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))) * self.steps


@pytest.mark.parametrize("mode", MODES)
def test_a_buffer_written_inside_a_no_grad_region_is_written_once_per_micro_batch(mode: str) -> None:
    """A recompute must not write it again, and the check of the example's parts must not
    mistake the count for samples mixed across the batch."""
    x = torch.randn(8, 5, dtype=torch.float64)
    with pytest.warns(UserWarning, match="torch.export"):
        pipe, reference = compiled(CountsWithoutGrad().double(), x, 2, chunks=1, checkpoint=mode)
    for _ in range(2):
        out = pipe(x)
        expected = reference(x)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
        out.sum().backward()
        expected.sum().backward()
    assert int(pipe.get_buffer("steps")) == 2
    assert_grads_equal(pipe, reference)
    with pytest.warns(UserWarning, match="torch.export"):
        pipe, reference = compiled(CountsWithoutGrad().double(), x, 2, chunks=2, checkpoint=mode)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), in_turn(reference, x, 2), rtol=0, atol=1e-10)
    assert int(pipe.get_buffer("steps")) == int(reference.get_buffer("steps")) == 2


class Dropping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.drop(torch.tanh(self.b(self.drop(torch.tanh(self.a(x)))))))


def _step(pipe: nn.Module, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for p in pipe.parameters():
        p.grad = None
    torch.manual_seed(seed)
    out = pipe(x)
    out.pow(2).sum().backward()
    return out.detach(), [grad_of(p).clone() for p in pipe.parameters()]


def test_a_dropout_rate_raised_between_steps_is_replayed_exactly() -> None:
    """A warm-up step at p=0 must not make the recompute of a later step at p=0.5 draw other masks."""
    x = torch.randn(8, 8, dtype=torch.float64)
    results = {}
    for mode in ("always", "never"):
        torch.manual_seed(0)
        model = Dropping().double()
        pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4, checkpoint=mode)
        _step(pipe, x, seed=1)
        model.drop.p = 0.5
        results[mode] = _step(pipe, x, seed=2)
        model.drop.p = 0.0
        plain = _step(pipe, x, seed=3)
        torch.testing.assert_close(plain[0], model(x), rtol=0, atol=1e-12)
        assert not torch.allclose(results[mode][0], plain[0]), "dropout did not act"
    (out_a, grads_a), (out_n, grads_n) = results["always"], results["never"]
    assert torch.equal(out_a, out_n)
    assert all(torch.equal(a, n) for a, n in zip(grads_a, grads_n))


class PerMicroBatchDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.a(x), 0.5, self.training)


def test_micro_batches_draw_different_masks() -> None:
    """Every micro-batch has its own random stream: identical rows in two micro-batches get
    different masks (a seed that ignored the micro-batch would repeat them)."""
    x = torch.randn(1, 16).repeat(4, 1)
    pipe = compile_pipeline(PerMicroBatchDropout(), x, ["cpu"], chunks=4)
    out = pipe(x)
    masks = [tuple(row.ne(0).tolist()) for row in out]
    assert len(set(masks)) == 4


def _spectral(new_style: bool) -> nn.Module:
    torch.manual_seed(0)
    norm = nn.utils.parametrizations.spectral_norm if new_style else nn.utils.spectral_norm
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), norm(nn.Linear(6, 6)), nn.Tanh(), nn.Linear(6, 3)).double()


def _power_vectors(model: nn.Module) -> list[torch.Tensor]:
    return [b for name, b in model.named_buffers() if name.endswith("_u") or name.endswith("_v")]


@pytest.mark.parametrize("new_style", [False, True], ids=["hook", "parametrization"])
@pytest.mark.parametrize("mode", MODES)
def test_spectral_norm_iterates_once_per_micro_batch_whatever_the_checkpointing(mode: str, new_style: bool) -> None:
    """spectral_norm's power iteration writes its vectors in place, from a forward hook (old
    style) or a parametrization (new): a recompute must neither iterate again nor see vectors
    written since its forward. Two steps match the plain model run on the micro-batches in turn."""
    x = torch.randn(4, 6, dtype=torch.float64)
    pipe, reference = compiled(_spectral(new_style), x, 2, chunks=2, checkpoint=mode, balance=[4, 1])
    for _ in range(2):
        pipe(x).sum().backward()
        in_turn(reference, x, 2).sum().backward()
    assert_grads_equal(pipe, reference, tol=1e-12)
    for got, expected in zip(_power_vectors(pipe), _power_vectors(reference)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("new_style", [False, True], ids=["hook", "parametrization"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_spectral_norm_under_train_step_iterates_once_per_micro_batch(schedule: str, new_style: bool) -> None:
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    pipe, reference = compiled(_spectral(new_style), x, 2, chunks=2, checkpoint="always", balance=[4, 1], schedule=schedule)
    for _ in range(2):
        loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
        expected = F.mse_loss(in_turn(reference, x, 2), y)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)
    for got, want in zip(_power_vectors(pipe), _power_vectors(reference)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("call", ["pipe(x)", "train_step", "no_grad", "eval"])
def test_a_call_inside_parametrize_cached_is_refused_and_exact_outside_it(call: str) -> None:
    """Before, the stages shared one cached weight among the micro-batches: the parametrization's
    originals got no gradient under checkpointing, and a backward ran twice without."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.utils.parametrizations.weight_norm(nn.Linear(6, 6)), nn.Tanh(), nn.Linear(6, 3))
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    pipe, reference = compiled(model.double(), x, 2, chunks=4, checkpoint="always", balance=[2, 3])
    if call == "eval":
        pipe.eval(), reference.eval()

    def run() -> torch.Tensor:
        if call == "train_step":
            return pipe.train_step(x, target=y, loss_fn=F.mse_loss)
        with torch.set_grad_enabled(call != "no_grad"):
            return F.mse_loss(pipe(x), y)

    with nn.utils.parametrize.cached(), pytest.raises(RuntimeError, match=r"(?s)cannot run inside torch.nn.utils.parametrize.cached\(\).*How to fix"):
        run()
    assert all(p.grad is None for p in pipe.parameters()), "a refused call accumulates nothing"
    loss, expected = run(), F.mse_loss(reference(x), y)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12)
    if call in ("pipe(x)", "eval"):
        loss.backward()
    if call != "no_grad":
        expected.backward()
        assert_grads_equal(pipe, reference, tol=1e-12)


def test_a_2bw_loop_inside_parametrize_cached_is_refused_leaving_the_parameters_as_they_were() -> None:
    """Before, the loop ran, and its second micro-batch's backward failed in a stage ('backward
    through the graph a second time') with a hint about loss_fn."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.utils.parametrizations.weight_norm(nn.Linear(6, 6)), nn.Tanh(), nn.Linear(6, 3)).double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, schedule="2bw", balance=[2, 3])
    before = [p.detach().clone() for p in pipe.parameters()]
    with nn.utils.parametrize.cached(), pytest.raises(RuntimeError, match=r"(?s)cannot run inside torch.nn.utils.parametrize.cached\(\).*How to fix"):
        for _ in pipe.train_steps([(x, y)] * 3, loss_fn=F.mse_loss, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.1)):
            pass
    assert all(torch.equal(p, q) for p, q in zip(pipe.parameters(), before))
    assert all(p.grad is None for p in pipe.parameters())


@pytest.mark.parametrize("new_style", [False, True], ids=["hook", "parametrization"])
def test_spectral_norm_in_eval_and_under_no_grad_is_the_plain_model(new_style: bool) -> None:
    """In eval mode spectral_norm does not iterate: the whole batch and its micro-batches agree."""
    x = torch.randn(4, 6, dtype=torch.float64)
    pipe, reference = compiled(_spectral(new_style), x, 2, chunks=2, balance=[4, 1])
    pipe.eval()
    reference.eval()
    pipe(x).sum().backward()
    reference(x).sum().backward()
    assert_grads_equal(pipe, reference, tol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-12)
    for got, want in zip(_power_vectors(pipe), _power_vectors(reference)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class _ReadsItsRunningMean(nn.Module):
    """Adds a BatchNorm's running mean, read after the norm wrote it, to the output of a later
    layer."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = self.norm.running_mean
        h = self.b(self.norm(self.a(x)))
        return h + self.norm.running_mean if mean is not None else h


class _ReadsItsRunningMeanExported(_ReadsItsRunningMean):
    def forward(self, x: torch.Tensor, *rest: Any) -> torch.Tensor:  # torch.fx cannot trace *rest
        return super().forward(x)


@pytest.mark.filterwarnings("ignore:torch.fx could not trace")
@pytest.mark.parametrize("cls", [_ReadsItsRunningMean, _ReadsItsRunningMeanExported], ids=["torch.fx", "torch.export"])
@pytest.mark.parametrize("mode", MODES)
def test_a_running_statistic_read_in_a_later_stage_is_the_one_its_micro_batch_left(mode: str, cls: type[nn.Module]) -> None:
    """Before, the later stage read the live buffer, which a later micro-batch had written by then
    (0.086 off), and the norm's stage, recomputed, wrote it a second time (0.06 off)."""
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe, reference = compiled(cls().double(), x, 2, chunks=2, split_points=["b"], checkpoint=mode)
    step_as_in_turn(pipe, reference, x, 2, atol=1e-12)


class _ReadsBothStatisticsLater(nn.Module):
    """Reads its norm's running mean and variance three layers after the norm."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.b, self.c, self.d = nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.c(torch.tanh(self.b(self.bn(self.a(x))))))
        mean, var = self.bn.running_mean, self.bn.running_var
        assert mean is not None and var is not None
        return self.d((h + mean) * var)


@pytest.mark.parametrize("mode", MODES)
def test_the_copy_of_a_running_statistic_stays_in_the_stage_of_its_norm(mode: str) -> None:
    """Before, a cut could fall between the norm and the copy made after it (interleaved-1f1b's
    own cut did): the later stage copied the live buffer after later micro-batches had written it
    (0.012 off in the loss, 0.2 in the running variance)."""
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    model = _ReadsBothStatisticsLater().double()
    reference = copy.deepcopy(model)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4, checkpoint=mode, schedule="interleaved-1f1b", stages_per_device=2)
    loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    expected = torch.zeros((), dtype=torch.float64)
    for a, b in zip(x.chunk(4), y.chunk(4)):  # each micro-batch's backward before the next writes the statistics
        part = F.mse_loss(reference(a), b) / 4
        part.backward()
        expected += part.detach()
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)
    assert_state_equal(pipe, reference)
    with pytest.raises(ValueError, match=r"(?s)the buffer 'bn.running_mean', which forward writes, runs from bn to clone.*How to fix"):
        compile_pipeline(copy.deepcopy(reference), x, ["cpu"] * 2, balance=[3, 8])  # a cut right after the norm


class _ScalesByItsRunningVar(nn.Module):
    """Reads its norm's running variance right after the norm, where a reordering that closes
    values early would move the read before the norm's write (no edge orders them)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.bn, self.mid, self.bn2, self.fc = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.stem(x)))
        var = self.bn.running_var
        assert var is not None
        return self.fc(self.bn2(self.mid(h * torch.sigmoid(var))))


@pytest.mark.parametrize("stages", [1, 2])
def test_a_running_statistic_read_right_after_its_norm_reads_the_norms_write(stages: int) -> None:
    """Before, the order the stages run their nodes in put the read first: the variance from
    before the update (0.026 off the plain model, even in one stage)."""
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe, reference = compiled(_ScalesByItsRunningVar().double(), x, stages, chunks=1)
    step_as_in_turn(pipe, reference, x, 1, atol=1e-12)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_running_statistic_read_in_a_later_stage_in_every_mode(schedule: str) -> None:
    """The copy of the running mean made after its norm: under train_step's schedules, no_grad,
    eval, and a second step after a failed one, as the plain model run on the micro-batches in turn."""
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    model = _ReadsItsRunningMean().double()
    reference = copy.deepcopy(model)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2, split_points=["b"], schedule=schedule)

    def failing(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a bad loss")

    with pytest.raises(StageError):
        pipe.train_step(x, target=y, loss_fn=failing)  # puts back what its forwards wrote
    loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    expected = sum(F.mse_loss(reference(a), b) / 2 for a, b in zip(x.chunk(2), y.chunk(2)))
    assert isinstance(expected, torch.Tensor)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)
    assert_state_equal(pipe, reference)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), in_turn(reference, x, 2), rtol=0, atol=1e-12)
    assert_state_equal(pipe, reference)
    pipe.eval(), reference.eval()
    torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-12)


class _Checkpointed(nn.Module):
    """A block run under the model's own activation checkpointing, with a BatchNorm or without."""

    def __init__(self, norm: bool, reentrant: bool) -> None:
        super().__init__()
        self.norm: nn.Module = nn.BatchNorm1d(6) if norm else nn.Identity()
        self.lin, self.reentrant = nn.Linear(6, 6), reentrant

    def run(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.relu(self.norm(h)))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.run, h, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_buffers_written_under_the_models_own_checkpointing_are_refused(reentrant: bool) -> None:
    """Its recompute in backward writes the running statistics a second time; before, the
    pipeline wrote them once, 0.075 off the plain model's (the count 2 where it is 4)."""
    model = nn.Sequential(nn.Linear(6, 6), _Checkpointed(True, reentrant), nn.Linear(6, 6)).double()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(TraceError, match=r"(?s)own activation checkpointing \(torch.utils.checkpoint\) runs modules that write their buffers: 1.norm\..*How to fix: turn the model's own checkpointing off"):
        compile_pipeline(model, torch.randn(8, 6, dtype=torch.float64), ["cpu"] * 2, chunks=2)
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items()), "left as it was"
    if not reentrant:  # (a reentrant one is captured by neither front end: a bound method as an autograd Function's argument)
        model, reference = twin(nn.Sequential(nn.Linear(6, 6), _Checkpointed(False, reentrant), nn.Linear(6, 6)))
        x = torch.randn(8, 6, dtype=torch.float64)
        pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2)  # nothing written: fine
        assert_call_and_grads_equal(pipe, reference, x)


class _CalledTwice(nn.Module):
    """`a` at the start and near the end: cut in four, two stages call it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.d(torch.tanh(self.a(torch.tanh(self.c(h)))))


@pytest.mark.parametrize("kind", ["orthogonal", "spectral_norm"])
def test_a_parametrization_that_only_reads_its_buffers_may_be_called_by_two_stages(kind: str) -> None:
    """Before, orthogonal's `base`, which its forward only reads, was taken for a buffer forward
    writes, and four stages were refused ('which forward writes'); spectral_norm's vectors, which
    its power iteration writes in training, keep the module's calls in one stage."""
    torch.manual_seed(0)
    model, reference = twin(_CalledTwice())
    for m in (model, reference):
        getattr(nn.utils.parametrizations, kind)(m.a)
    x = torch.randn(8, 6, dtype=torch.float64)
    if kind == "spectral_norm":
        with pytest.raises(Exception, match="a.parametrizations.weight.0._u'?, which forward writes"):
            compile_pipeline(model, x, ["cpu"] * 4, chunks=2)
        return
    pipe = compile_pipeline(model, x, ["cpu"] * 4, chunks=2)
    assert len(pipe.plan.stages) == 4
    assert_call_and_grads_equal(pipe, reference, x)


class _WholeThenChild(nn.Module):
    """A block kept whole writes its child's buffer; the child, called directly later in a
    module traced through, writes it again."""

    def __init__(self) -> None:
        super().__init__()
        self.block, self.m = CountingBlock(6), nn.ModuleList(nn.Linear(6, 6) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(x)
        for layer in self.m:
            h = torch.tanh(layer(h))
        return self.block.cnt(h)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stages,chunks", [(1, 1), (1, 4), (2, 4)])
def test_a_buffer_a_module_kept_whole_writes_and_the_graph_writes_again_gets_both_writes(stages: int, chunks: int, mode: str) -> None:
    """Before, the graph's write went to a copy of the buffer made after the whole module's
    write (meant for reads): one write of two was lost, even on one device with one micro-batch."""
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe, reference = compiled(_WholeThenChild().double(), x, stages, chunks=chunks, checkpoint=mode, leaf_modules=["block"])
    step_as_in_turn(pipe, reference, x, chunks, atol=1e-10)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), in_turn(reference, x, chunks), rtol=0, atol=1e-10)
    assert_state_equal(pipe, reference)


def test_such_a_buffer_split_between_its_writes_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"the buffer 'block.cnt.n', which forward writes, runs from block to add_"):
        compile_pipeline(_WholeThenChild().double(), torch.randn(8, 6, dtype=torch.float64), ["cpu"] * 3, chunks=4, split_points=["m.1", "m.2"], leaf_modules=["block"])


class _AliasedBuffers(nn.Module):
    """One tensor registered as a buffer in two modules; `writes`: forward counts in it."""

    def __init__(self, writes: bool) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(6, 6, dtype=torch.float64) for _ in range(4))
        shared = torch.ones(6, dtype=torch.float64)  # (model.double() would cast each name apart)
        self.a.register_buffer("scale", shared)
        self.d.register_buffer("scale", shared)
        self.writes = writes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = cast(torch.Tensor, self.a.scale)
        if self.writes:
            scale.add_(1)
        h = torch.tanh(self.a(x) * scale)
        h = torch.tanh(self.c(torch.tanh(self.b(h))))
        return self.d(h) * self.d.scale


def test_a_buffer_held_under_two_names_written_and_read_by_two_stages_is_refused_naming_both() -> None:
    """Before, both stages read the model's tensor itself, and a recompute wrote it a second
    time: counts of 7 and 8 for 4 micro-batches, gradients 0.13-0.41 off."""
    with pytest.raises(ValueError, match=r"the buffer a.scale and d.scale \(one tensor\), which forward writes, is read by more than one stage"):
        compile_pipeline(_AliasedBuffers(writes=True), torch.randn(8, 6, dtype=torch.float64), ["cpu"] * 3, chunks=4, split_points=["b", "d"])


@pytest.mark.parametrize("how", ["assigned", "functional_call"])
def test_a_buffer_held_under_two_names_rebound_under_one_is_refused_and_a_cast_is_not(how: str) -> None:
    """The graph reads the tensor under one name. Before, a new tensor under the other name
    (assigned, or functional_call(..., tie_weights=False)) was ignored: outputs 0.8-1.4 off."""
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe, reference = compiled(_AliasedBuffers(writes=False), x, 3, chunks=4, split_points=["b", "d"])
    torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-12)
    pipe.float()
    reference.float()  # both names cast apart: two tensors of one value
    torch.testing.assert_close(pipe(x.float()), reference(x.float()), rtol=0, atol=1e-6)
    new = torch.full((6,), 3.0)
    with pytest.raises(RuntimeError, match=r"one tensor under several names when compiling now hold different tensors: a.scale and d.scale"):
        if how == "assigned":
            pipe.get_submodule("d").scale = new
            pipe(x.float())
        else:
            torch.func.functional_call(pipe, {"d.scale": new}, (x.float(),), tie_weights=False)


class _TiedHead(nn.Module):
    """A head tied to the embedding, read through F.linear (torch.fx's get_attr) or called whole."""

    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.functional = functional
        self.emb, self.mid, self.head = nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(self.emb(ids)))
        return F.linear(h, self.head.weight) if self.functional else self.head(h)


@pytest.mark.parametrize("functional", [True, False])
@pytest.mark.parametrize("how", ["assigned", "loaded with assign=True", "functional_call"])
def test_a_tied_weight_untied_after_compiling_is_refused_and_kept_tied_runs(how: str, functional: bool) -> None:
    """The stages read a tied weight under one name. Before, a new parameter under the other
    (assigned, loaded apart with assign=True, or functional_call(..., tie_weights=False)) was
    ignored: outputs 6-9 off, and the new weight got no gradient."""
    ids = torch.randint(0, 16, (8, 5))
    pipe, reference = compiled(_TiedHead(functional).double(), ids, 2, chunks=2)
    new = torch.randn(16, 8, dtype=torch.float64)
    with torch.no_grad():  # kept tied: every name handed the same tensor
        torch.testing.assert_close(torch.func.functional_call(pipe, {"head.weight": new}, (ids,)),
                                   torch.func.functional_call(reference, {"head.weight": new}, (ids,)), rtol=0, atol=1e-12)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"(?s)a buffer registered on it\) now hold different tensors: emb.weight and head.weight.*How to fix: compile the model again"):
        if how == "assigned":
            pipe.get_submodule("head").weight = nn.Parameter(new)
            pipe(ids)
        elif how == "loaded with assign=True":
            pipe.load_state_dict({k: v.clone() for k, v in pipe.state_dict().items()}, assign=True)
            pipe(ids)
        else:
            torch.func.functional_call(pipe, {"head.weight": new}, (ids,), tie_weights=False)


class _Doubled(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 2 * w


def test_a_parametrization_registered_on_a_tied_weight_after_compiling_keeps_it_tied_and_runs() -> None:
    """The parametrized name holds the original it computes from, which stays the tied weight.
    Before, it was refused as untied (the name no longer held a Parameter)."""
    ids = torch.randint(0, 16, (8, 5))
    pipe, reference = compiled(_TiedHead(functional=False).double(), ids, 2, chunks=2)
    for model in (pipe, reference):
        torch.nn.utils.parametrize.register_parametrization(model.get_submodule("head"), "weight", _Doubled())
    assert_call_and_grads_equal(pipe, reference, ids)


class _BufferOnTheWeight(nn.Module):
    """A buffer registered on the embedding's weight, read as a matrix."""

    aux: nn.Module

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mid, self.aux = nn.Embedding(16, 8), nn.Linear(8, 8), nn.Module()
        self.aux.register_buffer("w", self.emb.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w: torch.Tensor = self.aux.w  # type: ignore[assignment]
        return torch.tanh(self.mid(self.emb(ids))) @ w.t()


def test_a_buffer_registered_on_a_weight_rebound_after_compiling_is_refused() -> None:
    """The graph reads it under the parameter's name. Before, rebinding the buffer was ignored
    (outputs 1.17 off), and so was a new parameter under the weight's name (1.12)."""
    ids = torch.randint(0, 16, (8, 5))
    for rebind in ("the buffer", "the weight"):
        pipe, reference = compiled(_BufferOnTheWeight().double(), ids, 2, chunks=2)
        assert_call_and_grads_equal(pipe, reference, ids)
        if rebind == "the buffer":
            pipe.get_submodule("aux").w = torch.randn(16, 8, dtype=torch.float64)
        else:
            pipe.get_submodule("emb").weight = nn.Parameter(torch.randn(16, 8, dtype=torch.float64))
        with pytest.raises(RuntimeError, match=r"(?s)now hold different tensors: emb.weight and aux.w.*How to fix: compile the model again"):
            pipe(ids)


class _EmaCodebook(nn.Module):
    """A VQ-VAE's codebook, kept as an exponential moving average in forward under no_grad
    (torch.export captures the region as one op that writes three buffers)."""

    embed: torch.Tensor
    cluster_size: torch.Tensor
    embed_avg: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6))
        self.dec = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6))
        self.register_buffer("embed", torch.randn(5, 6))
        self.register_buffer("cluster_size", torch.zeros(5))
        self.register_buffer("embed_avg", self.embed.clone())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.enc(x)
        idx = torch.cdist(z, self.embed).argmin(1)
        q = F.embedding(idx, self.embed)
        with torch.no_grad():
            onehot = F.one_hot(idx, 5).type(z.dtype)
            self.cluster_size.mul_(0.9).add_(onehot.sum(0), alpha=0.1)
            self.embed_avg.mul_(0.9).add_(onehot.t() @ z, alpha=0.1)
            self.embed.copy_(self.embed_avg / (self.cluster_size + 1e-5).unsqueeze(1))
        return self.dec(z + (q - z).detach()), (z - q.detach()).pow(2).mean(1)


def test_the_automatic_cut_keeps_a_no_grad_region_s_writes_with_what_follows_them() -> None:
    """Before, the cut search put a stage boundary right after the region, then refused its own
    cut ('wrap_with_set_grad_enabled ... stage 1 could not see what it wrote')."""
    torch.manual_seed(0)
    model = _EmaCodebook().double()
    x = torch.randn(8, 6, dtype=torch.float64)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch.export's fallback)
        pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=1)
    for got, expected in zip(pipe(x), reference(x)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    assert_state_equal(pipe, reference)


class _Distils(nn.Module):
    """A student, and a teacher run under no_grad (torch.export captures the region)."""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
        self.teacher = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 6)).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.student(x)
        with torch.no_grad():
            t = self.teacher(x)
        return (F.log_softmax(s, -1) * F.softmax(t, -1)).sum(-1)


@pytest.mark.filterwarnings("ignore:torch.fx could not trace")
def test_deferred_batch_norm_refuses_a_norm_in_training_inside_a_no_grad_region() -> None:
    """Before, the teacher's statistics stayed updated per micro-batch (4 counts for 1) without
    a word. A teacher in eval mode writes none: it compiles, and computes the plain model's."""
    model, x = _Distils().double(), torch.randn(16, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"teacher\.1\.running_mean, which a norm in training writes inside a no_grad region"):
        compile_pipeline(copy.deepcopy(model), x, ["cpu"] * 2, chunks=4, deferred_batch_norm=True)
    model.teacher.eval()
    reference = copy.deepcopy(model)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4, deferred_batch_norm=True)
    out, expected = pipe(x), reference(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    out.sum().backward()
    expected.sum().backward()
    assert_grads_equal(pipe, reference)
    assert_state_equal(pipe, reference)


class _AveragesInForward(nn.Module):
    """A teacher's weight kept as an average of the student's, written in forward under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.student, self.head = nn.Linear(6, 6), nn.Linear(6, 6)
        self.teacher = nn.Linear(6, 6).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.student(x)
        with torch.no_grad():
            self.teacher.weight.mul_(0.9).add_(self.student.weight, alpha=0.1)
            t = self.teacher(x)
        return self.head(s) * t


@pytest.mark.filterwarnings("ignore:torch.fx could not trace")
def test_a_parameter_written_in_forward_is_refused_where_a_recompute_would_write_it_again() -> None:
    """Before, checkpoint='always' with one micro-batch applied the average twice (0.057 off)."""
    model, x = _AveragesInForward().double(), torch.randn(8, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"(?s)'teacher.weight'.*its recompute would write it a second time.*'except_last' or 'never'"):
        compile_pipeline(copy.deepcopy(model), x, ["cpu"] * 2, chunks=1, checkpoint="always")
    reference = copy.deepcopy(model)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=1, checkpoint="except_last")
    out, expected = pipe(x), reference(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    out.sum().backward()
    expected.sum().backward()
    assert_grads_equal(pipe, reference)
    torch.testing.assert_close(model.teacher.weight, reference.teacher.weight, rtol=0, atol=1e-12)


class _Queues(nn.Module):
    """A queue of a teacher's outputs filled under no_grad (torch.export's region), then read."""

    queue: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.student, self.head = nn.Linear(6, 6), nn.Linear(6, 6)
        self.teacher = nn.Linear(6, 6).requires_grad_(False)
        self.register_buffer("queue", torch.randn(16, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.student(x)
        with torch.no_grad():
            t = self.teacher(x)
            self.queue.copy_(torch.roll(self.queue, x.shape[0], 0))
            self.queue[: x.shape[0]] = t
        return (s * t).sum(-1, keepdim=True) + (self.head(s) @ self.queue.t()).sum(-1, keepdim=True)


@pytest.mark.filterwarnings("ignore:torch.fx could not trace")
@pytest.mark.parametrize("mode", MODES)
def test_a_buffer_a_no_grad_region_writes_is_read_in_a_later_stage_as_its_micro_batch_left_it(mode: str) -> None:
    """The region returns the buffer itself among its outputs, which went whole to the next
    stage: before, that stage read the queue as the next micro-batch had left it (2.7-5.7 off)."""
    torch.manual_seed(0)
    model, x = _Queues().double(), torch.randn(8, 6, dtype=torch.float64)
    reference = copy.deepcopy(model)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2, checkpoint=mode)
    assert len(pipe.plan.stages) == 2
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), in_turn(reference, x, 2), rtol=0, atol=1e-12)
    assert_state_equal(pipe, reference)
    if mode == "never":
        return  # refused in training: the queue is saved for backward and the next micro-batch writes it
    pipe(x).pow(2).sum().backward()
    for piece in x.chunk(2):
        reference(piece).pow(2).sum().backward()
    assert_grads_equal(pipe, reference)
    assert_state_equal(pipe, reference)
