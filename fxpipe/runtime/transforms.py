"""What a call may ask that a Pipeline cannot carry through its stages: refused, with the fix.

The stages run on worker threads (or other processes) on tensors of their own, so a transform
that lives in the caller's tensors or thread would see nothing of them and silently lose its
work: torch.func's transforms (`vmap`, `grad`, `jvp`, `jacrev`, ...), forward-mode AD's
tangents (on the inputs, or on parameters and buffers swapped in), and parameters swapped for plain tensors that require grad (`torch.func.
functional_call` given such tensors), which autograd would never reach.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.autograd.forward_ad as forward_ad
from torch import nn
from torch.utils._pytree import tree_flatten


def refuse_transforms(
    values: dict[str, Any], unreached: list[str], grad_mode: bool, state: dict[str, torch.Tensor], held: dict[str, torch.Tensor],
    modules: dict[str, nn.Module],
) -> None:
    """Raise if the call runs under a torch.func transform, passes tangents of forward-mode AD
    in its input `values`, in the `state` the stages read (parameters, buffers) or in the tensors
    the model's `modules` hold, or asks for gradients while the model holds `unreached` tensors
    (swapped in for parameters, requiring grad, and not Parameters) or the stages read `held`
    tensors (those of `state` that are no Parameters) that require grad."""
    problems = []
    if _functorch_active():
        problems.append(
            "it runs under a torch.func transform (vmap, grad, jvp, jacrev, ...), which cannot see through "
            "the stages: they run on tensors of their own, on other threads"
        )
    duals = [name for name, value in values.items() if _has_tangent(value)]
    if duals:
        problems.append(f"inputs carry tangents of forward-mode AD ({', '.join(duals)}), which the stages would drop")
    tangents = _tangents_held(state, modules) if _dual_level_active() else []
    if tangents:
        problems.append(
            f"parameters or buffers the stages read carry tangents of forward-mode AD ({', '.join(tangents)}; "
            "swapped in by torch.func.functional_call, say), which the stages would drop"
        )
    if grad_mode and unreached:
        problems.append(
            f"parameters of the model were swapped for tensors that require grad but are not nn.Parameters "
            f"({', '.join(unreached)}; torch.func.functional_call given such tensors, say): a pipeline hands "
            "gradients to the model's parameters only"
        )
    # Leaves only: a view of a parameter (self.w_t = self.lin.weight.t()) carries its gradient there.
    learning = [name for name, tensor in held.items() if tensor.requires_grad and tensor.is_leaf and name not in unreached] if grad_mode else []
    if learning:  # (refused when compiling too; set so after it, say)
        problems.append(
            f"buffers or tensor attributes the stages read require grad but are not nn.Parameters ({', '.join(learning)}; "
            "made so after compiling, say): a pipeline hands gradients to the model's parameters only, and each "
            "micro-batch's backward would write theirs, outside what autograd.grad or backward(inputs=...) asks for"
        )
    if problems:
        raise RuntimeError(
            "this call of the pipeline cannot compute what the plain model would:\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nHow to fix: apply such transforms to the plain model; train the pipeline's own parameters "
            "(load new values with pipe.load_state_dict, or copy them in under torch.no_grad()), and register a tensor "
            "that learns as an nn.Parameter before compiling (or call .requires_grad_(False) on one that does not); a "
            "functional_call with tensors that do not require grad (or under torch.no_grad()) runs as it is."
        )


def _tangents_held(state: dict[str, torch.Tensor], modules: dict[str, nn.Module]) -> list[str]:
    """The names of the tensors the stages read that carry tangents: of `state`, and of every
    tensor the modules hold (a dual set as a plain attribute where a parameter was deleted, as
    forward-mode AD's tutorial does, is read by the module's own forward)."""
    found = {name: None for name, tensor in state.items() if _has_tangent(tensor)}
    for path, module in modules.items():
        for table in (module._parameters, module._buffers, vars(module)):
            found.update((f"{path}.{key}" if path else key, None) for key, value in table.items() if isinstance(value, torch.Tensor) and _has_tangent(value))
    return list(found)


def _functorch_active() -> bool:
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(active()) if active is not None else False


def _dual_level_active() -> bool:
    """Whether tangents may exist: only inside `forward_ad.dual_level()` (which keeps no public
    flag; without the private one, assume so)."""
    return getattr(forward_ad, "_current_level", 0) >= 0


def _has_tangent(value: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None for t in tree_flatten(value)[0])
