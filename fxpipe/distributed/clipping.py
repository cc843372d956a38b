"""Gradient clipping by the norm of the whole model's gradients, across processes too.

In one process `torch.nn.utils.clip_grad_norm_(pipe.parameters(), ...)` sees every gradient.
Across processes each rank holds its own stages' parameters only, so the same call there would
clip by that rank's part of the norm: every rank clipping differently from the plain model, and
the copies of a tied weight on two ranks drifting apart. Here the ranks add up their parts:

    rank 0: |g_a|^p + |g_tied|^p ─┐
                                  ├─ all-reduce (sum) ─▶ total norm, on every rank
    rank 1: |g_b|^p  (g_tied: ─────┘    each rank scales its own gradients by the same factor
            its copy, counted on rank 0)

For p = inf (-inf) the parts are the largest (smallest) entries, reduced by max (min); for p = 0
the counts of gradients that are not all zero, summed, as torch's norm of order 0 counts them. A
NaN travels beside the part as a flag: a max over ranks may drop it.
"""
from __future__ import annotations

import math
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn


def clip_across(params: Sequence[nn.Parameter], counted: Sequence[bool], max_norm: float, norm_type: float, error_if_nonfinite: bool, group: object, device: torch.device, timeout: float) -> torch.Tensor:
    """Clip the gradients of this rank's `params` by the norm of every rank's together, where
    `counted` says which of them this rank counts (a tied weight is counted on one rank only);
    returns the total norm, the same on every rank of `group`."""
    grads = [p.grad for p in params if p.grad is not None]
    mine = [p.grad for p, count in zip(params, counted) if count and p.grad is not None]
    sparse = any(g.layout != torch.strided for g in grads)  # refused on every rank, after the all-reduce
    norms = [torch.linalg.vector_norm(g.detach(), norm_type).to(device, torch.float64) for g in mine if g.layout == torch.strided]
    part, op = _part(torch.stack(norms) if norms else torch.zeros(0, dtype=torch.float64, device=device), norm_type, sparse)
    try:
        dist.all_reduce(part, op=op, group=group, async_op=True).wait(timedelta(seconds=timeout))  # type: ignore[union-attr]
    except RuntimeError as e:
        raise RuntimeError(
            f"clip_grad_norm_ did not get the other ranks' parts of the norm (timeout {timeout:g} s): {e}\nEvery rank of the "
            "pipeline must call pipe.clip_grad_norm_ at once (with the same max_norm and norm_type); a rank that "
            "died or is stuck says why in its own output."
        ) from e
    if part[3] > 0:
        raise RuntimeError(
            "clip_grad_norm_ got sparse gradients (of an nn.Embedding(sparse=True)) on some rank, and takes none, as "
            "torch.nn.utils.clip_grad_norm_ takes none.\nHow to fix: make the embedding dense (sparse=False) to clip its "
            "gradient, or train it unclipped."
        )
    total = _total(part, norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({float(total)}), so it cannot "
            "be clipped.\nHow to fix: pass error_if_nonfinite=False to clip anyway, or find where they overflow."
        )
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            g.mul_(coefficient.to(g.device, g.dtype))
    dtype = grads[0].dtype if grads else next((p.dtype for p in params if p.is_floating_point()), torch.get_default_dtype())
    return total.to(dtype)  # a rank without gradients returns the others' dtype


def _part(norms: torch.Tensor, p: float, sparse: bool = False) -> tuple[torch.Tensor, dist.ReduceOp.RedOpType]:
    """This rank's part of the norm of order `p`, a NaN flag, whether it has gradients and whether
    any is sparse, and how the ranks' parts combine (a flag set on one rank is set after either)."""
    nan = torch.isnan(norms)
    flags = [nan.any(), torch.tensor(norms.numel() > 0, device=norms.device), torch.tensor(sparse, device=norms.device)]
    if p == math.inf:
        value, op = norms.masked_fill(nan, 0.0).max() if norms.numel() else norms.new_zeros(()), dist.ReduceOp.MAX
    elif p == -math.inf:  # a min, as the max of the negated parts
        value, op = -(norms.masked_fill(nan, math.inf).min() if norms.numel() else norms.new_full((), math.inf)), dist.ReduceOp.MAX
    elif p == 0:
        value, op = (norms != 0).sum(), dist.ReduceOp.SUM
    else:
        value, op = norms.pow(p).sum(), dist.ReduceOp.SUM
    return torch.stack([value.to(torch.float64), *(flag.to(torch.float64) for flag in flags)]), op


def _total(part: torch.Tensor, p: float) -> torch.Tensor:
    """The norm from the ranks' parts combined by `_part`'s rule: NaN where any rank's was, 0 where
    no rank has a gradient (as torch's clip_grad_norm_ of no gradients)."""
    value, nan, some = part[0], part[1], part[2]
    total = value if p in (math.inf, 0) else -value if p == -math.inf else value.pow(1.0 / p)
    total = torch.where(some > 0, total, torch.zeros_like(total))
    return torch.where(nan > 0, torch.full_like(total, math.nan), total)
