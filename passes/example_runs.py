"""Runs of a graph on example inputs for the batch-dim check: the values of chosen nodes, draws fixed, buffers written.

The graph runs node by node (an fx Interpreter), with no gradients, from the state the model
holds, which is put back after each run; nodes that draw random numbers or normalise by the
batch's statistics run under `FixedDraws`, so that the example and its parts see alike draws.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_map_only

from fxpipe.core.attrs import fetch_attr
from fxpipe.core.randomness import draws_now
from fxpipe.core.snapshot import preserved
from fxpipe.core.writes import version_of
from fxpipe.passes.fixed_draws import FixedDraws
from fxpipe.passes.random_ops import random_sources
from fxpipe.passes.shapes import Recorder, small_on_cpu
from fxpipe.passes.state import writable_buffer_names
from fxpipe.tracing.assignments import assignments_recorded


class DrawsOf(NamedTuple):
    """The key of a node's draws' shapes among a run's values (`FixedDraws.shapes`)."""

    node: fx.Node


class ExampleRunner(Recorder):
    """Runs the graph without writing node.meta (unless it `records` shapes, as `Recorder`
    does), keeping the values of the nodes in `keep` (of every node when it is None); the nodes
    in `fixed` run under `FixedDraws` (a Python call per op: only where it matters)."""

    def __init__(self, gm: fx.GraphModule, on_meta: bool, keep: Optional[set[fx.Node]], fixed: set[fx.Node], records: bool = False) -> None:
        super().__init__(gm, on_meta)
        self.keep, self.fixed = keep, fixed
        self.values: dict[Any, Any] = {}  # by node, and the shapes of its draws by DrawsOf(node)
        self.records = records

    def run_one(self, n: fx.Node) -> Any:
        # A method, not a bound method kept on the runner: that would be a reference cycle, and
        # the runner (with the values it keeps) would wait for the cyclic collector, which
        # compiling holds off.
        return super().run_node(n) if self.records else self.run_bare(n)

    def _run_uncounted(self, n: fx.Node) -> Any:
        # Without the shape pass's retry with gradients on: the parts run without them, and
        # the whole example's run must fail where they would (`propagate_shapes` then retries).
        return self.run_bare(n)

    def run_node(self, n: fx.Node) -> Any:
        if n in self.fixed:
            with FixedDraws() as draws:
                value = self.run_one(n)
            if self.keep is None or n in self.keep:
                self.values[DrawsOf(n)] = draws.shapes
        else:
            value = self.run_one(n)
        if self.keep is None or n in self.keep:
            self.values[n] = value
        return value


def drawing_or_normalising(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes that may draw random numbers or normalise by batch statistics in a run now (a
    dropout of rate 0, or one in eval mode, draws nothing)."""
    found = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        module = fetch_attr(gm, str(node.target)) if node.op == "call_module" else None
        norms = module is not None and any(isinstance(m, nn.modules.batchnorm._NormBase) for m in module.modules())
        sources = random_sources(gm, [node])
        if norms or "batch_norm" in str(node.target) or sources.always or draws_now([fetch_attr(gm, name) for name in sources.modules]):
            found.add(node)
    return found


@dataclass
class WholeRun:
    """The graph's run on the whole example, drawing nodes under `FixedDraws`: the values of
    the nodes the graph returns and of those drawing nodes, and the buffers the run wrote."""

    values: dict[fx.Node, Any]
    written: set[str] = field(default_factory=set)
    fixed: set[fx.Node] = field(default_factory=set)  # `drawing_or_normalising`'s nodes, for the next runs


def run_whole(gm: fx.GraphModule, inputs: tuple[Any, ...], records: bool = True) -> Optional[WholeRun]:
    """The run on the whole example that `annotate_batch_dims` makes; with `records`, writing
    what `propagate_shapes` does too (its draws fixed, which leaves the shapes alike): one run of
    the graph for both passes. None where it fails: `propagate_shapes` then says why, or runs
    the graph another way (for real where the meta device cannot)."""
    returned = next(n for n in gm.graph.nodes if n.op == "output").all_input_nodes
    whole = WholeRun({}, fixed=drawing_or_normalising(gm))
    try:
        (whole.values,) = run_on(
            gm, [inputs], small_on_cpu(gm, inputs), keep={*returned, *whole.fixed}, written=whole.written, records=records, fixed=whole.fixed,
        )  # fmt: skip
    except Exception:  # noqa: BLE001 - propagate_shapes says why, or runs it another way
        return None
    return whole


def run_on(
    gm: fx.GraphModule, examples: list[tuple[Any, ...]], real: bool, keep: Optional[set[fx.Node]], written: Optional[set[str]] = None,
    records: bool = False, fixed: Optional[set[fx.Node]] = None,
) -> list[dict[fx.Node, Any]]:
    """The values of the nodes in `keep` (of every node when None) on each of `examples`; the
    buffers the runs may write that they did write are added to `written`. With `records`, the
    runs write the shapes and FLOPs into node.meta (`propagate_shapes`). `fixed`: the graph's
    `drawing_or_normalising` nodes, where an earlier run found them."""
    runs = []
    fixed = drawing_or_normalising(gm) if fixed is None else fixed
    with preserved(gm), torch.no_grad():
        names = writable_buffer_names(gm, list(gm.graph.nodes)) if written is not None else []
        before = {name: (b, version_of(b), b.clone()) for name in names if (b := _buffer(gm, name)) is not None}
        for inputs in examples:
            with assignments_recorded(gm):  # each run from the attributes the model holds (a counter it reads)
                runs.append(_run_once(gm, cloned(inputs), real, keep, fixed, records))
        if written is not None:
            written.update(name for name, kept in before.items() if _written(_buffer(gm, name), *kept))
    return runs


def _written(now: Optional[torch.Tensor], buffer: torch.Tensor, version: Optional[int], values: torch.Tensor) -> bool:
    """Whether a run wrote `buffer`: replaced it, bumped its version, or changed its values (a
    fused kernel, quantisation's observer, writes without bumping the version)."""
    if now is not buffer or version is None or version_of(buffer) != version:
        return True
    if buffer.is_meta or buffer.shape != values.shape:
        return buffer.shape != values.shape
    if buffer.is_floating_point() or buffer.is_complex():  # NaN where it was NaN is unchanged
        return not torch.allclose(buffer, values, rtol=0, atol=0, equal_nan=True)
    return not torch.equal(buffer, values)


def _run_once(
    gm: fx.GraphModule, inputs: tuple[Any, ...], real: bool, keep: Optional[set[fx.Node]], fixed: set[fx.Node], records: bool,
) -> dict[fx.Node, Any]:
    """The values of the nodes in `keep` in one run: node by node, or, where only what the graph
    returns is kept and nothing needs the interpreter (no draws fixed, no shapes recorded, no meta
    copies), by the graph's own code, at half the cost."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    plain = type(gm.graph._codegen) is fx.graph.CodeGen  # returns its output node's args as they are
    if real and plain and not records and not fixed and keep is not None and keep <= set(output.all_input_nodes):
        values: dict[fx.Node, Any] = {}
        # (fx's plain code returns the output node's args as written: they pair up, or the
        # interpreter runs after all.)
        if _returned(output.args[0], gm.forward(*inputs), values):
            return {node: value for node, value in values.items() if node in keep}
    runner = ExampleRunner(gm, on_meta=not real, keep=keep, fixed=fixed, records=records)
    runner.run(*inputs)
    return runner.values


def _returned(arg: Any, value: Any, values: dict[fx.Node, Any]) -> bool:
    """Each node in the output's `arg` paired with its part of the returned `value`, into
    `values`; False where the two are not alike in shape."""
    if isinstance(arg, fx.Node):
        values.setdefault(arg, value)
        return True
    if isinstance(arg, (tuple, list)):
        return isinstance(value, (tuple, list)) and len(arg) == len(value) and all(_returned(a, v, values) for a, v in zip(arg, value))
    if isinstance(arg, dict):
        return isinstance(value, dict) and arg.keys() == value.keys() and all(_returned(a, value[k], values) for k, a in arg.items())
    return True


def _buffer(gm: fx.GraphModule, name: str) -> Optional[torch.Tensor]:
    try:
        return gm.get_buffer(name)
    except AttributeError:
        return None


def cloned(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """Copies of tensor inputs: a graph may write its inputs in place. An inference tensor's
    copy is one too, which the graph fails to write as it would fail on the caller's."""
    return tree_map_only(torch.Tensor, _clone, inputs)


def _clone(t: torch.Tensor) -> torch.Tensor:
    if not t.is_inference():
        return _clone_as_laid_out(t)
    with torch.inference_mode():
        return _clone_as_laid_out(t)


def _clone_as_laid_out(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t`, a view of a copy of its base where the base is small (a half of the
    example): at a call, a micro-batch is a view of the caller's tensor, and an op that reads the
    storage from an offset of its own (`x.as_strided(size, stride, 0)`) reads otherwise there."""
    base = t._base
    if base is None or base.numel() > 4 * t.numel():
        return t.clone()
    return base.clone().as_strided(t.size(), t.stride(), t.storage_offset())
