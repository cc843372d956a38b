"""Graphs stay general in every dim the model allows: another sequence length runs exactly, and
a call whose shapes break what the graph assumed is refused before any stage runs."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import assert_grads_equal, example_module, twin
from fxpipe import Pipeline, compile_pipeline


def quietly(*args: object, **kwargs: object) -> Pipeline:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the note that torch.export took over from torch.fx
        return compile_pipeline(*args, **kwargs)  # type: ignore[arg-type]


class Attention(nn.Module):
    """Reads the sequence length from its input and reshapes by it; forward(*args) so that
    torch.export captures it, with every input dim marked dynamic."""

    def __init__(self, width: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        x = args[0]
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        y = (F.softmax(att, dim=-1) @ v).transpose(1, 2).reshape(b, t, c)
        return self.out(y)


class Looping(nn.Module):
    """A Python loop over a size: torch.export unrolls it for the example's length."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        total = h[:, 0]
        for i in range(h.shape[1] - 1):
            total = total + h[:, i + 1]
        return self.b(total)


@pytest.mark.parametrize("length", [5, 12, 20])
def test_exported_graph_runs_at_other_sequence_lengths(length: int) -> None:
    model, reference = twin(Attention())
    pipe = quietly(model, torch.randn(4, 12, 8, dtype=torch.float64), ["cpu"] * 3, chunks=2)
    assert "every other dim dynamic" in pipe.plan.summary() or "every dim dynamic" in pipe.plan.summary()
    x = torch.randn(6, length, 8, dtype=torch.float64)
    out, expected = pipe(x), reference(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    out.sum().backward()
    expected.sum().backward()
    assert_grads_equal(pipe, reference)


def test_a_size_the_graph_fixed_is_refused_before_running() -> None:
    model = Looping().double()
    pipe = quietly(model, torch.randn(4, 12, 4, dtype=torch.float64), ["cpu"] * 2, chunks=2)
    assert "x dim 1 = 12" in pipe.plan.summary()  # named by the forward's argument
    x = torch.randn(4, 12, 4, dtype=torch.float64)
    torch.testing.assert_close(pipe(x), model(x), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"  - x \(tensor of shape \(4, 20, 4\)\): dim 1 is 20, the graph was made for 12"):
        pipe(torch.randn(4, 20, 4, dtype=torch.float64))


def test_fx_graphs_read_sizes_from_their_inputs() -> None:
    gpt = example_module("gpt")
    model, reference = twin(gpt.make_model(n_layer=2, n_embd=16))
    pipe = compile_pipeline(model, gpt.make_batch(4, seq_len=8)[0], ["cpu"] * 3, chunks=2)
    assert "every dim dynamic (torch.fx)" in pipe.plan.summary()
    for length in (3, 16, 31):
        x, _ = gpt.make_batch(6, seq_len=length)
        torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-12)


class BranchesOnTheBatch(nn.Module):
    """A fast path for large batches: torch.export guards the graph with the batch size, which
    splitting the batch changes."""

    def __init__(self, factor: float = 2.0) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if x.shape[0] > 4:
            h = h * self.factor
        return self.b(h)


class NormedThenBranches(BranchesOnTheBatch):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.norm(x))


def test_a_micro_batch_the_model_itself_refuses_is_named_so_not_as_a_branch() -> None:
    """A micro-batch of one sample fails torch.export's guard, and BatchNorm itself refuses it:
    before, the refusal blamed a branch on the batch size and advised torch.where."""
    with pytest.raises(ValueError, match=r"(?s)NormedThenBranches does not run on micro-batch 0 of the example \(1 of its 8 samples\): ValueError: Expected more than 1 value per channel.*How to fix: fewer chunks"):
        quietly(NormedThenBranches().double(), torch.randn(8, 6, dtype=torch.float64), ["cpu"] * 2, chunks=8)


def test_a_branch_on_the_batch_size_is_checked_for_each_micro_batch() -> None:
    """Before, the stages ran micro-batches of 4 down the branch of the whole batch of 8."""
    with pytest.raises(ValueError, match=r"(?s)a micro-batch differs: Guard failed: x.size\(\)\[0\] >= 5.*  - x: shape \(4, 6\).*How to fix"):
        quietly(BranchesOnTheBatch().double(), torch.randn(8, 6, dtype=torch.float64), ["cpu"] * 2, chunks=2)
    model, reference = twin(BranchesOnTheBatch())
    pipe = quietly(model, torch.randn(16, 6, dtype=torch.float64), ["cpu"] * 2, chunks=2)  # micro-batches of 8
    x = torch.randn(12, 6, dtype=torch.float64)
    torch.testing.assert_close(pipe(x), torch.cat([reference(half) for half in x.chunk(2)]), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="a micro-batch differs"):
        pipe(torch.randn(8, 6, dtype=torch.float64))  # the call passes the guard, its micro-batches of 4 do not


class BranchesInOneMode(BranchesOnTheBatch):
    """The fast path in one mode only: the other mode's graph has no guard on the batch."""

    def __init__(self, in_training: bool) -> None:
        super().__init__()
        self.in_training = in_training

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.training == self.in_training and x.shape[0] > 4:
            h = h * self.factor
        return self.b(h)


@pytest.mark.parametrize("in_training", [False, True], ids=["eval-branch", "training-branch"])
def test_the_guards_of_the_graph_of_the_mode_the_call_runs_in_are_checked(in_training: bool) -> None:
    """Before, only the training graph's guards were checked: an eval call at batch 4 ran the
    eval graph's branch for batches over 4 (0.95 off the plain model), and a branch taken in
    training alone refused eval calls the eval graph computes."""
    model, reference = twin(BranchesInOneMode(in_training))
    pipe = quietly(model, torch.randn(16, 6, dtype=torch.float64), ["cpu"] * 2, chunks=2)
    pipe.eval(), reference.eval()
    for batch in (4, 8):
        x = torch.randn(batch, 6, dtype=torch.float64)
        if in_training:  # eval's graph has no branch: every batch runs
            torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-12)
        else:
            with pytest.raises(ValueError, match="made the graph for calls like the example, and (this call|a micro-batch) differs"):
                pipe(x)


def test_a_guard_that_fails_on_a_micro_batch_refuses_only_what_computes_otherwise() -> None:
    """A guard on the batch size whose branches compute alike (as torch.export's guards on a
    size of 1 do, in SimpleViT): not refused."""
    model, reference = twin(BranchesOnTheBatch(factor=1.0))
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = quietly(model, x, ["cpu"] * 2, chunks=2)  # micro-batches of 4 fail the guard, and run alike
    for batch in (8, 6):  # the model is run beside the graph once per new micro-batch shape
        torch.testing.assert_close(pipe(x[:batch]), torch.cat([reference(h) for h in x[:batch].chunk(2)]), rtol=0, atol=1e-12)
