"""`fxpipe.pipe_split()` marks in forward: a no-op in the plain model, stage boundaries in the plan."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fxpipe
from helpers import assert_grads_equal, twin
from fxpipe import PartitionError, compile_pipeline


class Marked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        fxpipe.pipe_split()
        h = torch.tanh(self.b(h)) + x
        h = torch.tanh(self.c(h))
        fxpipe.pipe_split()
        return self.d(h)


class MarkedThroughExport(Marked):
    def forward(self, *args: torch.Tensor) -> torch.Tensor:  # torch.fx cannot name *args
        return super().forward(args[0])


def test_marks_do_nothing_in_the_plain_model() -> None:
    model = Marked()
    x = torch.randn(3, 4)
    plain = model.d(torch.tanh(model.c(torch.tanh(model.b(torch.tanh(model.a(x)))) + x)))
    torch.testing.assert_close(model(x), plain)
    exported = torch.export.export(model, (x,)).module()
    torch.testing.assert_close(exported(x), plain)


@pytest.mark.parametrize("model_type", [Marked, MarkedThroughExport])
def test_marks_cut_the_plan(model_type: type) -> None:
    model, reference = twin(model_type())
    x = torch.randn(6, 4, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipeline(model, x, ["cpu"] * 3, chunks=3)
    scopes = [{m.split(".")[0] for m in stage.modules if m} for stage in pipe.plan.stages]
    assert scopes == [{"a"}, {"b", "c"}, {"d"}]
    out, expected = pipe(x), reference(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    out.sum().backward()
    expected.sum().backward()
    assert_grads_equal(pipe, reference)


def test_marks_combine_with_split_points() -> None:
    pipe = compile_pipeline(Marked(), torch.randn(4, 4), ["cpu"] * 4, split_points=["c"])
    scopes = [{m.split(".")[0] for m in stage.modules if m} for stage in pipe.plan.stages]
    assert scopes == [{"a"}, {"b"}, {"c"}, {"d"}]


def test_marks_that_contradict_the_devices_or_balance_are_refused() -> None:
    with pytest.raises(PartitionError, match=r"make 3 stages, but the pipeline has 2 \(devices times stages_per_device\)"):
        compile_pipeline(Marked(), torch.randn(4, 4), ["cpu"] * 2)
    with pytest.raises(PartitionError, match="pipe_split.*balance='time'"):
        compile_pipeline(Marked(), torch.randn(4, 4), ["cpu"] * 3, balance="time")


class MarkedTwiceInARow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        fxpipe.pipe_split()
        fxpipe.pipe_split()
        return self.b(h)


class MarkedAtTheEnd(MarkedTwiceInARow):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x)))
        fxpipe.pipe_split()
        return h


@pytest.mark.parametrize("model_type,stages,empty", [(MarkedTwiceInARow, 3, 1), (MarkedAtTheEnd, 2, 1)])
def test_marks_that_leave_a_stage_empty_are_refused(model_type: type, stages: int, empty: int) -> None:
    """As a mark at the start is. Before, the stage held the mark alone, and its device did nothing."""
    with pytest.raises(PartitionError, match=f"stage {empty} would be empty: two marks with nothing between them, or one at an end"):
        compile_pipeline(model_type(), torch.randn(4, 4), ["cpu"] * stages)
