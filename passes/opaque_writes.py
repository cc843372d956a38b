"""Tensors a module kept whole or a wrapped function writes in place, which its graph node does not show: found by running the example."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx

from fxpipe.core.attrs import fetch_attr
from fxpipe.core.writes import version_of

__all__ = ["mark_opaque_writes"]

# Whose calls say what they write: by an op's schema, an `inplace` flag, a `name_`, or runs of an
# autograd Function (fxpipe/core/writes.py). A call of anything else is opaque to the passes.
_KNOWN_MODULES = ("torch", "_operator", "operator", "builtins", "math")


def _opaque(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_module":
        owner = type(fetch_attr(gm, str(node.target))).__module__
    elif node.op == "call_function" and getattr(node.target, "applies", None) is None:
        owner = getattr(node.target, "__module__", None) or ""
    else:
        return False
    return not any(owner == known or owner.startswith(f"{known}.") for known in _KNOWN_MODULES)


def mark_opaque_writes(gm: fx.GraphModule, inputs: tuple[Any, ...]) -> None:
    """`meta["writes_seen"]`: the nodes an opaque call (a module called whole, a function torch.fx
    wraps) wrote in place on the example, as the version counters of its inputs show.
    `written_arguments` counts them, so that the passes keep a read before such a write before
    it, carry the write to later stages and copy a received input a stage writes. Runs the
    graph once, only where such a call exists."""
    opaque = {node for node in gm.graph.nodes if _opaque(gm, node)}
    for node in opaque:
        node.meta.pop("writes_seen", None)
    if not opaque:
        return
    from fxpipe.passes.shapes import run_watching  # the shape pass's runner: real or on meta

    given: dict[fx.Node, list[tuple[fx.Node, torch.Tensor, Optional[int]]]] = {}

    def before(node: fx.Node, values: dict[fx.Node, Any]) -> None:
        if node in opaque:
            given[node] = [(arg, t, version_of(t)) for arg, t in values.items() if isinstance(t, torch.Tensor)]

    def after(node: fx.Node, value: Any, args: tuple[Any, ...]) -> None:
        written = [arg for arg, t, version in given.pop(node, ()) if version_of(t) != version]
        if written:
            node.meta["writes_seen"] = written

    try:
        run_watching(gm, inputs, after, before)
    except Exception:  # noqa: BLE001 - not runnable here: the calls count as writing nothing, as before
        pass
