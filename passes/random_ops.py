"""Which nodes of a graph may draw random numbers: decided from the graph, not by watching ops.

A node is one of three things:

    never random   Linear, add, a dropout with p=0 or training=False written into the graph
    random if      a dropout module or RReLU (or a module holding one): while training with p > 0,
                   read when the stage runs, so a rate changed between steps takes effect
    always random  rand*, bernoulli, a dropout whose p or training flag is a value, a fractional
                   max pool (in eval mode too), a module or function the graph does not show the
                   inside of, a module run with forward hooks
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fxpipe.core.randomness import (
    TORCH_NAMESPACES, begin_draws, draw_key, draw_rate, dropout_function, dropout_module, end_draws, method_with_generator, runs_hooks,
    with_generator,
)
from fxpipe.core.writes import aten_overloads, subgraph_call
from fxpipe.passes.codegen import CALLS_MODULE, called_module

# Functions whose randomness depends on a probability and a training flag:
# (probability argument: name, position, default), (training flag: name, position, default).
_GATED: dict[Any, tuple[tuple[str, int, float], tuple[str, int, bool]]] = {
    F.dropout: (("p", 1, 0.5), ("training", 2, True)),
    F.dropout1d: (("p", 1, 0.5), ("training", 2, True)),
    F.dropout2d: (("p", 1, 0.5), ("training", 2, True)),
    F.dropout3d: (("p", 1, 0.5), ("training", 2, True)),
    F.alpha_dropout: (("p", 1, 0.5), ("training", 2, False)),
    F.feature_alpha_dropout: (("p", 1, 0.5), ("training", 2, False)),
    torch.dropout: (("p", 1, 0.5), ("train", 2, True)),
    torch.alpha_dropout: (("p", 1, 0.5), ("train", 2, True)),
    torch.feature_dropout: (("p", 1, 0.5), ("train", 2, True)),
    F.scaled_dot_product_attention: (("dropout_p", 4, 0.0), ("", -1, True)),
    F.rrelu: (("", -1, 1.0), ("training", 3, False)),
    F.multi_head_attention_forward: (("dropout_p", 10, 0.0), ("training", 13, True)),
}
# Functions that draw in every mode unless handed what they would draw: (argument, position).
_UNLESS_GIVEN: dict[Any, tuple[str, int]] = {
    F.fractional_max_pool2d: ("_random_samples", 5),
    F.fractional_max_pool3d: ("_random_samples", 5),
    F.fractional_max_pool2d_with_indices: ("_random_samples", 5),
    F.fractional_max_pool3d_with_indices: ("_random_samples", 5),
}
# Built-in modules that draw in every mode, unless they hold what they would draw.
_FRACTIONAL_POOLS = (nn.FractionalMaxPool2d, nn.FractionalMaxPool3d)
RANDOM_FUNCTIONS = {
    torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like, torch.randint_like,
    torch.bernoulli, torch.multinomial, torch.normal, torch.poisson, torch.randperm, F.gumbel_softmax,
}  # fmt: skip
RANDOM_METHODS = {
    "bernoulli", "bernoulli_", "multinomial", "uniform_", "normal_", "exponential_", "random_",
    "cauchy_", "log_normal_", "geometric_",
}  # fmt: skip
_DETERMINISTIC_MODULES = ("torch", "_operator", "operator", "math", "builtins", "fxpipe")
_PROBABILITY_ARGS = ("p", "dropout_p", "dropout")
_TRAINING_ARGS = ("train", "training")


# On a node that drew a value of one shape for the whole example and for each of its parts: a
# draw for the whole batch (stochastic depth in torchvision's mode="batch", a noise shared by every
# sample), which every micro-batch of a step then draws alike, as the plain model draws it once.
WHOLE_BATCH_DRAW = "draws_for_the_whole_batch"


@dataclass
class RandomSources:
    """What decides whether a stage draws random numbers when it runs."""

    always: bool = False
    modules: list[str] = field(default_factory=list)  # qualified names of modules that may draw


def argument(node: fx.Node, name: str, position: int, default: Any) -> Any:
    """A call's argument, given by `name` or at `position`, else `default`."""
    if name and name in node.kwargs:
        return node.kwargs[name]
    if 0 <= position < len(node.args):
        return node.args[position]
    return default


def _gated_by_constants(probability: Any, training: Any) -> bool:
    """Random unless a constant says otherwise: p == 0 or training is False."""
    if isinstance(training, bool) and not training:
        return False
    return not (isinstance(probability, (int, float)) and probability == 0)


def _overload_is_random(node: fx.Node) -> bool:
    op = node.target
    if op.namespace not in TORCH_NAMESPACES:  # type: ignore[union-attr]
        return True  # a library's own op (torch.library.custom_op): its kernel may draw, unseen
    if torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
        return False
    arguments = list(op._schema.arguments)  # type: ignore[union-attr]
    probability, training = None, None
    for position, declared in enumerate(arguments):
        if declared.name in _PROBABILITY_ARGS:
            probability = argument(node, declared.name, position, declared.default_value)
        if declared.name in _TRAINING_ARGS:
            training = argument(node, declared.name, position, declared.default_value)
    if probability is None and training is None:
        return True  # rand, bernoulli, randperm...
    return _gated_by_constants(probability, training)


def _function_is_random(node: fx.Node) -> bool:
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return _overload_is_random(node) if isinstance(target, torch._ops.OpOverload) else True
    if target in _GATED:
        (p_name, p_at, p_default), (t_name, t_at, t_default) = _GATED[target]
        return _gated_by_constants(argument(node, p_name, p_at, p_default), argument(node, t_name, t_at, t_default))
    if target in _UNLESS_GIVEN:
        return argument(node, *_UNLESS_GIVEN[target], None) is None
    if target in RANDOM_FUNCTIONS or getattr(target, "applies", None) is not None:
        return True  # (an autograd Function of the model's, applied: its forward is Python, which may draw)
    module = getattr(target, "__module__", None) or ""
    if module == "torch.nn.init":  # noise drawn as a weight is initialised: nn.init.normal_(torch.empty(...))
        return getattr(target, "__name__", "") not in _INIT_DETERMINISTIC
    if module == "torch" and _seeded(getattr(target, "__name__", "")):
        return True  # torch.binomial, and any other op torch tags as drawing
    return target is not operator.getitem and module.split(".")[0] not in _DETERMINISTIC_MODULES


_INIT_DETERMINISTIC = {"calculate_gain", "constant_", "ones_", "zeros_", "eye_", "dirac_"}
@functools.cache
def _seeded(name: str) -> bool:
    """Whether the aten op of that name draws random numbers in some overload (its schema's tag)."""
    return any(torch.Tag.nondeterministic_seeded in op.tags for op in aten_overloads(name))


def _holds_dropout(module: nn.Module) -> bool:
    return any(draw_rate(m) is not None for m in module.modules())


def _draws_in_every_mode(module: nn.Module) -> bool:
    """Whether `module` holds a layer that draws whatever its training flag (a fractional max
    pool draws its regions in eval mode too)."""
    return any(isinstance(m, _FRACTIONAL_POOLS) and m._random_samples is None for m in module.modules())


def _built_in(module: nn.Module) -> bool:
    """Whether `module` and every module inside it are PyTorch's own layers: a built-in
    container (nn.Sequential, nn.TransformerEncoder) may hold a layer of the model's that draws."""
    return all(type(m).__module__.startswith("torch.nn.") for m in module.modules())


def random_sources(gm: fx.GraphModule, nodes: Sequence[fx.Node]) -> RandomSources:
    """What may make these nodes draw random numbers (a stage's nodes, say)."""
    sources = RandomSources()
    for node in nodes:
        module = called_module(gm, node)  # a module shared with another stage: a function calls it
        if module is None and node.op == "call_function" and (_function_is_random(node) or _subgraph_draws(gm, node)):
            sources.always = True
        elif node.op == "call_method" and str(node.target) in RANDOM_METHODS:
            sources.always = True
        elif module is not None:
            if not _built_in(module) or runs_hooks([module]) or _draws_in_every_mode(module):
                sources.always = True  # called whole: its inside (and its hooks') is not in the graph
            elif _holds_dropout(module):
                sources.modules.append(str(node.target) if node.op == "call_module" else node.meta[CALLS_MODULE])
    return sources


def _subgraph_draws(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether a higher-order op runs a subgraph that may draw (torch.export's
    `wrap_with_set_grad_enabled` around a `no_grad` region holding a dropout)."""
    subgraph, _ = subgraph_call(gm, node)
    if subgraph is None:
        return False
    inner = random_sources(subgraph, list(subgraph.graph.nodes))
    return inner.always or bool(inner.modules)


def _torch_name(target: Any) -> Optional[str]:
    """The name of a `torch.rand*`-like function, which takes a `generator=`."""
    name = getattr(target, "__name__", "")
    return name if target in RANDOM_FUNCTIONS and getattr(torch, name, None) is target else None


def draw_from_task_streams(stage: fx.GraphModule) -> fx.GraphModule:
    """Rewrite the random ops that can take a generator to take their node's from the task's
    stream; mark the nodes whose draws the graph does not show (`begin_draws` before, `end_draws`
    after), so that the dispatch mode hands those draws their node's generator."""
    graph = stage.graph
    changed = False  # a stage that draws nothing keeps its code: generating it costs milliseconds
    for node in list(graph.nodes):
        key = draw_key(node.name, whole_batch=bool(node.meta.get(WHOLE_BATCH_DRAW)))
        replacement: Optional[tuple[Callable[..., Any], tuple[Any, ...]]] = None
        if node.op == "call_module" and type(stage.get_submodule(str(node.target))) is nn.Dropout:
            with graph.inserting_before(node):
                replacement = (dropout_module, (graph.get_attr(str(node.target)), *node.args))
        elif node.op == "call_function" and node.target is F.dropout:
            replacement = (dropout_function, node.args)
        elif node.op == "call_function" and _torch_name(node.target) and node.kwargs.get("generator") is None:
            replacement = (with_generator, (_torch_name(node.target), *node.args))
        elif node.op == "call_method" and node.target in RANDOM_METHODS and node.kwargs.get("generator") is None:
            replacement = (method_with_generator, (node.target, *node.args))
        elif _draws_unseen(stage, node):
            _mark(graph, node, key)
            changed = True
        if replacement is None:
            continue
        changed = True
        kwargs = {name: value for name, value in node.kwargs.items() if name != "generator"}  # (None: the default one's)
        with graph.inserting_before(node):
            call = graph.call_function(replacement[0], replacement[1], {**kwargs, "draw_key": key})
        node.replace_all_uses_with(call)
        graph.erase_node(node)
    if changed:
        stage.recompile()
    return stage


def _draws_unseen(stage: fx.GraphModule, node: fx.Node) -> bool:
    """Whether a node may draw where the graph does not show it: a call of a module holding a
    dropout or called whole (its inside is not in the graph), or a random function no generator
    can be handed to (attention with dropout, RReLU, an exported aten op)."""
    module = called_module(stage, node)
    if module is not None:
        return not _built_in(module) or _holds_dropout(module) or _draws_in_every_mode(module)
    return node.op == "call_function" and (_function_is_random(node) or _subgraph_draws(stage, node))


def _mark(graph: fx.Graph, node: fx.Node, key: int) -> None:
    with graph.inserting_before(node):
        graph.call_function(begin_draws, (key,))
    with graph.inserting_after(node):
        graph.call_function(end_draws, ())
