"""Models torch.fx cannot trace go through torch.export, and train with the plain model's gradients."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from conftest import assert_grads_equal, twin
from fxpipe import TraceError, compile_pipeline


class ShapeBranch(nn.Module):
    """Branches on an input's shape, makes a tensor on the input's device, ties two weights."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.emb = nn.Embedding(4, 32)
        self.head = nn.Linear(32, 4, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if x.shape[-1] > 16:
            h = h + torch.tanh(self.b(h))
        ramp = torch.arange(4, device=x.device, dtype=x.dtype)
        return self.c(h) * ramp + self.head(h)


class VarArgs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        x = args[0]
        return self.c(torch.relu(self.b(torch.relu(self.a(x))))) * kwargs.get("scale", 2.0)


class ValueBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.a(x)
        return x


@pytest.mark.parametrize("model_type,width", [(ShapeBranch, 32), (VarArgs, 8)])
@pytest.mark.parametrize("mode", ["always", "never"])
def test_export_fallback_trains_like_the_plain_model(model_type: type, width: int, mode: str) -> None:
    model, reference = twin(model_type())
    x = torch.randn(8, width, dtype=torch.float64)
    with pytest.warns(UserWarning, match=f"torch.fx could not trace {model_type.__name__} .*; used torch.export"):
        pipe = compile_pipeline(model, x, ["cpu"] * 3, chunks=4, checkpoint=mode)
    assert any("used torch.export" in note for note in pipe.plan.notes)
    assert list(pipe.state_dict()) == list(reference.state_dict())
    out, expected = pipe(x), reference(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    assert_grads_equal(pipe, reference)


def test_exported_ties_stay_tied() -> None:
    model = ShapeBranch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipeline(model, torch.randn(4, 32), ["cpu"] * 3, balance=None)
    assert model.head.weight is model.emb.weight
    assert sum(1 for _ in pipe.parameters()) == sum(1 for _ in model.parameters())


def test_exported_device_constants_follow_the_stage() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipeline(ShapeBranch(), torch.randn(4, 32), ["cpu"] * 2)
    devices = [n.kwargs["device"] for n in pipe.program().graph.graph.nodes if "device" in n.kwargs]
    assert devices and all(isinstance(d, torch.device) for d in devices)


def test_a_branch_on_values_defeats_both_tracers() -> None:
    with pytest.raises(TraceError) as info:
        compile_pipeline(ValueBranch(), torch.randn(4, 8), ["cpu"])
    message = str(info.value)
    assert "neither torch.fx nor torch.export can capture ValueBranch" in message
    assert "if x.sum() > 0:" in message and "test_frontends.py" in message
    assert "leaf_modules" in message and "torch.cond" in message


def test_exported_pipeline_refuses_a_call_shaped_unlike_the_example() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipeline(VarArgs(), torch.randn(4, 8), ["cpu"] * 2)
    with pytest.raises(TypeError, match="exported for arguments shaped like the example"):
        pipe(torch.randn(4, 8), scale=torch.ones(1))


def test_a_graph_module_from_any_tracer_is_accepted() -> None:
    model, reference = twin(VarArgs())
    x = torch.randn(6, 8, dtype=torch.float64)
    gm = torch.fx.symbolic_trace(nn.Sequential(model.a, nn.ReLU(), model.b))
    pipe = compile_pipeline(gm, x, ["cpu"] * 2, chunks=2)
    torch.testing.assert_close(pipe(x), reference.b(torch.relu(reference.a(x))), rtol=0, atol=1e-12)
    assert list(pipe.state_dict()) == list(gm.state_dict())
