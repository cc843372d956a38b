"""Models a trace cannot take as they are: named with the module, the line and a fix that applies."""
from __future__ import annotations

import contextlib
import copy
import sys
from typing import Any

import pytest
import torch
from torch import nn

from fxpipe import TraceError, compile_pipeline
from helpers import X, assert_call_and_grads_equal, assert_grads_equal, twin


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x) * 2


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x
        return -x


def test_untraceable_model_names_the_module_the_line_and_the_fix() -> None:
    with pytest.raises(TraceError) as info:
        compile_pipeline(Untraceable(), X, ["cpu"])
    message = str(info.value)
    assert "in module: gate" in message
    assert "test_trace_errors.py" in message and "if x.sum() > 0:" in message
    assert "leaf_modules=['gate']" in message
    pipe = compile_pipeline(Untraceable(), X, ["cpu"], leaf_modules=["gate"])
    torch.testing.assert_close(pipe(X), Untraceable()(X))


class _PackedRNN(nn.Module):
    """Packing, an LSTM and unpacking: called whole, per micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(6, 7, batch_first=True)

    def forward(self, h: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(h, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        return nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=h.shape[1])[0]


class Packs(nn.Module):
    def __init__(self, inline: bool) -> None:
        super().__init__()
        self.emb, self.seq, self.head = nn.Linear(5, 6), _PackedRNN(), nn.Linear(7, 3)
        self.inline = inline

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        if self.inline:
            packed = nn.utils.rnn.pack_padded_sequence(h, lengths, batch_first=True, enforce_sorted=False)
            h = nn.utils.rnn.pad_packed_sequence(self.seq.rnn(packed)[0], batch_first=True, total_length=x.shape[1])[0]
        else:
            h = self.seq(h, lengths)
        return self.head(h)


@pytest.mark.filterwarnings("ignore:The tensor attributes")
def test_packed_sequences_in_the_root_are_refused_naming_the_fix_and_in_a_submodule_it_is_called_whole() -> None:
    """Before, the advice was to rewrite control flow with torch.where, which does not apply;
    and packing in a submodule went to torch.export, which failed on it too."""
    x, lengths = torch.randn(8, 5, 5, dtype=torch.float64), torch.tensor([5, 3, 2, 5, 1, 4, 4, 2])
    with pytest.raises(TraceError, match=r"(?s)a packed sequence \(pack_padded_sequence\) cannot be traced: put the packing"):
        compile_pipeline(Packs(inline=True).double(), (x, lengths), ["cpu", "cpu"], chunks=2)
    model, reference = twin(Packs(inline=False))
    pipe = compile_pipeline(model, (x, lengths), ["cpu", "cpu"], chunks=2)
    assert any(n.op == "call_module" and n.target == "seq" for m in pipe.program().modules for n in m.graph.nodes), "called whole"
    assert_call_and_grads_equal(pipe, reference, x, lengths)


class HookedWhenTraining(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.requires_grad:  # fx cannot trace the branch; torch.export would drop the hook
            h.register_hook(lambda g: g * 2)
        return self.b(h)


def test_a_hook_forward_registers_on_a_tensor_is_not_dropped_by_torch_export() -> None:
    # Before, torch.export captured the model without the hook: a's gradients were half the plain model's.
    with pytest.raises(TraceError, match=r"drops the hooks forward registers on tensors"):
        compile_pipeline(HookedWhenTraining(), X, ["cpu"] * 2, chunks=2)
    model = nn.Sequential(HookedWhenTraining(), nn.Linear(6, 6)).double()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2, leaf_modules=[HookedWhenTraining])
    pipe(x).sum().backward()
    reference(x).sum().backward()
    assert_grads_equal(pipe, reference)


class HookedAlways(HookedWhenTraining):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.register_hook(lambda g: g * 2)  # raises under torch.no_grad()
        return self.b(h)


def test_a_forward_that_runs_only_with_gradients_on_is_named_as_such() -> None:
    # Before, the error said the model does not run on the example, which it does.
    with pytest.raises(ValueError, match=r"runs on the example only with gradients on") as refused:
        compile_pipeline(HookedAlways(), X, ["cpu"] * 2, chunks=2)
    # Both fixes, each alone refused again (the test above runs the model with both).
    assert "if h.requires_grad:" in str(refused.value) and "Both together" in str(refused.value)


class BranchesOnValues(nn.Module):
    """A Python branch on a tensor's value, in a forward that takes **kwargs (torch.export)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        h = self.a(x)
        if (h > 0).sum().item() > 3:
            h = h * 2
        return self.b(h)


def test_a_branch_torch_export_cannot_take_is_named_by_its_line_with_a_fix_that_applies() -> None:
    # Before, only export's first line was kept, and the fix named leaf_modules, which needs torch.fx.
    with pytest.raises(TraceError) as refused:
        compile_pipeline(BranchesOnValues(), X, ["cpu"] * 2)
    text = str(refused.value)
    assert "test_trace_errors.py:" in text and "(if (h > 0).sum().item() > 3:)" in text, text
    assert "name forward's arguments, so that torch.fx traces the model" in text, text


class SaysWhenTraced(nn.Module):
    """Writes a line to stderr each time its forward runs, as the plain model would."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        print("forward ran", file=sys.stderr)
        return self.b(torch.tanh(self.a(x)))


def test_torch_exports_own_printing_of_a_failure_is_held_back_and_other_output_is_not(capfd: pytest.CaptureFixture[str]) -> None:
    """Before, a failed export printed its partial graph twice and a log line for the data-dependent
    value above fxpipe's error, which names the line already."""
    with pytest.raises(TraceError, match=r"\(if \(h > 0\).sum\(\).item\(\) > 3:\)"):
        compile_pipeline(BranchesOnValues(), X, ["cpu"] * 2)
    printed = capfd.readouterr()
    assert "def forward" not in printed.err + printed.out, printed.err
    assert "Unable to find user code" not in printed.err, printed.err
    compile_pipeline(SaysWhenTraced(), X, ["cpu"] * 2)  # exported (it takes **kwargs): what forward writes is written
    assert "forward ran" in capfd.readouterr().err
    assert sys.stderr is not None and not type(sys.stderr).__name__.startswith("_Held")


class _Pair:
    """A class of the model's own, unknown to pytree."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a, self.b = a, b


class ReturnsPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> _Pair:
        h = self.a(x)
        return _Pair(h, self.b(h))


def test_an_output_of_a_class_pytree_does_not_know_is_refused_with_what_works() -> None:
    """Not the advice about control flow: what both front ends failed on is the class."""
    with pytest.raises(TraceError) as info:
        compile_pipeline(ReturnsPair(), X, ["cpu", "cpu"], chunks=2)
    message = str(info.value)
    assert message.count("How to fix: return (and pass between modules) tuples, lists or dicts of tensors") == 2, message
    assert "control flow" not in message


def _tensors_only(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"Tensor type unknown to the library: {type(x)}")
    return x * 2


class CallsALibrary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _tensors_only(self.a(x))
        return self.b(h) if bool(h.sum() > 0) else h  # and a branch on a value, which stops torch.export


def test_a_library_function_that_refuses_a_proxy_is_named_with_torch_fx_wrap_as_the_fix() -> None:
    with pytest.raises(TraceError) as refused:
        compile_pipeline(CallsALibrary(), X, ["cpu", "cpu"])
    fx_reason = str(refused.value).split("torch.export:")[0]
    assert "Tensor type unknown to the library" in fx_reason
    assert "register the function with torch.fx.wrap" in fx_reason and "control flow" not in fx_reason


class _WritesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.a(x)


def test_an_example_the_model_itself_fails_on_after_tracing_is_named_so() -> None:
    """An inference tensor written in place traces, and the graph then fails on it as the model
    does: before, the error was torch.fx's interpreter's, with no fix."""
    with torch.inference_mode():
        x = torch.randn(8, 6)
    with pytest.raises(ValueError, match=r"(?s)_WritesItsInput does not run on the example: RuntimeError: Inplace update to inference tensor.*How to fix"):
        compile_pipeline(_WritesItsInput(), x, ["cpu", "cpu"], chunks=2)


class _ChecksAMethod(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def inner(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.b(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.utils.checkpoint.checkpoint(self.inner, torch.tanh(self.a(x)), use_reentrant=True))


def test_a_method_given_to_a_reentrant_checkpoint_is_refused_with_its_line_and_the_fix() -> None:
    """Before, the refusal pointed at fxpipe's own tracer and advised dataclasses."""
    with pytest.raises(TraceError) as raised:
        compile_pipeline(_ChecksAMethod(), torch.randn(8, 6), ["cpu", "cpu"], chunks=2)
    message = str(raised.value)
    assert "test_trace_errors.py" in message and "fxpipe/tracing/trace.py" not in message, message
    assert "pass a module instead (checkpoint(self.block, x)), use use_reentrant=False" in message, message
    assert "register_dataclass" not in message.split("torch.export:")[0], message


class Penalised(nn.Module):
    """Takes a derivative in forward (a gradient penalty); under `with torch.enable_grad():`
    where `asks`, as the refusal of the plain form advises."""

    def __init__(self, asks: bool) -> None:
        super().__init__()
        self.asks = asks
        self.lin = nn.Linear(6, 6)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.enable_grad() if self.asks else contextlib.nullcontext():
            h = h if h.requires_grad else h.detach().requires_grad_()
            y = torch.tanh(self.lin(h))
            (g,) = torch.autograd.grad(y.sum(), h, create_graph=True)
        return y, g.pow(2).sum(-1)


class WithPenalty(nn.Module):
    def __init__(self, asks: bool) -> None:
        super().__init__()
        self.a, self.pen, self.b = nn.Linear(6, 6), Penalised(asks), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, pen = self.pen(self.a(x))
        return self.b(y), pen


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_a_derivative_in_forward_is_refused_with_a_fix_that_gives_the_plain_models_gradients(checkpoint: str) -> None:
    """Before, the refusal advised letting forward run under no_grad, which a branch on
    torch.is_grad_enabled() does: checkpointed micro-batches then returned the branch's other
    value (a penalty 7.5 where the plain model's is 15.4)."""
    with pytest.raises(ValueError, match=r"(?s)only with gradients on.*under `with torch.enable_grad\(\):`.*never a branch on torch.is_grad_enabled"):
        compile_pipeline(WithPenalty(asks=False).double(), X.double(), ["cpu"] * 2, chunks=2, leaf_modules=[Penalised])
    model, reference = twin(WithPenalty(asks=True))
    pipe = compile_pipeline(model, X.double(), ["cpu"] * 2, chunks=2, checkpoint=checkpoint, leaf_modules=[Penalised])
    (out, pen), (expected, expected_pen) = pipe(X.double()), reference(X.double())
    torch.testing.assert_close(pen, expected_pen, rtol=0, atol=1e-12)
    (out.pow(2).sum() + pen.sum()).backward()
    (expected.pow(2).sum() + expected_pen.sum()).backward()
    assert_grads_equal(pipe, reference)


class Compressed(nn.Module):
    """Keeps what its backward needs in bfloat16 (saved_tensors_hooks, entered in forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.to(torch.bfloat16), lambda t: t.to(torch.float64)):
            return self.b(torch.tanh(self.a(x)))


class WithCompressed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.inner, self.last = nn.Linear(6, 6), Compressed(), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.inner(torch.tanh(self.first(x))))


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_saved_tensor_hooks_entered_in_forward_are_refused_and_kept_in_a_module_kept_whole(checkpoint: str) -> None:
    """Before, both front ends dropped them: the gradients were those of the model without them
    (2.8e-3 off the plain model's)."""
    x = X.double()
    with pytest.raises(TraceError, match=r"(?s)torch.fx: .*saved_tensors_hooks.*torch.export: .*saved_tensors_hooks.*leaf_modules"):
        compile_pipeline(WithCompressed().double(), x, ["cpu"] * 2, chunks=2)
    model, reference = twin(WithCompressed())
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2, checkpoint=checkpoint, leaf_modules=[Compressed])
    pipe(x).pow(2).sum().backward()
    torch.cat([reference(half) for half in x.chunk(2)]).pow(2).sum().backward()
    assert_grads_equal(pipe, reference, tol=1e-12)
