"""How many targets a model's own mean cross-entropy counts in each micro-batch, so that their losses combine into the batch's exactly.

A model that computes its own loss (`labels=` to a Hugging Face model) returns a cross-entropy
averaged over the targets that count: not those equal to `ignore_index` (padding, -100). Over
micro-batches that mean is not a mean of the micro-batches' means by samples:

    batch:  sample 0 counts 2 targets, sample 1 counts 8      loss = (l0 + l1) / 10
    micro-batches of one sample each, weighted by samples:   (l0 / 2 + l1 / 8) / 2   (another loss)
    weighted by the targets each counts:                      2/10 * l0/2 + 8/10 * l1/8 = (l0 + l1) / 10

With class weights the mean is over the weights of the targets that count, `weight[target]`,
and so is the count. Where the graph's loss output is such a cross-entropy (`F.cross_entropy`,
`F.nll_loss`, or a `CrossEntropyLoss` / `NLLLoss` called whole, reduction 'mean'), this pass makes
the part of the graph that computes its target (and its weights) from the inputs (a shift of the
labels, a view), so that each micro-batch's count is read from its own inputs.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, cast

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten

from fxpipe.core.attrs import fetch_attr
from fxpipe.core.own_loss import own_loss_in
from fxpipe.passes.batch_dims import COMBINES
from fxpipe.passes.random_ops import argument, random_sources

Counter = Callable[[dict[str, Any]], Optional[float]]

_FUNCTIONS = (F.cross_entropy, F.nll_loss)
_MODULES = (nn.CrossEntropyLoss, nn.NLLLoss)
_ATEN = (  # (self, target, weight, reduction, ignore_index, ...) alike
    torch.ops.aten.cross_entropy_loss.default, torch.ops.aten.nll_loss.default, torch.ops.aten.nll_loss_nd.default,
    torch.ops.aten.nll_loss2d.default,
)
_MEAN = 1  # aten's reduction: 0 none, 1 mean, 2 sum
# Positions of the arguments read, in F.cross_entropy's and F.nll_loss's signatures alike.
_TARGET, _WEIGHT, _SIZE_AVERAGE, _IGNORE_INDEX, _REDUCE, _REDUCTION = 1, 2, 3, 4, 5, 6


def own_loss_combines(gm: fx.GraphModule, template: Any, name_of: Callable[[Any], Optional[str]]) -> Optional[str]:
    """How the model's own loss on the example came from its parts' losses (the batch-dim
    check's runs): 'sum' or 'mean' over samples, or 'neither'; None where it ran no parts."""
    found = _own_loss(gm, template, name_of)
    combines = found[0].meta.get(COMBINES) if found is not None else None
    if found is None or not combines:
        return None
    returned, position, loss = found
    if returned is loss:
        return combines[0] if len(combines) == 1 else None
    return combines[position] if position < len(combines) else None


def own_loss_leaf(gm: fx.GraphModule, template: Any, name_of: Callable[[Any], Optional[str]]) -> Optional[int]:
    """Where the model's own loss is the `loss` field of a namedtuple that one graph value holds
    whole (the output `Out(loss, logits)`): the field's position among that value's leaves; None
    where the loss is a value of its own, or there is none."""
    found = _own_loss(gm, template, name_of)
    return found[1] if found is not None and found[0] is not found[2] else None


def loss_counter(gm: fx.GraphModule, template: Any, name_of: Callable[[Any], Optional[str]]) -> Optional[Counter]:
    """A function of one micro-batch's inputs (by placeholder name) giving how many targets its
    loss counts, or with class weights their weights' sum (None for a target of class
    probabilities); None where the model's own loss (the `loss` field of `template`, or the
    output itself, whose leaves `name_of` names) is no mean cross-entropy whose target (and
    weights) come from the inputs alone."""
    own = _own_loss(gm, template, name_of)
    found = _mean_loss(gm, own[2]) if own is not None else None
    if found is None:
        return None
    target, ignore_index, weight = found
    if not isinstance(target, fx.Node) or not isinstance(ignore_index, int):
        return None
    counting = _inputs_to(gm, target)
    weighing = _weights(gm, weight)
    if counting is None or weighing is None:
        return None
    graph, names = counting

    def count(values: dict[str, Any]) -> Optional[float]:
        """None where the target is no tensor of class indices (class probabilities: a mean over samples)."""
        with torch.no_grad():
            made = graph(*(values[name] for name in names))
            if not isinstance(made, torch.Tensor) or made.is_floating_point():
                return None
            counted = made[made != ignore_index]
            weights = weighing(values)
            return int(counted.numel()) if weights is None else float(weights.to(counted.device)[counted].sum())

    return count


def _weights(gm: fx.GraphModule, weight: Any) -> Optional[Callable[[dict[str, Any]], Optional[torch.Tensor]]]:
    """A function of one micro-batch's inputs giving the loss's class weights (None: none); None
    where they do not come from the inputs and the graph's tensors alone."""
    if weight is None:
        return lambda values: None
    if isinstance(weight, torch.Tensor):
        return _held(lambda: weight)
    if isinstance(weight, _ModuleWeight):  # a loss module's, read at each count: the tensor it holds then
        return _held(lambda: cast(Optional[torch.Tensor], weight.module.weight))
    if not isinstance(weight, fx.Node):
        return None
    made = _inputs_to(gm, weight)
    if made is None:
        return None
    graph, names = made
    if not names:  # made from the graph's tensors alone (a buffer of class weights)
        return _held(lambda: cast(torch.Tensor, graph()))
    return lambda values: graph(*(values[name] for name in names))


def _held(now: Callable[[], Optional[torch.Tensor]]) -> Callable[[dict[str, Any]], Optional[torch.Tensor]]:
    """Class weights the model holds, read at each count (None: a loss module's set to none
    since); across processes a rank that holds another rank's stage holds them on the meta
    device: there, their values when compiled."""
    first = now()
    kept = None if first is None or first.is_meta else first.detach().clone()

    def weights(values: dict[str, Any]) -> Optional[torch.Tensor]:
        held = now()
        if held is None or not held.is_meta:
            return held
        if kept is None:
            raise ValueError(
                "the model's own loss is a mean over class weights that another process's stage holds, and this one "
                "never held their values: it cannot weigh its micro-batches' losses by them.\nHow to fix: build the "
                "model with its weights on every rank before compiling, or return the logits and pass loss_fn with the "
                "weights (functools.partial(F.cross_entropy, weight=w)) and reduction='sum' over a count given whole."
            )
        return kept

    return weights


def _loss_node(gm: fx.GraphModule, template: Any, name_of: Callable[[Any], Optional[str]]) -> Optional[fx.Node]:
    """The graph's node that the model's own loss is (fxpipe/core/own_loss.py)."""
    nodes = {n.name: n for n in gm.graph.nodes}

    def node(leaf: Any) -> Optional[fx.Node]:
        name = name_of(leaf)
        return nodes.get(name) if name is not None else None

    def zero_dim(leaf: Any) -> bool:
        found = node(leaf)
        return found is not None and found.meta.get("shape") == ()

    return node(own_loss_in(template, lambda leaf: node(leaf) is not None, zero_dim))


def _own_loss(gm: fx.GraphModule, template: Any, name_of: Callable[[Any], Optional[str]]) -> Optional[tuple[fx.Node, int, fx.Node]]:
    """The model's own loss in the graph: the node the output returns it in, the loss's position
    among that node's leaves, and the node that computes it (the same one, but for a namedtuple's
    `loss` field)."""
    node = _loss_node(gm, template, name_of)
    return (node, 0, node) if node is not None else _loss_field(gm, template, name_of)


def _loss_field(gm: fx.GraphModule, template: Any, name_of: Callable[[Any], Optional[str]]) -> Optional[tuple[fx.Node, int, fx.Node]]:
    """Where the output is a namedtuple made by one node of its fields (torch.fx records
    `Out(loss, logits)` so), one of them `loss`: that node, the position of the field among its
    leaves, and the node the field is."""
    name = name_of(template)
    made = next((n for n in gm.graph.nodes if n.name == name), None) if name is not None else None
    kind = made.target if made is not None and made.op == "call_function" else None
    if made is None or not (isinstance(kind, type) and issubclass(kind, tuple) and "loss" in getattr(kind, "_fields", ())):
        return None
    names: tuple[str, ...] = kind._fields  # type: ignore[attr-defined]
    given = [*made.args, *(made.kwargs[n] for n in names[len(made.args) :] if n in made.kwargs)]
    position = names.index("loss")
    loss = given[position] if len(given) == len(names) else None
    if not isinstance(loss, fx.Node) or not isinstance(loss.meta.get("dtype"), torch.dtype):
        return None
    before = 0  # the leaves of the fields before it, as the returned value flattens: None holds none, an int one
    for leaf in tree_flatten(given[:position])[0]:
        if isinstance(leaf, fx.Node) and not isinstance(leaf.meta.get("dtype"), torch.dtype):
            return None  # a value of several tensors made by one node: its leaves are not counted here
        before += 1
    return made, before, loss


class _ModuleWeight(NamedTuple):
    """The class weights a loss module called whole holds (read at each count)."""

    module: nn.Module


def _mean_loss(gm: fx.GraphModule, node: fx.Node) -> Optional[tuple[Any, Any, Any]]:
    """(its target, its ignore_index, its class weights or None) for a mean cross-entropy or NLL
    loss: a function's, torch.export's aten op's, or a loss module's called whole."""
    if node.op == "call_function" and node.target in _FUNCTIONS:
        legacy = (argument(node, "size_average", _SIZE_AVERAGE, None), argument(node, "reduce", _REDUCE, None))
        if any(s is not None for s in legacy) or argument(node, "reduction", _REDUCTION, "mean") != "mean":
            return None
        return argument(node, "target", _TARGET, None), argument(node, "ignore_index", _IGNORE_INDEX, -100), argument(node, "weight", _WEIGHT, None)
    if node.op == "call_function" and node.target in _ATEN:  # (self, target, weight, reduction, ignore_index)
        if argument(node, "reduction", 3, _MEAN) != _MEAN:
            return None
        return argument(node, "target", 1, None), argument(node, "ignore_index", 4, -100), argument(node, "weight", 2, None)
    if node.op == "call_module":
        module = fetch_attr(gm, str(node.target))
        if type(module) not in _MODULES or module.reduction != "mean" or node.kwargs:
            return None
        weight = _ModuleWeight(module) if module.weight is not None else None
        return (node.args[1] if len(node.args) > 1 else None), module.ignore_index, weight
    return None


def _inputs_to(gm: fx.GraphModule, value: fx.Node) -> Optional[tuple[fx.GraphModule, list[str]]]:
    """A graph computing `value` from the placeholders it reads (their names, in order), where
    it needs no parameter, module or random draw: only functions and methods of the inputs and
    of constants (`torch.tensor(-100)` made in forward: a tensor the graph holds)."""
    needed: list[fx.Node] = []
    todo, seen = [value], set()
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op not in ("placeholder", "call_function", "call_method") and not _constant(gm, node):
            return None
        needed.append(node)
        todo += node.all_input_nodes
    if random_sources(gm, needed).always:
        return None
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    needed.sort(key=order.__getitem__)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in needed:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(env[value])
    return fx.GraphModule(gm, graph), [n.name for n in needed if n.op == "placeholder"]  # (its constants copied from gm)


def _constant(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A tensor the graph holds that no gradient reaches: no parameter."""
    if node.op != "get_attr":
        return False
    value = fetch_attr(gm, str(node.target))
    return isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and not value.requires_grad
