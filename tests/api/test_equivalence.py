"""Outputs and every gradient equal the plain model's, for every stage count, chunk count and mode."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from helpers import FanOut, WindowBlock, WindowGrid, assert_grads_equal, covering, example_module, twin
from fxpipe import compile_pipeline

MODES = ("always", "except_last", "never")


def _unet() -> tuple[Any, torch.Tensor, Callable[..., torch.Tensor]]:
    m = example_module("unet")
    x, y = m.make_batch(8, dtype=torch.float64)
    return m.make_model(base=4), x, lambda out: m.loss_fn(out, y)


def _resnet() -> tuple[Any, torch.Tensor, Callable[..., torch.Tensor]]:
    m = example_module("resnet")
    x, y = m.make_batch(8, dtype=torch.float64)
    return m.make_model(), x, lambda out: m.loss_fn(out, y)


def _gpt() -> tuple[Any, torch.Tensor, Callable[..., torch.Tensor]]:
    m = example_module("gpt")
    x, y = m.make_batch(8)
    return m.make_model(n_layer=3, n_embd=32), x, lambda out: m.loss_fn(out, y)


def _fan_out() -> tuple[Any, torch.Tensor, Callable[..., torch.Tensor]]:
    x = torch.randn(8, 6, dtype=torch.float64)
    return FanOut(), x, lambda out: out.pow(2).mean()


MODELS = {"unet": _unet, "resnet": _resnet, "gpt": _gpt, "fan_out": _fan_out}


# Each model runs every stage count with every chunk count, and every mode with each of them;
# the models together run every (stages, chunks, mode) (helpers.covering). Chunks 3 split the 8
# samples unevenly (3, 3, 2), 8 into one sample each; an even split of several samples each is
# the property test's (tests/api/test_property.py), over random graphs.
GRID = covering(list(MODELS), [(1, 2, 3, 4), (1, 3, 8)], MODES)


@pytest.mark.parametrize("name,stages,chunks,mode", GRID)
def test_outputs_and_gradients_equal_plain_model(name: str, stages: int, chunks: int, mode: str) -> None:
    model, x, loss_fn = MODELS[name]()
    model, reference = twin(model)
    pipe = compile_pipeline(model, x, ["cpu"] * stages, chunks=chunks, checkpoint=mode)
    out = pipe(x)
    expected = reference(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
    loss_fn(out).backward()
    loss_fn(expected).backward()
    assert_grads_equal(pipe, reference)


@pytest.mark.parametrize("mode", MODES)
def test_input_gradient_through_fan_out(mode: str) -> None:
    model, reference = twin(FanOut())
    x = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    pipe = compile_pipeline(model, x, ["cpu"] * 4, chunks=3, checkpoint=mode)
    pipe(x).sum().backward()
    reference(x_ref).sum().backward()
    assert {e.value for e in pipe.plan.skip_edges}, "the fan-out model should have skip edges at 4 stages"
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-10)
    assert_grads_equal(pipe, reference)


def test_gradients_accumulate_over_steps_like_the_plain_model() -> None:
    model, reference = twin(example_module("gpt").make_model(n_layer=2, n_embd=16))
    x, y = example_module("gpt").make_batch(6)
    pipe = compile_pipeline(model, x, ["cpu"] * 3, chunks=2)
    for _ in range(2):
        pipe(x).sum().backward()
        reference(x).sum().backward()
    assert_grads_equal(pipe, reference)


def _per_sample(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The plain model on one sample at a time, as one-sample micro-batches run it (BatchNorm
    in training mode normalises each micro-batch by its own statistics)."""
    return torch.cat([model(x[i : i + 1]) for i in range(len(x))])


@pytest.mark.parametrize("call", ["backward", "autograd.grad", "two forwards"])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("mode", MODES)
def test_a_stage_gets_its_gradients_in_the_plain_models_layout(mode: str, training: bool, call: str) -> None:
    """A stage's input gradient goes back as autograd made it, not as the input's `.grad` stores
    it: with the stored layout, one-sample micro-batches of a BatchNorm before a window partition
    trained 2 to 6 off the plain model (a torch CPU kernel wrong on that layout)."""
    model, reference = twin(WindowBlock())
    model.train(training), reference.train(training)
    x = torch.randn(4, 3, 2, 2, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    pipe = compile_pipeline(model, x.detach(), ["cpu"] * 2, chunks=4, checkpoint=mode, split_points=["grid"])
    assert [e.value for e in pipe.plan.edges if e.kind == "activation"] == ["add"]
    out = torch.cat([pipe(x[:2]), pipe(x[2:])]) if call == "two forwards" else pipe(x)  # one backward for both
    expected = _per_sample(reference, x_ref)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
    params, ref_params = list(pipe.parameters()), list(reference.parameters())
    if call != "autograd.grad":
        out.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        assert_grads_equal(pipe, reference)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-10)
    else:
        got = torch.autograd.grad(out.pow(2).sum(), [x, *params])
        want = torch.autograd.grad(expected.pow(2).sum(), [x_ref, *ref_params])
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    for a, b in zip(pipe.buffers(), reference.buffers()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def _windows_loss(z: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (WindowGrid()(z) - target).pow(2).mean()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_a_train_step_sends_the_losss_gradients_in_the_plain_models_layout(schedule: str) -> None:
    """The loss's gradient of each output goes to the last stage as autograd made it: here the
    loss's permute makes a layout that the output's `.grad` would not keep."""
    model, reference = twin(WindowBlock(grid=False))
    x, target = torch.randn(4, 3, 2, 2, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4, split_points=["conv"], schedule=schedule)
    loss = pipe.train_step(x, target=target, loss_fn=_windows_loss)
    expected = torch.stack([_windows_loss(reference(x[i : i + 1]), target[i : i + 1]) for i in range(4)]).mean()
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-10)
    assert_grads_equal(pipe, reference)
