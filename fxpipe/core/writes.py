"""What a torch op writes in place and what it returns a view of, from its schema or its name."""
from __future__ import annotations

import operator
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from fxpipe.core.attrs import fetch_attr


def storage_key(t: torch.Tensor) -> int:
    """The storage `t` views (tensors of one storage share memory); a tensor without one
    (sparse, nested) stands for itself."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return id(t)


# Ops that return a view of their first argument: an in-place op on such a view writes the input.
_VIEW_METHODS = {
    "view", "view_as", "reshape", "transpose", "permute", "narrow", "select", "flatten",
    "unflatten", "squeeze", "unsqueeze", "expand", "expand_as", "t", "unfold", "chunk", "split",
    "as_strided", "diagonal", "contiguous", "detach", "unbind", "movedim", "swapaxes", "T", "mT",
}  # fmt: skip
_VIEW_FUNCTIONS = {operator.getitem, torch.transpose, torch.flatten, torch.reshape, torch.narrow,
                   torch.squeeze, torch.unsqueeze, torch.chunk, torch.split, torch.permute,
                   torch.select, torch.unbind, torch.movedim, torch.t, torch.detach}  # fmt: skip
_NOT_MUTATING = {"requires_grad_", "retain_grad_", "share_memory_"}


def _schemas(target: Any) -> list[Any]:
    """The schemas of an aten op: one for an `OpOverload`, every overload's for a packet."""
    if isinstance(target, torch._ops.OpOverload):
        return [target._schema]
    if isinstance(target, torch._ops.OpOverloadPacket):
        found = _PACKET_SCHEMAS.get(target)
        if found is None:  # every overload looked up: the passes ask of each node several times
            found = _PACKET_SCHEMAS[target] = [getattr(target, name)._schema for name in target.overloads()]
        return found
    return []


_PACKET_SCHEMAS: dict[Any, list[Any]] = {}


def _written_positions(schema: Any) -> list[tuple[int, str]]:
    """(position, name) of the arguments an op's schema marks as written (`Tensor(a!)`)."""
    return [
        (i, arg.name) for i, arg in enumerate(schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    ]  # fmt: skip


def _schema_writes_first(target: Any) -> Optional[bool]:
    """Whether every overload of an aten op writes its first argument; None without a schema."""
    schemas = _schemas(target)
    if not schemas:
        return None
    return all(any(i == 0 for i, _ in _written_positions(s)) for s in schemas)


def _schema_is_view(target: Any) -> bool:
    """An aten op whose result aliases its first argument without writing it (`aten.slice`)."""
    schemas = _schemas(target)

    def view(schema: Any) -> bool:
        first = schema.arguments[0].alias_info if schema.arguments else None
        ret = schema.returns[0].alias_info if len(schema.returns) == 1 else None
        return first is not None and not first.is_write and ret is not None and not ret.is_write

    return bool(schemas) and all(view(s) for s in schemas)


def writes_first_argument(gm: torch.nn.Module, node: fx.Node) -> bool:
    """Whether `node` writes its first argument in place (and, but for `setitem`, returns it);
    `gm` holds the modules it calls (the graph's module, or the model while tracing)."""
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.startswith("_") and name not in _NOT_MUTATING
    if node.op == "call_module":
        return bool(getattr(fetch_attr(gm, str(node.target)), "inplace", False))
    if node.op != "call_function":
        return False
    if node.target is operator.setitem or bool(node.kwargs.get("inplace", False)):
        return True
    if getattr(node.target, "applies", None) is not None:  # an autograd Function: as runs of it found
        return 0 in getattr(node.target, "writes", ())
    by_schema = _schema_writes_first(node.target)
    if by_schema is not None:
        return by_schema
    name = getattr(node.target, "__name__", "")
    return name.endswith("_") and not name.startswith("_") and name not in _NOT_MUTATING


def written_value(gm: torch.nn.Module, node: fx.Node) -> Optional[fx.Node]:
    """The value `node` writes in place: its first argument, or the `out=` tensor."""
    if writes_first_argument(gm, node):
        first = node.args[0] if node.args else None
        return first if isinstance(first, fx.Node) else None
    out = node.kwargs.get("out")
    if isinstance(out, fx.Node):
        return out
    for k in sorted(getattr(node.target, "writes", ())) if node.op == "call_function" else []:
        value = node.args[k] if k < len(node.args) else None
        if isinstance(value, fx.Node):
            return value
    for schema in _schemas(node.target) if node.op == "call_function" else []:
        for i, name in _written_positions(schema):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(name)
            if isinstance(value, fx.Node):
                return value
    return None


def written_arguments(gm: fx.GraphModule, node: fx.Node) -> list[fx.Node]:
    """The values `node` writes in place: `written_value`, or, for a higher-order op that runs a
    subgraph on its operands (torch.export's `wrap_with_set_grad_enabled` around a `no_grad`
    region, say), the operands that its subgraph writes."""
    subgraph, operands = _subgraph_call(gm, node)
    if subgraph is None:
        target = written_value(gm, node)
        return [target] if target is not None else []
    placeholders = [n for n in subgraph.graph.nodes if n.op == "placeholder"]
    found = []
    for inner in subgraph.graph.nodes:
        for target in written_arguments(subgraph, inner):
            root = view_root(target)
            if root in placeholders and placeholders.index(root) < len(operands):
                operand = operands[placeholders.index(root)]
                if isinstance(operand, fx.Node) and operand not in found:
                    found.append(operand)
    return found


def operand_returned(gm: fx.GraphModule, node: fx.Node) -> Optional[fx.Node]:
    """For `getitem(call, k)` of a higher-order op's subgraph call: the operand that the
    subgraph's k-th output is (through views and in-place writes), else None. torch.export's
    `no_grad` region returns the buffer it wrote: the same tensor, not a copy."""
    if node.op != "call_function" or node.target is not operator.getitem or not isinstance(node.args[0], fx.Node):
        return None
    subgraph, operands = _subgraph_call(gm, node.args[0])
    index = node.args[1] if len(node.args) > 1 else None
    if subgraph is None or not isinstance(index, int):
        return None
    outputs = next(n for n in subgraph.graph.nodes if n.op == "output").args[0]
    inner = outputs[index] if isinstance(outputs, (tuple, list)) and index < len(outputs) else None
    placeholders = [n for n in subgraph.graph.nodes if n.op == "placeholder"]
    seen = set()
    while isinstance(inner, fx.Node) and inner not in seen:
        seen.add(inner)
        if inner in placeholders:
            position = placeholders.index(inner)
            operand = operands[position] if position < len(operands) else None
            return operand if isinstance(operand, fx.Node) else None
        stepped = inner.args[0] if inner.args and (is_view(inner) or writes_first_argument(subgraph, inner)) else None
        inner = stepped if isinstance(stepped, fx.Node) else None
    return None


def _subgraph_call(gm: fx.GraphModule, node: fx.Node) -> tuple[Optional[fx.GraphModule], Sequence[Any]]:
    """For a higher-order op given a subgraph (a `get_attr` of a GraphModule), the subgraph and
    the operands after it, which its placeholders take in order; else (None, ())."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return None, ()
    for i, arg in enumerate(node.args):
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            value = fetch_attr(gm, str(arg.target))
            if isinstance(value, fx.GraphModule):
                return value, node.args[i + 1 :]
    return None, ()


def _basic_index(index: Any) -> bool:
    """`h[index]` is a view when the index is ints, slices, None and Ellipsis (not a tensor)."""
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in items)


def is_view(node: fx.Node) -> bool:
    """Whether `node` returns a view of (or a tuple of views of) its first argument; an op that
    returned a copy on the example (`mark_copies`) does not."""
    if not node.args or not isinstance(node.args[0], fx.Node) or node.meta.get("copies"):
        return False
    if node.op == "call_method":
        return str(node.target) in _VIEW_METHODS
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return len(node.args) > 1 and _basic_index(node.args[1])
    return node.target in _VIEW_FUNCTIONS or _schema_is_view(node.target)


# Ops that return a view where their input's layout allows, else a copy.


def view_root(node: fx.Node) -> fx.Node:
    """Follow view-producing ops back to the tensor whose memory they share."""
    while is_view(node):
        first = node.args[0]
        assert isinstance(first, fx.Node)
        node = first
    return node
