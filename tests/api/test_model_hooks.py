"""Hooks on the model itself run around each pipe(x) as the plain model's call runs them."""

import re
import warnings
from typing import Any, Callable, Optional

import pytest
import torch
from torch import nn
from torch.nn.utils import prune

from fxpipe import compile_pipeline
from helpers import assert_grads_equal, twin

X = torch.randn(8, 6, dtype=torch.float64)


class _Skip(nn.Module):
    """A skip from the first layer to the last, and an optional argument (another kind of call)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
        first = torch.tanh(self.a(x))
        out = self.c(torch.tanh(self.b(first)) + first)
        return out if scale is None else out * scale


def _hooked(module: nn.Module, log: list[Any]) -> list[Any]:
    """Hooks of every kind that change what the call computes, and record what they see: the
    input doubled (seeing the keywords), the output tripled, the output's gradient halved, the
    input's gradient recorded."""

    def pre(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        log.append(("pre", m is module, sorted(kwargs)))
        return (args[0] * 2, *args[1:]), kwargs

    def post(m: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        log.append(("forward", tuple(out.shape)))
        return out * 3

    def backward_pre(m: nn.Module, grads: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        log.append(("backward pre", round(grads[0].sum().item(), 9)))  # (the sum of micro-batches' parts rounds apart)
        return (grads[0] / 2,)

    def backward(m: nn.Module, grad_input: tuple[Any, ...], grad_output: tuple[Any, ...]) -> None:
        log.append(("backward", [None if g is None else round(g.sum().item(), 9) for g in grad_input]))

    return [
        module.register_forward_pre_hook(pre, with_kwargs=True),
        module.register_forward_hook(post),
        module.register_full_backward_pre_hook(backward_pre),
        module.register_full_backward_hook(backward),
    ]


def _run(call: Callable[..., torch.Tensor], mode: str, **kwargs: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The output, and the input's gradient where the mode takes one."""
    x = X.clone().requires_grad_(mode != "no_grad")
    if mode == "no_grad":
        with torch.no_grad():
            return call(x, **kwargs), None
    out = call(x, **kwargs)
    if mode == "two forwards, one backward":
        again = call(x, **kwargs)
        (out.pow(2).sum() + again.pow(2).sum()).backward()
        return out.detach(), x.grad
    if mode == "autograd.grad":
        return out.detach(), torch.autograd.grad(out.pow(2).sum(), x)[0]
    for _ in range(2 if mode == "accumulated" else 1):
        out = call(x, **kwargs) if _ else out
        out.pow(2).sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("registered", ["before compiling", "after compiling"])
@pytest.mark.parametrize("mode", ["train", "eval", "no_grad", "autograd.grad", "accumulated", "two forwards, one backward"])
def test_the_models_own_hooks_run_around_each_call_as_the_plain_models_do(registered: str, mode: str) -> None:
    """Before, hooks that change the output were refused at compile time as a graph that computes
    otherwise (torch.fx traces forward, never the model's call), and after compiling as hooks
    added since; hooks that change nothing (a counter) silently never ran. Each runs once per
    call, never per micro-batch, nor while compiling."""
    model, reference = twin(_Skip())
    seen: list[Any] = []
    expected: list[Any] = []
    _hooked(reference, expected)
    if registered == "before compiling":
        _hooked(model, seen)
    pipe = compile_pipeline(model, X, ["cpu", "cpu", "cpu"], chunks=4)
    assert seen == [], "compiling ran the model's hooks"
    if registered == "after compiling":
        _hooked(model, seen)
    if mode == "eval":
        pipe.eval(), reference.eval()
    out, grad = _run(pipe, mode)
    want, want_grad = _run(reference, mode)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    if want_grad is not None:
        assert grad is not None
        torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-12)
    if mode not in ("no_grad", "autograd.grad"):
        assert_grads_equal(pipe, reference, tol=1e-12)
    assert seen == expected and any(event[0] == "forward" for event in seen)


def test_a_call_of_another_kind_runs_them_once_with_its_arguments() -> None:
    """A call with an argument the example left out compiles stages of its own inside the call:
    the hooks run around it once, and see the keyword."""
    model, reference = twin(_Skip())
    seen: list[Any] = []
    expected: list[Any] = []
    _hooked(model, seen)
    _hooked(reference, expected)
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the notes of compiling for the new kind of call
        out, grad = _run(pipe, "train", scale=0.5)
    want, want_grad = _run(reference, "train", scale=0.5)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-12)
    assert seen == expected and ("pre", True, ["scale"]) in seen


def test_hooks_removed_after_compiling_stop_running_and_others_change_nothing_inside() -> None:
    model, reference = twin(_Skip())
    handles = _hooked(model, [])
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    for handle in handles:
        handle.remove()
    torch.testing.assert_close(pipe(X), reference(X), rtol=0, atol=1e-12)
    # A hook on a module inside still runs where the stages call it, once per micro-batch.
    calls: list[int] = []
    model.b.register_forward_hook(lambda m, args, out: calls.append(out.shape[0]))
    pipe(X)
    assert calls == [4, 4]


def test_an_always_call_hook_runs_once_when_the_call_fails() -> None:
    model, reference = twin(_Skip())
    ran: dict[str, list[str]] = {"pipe": [], "plain": []}
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    for module, key in ((model, "pipe"), (reference, "plain")):
        module.register_forward_hook(lambda m, args, out, key=key: ran[key].append("always"), always_call=True)
        module.register_forward_hook(lambda m, args, out, key=key: ran[key].append("once it ran"))
    for call in (pipe, reference):
        with pytest.raises(RuntimeError):
            call(torch.randn(8, 5, dtype=torch.float64))  # a width the first layer refuses
    assert ran["pipe"] == ran["plain"] == ["always"]
    torch.testing.assert_close(pipe(X), reference(X), rtol=0, atol=1e-12)  # and the next call runs both
    assert ran["pipe"] == ran["plain"] == ["always", "always", "once it ran"]


def test_what_cannot_run_around_the_call_is_refused_saying_how_to_fix_it() -> None:
    """A hook of the deprecated register_backward_hook sees the last operation's gradients, on a
    pipeline its own; a pruning hook on the model itself assigns the weight the stages read."""
    model, _ = twin(_Skip())
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = model.register_backward_hook(lambda m, gi, go: None)
    with pytest.raises(RuntimeError, match=r"(?s)register_backward_hook.*How to fix: register it with register_full_backward_hook"):
        pipe(X)
    with torch.no_grad():
        pipe(X)  # no backward, nothing to refuse
    handle.remove()
    model.w = nn.Parameter(torch.randn(6, 6, dtype=torch.float64))
    prune.l1_unstructured(model, "w", amount=0.5)
    with pytest.raises(RuntimeError, match=r"(?s)hook of torch.nn.utils on the model itself assigns 'w' \(L1Unstructured\).*How to fix: make it permanent"):
        pipe(X)


def test_the_hooks_a_call_runs_are_those_there_before_its_pre_hooks_and_pipe_forward_runs_none() -> None:
    """torch takes the backward hooks before running the pre-hooks: one a pre-hook removes still
    runs for that call. `model.forward(x)` runs no hook, nor does `pipe.forward(x)` (before, it ran
    them: 136.1 where 1.36)."""
    model, reference = twin(_Skip())
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    for module in (model, reference):
        scaled = module.register_full_backward_hook(lambda m, gi, go: (gi[0] * 10,))  # type: ignore[index]
        module.register_forward_pre_hook(lambda m, args, scaled=scaled: scaled.remove())
        module.register_forward_hook(lambda m, args, out: out * 100)
    grads = []
    for call in (pipe, reference):
        x = X.clone().requires_grad_()
        call(x).sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-12)
    torch.testing.assert_close(pipe.forward(X), reference.forward(X), rtol=0, atol=1e-12)


def test_a_compile_that_fails_on_what_a_pre_hook_would_change_says_so() -> None:
    """The model's pre-hooks are set aside while compiling: an example only they make runnable
    (a pad) fails in forward, and the error says why, and that the example they leave works."""
    model, reference = twin(_Skip())
    for module in (model, reference):
        module.register_forward_pre_hook(lambda m, args: (torch.nn.functional.pad(args[0], (0, 2)),))
    narrow = X[:, :4]
    with pytest.raises(ValueError, match="does not run on the example") as refused:
        compile_pipeline(model, narrow, ["cpu", "cpu"], chunks=2)
    assert re.search(r"forward pre-hook \S*<lambda> did not run while compiling", "".join(getattr(refused.value, "__notes__", []))), refused.value.__notes__
    pipe = compile_pipeline(model, torch.nn.functional.pad(narrow, (0, 2)), ["cpu", "cpu"], chunks=2)
    torch.testing.assert_close(pipe(narrow), reference(narrow), rtol=0, atol=1e-12)


def test_backward_hooks_on_a_model_whose_output_is_a_dict_warn_as_torch_warns() -> None:
    class _Dict(_Skip):
        def forward(self, x: torch.Tensor, scale: Optional[float] = None) -> dict[str, torch.Tensor]:  # type: ignore[override]
            return {"out": super().forward(x, scale)}

    model = _Dict().double()
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    model.register_full_backward_hook(lambda m, gi, go: None)
    with pytest.warns(UserWarning, match="For backward hooks to be called, module output should be a Tensor or a tuple"):
        pipe(X)
