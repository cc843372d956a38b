"""The runtime: failures, threads, memory, state dicts, odd batches, nested inputs and dropout."""
from __future__ import annotations

import collections
import copy
import functools
import gc
import threading
import time
import weakref
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fxpipe import StageError, compile_pipeline, is_recomputing
from helpers import FanOut, TiedEnds, WithPositions, assert_grads_equal, example_module, grad_of, twin


class Bomb(nn.Module):
    """A layer that raises on its `fuse`-th call while armed."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.armed, self.fuse, self.calls = False, 3, 0
        self.in_recompute = False  # whether it goes off in the recompute of its call, not the forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        call, self.calls = self.calls, self.calls + 1
        if self.armed and call == self.fuse and is_recomputing() == self.in_recompute:
            raise ValueError("boom")
        return self.linear(x)


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.bomb, self.d = nn.Linear(4, 4), nn.Linear(4, 4), Bomb(), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(self.bomb(self.b(self.a(x)).relu()).relu())


def _chain_pipeline(checkpoint: str = "never") -> tuple[Chain, nn.Module, torch.Tensor]:
    model = Chain()
    x = torch.randn(8, 4)
    pipe = compile_pipeline(model, x, ["cpu"] * 3, chunks=4, checkpoint=checkpoint, balance=[2, 1, 3], leaf_modules=[Bomb])
    assert "bomb" in pipe.plan.stages[2].nodes
    return model, pipe, x


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_exception_in_stage_2_micro_batch_3_reaches_the_caller(phase: str) -> None:
    model, pipe, x = _chain_pipeline("always")
    model.bomb.calls, model.bomb.armed = 0, True
    # Forward calls the bomb for micro-batches 0..3; with 'always', backward recomputes 3, 2, 1, 0,
    # each from the count its forward saw.
    model.bomb.fuse, model.bomb.in_recompute = 3, phase == "backward"
    with pytest.raises(StageError, match=f"stage 2 failed on micro-batch 3 in {phase}: ValueError: boom") as info:
        pipe(x).sum().backward()
    assert (info.value.stage, info.value.micro_batch, info.value.phase) == (2, 3, phase)
    assert isinstance(info.value.__cause__, ValueError)
    assert ("ran this micro-batch's forward again for its backward" in str(info.value)) == (phase == "backward")  # (the recompute's)
    model.bomb.armed = False
    reference = copy.deepcopy(model)
    for p in pipe.parameters():
        p.grad = None
    pipe(x).sum().backward()
    reference(x).sum().backward()
    assert_grads_equal(pipe, reference, tol=1e-6)


def _worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("fxpipe-stage")]


def test_no_worker_thread_outlives_the_pipeline() -> None:
    gc.collect()
    before = set(_worker_threads())
    _, pipe, x = _chain_pipeline()
    pipe(x).sum().backward()
    assert len(set(_worker_threads()) - before) == 3
    del pipe
    gc.collect()
    deadline = time.monotonic() + 5
    while set(_worker_threads()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not set(_worker_threads()) - before


class Spy(nn.Module):
    """Keeps a weak reference to everything it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.outputs: list[weakref.ref] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        self.outputs.append(weakref.ref(y))
        return y


@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
def test_no_activation_outlives_its_step(mode: str) -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.spy, self.b = nn.Linear(4, 4), Spy(), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.b(self.spy(h)) + h

    model = Model()
    x = torch.randn(8, 4)
    pipe = compile_pipeline(model, x, ["cpu"] * 3, chunks=4, checkpoint=mode, leaf_modules=[Spy])
    for _ in range(2):
        model.spy.outputs.clear()
        loss = pipe(x).sum()
        loss.backward()
        del loss
        gc.collect()
        assert model.spy.outputs and all(ref() is None for ref in model.spy.outputs)


class _NewMemory(TorchDispatchMode):
    """Counts the ops on this thread that fill new memory of one of `shapes`."""

    def __init__(self, shapes: set[tuple[int, ...]]) -> None:
        super().__init__()
        self.shapes = shapes
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] in ("copy_", "clone", "empty_strided", "new_empty_strided"):
            if isinstance(out, torch.Tensor) and tuple(out.shape) in self.shapes:
                self.ops.append(func.__name__)
        return out


@pytest.mark.parametrize("call", ["train_step", "backward"])
def test_the_step_gradients_become_grad_without_a_copy(call: str) -> None:
    # Without care, autograd copies a gradient it is handed while its giver still holds it: a
    # whole second copy of every stage's gradients at the end of each step. One device: its
    # stages run on this thread, where the mode sees their ops too.
    model, reference = twin(nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 7)))
    x, y = torch.randn(16, 6, dtype=torch.float64), torch.randn(16, 7, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"], chunks=4, schedule="zb-h1")
    with _NewMemory({tuple(p.shape) for p in model.parameters()}) as new_memory:
        if call == "train_step":
            pipe.train_step(x, target=y, loss_fn=torch.nn.functional.mse_loss)
        else:
            torch.nn.functional.mse_loss(pipe(x), y).backward()
    assert new_memory.ops == []
    torch.nn.functional.mse_loss(reference(x), y).backward()
    assert_grads_equal(pipe, reference)


def test_state_dict_round_trip() -> None:
    unet = example_module("unet")
    model = unet.make_model(base=4)
    plain = unet.make_model(base=4)
    x, _ = unet.make_batch(4)
    pipe = compile_pipeline(model, x, ["cpu"] * 3, chunks=2)
    assert list(pipe.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(pipe.state_dict())
    torch.testing.assert_close(plain(x), pipe(x), rtol=0, atol=0)
    fresh = unet.make_model(base=4)
    pipe.load_state_dict(fresh.state_dict())
    torch.testing.assert_close(pipe(x), fresh(x), rtol=0, atol=0)


class WithExtraState(nn.Module):
    """Keeps a step count as extra state, and renames a legacy key when loading."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.steps = 0
        self.register_load_state_dict_pre_hook(self._renamed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))

    def get_extra_state(self) -> dict[str, int]:
        return {"steps": self.steps}

    def set_extra_state(self, state: dict[str, int]) -> None:
        self.steps = state["steps"]

    @staticmethod
    def _renamed(module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
        if prefix + "first.weight" in state:
            state[prefix + "a.weight"] = state.pop(prefix + "first.weight")


def test_the_state_dict_is_the_models_with_its_extra_state_and_hooks() -> None:
    """Before, the pipeline's state dict had no `_extra_state` (it would not load into the model,
    nor the model's into it), and a load pre-hook of the model's never ran."""
    model, x = WithExtraState(), torch.randn(4, 6)
    model.steps = 3
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    state = pipe.state_dict()
    assert list(state) == list(model.state_dict()) and state["_extra_state"] == {"steps": 3}
    other = WithExtraState()
    other.load_state_dict(state)
    assert other.steps == 3
    legacy = {("first.weight" if k == "a.weight" else k): v for k, v in WithExtraState().state_dict().items()}
    legacy["_extra_state"] = {"steps": 7}
    pipe.load_state_dict(legacy)
    assert model.steps == 7
    torch.testing.assert_close(model.a.weight, legacy["first.weight"], rtol=0, atol=0)
    torch.testing.assert_close(pipe(x), model(x), rtol=0, atol=0)
    wrapped = nn.Sequential(pipe)  # the pipeline inside a module of the caller's
    assert wrapped.state_dict()["0._extra_state"] == {"steps": 7}
    wrapped.load_state_dict({**{"0." + k: v for k, v in state.items()}})
    assert model.steps == 3


@pytest.mark.parametrize("batch,chunks", [(5, 8), (10, 4), (1, 3), (7, 7)])
def test_uneven_and_small_batches(batch: int, chunks: int) -> None:
    model, reference = twin(FanOut())
    x = torch.randn(batch, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, torch.randn(4, 6, dtype=torch.float64), ["cpu"] * 3, chunks=chunks)
    out = pipe(x)
    torch.testing.assert_close(out, reference(x), rtol=0, atol=1e-12)
    out.sum().backward()
    reference(x).sum().backward()
    assert_grads_equal(pipe, reference)
    micro_batches = {r.micro_batch for r in pipe.timeline().records}
    assert len(micro_batches) == min(batch, chunks)


class Nested(nn.Module):
    """Takes a tensor, a shared (unbatched) tensor and a dict; returns a dict with a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.f, self.g, self.h = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, scale: torch.Tensor, extra: dict[str, torch.Tensor]) -> dict[str, object]:
        a = torch.tanh(self.f(x * scale))
        b = torch.tanh(self.g(a + extra["y"]))
        c = self.h(b) * extra["z"]
        return {"c": c, "pair": (a, b)}


def test_tuple_and_dict_inputs_and_outputs() -> None:
    model, reference = twin(Nested())
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    scale = torch.rand(4, dtype=torch.float64, requires_grad=True)
    extra = {"y": torch.randn(6, 4, dtype=torch.float64), "z": torch.randn(6, 1, dtype=torch.float64)}
    pipe = compile_pipeline(model, (x, scale, extra), ["cpu"] * 3, chunks=3, checkpoint="except_last")
    out = pipe(x, scale, extra=extra)
    x_ref, scale_ref = x.detach().clone().requires_grad_(), scale.detach().clone().requires_grad_()
    expected = reference(x_ref, scale_ref, extra)
    assert set(out) == {"c", "pair"} and isinstance(out["pair"], tuple)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    (out["c"].sum() + out["pair"][0].sum() * 2).backward()
    (expected["c"].sum() + expected["pair"][0].sum() * 2).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(scale.grad, scale_ref.grad, rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)


def _dropout_step(mode: str, seed: int, stages: int = 3) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    gpt = example_module("gpt")
    torch.manual_seed(1)
    model = gpt.make_model(n_layer=2, n_embd=16, dropout=0.3).double()
    x, y = gpt.make_batch(8)
    pipe = compile_pipeline(model, x, ["cpu"] * stages, chunks=4, checkpoint=mode)
    torch.manual_seed(seed)
    out = pipe(x)
    gpt.loss_fn(out, y).backward()
    return out.detach(), {n: grad_of(p).clone() for n, p in pipe.named_parameters()}


def test_dropout_is_replayed_exactly_under_recompute() -> None:
    out_never, grads_never = _dropout_step("never", seed=7)
    for mode in ("always", "except_last"):
        out, grads = _dropout_step(mode, seed=7)
        assert torch.equal(out, out_never), mode
        for name, grad in grads.items():
            assert torch.equal(grad, grads_never[name]), f"{mode}: {name}"


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("written", ["layers.3.weight", "layers.0.weight", "layers.7.bias"])
def test_a_parameter_written_between_forward_and_backward_gives_the_plain_models_gradients_or_is_refused(checkpoint: str, written: str) -> None:
    """Before, a recompute read the written parameter, and the gradients were of a forward that
    never ran (0.17-0.26 off). The plain model raises for a parameter autograd saved (a weight
    whose input takes a gradient), and otherwise gives the gradients of the forward that ran:
    so does the pipeline that recomputes nothing; one that recomputes refuses."""
    model, reference = twin(FanOut())
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 3, chunks=4, checkpoint=checkpoint)
    outputs = [reference(x), pipe(x)]
    with torch.no_grad():
        for m in (reference, model):
            dict(m.named_parameters())[written].add_(0.5)
    if written == "layers.3.weight":
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            outputs[0].sum().backward()
    else:
        outputs[0].sum().backward()
    if written == "layers.3.weight" or checkpoint != "never":
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            outputs[1].sum().backward()
        assert all(p.grad is None for p in pipe.parameters())
    else:
        outputs[1].sum().backward()
        assert_grads_equal(pipe, reference, tol=1e-12)


def test_a_tied_parameter_written_between_forward_and_backward_is_refused_as_the_plain_model_refuses() -> None:
    """Each stage reads its own copy of a tied weight, on its memory: the recompute read the write."""
    model, reference = twin(TiedEnds())
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2, checkpoint="always", split_points=["b"])
    for m, out in [(reference, reference(x)), (model, pipe(x))]:
        with torch.no_grad():
            m.a.weight.mul_(2.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


def test_dropout_is_reproducible_and_seeded() -> None:
    first, grads = _dropout_step("except_last", seed=3)
    again, grads_again = _dropout_step("except_last", seed=3)
    other, _ = _dropout_step("except_last", seed=4)
    assert torch.equal(first, again)
    assert all(torch.equal(grads[n], grads_again[n]) for n in grads)
    assert not torch.equal(first, other)
    gpt = example_module("gpt")
    model = gpt.make_model(n_layer=2, n_embd=16, dropout=0.3).double()
    x, _ = gpt.make_batch(8)
    assert not torch.equal(first, model.eval()(x)), "dropout did not act"


def test_dtype_casts_are_allowed_and_rebuild_the_stages() -> None:
    gpt = example_module("gpt")
    model = gpt.make_model(n_layer=2, n_embd=16)
    reference = copy.deepcopy(model).double()
    x, _ = gpt.make_batch(4)
    pipe = compile_pipeline(model, x, ["cpu"] * 3, chunks=2)
    pipe.double()
    out = pipe(x)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, reference(x), rtol=0, atol=1e-12)
    assert all(buffer.dtype == torch.float64 for _, buffer in pipe.named_buffers())


def test_frozen_model_and_plain_input_run_without_autograd() -> None:
    model = FanOut().requires_grad_(False)
    x = torch.randn(4, 6)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2)
    out = pipe(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, model(x))


def test_a_train_step_that_would_train_nothing_is_refused_as_the_plain_backward_raises() -> None:
    """Before, train_step returned the loss of a frozen model and left every `.grad` None (a probe
    in loss_fn too), where the plain model's backward raises."""
    model = FanOut().requires_grad_(False)
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2)
    with pytest.raises(RuntimeError, match=r"(?s)element 0 of tensors does not require grad.*How to fix: unfreeze"):
        pipe.train_step(x, target=y, loss_fn=torch.nn.functional.mse_loss)
    with pytest.raises(RuntimeError, match="element 0 of tensors does not require grad"):
        torch.nn.functional.mse_loss(model(x), y).backward()
    with torch.no_grad():  # the loss alone, as documented
        torch.testing.assert_close(pipe.train_step(x, target=y, loss_fn=torch.nn.functional.mse_loss), torch.nn.functional.mse_loss(model(x), y))


class Containers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f, self.g = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        a = self.f(x)
        b = self.g(torch.tanh(a))
        return {"a": a, "pair": [a, b], "inner": collections.OrderedDict(b=b), "t": (b,)}


def test_outputs_have_the_plain_model_containers() -> None:
    """Dicts, OrderedDicts and lists come back as the model made them (not fx's immutable
    ones), and can be edited."""
    model, reference = twin(Containers())
    x = torch.randn(6, 4, dtype=torch.float64)
    out = compile_pipeline(model, x, ["cpu"] * 2, chunks=3)(x)
    expected = reference(x)
    assert type(out) is dict and type(out["pair"]) is list and type(out["t"]) is tuple
    assert type(out["inner"]) is collections.OrderedDict
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    out["loss"] = out["a"].sum()
    out["pair"].append(None)


def test_load_state_dict_with_assign_runs_on_the_new_tensors() -> None:
    """`assign=True` puts new tensor objects in the model: the stages are built on them, and
    their gradients reach them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    new = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    pipe.load_state_dict(new, assign=True)
    reference = copy.deepcopy(model)
    out = pipe(x)
    torch.testing.assert_close(out, reference(x), rtol=0, atol=1e-12)
    out.sum().backward()
    reference(x).sum().backward()
    for p, q in zip(pipe.parameters(), reference.parameters()):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)
    pipe.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()}, assign=True)
    reference = copy.deepcopy(model)
    y = torch.randn(8, 4, dtype=torch.float64)
    loss = pipe.train_step(x, target=y, loss_fn=torch.nn.functional.mse_loss)
    expected = torch.nn.functional.mse_loss(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    for p, q in zip(pipe.parameters(), reference.parameters()):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)


def test_a_parameter_written_between_two_forwards_and_their_backward_under_autocast_is_refused() -> None:
    """Two forwards before one backward, under autocast, recomputing: with nothing written the
    gradients are the plain model's; a write after the second forward is refused at the recompute."""
    model, reference = twin(FanOut())
    x1, x2 = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x1, ["cpu"] * 3, chunks=4, checkpoint="always")
    runs: list[Callable[[torch.Tensor], torch.Tensor]] = [reference, pipe]
    for run in runs:
        with torch.autocast("cpu", torch.bfloat16):
            loss = run(x1).float().sum() + run(x2).float().sum()
        loss.backward()
    assert_grads_equal(pipe, reference, tol=1e-12)
    with torch.autocast("cpu", torch.bfloat16):
        loss = pipe(x1).float().sum() + pipe(x2).float().sum()
    with torch.no_grad():
        dict(model.named_parameters())["layers.0.weight"].add_(0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


class _Heads(nn.Module):
    """Reads one head of a dict by its key, and never touches a list of extras."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.heads, self.extras = nn.Linear(6, 6), nn.ModuleDict({"main": nn.Linear(6, 6)}), nn.ModuleList()

    def _run(self, x: torch.Tensor, gain: float) -> torch.Tensor:
        return self.heads["main"](torch.tanh(self.a(x))) * gain

    forward = functools.partialmethod(_run, gain=2.0)  # a new object at every lookup on the class


def test_members_added_to_containers_forward_does_not_list_run() -> None:
    """A first version refused a head added to a dict that forward reads by key, or a module
    appended to a list it never touches, and a forward made by partialmethod on every call: the
    graph computes what the plain model does."""
    model, reference = twin(_Heads())
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    for m in (model, reference):
        m.heads["aux"] = nn.Linear(6, 6).double()
        m.extras.append(nn.Linear(6, 6).double())
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-12)
    y = torch.randn(8, 6, dtype=torch.float64)
    loss, expected = pipe.train_step(x, target=y, loss_fn=nn.functional.mse_loss), nn.functional.mse_loss(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():  # the added ones take none, as in the plain model
        assert (p.grad is None) == (ref[name].grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, ref[name].grad, rtol=0, atol=1e-12)
    assert ref["heads.aux.weight"].grad is None and ref["a.weight"].grad is not None


class MaskedMix(nn.Module):
    """Mixes each sample's positions through a (T, T) mask that the whole batch shares."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # (B, T, 4), (T, T)
        return self.b(mask @ torch.tanh(self.a(x)))


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_a_mask_the_example_kept_whole_stays_whole_at_a_sequence_length_equal_to_the_batch(schedule: str) -> None:
    model, reference = twin(MaskedMix())
    mask = lambda t: torch.ones(t, t, dtype=torch.float64).tril()  # noqa: E731
    pipe = compile_pipeline(model, (torch.randn(4, 6, 4, dtype=torch.float64), mask(6)), ["cpu", "cpu"], chunks=2, schedule=schedule)
    x, y = torch.randn(5, 5, 4, dtype=torch.float64), torch.randn(5, 5, 3, dtype=torch.float64)  # T = B = 5
    out = pipe(x, mask(5))
    torch.testing.assert_close(out, reference(x, mask(5)), rtol=0, atol=1e-12)
    out.pow(2).sum().backward()
    reference(x, mask(5)).pow(2).sum().backward()
    assert_grads_equal(pipe, reference)
    for p in [*model.parameters(), *reference.parameters()]:
        p.grad = None
    loss = pipe.train_step(x, mask(5), target=y, loss_fn=torch.nn.functional.mse_loss)
    expected = torch.nn.functional.mse_loss(reference(x, mask(5)), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_an_input_the_example_kept_whole_stays_whole_when_its_dim_0_equals_the_batch(schedule: str) -> None:
    model, reference = twin(WithPositions())
    example = (torch.randn(8, 3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64))
    pipe = compile_pipeline(model, example, ["cpu", "cpu"], chunks=3, schedule=schedule)
    x, pos = torch.randn(3, 3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)  # a batch of 3 = the positions
    out = pipe(x, pos)
    torch.testing.assert_close(out, reference(x, pos), rtol=0, atol=1e-12)
    out.pow(2).sum().backward()
    reference(x, pos).pow(2).sum().backward()
    assert_grads_equal(pipe, reference)
    y = torch.randn(3, 3, 3, dtype=torch.float64)
    for p in [*model.parameters(), *reference.parameters()]:
        p.grad = None
    loss = pipe.train_step(x, pos, target=y, loss_fn=torch.nn.functional.mse_loss)
    expected = torch.nn.functional.mse_loss(reference(x, pos), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)


class Masked(nn.Module):
    """A mask of (B, T) or (1, T) over each sample's positions."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # (B, T, 4), (B or 1, T)
        return self.b(torch.tanh(self.a(x)) * mask.unsqueeze(-1))


@pytest.mark.parametrize("batch", [2, 4, 5])
def test_an_input_the_example_broadcast_against_the_batch_is_split_when_a_call_gives_one_per_sample(batch: int) -> None:
    """Before, a per-sample mask after an example's (1, T) one was kept whole: each micro-batch
    broadcast against all of it (4 rows out for a batch of 2, silently) or failed in a stage."""
    model, reference = twin(Masked())
    pipe = compile_pipeline(model, (torch.randn(4, 6, 4, dtype=torch.float64), torch.ones(1, 6, dtype=torch.float64)), ["cpu", "cpu"], chunks=2)
    g = torch.Generator().manual_seed(batch)
    x, mask = torch.randn(batch, 6, 4, dtype=torch.float64, generator=g), (torch.rand(batch, 6, generator=g) > 0.3).double()
    for m in (mask, torch.ones(1, 6, dtype=torch.float64)):
        out = pipe(x, m)
        torch.testing.assert_close(out, reference(x, m), rtol=0, atol=1e-12)
        out.pow(2).sum().backward()
        reference(x, m).pow(2).sum().backward()
        assert_grads_equal(pipe, reference)


class FlattensItsTime(nn.Module):
    """Sequence-first: flattens time and batch (with `reshape`: a micro-batch cut along dim 1 is
    a slice of the input), and returns its batch along dim 1 through a Function whose backward
    views its gradient, as a kernel that assumes a contiguous one does."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, B, 4)
        t, b, d = x.shape
        h = torch.tanh(self.a(x.reshape(t * b, d)))
        return ViewsItsGradient.apply(self.b(h).view(t, b, 3))


class ViewsItsGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad.view(-1, grad.shape[-1]).mul(2).view(grad.shape)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_the_gradients_of_outputs_cut_along_dim_1_keep_the_caller_s_contiguous_layout(checkpoint: str) -> None:
    """Before, each micro-batch's backward got a slice of the output's gradient along dim 1, not
    contiguous, which the Function's `view` refused, where the plain model's gets a contiguous one."""
    model, reference = twin(FlattensItsTime())
    x = torch.randn(5, 4, 4, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2, chunk_spec={"x": 1}, checkpoint=checkpoint)
    out = pipe(x)
    torch.testing.assert_close(out, reference(x), rtol=0, atol=1e-12)
    out.pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    assert_grads_equal(pipe, reference)


class _Gated(nn.Module):
    """Reads a parameter and a buffer of its own (the top level's), besides its children's."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(4, 4), nn.Linear(4, 4)
        self.gate = nn.Parameter(torch.randn(4))
        self.register_buffer("shift", torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.lin(x) * self.gate + self.shift))


def test_the_models_own_tensors_follow_functional_call_and_assign() -> None:
    """What is set on the pipeline's top level is the model's, which the stages read: before,
    they kept the old `gate` and `shift`, off by 1 and more, without a word."""
    torch.manual_seed(0)
    model = _Gated().double()
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    other = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    with torch.no_grad():
        expected = torch.func.functional_call(copy.deepcopy(model), other, (x,))
        torch.testing.assert_close(torch.func.functional_call(pipe, other, (x,)), expected, rtol=0, atol=1e-12)
    pipe.load_state_dict(other, assign=True)
    assert model.gate is pipe.gate and model.shift is pipe.shift
    reference = copy.deepcopy(model)
    out = pipe(x)
    torch.testing.assert_close(out, reference(x), rtol=0, atol=1e-12)
    out.sum().backward()
    reference(x).sum().backward()
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)


def test_a_put_wakes_only_the_task_that_waits_for_its_key() -> None:
    """Each waiting task has a wake-up of its own: a put sets the one of its key's taker, and no
    other (with one wake-up for all, eight stages would wake seven threads per value for nothing)."""
    from fxpipe.runtime.devices import Aborted, Mailbox, Parcel

    box, got, stopped = Mailbox(), {}, []

    def take(key: int) -> None:
        try:
            got[key] = box.take([key])
        except Aborted:
            stopped.append(key)

    threads = [threading.Thread(target=take, args=(key,)) for key in range(6)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while len(box.waiting) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    wake_ups = {key: takers[0] for key, takers in box.waiting.items()}
    box.put(3, Parcel("three", torch.device("cpu"), []))
    threads[3].join(10)
    assert got == {3: ["three"]}
    assert not any(event.is_set() for event in wake_ups.values())  # 3's was cleared by its taker
    box.abort()  # the others stop waiting, and raise
    for thread in threads:
        thread.join(10)
    assert sorted(stopped) == [0, 1, 2, 4, 5] and not box.waiting


def test_a_worker_runs_each_list_it_is_given_in_order_and_lets_go_of_each_task_once_run() -> None:
    """A stage's tasks are handed over as one list (one wake-up of its thread): they run in
    order, after any list given before, and each task goes (with what it holds) once it ran,
    before the next one waits."""
    from fxpipe.runtime.worker import Workers

    workers = Workers([torch.device("cpu")], name="test-workers")
    ran: list[int] = []
    gone: list[bool] = []
    done = threading.Event()

    class Held:
        pass

    def task(k: int, held: Held) -> Callable[[], None]:
        return lambda: ran.append(k) if held is not None else None

    held = Held()
    first = weakref.ref(held)
    start = threading.Event()  # the worker waits until this test holds nothing of the first task
    tasks = [lambda: None if start.wait(10) else None, task(0, held), lambda: gone.append(first() is None), task(1, Held())]
    workers.submit(0, tasks)
    del tasks, held
    workers.submit(0, [task(2, Held()), done.set])
    start.set()
    assert done.wait(10)
    assert ran == [0, 1, 2] and gone == [True]
    workers.close()
    with pytest.raises(RuntimeError, match="closed"):
        workers.submit(0, [lambda: None])
    for thread in workers.threads:
        thread.join(10)
        assert not thread.is_alive()


@pytest.mark.parametrize("inputs", ["all", "some"])
def test_a_stage_backward_through_the_engine_gives_what_autograd_backward_gives(inputs: str) -> None:
    """A stage's backward calls autograd's engine without torch's Python checks of the gradients
    (made by autograd for those very tensors): `.grad` as `torch.autograd.backward` leaves it,
    bit for bit, with `inputs=` too; inside a functorch transform, torch's own error."""
    from fxpipe.runtime.engine import run_backward

    def grads(backward: Callable[..., None]) -> list[Any]:
        torch.manual_seed(0)
        w, b, x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True), torch.randn(3, dtype=torch.float64, requires_grad=True), torch.randn(4, 5, dtype=torch.float64)
        h = (x @ w + b).tanh()
        outs = [h, h.sum(1)]
        given = [torch.randn_like(h), torch.randn(4, dtype=torch.float64)]
        backward(outs, given, [w] if inputs == "some" else None)
        return [w.grad, b.grad]

    ours = grads(run_backward)
    theirs = grads(lambda outs, given, wanted: torch.autograd.backward(outs, given, inputs=wanted))
    for a, b in zip(ours, theirs):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert ours[0] is not None and (ours[1] is None) == (inputs == "some")

    def inside_a_transform(x: torch.Tensor) -> torch.Tensor:
        y = (x * 2).sum()
        run_backward([y], [torch.ones_like(y)])
        return y

    with pytest.raises(RuntimeError, match="functorch transform"):
        torch.func.grad(inside_a_transform)(torch.randn(3))


@pytest.mark.parametrize("devices", [1, 2])
def test_a_step_is_freed_without_the_garbage_collector_once_its_backward_ran(devices: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step holds no reference to itself: once its backward ran (and the caller let go of
    the loss), reference counting frees it and all it holds (the micro-batches, the parameters'
    leaves), without waiting for the cycle collector to run."""
    from fxpipe.runtime import step as step_module

    made: list[weakref.ref[Any]] = []
    original = step_module.Step.__init__

    def recorded(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(step_module.Step, "__init__", recorded)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe = compile_pipeline(model, x, ["cpu"] * devices, chunks=2)
    gc.collect()
    gc.disable()
    try:
        pipe(x).sum().backward()
        pipe.train_step(x, target=y, loss_fn=nn.functional.mse_loss)
        assert len(made) == 2 and all(ref() is None for ref in made)
    finally:
        gc.enable()


class _ClampsInPlace(nn.Module):
    """Kept whole: writes its input in place, where the graph does not show it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp_(-0.5, 0.5)


class _ClampsFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.clamp, self.a = _ClampsInPlace(), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.a(self.clamp(x)) * mask


def test_an_input_cut_along_dim_1_gets_the_writes_a_module_kept_whole_makes_and_a_broadcast_mask_is_split() -> None:
    """Before, a write into a contiguous copy of a micro-batch's piece never reached the
    caller's tensor (max |x| 2.6 where the plain model leaves 0.5); and a mask of (T, 1, 1) on
    the example, given per sample later, was kept whole (4 samples out for 2)."""
    model, reference = twin(_ClampsFirst())
    x, mask = torch.randn(5, 4, 6, dtype=torch.float64) * 3, torch.rand(5, 1, 1, dtype=torch.float64)
    pipe = compile_pipeline(model, (x.clone(), mask), ["cpu", "cpu"], chunks=2, chunk_spec={"x": 1}, leaf_modules=[_ClampsInPlace], checkpoint="never")
    for m in (mask, torch.rand(5, 4, 1, dtype=torch.float64)):
        ours, theirs = x.clone(), x.clone()
        out, expected = pipe(ours, m), reference(theirs, m)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        out.sum().backward()
        expected.sum().backward()
        assert_grads_equal(pipe, reference)
    ours, theirs = x.clone(), x.clone()
    pipe.train_step(ours, mask, target=torch.zeros(5, 4, 6, dtype=torch.float64), loss_fn=nn.functional.mse_loss)
    reference(theirs, mask)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
