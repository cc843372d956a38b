"""Deferred batch normalisation: each micro-batch is normalised on its own statistics, and the
running statistics are those of the whole batch, committed once per step.

With `deferred_batch_norm=True` every BatchNorm call of a stage becomes `batch_norm_deferred`:

    training forward    normalise with the micro-batch's mean and variance, update nothing,
                        record (count, mean, sum of squared deviations) per channel
    recompute           normalise the same way, record nothing
    eval                the module as it is (running statistics)

and after the step's last forward task the records of each call are merged (Chan et al.'s
pairwise formula) into one update of its module's running statistics: the plain model's on the
full batch. A module called at several places is updated once per call, in the calls' order, as
the plain model updates it.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fxpipe.core.attrs import submodule_or_none
from fxpipe.core.eager_calls import runs_eagerly
from fxpipe.runtime.checkpoint import is_recomputing

_BatchNorm = nn.modules.batchnorm._BatchNorm
_local = threading.local()


Site = tuple[int, int]  # a BatchNorm call: its stage, and its place among the stage's calls


# A module's running mean, running variance and batch count, as its forward held them.
Buffers = tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]


class BatchStatistics:
    """Per-channel statistics of every micro-batch a step normalised, per call.

    The update goes to the buffers the module held when its forward recorded: under '2bw' a
    step's commit runs while a worker recomputes the next step's micro-batch on copies of them
    (fxpipe/runtime/checkpoint.py, `swapped_state`), which the module holds meanwhile."""

    def __init__(self) -> None:
        self.records: dict[Site, tuple[_BatchNorm, Buffers, list[tuple[int, torch.Tensor, torch.Tensor]]]] = {}
        self.lock = threading.Lock()

    def record(self, module: _BatchNorm, x: torch.Tensor, site: Site) -> None:
        dims = [d for d in range(x.dim()) if d != 1]
        if x.numel() == 0:  # no rows: nothing to merge (`commit` counts the call alone)
            with self.lock:
                buffers = (module.running_mean, module.running_var, module.num_batches_tracked)
                self.records.setdefault(site, (module, buffers, []))
            return
        with torch.no_grad():
            values = x.detach().to(module.running_mean.dtype) if module.running_mean is not None else x.detach()
            var, mean = torch.var_mean(values, dim=dims, correction=0)
        count = x.numel() // x.shape[1]
        with self.lock:
            buffers = (module.running_mean, module.running_var, module.num_batches_tracked)
            self.records.setdefault(site, (module, buffers, []))[2].append((count, mean, var * count))

    def commit(self) -> None:
        """One running-statistics update per call, from all its micro-batches, in the calls' order."""
        for _, (module, buffers, parts) in sorted(self.records.items(), key=lambda item: item[0]):
            if not parts:  # no micro-batch gave it rows: as nn.BatchNorm on an empty batch, counted, statistics kept
                _update(module, buffers, 0, None, None)
                continue
            count, mean, squares = parts[0]
            for n, m, s in parts[1:]:
                delta = m - mean
                total = count + n
                mean = mean + delta * (n / total)
                squares = squares + s + delta.pow(2) * (count * n / total)
                count = total
            _update(module, buffers, count, mean, squares)
        self.records.clear()


def _update(module: _BatchNorm, buffers: Buffers, count: int, mean: Optional[torch.Tensor], squares: Optional[torch.Tensor]) -> None:
    """What `nn.BatchNorm` does to its running statistics (`buffers`) after normalising a batch
    (of no rows where `mean` is None: the batch counted alone)."""
    running_mean, running_var, batches = buffers
    assert running_mean is not None and running_var is not None
    factor = 0.0 if module.momentum is None else module.momentum
    if batches is not None:
        batches.add_(1)
        if module.momentum is None:
            factor = 1.0 / float(batches)
    if mean is None or squares is None:
        return
    with torch.no_grad():
        unbiased = squares / max(count - 1, 1)
        # Through `.data`, as torch's kernel writes them: no version counted, so that a call of
        # the same BatchNorm earlier in the graph (which saved them) still backpropagates.
        running_mean.data.mul_(1 - factor).add_(mean, alpha=factor)
        running_var.data.mul_(1 - factor).add_(unbiased, alpha=factor)


def collecting_now() -> bool:
    """Whether BatchNorm calls on this thread record into a step's statistics now."""
    return getattr(_local, "stats", None) is not None


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


@runs_eagerly  # under compile_stages: its record and its thread's statistics stay out of the graph
def batch_norm_deferred(module: _BatchNorm, x: torch.Tensor, site: Site) -> torch.Tensor:
    """A BatchNorm call whose running statistics are updated later, for the whole batch."""
    stats: Optional[BatchStatistics] = getattr(_local, "stats", None)
    if not module.training or not module.track_running_stats or (stats is None and not is_recomputing()):
        return module(x)  # read live: the flag may have changed since compiling
    module._check_input_dim(x)  # type: ignore[operator]
    if stats is not None and not is_recomputing():
        stats.record(module, x, site)
    return F.batch_norm(x, None, None, module.weight, module.bias, True, 0.0, module.eps)


def is_deferrable(module: nn.Module) -> bool:
    """A BatchNorm with running statistics and torch's own forward (a subclass's forward of its
    own may do more than normalise: `batch_norm_deferred` would drop it)."""
    return isinstance(module, _BatchNorm) and module.running_mean is not None and type(module).forward is _BatchNorm.forward


def defer_batch_norm(stage: fx.GraphModule, owner: nn.Module, index: int) -> set[str]:
    """Rewrite the generated stage `index` so that its BatchNorm calls go through
    `batch_norm_deferred`, each with its site: torch.fx's calls of the module, and torch.export's
    `aten.batch_norm` in training on a module's running statistics. Returns the paths of the
    modules deferred in an exported graph, whose `num_batches_tracked.add_(1)` the step's commit
    does instead (`drop_batch_counts`)."""
    graph, exported, calls = stage.graph, set(), 0
    for node in list(graph.nodes):
        path = _exported_norm(node, owner)
        if node.op == "call_module" and is_deferrable(stage.get_submodule(str(node.target))):
            path, x = str(node.target), node.args[0]
        elif path is not None:
            _install(stage, path, owner.get_submodule(path))
            exported.add(path)
            x = node.args[0]
        else:
            continue
        with graph.inserting_before(node):
            call = graph.call_function(batch_norm_deferred, (graph.get_attr(path), x, (index, calls)))
        calls += 1
        node.replace_all_uses_with(call)
        graph.erase_node(node)
    stage.recompile()
    return exported


def _exported_norm(node: fx.Node, owner: nn.Module) -> Optional[str]:
    """The path of the BatchNorm whose running statistics `aten.batch_norm` normalises with in
    training, with the module's own weight and bias: its call of the module, exported."""
    if node.op != "call_function" or node.target is not torch.ops.aten.batch_norm.default or len(node.args) < 6:
        return None
    x, weight, bias, mean, var, training = node.args[:6]
    if training is not True or not all(isinstance(a, fx.Node) and a.op == "get_attr" for a in (mean, var)):
        return None
    path = str(mean.target).rpartition(".")[0]  # type: ignore[union-attr]
    module = submodule_or_none(owner, path)
    expected = [f"{path}.running_mean", f"{path}.running_var", f"{path}.weight", f"{path}.bias"]
    given = [a.target if isinstance(a, fx.Node) and a.op == "get_attr" else a for a in (mean, var, weight, bias)]
    affine = module is not None and module.affine
    if module is None or not is_deferrable(module) or given != (expected if affine else [*expected[:2], None, None]):
        return None
    return path


def _install(stage: fx.GraphModule, path: str, module: nn.Module) -> None:
    """Put the module itself where the exported stage holds a bare container of its tensors."""
    parent, _, name = path.rpartition(".")
    holder = stage.get_submodule(parent) if parent else stage
    if getattr(holder, name, None) is not module:
        setattr(holder, name, module)


def drop_batch_counts(stage: fx.GraphModule, paths: set[str]) -> None:
    """Remove an exported graph's `num_batches_tracked.add_(1)` for the deferred modules in
    `paths`: the step's commit counts the batch once (`_update`), not once per micro-batch."""
    counted = {f"{path}.num_batches_tracked" for path in paths}
    for node in list(stage.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.add_.Tensor and node.args[1:] == (1,):
            counter = node.args[0]
            if isinstance(counter, fx.Node) and counter.op == "get_attr" and counter.target in counted:
                node.replace_all_uses_with(counter)
                stage.graph.erase_node(node)
    stage.recompile()
