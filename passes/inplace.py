"""In-place writes: which ops write their first argument, and what later readers must see.

    a = f(x)                          a = f(x)
    b = relu_(a)        ─────▶        b = relu_(a)
    c = g(a)                          c = g(b)      # the reader after the write reads the writer

Within one stage the two graphs do the same thing (`b` is `a`). Across stages they do not: stage
boundaries copy values, so a stage that received `a` from its producer would never see another
stage's write. Reading the writer's result instead carries the write along the edges.
"""
from __future__ import annotations

import operator
from typing import Sequence

import torch
import torch.fx as fx

from fxpipe.passes.attrs import fetch_attr

# Ops that return a view of their first argument: an in-place op on such a view writes the input.
_VIEW_METHODS = {
    "view", "view_as", "reshape", "transpose", "permute", "narrow", "select", "flatten",
    "unflatten", "squeeze", "unsqueeze", "expand", "expand_as", "t", "unfold", "chunk", "split",
    "as_strided", "diagonal", "contiguous",
}  # fmt: skip
_VIEW_FUNCTIONS = {operator.getitem, torch.transpose, torch.flatten, torch.reshape, torch.narrow,
                   torch.squeeze, torch.unsqueeze, torch.chunk, torch.split, torch.permute}  # fmt: skip
_NOT_MUTATING = {"requires_grad_", "retain_grad_", "share_memory_"}


def writes_first_argument(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.startswith("_") and name not in _NOT_MUTATING
    if node.op == "call_module":
        return bool(getattr(fetch_attr(gm, str(node.target)), "inplace", False))
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        return (
            bool(node.kwargs.get("inplace", False))
            or node.target is operator.setitem
            or (name.endswith("_") and not name.startswith("_"))
        )
    return False


def _view_root(node: fx.Node) -> fx.Node:
    """Follow view-producing ops back to the tensor whose memory they share."""
    while node.args and isinstance(node.args[0], fx.Node) and (
        (node.op == "call_method" and node.target in _VIEW_METHODS)
        or (node.op == "call_function" and node.target in _VIEW_FUNCTIONS)
    ):
        node = node.args[0]
    return node


def mutated_inputs(gm: fx.GraphModule, run: Sequence[fx.Node], inputs: Sequence[str]) -> set[str]:
    """Stage inputs that the stage writes in place (say, a ReLU(inplace=True) on a received value).

    They are cloned on entry: a received value is an autograd leaf, and a checkpointed stage must
    find its saved inputs unchanged when it recomputes.
    """
    found = set()
    for node in run:
        if writes_first_argument(gm, node) and node.args and isinstance(node.args[0], fx.Node):
            root = _view_root(node.args[0])
            if root.name in inputs:
                found.add(root.name)
    return found



def redirect_reads_after_writes(gm: fx.GraphModule) -> fx.GraphModule:
    """Make every reader of a value that comes after an in-place write to it read the write's result.

    Writes through a view of the value (`x[0].add_(1)`) and `setitem` (which returns None) are
    left as they are.
    """
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    for writer in list(gm.graph.nodes):
        if writer.target is operator.setitem or not writes_first_argument(gm, writer):
            continue
        if not writer.args or not isinstance(writer.args[0], fx.Node):
            continue
        written = writer.args[0]
        for reader in list(written.users):
            if reader is not writer and position[reader] > position[writer]:
                reader.replace_input_with(written, writer)
    gm.recompile()
    return gm
