"""Outputs and every gradient equal the plain model's, for every stage count, chunk count and mode."""
from __future__ import annotations

import itertools
from typing import Any, Callable

import pytest
import torch

from conftest import FanOut, assert_grads_equal, example_module, twin
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


@pytest.mark.parametrize("stages,chunks,mode", list(itertools.product([1, 2, 3, 4], [1, 3, 4, 8], MODES)))
@pytest.mark.parametrize("name", list(MODELS))
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
