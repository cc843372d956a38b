"""Front ends: from a model to a graph, by torch.fx or, when fx fails, by torch.export."""
from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch.fx as fx
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten

from fxpipe.passes.export import batch_is_specialized, export_graph
from fxpipe.passes.trace import LeafSpec, TraceError, trace

Binder = Callable[[tuple[Any, ...], dict[str, Any]], dict[str, Any]]


@dataclass
class Traced:
    """A graph, how a call's arguments map onto its placeholders, and how it was made."""

    graph: fx.GraphModule
    bind: Binder
    note: Optional[str] = None


def signature_binder(gm: fx.GraphModule) -> Binder:
    """Arguments bound by the traced forward's signature (defaults applied), keyed by the
    placeholder nodes' names (an argument called `input` is the node `input_1`)."""
    signature = inspect.signature(gm.forward)
    names = {str(node.target): node.name for node in gm.graph.nodes if node.op == "placeholder"}

    def bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as error:
            raise TypeError(f"the pipeline takes the traced model's arguments {signature}: {error}") from None
        bound.apply_defaults()
        return {names[key]: value for key, value in bound.arguments.items()}

    return bind


def leaf_binder(gm: fx.GraphModule, spec: TreeSpec) -> Binder:
    """Arguments flattened into leaves, as the exported graph takes them."""
    names = [node.name for node in gm.graph.nodes if node.op == "placeholder"]

    def bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        leaves, called = tree_flatten((args, kwargs))
        if called != spec:
            raise TypeError(
                "the pipeline was exported for arguments shaped like the example, and this call differs:\n"
                f"  - example: {spec}\n  - call:    {called}\n"
                "How to fix: call it with the same positional and keyword arguments as the example."
            )
        return dict(zip(names, leaves))

    return bind


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def to_graph(model: nn.Module, example: tuple[Any, ...], leaf_modules: Iterable[LeafSpec], chunks: int) -> Traced:
    """Trace with torch.fx; when that fails, export; when both fail, one error with both reasons."""
    leaves = list(leaf_modules)
    try:
        gm = trace(model, leaves)
        return Traced(gm, signature_binder(gm))
    except TraceError as fx_error:
        reason = _first_line(fx_error.__cause__ or fx_error)
        try:
            gm, spec = export_graph(model, example, {})
        except Exception as export_error:
            raise TraceError(
                f"neither torch.fx nor torch.export can capture {type(model).__name__}.\n"
                f"torch.fx: {fx_error}\n"
                f"torch.export: {_first_line(export_error)}\n"
                "How to fix: keep the module with data-dependent control flow whole with "
                "leaf_modules=[...], or write the branch as tensor operations (torch.where) or "
                "with torch.cond."
            ) from export_error
    if chunks > 1 and batch_is_specialized(gm):
        raise TraceError(
            f"torch.export fixed the batch size of {type(model).__name__} to the example's, so "
            f"micro-batches of other sizes cannot run.\nHow to fix: use chunks=1, or avoid shapes "
            "that depend on the batch size in the model."
        )
    note = f"torch.fx could not trace {type(model).__name__} ({reason}); used torch.export"
    warnings.warn(note, stacklevel=3)
    return Traced(gm, leaf_binder(gm, spec), note)
