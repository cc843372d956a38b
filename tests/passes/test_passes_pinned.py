"""Pass-level tests that pin down what a plausible one-line bug would break: micro-batch sizes,
where parameters and buffers are placed, and an in-place write through a view of a stage input."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn

import fxpipe.compiler.placement

from helpers import assert_grads_equal, twin
from fxpipe import compile_pipeline
from fxpipe.compiler.placement import place_state
from fxpipe.core.microbatch import scatter, split_sizes
from fxpipe.passes.linearize import linearize
from fxpipe.tracing.trace import trace

MODES = ("always", "except_last", "never")
PAIRS = [(6, 4), (9, 4), (5, 8), (1, 3), (10, 4), (8, 3), (7, 7)]


# -- micro-batches ----------------------------------------------------------------------------------
@pytest.mark.parametrize("batch,chunks", PAIRS)
def test_split_sizes_are_tensor_splits(batch: int, chunks: int) -> None:
    # torch.chunk makes [2, 2, 2] for 6 / 4 and [3, 3, 3] for 9 / 4: other sizes, other counts.
    expected = [len(piece) for piece in torch.tensor_split(torch.arange(batch), chunks) if len(piece)]
    assert split_sizes(batch, chunks) == expected


@pytest.mark.parametrize("batch,chunks", PAIRS)
def test_scatter_splits_batched_tensors_like_tensor_split(batch: int, chunks: int) -> None:
    x, whole = torch.randn(batch, 3), torch.randn(2, 5)
    pieces = scatter((x, whole), split_sizes(batch, chunks), batch)
    expected = [p for p in torch.tensor_split(x, chunks) if len(p)]
    assert len(pieces) == len(expected)
    for (got, kept), want in zip(pieces, expected):
        assert torch.equal(got, want)
        assert kept is whole  # not batched: every micro-batch gets the tensor itself


# -- placement ---------------------------------------------------------------------------------------
class TwoParts(nn.Module):
    """`first` and `scale` are read by stage 0; `second` and `shift` only by stage 1."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))
        self.register_buffer("shift", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x) * self.scale)
        return self.second(h) + self.shift


def test_place_state_puts_each_tensor_on_its_first_readers_device(monkeypatch: pytest.MonkeyPatch) -> None:
    model = TwoParts()  # a throwaway: its second half's buffers end on the meta device
    gm = trace(model)
    order = linearize(gm)
    cut = next(i for i, node in enumerate(order) if node.target == "second")
    placed: dict[str, str] = {}
    place = fxpipe.compiler.placement._place

    def record(owner: nn.Module, graph: fx.GraphModule, name: str, tensor: torch.Tensor, device: torch.device) -> None:
        placed[name] = device.type
        if not isinstance(tensor, nn.Parameter):  # a Parameter's data cannot be set to a meta tensor
            place(owner, graph, name, tensor, device)

    monkeypatch.setattr(fxpipe.compiler.placement, "_place", record)
    place_state(model, gm, [order[:cut], order[cut:]], [torch.device("cpu"), torch.device("meta")])
    assert placed == {
        "first.weight": "cpu", "first.bias": "cpu", "second.weight": "meta", "second.bias": "meta",
        "scale": "cpu", "shift": "meta",
    }  # fmt: skip
    assert model.scale.device.type == "cpu" and model.shift.device.type == "meta"


# -- an in-place write through a view of a received value ------------------------------------------
class Halve(nn.Module):
    def forward(self, h: torch.Tensor) -> None:
        h[:, 1:3].mul_(0.5)


class WriteOnReceived(nn.Module):
    """Stage 1 receives `h`, halves part of it through a view, and reads it; stage 2 reads it too."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.l2 = (nn.Linear(4, 4) for _ in range(3))
        self.halve = Halve()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l0(x) * 3.0
        self.halve(h)
        return self.l2(torch.tanh(self.l1(h))) + h


@pytest.mark.parametrize("mode", MODES)
def test_write_through_view_of_stage_input(mode: str) -> None:
    model, reference = twin(WriteOnReceived())
    x = torch.randn(6, 4, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 3, chunks=3, checkpoint=mode, split_points=["halve", "l2"])
    assert pipe.program().stages[1].inputs == ["mul"]  # h is a received value there
    out, expected = pipe(x), reference(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    assert_grads_equal(pipe, reference)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-10)
