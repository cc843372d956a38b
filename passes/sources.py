"""What each output of a graph is computed from: the inputs and the parameters it depends on,
through tensors (a size or a dtype read from an input carries no gradient). Needs the shape pass.

An output that depends on no input and no parameter that requires grad (a constant, a mask made
from shapes), or only through a cut (`detach()`, a `torch.no_grad()` region), does not require
grad in the plain model, and must not in the pipeline either.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from fxpipe.core.attrs import fetch_attr


@dataclass
class Sources:
    """Placeholder names and parameters (by qualified name) a value depends on."""

    inputs: set[str] = field(default_factory=set)
    params: set[str] = field(default_factory=set)


# What returns its input cut from autograd: the output of a detach, or of a region run with
# gradients off (torch.export's higher-order op for `with torch.no_grad():`), carries no gradient.
_DETACH = {torch.detach, torch.Tensor.detach, torch.ops.aten.detach.default, torch.ops.aten.detach}


# What reads only the shape, dtype and device of its first argument, not its values: a constant
# made "like" an activation (`h.new_zeros(())`, `torch.zeros_like(h[0])`) depends on no input.
_LIKE_METHODS = {"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"}
_LIKE_FUNCTIONS = {
    torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.ops.aten.zeros_like.default,
    torch.ops.aten.ones_like.default, torch.ops.aten.empty_like.default, torch.ops.aten.full_like.default,
    torch.ops.aten.new_zeros.default, torch.ops.aten.new_ones.default, torch.ops.aten.new_empty.default,
    torch.ops.aten.new_full.default,
}  # fmt: skip
_LIKE = {*_LIKE_METHODS, *_LIKE_FUNCTIONS}  # (looked up per node before the call that sorts them)


def value_inputs(node: fx.Node) -> list[fx.Node]:
    """The nodes whose values `node`'s value depends on."""
    like = (node.op == "call_method" and node.target in _LIKE_METHODS) or (node.op == "call_function" and node.target in _LIKE_FUNCTIONS)
    if not like or not node.args or not isinstance(node.args[0], fx.Node):
        return node.all_input_nodes
    rest: list[fx.Node] = []
    fx.node.map_arg((node.args[1:], node.kwargs), rest.append)
    return list(dict.fromkeys(rest))


def _cuts_gradient(node: fx.Node) -> bool:
    """A detach (`x.detach()`, `x.detach_()`, `x.data`, a copy by `h.new_tensor(x)`), or a region
    run with gradients off."""
    if node.op == "call_method":
        return node.target in ("detach", "detach_", "new_tensor")
    if node.op != "call_function":
        return False
    if node.target in _DETACH or (node.target is getattr and node.args[1:2] == ("data",)):
        return True
    return node.target is torch.ops.higher_order.wrap_with_set_grad_enabled and bool(node.args) and node.args[0] is False


def _holds_no_gradient(node: fx.Node) -> bool:
    """Whether the shape pass found `node`'s value to hold tensors of no floating or complex
    dtype alone (a bool mask, indices), or no tensor."""
    dtypes = node.meta.get("dtype")
    found = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    known = [d for d in found if isinstance(d, torch.dtype)]
    return dtypes == () or (bool(known) and len(known) == len(found) and not any(d.is_floating_point or d.is_complex for d in known))


def _own(gm: fx.GraphModule, node: fx.Node) -> Sources:
    if node.op == "placeholder":
        return Sources(inputs={node.name})
    if node.op == "get_attr" and isinstance(fetch_attr(gm, str(node.target)), nn.Parameter):
        return Sources(params={str(node.target)})
    if node.op == "call_module":
        module = fetch_attr(gm, str(node.target))
        return Sources(params={f"{node.target}.{name}" for name, _ in module.named_parameters()})
    return Sources()


def output_sources(gm: fx.GraphModule, gradients: bool = True, every: bool = False) -> dict[str, Sources]:
    """For every value the output node reads (`every`: every node), by node name, what it is
    computed from: what its gradient reaches, or, without `gradients`, what its values depend on
    (through cuts too)."""
    sources: dict[fx.Node, Sources] = {}
    for node in gm.graph.nodes:
        if node.op != "output" and (node.meta.get("dtype") == () or (gradients and _cuts_gradient(node))):
            sources[node] = Sources()  # no tensor in it (x.shape, x.dtype), or cut: no gradient flows through
            continue
        inputs = value_inputs(node) if node.target in _LIKE else node.all_input_nodes  # (a set lookup: no call per node)
        own, parents = _own(gm, node), [sources[p] for p in inputs]
        if not own.inputs and not own.params and len(parents) == 1:
            sources[node] = parents[0]  # shared, never changed: a chain of ops costs no copies
            continue
        for parent in parents:
            own.inputs |= parent.inputs
            own.params |= parent.params
        sources[node] = own
    if every:
        return {node.name: found for node, found in sources.items()}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return {node.name: _returned(gm, node, sources) for node in output.all_input_nodes}


def _returned(gm: fx.GraphModule, node: fx.Node, sources: dict[fx.Node, Sources]) -> Sources:
    """What a returned value is computed from. One that held no tensor on the example (None:
    `need_weights=False` there) may hold one on another call: it depends on what its node reads."""
    if node.meta.get("dtype") != () or node.op == "placeholder":
        return sources[node]
    own = _own(gm, node)
    for parent in node.all_input_nodes:
        own.inputs |= sources[parent].inputs
        own.params |= sources[parent].params
    return own


def reached_from(gm: fx.GraphModule, outputs: frozenset[int]) -> tuple[frozenset[int], frozenset[str]]:
    """The placeholders (by position) and the attributes (get_attr targets, and the modules that
    call_module nodes call) that the graph's returned values at positions `outputs` are computed
    from: those a gradient from them reaches,
    as the plain model's autograd graph would: not through a cut (`detach()`, a no_grad region),
    nor through a value of no floating dtype (a comparison, an argmax), whose inputs autograd
    never reaches from it."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    returned = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    stack: list[fx.Node] = []
    for k in outputs:
        if k < len(returned):
            fx.node.map_arg(returned[k], stack.append)
    seen: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            if not (_cuts_gradient(node) or _holds_no_gradient(node)):
                stack.extend(node.all_input_nodes)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return (frozenset(i for i, n in enumerate(placeholders) if n in seen),
            frozenset(str(n.target) for n in seen if n.op in ("get_attr", "call_module")))  # fmt: skip
