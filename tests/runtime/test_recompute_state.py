"""A recompute computes what its forward computed: with the module flags and rates the forward
ran under, and from the inputs it read, or the call refuses, naming what changed."""
from __future__ import annotations

import copy
import threading
import time
import warnings
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import X, TiedUnderReentrant, assert_grads_equal, grad_of
from fxpipe import StageError, TraceError, compile_pipeline
from fxpipe.runtime.checkpoint import flags_kept, flags_of

CHECKPOINTED = ("always", "except_last")
MODES = ("always", "except_last", "never")


class NormAndDrop(nn.Module):
    """A BatchNorm and a dropout: what each computes depends on its flags and rate."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.drop, self.b = nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Dropout(0.3), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.tanh(self.norm(self.a(x)))))


CHANGES: dict[str, Callable[[nn.Module, nn.Module], object]] = {
    "pipe.eval()": lambda pipe, model: pipe.eval(),
    "model.eval()": lambda pipe, model: model.eval(),
    "one BatchNorm's eval()": lambda pipe, model: model.get_submodule("norm").eval(),
    "a dropout's rate raised": lambda pipe, model: setattr(model.get_submodule("drop"), "p", 0.9),
}


def _grads_after(mode: str, change: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = NormAndDrop().double()
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, checkpoint=mode, split_points=["drop"])
    torch.manual_seed(1)
    out = pipe(x)
    CHANGES[change](pipe, model)
    out.square().mean().backward()
    return out.detach(), [grad_of(p).clone() for p in pipe.parameters()]


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("mode", CHECKPOINTED)
def test_a_mode_or_rate_changed_before_backward_leaves_the_recompute_as_its_forward(mode: str, change: str) -> None:
    """Before, the recompute ran in the mode of the moment: eval-mode BatchNorm (a gradient 58 off
    at a scale of 58) or the new rate (15-32 off); 'never', which recomputes nothing, was exact."""
    out, grads = _grads_after("never", change)
    other, other_grads = _grads_after(mode, change)
    assert torch.equal(out, other)
    for got, expected in zip(other_grads, grads):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-14)


def test_the_flags_are_put_back_after_the_recompute() -> None:
    torch.manual_seed(0)
    model = NormAndDrop().double()
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, checkpoint="always", split_points=["drop"])
    out = pipe(x)
    model.eval()
    model.drop.p = 0.9
    out.sum().backward()
    assert not any(m.training for m in model.modules()) and model.drop.p == 0.9


def test_recomputes_on_two_workers_share_a_module_s_flags_until_both_end() -> None:
    """A module called in two stages is one object, whose flags both stages' recomputes set at
    once. Before, the second found the flags the first had set, kept nothing, and the first put
    the caller's eval mode back while the second still ran: 2 to 26 steps in 300 recomputed a
    dropout in eval mode (gradients 2.8 off), and a rate changed the same way."""
    drop = nn.Dropout(0.5)
    drop.eval()
    drop.p = 0.1  # the caller's, after the forward
    forward_flags = flags_of([nn.Dropout(0.5)])  # training, at 0.5
    first_in, second_in, first_out, other_in = (threading.Event() for _ in range(4))
    seen: dict[str, object] = {}

    def first() -> None:
        with flags_kept([drop], forward_flags):
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second() -> None:
        first_in.wait(5)
        with flags_kept([drop], forward_flags):
            second_in.set()
            first_out.wait(5)
            seen["second, after the first ended"] = (drop.training, drop.p)
            time.sleep(0.1)
            seen["other entered meanwhile"] = other_in.is_set()

    def other() -> None:  # a recompute of a forward that ran in eval mode: waits for the others
        first_out.wait(5)
        with flags_kept([drop], [(False, 0.5)]):
            other_in.set()
            seen["other"] = (drop.training, drop.p)

    threads = [threading.Thread(target=f) for f in (first, second, other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"second, after the first ended": (True, 0.5), "other entered meanwhile": False, "other": (False, 0.5)}
    assert (drop.training, drop.p) == (False, 0.1)


@pytest.mark.parametrize("mode", ["never", *CHECKPOINTED])
def test_an_input_written_between_forward_and_backward_is_refused(mode: str) -> None:
    """A reused input buffer written before the backward: the plain model refuses it (its Linear
    saved the input); before, a checkpointed pipeline recomputed from the new values, silently
    (0.14-0.37 off). The refusal names the input, in every mode, with no hint that speaks of
    something else (before, 'never' and 'except_last' blamed a write of a parameter in forward)."""
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(copy.deepcopy(model), x, ["cpu", "cpu"], chunks=4, checkpoint=mode)
    plain_x = x.clone()
    plain_out = model(plain_x)
    plain_x.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        plain_out.sum().backward()
    out = pipe(x)
    x.add_(1)
    # 'always' recomputes the last micro-batch first; under 'except_last' the last one's own
    # graph saved its rows, and autograd raises, as the plain model's does.
    why = "a checkpointed stage would recompute" if mode == "always" else "autograd saved it: the plain model's backward fails alike"
    with pytest.raises(StageError, match=f"modified by an inplace operation: the pipeline's input 'input_1' was written in place.*{why}") as refused:
        out.sum().backward()
    assert "writes a parameter or a buffer" not in str(refused.value)


class Shifted(nn.Module):
    """Reads a buffer it never writes: added (autograd saves nothing of it) or multiplied (saved)."""

    s: torch.Tensor

    def __init__(self, saved: bool) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.register_buffer("s", torch.full((6,), 0.5))
        self.saved = saved

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) * self.s if self.saved else self.a(x) + self.s
        return self.c(torch.tanh(self.b(torch.tanh(h))))


@pytest.mark.parametrize("how", ["load_state_dict", "fill_"])
@pytest.mark.parametrize("saved", [False, True], ids=["added", "saved"])
@pytest.mark.parametrize("mode", MODES)
def test_a_buffer_the_model_only_reads_written_between_forward_and_backward(mode: str, saved: bool, how: str) -> None:
    """The plain model's backward reads what its forward saw, or raises where autograd saved the
    buffer. Before, a checkpointed stage recomputed with the new value: 0.51-0.64 off, silently
    (and ran on where the plain model raises). Now it is refused as a parameter written so is;
    'never' keeps what its forward saw, and is exact."""
    torch.manual_seed(0)
    model, x = Shifted(saved).double(), torch.randn(8, 6, dtype=torch.float64)
    plain = copy.deepcopy(model)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, checkpoint=mode)
    out, expected = pipe(x), plain(x)
    for net in (pipe, plain):
        if how == "fill_":
            net.get_buffer("s").fill_(1.0)
        else:
            net.load_state_dict({"s": torch.ones(6, dtype=torch.float64)}, strict=False)
    if saved:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            expected.sum().backward()
    else:
        expected.sum().backward()
    if mode == "never" or (saved and mode == "except_last"):  # the last micro-batch's own graph saved it
        if saved:
            with pytest.raises(StageError, match="modified by an inplace operation"):
                out.sum().backward()
            return
        out.sum().backward()
        assert_grads_equal(pipe, plain, tol=1e-12)
        return
    with pytest.raises(StageError, match="the buffer\\(s\\) s of this stage, which the model's forward only reads, were written in place"):
        out.sum().backward()
    pipe.zero_grad()
    pipe(x).sum().backward()  # the next call runs with the new value
    plain.zero_grad()
    plain(x).sum().backward()
    assert_grads_equal(pipe, plain, tol=1e-12)


def test_two_forwards_into_one_buffer_before_one_backward_are_refused() -> None:
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    buffer = torch.empty(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, buffer, ["cpu", "cpu"], chunks=4, checkpoint="always")
    buffer.copy_(torch.randn(8, 6))
    first = pipe(buffer)
    buffer.copy_(torch.randn(8, 6))
    second = pipe(buffer)
    second.sum().backward()  # the last forward's inputs are as it read them
    with pytest.raises(StageError, match="modified by an inplace operation"):
        first.sum().backward()


class WritesItsInputLater(nn.Module):
    """Reads its input in the first stage (through an op that saves nothing of it, so that the
    plain model may write it afterwards) and writes it in place in the second."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x + 1)))
        x.mul_(2)
        return h * x


@pytest.mark.parametrize("how", ["pipe(x)", "1f1b", "zb-h1"])
@pytest.mark.parametrize("mode", MODES)
def test_an_input_a_later_stage_writes_is_read_by_the_recompute_as_the_forward_read_it(mode: str, how: str) -> None:
    """Before, the first stage's recompute read the input after the second stage wrote it (1.7-1.8
    off; train_step 0.03-0.05 off)."""
    torch.manual_seed(0)
    model = WritesItsInputLater().double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    schedule = how if how != "pipe(x)" else "gpipe"
    pipe = compile_pipeline(model, x.clone(), ["cpu", "cpu"], chunks=4, checkpoint=mode, split_points=["b"], schedule=schedule)
    mine, theirs = x.clone(), x.clone()
    if how == "pipe(x)":
        pipe(mine).square().mean().backward()
    else:
        pipe.train_step(mine, target=y, loss_fn=F.mse_loss)
    expected = reference(theirs)
    (expected.square().mean() if how == "pipe(x)" else F.mse_loss(expected, y)).backward()
    assert torch.equal(mine, theirs), "the caller's input written as the plain model writes it"
    assert_grads_equal(pipe, reference, tol=1e-12)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class ReentrantOnAValueWithoutGrad(nn.Module):
    """torch.utils.checkpoint(use_reentrant=True) in the second stage on a value computed from
    the input alone: its output requires no grad, and the plain model gives its block none."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.block = nn.Linear(6, 6), nn.Linear(6, 6), Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        z = torch.tanh(x) * 2
        h = self.b(h)
        return h + torch.utils.checkpoint.checkpoint(self.block, z, use_reentrant=True)


@pytest.mark.parametrize("mode", MODES)
def test_a_reentrant_checkpoint_on_a_value_without_grad_gives_its_block_none(mode: str) -> None:
    """Before, a checkpointed stage sent every floating-point output as requiring grad: the block
    behind the reentrant checkpoint got a gradient the plain model never gives it."""
    torch.manual_seed(0)
    model = ReentrantOnAValueWithoutGrad().double()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2, checkpoint=mode, split_points=["b"])
    pipe(x).square().mean().backward()
    reference(x).square().mean().backward()
    assert reference.block.lin.weight.grad is None and model.block.lin.weight.grad is None
    for name, param in reference.named_parameters():
        if not name.startswith("block."):
            torch.testing.assert_close(grad_of(pipe.get_parameter(name)), grad_of(param), rtol=0, atol=1e-12)


class KeptWhole(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=True)


class ReentrantBlocks(nn.Module):
    """Its middle under the model's own reentrant torch.utils.checkpoint, called from its forward or
    from a block kept whole."""

    def __init__(self, whole: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.block: nn.Module = KeptWhole() if whole else Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = self.block(h) if isinstance(self.block, KeptWhole) else torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=True)
        return self.b(h)


@pytest.mark.parametrize("whole", [False, True], ids=["traced", "kept whole"])
@pytest.mark.parametrize("mode", MODES)
def test_a_weight_inside_the_model_s_own_reentrant_checkpoint_gets_its_gradient_once_and_only_when_asked(mode: str, whole: bool) -> None:
    """Before, its backward ran autograd on the model's own weights after the step's forward had
    ended: a hook on one fired once per micro-batch and once more with None, and
    backward(inputs=[a.weight]) filled the block's `.grad` too."""
    torch.manual_seed(0)
    model = ReentrantBlocks(whole).double()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, checkpoint=mode, split_points=["b"], leaf_modules=[KeptWhole] if whole else [])
    heard: dict[str, list[torch.Tensor]] = {"pipe": [], "plain": []}
    for who, net in (("pipe", model), ("plain", reference)):
        weight = net.get_parameter("block.block.lin.weight" if whole else "block.lin.weight")
        weight.register_hook(lambda g, who=who: heard[who].append(g))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own, on the no_grad example runs
        pipe(x).square().mean().backward(inputs=[model.a.weight])
    assert heard["pipe"] == [] and all(p.grad is None for name, p in model.named_parameters() if name != "a.weight")
    asked = grad_of(model.a.weight)
    model.zero_grad(set_to_none=True)
    pipe(x).square().mean().backward()
    reference(x).square().mean().backward()  # the plain model refuses inputs= here: torch's limit
    torch.testing.assert_close(asked, grad_of(reference.a.weight), rtol=0, atol=1e-12)
    assert len(heard["pipe"]) == 1 and len(heard["plain"]) == 1
    torch.testing.assert_close(heard["pipe"][0], heard["plain"][0], rtol=0, atol=1e-12)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grad_of(pipe.get_parameter(name)), grad_of(param), rtol=0, atol=1e-12)


@pytest.mark.parametrize("how", ["two forwards", "autograd.grad", "train_step", "no_grad", "autocast", "after a failed step"])
def test_the_model_s_own_reentrant_checkpoint_in_every_mode_is_the_plain_model(how: str) -> None:
    """The step's leaves held in their slots in backward, in each way a user calls: gradients
    equal the plain model's (under autocast, its bfloat16 rounding), and a step after a refused one too."""
    torch.manual_seed(0)
    model = ReentrantBlocks(whole=False).double()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, split_points=["b"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own, on runs under no_grad
        if how == "two forwards":
            (pipe(x).square().mean() + pipe(2 * x).sum()).backward()
            (reference(x).square().mean() + reference(2 * x).sum()).backward()
        elif how == "autograd.grad":
            got = torch.autograd.grad(pipe(x).square().mean(), list(model.parameters()))
            reference(x).square().mean().backward()  # the plain model refuses autograd.grad here: torch's limit
            for g, w in zip(got, reference.parameters()):
                torch.testing.assert_close(g, grad_of(w), rtol=0, atol=1e-12)
            assert all(p.grad is None for p in model.parameters())
            return
        elif how == "train_step":
            loss = pipe.train_step(x, target=torch.zeros(8, 6, dtype=torch.float64), loss_fn=F.mse_loss)
            expected = F.mse_loss(reference(x), torch.zeros(8, 6, dtype=torch.float64))
            expected.backward()
            torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
        elif how == "no_grad":
            with torch.no_grad():
                torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-12)
            return
        elif how == "autocast":
            model.float(), reference.float()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out, expected = pipe(x.float()), reference(x.float())
            torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=0)
            out.float().square().mean().backward()
            expected.float().square().mean().backward()
            for p, q in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(grad_of(p), grad_of(q), rtol=0, atol=2e-2)
            return
        else:
            with pytest.raises(ValueError):
                pipe.train_step(x, target=torch.zeros(8, 6, dtype=torch.float64), loss_fn=F.mse_loss, reduction="median")
            pipe(x).square().mean().backward()
            reference(x).square().mean().backward()
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grad_of(pipe.get_parameter(name)), grad_of(param), rtol=0, atol=1e-12)


class WritesAValueWithoutGrad(nn.Module):
    """A value made from the input alone (a timestep's embedding) crosses to the next stage,
    which writes it in place: it requires no grad, so the write is fine, as in the plain model."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        embedding = torch.sin(t.unsqueeze(1) * torch.arange(6, dtype=x.dtype))
        h = self.b(h)
        embedding[:, :3].mul_(2)  # through a view
        return h + embedding


class WritesAValueWithoutGradExported(WritesAValueWithoutGrad):
    """The same, with a branch on a size that torch.fx cannot trace: torch.export takes over."""

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != 6:
            raise ValueError("six features")
        return super().forward(x, t)


@pytest.mark.parametrize("front_end", ["torch.fx", "torch.export"])
@pytest.mark.parametrize("mode", MODES)
def test_a_value_without_grad_written_in_place_by_a_later_stage(mode: str, front_end: str) -> None:
    """A checkpointed stage sends it as not requiring grad, as the plain model's is: a recompute
    that wrote in place a leaf requiring grad would fail ("a leaf Variable that requires grad is
    being used in an in-place operation"), where the forward, under no_grad, did not."""
    torch.manual_seed(0)
    model = (WritesAValueWithoutGradExported if front_end == "torch.export" else WritesAValueWithoutGrad)().double()
    reference = copy.deepcopy(model)
    x, t = torch.randn(10, 6, dtype=torch.float64), torch.arange(10, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = compile_pipeline(model, (x, t), ["cpu", "cpu"], chunks=5, checkpoint=mode, split_points=["b"])
    assert any("used torch.export" in str(w.message) for w in caught) == (front_end == "torch.export")
    pipe(x, t).square().mean().backward()
    reference(x, t).square().mean().backward()
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grad_of(dict(pipe.named_parameters())[name]), grad_of(param), rtol=0, atol=1e-12)


class _Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w, self.rate = nn.Parameter(torch.rand(6, dtype=torch.float64) + 0.5), 0.5

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.dropout(h * self.w, self.rate, self.training)


class _OwnCheckpoint(nn.Module):
    """A dropout inside the model's own torch.utils.checkpoint, at the model's level or in a
    block that may be kept whole."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.a, self.b, self.inner, self.reentrant = nn.Linear(6, 6), nn.Linear(6, 6), _Dropped(), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return torch.utils.checkpoint.checkpoint(self.inner, h, use_reentrant=self.reentrant)


class _CheckpointedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Dropped()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, h, use_reentrant=False)


class _WholeBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.block = nn.Linear(6, 6), nn.Linear(6, 6), _CheckpointedBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _mask_error(w: nn.Parameter, z: torch.Tensor) -> float:
    """With loss z.sum(), where z = dropout(h * w): the gradient of w the forward's mask implies
    is z.sum(0) / w; a backward on another mask gives another."""
    assert w.grad is not None
    return float((z.detach().sum(0) / w - w.grad).abs().max())


@pytest.mark.parametrize("case", ["reentrant", "kept whole"])
def test_a_dropout_that_the_models_own_checkpoint_recomputes_is_refused_where_torch_would_recompute_it(case: str) -> None:
    """Before, the backward used other masks than the forward (gradients 1.2-1.7 off, in every
    checkpoint mode for a block kept whole): torch's recompute does not replay the pipeline's
    per-micro-batch streams."""
    model = (_OwnCheckpoint(reentrant=True) if case == "reentrant" else _WholeBlock()).double()
    leaves = [_CheckpointedBlock] if case == "kept whole" else []
    with pytest.raises(TraceError, match=r"(?s)own activation checkpointing \(torch.utils.checkpoint\) recomputes random ops.*"
                       r"in (inner|block).*How to fix: turn the model's own checkpointing off"):
        compile_pipeline(model, X.double(), ["cpu", "cpu"], chunks=2, leaf_modules=leaves)
    with torch.no_grad():
        _zero_rates(model)
    pipe = compile_pipeline(model, X.double(), ["cpu", "cpu"], chunks=2, leaf_modules=leaves)  # no draw: nothing to replay
    torch.testing.assert_close(pipe(X.double()), model(X.double()), rtol=0, atol=1e-12)


def _zero_rates(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, _Dropped):
            m.rate = 0.0


@pytest.mark.parametrize("mode", MODES)
def test_a_dropout_in_the_models_own_non_reentrant_checkpoint_that_the_trace_goes_through_replays_its_masks(mode: str) -> None:
    model = _OwnCheckpoint(reentrant=False).double()
    pipe = compile_pipeline(model, X.double(), ["cpu", "cpu"], chunks=2, checkpoint=mode)
    z = pipe(X.double())
    z.sum().backward()
    assert _mask_error(model.inner.w, z) < 1e-12


def test_a_model_whose_own_checkpoint_recomputes_a_dropout_compiled_in_eval_mode_runs_in_eval_alone() -> None:
    """Before, it was refused at compile time, though in eval mode nothing is drawn (a Hugging
    Face model with gradient checkpointing on, compiled for inference)."""
    model = _OwnCheckpoint(reentrant=True).double().eval()
    pipe = compile_pipeline(model, X.double(), ["cpu", "cpu"], chunks=2)
    torch.testing.assert_close(pipe(X.double()), model(X.double()), rtol=0, atol=1e-12)
    pipe.train()
    with pytest.raises(RuntimeError, match=r"(?s)compiled for eval mode alone.*recomputes random ops \(dropout\) in backward.*gradient_checkpointing_disable"):
        pipe(X.double())


@pytest.mark.parametrize("mode", MODES)
def test_a_weight_tied_across_stages_under_the_model_s_own_reentrant_checkpoint_gets_the_plain_model_s_gradient(mode: str) -> None:
    """Before, the head's part of the tied weight's gradient was lost (norm 0.415 for 0.555): the
    stage held its own leaves in their slots in backward, and the tied weight, which another
    stage reads too, has none."""
    torch.manual_seed(0)
    model = TiedUnderReentrant().double()
    reference = copy.deepcopy(model)
    x = torch.randint(0, 16, (8, 5))
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2, checkpoint=mode, split_points=["mid"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own, on the no_grad example runs
        pipe(x).square().mean().backward()
    reference(x).square().mean().backward()
    assert_grads_equal(pipe, reference, tol=1e-12)


class BlockTwiceUnderCheckpoint(nn.Module):
    """One block run at two depths, each under the model's own checkpoint, the two in two stages."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.a, self.m, self.b, self.block, self.reentrant = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6), Block(), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.block, self.a(x), use_reentrant=self.reentrant)
        h = torch.utils.checkpoint.checkpoint(self.block, self.m(h), use_reentrant=self.reentrant)
        return self.b(h)


def test_a_block_two_stages_hand_to_a_reentrant_checkpoint_is_refused_and_the_fix_trains_as_the_plain_model() -> None:
    """Before, both stages held the block's parameters as their own and swapped its slots at once:
    its gradients were off, and now and then a slot kept a stage's leaf, so that every later call
    was refused as if the caller had swapped the parameters."""
    torch.manual_seed(0)
    x = torch.randn(16, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"(?s)held in their slots by several stages: block.lin.bias \(stages 0, 1\).*use_reentrant=False"):
        compile_pipeline(BlockTwiceUnderCheckpoint(reentrant=True).double(), x, ["cpu", "cpu"], chunks=8, split_points=["m"])
    model = BlockTwiceUnderCheckpoint(reentrant=False).double()
    reference = copy.deepcopy(model)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=8, split_points=["m"])
    for _ in range(5):
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        pipe(x).square().mean().backward()
        reference(x).square().mean().backward()
        assert_grads_equal(pipe, reference, tol=1e-12)
