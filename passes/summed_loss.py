"""Whether a loss is a sum over the batch on every batch, not only on the example: a sum, scaled by what no split input reaches.

The batch-dim check sees, on two parts of the example, whether a loss made from the whole batch is
their sum (passes/batch_dims.py). That holds on every batch only where the graph makes it so:

    tok.sum()                            a sum over the batch                       yes
    F.mse_loss(out, y, reduction="sum")  one, in a loss function (or its aten op)   yes
    tok.sum() / num_items_in_batch       scaled by an input kept whole              yes
    tok.sum() / mask.sum().clamp(min=1)  divided by a count of this batch           no (a mean)
    tok.sum() / mask.sum(1).max()        by the longest sequence of this batch      no
    a.sum() + b.sum()                    sums of the batch, added                   yes

A loss that the example shows to be a sum but this pass cannot follow is left unclassified
(combined as `reduction` says, with the warning that it cannot be checked).
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn

from fxpipe.core.attrs import fetch_attr

FromBatch = Callable[[fx.Node], bool]

_DIVIDES = {operator.truediv, torch.div, torch.true_divide, "div", "true_divide", "__truediv__", "div_"}
_MULTIPLIES = {operator.mul, torch.mul, "mul", "__mul__", "__rmul__", "mul_"}
_ADDS = {operator.add, operator.sub, torch.add, torch.sub, "add", "sub", "__add__", "__radd__", "__sub__", "add_", "sub_"}
_SUMS = {torch.sum, "sum"}
_KEEPS = {"to", "float", "double", "half", "bfloat16", "type_as", "clone", "contiguous", "squeeze", "reshape", "view"}
_ATEN_SUM = 2  # aten's reduction: 0 none, 1 mean, 2 sum


def summed_over_the_batch(gm: fx.GraphModule, node: fx.Node, from_batch: FromBatch) -> bool:
    """Whether `node` is a sum over the batch (`from_batch` tells the nodes a split input reaches),
    scaled by values that none reaches, or several such sums added."""
    target = node.target if node.op == "call_function" else str(node.target) if node.op == "call_method" else None
    if _sums(gm, node):
        return True
    batch = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node) and from_batch(a)]
    if target in _KEEPS or _is_aten(target, ("clone", "_to_copy", "squeeze", "view", "reshape")):
        return bool(node.args) and batch == [node.args[0]] and summed_over_the_batch(gm, batch[0], from_batch)
    if target in _DIVIDES or _is_aten(target, ("div",)):
        return batch == [node.args[0]] and summed_over_the_batch(gm, batch[0], from_batch)
    if target in _MULTIPLIES or _is_aten(target, ("mul",)):
        return len(batch) == 1 and summed_over_the_batch(gm, batch[0], from_batch)
    if target in _ADDS or _is_aten(target, ("add", "sub")):
        operands = [a for a in node.args[:2] if isinstance(a, fx.Node)]
        return len(operands) == 2 and batch == operands and all(summed_over_the_batch(gm, a, from_batch) for a in operands)
    if target is operator.getitem and node.args[1] == 0 and isinstance(node.args[0], fx.Node):
        return _sums(gm, node.args[0])  # (an aten loss that returns its total weight too: nll_loss_forward)
    return False


def _sums(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A reduction by sum of every element: `x.sum()`, a loss function or module with
    reduction 'sum', an aten op with reduction 2 (as torch.export writes them)."""
    target = node.target if node.op == "call_function" else str(node.target) if node.op == "call_method" else None
    if target in _SUMS:
        return len(node.args) == 1 and not node.kwargs.get("dim")
    if node.op == "call_function" and node.kwargs.get("reduction") == "sum":
        return True
    if isinstance(node.target, torch._ops.OpOverload):
        if node.target in (torch.ops.aten.sum.default,):
            return True
        positions = {a.name: k for k, a in enumerate(node.target._schema.arguments)}
        at = positions.get("reduction")
        given = node.kwargs.get("reduction", node.args[at] if at is not None and at < len(node.args) else None)
        return bool(given == _ATEN_SUM)
    if node.op == "call_module":
        module = fetch_attr(gm, str(node.target))
        return isinstance(module, nn.modules.loss._Loss) and module.reduction == "sum"
    return False


def _is_aten(target: Any, names: tuple[str, ...]) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "aten" and target._overloadpacket.__name__ in names
