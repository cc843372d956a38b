"""Buffers written in forward, BatchNorm under recompute, deferred BatchNorm, dropout rates that
change: the model's state after a step is the plain model's on the same micro-batches."""
from __future__ import annotations

import copy
from typing import TypeVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import assert_grads_equal, grad_of
from fxpipe import Pipeline, compile_pipeline

MODES = ("always", "except_last", "never")
M = TypeVar("M", bound=nn.Module)


def in_turn(model: nn.Module, x: torch.Tensor, chunks: int) -> torch.Tensor:
    """The plain model run on the micro-batches one after another."""
    return torch.cat([model(piece) for piece in torch.tensor_split(x, chunks)])


def compiled(model: M, x: torch.Tensor, stages: int, **kwargs: object) -> tuple[Pipeline, M]:
    """A pipeline of `model` and an untouched copy, taken before compiling."""
    reference = copy.deepcopy(model)
    pipe = compile_pipeline(model, x, ["cpu"] * stages, **kwargs)  # type: ignore[arg-type]
    return pipe, reference


def assert_state_equal(model: nn.Module, reference: nn.Module, tol: float = 1e-10) -> None:
    ours, theirs = model.state_dict(), reference.state_dict()
    assert list(ours) == list(theirs)
    for name, value in ours.items():
        torch.testing.assert_close(value, theirs[name], rtol=0, atol=tol, msg=lambda m: f"{name}: {m}")


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
    out = pipe(x)
    expected = in_turn(reference, x, 4)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    assert_grads_equal(pipe, reference)
    assert_state_equal(pipe, reference)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), in_turn(reference, x, 4), rtol=0, atol=1e-10)
    assert_state_equal(pipe, reference)


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
