"""A pipeline's life: closing, Ctrl-C in the middle of a step, copies, pickling, names the model
shares with the pipeline, scalar outputs, inputs kept whole, and errors of two stages at once."""
from __future__ import annotations

import _thread
import copy
import gc
import io
import multiprocessing
import os
import pickle
import subprocess
import sys
import threading
import time
import warnings
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import FanOut, assert_grads_equal, twin
import fxpipe.runtime.step
from fxpipe import Pipeline, StageError, compile_pipeline
from fxpipe.compiled.program import OtherCall
from fxpipe.core.failures import Failure, RemoteFailure
from fxpipe.passes.position_tags import CausalityError
from fxpipe.runtime.worker import Workers


def test_a_closed_pipeline_refuses_to_run() -> None:
    pipe = compile_pipeline(FanOut(), torch.randn(4, 6), ["cpu"] * 2)
    pipe.close()
    with pytest.raises(RuntimeError, match="closed"):
        pipe(torch.randn(4, 6))


def test_a_with_block_closes_the_pipeline_at_its_end() -> None:
    """Before, `with` raised Python's own TypeError: no context manager."""
    before = set(threading.enumerate())
    with compile_pipeline(FanOut(), torch.randn(4, 6), ["cpu"] * 2) as pipe:
        pipe(torch.randn(4, 6)).sum().backward()
        workers = [t for t in threading.enumerate() if t not in before and t.name.startswith("fxpipe")]
    assert len(workers) == 2
    with pytest.raises(RuntimeError, match="closed"):
        pipe(torch.randn(4, 6))
    for worker in workers:  # they stop once they see the close
        worker.join(timeout=10)
        assert not worker.is_alive()


class _SlowBackward(torch.autograd.Function):
    interrupt = False  # whether the next backward asks for a Ctrl-C (once)

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if _SlowBackward.interrupt:
            # Asked for from inside the first backward, so that it lands while the step runs
            # however loaded the machine is (a timer thread can be late by more than the step).
            _SlowBackward.interrupt = False
            _thread.interrupt_main()
        time.sleep(0.4)  # 1.6 s of backward in all
        return grad


class Slow(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlowBackward.apply(x)


class WithSlow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.slow, self.b = nn.Linear(6, 6), Slow(), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.slow(torch.tanh(self.a(x))))


def test_ctrl_c_during_backward_stops_the_step_and_leaves_nothing_behind() -> None:
    """In a process of its own, with Python's own Ctrl-C handler: in the full suite, a process
    started from a pytest-xdist worker could inherit SIGINT ignored, and `_thread.interrupt_main()`
    then raises nothing (in the worker itself too, late in the run), as a Ctrl-C would not. One
    stage (its worker runs its tasks on the caller's thread), then two, in the same process."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import signal, sys; sys.path[:0] = [{os.path.dirname(here)!r}, {here!r}]\n"
        "print('SIGINT handler inherited:', signal.getsignal(signal.SIGINT), file=sys.stderr)\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from test_lifecycle import ctrl_c_during_backward\n"
        "for stages in (1, 2):\n"
        "    ctrl_c_during_backward(stages)\n"
        "    print('done', stages)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0 and run.stdout.split() == ["done", "1", "done", "2"], run.stdout[-2000:] + run.stderr[-4000:]


def ctrl_c_during_backward(stages: int) -> None:
    """A Ctrl-C in the middle of a backward: raised to the caller, nothing of the step left
    running or in `.grad`, and the next step exact."""
    model, reference = twin(WithSlow())
    x = torch.randn(8, 6, dtype=torch.float64)
    balance = [4] if stages == 1 else [2, 2]
    pipe = compile_pipeline(model, x, ["cpu"] * stages, chunks=4, leaf_modules=[Slow], balance=balance)
    loss = pipe(x).sum()
    _SlowBackward.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        loss.backward()
    assert not _SlowBackward.interrupt
    time.sleep(1.0)  # what an abandoned step would still add, it would have added by now
    assert all(p.grad is None for p in pipe.parameters())
    pipe(x).sum().backward()
    reference(x).sum().backward()
    assert_grads_equal(pipe, reference)


class Exits(nn.Module):
    """Raises `kind` once armed, on the micro-batch whose first value is negative."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.kind: Optional[type] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.kind is not None and bool(x[0, 0] < 0):
            raise self.kind()
        return self.b(h)


@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("stages", [1, 2])
def test_a_ctrl_c_or_exit_raised_in_a_stage_reaches_the_caller_as_it_is(kind: type, stages: int) -> None:
    """Not wrapped in a StageError, which `except Exception` would swallow."""
    inner = Exits()
    model, reference = twin(nn.Sequential(inner, nn.Linear(6, 6)))
    x = torch.randn(8, 6, dtype=torch.float64)
    x[:, 0] = 1.0
    pipe = compile_pipeline(model, x, ["cpu"] * stages, chunks=4, leaf_modules=[Exits])
    inner.kind = kind
    bad = x.clone()
    bad[4, 0] = -1.0  # micro-batch 2
    with pytest.raises(kind) as raised:
        pipe(bad)
    assert raised.value.fxpipe_where[1:] == (2, "forward")  # type: ignore[attr-defined]
    inner.kind = None
    pipe(x).sum().backward()
    reference(x).sum().backward()
    assert_grads_equal(pipe, reference)


def test_deepcopy_gives_an_independent_pipeline_with_its_own_workers() -> None:
    model, reference = twin(FanOut())
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 3, chunks=4)
    twin_pipe = copy.deepcopy(pipe)
    assert all(a is not b for a, b in zip(twin_pipe.parameters(), pipe.parameters()))
    with torch.no_grad():
        next(twin_pipe.parameters()).add_(1)
    torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-12)
    twin_pipe(x).sum().backward()
    assert all(p.grad is None for p in pipe.parameters())
    assert list(twin_pipe.state_dict()) == list(reference.state_dict())
    twin_pipe.close()  # its workers are its own: the original still runs
    torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-12)


def test_pickling_says_to_save_the_state_dict() -> None:
    pipe = compile_pipeline(FanOut(), torch.randn(4, 6), ["cpu"] * 2)
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(pipe)
    with pytest.raises(TypeError, match="state_dict"):
        torch.save(pipe, io.BytesIO())
    with pytest.raises(TypeError, match=r"shallow-copied \(copy.copy\).*\nHow to fix: copy.deepcopy\(pipe\) gives an independent pipeline"):
        copy.copy(pipe)


def test_a_pipeline_is_indexed_as_its_model_is() -> None:
    """A Sequential's pipeline gives its layers by index and in iteration (the model's own); a model
    without indexing refuses naming what reaches a submodule. Before, both were a bare TypeError."""
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2))
    pipe = compile_pipeline(model, torch.randn(4, 6), ["cpu"] * 2)
    assert pipe[0] is model[0] and pipe[-1] is model[2] and list(pipe) == list(model)  # type: ignore[call-overload]
    assert isinstance(pipe[1:], nn.Sequential) and list(pipe[1:]) == [model[1], model[2]]
    other = compile_pipeline(FanOut(), torch.randn(4, 6), ["cpu"] * 2)
    with pytest.raises(TypeError, match=r"'FanOut' object is not subscriptable.*\nHow to fix: .*pipe.get_submodule"):
        other[0]
    with pytest.raises(TypeError, match="not subscriptable"):
        list(other)  # type: ignore[call-overload]


class Clashing(nn.Module):
    """Children named like the pipeline's own attributes (timm's ConvNeXt has `stages`)."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.plan = nn.Linear(4, 4)
        self.devices = nn.Linear(4, 4)
        self.chunks = nn.Linear(4, 4)
        self.checkpoint = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.checkpoint(self.chunks(self.devices(self.plan(self.stages(x)))))


def test_a_model_may_name_its_children_like_the_pipeline_attributes() -> None:
    """They are the model's, by name too, as torch's tools reach them: before, `pipe.stages` was
    the generated stages, so get_submodule('stages.0'), get_parameter and functional_call
    failed (timm's ConvNeXt, RegNet and CSPNet hold `stages`)."""
    model, reference = twin(Clashing())
    x = torch.randn(6, 4, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 3, chunks=2, checkpoint="never")
    assert list(pipe.state_dict()) == list(reference.state_dict())
    out = pipe(x)
    torch.testing.assert_close(out, reference(x), rtol=0, atol=1e-12)
    out.sum().backward()
    reference(x).sum().backward()
    assert_grads_equal(pipe, reference)
    for name in ("stages", "plan", "devices", "chunks", "checkpoint"):
        assert getattr(pipe, name) is getattr(model, name), name
    assert pipe.get_submodule("stages.2") is model.stages[2] and pipe.get_parameter("plan.weight") is model.plan.weight
    doubled = {name: 2 * p.detach() for name, p in reference.named_parameters()}
    torch.testing.assert_close(torch.func.functional_call(pipe, doubled, (x,)), torch.func.functional_call(reference, doubled, (x,)), rtol=0, atol=1e-12)
    # The pipeline's own, whatever the model's children are called:
    assert len(Pipeline.stages.own(pipe)) == 3 and Pipeline.chunks.own(pipe) == 2 and Pipeline.checkpoint.own(pipe) == "never"
    assert Pipeline.plan.own(pipe).chunks == 2 and Pipeline.devices.own(pipe) == [torch.device("cpu")] * 3


def test_the_pipeline_s_own_attributes_where_no_child_takes_their_names() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    pipe = compile_pipeline(model, torch.randn(6, 4, dtype=torch.float64), ["cpu"] * 2, chunks=3, checkpoint="always")
    assert len(pipe.stages) == 2 and pipe.plan.chunks == 3 and pipe.devices == [torch.device("cpu")] * 2
    assert pipe.chunks == 3 and pipe.checkpoint == "always"
    pipe.checkpoint = "never"  # set as before: the next call checkpoints nothing
    assert pipe.checkpoint == "never" == Pipeline.checkpoint.own(pipe)


class _WithPositions(nn.Module):
    """A parameter of the model's own top level, beside its layers."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(4))
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x + self.pos)))


def _pair() -> tuple[nn.Module, Pipeline, torch.Tensor]:
    torch.manual_seed(0)
    plain = _WithPositions().double()
    x = torch.randn(6, 4, dtype=torch.float64)
    return plain, compile_pipeline(copy.deepcopy(plain), x, ["cpu"] * 2, chunks=2), x


def test_state_dict_hooks_on_the_pipeline_itself_run_as_on_the_plain_model() -> None:
    """Before, the pipeline's own state-dict pre- and post-hooks and load pre-hooks never ran: an
    old checkpoint whose keys a load pre-hook renames loaded nothing, silently with strict=False."""
    plain, pipe, _ = _pair()
    old = {"old." + k: torch.full_like(v, 0.5) for k, v in plain.state_dict().items()}
    seen = {}
    for name, module in (("plain", plain), ("pipe", pipe)):
        calls: list[str] = []
        module.register_state_dict_pre_hook(lambda m, prefix, keep_vars, calls=calls: calls.append("pre"))

        def post(m: nn.Module, state: dict[str, torch.Tensor], prefix: str, local: dict[str, object], calls: list[str] = calls) -> None:
            calls.append("post")
            state["format"] = torch.tensor(2)

        def renamed(m: nn.Module, state: dict[str, torch.Tensor], prefix: str, *rest: object, calls: list[str] = calls) -> None:
            calls.append("load pre")
            for key in [k for k in state if k.startswith("old.")]:
                state[key[4:]] = state.pop(key)
            state.pop("format", None)

        module.register_state_dict_post_hook(post)
        module.register_load_state_dict_pre_hook(renamed)
        keys = list(module.state_dict())
        result = module.load_state_dict(dict(old))
        seen[name] = (calls, keys, result.missing_keys, result.unexpected_keys, module.get_parameter("a.weight").detach().clone())
    assert seen["pipe"][:4] == seen["plain"][:4] and seen["plain"][0] == ["pre", "post", "load pre"], seen
    torch.testing.assert_close(seen["pipe"][4], torch.full((4, 4), 0.5, dtype=torch.float64), rtol=0, atol=0)


def test_the_model_s_own_load_post_hooks_run_as_on_the_plain_model() -> None:
    """Registered on the model before compiling, they may mend the keys a strict load checks.
    Before, pipe.load_state_dict skipped them: a load the plain model takes was refused."""
    plain, pipe, _ = _pair()
    state = {k: v for k, v in plain.state_dict().items() if k != "pos"}
    seen: list[str] = []

    def mends(module: nn.Module, keys: Any) -> None:
        seen.append(type(module).__name__)
        if "pos" in keys.missing_keys:
            keys.missing_keys.remove("pos")

    for module in (plain, pipe):  # the pipeline's model is its own copy: its hook, registered on it
        owner = module if module is plain else pipe._owner
        owner.register_load_state_dict_post_hook(mends)
        module.load_state_dict(state)
    assert seen == ["_WithPositions", "_WithPositions"], seen


def test_a_deep_copy_keeps_what_was_set_on_the_pipeline_itself() -> None:
    """Before, the copy lost the hooks and attributes set on the pipeline: a pre-hook that scaled
    the input made the copies of the plain model and of the pipeline differ by 0.5."""
    plain, pipe, x = _pair()
    for module in (plain, pipe):
        module.register_forward_pre_hook(lambda m, args: (2 * args[0],))
        module.register_full_backward_hook(lambda m, grad_in, grad_out: (3 * grad_in[0],))  # type: ignore[index]
    pipe.note = "kept"  # type: ignore[assignment]
    loaded: list[nn.Module] = []
    for module in (plain, pipe):
        module.register_load_state_dict_pre_hook(lambda m, *rest: loaded.append(m))
    plain_copy, pipe_copy = copy.deepcopy(plain), copy.deepcopy(pipe)
    # A hook that holds its module holds the copy (before: the original, dead, or a third pipeline).
    for copied in (plain_copy, pipe_copy):
        copied.load_state_dict(copied.state_dict())
    assert loaded == [plain_copy, pipe_copy], loaded
    assert pipe_copy.note == "kept" and pipe_copy._forward_pre_hooks and pipe_copy._backward_hooks
    given = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    out, expected = pipe_copy(given[0]), plain_copy(given[1])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    torch.testing.assert_close(given[0].grad, given[1].grad, rtol=0, atol=1e-12)
    assert_grads_equal(pipe_copy, plain_copy)


def test_apply_reaches_the_model_itself_as_on_the_plain_model() -> None:
    """Before, `fn` ran on the pipeline in the model's place: an initialisation that picks the
    model by its class left its own parameters as they were."""
    plain, pipe, x = _pair()

    def init(m: nn.Module) -> None:
        if isinstance(m, _WithPositions):
            nn.init.normal_(m.pos, std=0.5)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.3)

    for module in (plain, pipe):
        torch.manual_seed(1)
        assert module.apply(init) is module
    assert plain.get_parameter("pos").abs().sum() > 0
    torch.testing.assert_close(pipe(x), plain(x), rtol=0, atol=1e-12)


def test_a_backward_hook_of_the_deprecated_form_on_the_pipeline_is_refused_naming_the_full_one() -> None:
    """It would see the gradient of the pipeline's own last operation, and what it returned
    reached no parameter: before, every gradient was half the plain model's."""
    plain, pipe, x = _pair()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation of the form
        pipe.register_backward_hook(lambda m, grad_in, grad_out: None)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), plain(x), rtol=0, atol=1e-12)  # nothing to hook: it runs
    with pytest.raises(RuntimeError, match="How to fix: register it with register_full_backward_hook"):
        pipe(x)


class Loss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).pow(2).mean()


def test_a_model_returning_a_loss_works_with_one_chunk_and_in_train_step_with_more() -> None:
    model, reference = twin(Loss())
    x = torch.randn(6, 4, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=1)
    loss = pipe(x)
    assert loss.dim() == 0
    loss.backward()
    reference(x).backward()
    assert_grads_equal(pipe, reference)
    model, reference = twin(Loss())
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=3)
    with pytest.raises(ValueError, match="(?s)a value made from the whole batch.*train_step.*chunks=1"):
        pipe(x)
    loss = pipe.train_step(x)  # the model's loss is a mean over samples: micro-batches weighted by size
    expected = reference(x)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)


class Reducing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).mean(0, keepdim=True).expand(5, 4)


def test_an_output_whose_dim_0_is_not_the_batch_is_refused() -> None:
    pipe = compile_pipeline(Reducing(), torch.randn(6, 4), ["cpu"], chunks=2)
    with pytest.raises(ValueError, match=r"a value made from the whole batch(.|\n)*How to fix"):
        pipe(torch.randn(6, 4))


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)) * mask.sum(0))


def test_chunk_spec_keeps_an_input_whole_that_looks_batched() -> None:
    model, reference = twin(Masked())
    x = torch.randn(4, 4, dtype=torch.float64)
    mask = torch.rand(4, 4, dtype=torch.float64, requires_grad=True)  # dim 0 equals the batch
    pipe = compile_pipeline(model, (x, mask), ["cpu"] * 2, chunks=2, chunk_spec={"mask": None})
    out = pipe(x, mask)
    mask_ref = mask.detach().clone().requires_grad_()
    expected = reference(x, mask_ref)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(mask.grad, mask_ref.grad, rtol=0, atol=1e-10)
    assert_grads_equal(pipe, reference)


class Transposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x.transpose(0, 1))


def test_chunk_spec_splits_along_another_dim() -> None:
    model, reference = twin(Transposed())
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)  # batch along dim 1
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=3, chunk_spec={"x": 1})
    out = pipe(x)
    assert out.shape == (6, 4)
    x_ref = x.detach().clone().requires_grad_()
    torch.testing.assert_close(out, reference(x_ref), rtol=0, atol=1e-12)
    out.pow(2).sum().backward()
    reference(x_ref).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-10)


class Bomb(nn.Module):
    """Raises on the `fuse`-th call while armed. The earlier stage's bomb (tag 0) says when it has
    gone off and waits a little before raising; the later one's waits for that, then raises at
    once: both tasks are running, and the later stage's error is the first one raised."""

    def __init__(self, tag: int, fuse: int, lit: threading.Event) -> None:
        super().__init__()
        self.tag, self.fuse, self.lit, self.linear = tag, fuse, lit, nn.Linear(4, 4)
        self.armed, self.calls = False, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        call, self.calls = self.calls, self.calls + 1
        if self.armed and call == self.fuse:
            if self.tag == 0:
                self.lit.set()
                time.sleep(0.1)
            else:
                self.lit.wait(5.0)
            raise ValueError(f"boom {self.tag}")
        return self.linear(x)


class TwoBombs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        lit = threading.Event()
        self.first, self.second = Bomb(0, fuse=1, lit=lit), Bomb(1, fuse=0, lit=lit)

    def arm(self, armed: bool) -> None:
        self.first.lit.clear()
        for bomb in (self.first, self.second):
            bomb.armed, bomb.calls = armed, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def test_when_two_stages_fail_in_one_tick_the_first_in_schedule_order_is_reported() -> None:
    """Micro-batch 1 fails on stage 0 at tick 1; micro-batch 0 fails on stage 1 at tick 1 too.
    The report names stage 0, whichever thread raised first."""
    model = TwoBombs()
    x = torch.randn(3, 4)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=3, leaf_modules=[Bomb], balance=[2, 1])
    model.arm(True)
    with pytest.raises(StageError, match="boom 0") as info:
        pipe(x)
    model.arm(False)
    assert (info.value.stage, info.value.micro_batch) == (0, 1)
    torch.testing.assert_close(pipe(x), model(x))


def test_a_stage_error_prints_nothing(capfd: pytest.CaptureFixture[str]) -> None:
    model = TwoBombs()
    x = torch.randn(2, 4)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2, leaf_modules=[Bomb], balance=[2, 1])
    model.arm(True)
    with pytest.raises(StageError):
        pipe(x)
    model.arm(False)
    assert capfd.readouterr().err == ""


def test_a_stuck_pipeline_fails_within_the_wait_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A task whose input never comes (an edge lost, say) is reported, not waited on forever."""

    monkeypatch.setattr(fxpipe.runtime.step, "WAIT_TIMEOUT", 0.5)
    model = FanOut()
    pipe = compile_pipeline(model, torch.randn(4, 6), ["cpu"] * 3, chunks=2)
    runtime = pipe.program().stages[0]
    lost = next(name for name, consumers in runtime.consumers.items() if 1 in consumers)
    monkeypatch.setitem(runtime.consumers, lost, [c for c in runtime.consumers[lost] if c != 1])
    start = time.monotonic()
    with pytest.raises(StageError, match="stuck"):
        pipe(torch.randn(4, 6))
    assert time.monotonic() - start < 5


class WritesItsInput(nn.Module):
    """Writes a part of a tuple input in place (pipelining's `test_tuple_inplace` shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        foo, bar = pair
        h = torch.tanh(self.a(foo))
        bar.add_(1)
        return self.b(h) * bar


@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
@pytest.mark.parametrize("stages", [1, 2])
def test_an_input_written_in_place_is_written_as_the_plain_model_writes_it(stages: int, mode: str) -> None:
    model, reference = twin(WritesItsInput())
    foo, bar = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    foo_ref, bar_ref = foo.clone(), bar.clone()
    pipe = compile_pipeline(model, ((foo.clone(), bar.clone()),), ["cpu"] * stages, chunks=2, checkpoint=mode)
    out = pipe((foo, bar))
    expected = reference((foo_ref, bar_ref))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(bar, bar_ref, rtol=0, atol=0)
    out.sum().backward()
    expected.sum().backward()
    assert_grads_equal(pipe, reference)


class WritesItsInputTwice(nn.Module):
    """Writes its input in place, computes, and writes it again."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        h = self.b(torch.tanh(self.a(x * 1)))
        x.add_(h)
        return self.c(torch.relu(h))


@pytest.mark.parametrize("mode", ["always", "never"])
@pytest.mark.parametrize("stages", [2, 3])
def test_an_input_written_at_two_places_is_written_by_one_stage(stages: int, mode: str) -> None:
    """Before, an automatic cut between the two writes left the caller's tensor with the first
    write only (1.3 off)."""
    model, reference = twin(WritesItsInputTwice())
    pipe = compile_pipeline(model, torch.randn(8, 6, dtype=torch.float64), ["cpu"] * stages, chunks=4, checkpoint=mode)
    given = torch.randn(8, 6, dtype=torch.float64)
    x, x_ref = given.clone(), given.clone()
    out, expected = pipe(x), reference(x_ref)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(x, x_ref, rtol=0, atol=1e-12)
    out.sum().backward()
    expected.sum().backward()
    assert_grads_equal(pipe, reference)
    x, x_ref = given.clone(), given.clone()
    y = torch.randn(8, 6, dtype=torch.float64)
    loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    expected = F.mse_loss(reference(x_ref), y)
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(x, x_ref, rtol=0, atol=1e-12)
    x, x_ref = given.clone(), given.clone()
    got = torch.autograd.grad(pipe(x).sum(), list(pipe.parameters()))
    for grad, want in zip(got, torch.autograd.grad(reference(x_ref).sum(), list(reference.parameters()))):
        torch.testing.assert_close(grad, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(x, x_ref, rtol=0, atol=1e-12)
    pipe.zero_grad()  # (train_step filled the pipeline's alone)
    reference.zero_grad()
    x, x_ref, z, z_ref = given.clone(), given.clone(), -given, -given  # two forwards before one backward
    (pipe(x).sum() + pipe(z).pow(2).sum()).backward()
    (reference(x_ref).sum() + reference(z_ref).pow(2).sum()).backward()
    assert_grads_equal(pipe, reference)
    torch.testing.assert_close(torch.cat([x, z]), torch.cat([x_ref, z_ref]), rtol=0, atol=1e-12)
    with torch.no_grad():
        x, x_ref = given.clone(), given.clone()
        torch.testing.assert_close(pipe.eval()(x), reference.eval()(x_ref), rtol=0, atol=1e-12)
        torch.testing.assert_close(x, x_ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("pair", [False, True], ids=["written twice", "a part of a tuple"])
def test_an_input_written_in_place_that_requires_grad_is_refused(pair: bool) -> None:
    """Before, a loss that read the caller's tensor after the call got its input's gradient
    through the value before the write: 9.5 to 10 off, with no error. The pipeline writes the caller's
    tensor outside autograd; it now refuses, and leaves the tensor as it was."""
    model, width = (WritesItsInput(), 4) if pair else (WritesItsInputTwice(), 6)
    model.double()
    other = torch.randn(8, width, dtype=torch.float64)
    pipe = compile_pipeline(model, ((other, other.clone()),) if pair else other, ["cpu"] * 2, chunks=4)
    x = torch.randn(8, width, dtype=torch.float64, requires_grad=True) * 1
    before = x.detach().clone()
    call = (lambda: pipe((other, x))) if pair else (lambda: pipe(x))
    with pytest.raises(RuntimeError, match=f"writes its input {'pair' if pair else 'x'!r} in place, and it requires grad"):
        call()
    torch.testing.assert_close(x.detach(), before, rtol=0, atol=0)
    with torch.no_grad():
        call()
    assert not torch.equal(x.detach(), before)


class WritesOneReadsOther(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.b(torch.tanh(self.a(y)))


@pytest.mark.parametrize("stages,chunks", [(1, 1), (2, 4)])
@pytest.mark.parametrize("other", ["the same tensor", "a view of it"])
def test_an_input_written_in_place_that_shares_memory_with_another_is_refused(stages: int, chunks: int, other: str) -> None:
    """`model(t, t)`: the plain model's write of x shows through y. Before, a stage wrote its own
    copy of x, and y was read unwritten: 0.34 off, with no error."""
    model, reference = twin(WritesOneReadsOther())
    example = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, (example, example.clone()), ["cpu"] * stages, chunks=chunks)
    t = torch.randn(8, 6, dtype=torch.float64)
    before = t.clone()
    with torch.no_grad(), pytest.raises(ValueError, match="writes its input 'x' in place, and 'y' shares its memory"):
        pipe(t, t if other == "the same tensor" else t[:, :])
    torch.testing.assert_close(t, before, rtol=0, atol=0)
    x, y = t.clone(), t.clone()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x, y), reference(t.clone(), y.clone()), rtol=0, atol=1e-12)
    torch.testing.assert_close(x, 2 * t, rtol=0, atol=0)


@pytest.mark.parametrize("stages,chunks", [(1, 1), (2, 4)])
def test_disjoint_views_of_one_tensor_one_written_in_place_run_as_the_plain_model(stages: int, chunks: int) -> None:
    """Before, they were refused as sharing memory, though neither write shows through the other."""
    model, reference = twin(WritesOneReadsOther())
    example = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, (example, example.clone()), ["cpu"] * stages, chunks=chunks)
    packed = torch.randn(8, 12, dtype=torch.float64)
    theirs = packed.clone()
    with torch.no_grad():
        out, expected = pipe(packed[:, :6], packed[:, 6:]), reference(theirs[:, :6], theirs[:, 6:])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(packed, theirs, rtol=0, atol=0)
    with torch.no_grad(), pytest.raises(ValueError, match="writes its input 'x' in place, and 'y' shares its memory"):
        pipe(packed[:, :6], packed[:, 3:9])  # overlapping columns


def test_a_cut_between_two_writes_of_an_input_is_refused() -> None:
    with pytest.raises(ValueError, match=r"the input 'x' is written in place by stages \[0, 1\]"):
        compile_pipeline(WritesItsInputTwice(), torch.randn(8, 6), ["cpu"] * 2, chunks=4, split_points=["a"])


def test_an_input_written_in_place_and_passed_whole_is_refused() -> None:
    pipe = compile_pipeline(WritesItsInput(), ((torch.randn(6, 4), torch.randn(6, 4)),), ["cpu"], chunks=2)
    with pytest.raises(ValueError, match="writes its input 'pair' in place"):
        pipe((torch.randn(6, 4), torch.randn(1, 4)))


@pytest.mark.parametrize("view", [False, True], ids=["leaf", "view of a leaf"])
def test_an_input_written_in_place_that_is_a_leaf_requiring_grad_is_refused_as_the_plain_model_refuses_it(view: bool) -> None:
    """The plain model raises at the write; the stages would write their own slices silently.
    Under no_grad PyTorch allows the write, and so does the pipeline."""
    model, reference = twin(WritesItsInput())
    foo = torch.randn(6, 4, dtype=torch.float64)
    pipe = compile_pipeline(model, ((foo, torch.randn(6, 4, dtype=torch.float64)),), ["cpu"] * 2, chunks=2)
    leaf = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    bar = leaf[:, :] if view else leaf
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad is being used in an in-place operation"):
        reference((foo, bar))
    with pytest.raises(RuntimeError, match=r"writes its input 'pair' in place, and it is a leaf that requires grad \(or a view of one\)"):
        pipe((foo, bar))
    assert leaf._version == 0, "the caller's tensor is untouched"
    mine, theirs = leaf.detach().clone().requires_grad_(), leaf.detach().clone().requires_grad_()
    with torch.no_grad():
        out, expected = pipe((foo, mine)), reference((foo, theirs))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_closing_between_forward_and_backward_makes_the_backward_raise() -> None:
    """The backward's stage work has no thread left to run it: it raises instead of waiting for
    ever."""
    model = FanOut().double()
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    out = pipe(x)
    pipe.close()
    with pytest.raises(RuntimeError, match=r"(?s)closed \(pipe.close\(\)\) while a step still had work to run.*close it after the last backward"):
        out.sum().backward()


class _ScalesByMode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.c(torch.tanh(h * 2 if self.training else h * 0.5))


def test_eval_and_train_called_on_the_model_itself_reach_the_pipeline() -> None:
    model = _ScalesByMode().double()
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2, split_points=["c"])
    model.eval()
    torch.testing.assert_close(pipe(x), model(x), rtol=0, atol=1e-12)
    assert not pipe.training
    model.train()
    torch.testing.assert_close(pipe(x), model(x), rtol=0, atol=1e-12)
    assert pipe.training


@pytest.mark.parametrize("collector_on", [True, False])
@pytest.mark.parametrize("fails", [False, True])
def test_compiling_holds_the_collector_off_and_leaves_it_as_it_was(monkeypatch: pytest.MonkeyPatch, collector_on: bool, fails: bool) -> None:
    """A full collection walks every object of the process; compiling builds many that live to
    its end, so it holds the cyclic collector off, and then leaves it on or off as it found it,
    also when compiling fails."""
    import gc

    import fxpipe.compile as compiling

    seen: list[bool] = []
    costs = compiling.annotate_costs

    def noting(gm: torch.fx.GraphModule) -> None:
        seen.append(gc.isenabled())
        if fails:
            raise RuntimeError("a pass failed")
        costs(gm)

    monkeypatch.setattr(compiling, "annotate_costs", noting)
    was_on = gc.isenabled()
    (gc.enable if collector_on else gc.disable)()
    try:
        if fails:
            with pytest.raises(RuntimeError, match="a pass failed"):
                compile_pipeline(FanOut(), torch.randn(4, 6), ["cpu"] * 2)
        else:
            compile_pipeline(FanOut(), torch.randn(4, 6), ["cpu"] * 2).close()
        assert seen == [False], "the collector was off in the middle of compiling"
        assert gc.isenabled() is collector_on, "and as it was after"
    finally:
        (gc.enable if was_on else gc.disable)()


def _loss_of_a_pipeline_let_go(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4)
    return F.mse_loss(pipe(x), y)  # the pipeline goes out of scope here; its output's graph lives on


def test_a_pipeline_let_go_of_before_the_backward_of_its_output_lives_until_that_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the pipeline's garbage collection stopped its workers while its output's graph
    still needed them: the backward waited for ever. The plain model's graph keeps its weights."""
    monkeypatch.setattr(fxpipe.runtime.step, "WAIT_TIMEOUT", 10.0)
    model, plain = twin(FanOut())
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    threads = threading.active_count()
    loss = _loss_of_a_pipeline_let_go(model, x, y)
    gc.collect()
    loss.backward()
    F.mse_loss(plain(x), y).backward()
    assert_grads_equal(model, plain, tol=1e-12)
    del loss
    gc.collect()
    deadline = time.monotonic() + 10
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() <= threads  # the workers stop once nothing needs them


def test_two_threads_calling_one_pipeline_take_turns_and_each_gets_the_plain_model_s_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the two steps' task lists interleaved in the workers' queues in opposite orders
    (a thread switch between one step's submits, forced here by a pause) and both waited on
    each other; or one call saw the other's leaves in the model's slots and was refused as a
    call of `torch.func.functional_call`."""
    monkeypatch.setattr(fxpipe.runtime.step, "WAIT_TIMEOUT", 10.0)
    model, plain = twin(FanOut())
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, schedule="1f1b")
    submit = Workers.submit

    def paused(self: Workers, stage: int, tasks: list) -> None:  # type: ignore[type-arg]
        submit(self, stage, tasks)
        if stage == 0 and threading.current_thread().name == "first":
            time.sleep(0.05)

    monkeypatch.setattr(Workers, "submit", paused)
    losses: dict[str, list[torch.Tensor]] = {"first": [], "second": []}
    outputs: list[torch.Tensor] = []

    def steps() -> None:
        for _ in range(3):
            losses[threading.current_thread().name].append(pipe.train_step(x, target=y, loss_fn=F.mse_loss))
            with torch.no_grad():
                outputs.append(pipe(x))

    threads = [threading.Thread(target=steps, name=name) for name in losses]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    expected = F.mse_loss(plain(x), y)
    for _ in range(6):
        expected.backward(retain_graph=True)
    assert len(outputs) == 6 and all(torch.allclose(o, plain(x), rtol=0, atol=1e-12) for o in outputs)
    assert all(torch.allclose(loss, expected.detach(), rtol=0, atol=1e-12) for found in losses.values() for loss in found)
    assert_grads_equal(model, plain, tol=1e-11)


def _call_in_child(pipe: object, x: torch.Tensor, conn: object) -> None:
    try:
        with torch.no_grad():
            pipe(x)  # type: ignore[operator]
        conn.send("ran")  # type: ignore[attr-defined]
    except RuntimeError as error:
        conn.send(str(error))  # type: ignore[attr-defined]


def test_a_pipeline_called_in_a_forked_child_refuses_saying_why() -> None:
    """Before, the call waited for ever on stage threads that a forked child (a DataLoader
    worker) does not have."""
    pipe = compile_pipeline(FanOut(), torch.randn(8, 6), ["cpu", "cpu"], chunks=2)
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_call_in_child, args=(pipe, torch.randn(8, 6), send))
    child.start()
    try:
        said = receive.recv() if receive.poll(60) else "nothing in 60 s"
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join(10)
    assert "called in a process forked from the one that compiled it" in said and "How to fix" in said, said
    pipe(torch.randn(8, 6))  # the parent's pipeline runs on


def test_the_library_s_errors_pickle_as_they_were() -> None:
    """multiprocessing hands a worker's error back pickled. Before, a StageError, a
    RemoteFailure and an OtherCall failed to unpickle (a Pool's result thread died on it), and
    a CausalityError came back with one line per letter of its message."""
    model = nn.Sequential(nn.Linear(4, 4), _Fails(), nn.Linear(4, 4))
    pipe = compile_pipeline(model, torch.randn(4, 4), ["cpu", "cpu"], chunks=2, leaf_modules=[_Fails])
    with pytest.raises(StageError) as raised:
        pipe(torch.full((4, 4), -1000.0))
    raised.value.add_note("a note")
    failure = Failure(1, 2, 0, "forward", "ValueError: no")
    errors = [
        raised.value, StageError(1, 2, "backward", RemoteFailure(failure), rank=1), RemoteFailure(failure),
        CausalityError(["cumsum (h, line 3)"], fix="something"), OtherCall("another call", ("kind", 1)),
    ]  # fmt: skip
    for error in errors:
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error)
        assert {k: v for k, v in vars(again).items() if k != "failure"} == {k: v for k, v in vars(error).items() if k != "failure"}
    assert pickle.loads(pickle.dumps(raised.value)).__notes__ == ["a note"]


class _Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.min() < -100:
            raise ValueError("an input below -100")
        return x
