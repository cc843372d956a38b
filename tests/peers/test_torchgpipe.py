"""torchgpipe's test suite (tests/, tests/skip/), re-expressed as compile_pipeline tests."""
from __future__ import annotations

import time
import warnings
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe import StageError, compile_pipeline, is_checkpointing, is_recomputing
from peer_common import ATOL, CPU2, assert_same, check_step, cpus, fresh, stage_modules, twin64

MODES = ["never", "always", "except_last"]


def x64(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


class Chain(nn.Module):
    """Four small linear layers with tanh between them."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 5)
        self.b = nn.Linear(5, 4)
        self.c = nn.Linear(4, 4)
        self.d = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))))


class Recorder(nn.Module):
    """Identity that logs (is_checkpointing, is_recomputing) on every call."""

    def __init__(self, log: list[tuple[bool, bool]]) -> None:
        super().__init__()
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append((is_checkpointing(), is_recomputing()))
        return x


class Armed(nn.Module):
    """Raises once armed (after compiling); kept whole as a leaf module."""

    class Expected(Exception):
        pass

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__()
        self.armed = False
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise Armed.Expected("boom")
        return x * 1.0


class Slow(nn.Module):
    """Sleeps in each call and logs it; kept whole as a leaf module."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        self.calls.append(x.shape[0])
        return x * 1.0


# -- tests/test_gpipe.py ------------------------------------------------------------------------


def test_parameters_are_the_models() -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_parameters."""
    model, _ = twin64(nn.Sequential(nn.Linear(2, 2)))
    pipe = compile_pipeline(model, x64(4, 2), ["cpu"])
    params = list(pipe.parameters())
    assert params, "the pipeline has no parameters"
    assert [id(p) for p in params] == [id(p) for p in model.parameters()]


def test_public_attributes() -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_public_attrs (fxpipe refuses a float `chunks`
    instead of truncating it, as issue 10 item 9 asks)."""
    model, _ = twin64(nn.Sequential(nn.Linear(2, 2)))
    pipe = compile_pipeline(model, x64(4, 2), ("cpu",), chunks=2, checkpoint="always")
    assert pipe.devices == [torch.device("cpu")]
    assert pipe.chunks == 2 and type(pipe.chunks) is int
    assert pipe.checkpoint == "always" and type(pipe.checkpoint) is str
    with pytest.raises(ValueError, match="chunks"):
        compile_pipeline(model, x64(4, 2), ["cpu"], chunks=2.0)  # type: ignore[arg-type]


def test_module_tree_is_the_models() -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_sequential_like, ::test_named_children and
    ::test_partitions: the pipeline's children, parameter names and state-dict keys are the
    model's own (no `partitions.N.` prefix), and its stages are generated modules."""
    model, _ = twin64(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    pipe = compile_pipeline(model, x64(4, 2), CPU2, split_points=["1"])
    assert [n for n, _ in pipe.named_children()] == [n for n, _ in model.named_children()]
    assert dict(pipe.named_children())["0"] is model[0]
    assert dict(pipe.named_children())["1"] is model[1]
    assert list(pipe.state_dict()) == list(model.state_dict())
    assert len(pipe.stages) == 2
    assert all(isinstance(s, torch.fx.GraphModule) for s in pipe.stages)


def test_balance_counts_that_do_not_fit() -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_balance_wrong_length and
    ::test_recommend_auto_balance: node counts whose sum or length disagrees with the graph or
    the devices are a clear ValueError."""
    model, _ = twin64(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    for balance in ([1], [3], [1, 2]):
        with pytest.raises(ValueError):
            compile_pipeline(model, x64(4, 2), CPU2, balance=balance)


def test_balance_less_than_one() -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_balance_less_than_1."""
    model, _ = twin64(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    for balance in ([0, 2], [-1, 3]):
        with pytest.raises(ValueError, match="balance"):
            compile_pipeline(model, x64(4, 2), CPU2, balance=balance)


def test_chunks_less_than_one() -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_chunks_less_than_1."""
    model, _ = twin64(nn.Sequential(nn.Linear(2, 2)))
    for chunks in (0, -1):
        with pytest.raises(ValueError, match="chunks"):
            compile_pipeline(model, x64(4, 2), ["cpu"], chunks=chunks)


def test_balance_and_devices_disagree() -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_too_few_devices and ::test_devices (fxpipe
    has one stage per device, so a balance of another length is refused, not truncated)."""
    model, _ = twin64(nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)]))
    with pytest.raises(ValueError):
        compile_pipeline(model, x64(4, 2), ["cpu"], balance=[1, 1, 1, 1])
    with pytest.raises(ValueError):
        compile_pipeline(model, x64(4, 2), cpus(5), balance=[1, 1, 1, 1])


@pytest.mark.parametrize("batch", [7, 2], ids=["indivisible", "smaller-than-chunks"])
def test_batch_sizes_chunks_do_not_divide(batch: int) -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_batch_size_indivisible and
    ::test_batch_size_small: legal, silent, and exact."""
    model, reference = twin64(Chain())
    pipe = compile_pipeline(model, x64(8, 3), CPU2, chunks=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_step(pipe, reference, (x64(batch, 3),))


@pytest.mark.parametrize("mode,expected", [("always", 2), ("except_last", 1), ("never", 0)])
def test_which_micro_batches_are_checkpointed(mode: str, expected: int) -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_checkpoint_mode: with 2 micro-batches,
    'always' checkpoints both, 'except_last' one, 'never' none; each is recomputed once."""
    log: list[tuple[bool, bool]] = []
    model, reference = twin64(nn.Sequential(nn.Linear(2, 2), Recorder(log), nn.Linear(2, 2)))
    pipe = compile_pipeline(model, x64(4, 2), ["cpu"], chunks=2, checkpoint=mode, leaf_modules=[Recorder])
    log.clear()
    check_step(pipe, reference, (x64(4, 2),))  # the reference logs into its own copy of the list
    assert sum(c for c, _ in log) == expected
    assert sum(r for _, r in log) == expected


def test_checkpoint_mode_invalid() -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_checkpoint_mode_invalid."""
    model, _ = twin64(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        compile_pipeline(model, x64(4, 2), ["cpu"], chunks=2, checkpoint="INVALID")


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_modes_at_one_chunk(mode: str) -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_checkpoint_mode_when_chunks_1."""
    model, reference = twin64(Chain())
    pipe = compile_pipeline(model, x64(4, 3), CPU2, chunks=1, checkpoint=mode)
    check_step(pipe, reference, (x64(4, 3),))


def test_eval_mode_does_not_checkpoint() -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_checkpoint_eval."""
    log: list[tuple[bool, bool]] = []
    model, reference = twin64(nn.Sequential(nn.Linear(2, 2), Recorder(log)))
    pipe = compile_pipeline(model, x64(4, 2), ["cpu"], chunks=2, leaf_modules=[Recorder])
    log.clear()
    pipe.train()
    pipe(x64(4, 2)).sum().backward()
    assert any(c for c, _ in log) and any(r for _, r in log)
    log.clear()
    pipe.eval()
    reference.eval()
    x = x64(4, 2)
    assert_same(pipe(x), reference(x))
    assert log and all(entry == (False, False) for entry in log)


def test_no_grad_builds_no_graph() -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_no_grad: under no_grad no stage output
    carries a grad_fn."""
    seen: list[Optional[Any]] = []
    model, reference = twin64(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.grad_fn))
    pipe = compile_pipeline(model, x64(4, 2), CPU2, chunks=2, split_points=["1"])
    seen.clear()
    x = x64(4, 2)
    with torch.no_grad():
        out = pipe(x)
        ref = reference(x)
    assert_same(out, ref)
    assert out.grad_fn is None
    assert seen and all(g is None for g in seen)


def test_exception_in_a_stage() -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_exception: the stage's exception reaches the
    caller (as fxpipe.StageError with the original as its cause)."""
    armed = Armed()
    model, _ = twin64(nn.Sequential(nn.Linear(1, 1), armed))
    pipe = compile_pipeline(model, x64(2, 1), ["cpu"], leaf_modules=[Armed])
    armed.armed = True
    with pytest.raises(StageError) as info:
        pipe(x64(2, 1))
    assert isinstance(info.value.__cause__, Armed.Expected)


def test_exception_stops_earlier_stages_early() -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_exception_early_stop_asap: when the last
    stage fails on the first micro-batch, the slow stage before it does not go on to the
    third."""
    slow, armed = Slow(0.1), Armed()
    model, _ = twin64(nn.Sequential(nn.Identity(), nn.Linear(1, 1), slow, armed))
    pipe = compile_pipeline(model, x64(3, 1), cpus(4), chunks=3, balance=[1, 1, 1, 1], leaf_modules=[Slow, Armed])
    armed.armed = True
    slow.calls.clear()
    with pytest.raises(StageError):
        pipe(x64(3, 1))
    assert len(slow.calls) <= 2  # without the early stop it would be 3 (torchgpipe's clock stops at 2)


def test_tuple_input_pair() -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_input_pair."""

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc_a = nn.Linear(1, 1)
            self.fc_b = nn.Linear(1, 1)

        def forward(self, a_and_b: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            a, b = a_and_b
            return self.fc_a(a), self.fc_b(b)

    model, reference = twin64(Two())
    pipe = compile_pipeline(model, ((x64(10, 1), x64(10, 1)),), CPU2, chunks=2)
    check_step(pipe, reference, ((x64(10, 1), x64(10, 1)),))


def test_tuple_input_singleton() -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_input_singleton."""

    class One(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(1, 1)

        def forward(self, only_a: tuple[torch.Tensor]) -> tuple[torch.Tensor]:
            (a,) = only_a
            return (self.fc(a),)

    model, reference = twin64(One())
    pipe = compile_pipeline(model, ((x64(10, 1),),), ["cpu"], chunks=2)
    check_step(pipe, reference, ((x64(10, 1),),))


def test_too_many_arguments() -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_input_varargs: TypeError, as the model."""
    model, _ = twin64(nn.Sequential(nn.Linear(1, 1)))
    pipe = compile_pipeline(model, x64(2, 1), ["cpu"])
    with pytest.raises(TypeError):
        pipe(x64(2, 1), x64(2, 1))


def test_non_tensor_output() -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_non_tensor: where torchgpipe refuses, fxpipe
    returns what the plain model returns; a batch that is not a tensor is refused."""

    class Hello(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(1, 1)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, str]:
            return self.fc(x), "hello"

    class OnlyHello(nn.Module):
        def forward(self, x: torch.Tensor) -> str:
            return "hello"

    model, reference = twin64(Hello())
    pipe = compile_pipeline(model, x64(4, 1), ["cpu"], chunks=2)
    check_step(pipe, reference, (x64(4, 1),))
    try:
        only = compile_pipeline(OnlyHello(), x64(4, 1), ["cpu"], chunks=2)
    except ValueError as error:  # nothing to place on a stage: a clear refusal is fine
        assert "stage" in str(error)
        return
    assert only(x64(4, 1)) == "hello"
    with pytest.raises((TypeError, ValueError)):
        only("hello")


def test_non_tensor_in_tuple_output() -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_non_tensor_tuple: a string beside a tensor
    in the output comes back as the plain model returns it."""

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, str]:
            return self.fc(x), "hello"

    model, reference = twin64(Pair())
    pipe = compile_pipeline(model, x64(4, 2), ["cpu"], chunks=2, checkpoint="always")
    check_step(pipe, reference, (x64(4, 2),))


@pytest.mark.parametrize("mode", MODES)
def test_deferred_batch_norm_running_stats(mode: str) -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_deferred_batch_norm: the running statistics
    after a step equal the plain BatchNorm's on the whole batch."""
    model, reference = twin64(nn.Sequential(nn.BatchNorm2d(3)))
    x = x64(4, 3, 5, 5) * 3 + 1
    pipe = compile_pipeline(model, x, ["cpu"], chunks=2, checkpoint=mode, deferred_batch_norm=True)
    pipe(fresh(x)).mean().backward()
    reference(fresh(x)).mean().backward()
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(model[0], name), getattr(reference[0], name), rtol=0, atol=ATOL)


@pytest.mark.parametrize("mode", ["never", "always"])
def test_deferred_batch_norm_parameter_grads(mode: str) -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_deferred_batch_norm_params."""
    model, reference = twin64(nn.Sequential(nn.BatchNorm2d(3)))
    x = x64(4, 3, 5, 5)
    pipe = compile_pipeline(model, x, ["cpu"], chunks=1, checkpoint=mode, deferred_batch_norm=True)
    check_step(pipe, reference, (x,))


def test_moving_is_refused_casting_is_not() -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_deny_moving (fxpipe raises PlacementError)."""
    model, reference = twin64(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    pipe = compile_pipeline(model, x64(4, 2), CPU2, split_points=["1"])
    for move in (lambda: pipe.cuda(), lambda: pipe.cpu(), lambda: pipe.to("cpu"), lambda: pipe.to(torch.device("cpu")),
                 lambda: pipe.to(device="cpu"), lambda: pipe.to(torch.rand(1)), lambda: pipe.to(tensor=torch.rand(1))):  # fmt: skip
        with pytest.raises(fxpipe.PlacementError):
            move()
    pipe.float()
    pipe.to(torch.float64)
    pipe.to(dtype=torch.float64)
    reference.float().double()
    check_step(pipe, reference, (x64(4, 2),))


def test_identity_model() -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_empty_module: a model that computes nothing
    gives back its input, or is refused at compile time with a clear ValueError."""
    x = x64(4, 2)
    try:
        pipe = compile_pipeline(nn.Sequential(), x, ["cpu"])
    except ValueError as error:
        assert "stage" in str(error) or "node" in str(error)
        return
    assert_same(pipe(x), x)
    assert_same(pipe((x,)), (x,))


def test_any_module_not_only_sequential() -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_verify_module_non_sequential: fxpipe takes
    a model with branches (tests/helpers.py's FanOut) and cuts it exactly."""
    from helpers import FanOut

    model, reference = twin64(FanOut())
    pipe = compile_pipeline(model, x64(8, 6), cpus(4), chunks=2)
    check_step(pipe, reference, (x64(8, 6),))


def test_module_used_twice() -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_verify_module_duplicate_children: where
    torchgpipe refuses a child listed twice, fxpipe cuts between its two uses and ties it."""
    lin = nn.Linear(3, 3)
    model, reference = twin64(nn.Sequential(lin, nn.Tanh(), lin))
    pipe = compile_pipeline(model, x64(4, 3), CPU2, chunks=2, split_points=["1"])
    assert list(pipe.state_dict()) == list(model.state_dict())
    check_step(pipe, reference, (x64(4, 3),))


def test_parameters_shared_by_distinct_children() -> None:
    """Mirrors torchgpipe tests/test_gpipe.py::test_verify_module_duplicate_parameters_in_distinct_children."""

    class Wrap(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.inner(x))

    lin = nn.Linear(3, 3)
    model, reference = twin64(nn.Sequential(Wrap(lin), Wrap(lin)))
    pipe = compile_pipeline(model, x64(4, 3), CPU2, chunks=2, split_points=["1"])
    assert list(pipe.state_dict()) == list(model.state_dict())
    check_step(pipe, reference, (x64(4, 3),))


# -- tests/passes/test_inplace.py ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_inplace_relu_starting_a_stage(mode: str) -> None:
    """Mirrors torchgpipe tests/passes/test_inplace.py::test_inplace_on_requires_grad: where torchgpipe
    fails (an in-place op on the stage's input leaf), fxpipe gives the plain model's gradients."""
    model, reference = twin64(nn.Sequential(nn.Linear(2, 2), nn.ReLU(inplace=True), nn.Linear(2, 1)))
    pipe = compile_pipeline(model, x64(4, 2), CPU2, chunks=2, checkpoint=mode, split_points=["1"])
    check_step(pipe, reference, (x64(4, 2),))


@pytest.mark.parametrize("mode", MODES)
def test_inplace_on_input_without_grad(mode: str) -> None:
    """Mirrors torchgpipe tests/passes/test_inplace.py::test_inplace_on_not_requires_grad (xfail there):
    an in-place ReLU on the caller's input writes it once, as the plain model does."""
    model, reference = twin64(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(2, 2)))
    pipe = compile_pipeline(model, x64(4, 2), ["cpu"], chunks=2, checkpoint=mode)
    x = x64(4, 2)
    px, rx = x.clone(), x.clone()
    out, ref = pipe(px), reference(rx)
    assert_same(out, ref)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(px, rx, rtol=0, atol=ATOL)
    from helpers import assert_grads_equal

    assert_grads_equal(pipe, reference, tol=ATOL)


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_inplace_on_part_of_a_tuple_input(mode: str, chunks: int) -> None:
    """Mirrors torchgpipe tests/passes/test_inplace.py::test_inplace_incorrect_grad (xfail there):
    `bar.add_(1)` on a tuple input under checkpointing; foo's gradient is the plain model's
    and bar is written once."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))

        def forward(self, foo_bar: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            foo, bar = foo_bar
            bar.add_(1)
            return foo * bar * self.scale

    model, reference = twin64(M())
    pipe = compile_pipeline(model, ((x64(4, 1), x64(4, 1)),), ["cpu"], chunks=chunks, checkpoint=mode)
    foo = torch.ones(4, 1, dtype=torch.float64)
    bar = torch.ones(4, 1, dtype=torch.float64)
    pfoo, rfoo = foo.clone().requires_grad_(), foo.clone().requires_grad_()
    pbar, rbar = bar.clone(), bar.clone()
    out, ref = pipe((pfoo, pbar)), reference((rfoo, rbar))
    assert_same(out, ref)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(pfoo.grad, rfoo.grad, rtol=0, atol=ATOL)
    assert pfoo.grad is not None and bool((pfoo.grad == 2).all())
    torch.testing.assert_close(pbar, rbar, rtol=0, atol=ATOL)


# -- tests/test_checkpoint.py -------------------------------------------------------------------


def test_custom_function_forward_recompute_backward_order() -> None:
    """Mirrors torchgpipe tests/test_checkpoint.py::test_serial_checkpoints: a custom autograd
    Function in a checkpointed stage runs forward, forward again (the recompute), then its own
    backward, whose gradient (here doubled) is the plain model's."""
    timeline: list[str] = []

    class Log(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            timeline.append("forward")
            return x.detach()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            timeline.append("backward")
            return grad * 2

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Log.apply(self.fc(x))

    model, reference = twin64(M())
    pipe = compile_pipeline(model, x64(4, 2), ["cpu"], chunks=1, checkpoint="always")
    timeline.clear()
    out = pipe(x64(4, 2))
    out.sum().backward()
    assert timeline == ["forward", "forward", "backward"]
    model.zero_grad()
    check_step(pipe, reference, (x64(4, 2),))


def test_checkpointed_stage_input_without_grad() -> None:
    """Mirrors torchgpipe tests/test_checkpoint.py::test_not_requires_grad and
    ::test_not_requires_grad_with_parameter: a checkpointed stage whose input needs no grad
    still gives its parameters their gradients."""
    model, reference = twin64(Chain())
    pipe = compile_pipeline(model, x64(4, 3), CPU2, chunks=2, checkpoint="always")
    check_step(pipe, reference, (x64(4, 3),), input_grads=False)


def test_dropout_recomputed_with_the_same_mask() -> None:
    """Mirrors torchgpipe tests/test_checkpoint.py::test_random_in_checkpoint: the recompute
    draws the forward's mask, so x.grad * x equals the output exactly; 'always' and 'never'
    agree bit for bit."""
    results = []
    for mode in ("always", "never"):
        model, _ = twin64(nn.Sequential(nn.Identity(), nn.Dropout(0.5)))
        pipe = compile_pipeline(model, x64(6, 6), ["cpu"], chunks=2, checkpoint=mode)
        torch.manual_seed(3)
        x = x64(6, 6).requires_grad_()
        y = pipe(x)
        y.sum().backward()
        assert x.grad is not None
        torch.testing.assert_close(x.grad * x.detach(), y.detach(), rtol=0, atol=ATOL)
        results.append((y.detach(), x.grad))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


@pytest.mark.parametrize("mode,expected", [("always", [(True, False), (False, True)]), ("never", [(False, False)])])
def test_is_checkpointing_and_is_recomputing(mode: str, expected: list[tuple[bool, bool]]) -> None:
    """Mirrors torchgpipe tests/test_checkpoint.py::test_detect_checkpointing_recomputing and
    ::test_detect_checkpointing_recomputing_without_checkpoint."""
    log: list[tuple[bool, bool]] = []
    model, _ = twin64(nn.Sequential(nn.Linear(1, 1), Recorder(log)))
    pipe = compile_pipeline(model, x64(2, 1), ["cpu"], chunks=1, checkpoint=mode, leaf_modules=[Recorder])
    log.clear()
    pipe(x64(2, 1)).sum().backward()
    assert log == expected


# -- tests/test_bugs.py -------------------------------------------------------------------------


def test_identity_autograd_function_across_stages() -> None:
    """Mirrors torchgpipe tests/test_bugs.py::test_python_autograd_function."""

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Identity.apply(self.fc(x))

    model, reference = twin64(nn.Sequential(M(), M()))
    pipe = compile_pipeline(model, x64(6, 3), CPU2, chunks=2, checkpoint="always", split_points=["1"])
    check_step(pipe, reference, (x64(6, 3),))


def test_exception_does_not_hang() -> None:
    """Mirrors torchgpipe tests/test_bugs.py::test_exception_no_hang: the last of three stages
    fails on every micro-batch; the call raises, and the next call works."""
    armed = Armed()
    model, reference = twin64(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1), armed))
    pipe = compile_pipeline(model, x64(3, 1), cpus(3), chunks=3, balance=[1, 1, 1], leaf_modules=[Armed])
    armed.armed = True
    with pytest.raises(StageError):
        pipe(x64(3, 1))
    armed.armed = False
    check_step(pipe, reference, (x64(3, 1),))


def test_straight_through_function_in_tuple() -> None:
    """Mirrors torchgpipe tests/test_bugs.py::test_tuple_wait (on CPU stages): a Function whose
    forward detaches and whose backward passes the gradient on keeps b's gradient path."""

    class PassThrough(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.detach()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad

    class Layer1(nn.Module):
        def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            a, b = pair
            return a * 1, b * 2, b * 3

    class Layer2(nn.Module):
        def forward(self, triple: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
            a, b, c = triple
            return a + PassThrough.apply(b) + c

    model, reference = twin64(nn.Sequential(Layer1(), nn.Identity(), Layer2()))
    example = ((x64(8, 3), x64(8, 3)),)
    pipe = compile_pipeline(model, example, CPU2, chunks=4, checkpoint="never", split_points=["2"])
    a, b = torch.rand(8, 3, dtype=torch.float64), torch.rand(8, 3, dtype=torch.float64)
    pa, pb = a.clone().requires_grad_(), b.clone().requires_grad_()
    ra, rb = a.clone().requires_grad_(), b.clone().requires_grad_()
    out, ref = pipe((pa, pb)), reference((ra, rb))
    assert_same(out, ref)
    out.sum().backward()
    ref.sum().backward()
    assert pb.grad is not None and rb.grad is not None
    torch.testing.assert_close(pb.grad, rb.grad, rtol=0, atol=ATOL)
    torch.testing.assert_close(pa.grad, ra.grad, rtol=0, atol=ATOL)


def test_many_dropouts_in_parallel_stages() -> None:
    """Mirrors torchgpipe tests/test_bugs.py::test_parallel_randoms: with dropout in both
    stages and every micro-batch checkpointed, an output is zero exactly where the input's
    gradient is."""

    class Dropouts(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(10):
                x = F.dropout(x, p=0.02)
            return x

    model, _ = twin64(nn.Sequential(Dropouts(), Dropouts()))
    pipe = compile_pipeline(model, x64(10, 10), CPU2, chunks=10, checkpoint="always", split_points=["1"])
    x = torch.rand(10, 10, dtype=torch.float64, requires_grad=True)
    y = pipe(x)
    y.norm().backward()
    assert x.grad is not None
    assert y.to(torch.bool).tolist() == x.grad.to(torch.bool).tolist()


# -- tests/test_transparency.py -----------------------------------------------------------------


def test_simple_linears_by_counts() -> None:
    """Mirrors torchgpipe tests/test_transparency.py::test_simple_linears (every gradient, not
    their sum)."""
    model, reference = twin64(nn.Sequential(nn.Linear(1, 2), nn.Linear(2, 4), nn.Linear(4, 2), nn.Linear(2, 1)))
    pipe = compile_pipeline(model, x64(8, 1), CPU2, chunks=4, balance=[2, 2])
    assert stage_modules(pipe) == [{"0", "1"}, {"2", "3"}]
    check_step(pipe, reference, (torch.rand(8, 1, dtype=torch.float64),))


# -- tests/test_deferred_batch_norm.py ----------------------------------------------------------


def tilted(n: int = 16) -> torch.Tensor:
    """A batch whose channels differ in scale and whose samples differ in mean."""
    x = torch.rand(n, 3, 6, 6, dtype=torch.float64)
    x = x * torch.tensor([1.0, 10.0, 100.0], dtype=torch.float64).view(1, 3, 1, 1)
    return x + (2.0 ** torch.arange(n, dtype=torch.float64) / 2**n * 50).view(n, 1, 1, 1)


def chunked(model: nn.Module, x: torch.Tensor, chunks: int) -> torch.Tensor:
    return torch.cat([model(piece) for piece in x.chunk(chunks)])


@pytest.mark.parametrize("input_grad", [True, False])
@pytest.mark.parametrize("chunks", [1, 4])
def test_deferred_batch_norm_is_per_micro_batch(chunks: int, input_grad: bool) -> None:
    """Mirrors torchgpipe tests/test_deferred_batch_norm.py::test_transparency: each micro-batch
    is normalised on its own, as the plain BatchNorm run on the micro-batches in turn."""
    model, reference = twin64(nn.Sequential(nn.BatchNorm2d(3)))
    x = tilted()
    pipe = compile_pipeline(model, x, ["cpu"], chunks=chunks, deferred_batch_norm=True)
    px, rx = fresh(x, input_grad), fresh(x, input_grad)
    out, ref = pipe(px), chunked(reference, rx, chunks)
    assert_same(out, ref)
    out.mean().backward()
    ref.mean().backward()
    for name in ("weight", "bias"):
        torch.testing.assert_close(getattr(model[0], name).grad, getattr(reference[0], name).grad, rtol=0, atol=ATOL)
    if input_grad:
        torch.testing.assert_close(px.grad, rx.grad, rtol=0, atol=ATOL)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_deferred_batch_norm_statistics_of_the_batch(momentum: Optional[float]) -> None:
    """Mirrors torchgpipe tests/test_deferred_batch_norm.py::test_running_stats and
    ::test_input_requiring_grad: the running statistics are the plain BatchNorm's on the whole
    batch (cumulative average too), and they carry no autograd history."""
    model, reference = twin64(nn.Sequential(nn.BatchNorm2d(3, momentum=momentum)))
    x = tilted()
    pipe = compile_pipeline(model, x, ["cpu"], chunks=4, deferred_batch_norm=True)
    pipe(fresh(x, True)).sum().backward()
    reference(fresh(x, True))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        got = getattr(model[0], name)
        torch.testing.assert_close(got, getattr(reference[0], name), rtol=0, atol=ATOL)
        assert not got.requires_grad and got.grad_fn is None


def test_deferred_batch_norm_without_running_stats() -> None:
    """Mirrors torchgpipe tests/test_deferred_batch_norm.py::test_convert_deferred_batch_norm:
    a BatchNorm that tracks no running statistics is left as it is (per micro-batch)."""
    model, reference = twin64(nn.Sequential(nn.BatchNorm2d(3, track_running_stats=False)))
    x = tilted(8)
    pipe = compile_pipeline(model, x, ["cpu"], chunks=4, deferred_batch_norm=True)
    assert_same(pipe(x), chunked(reference, x, 4))


def test_deferred_batch_norm_in_eval_after_steps() -> None:
    """Mirrors torchgpipe tests/test_deferred_batch_norm.py::test_eval, ::test_optimize and
    ::test_conv_bn: after SGD steps on a conv + BatchNorm, parameters, running statistics and
    eval outputs equal a plain model trained with per-micro-batch normalisation and
    whole-batch statistics."""
    chunks = 4
    model, reference = twin64(nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)))
    pipe = compile_pipeline(model, tilted(), ["cpu"], chunks=chunks, deferred_batch_norm=True)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01)
    conv, bn = reference[0], reference[1]
    assert isinstance(bn, nn.BatchNorm2d)
    for _ in range(3):
        x = tilted()
        pipe(fresh(x)).sum().backward()
        opt.step()
        opt.zero_grad()
        h = conv(fresh(x))
        pieces = [F.batch_norm(p, None, None, bn.weight, bn.bias, training=True, eps=bn.eps) for p in h.chunk(chunks)]
        torch.cat(pieces).sum().backward()
        with torch.no_grad():
            bn(h)  # the whole batch's statistics, once
        ref_opt.step()
        ref_opt.zero_grad()
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL, msg=lambda m: f"{name}: {m}")
    pipe.eval()
    reference.eval()
    x = tilted()
    assert_same(pipe(x), reference(x))


# -- tests/test_microbatch.py -------------------------------------------------------------------


def test_scatter_and_gather_of_tuples() -> None:
    """Mirrors torchgpipe tests/test_microbatch.py::test_scatter_tensor, ::test_scatter_tuple,
    ::test_gather_tensors and ::test_gather_tuples: every tensor of a tuple input is split along
    dim 0, and every tensor of a tuple output is concatenated back."""
    shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fa = nn.Linear(1, 1)
            self.fb = nn.Linear(2, 2)

        def forward(self, ab: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            a, b = ab
            return self.fa(a), self.fb(b)

    model, reference = twin64(Pair())
    model.fa.register_forward_hook(lambda m, i, o: shapes.append((tuple(i[0].shape), tuple(o.shape))))
    pipe = compile_pipeline(model, ((x64(4, 1), x64(4, 2)),), ["cpu"], chunks=2, checkpoint="never")
    shapes.clear()
    out, _ = check_step(pipe, reference, ((x64(4, 1), x64(4, 2)),))
    assert shapes == [((2, 1), (2, 1)), ((2, 1), (2, 1))]
    assert isinstance(out, tuple) and out[0].shape == (4, 1) and out[1].shape == (4, 2)


# -- tests/passes/test_balance.py ----------------------------------------------------------------------


class Delay(nn.Module):
    """Sleeps a fixed time, kept whole as a leaf module."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x * 1.0


def test_balance_by_time() -> None:
    """Mirrors torchgpipe tests/passes/test_balance.py::test_balance_by_time: six layers sleeping 1 to 6
    units cut as [4, 2]."""
    model, _ = twin64(nn.Sequential(*[Delay(i / 400) for i in range(1, 7)]))
    pipe = compile_pipeline(model, x64(2, 1), CPU2, chunks=8, balance="time", leaf_modules=[Delay])
    assert stage_modules(pipe) == [{"0", "1", "2", "3"}, {"4", "5"}]


def test_balance_by_time_then_exact() -> None:
    """Mirrors torchgpipe tests/passes/test_balance.py::test_balance_by_time_loop_resets_input: profiling
    a conv, a flatten and a linear does not disturb the model, which then trains exactly."""
    model, reference = twin64(nn.Sequential(nn.Conv2d(3, 2, 1), nn.Flatten(), nn.Linear(32, 4)))
    x = x64(6, 3, 4, 4)
    pipe = compile_pipeline(model, x, CPU2, chunks=2, balance="time")
    check_step(pipe, reference, (x,))


@pytest.mark.parametrize("grow", [True, False], ids=["growing", "shrinking"])
def test_balance_by_parameter_size(grow: bool) -> None:
    """Mirrors torchgpipe tests/passes/test_balance.py::test_balance_by_size_param: linear layers whose
    parameter count grows are cut [4, 2], shrinking ones [2, 4]."""
    sizes = [(i + 1, i + 2) for i in range(6)] if grow else [(i + 2, i + 1) for i in reversed(range(6))]
    model, _ = twin64(nn.Sequential(*[nn.Linear(a, b) for a, b in sizes]))
    example = x64(7, 1) if grow else x64(1, 7)
    pipe = compile_pipeline(model, example, CPU2, balance="params")
    expected = [{"0", "1", "2", "3"}, {"4", "5"}] if grow else [{"0", "1"}, {"2", "3", "4", "5"}]
    assert stage_modules(pipe) == expected


def test_balance_by_memory_param_scale() -> None:
    """Mirrors torchgpipe tests/passes/test_balance.py::test_balance_by_size_param_scale: with
    param_scale=0 the activations decide the cut, with a large one the parameters do."""

    class Tradeoff(nn.Module):
        def __init__(self, param_size: int, latent: int) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(param_size * 4096))
            self.latent = latent

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.w.sum()
            for _ in range(self.latent):
                x = torch.tanh(x) + 1
            return x

    model, _ = twin64(nn.Sequential(*[Tradeoff(p, 7 - p) for p in range(1, 7)]))
    x = x64(64, 8)
    by_activations = compile_pipeline(model, x, CPU2, chunks=1, checkpoint="never", balance="memory", param_scale=0.0)
    by_params = compile_pipeline(model, x, CPU2, chunks=1, checkpoint="never", balance="memory", param_scale=1e6)
    first_of_second = lambda pipe: min(int(m.split(".")[0]) for m in stage_modules(pipe)[1])  # noqa: E731
    assert first_of_second(by_activations) == 2
    assert first_of_second(by_params) == 4


def test_profiling_leaves_the_model_as_it_was() -> None:
    """Mirrors torchgpipe tests/passes/test_balance.py::test_layerwise_sandbox,
    ::test_sandbox_during_profiling and ::test_not_training: balance='time' leaves BatchNorm's
    statistics, the training flags and the devices as they were."""
    model, _ = twin64(nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)))
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    compile_pipeline(model, x64(2, 3, 4, 4), CPU2, balance="time")
    assert not model.training and not any(m.training for m in model.modules())
    assert list(model.state_dict()) == list(before)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_profiling_keeps_existing_grads() -> None:
    """Mirrors torchgpipe tests/passes/test_balance.py::test_already_has_grad: where torchgpipe refuses
    a model that has gradients, fxpipe's profiling leaves them as they were."""
    model, reference = twin64(nn.Sequential(nn.Conv2d(3, 3, 1), nn.Flatten(), nn.Linear(48, 2)))
    x = x64(2, 3, 4, 4)
    model(x).norm().backward()
    reference(x).norm().backward()
    compile_pipeline(model, x, CPU2, balance="time")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("balance", ["time", "memory"])
def test_balance_with_tuple_between_layers(balance: str) -> None:
    """Mirrors torchgpipe tests/passes/test_balance.py::test_balance_by_time_tuple and
    ::test_balance_by_size_tuple."""

    class Twin(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x.detach()

    class Add(nn.Module):
        def forward(self, a_b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            a, b = a_b
            return a + b

    model, reference = twin64(nn.Sequential(nn.Linear(2, 2), Twin(), Add()))
    pipe = compile_pipeline(model, x64(4, 2), CPU2, chunks=2, balance=balance)
    check_step(pipe, reference, (x64(4, 2),))


def test_more_stages_than_nodes() -> None:
    """Mirrors torchgpipe tests/passes/test_balance.py::test_blockpartition_short_sequence: more
    stages than there is work to place is a clear error."""
    model, _ = twin64(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="stages"):
        compile_pipeline(model, x64(4, 2), cpus(3))


# -- tests/skip/test_gpipe.py, tests/skip/test_leak.py, tests/skip/test_inspect_skip_layout.py ---


class OneToThree(nn.Module):
    """layer1's input is added to layer3's output: a skip over layer2."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Conv2d(3, 3, 1)
        self.layer2 = nn.Conv2d(3, 3, 1)
        self.layer3 = nn.Conv2d(3, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x
        return self.layer3(self.layer2(self.layer1(x))) + skip


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cuts", [[], ["layer2"], ["layer3"], ["layer2", "layer3"]], ids=["3", "1:2", "2:1", "1:1:1"])
def test_skip_one_to_three(cuts: list[str], mode: str) -> None:
    """Mirrors torchgpipe tests/skip/test_gpipe.py::test_1to3: a skip from the first layer's
    input to the third's output, at every cut and checkpoint mode: output and input gradient."""
    model, reference = twin64(OneToThree())
    x = x64(6, 3, 4, 4)
    pipe = compile_pipeline(model, x, cpus(len(cuts) + 1), chunks=3, checkpoint=mode, split_points=cuts or None)
    check_step(pipe, reference, (x,))
    if len(cuts) == 2:  # the input goes straight to stage 2; stage 1 receives only layer1's output
        assert [e.kind for e in pipe.plan.edges if e.dst == 1] == ["activation"]


def test_none_through_a_skip() -> None:
    """Mirrors torchgpipe tests/skip/test_gpipe.py::test_none_skip: a None carried from one
    stage to a later one is no edge, and the gradient is the plain model's."""

    class Stash(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
            return x * 1.0, None

    class Pop(nn.Module):
        def forward(self, x_none: tuple[torch.Tensor, None]) -> torch.Tensor:
            x, none = x_none
            assert none is None
            return x * 1.0

    model, reference = twin64(nn.Sequential(Stash(), Pop()))
    pipe = compile_pipeline(model, x64(10, 1), CPU2, chunks=5, split_points=["1"])
    assert not pipe.plan.skip_edges
    x = torch.rand(10, 1, dtype=torch.float64, requires_grad=True)
    pipe(x).sum().backward()
    assert x.grad is not None and float(x.grad.mean()) == 1.0
    check_step(pipe, reference, (x64(10, 1),))


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_plain_model_unchanged_by_compiling(train: bool) -> None:
    """Mirrors torchgpipe tests/skip/test_leak.py::test_no_portal_without_gpipe: after
    compile_pipeline, the plain model still runs on its own and gives its own results."""
    model, reference = twin64(OneToThree())
    compile_pipeline(model, x64(4, 3, 2, 2), CPU2, chunks=2, split_points=["layer3"])
    model.train(train)
    reference.train(train)
    x = x64(4, 3, 2, 2)
    assert_same(model(x), reference(x))


class Layout(nn.Module):
    """Five layers; `uses` says which earlier layers' outputs each layer adds to its own."""

    def __init__(self, uses: dict[int, list[int]]) -> None:
        super().__init__()
        self.uses = uses
        self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            for j in self.uses.get(i, []):
                x = x + outs[j]
            outs.append(x)
        return x


@pytest.mark.parametrize(
    "uses,skips",
    [
        ({}, []),  # test_no_skippables
        ({1: [0]}, []),  # test_inner_partition: made and used inside stage 0
        ({2: [0]}, []),  # test_adjoining_partitions: stage 1 receives it as an activation
        ({3: [0]}, [(0, 2)]),  # test_far_partitions
        ({4: [2, 0]}, [(0, 3), (1, 3)]),  # test_pop_2_from_different_partitions, test_namespace
    ],
    ids=["none", "inner", "adjoining", "far", "two-sources"],
)
def test_skip_layout(uses: dict[int, list[int]], skips: list[tuple[int, int]]) -> None:
    """Mirrors torchgpipe tests/skip/test_inspect_skip_layout.py (all six tests): which values
    jump over stages, from where to where; the stages are layers [0, 1], [2], [3], [4]."""
    model, reference = twin64(Layout(uses))
    pipe = compile_pipeline(model, x64(4, 2), cpus(4), chunks=2, split_points=["layers.2", "layers.3", "layers.4"])
    assert sorted((e.src, e.dst) for e in pipe.plan.skip_edges) == skips
    assert all(e.dst - e.src == 1 for e in pipe.plan.edges_of_kind("activation"))
    check_step(pipe, reference, (x64(4, 2),))
