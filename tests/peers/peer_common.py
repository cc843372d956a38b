"""Shared helpers of the peer-suite tests: float64 twins, exact comparison with the plain model."""
from __future__ import annotations

import copy
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

import fxpipe
from helpers import assert_grads_equal

ATOL = 1e-9
CPU2 = ["cpu", "cpu"]

M = TypeVar("M", bound=nn.Module)


def cpus(n: int) -> list[str]:
    """`n` CPU stage devices."""
    return ["cpu"] * n


def twin64(model: M) -> tuple[M, M]:
    """The model in float64, and an independent copy of it to run plain."""
    model = model.double()
    return model, copy.deepcopy(model)


def fresh(value: Any, requires_grad: bool = False) -> Any:
    """An independent copy of every tensor in `value` (a leaf, with grad if asked and floating)."""

    def copy_leaf(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        out = t.detach().clone()
        return out.requires_grad_(requires_grad and out.is_floating_point())

    return tree_map(copy_leaf, value)


def assert_same(actual: Any, expected: Any, what: str = "output") -> None:
    """Same structure, same container types, and tensors equal to `ATOL` (non-tensors equal)."""
    assert type(actual) is type(expected), f"{what}: {type(actual).__name__} where the plain model gives {type(expected).__name__}"
    got, got_spec = tree_flatten(actual)
    want, want_spec = tree_flatten(expected)
    assert got_spec == want_spec, f"{what}: structure {got_spec} where the plain model gives {want_spec}"
    for i, (a, b) in enumerate(zip(got, want)):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"{what}[{i}]: {type(a).__name__}, not a tensor"
            torch.testing.assert_close(a.detach().cpu(), b.detach().cpu(), rtol=0, atol=ATOL, msg=lambda m: f"{what}[{i}]: {m}")
        else:
            assert a == b, f"{what}[{i}]: {a!r} where the plain model gives {b!r}"


def loss_of(out: Any) -> torch.Tensor:
    """A non-linear scalar of every output tensor that requires grad."""
    leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    assert leaves, "no output requires grad"
    return sum((torch.sin(t.double()).sum() for t in leaves), torch.zeros((), dtype=torch.float64))


def assert_input_grads(got: Any, want: Any) -> None:
    """The gradients of the inputs (leaf tensors) are equal, or both absent."""
    for i, (a, b) in enumerate(zip(tree_flatten(got)[0], tree_flatten(want)[0])):
        if isinstance(b, torch.Tensor) and b.requires_grad:
            assert (a.grad is None) == (b.grad is None), f"input {i}: gradient presence differs ({a.grad is not None} vs {b.grad is not None})"
            if b.grad is not None:
                torch.testing.assert_close(a.grad.cpu(), b.grad, rtol=0, atol=ATOL, msg=lambda m: f"input {i} grad: {m}")


def check_step(
    pipe: nn.Module,
    reference: nn.Module,
    args: Sequence[Any],
    kwargs: Optional[dict[str, Any]] = None,
    *,
    input_grads: bool = True,
    loss: Callable[[Any], torch.Tensor] = loss_of,
) -> tuple[Any, Any]:
    """One forward and backward of the pipeline and of the plain model on copies of the same
    inputs: outputs, every parameter's gradient and (if asked) the inputs' gradients agree."""
    kwargs = kwargs or {}
    p_args, p_kwargs = fresh(tuple(args), input_grads), fresh(kwargs, input_grads)
    r_args, r_kwargs = fresh(tuple(args), input_grads), fresh(kwargs, input_grads)
    out = pipe(*p_args, **p_kwargs)
    ref = reference(*r_args, **r_kwargs)
    assert_same(out, ref)
    loss(out).backward()
    loss(ref).backward()
    assert_grads_equal(pipe, reference, tol=ATOL)
    if input_grads:
        assert_input_grads((p_args, p_kwargs), (r_args, r_kwargs))
    return out, ref


def stage_modules(pipe: fxpipe.Pipeline) -> list[set[str]]:
    """For each stage, the top-level-qualified module paths its nodes come from."""
    return [{m for m in stage.modules if m} for stage in pipe.plan.stages]


def first_module_of(pipe: fxpipe.Pipeline, stage: int) -> str:
    """The module path of the first node of `stage` that belongs to a module."""
    return next(m for m in pipe.plan.stages[stage].modules if m)
