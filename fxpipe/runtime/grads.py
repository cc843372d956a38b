"""A step's gradients handed to autograd: each parameter's summed over its stages' copies, the
inputs' put back together, into `.grad` as the plain model's backward puts them."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from fxpipe.compiled.program import Program
from fxpipe.runtime.autograd import whole_input_grads
from fxpipe.runtime.call import Call
from fxpipe.runtime.step import Step


def parameter_grads(program: Program, step: Step, params: list[nn.Parameter]) -> list[Optional[torch.Tensor]]:
    """The step's gradient of each of `params`: its own stage's sum over micro-batches, plus
    the sums of other stages' copies, added in stage order (deterministic)."""
    totals: dict[int, torch.Tensor] = {}
    for index, stage in enumerate(program.stages):
        for p, grad in zip(stage.params, step.take_parameter_grads(index)):
            if grad is not None:
                totals[id(p)] = grad
    for index, tensors in enumerate(program.shared):
        for param, grad in zip(tensors, step.shared_grads(index)):
            if grad is not None:
                grad = grad.to(param.device)
                totals[id(param)] = summed(totals[id(param)], grad) if id(param) in totals else grad
    return [totals.get(id(p)) for p in params]


def accumulate(call: Call, input_grads: list[dict[str, Any]], param_grads: list[Optional[torch.Tensor]]) -> None:
    """Hand the step's gradients to autograd, as the plain model's backward would: into `.grad`
    of leaves (through their hooks), on through the graph of inputs that are not leaves."""
    grads = [*whole_input_grads(call.input_slots, call.caller_micro_batches, input_grads), *param_grads]
    pairs = [(t, g) for t, g in zip([*(slot.tensor for slot in call.input_slots), *call.params], grads) if g is not None]
    if pairs:
        torch.autograd.backward([moved_into_grad(t, g) for t, g in pairs], [g for _, g in pairs])


def moved_into_grad(leaf: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Where backward starts for `leaf`'s gradient: a view of a leaf, so that autograd hands its
    `.grad` a fresh view of `grad` that nothing else holds, which it takes as it is; given the
    leaf itself, it would copy `grad`, which its caller still holds (a whole copy of every
    gradient at the end of each step). Sparse gradients cannot pass a view's backward."""
    if not leaf.is_leaf or grad.is_sparse:
        return leaf
    with torch.enable_grad():
        return leaf.view_as(leaf)


def summed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b, for a sparse gradient (an embedding's) and a dense one too: torch adds sparse to
    dense only in that order, and either order gives the same sum."""
    return b + a if a.is_sparse and not b.is_sparse else a + b
