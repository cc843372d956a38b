"""Data-parallel replicas of a pipeline ("dp" in the mesh): each trains on its own share of the
batch, and their gradients and losses are combined as those of the whole batch, once per step."""
from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from fxpipe.distributed import RankPlacement


class ReplicaFailed(RuntimeError):
    """A data-parallel replica of this rank's stages failed its step."""


def sync_replicas(
    where: RankPlacement, grads: list[Optional[torch.Tensor]], loss: Optional[torch.Tensor], size: int, mean: bool, failed: bool
) -> tuple[list[Optional[torch.Tensor]], Optional[torch.Tensor]]:
    """Gradients and loss of the whole batch, from this rank's and its replicas' (one batch
    each, on the "dp" dimension): for a mean-reduced loss, each replica's weighted by its batch
    size; for a sum-reduced one, summed. A replica whose step failed says so, and every replica
    raises: none waits for a sum that will not come."""
    group, timeout = where.dp_group, timedelta(seconds=where.timeout)
    device = where.device
    weight = float(size) if mean else 1.0
    present = [g is not None for g in grads]
    head = torch.tensor([float(failed), float(size), 0.0 if loss is None else float(loss) * weight, *map(float, present)], dtype=torch.float64, device=device)
    dist.all_reduce(head, group=group, async_op=True).wait(timeout)
    if head[0] > 0:
        raise ReplicaFailed(f"{int(head[0])} data-parallel replica(s) of this rank's stages failed this step; see their errors")
    replicas = dist.get_world_size(group)
    if any(0 < int(n) < replicas for n in head[3:].tolist()):
        raise RuntimeError("a parameter got a gradient on some data-parallel replicas and not on others: the replicas ran different graphs")
    total = float(head[1]) if mean else 1.0
    buckets: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        if g is not None:
            buckets.setdefault(g.dtype, []).append(g)
    summed: dict[int, torch.Tensor] = {}
    for tensors in buckets.values():
        flat = torch.cat([t.reshape(-1) * weight for t in tensors])
        dist.all_reduce(flat, group=group, async_op=True).wait(timeout)
        flat /= total
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
            summed[id(t)] = part.view_as(t)
    out = [summed[id(g)] if g is not None else None for g in grads]
    new_loss = None if loss is None else torch.tensor(float(head[2]) / total, dtype=loss.dtype, device=loss.device)
    return out, new_loss
