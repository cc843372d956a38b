"""Deferred batch normalisation: each micro-batch is normalised on its own statistics, and the
running statistics are those of the whole batch, committed once per step.

With `deferred_batch_norm=True` every BatchNorm call of a stage becomes `batch_norm_deferred`:

    training forward    normalise with the micro-batch's mean and variance, update nothing,
                        record (count, mean, sum of squared deviations) per channel
    recompute           normalise the same way, record nothing
    eval                the module as it is (running statistics)

and after the step's last forward task the records of each module are merged (Chan et al.'s
pairwise formula) into one update of its running statistics: the plain model's on the full batch.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fxpipe.checkpoint import is_recomputing

_BatchNorm = nn.modules.batchnorm._BatchNorm
_local = threading.local()


class BatchStatistics:
    """Per-channel statistics of every micro-batch a step normalised, per module."""

    def __init__(self) -> None:
        self.records: dict[int, tuple[_BatchNorm, list[tuple[int, torch.Tensor, torch.Tensor]]]] = {}
        self.lock = threading.Lock()

    def record(self, module: _BatchNorm, x: torch.Tensor) -> None:
        dims = [d for d in range(x.dim()) if d != 1]
        with torch.no_grad():
            values = x.detach().to(module.running_mean.dtype) if module.running_mean is not None else x.detach()
            var, mean = torch.var_mean(values, dim=dims, correction=0)
        count = x.numel() // x.shape[1]
        with self.lock:
            self.records.setdefault(id(module), (module, []))[1].append((count, mean, var * count))

    def commit(self) -> None:
        """One running-statistics update per module, from all its micro-batches."""
        for module, parts in self.records.values():
            count, mean, squares = parts[0]
            for n, m, s in parts[1:]:
                delta = m - mean
                total = count + n
                mean = mean + delta * (n / total)
                squares = squares + s + delta.pow(2) * (count * n / total)
                count = total
            _update(module, count, mean, squares)
        self.records.clear()


def _update(module: _BatchNorm, count: int, mean: torch.Tensor, squares: torch.Tensor) -> None:
    """What `nn.BatchNorm` does to its running statistics after normalising a batch."""
    assert module.running_mean is not None and module.running_var is not None
    factor = 0.0 if module.momentum is None else module.momentum
    if module.num_batches_tracked is not None:
        module.num_batches_tracked.add_(1)
        if module.momentum is None:
            factor = 1.0 / float(module.num_batches_tracked)
    with torch.no_grad():
        unbiased = squares / max(count - 1, 1)
        module.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
        module.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)


def collecting(stats: Optional[BatchStatistics]) -> "_Collecting":
    """Within this block, deferred BatchNorm calls on this thread record into `stats`."""
    return _Collecting(stats)


class _Collecting:
    def __init__(self, stats: Optional[BatchStatistics]) -> None:
        self.stats = stats

    def __enter__(self) -> None:
        self.previous = getattr(_local, "stats", None)
        _local.stats = self.stats

    def __exit__(self, *exc: object) -> None:
        _local.stats = self.previous


def batch_norm_deferred(module: _BatchNorm, x: torch.Tensor) -> torch.Tensor:
    """A BatchNorm call whose running statistics are updated later, for the whole batch."""
    stats: Optional[BatchStatistics] = getattr(_local, "stats", None)
    if not module.training or not module.track_running_stats or (stats is None and not is_recomputing()):
        return module(x)  # read live: the flag may have changed since compiling
    module._check_input_dim(x)  # type: ignore[operator]
    if stats is not None and not is_recomputing():
        stats.record(module, x)
    return F.batch_norm(x, None, None, module.weight, module.bias, True, 0.0, module.eps)


def is_deferrable(module: nn.Module) -> bool:
    """A BatchNorm with running statistics and torch's own forward (a subclass's forward of its
    own may do more than normalise: `batch_norm_deferred` would drop it)."""
    return isinstance(module, _BatchNorm) and module.running_mean is not None and type(module).forward is _BatchNorm.forward


def defer_batch_norm(stage: fx.GraphModule) -> fx.GraphModule:
    """Rewrite a generated stage so that its BatchNorm calls go through `batch_norm_deferred`."""
    graph = stage.graph
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        if not is_deferrable(stage.get_submodule(str(node.target))):
            continue
        with graph.inserting_before(node):
            getter = graph.get_attr(str(node.target))
            call = graph.call_function(batch_norm_deferred, (getter, *node.args), dict(node.kwargs))
        node.replace_all_uses_with(call)
        graph.erase_node(node)
    stage.recompile()
    return stage
