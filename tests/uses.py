"""The ways a user calls a model, each run on a pipeline and on its plain model and compared."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

Call = Callable[[nn.Module], Any]  # runs a model (the pipeline or the plain one) on fixed inputs
Loss = Callable[[Any], torch.Tensor]


@dataclass
class Use:
    """One way of calling: `run(model, call, loss)` returns what it saw (outputs, a loss); the
    parameters' gradients and the model's state after it are compared too."""

    name: str
    run: Callable[[nn.Module, Call, Loss], Any]
    trains: bool = True  # the model in training mode (else eval)


def _forward_backward(model: nn.Module, call: Call, loss: Loss) -> Any:
    out = call(model)
    loss(out).backward()
    return out


def _no_grad(model: nn.Module, call: Call, loss: Loss) -> Any:
    with torch.no_grad():
        return call(model)


def _inference_mode(model: nn.Module, call: Call, loss: Loss) -> Any:
    with torch.inference_mode():
        return tree_map_only(torch.Tensor, torch.Tensor.clone, call(model))


def _autocast(model: nn.Module, call: Call, loss: Loss) -> Any:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = call(model)
        value = loss(out)
    value.backward()
    return out


def _two_forwards(model: nn.Module, call: Call, loss: Loss) -> Any:
    first, second = call(model), call(model)
    (loss(first) + 2 * loss(second)).backward()
    return first, second


def _accumulated(model: nn.Module, call: Call, loss: Loss) -> Any:
    outs = []
    for _ in range(2):
        outs.append(call(model))
        loss(outs[-1]).backward()
    return outs


def _autograd_grad(model: nn.Module, call: Call, loss: Loss) -> Any:
    params = [p for p in model.parameters() if p.requires_grad]
    out = call(model)
    return out, torch.autograd.grad(loss(out), params, allow_unused=True)


class _Refused(Exception):
    pass


def _after_a_failed_backward(model: nn.Module, call: Call, loss: Loss) -> Any:
    """A backward that fails half-way (a hook on the loss's way raises), then a whole step."""
    out = call(model)

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise _Refused

    value = loss(out)
    first = next(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad)
    first.register_hook(fail)
    with pytest.raises(_Refused):
        value.backward()
    return _forward_backward(model, call, loss)


TRAIN = Use("train", _forward_backward)
EVAL = Use("eval", _forward_backward, trains=False)
NO_GRAD = Use("no_grad", _no_grad)
INFERENCE = Use("inference_mode", _inference_mode, trains=False)
AUTOCAST = Use("autocast", _autocast)
TWO_FORWARDS = Use("two forwards, one backward", _two_forwards)
ACCUMULATED = Use("accumulated over two calls", _accumulated)
AUTOGRAD_GRAD = Use("autograd.grad", _autograd_grad)
AFTER_FAILURE = Use("a step after a failed backward", _after_a_failed_backward)
EVERY_USE = (TRAIN, EVAL, NO_GRAD, INFERENCE, AUTOCAST, TWO_FORWARDS, ACCUMULATED, AUTOGRAD_GRAD, AFTER_FAILURE)


@contextlib.contextmanager
def _mode(model: nn.Module, training: bool) -> Iterator[None]:
    was = model.training
    model.train(training)
    try:
        yield
    finally:
        model.train(was)


def _seeded(call: Call, seed: int) -> Call:
    """`call`, from the same seed each time it is made (a pipeline draws dropout's masks from
    streams of its own, which take their seeds from the caller's generator)."""
    counter = [0]

    def run(model: nn.Module) -> Any:
        torch.manual_seed(seed + counter[0])
        counter[0] += 1
        return call(model)

    return run


def _assert_close(got: Any, expected: Any, tol: float, what: str) -> None:
    got_leaves, got_spec = tree_flatten(got)
    expected_leaves, expected_spec = tree_flatten(expected)
    assert got_spec == expected_spec, f"{what}: structure {got_spec} instead of {expected_spec}"
    for index, (a, b) in enumerate(zip(got_leaves, expected_leaves)):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"{what}, leaf {index}: {type(a).__name__} instead of a tensor"
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{what}, leaf {index}: {m}")
        else:
            assert a == b, f"{what}, leaf {index}: {a!r} instead of {b!r}"


def assert_alike_in_every_use(
    pipe: nn.Module, plain: nn.Module, call: Call, loss: Loss, uses: Sequence[Use] = EVERY_USE,
    tol: float = 1e-10, low_precision_tol: float = 2e-2, seed: int = 0, plain_call: Optional[Call] = None,
) -> None:
    """Each use, on `pipe` and on `plain` in turn from the same seed: what it returns, every
    parameter's gradient (by name, None alike) and every buffer are alike after it. `plain_call`
    stands for `call` on the plain model where the two differ (micro-batches run in turn)."""
    for number, use in enumerate(uses):
        tolerance = low_precision_tol if use is AUTOCAST else tol
        seen = []
        for model, runs in ((pipe, call), (plain, plain_call or call)):
            model.zero_grad(set_to_none=True)
            with _mode(model, use.trains):
                seen.append(use.run(model, _seeded(runs, seed + 100 * number), loss))
        what = f"{use.name}"
        _assert_close(seen[0], seen[1], tolerance, f"{what}, what it returned")
        ours, theirs = dict(pipe.named_parameters()), dict(plain.named_parameters())
        assert list(ours) == list(theirs), f"{what}: parameter names differ"
        for name, param in ours.items():
            expected = theirs[name].grad
            assert (param.grad is None) == (expected is None), f"{what}: {name}'s gradient is {param.grad} instead of {expected}"
            if expected is not None:
                torch.testing.assert_close(param.grad, expected, rtol=tolerance, atol=tolerance, msg=lambda m: f"{what}, {name}'s gradient: {m}")
        _assert_close(dict(pipe.named_buffers()), dict(plain.named_buffers()), tolerance, f"{what}, the buffers")
    pipe.zero_grad(set_to_none=True)
    plain.zero_grad(set_to_none=True)
