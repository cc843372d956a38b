"""A stage's backward as one call of autograd's engine, without re-checking gradients autograd itself made."""
from __future__ import annotations

import contextvars
from typing import Any, Optional, Sequence

import torch

try:  # the engine `torch.autograd.backward` calls, below its Python checks
    from torch.autograd.variable import Variable

    _ENGINE: Any = Variable._execution_engine
    _TLS = (torch._C._stash_obj_in_tls, torch._C._remove_obj_from_tls)
except (ImportError, AttributeError):  # another torch: its public entry point
    _ENGINE = None


def run_backward(tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], inputs: Optional[Sequence[torch.Tensor]] = None) -> None:
    """`torch.autograd.backward(tensors, grads, inputs=inputs)`, for gradients that match their
    tensors by construction: each is what a consumer's backward gave the leaf made from that very
    tensor (or the loss's `ones_like`). Torch's Python wrapper checks every gradient's shape and
    dtype against its tensor before the engine runs; on a small stage that costs a quarter of the
    task's own time (the checks' code is cold between kernels), once per backward task."""
    if _ENGINE is None or torch._C._are_functorch_transforms_active():
        torch.autograd.backward(tensors, grads, inputs=inputs)  # the public path, and its error
        return
    stash, remove = _TLS
    # As torch does: the caller's context variables (the compiler's settings) reach the engine's
    # device threads.
    stash("context", contextvars.copy_context())
    try:
        _ENGINE.run_backward(tuple(tensors), tuple(grads), False, False, tuple(inputs or ()), allow_unreachable=True, accumulate_grad=True)
    finally:
        remove("context")
