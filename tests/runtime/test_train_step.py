"""`pipe.train_step` under every schedule gives the plain model's loss and gradients, in every mode."""
from __future__ import annotations

import collections
import contextlib
import copy
import functools
import itertools
import math
import types
import warnings
from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import FanOut, PaddedLM, SeqFirst, assert_grads_equal, example_module, grad_of, padded_labels, prepared_for_qat, twin
import fxpipe.runtime.losses
from fxpipe import StageError, TraceError, compile_pipeline
from fxpipe.core.microbatch import split_sizes
from fxpipe.core.own_loss import SUMMED_ON_EXAMPLE

MODES = ("always", "except_last", "never")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
Case = tuple[nn.Module, torch.Tensor, torch.Tensor, Callable[[Any, Any], torch.Tensor]]


def _example(name: str, **sizes: Any) -> Case:
    m = example_module(name)
    x, y = m.make_batch(8, dtype=torch.float64) if name != "gpt" else m.make_batch(8)
    return m.make_model(**sizes), x, y, m.loss_fn


def _fan_out() -> Case:
    return FanOut(), torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64), F.mse_loss


MODELS: dict[str, Callable[[], Case]] = {
    "unet": lambda: _example("unet", base=4),
    "resnet": lambda: _example("resnet"),
    "gpt": lambda: _example("gpt", n_layer=3, n_embd=32),  # its head is tied to the embedding
    "fan_out": _fan_out,  # one value read by three later stages
}


def compile_with(model: nn.Module, x: Any, schedule: str, **kwargs: Any) -> Any:
    """Four stages: on four devices, or, interleaved, two stages on each of two devices."""
    if schedule == "interleaved-1f1b":
        return compile_pipeline(model, x, ["cpu"] * 2, schedule=schedule, stages_per_device=2, **kwargs)
    return compile_pipeline(model, x, ["cpu"] * 4, schedule=schedule, **kwargs)


@pytest.mark.parametrize("schedule,mode", list(itertools.product(SCHEDULES, MODES)))
@pytest.mark.parametrize("name", list(MODELS))
def test_train_step_equals_the_plain_model(name: str, schedule: str, mode: str) -> None:
    model, x, y, loss_fn = MODELS[name]()
    model, reference = twin(model)
    pipe = compile_with(model, x, schedule, chunks=4, checkpoint=mode)
    loss, out = pipe.train_step(x, target=y, loss_fn=loss_fn, return_outputs=True)
    expected_out = reference(x)
    expected = loss_fn(expected_out, y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-10)
    torch.testing.assert_close(out, expected_out.detach(), rtol=0, atol=1e-10)
    assert not loss.requires_grad and not out.requires_grad
    assert_grads_equal(pipe, reference)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_train_step_and_call_then_backward_agree(schedule: str) -> None:
    model, x, y, loss_fn = _fan_out()
    model = model.double()
    pipe = compile_with(model, x, schedule, chunks=4)
    loss_fn(pipe(x), y).backward()
    by_call = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
    pipe.zero_grad()
    pipe.train_step(x, target=y, loss_fn=loss_fn)
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, by_call[name], rtol=0, atol=1e-12)


# 'never' runs every micro-batch's loss-stage backward from the loss itself (see
# test_the_loss_stage_backward_starts_from_the_loss...), 'except_last' only the last one's.
FUSED_OR_NOT = ("except_last", "never")


@pytest.mark.parametrize("mode", FUSED_OR_NOT)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gradients_accumulate_over_steps_and_the_inputs_get_theirs(schedule: str, mode: str) -> None:
    model, reference = twin(FanOut())
    pipe = compile_with(model, torch.randn(8, 6, dtype=torch.float64), schedule, chunks=4, checkpoint=mode)
    batches = [torch.randn(8, 6, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    targets = [torch.randn(8, 6, dtype=torch.float64) for _ in range(2)]
    for x, y in zip(batches, targets):
        pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    for x, y in zip(batches, targets):
        x_ref = x.detach().requires_grad_()
        F.mse_loss(reference(x_ref), y).backward()
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)


def test_a_sum_reduced_loss_is_summed_over_micro_batches() -> None:
    model, reference = twin(FanOut())
    x, y = torch.randn(7, 6, dtype=torch.float64), torch.randn(7, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 3, chunks=3, schedule="1f1b")
    loss_fn = lambda out, target: F.mse_loss(out, target, reduction="sum")  # noqa: E731
    loss = pipe.train_step(x, target=y, loss_fn=loss_fn, reduction="sum")
    expected = loss_fn(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-10)
    assert_grads_equal(pipe, reference)


def _penalised(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A sum over samples plus a penalty on its gradient with respect to the outputs."""
    loss = F.mse_loss(torch.tanh(out), target, reduction="sum")
    (grad,) = torch.autograd.grad(loss, out, create_graph=True)
    return loss + grad.pow(2).sum()


def _hooked(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    out.register_hook(lambda g: g.clamp(-0.05, 0.05))
    out.retain_grad()
    return F.mse_loss(out, target, reduction="sum")


@pytest.mark.parametrize("loss_fn", [_penalised, _hooked], ids=["autograd.grad", "hook"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_a_loss_fn_that_differentiates_its_outputs(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], schedule: str) -> None:
    """Before, with more than one micro-batch, the check that the losses combine ran loss_fn on
    outputs without grad, and torch's own error came out of train_step ("element 0 of tensors
    does not require grad", "cannot register a hook")."""
    torch.manual_seed(0)
    model, reference = twin(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)))
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, schedule=schedule)
    loss = pipe.train_step(x, target=y, loss_fn=loss_fn, reduction="sum")
    expected = loss_fn(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)


@pytest.mark.parametrize("behind", ["the weights", "the input"])
@pytest.mark.parametrize("unused", ["allow_unused=True", "materialize_grads=True"])
def test_a_loss_fn_that_differentiates_what_lies_behind_the_outputs_is_refused(behind: str, unused: str) -> None:
    """A gradient penalty on the weights or on the input, taken inside loss_fn: it sees the
    outputs with no graph behind them. Before, the penalty's gradients came back None (or zero)
    and the step trained without it, silently (loss 0.395 where the plain model's was 1.287)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1)).double()
    x, y = torch.randn(8, 6, dtype=torch.float64, requires_grad=True), torch.randn(8, 1, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    wrt = list(model.parameters()) if behind == "the weights" else [x]

    def penalised(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(out, target)
        if unused == "allow_unused=True":
            grads = torch.autograd.grad(loss, wrt, create_graph=True, allow_unused=True)
        else:
            grads = torch.autograd.grad(loss, wrt, create_graph=True, materialize_grads=True)
        return loss + sum(g.pow(2).sum() for g in grads if g is not None)

    reference = copy.deepcopy(model)
    with pytest.raises(StageError, match=r"(?s)in loss: RuntimeError: loss_fn differentiates with respect to tensors its loss does not reach.*How to fix") as raised:
        pipe.train_step(x, target=y, loss_fn=penalised)
    assert "The target's tensors" not in str(raised.value), "no note on how the target was split"
    assert all(p.grad is None for p in model.parameters()) and x.grad is None
    # the next step, under autocast and not, as the plain model's
    for autocast in (False, True):
        model.zero_grad()
        reference.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = pipe.train_step(x.detach(), target=y, loss_fn=F.mse_loss)
            expected = F.mse_loss(reference(x.detach()), y)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
        assert_grads_equal(pipe, reference, tol=1e-12)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_a_target_computed_with_gradients_gives_its_graph_the_plain_models_gradient(schedule: str) -> None:
    """A jointly trained teacher's output as the target. Before, the second micro-batch's backward
    went through the target's graph, which the first had freed (torch's "backward through the
    graph a second time", in a StageError)."""
    torch.manual_seed(0)
    model, reference = twin(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)))
    teacher, plain_teacher = twin(nn.Linear(8, 8))
    x = torch.randn(8, 8, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, schedule=schedule)
    loss = pipe.train_step(x, target=torch.tanh(teacher(x)), loss_fn=F.mse_loss)
    expected = F.mse_loss(reference(x), torch.tanh(plain_teacher(x)))
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)
    assert_grads_equal(teacher, plain_teacher, tol=1e-12)


def test_a_tensor_computed_with_gradients_outside_loss_fn_is_named_with_its_fix() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).double()
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4)
    log_t = nn.Parameter(torch.tensor(0.3, dtype=torch.float64))
    temperature = log_t.exp()
    with pytest.raises(StageError, match=r"compute that tensor where it is read, inside the forward or inside loss_fn"):
        pipe.train_step(x, target=y, loss_fn=lambda out, t: F.mse_loss(out * temperature, t))
    assert log_t.grad is None and all(p.grad is None for p in model.parameters())
    pipe.train_step(x, target=y, loss_fn=lambda out, t: F.mse_loss(out * log_t.exp(), t))  # the fix
    assert log_t.grad is not None


def test_a_mean_over_a_varying_count_of_tokens_is_refused_with_a_fix_that_works() -> None:
    """The refusal's fix, a sum over the whole batch's count with reduction='sum', gives the plain
    model's loss and gradients; across processes, where pipe(x) runs forward only, it is the one
    way (the message said to use pipe(x) and loss.backward() alone before)."""
    model, reference = twin(nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 5)))
    x = torch.randn(8, 6, dtype=torch.float64)
    y = torch.tensor([0, -100, 1, 2, -100, -100, 3, 4])
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4)
    with pytest.raises(ValueError, match=r"(?s)not a mean over samples.*divide its sum by the whole batch's count.*reduction='sum'"):
        pipe.train_step(x, target=y, loss_fn=lambda out, t: F.cross_entropy(out, t, ignore_index=-100))
    count = (y != -100).sum()
    loss = pipe.train_step(x, target=y, loss_fn=lambda out, t: F.cross_entropy(out, t, ignore_index=-100, reduction="sum") / count, reduction="sum")
    expected = F.cross_entropy(reference(x), y, ignore_index=-100)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)


def test_a_loss_combined_wrongly_is_refused_and_accumulates_nothing() -> None:
    model = FanOut().double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4, schedule="1f1b")
    summed = lambda out, target: F.mse_loss(out, target, reduction="sum")  # noqa: E731
    with pytest.raises(ValueError, match="(?s)not a mean over samples.*reduction='sum'.*No gradient"):
        pipe.train_step(x, target=y, loss_fn=summed)
    assert all(p.grad is None for p in pipe.parameters())
    pipe.train_step(x, target=y, loss_fn=summed, reduction="sum")  # and it works as told
    assert all(p.grad is not None for p in pipe.parameters())


def _advantage_normalised(out: torch.Tensor, target: Any) -> torch.Tensor:
    """PPO's policy loss in its first epoch: the ratio is 1 in value, the advantages normalised
    over the batch; its value is about 0 on any part of the batch, its gradient is not."""
    advantage, old = target
    logp = F.log_softmax(out, -1)[:, 0]
    advantage = (advantage - advantage.mean()) / advantage.std()
    return -(torch.exp(logp - old) * advantage).mean()


def _scaled_by_its_detached_mean(out: torch.Tensor, target: Any) -> torch.Tensor:
    losses = (out - target[0]).pow(2).mean(-1)
    return (losses / losses.detach().mean()).mean()  # 1 in value on every part of the batch


def _hook_on_the_outputs(out: torch.Tensor, target: Any) -> torch.Tensor:
    out.register_hook(lambda g: g / g.norm())  # the gradient normalised over what the hook sees
    return F.mse_loss(out, target[0])


@pytest.mark.parametrize("loss", [_advantage_normalised, _scaled_by_its_detached_mean, _hook_on_the_outputs])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_loss_whose_value_combines_but_whose_gradient_does_not_is_refused(loss: Callable[[Any, Any], torch.Tensor], schedule: str) -> None:
    """Before, the check compared values alone: these gave the plain model's loss and gradients
    0.03-0.98 off it (of their size), with no word. The statistic computed on the whole batch and
    given in the target, whole to every micro-batch, trains as the plain model."""
    model, reference = twin(nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)))
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    advantage = torch.randn(8, dtype=torch.float64)
    old = F.log_softmax(reference(x), -1)[:, 0].detach()
    target = (advantage, old) if loss is _advantage_normalised else (y,)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4, schedule=schedule)
    with pytest.raises(ValueError, match=r"(?s)give the loss of the whole batch, but not its gradient.*How to fix: compute that statistic outside"):
        pipe.train_step(x, target=target, loss_fn=loss)
    assert all(p.grad is None for p in pipe.parameters())
    if loss is _advantage_normalised:  # the fix: the statistic from the whole batch, in the target
        normalised = (advantage - advantage.mean()) / advantage.std()
        stats = (advantage.mean(), advantage.std())  # 0-dim: whole to every micro-batch
        fixed = lambda out, t: -(torch.exp(F.log_softmax(out, -1)[:, 0] - t[1]) * (t[0] - t[2]) / t[3]).mean()  # noqa: E731
        got = pipe.train_step(x, target=(advantage, old, *stats), loss_fn=fixed)
        expected = -(torch.exp(F.log_softmax(reference(x), -1)[:, 0] - old) * normalised).mean()
        expected.backward()
        torch.testing.assert_close(got, expected.detach(), rtol=0, atol=1e-12)
        assert_grads_equal(pipe, reference, tol=1e-12)


def test_a_loss_computed_in_bfloat16_from_float32_outputs_is_held_to_its_own_rounding() -> None:
    """Before, refused as "not a mean over samples": the check, made again in float64 for a loss
    of half precision, ran the loss's own cast to bfloat16 again, and held it to float64's tolerance."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    loss_fn = lambda out, t: F.cross_entropy(out.bfloat16(), t)  # noqa: E731
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4)
    loss = pipe.train_step(x, target=y, loss_fn=loss_fn)
    expected = loss_fn(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss.float(), expected.detach().float(), rtol=2e-2, atol=1e-2)
    for p, q in zip(pipe.parameters(), reference.parameters()):
        assert p.grad is not None and q.grad is not None
        assert (p.grad - q.grad).norm() <= 5e-2 * q.grad.norm() + 1e-6


def _maybe_normalised(out: torch.Tensor, target: torch.Tensor, normalise: bool = False) -> torch.Tensor:
    losses = (out - target).pow(2).mean(-1)
    return (losses / losses.detach().mean() if normalise else losses).mean()  # (1 in value on any part, normalised)


def test_the_gradient_is_checked_for_each_loss_however_it_shares_code_with_one_checked() -> None:
    """Before, the check was keyed by a partial's function and a loss module's type: a partial
    of the same function with another setting went unchecked (0.076 off the plain gradient)."""
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4)
    pipe.train_step(x, target=y, loss_fn=functools.partial(_maybe_normalised, normalise=False))
    with pytest.raises(ValueError, match="but not its gradient"):
        pipe.train_step(x, target=y, loss_fn=functools.partial(_maybe_normalised, normalise=True))
    pipe.train_step(x, target=y, loss_fn=nn.CrossEntropyLoss())
    pipe.train_step(x, target=y.softmax(-1), loss_fn=nn.CrossEntropyLoss(label_smoothing=0.1))  # another setting: checked, and fine


def test_a_loss_of_one_element_or_a_count_of_the_whole_batch_in_the_target_is_taken_as_the_plain_model_takes_it() -> None:
    """Before, a target tensor with no dim of the batch's size (a count of the whole batch's
    tokens as a tensor, 0-dim or (1,), as Hugging Face's num_items_in_batch is) was refused as
    not split, and a loss of shape (1,) as not 0-dim; a loss returned with values to log said
    no fix."""
    model, reference = twin(nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 5)))
    x = torch.randn(8, 6, dtype=torch.float64)
    y = torch.tensor([0, -100, 1, 2, -100, -100, 3, 4])
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4)
    count = (y != -100).sum().reshape(1)  # (1,)
    summed = lambda out, t: (F.cross_entropy(out, t[0], ignore_index=-100, reduction="sum") / t[1]).reshape(1)  # noqa: E731
    loss = pipe.train_step(x, target=(y, count), loss_fn=summed, reduction="sum")
    expected = F.cross_entropy(reference(x), y, ignore_index=-100)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)
    with pytest.raises(StageError, match=r"must be a tensor of one element, and loss_fn gave a tuple.*\n.*How to fix: return the loss alone"):
        with_logs: Any = lambda out, t: (F.cross_entropy(out, t, ignore_index=-100), {"logs": 1})  # noqa: E731
        pipe.train_step(x, target=y, loss_fn=with_logs)


class _ReturnsWeight(nn.Module):
    """Returns its last layer's weight beside the output: the loss reads it as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.b(torch.tanh(self.a(x))), self.b.weight


@pytest.mark.parametrize("mode", ["except_last", "never"])
@pytest.mark.parametrize("failure", ["refused combination", "stage error"])
def test_a_failed_step_puts_back_what_the_loss_reached_besides_the_outputs(failure: str, mode: str) -> None:
    """A parameter the model returns and a temperature the loss reads get each micro-batch's
    gradient as its backward runs: a step refused or failed afterwards must leave them as they
    were, as it leaves the stages' parameters."""
    model = _ReturnsWeight().double()
    temperature = nn.Parameter(torch.tensor(2.0, dtype=torch.float64))
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4, schedule="1f1b", checkpoint=mode)

    def loss_fn(out: Any, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        return F.mse_loss(out[0] / temperature, target, reduction=reduction) + out[1].pow(2).sum() + temperature

    pipe.train_step(x, target=y, loss_fn=loss_fn)
    before = {name: grad_of(p).clone() for name, p in [*pipe.named_parameters(), ("temperature", temperature)]}
    if failure == "refused combination":
        with pytest.raises(ValueError, match="not a mean over samples"):
            pipe.train_step(x, target=y, loss_fn=lambda out, t: loss_fn(out, t, "sum"))
    else:
        bad = x.clone()
        bad[6:] = float("nan")  # micro-batch 3: stage 1 refuses it after micro-batch 0's backward
        pipe.get_submodule("b").register_forward_hook(_refuse_nan)
        with pytest.raises(StageError, match="a NaN reached b"):
            pipe.train_step(bad, target=y, loss_fn=loss_fn)
    after = {name: grad_of(p) for name, p in [*pipe.named_parameters(), ("temperature", temperature)]}
    assert all(torch.equal(after[name], grad) for name, grad in before.items()), "a failed step accumulated nothing"


def _refuse_nan(module: nn.Module, args: Any, out: torch.Tensor) -> None:
    if bool(out.isnan().any()):
        raise ValueError("a NaN reached b")


class _Tally(nn.Module):
    """Counts its calls in a plain int: called whole."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return h


class _Counted(nn.Module):
    """BatchNorm and counters: buffers every forward writes, and an attribute."""

    calls: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b, self.tally = nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 6), _Tally()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.b(self.tally(self.norm(torch.tanh(self.a(x)))))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("failure", ["refused combination", "stage error", "pipe(x) stage error"])
def test_a_failed_step_writes_no_buffer(failure: str, schedule: str) -> None:
    """As it accumulates nothing into `.grad`: a step that fails or is refused after its
    forwards ran puts back what they wrote (running statistics, a counter)."""
    model, reference = twin(_Counted())
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4, schedule=schedule, split_points=["norm"])
    before = copy.deepcopy(model.state_dict())
    if failure == "refused combination":
        with pytest.raises(ValueError, match="not a mean over samples"):
            pipe.train_step(x, target=y, loss_fn=lambda out, t: F.mse_loss(out, t, reduction="sum"))
    else:
        bad = x.clone()
        bad[4:6] = float("nan")  # micro-batch 2 fails in stage 1, after micro-batches 0 and 1 ran
        handle = pipe.get_submodule("b").register_forward_hook(_refuse_nan)
        with pytest.raises(StageError, match="micro-batch 2 in forward(.|\n)*a NaN reached b"):
            pipe.train_step(bad, target=y, loss_fn=F.mse_loss) if failure == "stage error" else pipe(bad)
        handle.remove()
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items()), "a buffer was written"
    assert model.tally.calls == 0, "the count of a module called whole was kept"
    assert all(p.grad is None for p in pipe.parameters())
    loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss)  # and the next step is the plain model's
    expected = torch.stack([F.mse_loss(reference(x[i : i + 2]), y[i : i + 2]) for i in range(0, 8, 2)]).mean()
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=1e-12)


def test_a_failed_step_puts_back_buffers_its_forward_resized_and_says_why_it_failed() -> None:
    """Quantisation-aware training's observers resize their empty statistics on the first
    forward. Before, the put-back of a failed step raised on their shapes: the step's own error
    was lost ("size of tensor a (6) must match ... (0)"), and every buffer stayed as written."""
    torch.manual_seed(0)
    model = prepared_for_qat()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=1)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(StageError, match=r"in loss: RuntimeError: The size of tensor a \(3\) must match the size of tensor b \(2\)"):
        pipe.train_step(x, target=y[:, :2], loss_fn=F.mse_loss)
    for key, value in model.state_dict().items():
        assert value.shape == before[key].shape and torch.equal(value, before[key]), f"{key} was left as the failed step wrote it"
    loss, expected = pipe.train_step(x, target=y, loss_fn=F.mse_loss), F.mse_loss(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-6)
    assert_grads_equal(pipe, reference, tol=1e-6)


@pytest.mark.parametrize("checkpoint", ["except_last", "never"])
def test_a_failed_call_leaves_the_backward_of_an_earlier_output_as_it_was(checkpoint: str) -> None:
    """Before, putting back the running statistics the failed call wrote moved their version
    counters, which an earlier output's BatchNorm backward checks: its backward raised
    "modified by an inplace operation", where the plain model's gives the gradients."""
    model, reference = twin(_Counted())
    x, bad = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    bad[4:6] = float("nan")  # micro-batch 2 fails in stage 1, after micro-batches 0 and 1 ran
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4, checkpoint=checkpoint, split_points=["norm"])
    out = pipe(x)
    handle = pipe.get_submodule("b").register_forward_hook(_refuse_nan)
    with pytest.raises(StageError, match="a NaN reached b"):
        pipe(bad)
    handle.remove()
    out.square().sum().backward()
    sum(reference(x[i : i + 2]).square().sum() for i in range(0, 8, 2)).backward()
    assert_grads_equal(pipe, reference)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=1e-12)


@pytest.mark.parametrize("call", ["train_step", "pipe(x)"])
def test_a_failed_step_leaves_the_callers_generator_as_it_was(call: str) -> None:
    """As across processes: before, in one process a step that failed after its dropout or its
    loss_fn drew left the generator moved."""
    model = Dropping().double()
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2, schedule="1f1b")

    def draws_then_fails(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        torch.randn(3)
        raise RuntimeError("a bad loss")

    before = torch.get_rng_state()
    with pytest.raises(StageError):
        if call == "train_step":
            pipe.train_step(x, target=x, loss_fn=draws_then_fails)
        else:
            pipe(x[:, :5])  # fails in its first layer, after the step's seed was taken
    assert torch.equal(torch.get_rng_state(), before)


def test_buffers_over_the_put_back_limit_are_not_copied_and_keep_a_failed_steps_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy on every step would cost more than the step for a large buffer (a queue of features)."""
    import fxpipe.runtime.rollback

    monkeypatch.setattr(fxpipe.runtime.rollback, "PUT_BACK_LIMIT", 0)
    model = _Counted().double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4, split_points=["norm"])
    with pytest.raises(ValueError, match="not a mean over samples"):
        pipe.train_step(x, target=y, loss_fn=lambda out, t: F.mse_loss(out, t, reduction="sum"))
    assert int(model.calls) == 4 and all(p.grad is None for p in pipe.parameters())


def _classifier() -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    model, reference = twin(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5)))
    return model, reference, torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 5, (8,))


def test_every_step_checks_the_combination_a_later_batch_may_break() -> None:
    """A mean over the targets not ignored combines like a mean over samples only while every
    micro-batch ignores as many: the first batch passes, a later one does not."""
    model, _, x, y = _classifier()
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2, schedule="1f1b")
    even, uneven = y.clone(), y.clone()
    even[[0, 4]], uneven[[0, 1, 2]] = -100, -100
    pipe.train_step(x, target=even, loss_fn=F.cross_entropy)
    before = [grad_of(p).clone() for p in pipe.parameters()]
    with pytest.raises(ValueError, match="(?s)not a mean over samples.*No gradient was accumulated"):
        pipe.train_step(x, target=uneven, loss_fn=F.cross_entropy)
    assert all(torch.equal(grad_of(p), b) for p, b in zip(pipe.parameters(), before))


def test_in_float64_a_combination_off_by_little_is_refused_too() -> None:
    model, _, x, y = _classifier()
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2, schedule="1f1b")
    weight = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0001], dtype=torch.float64)
    with pytest.raises(ValueError, match="not a mean over samples"):
        pipe.train_step(x, target=y, loss_fn=lambda out, t: F.cross_entropy(out, t, weight=weight))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_a_tensor_the_loss_function_learns_gets_its_gradient(schedule: str, mode: str) -> None:
    """A temperature outside the model, read by the loss: loss.backward() gives it a gradient,
    whether the loss stage's backward starts from the loss or from its outputs' gradients."""
    model, reference, x, y = _classifier()
    temperature, twin_temperature = nn.Parameter(torch.tensor(2.0, dtype=torch.float64)), nn.Parameter(torch.tensor(2.0, dtype=torch.float64))
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2, schedule=schedule, checkpoint=mode)
    loss = pipe.train_step(x, target=y, loss_fn=lambda out, t: F.cross_entropy(out / temperature, t))
    expected = F.cross_entropy(reference(x) / twin_temperature, y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert temperature.grad is not None and twin_temperature.grad is not None
    torch.testing.assert_close(temperature.grad, twin_temperature.grad, rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)


class OwnLoss(nn.Module):
    """Returns its loss, as a language model given labels does: a mean over samples."""

    def __init__(self) -> None:
        super().__init__()
        self.body = FanOut()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": F.mse_loss(self.body(x), y)}


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_model_that_returns_its_loss_needs_no_loss_function(schedule: str) -> None:
    model, reference = twin(OwnLoss())
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, (x, y), ["cpu"] * 3, chunks=4, schedule=schedule)
    with pytest.warns(UserWarning, match="cannot check that it is one"):
        loss = pipe.train_step(x, y)
    expected = reference(x, y)["loss"]
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)


class OwnLossAndSpread(OwnLoss):
    """Returns its loss and a statistic over the batch, which no micro-batch's make."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.body(x)
        return {"loss": F.mse_loss(out, y), "spread": out.var()}


def test_an_output_besides_the_models_own_loss_made_from_the_whole_batch_cannot_be_gathered_and_says_so() -> None:
    """The loss is returned as the step combined it; another value of the whole batch is named."""
    model = OwnLossAndSpread().double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, (x, y), ["cpu"] * 2, chunks=4, schedule="1f1b")
    with pytest.raises(ValueError, match=r"(?s)return_outputs=True puts the outputs .* together.*the model returns output\['spread'\], made from the whole batch.*No gradient was accumulated"):
        pipe.train_step(x, y, return_outputs=True)
    assert all(p.grad is None for p in pipe.parameters())


class WithAuxiliary(nn.Module):
    """Returns its output and a load-balancing term over the batch (a 0-dim value)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.gate, self.b = nn.Linear(6, 6), nn.Linear(6, 3), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.a(x))
        return self.b(h), self.gate(h).softmax(-1).mean(0).pow(2).sum()


def test_a_scalar_beside_the_outputs_says_why_the_loss_check_cannot_use_it() -> None:
    model = WithAuxiliary().double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2, schedule="1f1b")
    loss_fn = lambda out, t: F.mse_loss(out[0], t) + out[1]  # noqa: E731
    with pytest.raises(ValueError, match=r"(?s)checks their losses against loss_fn on the whole batch's outputs.*output\[1\], made from the whole batch.*How to fix: chunks=1.*No gradient"):
        pipe.train_step(x, target=y, loss_fn=loss_fn)
    assert all(p.grad is None for p in pipe.parameters())
    reference = copy.deepcopy(model)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=1, schedule="1f1b")  # as the fix says
    loss = pipe.train_step(x, target=y, loss_fn=loss_fn)
    expected = loss_fn(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)


class _Similarities(nn.Module):
    """A CLIP-like (B, B) matrix between the samples: made from the whole batch."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(6, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.a(x), dim=-1) @ F.normalize(self.b(y), dim=-1).t()


def test_an_output_made_from_the_whole_batch_is_refused_before_loss_fn_sees_a_micro_batch_of_it() -> None:
    """Before, loss_fn ran on each micro-batch's (2, 2) piece first, and the caller saw its shape
    error, or with chunks=4 the refusal came after the losses ran on wrong values."""
    model = _Similarities().double()
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, (x, y), ["cpu"] * 2, chunks=2, split_points=["b"])
    ran: list[int] = []

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        ran.append(1)
        return F.mse_loss(out, target)

    with pytest.raises(ValueError, match=r"(?s)the model returns its output, made from the whole batch.*How to fix: chunks=1"):
        pipe.train_step(x, y, target=torch.eye(4, dtype=torch.float64), loss_fn=loss_fn)
    assert not ran and all(p.grad is None for p in pipe.parameters())


class _WeightPenalty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.b(torch.tanh(self.a(x))), self.b.weight.pow(2).sum()


class _AllWeightsPenalty(_WeightPenalty):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.b(torch.tanh(self.a(x))), sum((p.pow(2).sum() for p in self.parameters()), torch.zeros(()))


@pytest.mark.filterwarnings("ignore:torch.fx could not trace")
@pytest.mark.parametrize("return_outputs", [False, True])
@pytest.mark.parametrize("cls", [_WeightPenalty, _AllWeightsPenalty], ids=["by-name", "iterating-parameters"])
def test_a_0_dim_value_made_from_parameters_alone_is_returned_once_by_train_step_too(return_outputs: bool, cls: type[nn.Module]) -> None:
    """As pipe(x) returns it: before, train_step refused it as one value per micro-batch. Iterating
    self.parameters(), torch.fx computed it once, when traced (9.0 off after a step): torch.export
    captures such a model."""
    model, reference = twin(cls())
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2, schedule="1f1b")
    loss_fn = lambda out, t: F.mse_loss(out[0], t) + 1e-3 * out[1]  # noqa: E731
    got = pipe.train_step(x, target=y, loss_fn=loss_fn, return_outputs=return_outputs)
    expected = loss_fn(reference(x), y)
    expected.backward()
    torch.testing.assert_close(got[0] if return_outputs else got, expected.detach(), rtol=0, atol=1e-12)
    if return_outputs:
        torch.testing.assert_close(got[1][1], reference(x)[1].detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)
    with torch.no_grad():
        for p in [*model.parameters(), *reference.parameters()]:
            p.mul_(2)  # a step of the optimizer: the value follows
        torch.testing.assert_close(pipe(x)[1], reference(x)[1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_under_no_grad_train_step_computes_the_loss_alone(schedule: str) -> None:
    model, x, y, loss_fn = _fan_out()
    model, reference = twin(model)
    pipe = compile_with(model, x, schedule, chunks=4)
    with torch.no_grad():
        loss = pipe.train_step(x, target=y, loss_fn=loss_fn)
    torch.testing.assert_close(loss, loss_fn(reference(x), y).detach(), rtol=0, atol=1e-12)
    assert all(p.grad is None for p in pipe.parameters())


def test_parameter_hooks_fire_once_per_step_with_the_whole_gradient() -> None:
    model, reference = twin(FanOut())
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 4, chunks=4, schedule="zb-h1")
    seen: list[torch.Tensor] = []
    first, plain_first = model.layers[0], reference.layers[0]
    assert isinstance(first, nn.Linear) and isinstance(plain_first, nn.Linear)
    first.weight.register_hook(lambda g: seen.append(g.clone()))
    pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    F.mse_loss(reference(x), y).backward()
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], plain_first.weight.grad, rtol=0, atol=1e-12)


def test_a_failing_loss_function_names_the_micro_batch_and_leaves_no_gradient() -> None:
    model = FanOut().double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 3, chunks=4, schedule="1f1b")

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if out.shape[0] != 2:
            raise RuntimeError("boom")
        return F.mse_loss(out, target)

    with pytest.raises(StageError, match="stage 2 failed on micro-batch 1 in loss: RuntimeError: boom"):
        pipe.train_step(x[:5], target=y[:5], loss_fn=loss_fn)  # micro-batches of 2, 1, 1, 1
    assert all(p.grad is None for p in pipe.parameters())
    pipe.train_step(x, target=y, loss_fn=F.mse_loss)  # and the pipeline works again
    assert all(p.grad is not None for p in pipe.parameters())


@pytest.mark.parametrize("schedule,mode,separate", [
    ("1f1b", "never", 0), ("gpipe", "never", 0), ("1f1b", "except_last", 3), ("1f1b", "always", 4), ("zb-h1", "never", 4),
])  # fmt: skip
def test_the_loss_stage_backward_starts_from_the_loss_where_nothing_recomputes_or_splits_it(
    monkeypatch: pytest.MonkeyPatch, schedule: str, mode: str, separate: int
) -> None:
    """As `loss.backward()` in the plain model: one autograd call from the loss through the last
    stage, rather than one to the outputs' gradients first, on every schedule's critical path.
    A micro-batch the last stage recomputes, or whose backward it splits into I and W, takes the
    outputs' gradients from a backward of the loss alone; the gradients are the plain model's
    either way."""
    import fxpipe.runtime.tasks

    calls: list[int] = []

    def counted(loss: torch.Tensor, values: dict[str, Any]) -> dict[str, Any]:
        calls.append(1)
        return fxpipe.runtime.losses.value_grads(loss, values)

    monkeypatch.setattr(fxpipe.runtime.tasks, "value_grads", counted)
    model, reference = twin(FanOut())
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 3, chunks=4, schedule=schedule, checkpoint=mode)
    loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    expected = F.mse_loss(reference(x), y)
    expected.backward()
    assert len(calls) == separate
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)


class _FailsBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise RuntimeError("the loss's backward failed")


@pytest.mark.parametrize("mode", MODES)
def test_a_loss_whose_backward_fails_names_it_and_leaves_no_gradient(mode: str) -> None:
    model = FanOut().double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 3, chunks=4, schedule="1f1b", checkpoint=mode)
    with pytest.raises(StageError, match=r"stage 2 failed on micro-batch 0 in (loss|backward): RuntimeError: the loss's backward failed"):
        pipe.train_step(x, target=y, loss_fn=lambda out, t: F.mse_loss(_FailsBackward.apply(out), t))
    assert all(p.grad is None for p in pipe.parameters())
    pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    assert all(p.grad is not None for p in pipe.parameters())


def test_a_target_that_cannot_be_split_is_refused() -> None:
    """A target with the batch's size on a dim the inputs do not hold it in is refused; one with
    no dim of the batch's size goes whole to each micro-batch (a count, a class weight), and the
    loss that fails on it (as the plain model's does) is told so."""
    model = FanOut().double()
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4, schedule="1f1b")
    with pytest.raises(ValueError, match="target must be split"):
        pipe.train_step(x, target=torch.randn(6, 6, 8, dtype=torch.float64), loss_fn=F.mse_loss)
    with pytest.raises(StageError, match="in loss") as failed:
        pipe.train_step(x, target=torch.randn(6, 6, dtype=torch.float64), loss_fn=F.mse_loss)
    assert any("no dim of the batch's size (8) went whole to every micro-batch: (6, 6)" in note for note in getattr(failed.value.__cause__, "__notes__", []))


class _Tagger(nn.Module):
    """A label per token: (batch, tokens, classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.a, self.b = nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(self.embed(x))))


def test_a_target_flattened_over_the_batch_and_the_tokens_fails_as_one_the_error_says_how_to_give_and_given_so_trains_as_the_plain_model() -> None:
    """A label per token given flat, (batch x tokens,): no dim of the batch's size, it went whole
    to every micro-batch, and torch's error ("Expected input batch_size (14) to match target
    batch_size (56)") came with no fix; the error now says how to give it, which then runs as the
    plain model."""
    model, reference = twin(_Tagger())
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 10, (8, 7), generator=g), torch.randint(0, 10, (56,), generator=g)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4)
    with pytest.raises(StageError, match=r"(?s)in loss: ValueError: Expected input batch_size \(14\).*\(56,\) holds 7 x the batch's 8 along dim 0.*How to fix.*target.unflatten\(0, \(8, -1\)\)"):
        pipe.train_step(x, target=y, loss_fn=lambda out, t: F.cross_entropy(out.flatten(0, 1), t))
    assert all(p.grad is None for p in pipe.parameters())
    loss = pipe.train_step(x, target=y.unflatten(0, (8, -1)), loss_fn=lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()))
    expected = F.cross_entropy(reference(x).flatten(0, 1), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)


class _PackedGRU(nn.Module):
    """Pads its outputs to the longest sequence it is given, or to `total` where set."""

    def __init__(self, total: bool) -> None:
        super().__init__()
        self.total, self.rnn = total, nn.GRU(4, 4, batch_first=True)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=x.shape[1] if self.total else None)
        return out


class _Tagged(nn.Module):
    def __init__(self, total: bool) -> None:
        super().__init__()
        self.a, self.rnn, self.b = nn.Linear(4, 4), _PackedGRU(total), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.b(self.rnn(torch.tanh(self.a(x)), lengths))


@pytest.mark.parametrize("total", [False, True])
def test_outputs_sized_by_each_micro_batch_s_longest_sequence_fail_in_the_loss_with_a_note_that_says_so(total: bool) -> None:
    """pad_packed_sequence without total_length: one micro-batch's longest sequence is shorter
    than the batch's. Before, the loss's error came with a note on how the target was split alone;
    padded to a fixed length, train_step equals the plain model."""
    model, reference = twin(_Tagged(total))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 6, 4, dtype=torch.float64, generator=g), torch.randn(8, 6, 3, dtype=torch.float64, generator=g)
    lengths = torch.tensor([6, 3, 5, 2, 4, 4, 1, 5])
    pipe = compile_pipeline(model, (x, lengths), ["cpu", "cpu"], chunks=2, leaf_modules=[_PackedGRU])
    if not total:
        with pytest.raises(StageError, match=r"(?s)in loss: RuntimeError: The size of tensor a \(5\).*output of shape \(4, 5, 3\) meets a target of shape \(4, 6, 3\).*total_length"):
            pipe.train_step(x, lengths, target=y, loss_fn=F.mse_loss)
        return
    loss = pipe.train_step(x, lengths, target=y, loss_fn=F.mse_loss)
    expected = F.mse_loss(reference(x, lengths), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)


def test_a_loss_that_fails_on_its_own_logic_is_not_told_how_the_target_was_split() -> None:
    """Before, every error of a loss function came with the note on the target's split (class
    weights given whole), whatever it said."""
    model = nn.Sequential(nn.Linear(6, 8)).double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"], chunks=4)

    def broken(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise ValueError("my loss is broken")

    with pytest.raises(StageError, match="in loss: ValueError: my loss is broken") as failed:
        pipe.train_step(x, target=y, loss_fn=broken)
    assert "were split into the micro-batches" not in str(failed.value)


def test_class_weights_as_many_as_the_samples_are_split_and_the_loss_that_fails_on_them_is_told_how_to_give_them_whole() -> None:
    model = nn.Sequential(nn.Linear(6, 8)).double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 8, (8,))
    pipe = compile_pipeline(model, x, ["cpu"], chunks=4)

    def weighted(out: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        labels, weight = target
        return F.cross_entropy(out, labels, weight=weight)

    with pytest.raises(StageError, match="in loss") as failed:
        pipe.train_step(x, target=(y, torch.rand(8, dtype=torch.float64)), loss_fn=weighted)
    notes = getattr(failed.value.__cause__, "__notes__", [])
    assert any("were split into the micro-batches along it: (8,), (8,)" in n and "functools.partial(my_loss, weight=w)" in n for n in notes), notes
    w = torch.rand(8, dtype=torch.float64)  # the fix: whole, with the sum over the weights counted before the step
    loss = pipe.train_step(x, target=y, loss_fn=lambda out, t: F.cross_entropy(out, t, weight=w, reduction="sum") / w[y].sum(), reduction="sum")
    assert torch.allclose(loss, F.cross_entropy(model(x), y, weight=w), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "given,error",
    [(dict(target="y"), "it got a target and no loss_fn: .*the target would go unused.*How to fix: pass loss_fn="),
     (dict(target="y", loss_fn=lambda out: out.sum()), r"loss_fn is called as loss_fn\(output, target\), and .*<lambda> takes \(out\).*How to fix: take two"),
     (dict(target="y", loss_fn="mse"), "loss_fn must be callable, not a str")],
    ids=["target-without-loss", "loss-of-one-argument", "loss-not-callable"],
)  # fmt: skip
def test_a_loss_that_cannot_be_computed_is_refused_before_any_stage_runs(given: dict[str, Any], error: str) -> None:
    """Before, each ran every forward and then failed in the loss (the first dropped the target)."""
    model = FanOut().double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2, schedule="1f1b")
    ran: list[int] = []
    model.layers[0].register_forward_hook(lambda *_: ran.append(1))
    with pytest.raises(ValueError, match=f"(?s)train_step cannot compute the loss: {error}"):
        arguments: dict[str, Any] = {k: (y if v == "y" else v) for k, v in given.items()}
        pipe.train_step(x, **arguments)
    assert not ran and all(p.grad is None for p in pipe.parameters())


def test_a_loss_function_failing_on_a_missing_target_says_none_was_given() -> None:
    model = FanOut().double()
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2, schedule="1f1b")
    with pytest.raises(StageError, match="(?s)in loss: ValueError: loss_fn raised .* on a target of None: train_step was given no target.*How to fix: pass target="):
        pipe.train_step(x, loss_fn=F.mse_loss)
    without_target = pipe.train_step(x, loss_fn=lambda out, _: out.square().mean())  # a loss that takes none
    torch.testing.assert_close(without_target, model(x).square().mean().detach(), rtol=0, atol=1e-12)


def test_a_model_output_that_is_no_loss_says_so_without_loss_fn() -> None:
    model = FanOut().double()
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2, schedule="1f1b")
    with pytest.raises(StageError, match=r"(?s)needs a model that returns its loss .* returns a tensor of shape \(4, 6\).*How to fix: pass loss_fn"):
        pipe.train_step(x)


def _noisy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target + 0.1 * torch.randn_like(target))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_loss_that_draws_is_not_refused_by_the_combination_check_and_draws_per_micro_batch(schedule: str) -> None:
    """Before, the check drew other noise on the whole batch and refused every step, telling to
    pass the other reduction (which it then refused too)."""
    model, reference = twin(FanOut())
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_with(model, x, schedule, chunks=2)
    torch.manual_seed(3)
    with pytest.warns(UserWarning, match="loss_fn draws random numbers: .*cannot check that reduction='mean'"):
        loss = pipe.train_step(x, target=y, loss_fn=_noisy)
    after = torch.get_rng_state()
    torch.manual_seed(3)
    expected = sum(_noisy(reference(a), b) / 2 for a, b in zip(x.chunk(2), y.chunk(2)))  # the plain model, in turn
    assert isinstance(expected, torch.Tensor)
    assert torch.equal(after, torch.get_rng_state()), "the check drew nothing of the caller's"
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)


def test_schedule_arguments_are_checked() -> None:
    model, x = FanOut(), torch.randn(8, 6)
    with pytest.raises(ValueError) as info:
        compile_pipeline(model, x, ["cpu"] * 2, schedule="pipedream", stages_per_device=0)
    assert "schedule must be one of 'gpipe', '1f1b', 'interleaved-1f1b', 'zb-h1'" in str(info.value)
    with pytest.raises(ValueError, match="only schedule='interleaved-1f1b' runs"):
        compile_pipeline(model, x, ["cpu"] * 2, schedule="1f1b", stages_per_device=2)
    with pytest.raises(ValueError, match="chunks to be a multiple of the device count, 2"):
        compile_pipeline(model, x, ["cpu"] * 2, chunks=3, schedule="interleaved-1f1b", stages_per_device=2)


class Dropping(nn.Module):
    """Dropout between layers: eval mode must not draw, and autocast must reach every stage."""

    def __init__(self) -> None:
        super().__init__()
        self.body = FanOut()
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.drop(x))


@pytest.mark.parametrize("mode", FUSED_OR_NOT)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_in_eval_mode_train_step_equals_the_plain_model(schedule: str, mode: str) -> None:
    model, reference = twin(Dropping())
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_with(model, x, schedule, chunks=4, checkpoint=mode)
    pipe.eval()
    reference.eval()
    loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    expected = F.mse_loss(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)


@pytest.mark.parametrize("mode", FUSED_OR_NOT)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_under_autocast_train_step_casts_as_the_plain_model_does(schedule: str, mode: str) -> None:
    model, reference = FanOut(), FanOut()
    reference.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    pipe = compile_with(model, x, schedule, chunks=4, checkpoint=mode)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, out = pipe.train_step(x, target=y, loss_fn=F.mse_loss, return_outputs=True)
        expected_out = reference(x)
        expected = F.mse_loss(expected_out, y)
    expected.backward()
    assert out.dtype == expected_out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected_out.detach(), rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(loss, expected.detach().to(loss.dtype), rtol=2e-2, atol=1e-3)
    for p, q in zip(pipe.parameters(), reference.parameters()):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=3e-2, atol=3e-3)


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = x = self.layers[0](x).relu()
        for layer in self.layers[1:]:
            x = layer(x).tanh() + x
        return self.head(x + first)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_under_autocast_a_float32_loss_with_a_low_precision_term_is_checked_at_that_precision(dtype: torch.dtype) -> None:
    """Cross-entropy (float32 under autocast) plus a penalty on the logits (left in bfloat16), or
    a float16 loss times GradScaler's float32 scale: before, the check of the combined loss took
    float32's tolerance, and refused most steps as not a mean over samples."""
    torch.manual_seed(0)
    model = _Residual()
    pipe = compile_pipeline(copy.deepcopy(model), torch.randn(16, 16), ["cpu", "cpu"], chunks=4, schedule="1f1b")
    scale = torch.tensor(65536.0)

    def penalised(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, t) + 0.1 * out.pow(2).mean()

    def scaled(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return out.mean() * scale

    loss_fn = penalised if dtype == torch.bfloat16 else scaled
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        x, y = torch.randn(16, 16, generator=g) * 3, torch.randint(0, 4, (16,), generator=g)
        with torch.autocast("cpu", dtype=dtype):
            loss = pipe.train_step(x, target=y, loss_fn=loss_fn)
            expected = loss_fn(model(x), y)
        assert loss.dtype == expected.dtype == torch.float32
        torch.testing.assert_close(loss, expected.detach(), rtol=4 * torch.finfo(dtype).eps, atol=0)
        pipe.zero_grad()


@pytest.mark.parametrize("autocast, loss_dtype", [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)])
def test_a_loss_in_the_other_half_precision_under_autocast_trains_as_the_plain_model(autocast: torch.dtype, loss_dtype: torch.dtype) -> None:
    """Before, the micro-batches' losses were added up under the caller's autocast, whose rule for
    stack refuses a half dtype not its own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    plain = copy.deepcopy(model)
    x, t = torch.randn(16, 8), torch.randn(16, 8)

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (out.to(loss_dtype) - y.to(loss_dtype)).abs().mean()

    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4)
    with torch.autocast("cpu", dtype=autocast):
        loss = pipe.train_step(x, target=t, loss_fn=loss_fn)
        expected = loss_fn(plain(x), t)
    expected.backward()
    assert loss.dtype == expected.dtype == loss_dtype
    torch.testing.assert_close(loss.float(), expected.float(), rtol=0.02, atol=0)
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(grad_of(p), grad_of(q), rtol=0.05, atol=0.02)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_loss_that_is_no_mean_is_refused_under_autocast_too(dtype: torch.dtype) -> None:
    """Cross-entropy over the targets not ignored (a count that differs between micro-batches)
    differs from the combined micro-batches' by less than bfloat16's rounding of the outputs:
    the check runs again on them in float64. Before, under autocast it was accepted (gradients
    10-30% off), where without autocast it was refused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=g).to(dtype), torch.randint(0, 4, (16,), generator=g)
    y[y == 3] = -100  # ignored

    def loss_fn(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.float() if dtype == torch.float32 else out, t)

    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, schedule="1f1b")
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), pytest.raises(ValueError, match="not a mean over samples"):
            pipe.train_step(x, target=y, loss_fn=loss_fn)
        assert all(p.grad is None for p in pipe.parameters())


def test_under_inference_mode_train_step_computes_the_loss_alone() -> None:
    model, x, y, loss_fn = _fan_out()
    model, reference = twin(model)
    pipe = compile_pipeline(model, x, ["cpu"] * 3, chunks=4, schedule="1f1b")
    with torch.inference_mode():
        loss = pipe.train_step(x, target=y, loss_fn=loss_fn)
        expected = loss_fn(reference(x), y)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12)
    assert all(p.grad is None for p in pipe.parameters())


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.bn(self.a(x))))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_deferred_batch_norm_commits_the_whole_batch_statistics_under_every_schedule(schedule: str) -> None:
    model, reference = twin(Normed())
    x, y = torch.randn(16, 6, dtype=torch.float64), torch.randn(16, 6, dtype=torch.float64)
    pipe = compile_with(model, x, schedule, chunks=4, deferred_batch_norm=True)
    pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    reference(x)  # the plain model's statistics of the whole batch
    bn, plain_bn = model.bn, reference.bn
    assert bn.running_mean is not None and bn.running_var is not None
    assert plain_bn.running_mean is not None and plain_bn.running_var is not None
    torch.testing.assert_close(bn.running_mean, plain_bn.running_mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(bn.running_var, plain_bn.running_var, rtol=0, atol=1e-12)
    assert bn.num_batches_tracked is not None and plain_bn.num_batches_tracked is not None
    assert int(bn.num_batches_tracked) == int(plain_bn.num_batches_tracked) == 1


class TiedSparse(nn.Module):
    """An embedding with sparse gradients whose weight is also the output layer's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.body = nn.Embedding(10, 6, sparse=True), nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(ids))))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_a_sparse_embedding_tied_to_the_output_layer(schedule: str) -> None:
    """The first stage's copy gets a sparse gradient, the last stage's a dense one: their sum is
    the plain model's dense gradient."""
    model, reference = twin(TiedSparse())
    ids, y = torch.randint(0, 10, (4, 5)), torch.randn(4, 5, 10, dtype=torch.float64)
    pipe = compile_pipeline(model, ids, ["cpu"] * 2, chunks=2, schedule=schedule)
    pipe.train_step(ids, target=y, loss_fn=F.mse_loss)
    F.mse_loss(reference(ids), y).backward()
    assert_grads_equal(pipe, reference, tol=1e-12)


@pytest.mark.parametrize("call", ["train_step", "pipe(x)"])
def test_a_sparse_embedding_tied_to_the_output_layer_under_autocast(call: str) -> None:
    """Under the caller's autocast a stage reads aliases of its leaves, which pass a sparse
    gradient on as it is."""
    model = TiedSparse().float()
    reference = copy.deepcopy(model)
    ids, y = torch.randint(0, 10, (4, 5)), torch.randn(4, 5, 10)
    pipe = compile_pipeline(model, ids, ["cpu"] * 2, chunks=2)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out.float(), target)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = loss_fn(reference(ids), y)
        if call == "train_step":
            loss = pipe.train_step(ids, target=y, loss_fn=loss_fn)
        else:
            loss = loss_fn(pipe(ids), y)
    expected.backward()
    if call != "train_step":
        loss.backward()
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-2, atol=1e-3)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad.to_dense(), q.grad.to_dense(), rtol=2e-2, atol=2e-3, msg=name)  # type: ignore[union-attr]


def test_a_mean_loss_in_bfloat16_passes_the_combination_check() -> None:
    """The micro-batches' bfloat16 losses, combined, round otherwise than the whole batch's."""
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    pipe = compile_pipeline(model, torch.randn(8, 6), ["cpu", "cpu"], chunks=2, checkpoint="never")
    pipe.bfloat16()
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(8, 6, generator=g).bfloat16(), torch.randn(8, 3, generator=g).bfloat16()
        loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
        torch.testing.assert_close(loss.float(), F.mse_loss(model(x), y).float(), rtol=3e-2, atol=1e-2)
    with pytest.raises(ValueError, match="not a mean over samples"):
        pipe.train_step(x, target=y, loss_fn=lambda o, t: F.mse_loss(o, t, reduction="sum"))


def test_no_sync_changes_nothing_in_one_process() -> None:
    model, reference = twin(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)))
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2, schedule="1f1b")
    with pipe.no_sync():
        loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    expected = F.mse_loss(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_a_nan_loss_is_returned_as_the_plain_model_returns_it(schedule: str) -> None:
    """A NaN in one sample makes the plain model's loss and gradients NaN: the combination
    check sees the same NaN in the whole batch's loss, and lets the caller see it too."""
    model, reference, x, _ = _classifier()
    y = torch.randn(8, 5, dtype=torch.float64)
    x[5, 0] = float("nan")
    pipe = compile_pipeline(model, x.nan_to_num(), ["cpu"] * 2, chunks=4, schedule=schedule)
    loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    expected = F.mse_loss(reference(x), y)
    expected.backward()
    assert loss.isnan() and expected.isnan()
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters()):
        torch.testing.assert_close(grad_of(p), grad_of(q), rtol=0, atol=1e-12, equal_nan=True, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("call", ["train_step", "backward"])
def test_a_grad_scaler_scales_steps_and_skips_the_one_that_overflows(call: str) -> None:
    """torch.amp.GradScaler as with the plain model: train_step scales inside `loss_fn`,
    pipe(x) outside; a step whose gradients are not finite is skipped by both alike."""
    model, reference, x, _ = _classifier()
    y = torch.randn(8, 5, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4, schedule="1f1b")
    runs = []
    for module, pipelined in ((pipe, True), (reference, False)):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        for bad in (False, True, False):
            inputs = x.clone()
            if bad:
                inputs[3, 1] = float("inf")
            opt.zero_grad()
            if pipelined and call == "train_step":
                pipe.train_step(inputs, target=y, loss_fn=lambda out, t: scaler.scale(F.mse_loss(out, t)))
            else:
                scaler.scale(F.mse_loss(module(inputs), y)).backward()
            scaler.step(opt)
            scaler.update()
        runs.append((scaler.get_scale(), [p.detach().clone() for p in module.parameters()]))
    (scale, params), (expected_scale, expected) = runs
    assert scale == expected_scale == 2.0**11  # grew, halved on the skipped step, grew
    for p, q in zip(params, expected):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)


class ConvGroupNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2, self.c3 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 4, 1)
        self.gn = nn.GroupNorm(2, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.c1(x))
        h = self.gn(self.c2(h)) + h
        return self.c3(torch.relu(h)).flatten(1)


class _ScalesAndFrees(torch.autograd.Function):
    """x * w, whose backward counts its calls into a buffer and frees what it kept on ctx."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, calls: torch.Tensor) -> torch.Tensor:
        ctx.x, ctx.calls = x, calls
        ctx.save_for_backward(w)
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x = ctx.x
        del ctx.x  # kept for one backward: a second would fail
        ctx.calls.add_(1)
        (w,) = ctx.saved_tensors
        return grad * w, (grad * x).sum(0), None


class ScaledByAFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.w = nn.Parameter(torch.randn(6))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x)))
        return self.c(torch.tanh(_ScalesAndFrees.apply(h, self.w, self.calls)))


def test_zero_bubble_runs_an_autograd_function_s_backward_once() -> None:
    """Before, I ran it for the input's gradient and W again for the weight's: twice per
    micro-batch (a count 4 where the plain model, run on the micro-batches, counts 2), and a
    backward that frees what it kept failed with its own AttributeError."""
    model, reference = twin(ScaledByAFunction())
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2, schedule="zb-h1", checkpoint="never", split_points=["b"])
    loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    expected = torch.stack([F.mse_loss(reference(half), target) for half, target in zip(x.chunk(2), y.chunk(2))]).mean()
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)
    assert model.calls.item() == reference.calls.item() == 2  # type: ignore[operator]


@pytest.mark.parametrize("memory_format", [torch.channels_last, torch.contiguous_format])
def test_zero_bubble_never_asks_group_norm_for_its_weights_alone(memory_format: torch.memory_format) -> None:
    """GroupNorm's backward kernel crashes the process when asked for its weights' gradients
    alone on a channels_last input, which is what W would ask: I computes them instead."""
    model, reference = twin(ConvGroupNorm())
    for module in (model, reference):
        for p in module.parameters():
            if p.dim() == 4:  # the convolutions' weights, as module.to(memory_format=...) lays them out
                p.data = p.data.contiguous(memory_format=memory_format)
    x = torch.randn(8, 3, 6, 6, dtype=torch.float64).contiguous(memory_format=memory_format)
    y = torch.randn(8, 144, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2, schedule="zb-h1", split_points=["c2"])
    assert "gn" in pipe.plan.stages[1].nodes
    loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    expected = F.mse_loss(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)


@pytest.mark.parametrize("norm_type,foreach", [(2.0, None), (float("inf"), False)])
def test_clip_grad_norm_in_one_process_is_torchs_over_the_model(norm_type: float, foreach: bool | None) -> None:
    fan_out, x, y, _ = _fan_out()
    model, reference = twin(fan_out)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2, schedule="zb-h1")
    pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    F.mse_loss(reference(x), y).backward()
    got = pipe.clip_grad_norm_(0.05, norm_type, foreach=foreach)  # torch's own argument, passed through
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05, norm_type, foreach=foreach)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)


def _scaled_by_hooks(module: nn.Module, backward: bool = False) -> list[Any]:
    """Forward hooks that change what a call computes: its input doubled, its output tripled;
    with `backward`, backward hooks that record too."""
    seen: list[str] = []
    handles = [module.register_forward_pre_hook(lambda m, args: (args[0] * 2,)), module.register_forward_hook(lambda m, args, out: out * 3)]
    if backward:
        handles.append(module.register_full_backward_pre_hook(lambda m, grads: seen.append("pre")))
        handles.append(module.register_full_backward_hook(lambda m, gi, go: seen.append("post")))
    return handles


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("where", ["the pipeline", "the model"])
def test_hooks_on_the_pipeline_or_the_model_itself_are_refused_by_train_step_and_run_by_a_call(schedule: str, where: str) -> None:
    """Before, train_step ran the stages without the pipeline's own hooks, which `pipe(x)` runs:
    the loss was 1.21 where it is 3.80, the gradients 2.9 off. The model's own hooks are no part
    of the graph (a trace calls forward, not the model): a call runs them around the stages, and
    train_step, which never calls the model whole, refuses them as it refuses the pipeline's."""
    model, reference = twin(nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)))
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    _scaled_by_hooks(reference)
    if where == "the model":
        handles = _scaled_by_hooks(model, backward=True)
        pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2, schedule=schedule)
    else:
        pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2, schedule=schedule)
        handles = _scaled_by_hooks(pipe, backward=True)
    refused = rf"(?si)train_step cannot run the .*hooks registered on {where} itself.*How to fix"
    kept = handles[:2] if where == "the model" else []  # the model keeps the forward hooks its twin has
    for handle in handles[len(kept):][::-1]:
        with pytest.raises(RuntimeError, match=refused):
            pipe.train_step(x, target=y, loss_fn=F.mse_loss)
        handle.remove()
    if kept:
        with pytest.raises(RuntimeError, match=refused):
            pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    assert all(p.grad is None for p in pipe.parameters()), "a refused step accumulates nothing"
    if where == "the pipeline":
        _scaled_by_hooks(pipe)
    out, expected = pipe(x), reference(x)
    F.mse_loss(out, y).backward()
    F.mse_loss(expected, y).backward()
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("loss", ["loss_fn", "the model's own"])
def test_uneven_micro_batches_weigh_a_mean_loss_by_their_sizes(schedule: str, loss: str) -> None:
    """Batch 10 in 4 micro-batches (3, 3, 2, 2): each micro-batch's mean weighs its size in the
    batch's mean. Before, only the runtime's own loss check caught a wrong weight: no test
    compared such gradients with the plain model's."""
    x, y = torch.randn(10, 6, dtype=torch.float64), torch.randn(10, 6, dtype=torch.float64)
    reference: nn.Module
    if loss == "loss_fn":
        model, reference = twin(FanOut())
        pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4, schedule=schedule)
        total = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
        expected = F.mse_loss(reference(x), y)
    else:
        own, reference_own = twin(OwnLoss())
        pipe = compile_pipeline(own, (x, y), ["cpu"] * 2, chunks=4, schedule=schedule)
        with pytest.warns(UserWarning, match="cannot check that it is one"):
            total = pipe.train_step(x, y)
        expected = reference_own(x, y)["loss"]
        reference = reference_own
    assert split_sizes(10, 4) == [3, 3, 2, 2]
    expected.backward()
    torch.testing.assert_close(total, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)


@pytest.mark.parametrize("how, schedule, mode, chunks", [
    ("function", "gpipe", "except_last", 4), ("function", "1f1b", "always", 8), ("module", "zb-h1", "never", 3),
    ("module", "interleaved-1f1b", "except_last", 4),
])  # fmt: skip
def test_a_model_s_own_mean_over_the_targets_it_counts_is_the_plain_model_s_without_loss_fn(how: str, schedule: str, mode: str, chunks: int) -> None:
    """Micro-batches that count other numbers of positions: their losses are weighted by those
    counts, read from each micro-batch's labels (shifted in the graph), so that train_step gives
    the plain model's loss and gradients, with nothing to warn of."""
    torch.manual_seed(0)
    model, reference = twin(PaddedLM(how))
    ids, labels = padded_labels(1)
    options: dict[str, Any] = {"stages_per_device": 2} if schedule == "interleaved-1f1b" else {}
    pipe = compile_pipeline(model, (ids, labels), ["cpu"] * 2, chunks=chunks, schedule=schedule, checkpoint=mode, **options)
    assert pipe.program().loss_counter is not None
    for _ in range(2):  # accumulated over two steps, the second on other paddings
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            loss = pipe.train_step(ids, labels)
        expected = reference(ids, labels)["loss"]
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
        ids, labels = padded_labels(2, pads=(0, 0, 8, 7, 3, 4, 6, 1))
    assert_grads_equal(pipe, reference, tol=1e-12)


class WeightedOwnLoss(nn.Module):
    """A tagger's own cross-entropy with class weights (a buffer, or a loss module's), some
    targets ignored: a mean over the weights of the targets that count."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.embed, self.mix, self.head = nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 6)
        self.register_buffer("weight", torch.tensor([0.5, 1.0, 2.0, 1.5, 0.7, 3.0]))
        self.criterion = nn.CrossEntropyLoss(weight=torch.tensor([0.5, 1.0, 2.0, 1.5, 0.7, 3.0]), label_smoothing=0.1)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.mix(self.embed(ids)))).reshape(-1, 6)
        if self.how == "nll_loss":
            return F.nll_loss(F.log_softmax(logits, -1), labels.reshape(-1), weight=self.get_buffer("weight"))
        if self.how == "module":
            return self.criterion(logits, labels.reshape(-1))  # type: ignore[no-any-return]
        return F.cross_entropy(logits, labels.reshape(-1), weight=self.get_buffer("weight"))


class WeightedOwnLossExported(WeightedOwnLoss):
    def forward(self, ids: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> torch.Tensor:  # torch.export captures it
        return super().forward(ids, labels)


@pytest.mark.parametrize("how", ["cross_entropy", "nll_loss", "module"])
@pytest.mark.parametrize("front_end", ["torch.fx", "torch.export"])
def test_a_model_s_own_mean_with_class_weights_is_weighted_by_the_weights_it_counts(how: str, front_end: str) -> None:
    """Before, class weights left the loss uncounted: combined as a mean over samples, 1e-3 to
    0.08 off the plain model's loss and 0.02 to 0.28 in a gradient, with a warning."""
    torch.manual_seed(0)
    model, reference = twin((WeightedOwnLossExported if front_end == "torch.export" else WeightedOwnLoss)(how))
    ids, labels = torch.randint(0, 10, (7, 4)), torch.randint(0, 6, (7, 4))
    labels[0, :3] = labels[1, :] = labels[5, 1] = -100
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = compile_pipeline(model, (ids, labels), ["cpu"] * 2, chunks=4)
    assert any("used torch.export" in str(w.message) for w in caught) == (front_end == "torch.export")
    assert pipe.program().loss_counter is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = pipe.train_step(ids, labels)
    expected = reference(ids, labels)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)


def test_reduction_sum_of_a_model_s_own_mean_over_the_targets_it_counts_is_refused() -> None:
    """Before, the micro-batches' means were summed (twice the plain model's loss and gradients at
    two micro-batches), with a warning that the loss was neither a sum nor a mean."""
    model = PaddedLM("function")
    ids, labels = padded_labels(1)
    pipe = compile_pipeline(model, (ids, labels), ["cpu"] * 2, chunks=2)
    with pytest.raises(ValueError, match=r"(?s)reduction='sum', but the model's own loss is a mean cross-entropy over the targets it counts.*leave reduction at 'mean'"):
        pipe.train_step(ids, labels, reduction="sum")
    assert all(p.grad is None for p in pipe.parameters())


class PaddedLMTuple(PaddedLM):
    """PaddedLM returning `(loss, logits)`, as a Hugging Face model with return_dict=False."""

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        out = super().forward(ids, labels)
        return out["loss"], out["logits"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_model_returning_its_loss_first_in_a_tuple_trains_without_loss_fn(schedule: str) -> None:
    """Before, train_step without loss_fn refused a tuple (pass loss_fn), and with a loss_fn that
    picks its first element refused that as made from the whole batch (call it without loss_fn)."""
    torch.manual_seed(0)
    model, reference = twin(PaddedLMTuple())
    ids, labels = padded_labels(1)
    pipe = compile_pipeline(model, (ids, labels), ["cpu"] * 2, chunks=4, schedule=schedule)
    assert pipe.program().loss_counter is not None  # its mean over the positions that count, weighted by them
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = pipe.train_step(ids, labels)
    expected = reference(ids, labels)[0]
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)


@pytest.mark.parametrize("returned", ["dict", "tuple"])
def test_return_outputs_with_the_models_own_loss_gives_the_combined_loss_in_its_place(returned: str) -> None:
    """Before, return_outputs=True without loss_fn was refused: the loss field is made from the
    whole batch, and the refusal advised the call being made."""
    torch.manual_seed(0)
    model, reference = twin(PaddedLM() if returned == "dict" else PaddedLMTuple())
    ids, labels = padded_labels(1)
    pipe = compile_pipeline(model, (ids, labels), ["cpu"] * 2, chunks=4, schedule="1f1b")
    loss, out = pipe.train_step(ids, labels, return_outputs=True)
    expected = reference(ids, labels)
    own, logits = (out["loss"], out["logits"]) if returned == "dict" else out
    plain_loss, plain_logits = (expected["loss"], expected["logits"]) if returned == "dict" else expected
    plain_loss.backward()
    torch.testing.assert_close(loss, plain_loss.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(own, loss, rtol=0, atol=0)
    torch.testing.assert_close(logits, plain_logits.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)


def test_a_2bw_loop_on_the_model_s_own_mean_is_the_delayed_plain_loop() -> None:
    from dag_models import delayed_loop

    torch.manual_seed(0)
    model, reference = twin(PaddedLM())
    batches = [padded_labels(seed) for seed in (1, 2, 3)]
    pipe = compile_pipeline(model, batches[0], ["cpu"] * 2, chunks=4, schedule="2bw")
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    losses = list(pipe.train_steps([((ids, labels), None) for ids, labels in batches], loss_fn=None, optimizer=optimizer))

    def step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = reference(ids, labels)["loss"]
        loss.backward()
        return loss

    expected = delayed_loop(list(reference.parameters()), torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9),
                            [((ids, labels), None) for ids, labels in batches], lambda inputs, _: step(*inputs))  # fmt: skip
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-12, atol=1e-12)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)


def test_the_model_s_own_mean_in_eval_mode_and_under_no_grad_is_the_plain_model_s() -> None:
    model = PaddedLM().double()
    ids, labels = padded_labels(3)
    pipe = compile_pipeline(model, (ids, labels), ["cpu"] * 2, chunks=4)
    reference = copy.deepcopy(model)
    expected = reference(ids, labels)["loss"]
    with torch.no_grad():
        torch.testing.assert_close(pipe.train_step(ids, labels), expected.detach(), rtol=1e-12, atol=1e-12)
    assert all(p.grad is None for p in model.parameters())
    pipe.eval()
    reference.eval()
    torch.testing.assert_close(pipe.train_step(ids, labels), expected.detach(), rtol=1e-12, atol=1e-12)
    expected.backward()
    assert_grads_equal(pipe, reference, tol=1e-12)


def test_a_micro_batch_that_counts_no_target_is_refused_and_another_loss_has_no_counter() -> None:
    model = PaddedLM().double()
    ids, labels = padded_labels(1, pads=(10, 10, 2, 3))
    pipe = compile_pipeline(model, (ids, labels), ["cpu"] * 2, chunks=2)
    with pytest.raises(ValueError, match=r"micro-batch 0 of this batch counts none: its mean is 0 / 0"):
        pipe.train_step(ids, labels)
    assert all(p.grad is None for p in model.parameters())
    reference = copy.deepcopy(model)
    ids, labels = padded_labels(2, pads=(9, 0, 2, 3))  # the next step, on a batch that counts in each micro-batch
    loss = pipe.train_step(ids, labels)
    expected = reference(ids, labels)["loss"]
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)
    # A model whose own loss is no mean over counted targets keeps today's weights, and says it cannot check them.
    pipe = compile_pipeline(OwnLoss().double(), (torch.randn(8, 6).double(), torch.randn(8, 6).double()), ["cpu"] * 2, chunks=2)
    assert pipe.program().loss_counter is None


class SoftTargets(nn.Module):
    """A model's own cross-entropy against class probabilities: a mean over samples, not over counted targets."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 5)

    def forward(self, x: torch.Tensor, probs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": F.cross_entropy(self.b(torch.tanh(self.a(x))), probs)}


def test_a_model_s_own_cross_entropy_on_class_probabilities_weighs_micro_batches_by_samples() -> None:
    """Its target counts no classes: the micro-batches of 3, 3 and 2 samples are weighted by
    their samples, which is the plain model's mean, and train_step says it cannot check that."""
    torch.manual_seed(0)
    model, reference = twin(SoftTargets())
    x = torch.randn(8, 6, dtype=torch.float64)
    probs = torch.softmax(torch.randn(8, 5, dtype=torch.float64), dim=-1)
    pipe = compile_pipeline(model, (x, probs), ["cpu"] * 2, chunks=3)
    assert pipe.program().loss_counter is not None  # a cross-entropy: its counter finds a float target
    with pytest.warns(UserWarning, match=r"combines the model's own loss over micro-batches"):
        loss = pipe.train_step(x, probs)
    expected = reference(x, probs)["loss"]
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)


@pytest.mark.parametrize("devices", [1, 2])
def test_a_loss_refused_after_the_step_puts_back_the_buffers_it_wrote_and_the_next_step_is_the_plain_models(devices: int) -> None:
    """The check of the micro-batches' losses runs after the step, whose BatchNorm wrote its
    running statistics: a refusal there puts them back (the step is held weakly by what undoes
    it, so that a step that ran is freed as soon as the caller lets go of it), and the step
    after it computes the plain model's loss, gradients and statistics."""
    model, reference = twin(Normed().double())
    x, y = torch.randn(16, 6, dtype=torch.float64), torch.randn(16, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * devices, chunks=4)
    before = {name: b.clone() for name, b in model.named_buffers()}
    summed = lambda out, target: F.mse_loss(out, target, reduction="sum")  # noqa: E731
    with pytest.raises(ValueError, match="not a mean over samples"):
        pipe.train_step(x, target=y, loss_fn=summed)
    for name, b in model.named_buffers():
        assert torch.equal(b, before[name]), name
    assert all(p.grad is None for p in pipe.parameters())
    loss = pipe.train_step(x, target=y, loss_fn=summed, reduction="sum")
    expected = torch.stack([summed(reference(xi), yi) for xi, yi in zip(x.chunk(4), y.chunk(4))]).sum()
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)
    for (name, b), (_, plain) in zip(model.named_buffers(), reference.named_buffers()):
        torch.testing.assert_close(b, plain, rtol=0, atol=1e-12, msg=name)


def test_a_target_given_as_an_input_is_named_with_the_keyword_that_takes_it() -> None:
    """`loss_fn(output, target)` makes `train_step(x, y, loss_fn=...)` a natural first try."""
    model, reference = twin(FanOut())
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    with pytest.raises(TypeError, match=r"too many positional arguments\nHow to fix: give the target by keyword, pipe.train_step\(x, target=y"):
        pipe.train_step(x, y, loss_fn=F.mse_loss)
    assert all(p.grad is None for p in pipe.parameters())
    loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    expected = F.mse_loss(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)


@pytest.mark.parametrize("length", [3, 8])
def test_a_target_is_split_along_the_inputs_batch_dim(length: int) -> None:
    """Before, the target was split along dim 0 whatever chunk_spec said: refused where its dim 0
    was not the batch's size, and, where it happened to be (T == B), cut across the sequence and
    refused as a loss that is 'not a mean over samples'."""
    model, plain = twin(SeqFirst(6, 5))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(length, 8, 6, dtype=torch.float64, generator=g), torch.randint(0, 5, (length, 8), generator=g)
    loss_fn = lambda out, t: F.cross_entropy(out.reshape(-1, 5), t.reshape(-1))  # noqa: E731
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, chunk_spec={"x": 1})
    loss = pipe.train_step(x, target=y, loss_fn=loss_fn)
    expected = loss_fn(plain(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, plain, tol=1e-12)


class Pooled(SeqFirst):
    """Takes (time, batch, features) to (batch, classes): the sequence pooled, the output batch first."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).mean(0)


def test_a_batch_first_target_of_a_sequence_first_model_is_split_along_the_outputs_batch_dim() -> None:
    """Before, a target of (batch, classes), its classes as many as the samples, was split along
    dim 1 (the inputs' batch dim): across its classes, refused as 'not a mean over samples'
    (advising reduction='sum') or failing in the loss."""
    model, plain = twin(Pooled(6, 8))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 8, 6, dtype=torch.float64, generator=g), torch.randn(8, 8, dtype=torch.float64, generator=g)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, chunk_spec={"x": 1})
    loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    expected = F.mse_loss(plain(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, plain, tol=1e-12)


class SequenceAndPooled(SeqFirst):
    """Returns (time, batch, classes) and the sequence pooled, (batch, classes)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        out = super().forward(x)
        return out, out.mean(0)


def test_each_leaf_of_a_target_shaped_like_the_outputs_is_split_as_its_output_holds_the_batch() -> None:
    """Before, the outputs' batch dims counted as one set ({0, 1}): the pooled output's target,
    its classes as many as the samples, was split along dim 1 and the loss failed on its sizes."""
    model, plain = twin(SequenceAndPooled(6, 8))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, 6, dtype=torch.float64, generator=g)
    y = (torch.randn(5, 8, 8, dtype=torch.float64, generator=g), torch.randn(8, 8, dtype=torch.float64, generator=g))
    loss_fn = lambda out, t: F.mse_loss(out[0], t[0]) + F.mse_loss(out[1], t[1])  # noqa: E731
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, chunk_spec={"x": 1})
    loss = pipe.train_step(x, target=y, loss_fn=loss_fn)
    expected = loss_fn(plain(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, plain, tol=1e-12)


class WithFinalState(nn.Module):
    """A batch-first GRU given its initial state (layers, batch, hidden), returning its outputs
    and its final state, which holds the batch on dim 1; or an LSTM, whose state is a pair."""

    def __init__(self, layers: int, lstm: bool = False, whole: bool = False) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(5, 8), nn.Identity() if whole else nn.Linear(6, 3)
        self.rnn = (nn.LSTM if lstm else nn.GRU)(8, 6, num_layers=layers, batch_first=True)
        self.lstm, self.whole = lstm, whole

    def forward(self, x: torch.Tensor, h0: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if self.whole:  # the RNN's (output, state), one value holding both
            return self.rnn(self.inp(x), h0)  # type: ignore[no-any-return]
        y, state = self.rnn(self.inp(x), (h0, h0) if self.lstm else h0)
        return self.out(y), state


def _state_loss(out: Any, t: Any) -> torch.Tensor:
    state = F.mse_loss(out[1][0], t[1][0]) + F.mse_loss(out[1][1], t[1][1]) if isinstance(t[1], tuple) else F.mse_loss(out[1], t[1])
    return F.mse_loss(out[0], t[0]) + state


@pytest.mark.parametrize("layers, batch, lstm, whole", [(2, 8, False, False), (4, 4, False, False), (4, 4, True, False), (4, 4, False, True)],
                         ids=["batch-on-dim-1", "layers-as-many-as-samples", "an-lstm's-pair", "the-rnn's-pair-whole"])  # fmt: skip
def test_a_target_shaped_like_the_outputs_is_split_along_a_batch_dim_its_output_holds_that_no_input_names(
    layers: int, batch: int, lstm: bool, whole: bool
) -> None:
    """x is split along dim 0, h0 along dim 1: the final state's target holds the batch on dim 1
    (an LSTM's, in each of its pair, which one output value holds). Before, only the inputs' first
    split dim and dim 0 were tried: the target was refused, or, with as many layers as samples,
    cut along its layers (a raw size error in the loss)."""
    model, plain = twin(WithFinalState(layers, lstm, whole).double())
    g = torch.Generator().manual_seed(0)
    x, h0 = torch.randn(batch, 7, 5, dtype=torch.float64, generator=g), torch.randn(layers, batch, 6, dtype=torch.float64, generator=g)
    state = torch.randn(layers, batch, 6, dtype=torch.float64, generator=g)
    target = (torch.randn(batch, 7, 6 if whole else 3, dtype=torch.float64, generator=g), (state, state + 1) if lstm else state)
    loss_fn = _state_loss
    for schedule in ("gpipe", "1f1b"):
        pipe = compile_pipeline(model, (x, h0), ["cpu", "cpu"], chunks=2, chunk_spec={"h0": 1}, schedule=schedule)
        pipe.zero_grad()
        plain.zero_grad()
        loss = pipe.train_step(x, h0, target=target, loss_fn=loss_fn)
        expected = loss_fn(plain(x, h0), target)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
        assert_grads_equal(pipe, plain, tol=1e-12)


def test_a_batch_too_small_for_interleaved_says_how_to_fix_it() -> None:
    """Before, the refusal advised chunks=2 (refused again for a batch of one) or schedule='1f1b'
    (refused with stages_per_device=2)."""
    model = FanOut().double()
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, schedule="interleaved-1f1b", stages_per_device=2)
    with pytest.raises(ValueError, match=r"(?s)micro-batch count \(3\).*drop a smaller last batch.*stages_per_device=1 and schedule='1f1b'"):
        pipe.train_step(x[:3], target=x[:3], loss_fn=F.mse_loss)


class SummedOwnLoss(nn.Module):
    """Returns its loss: a sum over samples ('sum'), that sum divided by a count given for the
    whole batch ('count': Hugging Face's num_items_in_batch), or a mean over samples ('mean')."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.body = FanOut()

    def forward(self, x: torch.Tensor, y: torch.Tensor, count: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.body(x)
        if self.how == "mean":
            return {"loss": F.mse_loss(out, y), "out": out}
        loss = F.mse_loss(out, y, reduction="sum")
        return {"loss": loss / count if self.how == "count" else loss, "out": out}


@pytest.mark.parametrize("schedule, training", [("gpipe", True), ("1f1b", True), ("2bw", True), ("gpipe", False)])
@pytest.mark.parametrize("how", ["sum", "count"])
def test_a_models_own_loss_summed_over_samples_combines_as_a_sum(how: str, schedule: str, training: bool) -> None:
    """Compiling sees, on two parts of the example, that the model's own loss is their sum: train_step
    sums the micro-batches' losses, under the default reduction, with nothing to warn of. Before,
    it took their mean: the loss and every gradient 1/chunks of the plain model's, with a warning."""
    model, reference = twin(SummedOwnLoss(how))
    x, y, count = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64), torch.tensor(48.0, dtype=torch.float64)
    pipe = compile_pipeline(model, (x, y, count), ["cpu"] * 2, chunks=3, schedule=schedule)
    assert pipe.program().own_loss_combines == "sum"
    pipe.train(training), reference.train(training)
    for step in range(2):  # gradients accumulated over two steps
        x, y = x + step, y - step
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            loss = pipe.train_step(x, y, count)
        expected = reference(x, y, count)["loss"]
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)
    with torch.no_grad():  # the loss alone, summed alike
        torch.testing.assert_close(pipe.train_step(x, y, count), reference(x, y, count)["loss"], rtol=1e-12, atol=1e-12)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # (float64 stays float64 under autocast: the same sum)
        torch.testing.assert_close(pipe.train_step(x, y, count).detach(), reference(x, y, count)["loss"].detach(), rtol=1e-12, atol=1e-12)


def test_a_sum_asked_of_a_models_own_mean_loss_is_refused_before_the_step() -> None:
    model = SummedOwnLoss("mean")
    x, y, count = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)
    pipe = compile_pipeline(model.double(), (x, y, count), ["cpu"] * 2, chunks=4)
    assert pipe.program().own_loss_combines == "mean"
    reference = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"(?s)reduction='sum', but the model's own loss is a mean over samples.*4 times.*leave reduction at 'mean'"):
        pipe.train_step(x, y, count, reduction="sum")
    assert all(p.grad is None for p in pipe.parameters())
    with pytest.warns(UserWarning, match="as it is on two parts of the example"):  # the step after the refusal
        loss = pipe.train_step(x, y, count)
    expected = reference(x, y, count)["loss"]
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)


class TokenLoss(nn.Module):
    """A loss over the tokens `mask` keeps, summed, then: divided by a count given whole
    ('given'), by this batch's count, clamped ('clamped'), by its longest row ('longest'), or
    added to a second sum and halved ('two sums')."""

    def __init__(self, norm: str) -> None:
        super().__init__()
        self.norm = norm
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, count: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.b(torch.tanh(self.a(x)))
        tok = (out - y).pow(2).sum(-1) * mask
        if self.norm == "given":
            loss = tok.sum() / count
        elif self.norm == "clamped":
            loss = tok.sum() / mask.sum().clamp(min=1)
        elif self.norm == "longest":
            loss = tok.sum() / mask.sum(1).max()
        else:
            loss = (tok.sum() + out.abs().sum()) * 0.5
        return {"loss": loss, "out": out}


@pytest.mark.parametrize("norm, example_mask, combines", [
    ("given", "padded", "sum"), ("two sums", "padded", "sum"),
    ("clamped", "second part empty", SUMMED_ON_EXAMPLE), ("longest", "full", SUMMED_ON_EXAMPLE),
])  # fmt: skip
def test_a_loss_that_is_a_sum_on_the_example_alone_is_not_taken_for_one(norm: str, example_mask: str, combines: Optional[str]) -> None:
    """A loss divided by something of this batch that the example's parts happen to share (its
    longest row, on an example with none shorter; a clamped count, where one part counts none)
    is a sum of the parts' on the example and not on later batches. Before, it was summed on
    every batch with nothing to warn of: on a padded batch the loss 14.95 where the plain
    model's is 11.37. Only a sum the graph makes (passes/summed_loss.py) is summed now; a mean,
    which the example shows wrong, is refused, and a sum asked for is warned of."""
    model, reference = twin(TokenLoss(norm))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 5, 6, dtype=torch.float64, generator=g), torch.randn(8, 5, 6, dtype=torch.float64, generator=g)
    mask = torch.ones(8, 5, dtype=torch.float64)
    if example_mask == "padded":
        mask[1, 2:] = mask[6, 1:] = 0
    elif example_mask == "second part empty":
        mask[3:] = 0  # (compiling's check runs on samples 0-2 and 3-7)
    count = mask.sum()
    pipe = compile_pipeline(model, (x, y, mask, count), ["cpu"] * 2, chunks=2)
    assert pipe.program().own_loss_combines == combines
    mask = torch.ones(8, 5, dtype=torch.float64)
    mask[0, 1:] = mask[5, 3:] = 0  # a batch whose halves differ
    if combines == SUMMED_ON_EXAMPLE:
        with pytest.raises(ValueError, match="on the example the model's own loss is the sum of its parts' losses"):
            pipe.train_step(x, y, mask, mask.sum())
        with pytest.warns(UserWarning, match="cannot check that it is one"):
            pipe.train_step(x, y, mask, mask.sum(), reduction="sum")
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = pipe.train_step(x, y, mask, mask.sum())
    expected = reference(x, y, mask, mask.sum())["loss"]
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)


LossAndLogits = collections.namedtuple("LossAndLogits", ["loss", "logits"])


class PaddedLMNamedTuple(PaddedLM):
    """PaddedLM returning a namedtuple with a `loss` field; its loss summed over the labels that
    count where `summed`."""

    def __init__(self, summed: bool) -> None:
        super().__init__()
        self.summed = summed

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> LossAndLogits:  # type: ignore[override]
        logits = self.head(torch.tanh(self.mix(self.embed(ids))))
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        loss = F.cross_entropy(logits.view(-1, self.vocab), shifted.view(-1), ignore_index=-100, reduction="sum" if self.summed else "mean")
        return LossAndLogits(loss, logits)


@pytest.mark.parametrize("summed", [False, True])
def test_a_namedtuple_with_a_loss_field_is_the_models_own_loss_at_compile_time_too(summed: bool) -> None:
    """Before, compiling found no own loss in a namedtuple (the template holds it as one value):
    its mean over counted labels was not weighted by them (1.6306 where the plain model's is
    1.6937), its sum was averaged (3.387 for 6.775)."""
    torch.manual_seed(0)
    model, reference = twin(PaddedLMNamedTuple(summed))
    ids, labels = padded_labels(1)
    pipe = compile_pipeline(model, (ids, labels), ["cpu"] * 2, chunks=4)
    assert (pipe.program().own_loss_combines == "sum") if summed else (pipe.program().loss_counter is not None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = pipe.train_step(ids, labels)
    expected = reference(ids, labels).loss
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)


@pytest.mark.parametrize("summed", [False, True])
def test_a_namedtuple_own_loss_is_returned_with_the_outputs_as_the_plain_model_s(summed: bool) -> None:
    """Before, return_outputs=True was refused as an output made from the whole batch, advising
    to add the loss into a loss the model returns itself, which it does: the namedtuple is one
    value of the outputs, whose `loss` field is now the step's combined loss."""
    torch.manual_seed(0)
    model, reference = twin(PaddedLMNamedTuple(summed))
    ids, labels = padded_labels(1)
    pipe = compile_pipeline(model, (ids, labels), ["cpu"] * 2, chunks=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss, outputs = pipe.train_step(ids, labels, return_outputs=True)
    expected = reference(ids, labels)
    expected.loss.backward()
    assert type(outputs) is LossAndLogits
    torch.testing.assert_close(outputs.loss, expected.loss.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss, expected.loss.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(outputs.logits, expected.logits.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)


PastLossLogits = collections.namedtuple("PastLossLogits", ["past", "loss", "logits"])


class LossAfterOtherFields(nn.Module):
    """A namedtuple whose `loss` field follows one of no tensor, a number, or two tensors."""

    def __init__(self, past: str) -> None:
        super().__init__()
        self.past, self.a, self.b = past, nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> PastLossLogits:
        h = torch.tanh(self.a(x))
        logits = self.b(h)
        past = None if self.past == "none" else 3 if self.past == "int" else (h, h * 2)
        return PastLossLogits(past, F.cross_entropy(logits, labels), logits)


@pytest.mark.parametrize("past", ["none", "int", "tuple"])
def test_a_namedtuple_own_loss_after_fields_of_other_kinds_is_returned_as_the_plain_model_s(past: str) -> None:
    """Before, a field that was no single tensor before or beside the loss made compiling give up
    on the field: return_outputs=True was refused with the advice the model already followed."""
    torch.manual_seed(0)
    model, reference = twin(LossAfterOtherFields(past).double())
    x, labels = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 4, (8,))
    pipe = compile_pipeline(model, (x, labels), ["cpu"] * 2, chunks=4, split_points=["b"])
    loss, outputs = pipe.train_step(x, labels, return_outputs=True)
    expected = reference(x, labels)
    expected.loss.backward()
    torch.testing.assert_close(outputs.loss, expected.loss.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss, expected.loss.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(outputs.logits, expected.logits.detach(), rtol=0, atol=1e-12)
    if past == "tuple":
        torch.testing.assert_close(outputs.past[1], expected.past[1].detach(), rtol=0, atol=1e-12)
    else:
        assert outputs.past == expected.past
    assert_grads_equal(pipe, reference, tol=1e-12)


class CountedAsOneElement(SummedOwnLoss):
    """SummedOwnLoss('count') given its count as a tensor of one element: its loss has shape (1,)."""

    def __init__(self) -> None:
        super().__init__("count")


def test_an_own_loss_of_one_element_trains_as_the_plain_model() -> None:
    """A count given as a tensor of one element (Hugging Face's Trainer gives num_items_in_batch
    so under DataParallel) makes the plain model's loss one of shape (1,), whose backward works.
    Before, a stage failed on it ('the loss of a micro-batch must be a 0-dim tensor')."""
    model, reference = twin(CountedAsOneElement())
    x, y, count = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64), torch.tensor([48.0], dtype=torch.float64)
    pipe = compile_pipeline(model, (x, y, count), ["cpu"] * 2, chunks=2)
    assert pipe.program().own_loss_combines == "sum"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = pipe.train_step(x, y, count)
    expected = reference(x, y, count)["loss"]
    expected.backward()
    torch.testing.assert_close(loss, expected.detach().reshape(()), rtol=1e-12, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)


class SumAndPenalty(SummedOwnLoss):
    """A sum over samples plus a penalty on a weight, added once for the batch."""

    def __init__(self) -> None:
        super().__init__("sum")

    def forward(self, x: torch.Tensor, y: torch.Tensor, count: torch.Tensor) -> dict[str, torch.Tensor]:
        out = super().forward(x, y, count)
        return {**out, "loss": out["loss"] + 0.01 * next(self.parameters()).pow(2).sum()}


def test_an_own_loss_neither_the_sum_nor_the_mean_of_the_halves_is_refused_without_advising_a_reduction() -> None:
    """Before, a warning said the result differs and the step ran (and before that, advised
    reduction='sum', which counts the penalty once per micro-batch). One micro-batch runs it."""
    model, reference = twin(SumAndPenalty())
    x, y, count = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)
    pipe = compile_pipeline(model, (x, y, count), ["cpu"] * 2, chunks=2)
    assert pipe.program().own_loss_combines == "neither"
    with pytest.raises(ValueError, match=r"(?s)neither the sum nor the mean of its parts' losses.*would differ.*How to fix: .*loss_fn") as refused:
        pipe.train_step(x, y, count)
    assert "reduction='sum'" not in str(refused.value)
    assert all(p.grad is None for p in model.parameters())
    whole = compile_pipeline(model, (x, y, count), ["cpu"] * 2, chunks=1)
    loss, expected = whole.train_step(x, y, count), reference(x, y, count)["loss"]
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    assert_grads_equal(model, reference, tol=1e-12)


class ConstantIgnored(nn.Module):
    """A token classifier's own loss as several Hugging Face models write it: the labels kept
    where the mask says, elsewhere a tensor made in forward (`torch.tensor(-100).type_as(...)`);
    `built_in_forward`: its `CrossEntropyLoss` made in forward too, which torch.export captures."""

    def __init__(self, built_in_forward: bool) -> None:
        super().__init__()
        self.built_in_forward = built_in_forward
        self.embed, self.mix, self.head = nn.Embedding(11, 8), nn.Linear(8, 8), nn.Linear(8, 5)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(torch.tanh(self.mix(self.embed(ids))))
        kept = torch.where(mask.view(-1) == 1, labels.view(-1), torch.tensor(-100).type_as(labels))
        if self.built_in_forward:
            return nn.CrossEntropyLoss()(logits.view(-1, 5), kept), logits
        return F.cross_entropy(logits.view(-1, 5), kept), logits


@pytest.mark.parametrize("built_in_forward", [False, True], ids=["fx", "export"])
def test_a_model_s_own_mean_over_targets_made_with_a_tensor_constant_is_weighted_by_its_counts(built_in_forward: bool) -> None:
    """Before, the constant hid the target from the counting pass: the micro-batches were
    weighted by samples (a loss 1.683 where the plain model's is 1.673, gradients 0.05 off),
    with a warning."""
    torch.manual_seed(0)
    model, reference = twin(ConstantIgnored(built_in_forward))
    ids, _ = padded_labels(1)
    mask = torch.ones_like(ids)
    labels = torch.randint(0, 5, ids.shape, generator=torch.Generator().manual_seed(2))
    for row, pad in enumerate((8, 5, 0, 0, 0, 2, 0, 0)):
        mask[row, 10 - pad :] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch.export's fallback)
        pipe = compile_pipeline(model, (ids, torch.ones_like(ids), labels), ["cpu"] * 2, chunks=4)
    assert pipe.program().loss_counter is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = pipe.train_step(ids, mask, labels)
    expected = reference(ids, mask, labels)[0]
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)


class WarmedUp(nn.Module):
    """A cross-entropy with a penalty switched on after `warmup` calls: a counter the loss keeps
    (as a plain attribute, or as a buffer)."""

    calls: torch.Tensor

    def __init__(self, warmup: int, buffer: bool) -> None:
        super().__init__()
        self.warmup, self.buffer = warmup, buffer
        self.step = 0
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.buffer:
            self.calls += 1
        else:
            self.step += 1
        on = (int(self.calls) if self.buffer else self.step) > self.warmup
        return F.cross_entropy(out, target) + (out.pow(2).mean() if on else 0)


class Tempered(nn.Module):
    """A cross-entropy at a learned temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.full((), 2.0))

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out / self.temperature, target)


@pytest.mark.parametrize("buffer", [False, True], ids=["attribute", "buffer"])
def test_a_loss_fn_that_keeps_state_is_refused_and_its_state_put_back(buffer: bool) -> None:
    """train_step calls loss_fn once per micro-batch and once more on the whole batch: before,
    a counter the loss kept moved 5 times a step (its penalty on from the second step, not the
    sixth), with no word."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 4, (8,))
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4)
    loss = WarmedUp(warmup=5, buffer=buffer)
    with pytest.raises(ValueError, match=r"loss_fn changes its own state when called: (step \(0 -> 5\)|calls \(a tensor -> a tensor\)), over this step's 5 calls"):
        pipe.train_step(x, target=y, loss_fn=loss)
    assert loss.step == 0 and int(loss.calls) == 0
    assert all(p.grad is None for p in model.parameters())
    # A loss holding only settings and parameters (a learned temperature) is no state.
    tempered, reference = Tempered().double(), copy.deepcopy(model)
    got = pipe.train_step(x, target=y, loss_fn=tempered)
    plain_tempered = Tempered().double()
    expected = plain_tempered(reference(x), y)
    expected.backward()
    torch.testing.assert_close(got, expected.detach(), rtol=1e-12, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)
    torch.testing.assert_close(tempered.temperature.grad, plain_tempered.temperature.grad, rtol=1e-12, atol=1e-12)
    label_smoothed = nn.CrossEntropyLoss(label_smoothing=0.1)
    pipe.train_step(x, target=y, loss_fn=label_smoothed)


def test_per_sample_values_of_the_target_that_are_no_tensors_are_refused_naming_them() -> None:
    """Before, they went whole to every micro-batch: the loss failed inside the loss stage with a
    batch-size mismatch (an array of labels), or with ctc_loss's `input_lengths must be of size
    batch_size` (lengths as lists, which ctc_loss takes)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 4, (8,))
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4)

    def loss_fn(out: torch.Tensor, t: Any) -> torch.Tensor:
        return F.cross_entropy(out, torch.as_tensor(t[0] if isinstance(t, tuple) else t))

    cases = {r"target, an array of shape \(8,\)": y.numpy(), r"target\[1\], a list of 8 numbers": (y, [3] * 8)}
    for said, target in cases.items():
        with pytest.raises(ValueError, match=rf"(?s)per sample that are not tensors: {said}\..*torch.as_tensor"):
            pipe.train_step(x, target=target, loss_fn=loss_fn)
    assert all(p.grad is None for p in model.parameters())
    reference = copy.deepcopy(model)
    loss = pipe.train_step(x, target=(y, 2.0), loss_fn=loss_fn)  # a number for the whole batch goes whole
    expected = F.cross_entropy(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)


def _ctc(out: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    labels, input_lengths, label_lengths = target
    return F.ctc_loss(out.log_softmax(-1), labels, input_lengths, label_lengths)


def test_a_target_split_along_one_dim_stays_split_there_when_another_batch_fits_both() -> None:
    """ctc_loss on a sequence-first model: its padded labels (batch, longest label) have the
    batch's size on dim 1 too in a batch whose longest label is as long as the batch. Before,
    such a batch's labels were split along dim 1 (the outputs' batch dim), and ctc_loss failed
    in the loss stage, in the middle of training."""
    torch.manual_seed(0)
    model, reference = twin(SeqFirst(6, 5))
    x = torch.randn(12, 8, 6, dtype=torch.float64)  # (time, batch, features)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, chunk_spec={"x": 1})
    g = torch.Generator().manual_seed(1)
    for longest in (5, 8):  # the second batch's labels are (8, 8)
        label_lengths = torch.randint(1, longest + 1, (8,), generator=g)
        label_lengths[0] = longest
        target = (torch.randint(1, 5, (8, longest), generator=g), torch.full((8,), 12), label_lengths)
        loss = pipe.train_step(x, target=target, loss_fn=_ctc)
        expected = _ctc(reference(x), target)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
        assert_grads_equal(pipe, reference, tol=1e-12)


def _info_nce(out: torch.Tensor, _: Any) -> torch.Tensor:
    """Each sample against every other of the batch: no sum or mean over samples."""
    z = F.normalize(out, dim=1)
    return F.cross_entropy(z @ z.T / 0.1, torch.arange(len(z)))


def test_a_loss_that_compares_samples_is_refused_pointing_to_pipe_x_and_backward() -> None:
    """Before, the refusal's first fixes (another reduction, a sum over a count) cannot apply to it."""
    torch.manual_seed(0)
    model, reference = twin(nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 4)))
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4)
    with pytest.raises(ValueError, match=r"(?s)compares samples with each other .*use pipe\(x\) and loss.backward\(\)"):
        pipe.train_step(x, target=None, loss_fn=_info_nce)
    _info_nce(pipe(x), None).backward()  # the fix it gives
    _info_nce(reference(x), None).backward()
    assert_grads_equal(pipe, reference, tol=1e-12)


class _Appends:
    """Keeps what it saw in a list."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def __call__(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.seen.append(len(out))
        return F.cross_entropy(out, target)


class _Tallies:
    """Counts in a dict, through an object it holds."""

    def __init__(self) -> None:
        self.meter = types.SimpleNamespace(stats={"calls": 0})

    def __call__(self, out: torch.Tensor, target: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        self.meter.stats["calls"] += 1
        return F.cross_entropy(out, target) * scale


def test_loss_state_in_containers_held_objects_and_partials_is_refused_and_one_call_is_not() -> None:
    """Before, a list appended to, a dict in an object the loss holds, or a loss behind
    functools.partial moved 5 times a step with no word; and a step of one micro-batch, which
    calls loss_fn once, was refused as two calls."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 4, (8,))
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4)
    appends, tallies = _Appends(), _Tallies()
    for loss_fn, said in ((appends, r"seen \(\[\] -> a list of 5\)"), (functools.partial(tallies, scale=2.0), r"stats \(\{'calls': 0\} -> \{'calls': 5\}\)")):
        with pytest.raises(ValueError, match=rf"loss_fn changes its own state when called: {said}"):
            pipe.train_step(x, target=y, loss_fn=loss_fn)
    assert appends.seen == [] and tallies.meter.stats == {"calls": 0}
    one = compile_pipeline(copy.deepcopy(model), x, ["cpu"] * 2, chunks=1)
    one.train_step(x, target=y, loss_fn=appends)  # one call, as the plain loop's
    assert appends.seen == [8]


class _Scaled(SeqFirst):
    def forward(self, x: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:  # type: ignore[override]
        out = super().forward(x)
        return out if scale is None else out * scale


def test_the_remembered_split_of_a_target_holds_for_calls_of_another_kind_too() -> None:
    """Before, a call with an optional argument ran on stages of its own that had not seen the
    earlier calls: its ambiguous target was split along the outputs' batch dim, and the loss
    failed in the loss stage."""
    torch.manual_seed(0)
    model, reference = twin(_Scaled(6, 4))
    pipe = compile_pipeline(model, torch.randn(3, 8, 6, dtype=torch.float64), ["cpu", "cpu"], chunks=2, chunk_spec={"x": 1})

    def loss_fn(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # a batch-first target of a sequence-first output
        return F.mse_loss(out.mean(0), t)

    pipe.train_step(torch.randn(3, 8, 6, dtype=torch.float64), target=torch.randn(8, 4, dtype=torch.float64), loss_fn=loss_fn)
    model.zero_grad()
    x, t, scale = torch.randn(3, 4, 6, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (another kind of call compiles its stages)
        loss = pipe.train_step(x, target=t, loss_fn=loss_fn, scale=scale)
    expected = loss_fn(reference(x, scale=scale), t)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)


class _KeepsTheLast(nn.Module):
    """Keeps its last loss and its parts for logging: what the plain loop's one call leaves."""

    def __init__(self) -> None:
        super().__init__()
        self.last: Optional[torch.Tensor] = None
        self.parts: dict[str, float] = {}

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(out, target)
        self.last, self.parts = loss.detach(), {"ce": loss.item()}
        return loss


def _trained_as_the_plain_loop(make: Callable[[], _KeepsTheLast], tol: float) -> tuple[Any, _KeepsTheLast, _KeepsTheLast, torch.Tensor, torch.Tensor]:
    """One train_step with a loss of `make`'s, against the plain model's step with another: the
    loss and every gradient alike; the pipeline, its loss, the plain one's, and the batch."""
    torch.manual_seed(0)
    model, reference = twin(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)))
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 4, (8,))
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4)
    ours, theirs = make(), make()
    loss = pipe.train_step(x, target=y, loss_fn=ours)
    expected = theirs(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=tol)
    return pipe, ours, theirs, x, y


def test_a_loss_that_keeps_its_last_value_for_logging_trains_and_keeps_the_plain_loop_s() -> None:
    """Its last call, on the whole batch, leaves what the plain loop's one call leaves: no state
    that moves with the calls. Refused by the check of state before."""
    _, ours, theirs, _, _ = _trained_as_the_plain_loop(_KeepsTheLast, tol=1e-12)
    assert ours.last is not None and theirs.last is not None
    torch.testing.assert_close(ours.last, theirs.last, rtol=1e-12, atol=1e-12)
    assert ours.parts.keys() == theirs.parts.keys() and abs(ours.parts["ce"] - theirs.parts["ce"]) < 1e-12


class _KeepsTheLastAndDraws(_KeepsTheLast):
    """Keeps its last loss, and adds label noise: its calls draw."""

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return super().forward(out + 0.01 * torch.randn_like(out), target)


class _KeepsTheLastPenalty(_KeepsTheLast):
    """Keeps its last loss, and penalises its outputs' gradient (it differentiates them)."""

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = super().forward(out, target)
        (grad,) = torch.autograd.grad(loss, out, create_graph=True)
        return loss + (grad * len(out)).square().sum() / len(out)  # (a mean over samples of their gradients' squares)


def test_a_loss_that_keeps_its_last_value_is_compared_on_a_call_like_the_check_s() -> None:
    """The call that tells whether the kept value is what the plain loop's one call leaves runs
    as the check's does: with gradients (a penalty on them ran before under no_grad, and failed
    in the loss), and undoing its draws (one that draws is refused: the call cannot tell)."""
    pipe, _, _, x, y = _trained_as_the_plain_loop(_KeepsTheLastPenalty, tol=1e-10)
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match="loss_fn changes its own state when called: last"):
        pipe.train_step(x, target=y, loss_fn=_KeepsTheLastAndDraws())
    assert torch.equal(torch.get_rng_state(), state)


class _TwoHeads(nn.Module):
    """Outputs from the first stage and the last: the loss reads leaves a stage sent."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        return self.c(torch.tanh(self.b(h))), h + 1  # (h itself is saved by b's backward: no loss may write it)


def _writing_loss(out: Any, t: torch.Tensor) -> torch.Tensor:
    """A loss that writes the outputs it is given in place, as `logits.div_(temperature)` does."""
    o, h = out if isinstance(out, tuple) else (out, None)
    o.div_(2.0).clamp_(min=-0.5)
    extra = h.mul_(3.0).pow(2).mean() if h is not None else 0.0
    return F.mse_loss(o, t) + extra


@pytest.mark.parametrize("schedule, checkpoint", [("gpipe", "except_last"), ("1f1b", "always"), ("zb-h1", "never"), ("1f1b", "except_last")])
@pytest.mark.parametrize("heads", [False, True], ids=["one-output", "two-stages-outputs"])
def test_a_loss_that_writes_its_outputs_in_place_trains_as_the_plain_model(schedule: str, checkpoint: str, heads: bool) -> None:
    torch.manual_seed(0)
    made = _TwoHeads() if heads else nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    model, plain = twin(made)
    x, t = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 3 if heads else ["cpu"] * 2, chunks=4, schedule=schedule, checkpoint=checkpoint)
    for step in range(3):  # the first step learns that the loss writes; the others hand it copies as known
        out = plain(x)
        expected_outputs = tuple(o.detach().clone() for o in out) if heads else out.detach().clone()
        expected = _writing_loss(out, t)
        expected.backward()
        loss, outputs = pipe.train_step(x, target=t, loss_fn=_writing_loss, return_outputs=True)
        assert torch.allclose(loss, expected, rtol=0, atol=1e-12), step
        assert_grads_equal(pipe, plain)
        for got, want in zip(outputs if heads else (outputs,), expected_outputs if heads else (expected_outputs,)):
            assert torch.allclose(got, want, rtol=0, atol=1e-12)  # the model's outputs, as it returned them


def test_a_loss_that_writes_nothing_is_handed_the_outputs_themselves_after_its_first_step() -> None:
    torch.manual_seed(0)
    model, plain = twin(_TwoHeads())
    x, t = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 3, chunks=2)
    given: list[bool] = []

    def loss_fn(out: Any, y: torch.Tensor) -> torch.Tensor:
        given.append(any(type(o.grad_fn).__name__ == "CloneBackward0" for o in out))  # a copy
        return F.mse_loss(out[0], y) + out[1].pow(2).mean()

    steps = []
    for _ in range(2):
        given.clear()
        pipe.train_step(x, target=t, loss_fn=loss_fn)
        steps.append(given[:2])  # the two micro-batches' losses (the checks of the whole batch follow)
        (F.mse_loss(plain(x)[0], t) + plain(x)[1].pow(2).mean()).backward()
    assert_grads_equal(pipe, plain)
    assert steps == [[True, True], [False, False]]


@pytest.mark.parametrize("schedule, checkpoint", [("gpipe", "except_last"), ("1f1b", "always"), ("zb-h1", "never")])
def test_a_loss_that_writes_its_target_in_place_trains_and_writes_it_as_the_plain_model(schedule: str, checkpoint: str) -> None:
    def smoothed(out: torch.Tensor, y: dict[str, torch.Tensor]) -> torch.Tensor:
        y["soft"].mul_(0.9).add_(0.05)  # label smoothing written into the target, as some losses do
        return F.mse_loss(out, y["soft"]) + y["scale"].mul_(2.0).sum() * 0.0  # ("scale" goes whole to each micro-batch)

    torch.manual_seed(0)
    model, plain = twin(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)))
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4, schedule=schedule, checkpoint=checkpoint)
    for step in range(2):
        soft = torch.randn(8, 4, dtype=torch.float64)
        mine, theirs = {"soft": soft.clone(), "scale": torch.ones(3)}, {"soft": soft.clone(), "scale": torch.ones(3)}
        expected = smoothed(plain(x), theirs)
        expected.backward()
        loss = pipe.train_step(x, target=mine, loss_fn=smoothed)
        assert torch.allclose(loss, expected, rtol=0, atol=1e-12), step
        assert_grads_equal(pipe, plain)
        assert torch.equal(mine["soft"], theirs["soft"]) and torch.equal(mine["scale"], theirs["scale"]), step


def test_a_loss_that_writes_its_outputs_at_a_later_step_only_is_refused_once_then_handed_copies() -> None:
    torch.manual_seed(0)
    model, plain = twin(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)))
    x, t = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    writes = [False]

    def sometimes(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out.div_(2.0) if writes[0] else out / 2.0, y)

    for schedule, checkpoint in [("1f1b", "always"), ("zb-h1", "never")]:  # a sent leaf; the loss stage's own outputs
        writes[0] = False
        pipe = compile_pipeline(copy.deepcopy(model), x, ["cpu"] * 2, chunks=4, schedule=schedule, checkpoint=checkpoint)
        pipe.train_step(x, target=t, loss_fn=sometimes)  # learns that it writes nothing
        before = [grad_of(p).clone() for p in pipe.parameters()]
        writes[0] = True
        with pytest.raises(StageError, match=r"wrote the outputs it is given in place at this step(.|\n)*How to fix: call train_step again"):
            pipe.train_step(x, target=t, loss_fn=sometimes)
        assert all(torch.equal(grad_of(p), b) for p, b in zip(pipe.parameters(), before))  # nothing accumulated
        pipe.zero_grad()
        plain.zero_grad()
        loss = pipe.train_step(x, target=t, loss_fn=sometimes)
        expected = sometimes(plain(x), t)
        expected.backward()
        assert torch.allclose(loss, expected, rtol=0, atol=1e-12)
        for p, q in zip(pipe.parameters(), plain.parameters()):
            assert torch.allclose(grad_of(p), grad_of(q), rtol=0, atol=1e-12)


class _Aliased(nn.Module):
    def __init__(self, view: bool) -> None:
        super().__init__()
        self.a, self.b, self.view = nn.Linear(4, 4), nn.Linear(4, 4), view

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.b(torch.tanh(self.a(x)))
        return h, h[:, :2] if self.view else h


def _writes_the_first_reads_the_second(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    h, other = out
    h.mul_(2.0)
    return F.mse_loss(other, y[:, : other.shape[1]])


def _one_step_as_the_plain_model(made: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
    """One train_step of `made` (in float64, 2 stages, 4 micro-batches) against the plain model's."""
    torch.manual_seed(0)
    model, plain = twin(made)
    x, t = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4)
    loss = pipe.train_step(x, target=t, loss_fn=loss_fn)
    expected = loss_fn(plain(x), t)
    expected.backward()
    assert torch.allclose(loss, expected, rtol=0, atol=1e-12)
    assert_grads_equal(pipe, plain)


def test_outputs_that_alias_are_handed_as_one_or_refused_where_copies_would_part_them() -> None:
    _one_step_as_the_plain_model(_Aliased(view=False), _writes_the_first_reads_the_second)  # one tensor twice: one copy, handed twice
    x, t = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    model = _Aliased(view=True).double()  # a view of another: refused, nothing accumulated
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4)
    with pytest.raises(StageError, match=r"hold one tensor twice, or views that share elements(.|\n)*How to fix: write a copy in loss_fn"):
        pipe.train_step(x, target=t, loss_fn=_writes_the_first_reads_the_second)
    assert all(p.grad is None for p in model.parameters())

    def reads_what_it_wrote(out: torch.Tensor, y: dict[str, torch.Tensor]) -> torch.Tensor:
        y["soft"].mul_(0.5)
        return F.mse_loss(out, y["ref"])

    pipe = compile_pipeline(nn.Sequential(nn.Linear(4, 4)).double(), x, ["cpu"], chunks=2)
    y = t.clone()
    with pytest.raises(StageError, match="hold one tensor twice, or views that share elements"):
        pipe.train_step(x, target={"soft": y, "ref": y}, loss_fn=reads_what_it_wrote)
    assert torch.equal(y, t)  # the caller's target as given


def test_a_loss_that_writes_its_target_under_inference_mode_writes_the_caller_s_target() -> None:
    model, plain = twin(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)))
    x = torch.randn(8, 4, dtype=torch.float64)
    with torch.inference_mode():
        y, expected_y = torch.randn(8, 4, dtype=torch.float64), None
        expected_y = y.clone()
        pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4)
        loss = pipe.train_step(x, target=y, loss_fn=lambda out, t: F.mse_loss(out, t.mul_(0.9)))
        expected = F.mse_loss(plain(x), expected_y.mul_(0.9))
    assert torch.allclose(loss, expected, rtol=0, atol=1e-12)
    assert torch.equal(y, expected_y)


def test_a_step_refused_after_its_losses_ran_leaves_the_caller_s_target_as_given() -> None:
    class Counting(nn.Module):  # state the plain loop moves once a step: refused, and put back
        def __init__(self) -> None:
            super().__init__()
            self.steps = 0

        def forward(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            self.steps += 1
            return F.mse_loss(out, t.mul_(0.9))

    x, t = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    pipe = compile_pipeline(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double(), x, ["cpu"] * 2, chunks=4)
    y = t.clone()
    with pytest.raises(ValueError, match="loss_fn changes its own state"):
        pipe.train_step(x, target=y, loss_fn=Counting())
    assert torch.equal(y, t)


def test_a_loss_whose_closure_holds_a_number_that_moves_every_step_is_one_loss_function() -> None:
    x, t = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    pipe = compile_pipeline(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double(), x, ["cpu"] * 2, chunks=4)
    calls, copies = [], []
    for step in range(3):
        temperature = 1.0 + 0.1 * step  # annealed

        def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            calls.append(step)
            copies.append(type(out.grad_fn).__name__ == "CloneBackward0")
            return F.mse_loss(out / temperature, y)

        pipe.train_step(x, target=t, loss_fn=loss_fn)
    # the first step: 4 micro-batches, the whole batch's check, the gradient's check (5 more);
    # then 4 and the check, with the outputs themselves
    assert [calls.count(s) for s in range(3)] == [10, 5, 5]
    assert copies[:4] == [True] * 4 and copies[10:14] == copies[15:19] == [False] * 4


class _NormedCritic(nn.Module):
    """A loss object holding a network with BatchNorm, in training mode: each call moves its statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).double()

    def forward(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.critic(out), t)


def test_a_loss_object_whose_batch_norm_moves_is_refused_and_its_statistics_put_back() -> None:
    x, t = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    pipe = compile_pipeline(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double(), x, ["cpu"] * 2, chunks=4)
    loss_fn = _NormedCritic()
    before = {k: v.clone() for k, v in loss_fn.state_dict().items()}
    with pytest.raises(ValueError, match=r"loss_fn changes its own state when called: .*running_mean"):
        pipe.train_step(x, target=t, loss_fn=loss_fn)
    assert all(torch.equal(v, before[k]) for k, v in loss_fn.state_dict().items())


class _ReturnsItsOwn(nn.Module):
    """Returns a buffer, or its input, as it is beside its prediction."""

    def __init__(self, returns: str) -> None:
        super().__init__()
        self.a, self.b, self.returns = nn.Linear(4, 4), nn.Linear(4, 4), returns
        self.count: torch.Tensor
        self.register_buffer("count", torch.ones(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.b(torch.tanh(self.a(torch.tanh(x)))), self.count if self.returns == "buffer" else x


@pytest.mark.parametrize("returns, checkpoint", [("buffer", "except_last"), ("input", "never"), ("input", "always")])
def test_a_loss_that_writes_a_buffer_or_input_the_model_returns_as_it_is_writes_it_once_as_the_plain_model(returns: str, checkpoint: str) -> None:
    def counting(out: tuple[torch.Tensor, torch.Tensor], t: torch.Tensor) -> torch.Tensor:
        pred, extra = out
        extra.add_(1.0)
        return F.mse_loss(pred, t)

    torch.manual_seed(0)
    model, plain = twin(_ReturnsItsOwn(returns))
    x, t = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    mine, theirs = x.clone(), x.clone()
    pipe = compile_pipeline(model, mine, ["cpu"] * 2, chunks=4, checkpoint=checkpoint)
    for _ in range(2):
        loss = pipe.train_step(mine, target=t, loss_fn=counting)
        expected = counting(plain(theirs), t)
        expected.backward()
        assert torch.allclose(loss, expected, rtol=0, atol=1e-12)
        assert torch.equal(mine, theirs) and torch.equal(model.count, plain.count)
    assert_grads_equal(pipe, plain)


def test_a_loss_that_writes_its_outputs_under_inference_mode_alone_computes_the_plain_model_s_loss() -> None:
    def doubles_in_inference(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        out = out.mul_(2.0) if torch.is_inference_mode_enabled() else out * 2.0
        return F.mse_loss(out, t)

    model, plain = twin(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)))
    x, t = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4)
    pipe.train_step(x, target=t, loss_fn=doubles_in_inference)  # learns that it writes nothing (with gradients)
    with torch.inference_mode():
        loss = pipe.train_step(x, target=t, loss_fn=doubles_in_inference)
        expected = doubles_in_inference(plain(x), t)
    assert torch.allclose(loss, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kept", ["tensor", "float"])
def test_a_nan_loss_kept_for_logging_is_returned_as_the_plain_model_s(kept: str) -> None:
    class KeepsLast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.last: Any = None

        def forward(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            loss = F.mse_loss(out, t)
            self.last = loss.detach() if kept == "tensor" else loss.item()
            return loss

    x, t = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    t[3, 1] = float("nan")  # a bad sample: the plain model's loss is NaN
    pipe = compile_pipeline(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double(), x, ["cpu"] * 2, chunks=4)
    loss_fn = KeepsLast()
    assert pipe.train_step(x, target=t, loss_fn=loss_fn).isnan()
    assert math.isnan(float(loss_fn.last))


class _Halves(nn.Module):
    """Returns the two halves of one tensor, as a VAE returns its mean and log-variance."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.b(torch.tanh(self.a(x)))
        return h[:, :4], h[:, 4:]  # (slices: autograd lets no one write the views chunk() makes)


def test_a_loss_that_writes_one_of_two_halves_of_one_tensor_trains_as_the_plain_model() -> None:
    def clamped(out: tuple[torch.Tensor, torch.Tensor], t: torch.Tensor) -> torch.Tensor:
        mean, logvar = out
        logvar.clamp_(-0.5, 0.5)  # apart from mean's elements: the plain model's mean is untouched
        return F.mse_loss(mean, t) + logvar.exp().mean()

    _one_step_as_the_plain_model(_Halves(), clamped)


class _Memory(nn.Module):
    """Returns a buffer as it is (`out, self.memory`), or one forward wrote (`written`), or a view of it."""

    def __init__(self, returns: str = "buffer") -> None:
        super().__init__()
        self.a, self.b, self.returns = nn.Linear(4, 4), nn.Linear(4, 4), returns
        self.memory: torch.Tensor
        self.register_buffer("memory", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.b(torch.tanh(self.a(x))) + self.memory
        if self.returns == "written":
            self.memory.add_(0.0)
        return out, self.memory[:2] if self.returns == "view" else self.memory


def test_writes_of_a_returned_buffer_that_a_pipeline_cannot_keep_as_the_plain_model_are_refused() -> None:
    x, t = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)

    def counts(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        out[1].add_(1.0)
        return F.mse_loss(out[0], y)

    def centres(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        out[1].mul_(0.9).add_(0.1 * out[0].detach().mean(0))  # a different value from each micro-batch
        return F.mse_loss(out[0], y)

    # a copy of what forward wrote, or of a view: the write would not reach the buffer
    for returns in ("written", "view"):  # (one micro-batch: with more, a buffer forward writes goes back per micro-batch, refused)
        pipe = compile_pipeline(_Memory(returns).double(), x, ["cpu"] * 2, chunks=1)
        with pytest.raises(StageError, match="an output that is, in the plain model, the caller.s memory: a buffer forward wrote, a view of a buffer"):
            pipe.train_step(x, target=t, loss_fn=counts)
    # each micro-batch writes its own value into the buffer every micro-batch gets whole
    model = _Memory().double()
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4)
    with pytest.raises(ValueError, match="the micro-batches wrote different values into it"):
        pipe.train_step(x, target=t, loss_fn=centres)
    assert torch.equal(model.memory, torch.zeros(4, dtype=torch.float64)) and all(p.grad is None for p in model.parameters())
    # the next batch's forward reads it before this batch's loss writes it
    pipe = compile_pipeline(_Memory().double(), x, ["cpu"] * 2, chunks=4, schedule="2bw")
    batches = [(x, t)] * 3
    with pytest.raises(StageError, match=r"in a loop whose steps overlap \(2bw\)(.|\n)*schedule='1f1b'"):
        list(pipe.train_steps(batches, loss_fn=counts, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.0)))


def test_a_loss_that_writes_a_returned_buffer_at_a_later_step_only_writes_it_once_as_the_plain_model() -> None:
    torch.manual_seed(0)
    model, plain = twin(_Memory())
    x, t = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4)
    step = [0]

    def later(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        if step[0] > 0:
            out[1].add_(1.0)
        return F.mse_loss(out[0], y)

    for step[0] in range(3):
        loss = pipe.train_step(x, target=t, loss_fn=later)
        expected = later(plain(x), t)
        expected.backward()
        assert torch.allclose(loss, expected, rtol=0, atol=1e-12)
        assert torch.equal(model.memory, plain.memory)
    assert_grads_equal(pipe, plain)


def test_an_input_computed_with_gradients_returned_as_it_is_and_read_by_the_loss_gets_the_plain_model_s_gradient() -> None:
    model, plain = twin(_ReturnsItsOwn("input"))
    x0 = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
    t = torch.randn(8, 4, dtype=torch.float64)

    def reads_it(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out[0] * out[1], y)

    pipe = compile_pipeline(model, x0.detach(), ["cpu"] * 2, chunks=4)
    loss = pipe.train_step(x0 * 2, target=t, loss_fn=reads_it)  # (x0 * 2 saves nothing for backward... )
    expected = reads_it(plain(x0 * 2), t)
    assert torch.allclose(loss, expected, rtol=0, atol=1e-12)
    mine = grad_of(x0).clone()
    x0.grad = None
    expected.backward()
    assert torch.allclose(mine, grad_of(x0), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, plain)
    x0.grad = None
    pipe.zero_grad()
    pipe.train_step(torch.tanh(x0), target=t, loss_fn=reads_it)  # (... tanh saves its output: one backward through it)
    assert x0.grad is not None


class _ReturnsCallersMemory(nn.Module):
    """Returns, beside its prediction, what is the caller's memory in the plain model."""

    def __init__(self, returns: str) -> None:
        super().__init__()
        self.a, self.returns = nn.Linear(4, 4), returns
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor, pack: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x) * self.scale
        chosen = {"item": pack["m"], "view": x[:, :2], "detached": x.detach(), "parameter": self.scale}[self.returns]
        return h, chosen


@pytest.mark.parametrize("returns, refusal", [
    ("item", "the caller's memory"), ("view", "the caller's memory"), ("detached", "the caller's memory"), ("parameter", "a leaf that requires grad"),
])  # fmt: skip
def test_a_loss_that_writes_what_is_the_caller_s_memory_in_the_plain_model_is_refused_and_leaves_it(returns: str, refusal: str) -> None:
    model = _ReturnsCallersMemory(returns).double()
    x, m, t = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    pipe = compile_pipeline(model, (x, {"m": m}), ["cpu"], chunks=4)
    before = (x.clone(), m.clone(), model.scale.detach().clone())

    def writes(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        out[1].clamp_(max=0.5)
        return F.mse_loss(out[0], y)

    with pytest.raises(StageError, match=refusal):
        pipe.train_step(x, {"m": m}, target=t, loss_fn=writes)
    assert torch.equal(x, before[0]) and torch.equal(m, before[1]) and torch.equal(model.scale, before[2])
    assert all(p.grad is None for p in model.parameters())


def test_a_returned_buffer_written_by_some_micro_batches_only_is_refused() -> None:
    x, t = torch.randn(8, 4, dtype=torch.float64), torch.zeros(8, 4, dtype=torch.float64)
    t[:4, 0] = -5.0  # the first two micro-batches hold a sample below -1: they write nothing

    def flags(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        if (y[:, 0] > -1).all():  # the plain model's whole batch holds one: it writes nothing
            out[1].fill_(1.0)
        return F.mse_loss(out[0], y)

    model = _Memory().double()
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4)
    with pytest.raises(ValueError, match="the micro-batches wrote different values into it"):
        pipe.train_step(x, target=t, loss_fn=flags)
    assert torch.equal(model.memory, torch.zeros(4, dtype=torch.float64))


def test_a_2bw_loop_whose_loss_writes_each_batch_s_own_returned_input_trains() -> None:
    def clamps(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out[0] * out[1].clamp_(-1.0, 1.0), y)

    model = _ReturnsItsOwn("input").double()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 4, dtype=torch.float64, generator=g), torch.randn(8, 4, dtype=torch.float64, generator=g)) for _ in range(3)]
    given = [x.clone() for x, _ in batches]
    pipe = compile_pipeline(model, batches[0][0], ["cpu"] * 2, chunks=4, schedule="2bw")
    losses = list(pipe.train_steps(batches, loss_fn=clamps, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.0)))
    assert len(losses) == 3
    assert all(torch.equal(x, g_.clamp(-1.0, 1.0)) for (x, _), g_ in zip(batches, given))  # each written once, as the plain loop's


class _NormedMemory(_Memory):
    """`_Memory`, with BatchNorm and dropout before its output: a refused step must leave both as found."""

    def __init__(self) -> None:
        super().__init__()
        self.bn, self.drop = nn.BatchNorm1d(4), nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, memory = super().forward(x)
        return self.drop(self.bn(out)), memory


def test_a_step_refused_at_its_writes_back_leaves_buffers_and_the_generator_as_found() -> None:
    def centres(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        out[1].copy_(out[0].detach().mean(0))  # a different value from each micro-batch
        return F.mse_loss(out[0], y)

    model = _NormedMemory().double()
    x, t = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4)
    state, generator = copy.deepcopy(model.state_dict()), torch.get_rng_state()
    with pytest.raises(ValueError, match="the micro-batches wrote different values into it"):
        pipe.train_step(x, target=t, loss_fn=centres)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), generator)


def test_target_writes_through_data_reach_the_caller_and_broadcast_targets_are_refused_as_the_plain_model() -> None:
    model, plain = twin(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)))
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4)

    def smooths(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        y.data.mul_(0.9).add_(0.05)  # (moves no version)
        return F.mse_loss(out, y)

    mine, theirs = torch.randn(8, 4, dtype=torch.float64), None
    theirs = mine.clone()
    loss = pipe.train_step(x, target=mine, loss_fn=smooths)
    assert torch.allclose(loss, smooths(plain(x), theirs), rtol=0, atol=1e-12) and torch.equal(mine, theirs)
    broadcast = torch.ones(1, 4, dtype=torch.float64).expand(8, 4)
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        F.mse_loss(plain(x), broadcast.mul_(0.5))
    with pytest.raises(ValueError, match=r"a broadcast view \(`t.expand\(...\)`\)"):
        pipe.train_step(x, target=broadcast, loss_fn=lambda out, y: F.mse_loss(out, y.mul_(0.5)))
    assert torch.equal(broadcast, torch.ones(8, 4, dtype=torch.float64))


def test_a_loss_module_that_writes_its_own_parameter_gets_autograd_s_error_as_the_plain_model() -> None:
    calls = [0]  # (kept outside the loss object: state it keeps would be refused first)

    class Tempered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.temp = nn.Parameter(torch.tensor(3.0, dtype=torch.float64))

        def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            if calls[0] > 10:  # from its second step on, when it is handed the outputs themselves
                self.temp.clamp_(max=2.0)
            return F.mse_loss(out / self.temp, y)

    x, t = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    pipe = compile_pipeline(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double(), x, ["cpu"] * 2, chunks=4)
    loss_fn = Tempered()
    pipe.train_step(x, target=t, loss_fn=loss_fn)  # (10 calls: the micro-batches', the checks')
    with pytest.raises(StageError, match="a leaf Variable that requires grad is being used in an in-place operation"):
        pipe.train_step(x, target=t, loss_fn=loss_fn)


@pytest.mark.parametrize("mode", ["eval", "no_grad", "autocast", "accumulated"])
def test_a_loss_that_writes_its_outputs_and_target_trains_as_the_plain_model_in_every_mode(mode: str) -> None:
    def writes(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        y.mul_(0.9).add_(0.05)
        return F.mse_loss(out.div_(2.0), y)

    torch.manual_seed(0)
    made = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 4))
    model, plain = (made, copy.deepcopy(made)) if mode == "autocast" else twin(made)
    dtype = next(model.parameters()).dtype
    x, t = torch.randn(8, 4, dtype=dtype), torch.randn(8, 4, dtype=dtype)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=1 if mode != "eval" else 4)  # (BatchNorm in training: one micro-batch)
    if mode == "eval":
        pipe.eval()
        plain.eval()
    context = torch.no_grad() if mode == "no_grad" else torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext()
    mine, theirs = t.clone(), t.clone()
    for _ in range(2 if mode == "accumulated" else 1):
        with context:
            loss = pipe.train_step(x, target=mine, loss_fn=writes)
            expected = writes(plain(x), theirs)
        if expected.requires_grad:
            expected.backward()
        tol = 1e-2 if mode == "autocast" else 1e-12
        assert torch.allclose(loss.float(), expected.detach().float(), rtol=tol, atol=tol)
        assert torch.equal(mine, theirs)  # written once per step, as the plain model's loss writes it
    for p, q in zip(model.parameters(), plain.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert torch.allclose(p.grad.float(), grad_of(q).float(), rtol=0.05 if mode == "autocast" else 0, atol=0.02 if mode == "autocast" else 1e-12)
    for got, want in zip(model.buffers(), plain.buffers()):
        assert torch.allclose(got.float(), want.float(), rtol=0, atol=1e-6 if mode == "autocast" else 1e-12)


def test_a_target_with_two_dims_of_the_batch_s_size_split_along_the_wrong_one_is_named() -> None:
    """A sequence-first model (time, batch, classes) trained on a batch-first target (batch, time)
    where time == batch: the target is split where the outputs hold their batch. Before, the
    refusal blamed the reduction alone; it names the target's dims, and the transposed target runs."""
    model, reference = twin(SeqFirst(classes=5))
    x, y = torch.randn(6, 6, 4, dtype=torch.float64), torch.randint(0, 5, (6, 6))
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2, chunk_spec={"x": 1})

    def batch_first(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.transpose(0, 1).reshape(-1, 5), t.reshape(-1))

    with pytest.raises(ValueError, match=r"(?s)is not a mean over samples.*The target's tensor of shape \(6, 6\) has several dims of the batch's size \(6\), and was split along dim 1"):
        pipe.train_step(x, target=y, loss_fn=batch_first)
    assert all(p.grad is None for p in model.parameters())
    loss = pipe.train_step(x, target=y.t(), loss_fn=lambda out, t: batch_first(out, t.t()))
    expected = batch_first(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)
