"""Data-parallel replicas of a pipeline ("dp" in the mesh): each trains on its own share of the
batch, and DistributedDataParallel averages their gradients once per step, weighted so that they
are those of the whole batch.

A stage's backward runs on fxpipe's own autograd graphs, never through a DDP module's forward,
so DDP wraps a sink that holds this rank's parameters: its forward returns a zero that autograd
ties to every parameter with a gradient this step, and its backward hands each parameter that
gradient, scaled. Autograd's accumulation into `.grad` then fires DDP's hooks as a plain DDP
backward would:

    step's gradients g ──▶ sink backward: g x scale ──▶ AccumulateGrad (.grad += ...)
                                                        └──▶ DDP hook: bucket, all-reduce, / replicas
"""
from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fxpipe.compiled.placement import RankPlacement


class ReplicaFailed(RuntimeError):
    """A data-parallel replica of this rank's stages failed its step."""


def _collective_failure(error: BaseException) -> bool:
    """An error of the collective itself (gloo's or NCCL's: a peer gone, a timeout), not one
    raised by code run inside it (a hook's own error on this rank)."""
    text = str(error)
    return isinstance(error, dist.DistError) or any(word in text for word in ("gloo", "Gloo", "NCCL", "Connection", "Timed out", "timed out", "timeout"))


class Replicas:
    """This rank's stages and their replicas on the mesh's "dp" dimension."""

    def __init__(self, where: RankPlacement, params: Sequence[nn.Parameter]) -> None:
        self.where = where
        self.size = dist.get_world_size(where.dp_group)
        self._ddp: Optional[DistributedDataParallel] = None
        self._held: tuple[tuple[Any, ...], ...] = ()
        self.syncing = True  # off inside `Pipeline.no_sync()`
        self.watch(params)

    def watch(self, params: Sequence[nn.Parameter], present: Optional[Sequence[bool]] = None) -> None:
        """Wrap in DDP these parameters, less those that require grad but have no gradient this step
        (`present`, which every replica agreed on); again if that set changed since last time, or a
        parameter's dtype, device or shape did (DDP's buckets are made for them). Like DDP's
        constructor this is a collective of the replicas, and it copies replica 0's parameters to
        the others."""
        present = present if present is not None else [True] * len(params)
        held = [p for p, has in zip(params, present) if has or not p.requires_grad]
        key = tuple((id(p), p.requires_grad, p.dtype, p.device, p.shape) for p in held)
        if key == self._held:
            return
        trains = any(p.requires_grad for p in held)
        self._ddp = DistributedDataParallel(_Sink(held), process_group=self.where.dp_group) if trains else None
        self._held = key

    def agree(
        self, present: list[bool], loss: Optional[torch.Tensor], size: float, mean: bool, failed: str = "", alike: Optional[dict[str, bool]] = None
    ) -> tuple[float, Optional[torch.Tensor]]:
        """What every replica needs before gradients move: whether one failed (`failed` says how;
        then each raises, naming the failures, and none waits for gradients that will not come),
        that every replica's call was `alike` (its reduction, mode, autocast: else their gradients
        do not combine), the whole batch's loss, and the scale of this replica's gradients, its
        share of the batch for a mean-reduced loss (DDP then divides by the number of replicas)."""
        alike = {"reduction='mean'": mean, **(alike or {})}
        weight = float(size) if mean else 1.0
        head = torch.tensor(
            [float(bool(failed)), float(size), 0.0 if loss is None else float(loss) * weight, *map(float, alike.values()), *map(float, present)],
            dtype=torch.float64, device=self.where.device,
        )  # fmt: skip
        with self._bounded("the replicas' agreement at the end of the step"):
            dist.all_reduce(head, group=self.where.dp_group, async_op=True).wait(timedelta(seconds=self.where.timeout))
        if head[0] > 0:
            raise ReplicaFailed(self._failures(failed))
        differ = [name for name, n in zip(alike, head[3:].tolist()) if 0 < int(n) < self.size]
        if differ:
            raise RuntimeError(
                f"the data-parallel replicas of this rank's stages (ranks {dist.get_process_group_ranks(self.where.dp_group)}) "
                f"were called differently: {', '.join(differ)} on some and not on others, so their gradients "
                "cannot be combined.\nHow to fix: call train_step alike on every replica: the same reduction, under "
                "the same autocast, in the same train or eval mode."
            )
        if any(0 < int(n) < self.size for n in head[3 + len(alike):].tolist()):
            raise RuntimeError("a parameter got a gradient on some data-parallel replicas and not on others: the replicas ran different graphs")
        total = float(head[1]) if mean else 1.0
        new_loss = None if loss is None else torch.tensor(float(head[2]) / total, dtype=loss.dtype, device=loss.device)
        return weight * self.size / total, new_loss

    def _failures(self, failed: str) -> str:
        """Every replica has reached the all-reduce that told of a failure, so each can say how it
        failed: the text a healthy replica raises."""
        said: list[Any] = [None] * self.size
        dist.all_gather_object(said, (dist.get_rank(), failed), group=self.where.dp_group)
        lines = [f"  - rank {rank}: {text}" for rank, text in said if text]
        return "data-parallel replica(s) of this rank's stages failed this step:\n" + "\n".join(lines)

    def accumulate(self, held: Sequence[nn.Parameter], params: Sequence[nn.Parameter], grads: Sequence[Optional[torch.Tensor]], scale: float) -> None:
        """Add the replicas' weighted mean of `grads` into the `.grad` of `params` (those of `held`
        that require grad), through DDP; every replica has agreed which have a gradient. When not
        syncing, add this replica's own, scaled alike: the next synced step's all-reduce averages
        everything accumulated since, as DDP's `no_sync` does."""
        given = {id(p): g * scale for p, g in zip(params, grads) if g is not None}
        sparse = {k: g for k, g in given.items() if g.layout != torch.strided}  # (a sparse embedding's)
        self.watch(held, [id(p) in given and id(p) not in sparse for p in held])
        if self._ddp is not None:
            dense = {k: g for k, g in given.items() if k not in sparse}
            with self._bounded("the replicas' gradient all-reduce"), torch.enable_grad(), contextlib.nullcontext() if self.syncing else self._ddp.no_sync():
                self._ddp(dense).backward()
        for p in held:
            if id(p) in sparse:
                self._accumulate_sparse(p, sparse[id(p)])

    def _accumulate_sparse(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """A sparse gradient, which DDP's buckets cannot hold, added and averaged as DDP would: the
        replicas' mean of what `.grad` holds with it, where syncing; else added here alone."""
        total = grad if p.grad is None else p.grad + grad
        if self.syncing:
            total = total.coalesce()
            with self._bounded("the replicas' sparse gradient all-reduce"):
                dist.all_reduce(total, group=self.where.dp_group, async_op=True).wait(timedelta(seconds=self.where.timeout))
            total = total / self.size
        p.grad = total

    @contextlib.contextmanager
    def _bounded(self, what: str) -> Iterator[None]:
        """A collective of the replicas that fails (a replica died, or raised inside it: a hook on
        a parameter, say, while the others wait for its share) raises ReplicaFailed, naming the
        replicas' ranks; fxpipe's replica groups bound the wait by the pipeline's timeout."""
        try:
            yield
        except (RuntimeError, dist.DistError) as e:
            if isinstance(e, ReplicaFailed) or not _collective_failure(e):
                raise
            ranks = dist.get_process_group_ranks(self.where.dp_group)
            raise ReplicaFailed(
                f"{what} failed on rank {dist.get_rank()}: a data-parallel replica of this rank's stages (ranks "
                f"{ranks}) died, or raised in it and never sent its share, or took longer than timeout="
                f"{self.where.timeout:g}s: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}\n"
                "The process group may be broken now: end the processes (torchrun restarts them)."
            ) from e


class _Sink(nn.Module):
    """Holds parameters for DDP; its forward ties a zero to those given gradients (see above)."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        super().__init__()
        self.held = nn.ParameterList(params)

    def forward(self, given: dict[int, torch.Tensor]) -> torch.Tensor:
        params = [p for p in self.held if id(p) in given]
        return _Feed.apply([given[id(p)] for p in params], *params)


class _Feed(torch.autograd.Function):
    """Forward: a zero. Backward: the given gradients, one per parameter."""

    @staticmethod
    def forward(ctx: Any, grads: list[torch.Tensor], *params: torch.Tensor) -> torch.Tensor:
        ctx.grads = grads
        return torch.zeros((), dtype=torch.float64, device=params[0].device if params else None)

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        grads, ctx.grads = ctx.grads, None
        return (None, *grads)
