"""Traced graphs are checked against the model, in both modes, and compiling leaves the model as it was."""
from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import assert_grads_equal, twin
from fxpipe import StageError, TraceError, compile_pipeline
from fxpipe.compiler.frontend import to_graph


class DroppedSkip(nn.Module):
    """torch.jit.isinstance is False for an fx proxy: torch.fx traces it without the skip."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if torch.jit.isinstance(x, torch.Tensor):
            h = h + x
        return self.c(torch.tanh(self.b(h)))


class DroppedSkipAndValueBranch(nn.Module):
    """torch.fx drops the block; torch.export enters it and cannot branch on a value."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if torch.jit.isinstance(x, torch.Tensor):
            h = h + x
            if x.sum() > 0:
                h = h * 2
        return self.b(h)


class DroppedCount(nn.Module):
    """The output is right under torch.fx, but the buffer write is lost."""

    count: torch.Tensor  # a buffer, registered in __init__

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.isinstance(x, torch.Tensor):
            self.count.add_(1)
        return self.a(x)


def test_a_graph_that_drops_a_skip_is_replaced_by_the_exported_one() -> None:
    model, reference = twin(DroppedSkip())
    x = torch.randn(6, 8, dtype=torch.float64)
    match = r"torch.fx could not trace DroppedSkip \(its graph \(traced in training mode\) computes otherwise than the model: first difference at node b .*; used torch.export"
    with pytest.warns(UserWarning, match=match):
        pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=3)
    assert any("first difference at node b" in note for note in pipe.plan.notes)
    for _ in range(2):  # two training steps
        out, expected = pipe(x), reference(x)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
        out.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        assert_grads_equal(pipe, reference)
        for module in (pipe, reference):
            torch.optim.SGD(module.parameters(), lr=0.1).step()
            module.zero_grad()


def test_buffer_updates_are_checked_too() -> None:
    model = DroppedCount().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"buffer count is updated otherwise than by the model"):
        pipe = compile_pipeline(model, x, ["cpu"])
    assert int(model.count) == 0
    pipe(x)
    assert int(model.count) == 1


def test_when_every_front_end_fails_the_error_names_the_first_difference() -> None:
    with pytest.raises(TraceError) as info:
        compile_pipeline(DroppedSkipAndValueBranch().double(), torch.randn(4, 8, dtype=torch.float64).abs(), ["cpu"])
    message = str(info.value)
    assert "neither torch.fx nor torch.export can capture DroppedSkipAndValueBranch" in message
    fx_line = next(line for line in message.splitlines() if line.startswith("torch.fx:"))
    assert "its graph (traced in training mode) computes otherwise than the model" in fx_line
    assert "first difference at node b (module b, " in fx_line
    assert "test_validation.py" in fx_line and "(return self.b(h))" in fx_line
    assert "max abs difference" in fx_line
    assert "torch.export:" in message and "How to fix" in message


class Frozen(nn.Module):
    """BatchNorm (one of them frozen in eval mode), dropout, and a parameter left without grad."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.norm, self.frozen = nn.BatchNorm1d(8), nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.norm(torch.relu(self.a(x))))
        return self.c(self.frozen(torch.relu(self.b(h))))


class FrozenExported(Frozen):
    """The same, through torch.export (a forward with *args)."""

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return super().forward(args[0])


def _state(model: nn.Module) -> dict[str, Any]:
    return {
        "state": copy.deepcopy(model.state_dict()),
        "grads": {name: (p.grad, None if p.grad is None else p.grad.clone()) for name, p in model.named_parameters()},
        "training": [m.training for m in model.modules()],
        "rng": torch.get_rng_state(),
        # Seeds queued for CUDA's first use (where it has not started) would reseed it then.
        "queued for cuda": torch.cuda._lazy_seed_tracker.get_calls(),
    }


@pytest.mark.parametrize("model_type", [Frozen, FrozenExported])
@pytest.mark.parametrize("balance", ["memory", "time"])
def test_compiling_leaves_the_model_as_it_was(model_type: type, balance: str) -> None:
    model = model_type().double()
    model.frozen.eval()
    with torch.no_grad():
        model.norm.running_mean.uniform_()
    model.a.weight.grad = torch.randn_like(model.a.weight)
    model.c.bias.grad = torch.randn_like(model.c.bias)
    x = torch.randn(6, 8, dtype=torch.float64)
    before = _state(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compile_pipeline(model, x, ["cpu", "cpu"], chunks=2, balance=balance)
    after = _state(model)
    for name, value in before["state"].items():
        assert torch.equal(after["state"][name], value), name
    for name, (grad, values) in before["grads"].items():
        now, now_values = after["grads"][name]
        assert now is grad, f"{name}: .grad was replaced"
        assert (values is None and now_values is None) or torch.equal(now_values, values), name
    assert after["training"] == before["training"]
    assert torch.equal(after["rng"], before["rng"])
    assert after["queued for cuda"] is before["queued for cuda"], "compiling queued a seed for CUDA's first use"


class WritesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:  # *rest: torch.export
        x.mul_(2)
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("extra", [(), (torch.zeros(()),)], ids=["fx", "export"])
def test_compiling_leaves_an_example_the_forward_writes_as_it_was(chunks: int, extra: tuple[torch.Tensor, ...]) -> None:
    model, reference = twin(WritesItsInput())
    x = torch.randn(8, 6, dtype=torch.float64)
    values, version = x.clone(), x._version
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipeline(model, (x, *extra), ["cpu"] * chunks, chunks=chunks)
    assert torch.equal(x, values), "compiling is not a call: the example keeps its values"
    expected = reference(values.clone(), *extra)
    torch.testing.assert_close(pipe(x, *extra), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(x, values * 2, rtol=0, atol=0)  # a call writes it, as the plain model's does
    assert x._version > version


@pytest.mark.parametrize("chunks", [1, 2])
def test_inference_tensors_compile_and_an_input_written_under_inference_mode_is_written_as_the_plain_models(chunks: int) -> None:
    """Inference tensors keep no version counter: before, compiling on one, and a call under
    torch.inference_mode() of a forward that writes its input, raised from the pipeline's own code."""
    with torch.inference_mode():
        example = torch.randn(8, 6, dtype=torch.float64)
    plain = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).double()
    assert compile_pipeline(plain, example, ["cpu"] * 2, chunks=chunks).plan is not None
    model, reference = twin(WritesItsInput())
    pipe = compile_pipeline(model, example.clone(), ["cpu"] * 2, chunks=chunks)
    for inference_tensor in (False, True):
        with torch.inference_mode(inference_tensor):
            x, x_plain = example.clone(), example.clone()
        with torch.inference_mode():
            torch.testing.assert_close(pipe(x), reference(x_plain), rtol=0, atol=1e-12)
        assert x.is_inference() == inference_tensor
        torch.testing.assert_close(x, x_plain, rtol=0, atol=0)


class _TakesKeywords(nn.Module):
    """A forward with **kwargs, which torch.fx cannot trace: torch.export captures it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x)))
        return h * kwargs["scale"] if "scale" in kwargs else h


@pytest.mark.parametrize("where", ["an inference tensor", "under inference_mode", "a call of another kind"])
def test_a_model_torch_export_captures_compiles_under_inference_mode_and_an_inference_tensor_outside_it_says_how(where: str) -> None:
    """Compiling under inference mode traces outside it, from copies of the example's inference
    tensors. Before, the refusal said the model's forward enters torch.inference_mode(), which it
    does not (the caller's did; a call with a new keyword compiles its stages inside the call).
    Outside inference mode an inference tensor fails torch.export as it fails the plain model's
    forward with gradients; before, the fix offered was torch.where."""
    model, reference = twin(_TakesKeywords())
    with torch.inference_mode():
        x = torch.randn(8, 6, dtype=torch.float64)
        scale = torch.rand(8, 6, dtype=torch.float64)
    kwargs = {"scale": scale} if where == "a call of another kind" else {}
    if where == "an inference tensor":  # outside inference mode: refused as the plain model's forward with gradients fails
        with pytest.raises(TraceError, match=r"(?s)Inference tensors cannot be saved.*How to fix: the example holds tensors made under torch.inference_mode\(\)"):
            compile_pipeline(model, x, ["cpu"] * 2, chunks=2)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.fx could not trace it; torch.export did
        if where == "under inference_mode":
            with torch.inference_mode():
                pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2)
        else:
            pipe = compile_pipeline(model, x.clone(), ["cpu"] * 2, chunks=2)
        with torch.inference_mode():
            out, expected = pipe(x, **kwargs), reference(x, **kwargs)
    assert out.is_inference()
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    assert x.is_inference() and scale.is_inference(), "the caller's tensors are as they were"
    out = pipe(x.clone(), **{name: t.clone() for name, t in kwargs.items()})  # and a call outside it trains
    out.sum().backward()
    reference(x.clone(), **{name: t.clone() for name, t in kwargs.items()}).sum().backward()
    assert_grads_equal(pipe, reference, tol=1e-12)


class _FailsOnTheSecondMicroBatch(nn.Module):
    """Called whole (it counts its calls): raises on every second call once armed."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.calls, self.armed = nn.Linear(6, 6), 0, False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.armed and self.calls % 2 == 0:
            raise RuntimeError("a bad micro-batch")
        return self.lin(h)


class _WritesThenFails(WritesItsInput):
    def __init__(self) -> None:
        super().__init__()
        self.fails = _FailsOnTheSecondMicroBatch()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.fails(super().forward(x))


@pytest.mark.parametrize("call", ["pipe(x)", "no_grad", "train_step"])
def test_a_failed_call_puts_back_the_input_its_forward_wrote(call: str) -> None:
    """As it puts back buffers: before, the micro-batches before the failure stayed written and
    the others not (rows 0-3 doubled, 4-7 as they were)."""
    model = _WritesThenFails().double()
    pipe = compile_pipeline(model, torch.randn(8, 6, dtype=torch.float64), ["cpu"] * 2, chunks=2, split_points=["fails"])
    x = torch.randn(8, 6, dtype=torch.float64)
    values = x.clone()
    model.fails.armed = call != "train_step"

    def failing(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a bad loss")

    with pytest.raises(StageError, match="a bad (micro-batch|loss)"):
        if call == "train_step":
            pipe.train_step(x, target=values, loss_fn=failing)
        else:
            with torch.no_grad() if call == "no_grad" else contextlib.nullcontext():
                pipe(x)
    assert torch.equal(x, values)
    model.fails.armed = False
    torch.testing.assert_close(pipe(x), model.fails.lin(model.b(torch.tanh(model.a(values * 2)))), rtol=0, atol=1e-12)
    torch.testing.assert_close(x, values * 2, rtol=0, atol=0)


class TrainingBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.training:
            h = h * 2
        return F.dropout(h, 0.5, self.training)


@pytest.mark.parametrize("mode", [True, False])
def test_a_training_branch_gives_an_eval_graph(mode: bool) -> None:
    model = TrainingBranch().double().train(mode)
    traced = to_graph(model, (torch.randn(4, 8, dtype=torch.float64),), [], 1)
    assert traced.eval_graph is not None
    assert "mul" in traced.graph.code and "training = True" in traced.graph.code
    assert "mul" not in traced.eval_graph.code and "training = False" in traced.eval_graph.code
    assert traced.eval_graph.a is model.a and traced.graph.a is model.a
    assert model.training is mode


def test_a_model_without_training_branches_has_one_graph() -> None:
    traced = to_graph(Frozen().double(), (torch.randn(4, 8, dtype=torch.float64),), [], 1)
    assert traced.eval_graph is None


@pytest.mark.filterwarnings("ignore")
def test_a_nested_tensor_fast_path_the_graph_does_not_take_is_named_with_the_fix() -> None:
    """Before, comparing the module outputs raised torch's 'NestedTensorImpl doesn't support sizes'."""

    def encoder(nested: bool) -> nn.TransformerEncoder:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested).double()

    x, pad = torch.randn(4, 6, 8, dtype=torch.float64), torch.zeros(4, 6, dtype=torch.bool)
    pad[1, -2:] = True
    with pytest.raises(TraceError, match="fast path on nested tensors .* build nn.TransformerEncoder with enable_nested_tensor=False"):
        compile_pipeline(encoder(True), x, ["cpu"] * 2, chunks=2, example_kwargs={"src_key_padding_mask": pad})
    model, reference = twin(encoder(False))
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2, example_kwargs={"src_key_padding_mask": pad})
    pipe.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x, src_key_padding_mask=pad), reference(x, src_key_padding_mask=pad), rtol=0, atol=1e-12)


class _RunningNorm(nn.Module):
    """Keeps a running mean and a Python count of the batches it saw, as speechbrain's
    InputNormalization does: its forward assigns both."""

    def __init__(self) -> None:
        super().__init__()
        self.count, self.mean = 0, torch.zeros(8, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        current = x.mean(0)
        if self.training:
            self.mean = current.detach() if self.count == 0 else (self.count * self.mean + current.detach()) / (self.count + 1)
            self.count = self.count + 1
        return x - self.mean


class _Normalised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.a = _RunningNorm(), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(self.norm(x))


def test_compiling_leaves_a_count_a_forward_keeps_as_it_was() -> None:
    """Before, compiling's runs of the forward left the count at 1 (its tensor put back): the
    pipeline's first call blended the batch's mean with the initial zeros, 1.5 off."""
    model, reference = twin(_Normalised())
    x = torch.randn(6, 8, dtype=torch.float64) + 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=1)
    assert model.norm.count == 0
    for _ in range(2):
        torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-12)
    assert model.norm.count == reference.norm.count == 2
