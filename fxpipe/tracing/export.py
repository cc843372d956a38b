"""The torch.export front end, for models that torch.fx cannot trace symbolically."""
from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Optional

import torch
import torch.fx as fx
from torch import nn
from torch.export import Dim
from torch.utils._pytree import TreeSpec, keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from fxpipe.core.attrs import fetch_attr
from fxpipe.core.hooks import KINDS, hook_name, hook_tables, output_hook
from fxpipe.tracing.context_watch import (
    INFERENCE_MODE, SAVED_TENSOR_HOOKS, grad_mode_message, inference_mode_watched, saved_tensor_hooks_watched, unseen_grad_modes_watched,
)
from fxpipe.tracing.export_output import export_failure_unprinted
from fxpipe.tracing.trace import TraceError, containers_of, fields_of_dataclasses, plain_dicts

_PREFIX = "model."


class _Flat(nn.Module):
    """The model called with its inputs as flat leaves, so any signature exports alike."""

    def __init__(self, model: nn.Module, spec: TreeSpec, found: dict[str, Any]) -> None:
        super().__init__()
        self.model, self.spec = model, spec
        # Into `found["containers"]`: the output's container kinds, its dataclasses among them. A
        # function, which no copy of the module copies: export does not run this object itself.
        self.note: Callable[[Any], None] = lambda containers: found.update(containers=containers)

    def forward(self, *leaves: Any) -> Any:
        args, kwargs = tree_unflatten(list(leaves), self.spec)
        # A dataclass output torch.export cannot flatten (the model's own type, or one a library
        # registered without keys) is returned as its fields, and made again from them.
        returned = fields_of_dataclasses(self.model(*args, **kwargs), keyed=True)
        self.note(containers_of(returned))
        return plain_dicts(returned)


def hooks_export_runs_once(model: nn.Module) -> list[str]:
    """The module hooks of the model (and the global ones), which torch.export would run once, while
    it captures the model, and never at a call: each named with its module. Hooks whose whole
    effect is in the model's own output, as the trace captures it, are not (`output_hook`)."""
    found = [f"{kind} {hook_name(hook)} of {path or 'the model'}" for path, module in model.named_modules()
             for kind, table in zip(KINDS, hook_tables(module)) for hook in table.values() if not output_hook(hook)]  # fmt: skip
    found += [f"global {kind} {hook_name(hook)}" for kind, table in zip(KINDS, hook_tables(None)) for hook in table.values()]
    return found


def _dynamic_dims(leaves: list[Any], batch_dims: Mapping[int, Optional[int]]) -> tuple[Any, ...]:
    """Every dim of every tensor may vary (micro-batches are smaller than the example, sequence
    lengths change from step to step); torch.export fixes those the model ties to a size. An
    image batch varies in its batch dim alone (`_batch_dim_of_images`): symbolic heights and
    widths can cost export minutes (a Swin's window arithmetic), and another size compiles
    stages for it."""
    return tuple(
        ({d: Dim.AUTO} if (d := _batch_dim_of_images(t, batch_dims)) is not None else {d: Dim.AUTO for d in range(t.dim())})
        if isinstance(t, torch.Tensor) and t.dim() > 0 else None
        for t in leaves
    )


def _batch_dim_of_images(value: Any, batch_dims: Mapping[int, Optional[int]]) -> Optional[int]:
    """Of floats of four dims or more (images: batch, channels, height, width; volumes; a video
    with its batch along dim 1, as chunk_spec says), the batch dim; None for any other value."""
    if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() >= 4):
        return None
    dim = batch_dims.get(id(value), 0)
    return dim if dim is not None and 0 <= dim < value.dim() else 0


def held_static(gm: fx.GraphModule) -> set[tuple[int, int]]:
    """(input leaf, dim) of each dim export was asked to keep at the example's size."""
    return set(gm.meta.get(_HELD_STATIC, ()))


_HELD_STATIC = "held_static"  # gm.meta key: `held_static`'s answer, as `export_graph` asked
_BATCH_DIMS = "batch_dims_given"  # gm.meta key: by input leaf, the dim chunk_spec named (None: kept whole)


def _strip(target: str) -> str:
    return target[len(_PREFIX) :] if target.startswith(_PREFIX) else target


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _name_arguments(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], placeholders: list[fx.Node]) -> None:
    """`meta["argument"]` on each placeholder: the forward argument its leaf comes from (`bias`,
    `pair[1]`), for messages, where `leaves_3` would say nothing."""
    positional = [p.name for p in inspect.signature(model.forward).parameters.values() if p.kind in _POSITIONAL]
    for node, (path, _) in zip(placeholders, tree_flatten_with_path((args, kwargs))[0]):
        where, key, rest = path[0], path[1], path[2:]
        index = getattr(key, "idx", None)
        if getattr(where, "idx", None) == 0 and isinstance(index, int) and index < len(positional):
            name = positional[index]
        else:
            name = str(getattr(key, "key", index))
        node.meta["argument"] = name + keystr(rest)


# Batch norms in training mode, and where their `training` argument is: torch.nn.functional checks
# in Python that each channel has more than one value, and an exported graph calls the op below it.
_BATCH_NORMS = {
    torch.ops.aten.batch_norm.default: 5,
    torch.ops.aten.native_batch_norm.default: 5,
    torch.ops.aten._native_batch_norm_legit.default: 5,
    torch.ops.aten._native_batch_norm_legit.no_stats: 3,
    torch.ops.aten._native_batch_norm_legit_functional.default: 5,
}


def values_per_channel_checked(x: torch.Tensor) -> None:
    """The check torch.nn.functional.batch_norm makes: with one value per channel, the batch's
    variance is 0 and training normalises every sample to the bias (a micro-batch of one)."""
    if x.dim() >= 2 and x.numel() // max(x.shape[1], 1) == 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {x.shape}")


def _check_batch_norm_inputs(graph: fx.Graph) -> None:
    for node in list(graph.nodes):
        at = _BATCH_NORMS.get(node.target) if node.op == "call_function" else None  # type: ignore[call-overload]
        if at is not None and len(node.args) > at and node.args[at] is True:
            with graph.inserting_before(node):
                graph.call_function(values_per_channel_checked, (node.args[0],))


def export_graph(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], batch_dims: Optional[Mapping[int, Optional[int]]] = None,
) -> tuple[fx.GraphModule, TreeSpec]:
    """Export `model` and return its graph over the flat input leaves, with attribute targets
    named as in `model` (so that they resolve to the model's own parameters), and the input spec.
    `batch_dims`: the dim chunk_spec splits an input tensor along, by its id (else dim 0).

    The graph's placeholders are the leaves of `(args, kwargs)` in `tree_flatten` order; its
    output has the model's output structure.
    """
    leaves, spec = tree_flatten((args, kwargs))
    batch_dims = batch_dims or {}
    found: dict[str, Any] = {}
    under_no_grad = not torch.is_grad_enabled()
    with saved_tensor_hooks_watched() as hooked, inference_mode_watched() as inferred, unseen_grad_modes_watched() as unseen, export_failure_unprinted():
        program = torch.export.export(_Flat(model, spec, found), tuple(leaves), dynamic_shapes={"leaves": _dynamic_dims(leaves, batch_dims)}, strict=False)
    if hooked:
        raise TraceError(f"torch.export cannot capture {type(model).__name__}: {SAVED_TENSOR_HOOKS}")
    if inferred:
        raise TraceError(f"torch.export cannot capture {type(model).__name__}: {INFERENCE_MODE}")
    grad_mode_only = (not under_no_grad, grad_mode_message(unseen, under_no_grad)) if unseen else None
    exported = program.module()
    graph = exported.graph
    attrs: dict[str, Any] = {}
    guards = None
    for node in list(graph.nodes):
        if node.op == "call_module" and not node.users:  # the input guards: checked once per call, not per stage
            guards = getattr(exported, str(node.target), None)
            graph.erase_node(node)
        elif node.op == "get_attr":
            if not node.users:
                graph.erase_node(node)
                continue
            target = _strip(str(node.target))
            try:
                attrs[target] = fetch_attr(model, target)
            except AttributeError:
                target = str(node.target)
                attrs[target] = fetch_attr(exported, target)
            node.target = target
        stack = node.meta.get("nn_module_stack") or {}
        paths = [path for path, _ in stack.values() if path.startswith(_PREFIX)]
        node.meta["scope"] = _strip(paths[-1]) if paths else ""
    _name_arguments(model, args, kwargs, [n for n in graph.nodes if n.op == "placeholder"])
    _check_batch_norm_inputs(graph)
    output = next(n for n in graph.nodes if n.op == "output")
    out_spec = exported._out_spec
    assert out_spec is not None, "an exported module knows its output structure"
    output.args = (tree_unflatten(list(output.args[0]), out_spec),)
    output.meta["out_spec"] = out_spec  # fx turns any dict into its own: the model's kind is here
    output.meta["containers"] = found.get("containers")  # and its dataclasses here
    graph._codegen = fx.graph.CodeGen()
    gm = fx.GraphModule(attrs, graph, type(model).__name__)
    gm.meta["input_guards"] = guards  # export's checks of a call's inputs: the sizes and values it assumed
    gm.meta[_BATCH_DIMS] = {i: batch_dims[id(leaf)] for i, leaf in enumerate(leaves) if id(leaf) in batch_dims}
    gm.meta[_HELD_STATIC] = {
        (i, d) for i, leaf in enumerate(leaves) if (batch := _batch_dim_of_images(leaf, batch_dims)) is not None
        for d in range(leaf.dim()) if d != batch
    }  # fmt: skip
    # A grad mode the forward set to the one it was captured in, which the graph does not hold: it
    # serves calls in that mode alone (the mode, and why).
    gm.meta["grad_mode_only"] = grad_mode_only
    return gm, spec


def batch_is_specialized(gm: fx.GraphModule) -> bool:
    """Whether export fixed the batch size (a model that reshapes to the example's batch, say):
    of the first input split into micro-batches, its batch dim (chunk_spec's, else dim 0)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for index, node in enumerate(placeholders):
        value, dim = node.meta.get("val"), gm.meta.get(_BATCH_DIMS, {}).get(index, 0)
        if isinstance(value, torch.Tensor) and dim is not None and value.dim() > dim:
            return _is_concrete_int(value.shape[dim])
    return False


def fixed_dims(gm: fx.GraphModule) -> list[tuple[int, int, int]]:
    """(input leaf, dim, size) for every input dim that torch.export fixed to the example's size:
    a call with another size there would run a graph made for other shapes."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fixed = []
    for index, node in enumerate(placeholders):
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            fixed += [(index, dim, int(size)) for dim, size in enumerate(value.shape) if _is_concrete_int(size)]
    return fixed


def shapes_note(gm: fx.GraphModule) -> str:
    """A line for the plan: which input dims the exported graph fixed; the rest are dynamic."""
    fixed = fixed_dims(gm)
    if not fixed:
        return "input shapes: every dim dynamic"
    names = [str(n.meta.get("argument", n.name)) for n in gm.graph.nodes if n.op == "placeholder"]
    listed = ", ".join(f"{names[index]} dim {dim} = {size}" for index, dim, size in fixed)
    return f"input shapes: fixed by torch.export at {listed}; every other dim dynamic"


def _is_concrete_int(size: Any) -> bool:
    """Whether a size of an exported graph is a plain int, not a symbol (imported here: its
    module imports sympy, which `import fxpipe` need not pay for)."""
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    return bool(is_concrete_int(size))
