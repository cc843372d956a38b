"""A model built on the meta device compiles on shapes alone; each stage is made on its device and
initialised by its modules, or loaded from the plain model's state."""
from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from fxpipe import Pipeline, compile_pipeline
from fxpipe.compiled.materialize import release_for_swap
from helpers import FanOut, Positions, assert_grads_equal, example_module


def test_a_model_on_the_meta_device_is_made_on_its_stage_devices_and_initialised() -> None:
    with torch.device("meta"):
        model = FanOut().double()
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    tensors = [*pipe.parameters(), *pipe.buffers()]
    assert tensors and all(t.device.type == "cpu" and bool(torch.isfinite(t).all()) for t in tensors)
    assert len({float(p.detach().std()) for p in pipe.parameters() if p.dim() == 2}) > 1, "reset_parameters() ran per module"
    assert torch.isfinite(pipe(x)).all()


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_loaded_with_the_plain_models_state_it_computes_what_the_plain_model_does(schedule: str) -> None:
    gpt = example_module("gpt")
    reference = gpt.make_model(n_layer=2, n_embd=16).double()
    with torch.device("meta"):
        model = gpt.make_model(n_layer=2, n_embd=16).double()
    x, y = gpt.make_batch(6)
    pipe = compile_pipeline(model, x, ["cpu"] * 3, chunks=3, schedule=schedule)
    _trains_as_loaded(pipe, reference, x, y, gpt.loss_fn, atol=1e-10)


def _trains_as_loaded(pipe: Pipeline, reference: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Any, atol: float) -> None:
    """Loaded with the plain model's state, a step gives its loss and gradients."""
    pipe.load_state_dict(reference.state_dict())
    loss = pipe.train_step(x, target=y, loss_fn=loss_fn)
    expected = loss_fn(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=atol)
    assert_grads_equal(pipe, reference)


class Scaled(nn.Module):
    """A buffer no reset_parameters() initialises."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_what_no_module_initialises_is_nan_and_named() -> None:
    with torch.device("meta"):
        model = Scaled()
    with pytest.warns(UserWarning, match="no reset_parameters\\(\\) initialises scale.*Load a checkpoint"):
        pipe = compile_pipeline(model, torch.randn(4, 4), ["cpu"])
    state = pipe.state_dict()
    assert torch.isnan(state["scale"]).all() and torch.isfinite(state["lin.weight"]).all()
    pipe.load_state_dict(Scaled().state_dict())
    assert torch.equal(pipe.state_dict()["scale"], torch.ones(4))


class _GainedLinear(nn.Linear):
    """A Linear with a scale of its own, which Linear's reset_parameters() leaves alone."""

    def __init__(self, width: int) -> None:
        super().__init__(width, width)
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.gain


def test_a_parameter_its_modules_reset_leaves_alone_is_nan_and_named() -> None:
    """Before, every tensor of a module with reset_parameters() counted as set: the gain kept
    whatever memory torch.empty gave it (6.9e-310, 0, ...), with no warning."""
    with torch.device("meta"):
        model = nn.Sequential(_GainedLinear(4), nn.Tanh(), _GainedLinear(4))
    with pytest.warns(UserWarning, match=r"no reset_parameters\(\) initialises 0\.gain, 2\.gain: they hold NaN"):
        pipe = compile_pipeline(model, torch.randn(4, 4), ["cpu", "cpu"])
    state = pipe.state_dict()
    assert torch.isnan(state["0.gain"]).all() and torch.isfinite(state["0.weight"]).all() and torch.isfinite(state["2.bias"]).all()


def test_balance_by_time_cannot_time_a_model_on_the_meta_device() -> None:
    with torch.device("meta"):
        model = FanOut()
    with pytest.raises(ValueError, match="meta device cannot run: pass balance='flops'"):
        compile_pipeline(model, torch.randn(4, 6), ["cpu", "cpu"], balance="time")


def test_training_a_loaded_meta_model_matches_the_plain_model_step_by_step() -> None:
    torch.manual_seed(1)
    reference = FanOut().double()
    with torch.device("meta"):
        model = FanOut().double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, schedule="1f1b")
    pipe.load_state_dict(reference.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (pipe, reference)]
    for _ in range(2):
        for opt in opts:
            opt.zero_grad()
        pipe.train_step(x, target=y, loss_fn=F.mse_loss)
        F.mse_loss(reference(x), y).backward()
        for opt in opts:
            opt.step()
    torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-10)


class _TakesKwargs(nn.Module):
    """Its forward takes **kwargs: torch.export captures it (which leaves weak references to the
    parameters, in its fake tensors' memos)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def test_a_model_captured_by_torch_export_is_made_from_the_meta_device_too() -> None:
    reference = _TakesKwargs().double()
    with torch.device("meta"):
        model = _TakesKwargs().double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    with pytest.warns(UserWarning, match="used torch.export"):
        pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    _trains_as_loaded(pipe, reference, x, y, F.mse_loss, atol=1e-12)


def test_a_buffer_no_checkpoint_holds_is_refused_on_the_meta_device() -> None:
    """A position table left out of the state dict: a checkpoint cannot fill it, and filled with
    0 (an integer one) it would train another model without a word."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(6, 6), Positions(), nn.Linear(6, 6)).double()
    with pytest.raises(ValueError, match=r"(?s)buffers that nothing can fill \(on this rank: 1\.table\).*build the model on the CPU"):
        compile_pipeline(model, torch.randn(4, 6, dtype=torch.float64), ["cpu", "cpu"], chunks=2)
    model = nn.Sequential(nn.Linear(6, 6), Positions(), nn.Linear(6, 6)).double()  # on the CPU it runs
    x = torch.randn(4, 6, dtype=torch.float64)
    torch.testing.assert_close(compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)(x), model(x), rtol=0, atol=1e-12)


def test_a_dead_weak_proxy_among_the_live_objects_does_not_stop_the_swap() -> None:
    """Before the swap, a pass over the live objects drops torch.export's weak references to the
    tensors: a weakref.proxy whose object died is among them at times, and asking its class raises."""
    class Held:
        pass

    held = Held()
    proxies = [weakref.proxy(held)]
    del held  # the proxy stays, and is dead
    tensor = torch.zeros(2)
    memo = WeakIdKeyDictionary()
    memo[tensor] = 1
    release_for_swap([tensor])
    assert len(memo) == 0 and len(proxies) == 1
