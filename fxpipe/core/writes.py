"""What a torch op writes in place and what it returns a view of, from its schema or its name."""
from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxpipe.core.attrs import fetch_attr


def version_of(t: torch.Tensor) -> Optional[int]:
    """Its version counter; None for an inference tensor, which keeps none (reading it raises)."""
    return None if t.is_inference() else t._version


def storage_key(t: torch.Tensor) -> int:
    """The storage `t` views (tensors of one storage share memory); a tensor without one
    (sparse, nested) stands for itself."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return id(t)


# Ops that always return a view of their first argument (or the argument itself): an in-place
# op on such a view writes the input.
_VIEWS = {
    "view", "view_as", "transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis", "t",
    "adjoint", "narrow", "select", "slice", "squeeze", "unsqueeze", "unflatten", "expand",
    "expand_as", "broadcast_to", "unfold", "chunk", "split", "split_with_sizes", "tensor_split",
    "hsplit", "vsplit", "dsplit", "unbind", "as_strided", "diagonal", "detach", "alias",
    "view_as_real", "view_as_complex", "atleast_1d", "atleast_2d", "atleast_3d",
}  # fmt: skip
# Ops that return a view, or the argument itself, where the input's layout, dtype or device
# allow, else a copy: what they returned on the example decides (`passes/inplace.mark_copies`).
# So does an op whose schema alone says its result may alias its input.
_VIEWS_OR_COPIES = {
    "reshape", "reshape_as", "contiguous", "flatten", "to", "type", "type_as", "double", "float", "half",
    "bfloat16", "int", "long", "short", "bool", "byte", "cpu", "cuda", "positive", "resolve_conj", "resolve_neg",
}  # fmt: skip
# So does `+h`. A dropout returns its input itself in eval mode or at rate 0, and a copy in
# training: both modes share a graph where they agree, and the rate may change after compiling,
# so it counts as a view (a write through it then orders the reads of its input after it, which
# holds what the input holds either way).
_FUNCTIONS_VIEWS_OR_COPIES = {operator.pos}
_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout}
# Tensor attributes that are views (`h.T`): torch.fx records them as `getattr(h, "T")`.
_ATTRIBUTE_VIEWS = {"T", "mT", "H", "mH", "real", "imag", "data"}
_NOT_MUTATING = {"requires_grad_", "retain_grad_", "share_memory_"}
# In-place ops that change what a tensor looks at (its shape, strides or storage), not the values
# it holds: the views made of it before keep theirs.
_METADATA_WRITES = {
    "transpose_", "t_", "swapaxes_", "swapdims_", "unsqueeze_", "squeeze_", "as_strided_", "resize_",
    "resize_as_", "set_", "detach_",
}  # fmt: skip


def changes_metadata_only(node: fx.Node) -> bool:
    """Whether `node` is an in-place op that changes its first argument's shape, strides or
    storage, not the values it holds (`h.transpose_(1, 2)`)."""
    return node.op in ("call_method", "call_function") and _op_name(node) in _METADATA_WRITES


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
    """Whether every overload of an op writes its first argument and returns it (`add_`, unlike a
    custom op that writes an argument, which returns nothing or a new tensor); None without a schema."""
    schemas = _schemas(target)
    if not schemas:
        return None
    return all(any(i == 0 for i, _ in _written_positions(s)) and _returns_argument(s, 0) for s in schemas)


def _returns_argument(schema: Any, position: int) -> bool:
    """Whether the op returns its argument at `position` (the same alias set: `Tensor(a!)`)."""
    alias = schema.arguments[position].alias_info if position < len(schema.arguments) else None
    return alias is not None and any(r.alias_info is not None and r.alias_info.before_set == alias.before_set for r in schema.returns)


def returns_written(node: fx.Node, target: fx.Node) -> bool:
    """Whether `node`, which writes `target` in place, returns it: aten's in-place ops and `out=`
    ops do; `setitem` and a custom op that writes an argument (which returns nothing or a new
    tensor) do not."""
    if node.op != "call_function":
        return True  # a method or a module: `x.add_(1)` returns x, an in-place ReLU its input
    if node.target is operator.setitem:
        return False
    schemas = _schemas(node.target)
    if not schemas:
        return True
    places = [(s, i) for s in schemas for i, name in _written_positions(s)
              if (node.args[i] if i < len(node.args) else node.kwargs.get(name)) is target]  # fmt: skip
    return bool(places) and all(_returns_argument(s, i) for s, i in places)


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
    if getattr(node.target, "__module__", None) == "_operator":  # `a & b` is operator.and_, which writes nothing
        return False
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


def _also_written(node: fx.Node) -> list[fx.Node]:
    """Every argument the op's schema marks written, of an op that writes several: an aten op's,
    or a torch function's of that name (`torch.fused_moving_avg_obs_fake_quant`, which fake
    quantisation's observers call, writes its four statistics)."""
    if node.op != "call_function":
        return []
    found = []
    for i, name in _positions_written(node.target):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(name)
        if isinstance(value, fx.Node) and value not in found:
            found.append(value)
    return found


_WRITTEN_BY: dict[Any, tuple[tuple[int, str], ...]] = {}


def _positions_written(target: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of every argument the op writes in any overload (the passes ask of each
    node several times: looked up once per op)."""
    try:
        return _WRITTEN_BY[target]
    except (KeyError, TypeError):  # (TypeError: a target that cannot be hashed, looked up each time)
        pass
    schemas = _schemas(target)
    places = [place for s in schemas for place in _written_positions(s)] if schemas else list(_torch_function_writes(target))
    found = tuple(dict.fromkeys(places))
    try:
        _WRITTEN_BY[target] = found
    except TypeError:
        pass
    return found


def _torch_function_writes(target: Any) -> tuple[tuple[int, str], ...]:
    """For a torch function that binds an aten op of its name, the arguments written in place
    that every overload writes at the same place: torch's functions take the op's arguments."""
    name = getattr(target, "__name__", None)
    if not isinstance(name, str) or getattr(target, "__module__", None) != "torch" or not callable(target):
        return ()
    return _written_everywhere(name)


@functools.cache
def _written_everywhere(name: str) -> tuple[tuple[int, str], ...]:
    positions = [set(_written_positions(op._schema)) for op in aten_overloads(name)]
    return tuple(sorted(set.intersection(*positions))) if positions else ()


def written_arguments(gm: fx.GraphModule, node: fx.Node) -> list[fx.Node]:
    """The values `node` writes in place: `written_value`, or, for a higher-order op that runs a
    subgraph on its operands (torch.export's `wrap_with_set_grad_enabled` around a `no_grad`
    region, say), the operands that its subgraph writes; and those an opaque call wrote on the
    example (passes/opaque_writes.py)."""
    inside = operands_written_inside(gm, node, written_arguments)
    if inside is not None:
        return inside
    target = written_value(gm, node)
    found = [target] if target is not None else []
    found += [value for value in _also_written(node) if value not in found]
    # What an opaque call (a module kept whole, a wrapped function) wrote on the example.
    return found + [value for value in node.meta.get("writes_seen", ()) if value not in found]


def operands_written_inside(
    gm: fx.GraphModule, node: fx.Node, written_by: Callable[[fx.GraphModule, fx.Node], list[fx.Node]],
) -> Optional[list[fx.Node]]:
    """For a higher-order op that runs a subgraph on its operands, the operands whose subgraph
    placeholders (through views) `written_by` finds written by a node of the subgraph; None for
    any other node."""
    subgraph, operands = subgraph_call(gm, node)
    if subgraph is None:
        return None
    placeholders = [n for n in subgraph.graph.nodes if n.op == "placeholder"]
    found: list[fx.Node] = []
    for inner in subgraph.graph.nodes:
        for target in written_by(subgraph, inner):
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
    subgraph, operands = subgraph_call(gm, node.args[0])
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


def subgraph_call(gm: fx.GraphModule, node: fx.Node) -> tuple[Optional[fx.GraphModule], Sequence[Any]]:
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


def _op_name(node: fx.Node) -> Optional[str]:
    """The name of the torch op a node calls: a Tensor method, a function of `torch` (or
    `Tensor.name` called as one), an aten op's; None for anything else (a user's function)."""
    target = node.target
    if node.op == "call_method":
        return str(target)
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.partition("::")[2]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.partition("::")[2]
    if getattr(target, "__module__", None) in ("torch", "torch.functional") or getattr(target, "__objclass__", None) in (torch.Tensor, torch._C.TensorBase):
        return getattr(target, "__name__", None)
    return None


@functools.cache
def aten_overloads(name: str) -> tuple[Any, ...]:
    """The overloads of the aten op of that name; none where no aten op has it."""
    try:
        packet = getattr(torch.ops.aten, name) if name.isidentifier() else None
    except (AttributeError, RuntimeError):
        packet = None
    return tuple(getattr(packet, o) for o in packet.overloads()) if isinstance(packet, torch._ops.OpOverloadPacket) else ()


@functools.cache
def _aliases_by_schema(name: str) -> bool:
    """Whether the aten op of that name returns what may alias its first argument, in every
    overload taking a Tensor first (`aten.positive`: `Tensor(a) self -> Tensor(a)`)."""
    schemas = [op._schema for op in aten_overloads(name)]
    tensor_first = [s for s in schemas if s.arguments and isinstance(s.arguments[0].type, torch.TensorType)]
    return bool(tensor_first) and all(_aliases_first(s) for s in tensor_first)


def _aliases_first(schema: Any) -> bool:
    first = schema.arguments[0].alias_info if schema.arguments else None
    ret = schema.returns[0].alias_info if len(schema.returns) == 1 else None
    return first is not None and not first.is_write and ret is not None and not ret.is_write


def op_namespace(target: Any) -> Optional[str]:
    """The library of a torch op (`aten`, or a user's `torch.library` namespace); None for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.partition("::")[0]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.partition("::")[0]
    return None


def _view_kind(node: fx.Node) -> Optional[str]:
    """'view' for an op that always returns a view of its first argument, 'view or copy' for one
    that may return a copy, None for anything else."""
    if not node.args or not isinstance(node.args[0], fx.Node) or node.op not in ("call_method", "call_function", "call_module"):
        return None
    if node.op == "call_module":
        return _module_view_kind(node)
    if node.target in _DROPOUTS:
        return "view"
    if node.target in _FUNCTIONS_VIEWS_OR_COPIES:
        return "view or copy"
    if node.target is operator.getitem:
        return "view" if len(node.args) > 1 and _basic_index(node.args[1]) else None
    if node.target is getattr:
        return "view" if len(node.args) > 1 and node.args[1] in _ATTRIBUTE_VIEWS else None
    if op_namespace(node.target) not in (None, "aten"):
        schemas = _schemas(node.target)  # an op of its own library: its schema says, not a namesake of aten's
        return "view or copy" if schemas and all(_aliases_first(s) for s in schemas) else None
    name = _op_name(node)
    if name is None:
        return None
    if name in _VIEWS:
        return "view"
    if isinstance(node.target, torch._ops.OpOverload):
        aliases = name in _VIEWS_OR_COPIES or _aliases_first(node.target._schema)
    else:
        aliases = name in _VIEWS_OR_COPIES or _aliases_by_schema(name)
    return "view or copy" if aliases else None


def _module_view_kind(node: fx.Node) -> Optional[str]:
    """An nn.Identity returns its input itself; a dropout does in eval mode or at rate 0 (`_DROPOUTS`)."""
    owner = node.graph.owning_module
    module = fetch_attr(owner, str(node.target)) if owner is not None else None
    return "view" if isinstance(module, (torch.nn.Identity, torch.nn.modules.dropout._DropoutNd, torch.nn.AlphaDropout)) else None


def writes_a_view(gm: torch.nn.Module, node: fx.Node) -> bool:
    """An in-place write of a view (`v.mul_(g)`): what it returns is that view, as written."""
    return writes_first_argument(gm, node) and bool(node.args) and isinstance(node.args[0], fx.Node) and is_view(node.args[0])


def may_copy(node: fx.Node) -> bool:
    """Whether `node` returns a view of its first argument or a copy as the values it is given
    decide (`reshape`, `contiguous`, `to`): `is_view` until the example says otherwise."""
    return _view_kind(node) == "view or copy"


def is_view(node: fx.Node) -> bool:
    """Whether `node` returns a view of (or a tuple of views of) its first argument, or that
    argument itself; an op that returned a copy on the example (`mark_copies`) does not."""
    return not node.meta.get("copies") and _view_kind(node) is not None


def view_root(node: fx.Node) -> fx.Node:
    """Follow view-producing ops back to the tensor whose memory they share."""
    while is_view(node):
        first = node.args[0]
        assert isinstance(first, fx.Node)
        node = first
    return node
