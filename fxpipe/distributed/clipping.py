"""Gradient clipping by the norm of the whole model's gradients, across processes too.

In one process `torch.nn.utils.clip_grad_norm_(pipe.parameters(), ...)` sees every gradient.
Across processes each rank holds its own stages' parameters only, so the same call there would
clip by that rank's part of the norm: every rank clipping differently from the plain model, and
the copies of a tied weight on two ranks drifting apart. Here the ranks add up their parts:

    rank 0: |g_a|^p + |g_tied|^p ─┐
                                  ├─ all-reduce (sum; max for p = inf) ─▶ total norm, on every rank
    rank 1: |g_b|^p  (g_tied: ─────┘    each rank scales its own gradients by the same factor
            its copy, counted on rank 0)
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
    norms = [torch.linalg.vector_norm(g.detach(), norm_type).to(device, torch.float64) for g in mine]
    infinite = math.isinf(norm_type)
    if infinite:
        part = torch.stack(norms).max() if norms else torch.zeros((), dtype=torch.float64, device=device)
    else:
        part = torch.stack(norms).pow(norm_type).sum() if norms else torch.zeros((), dtype=torch.float64, device=device)
    op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
    try:
        dist.all_reduce(part, op=op, group=group, async_op=True).wait(timedelta(seconds=timeout))  # type: ignore[union-attr]
    except RuntimeError as e:
        raise RuntimeError(
            f"clip_grad_norm_ did not get the other ranks' parts of the norm (timeout {timeout:g} s): {e}\nEvery rank of the "
            "pipeline must call pipe.clip_grad_norm_ at once (with the same max_norm and norm_type); a rank that "
            "died or is stuck says why in its own output."
        ) from e
    total = part if infinite else part.pow(1.0 / norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({float(total)}), so it cannot "
            "be clipped.\nHow to fix: pass error_if_nonfinite=False to clip anyway, or find where they overflow."
        )
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            g.mul_(coefficient.to(g.device, g.dtype))
    return total.to(grads[0].dtype) if grads else total
