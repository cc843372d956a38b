"""Stage generation: one GraphModule per stage, taking what it receives and returning what it sends.

A tensor that several stages read (tied weights, a shared buffer) is not read from a module
attribute inside the stage: it becomes a trailing input, so that the runtime can hand each stage
its own copy on its own device and sum the copies' gradients into the one `Parameter`.
"""
from __future__ import annotations

import copy
import functools
import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.fx._lazy_graph_module import _LazyGraphModule

from fxpipe.core.attrs import buffer_names, fetch_attr, tensors_read
from fxpipe.core.edges import CALLER, Edge
from fxpipe.core.microbatch import clone_tree
from fxpipe.passes.edges import stage_inputs, stage_outputs
from fxpipe.passes.inplace import mutated_inputs
from fxpipe.passes.partition import refuse
from fxpipe.passes.state import buffers_written

@dataclass
class StageCode:
    """A generated stage: `module(*inputs, *shared)` returns the tuple `outputs`, followed by
    the final values of the `written` inputs (the pipeline's inputs it writes in place, on its
    own copies, for the runtime to copy back into the caller's tensors)."""

    module: fx.GraphModule
    inputs: list[str]
    outputs: list[str]
    shared: list[str]
    written: list[str]


# On a stage's private copy of a model's module: the module it copies.
ORIGINAL = "_fxpipe_original"
_STRUCTURE = ("_parameters", "_buffers", "_modules", ORIGINAL)


CALLS_MODULE = "calls_module"  # node.meta key: the module a `call_with_state` node calls


def called_module(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    """The module `node` calls: a `call_module`'s, or the model's module whose private copy a
    `call_with_state` calls (the copy takes its attributes and hooks from it at every call)."""
    if node.op == "call_module":
        return gm.get_submodule(str(node.target))
    name = node.meta.get(CALLS_MODULE)
    if node.op != "call_function" or name is None:
        return None
    copy = gm.get_submodule(name)
    return copy.__dict__.get(ORIGINAL, copy)


def call_with_state(module: nn.Module, state: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
    """Call `module`, a stage's private copy of one of the model's modules, with some of its
    parameters or buffers replaced by `state` for this call, and with every other attribute as
    the model's module holds it now: its `training` flag after `pipe.eval()`, a dropout rate
    changed since compiling, its hooks; what the call assigns goes back to the model's module."""
    original = module.__dict__[ORIGINAL]
    pairs = list(zip(module.modules(), original.modules()))
    for mine, theirs in pairs:
        mine.__dict__.update((key, value) for key, value in theirs.__dict__.items() if key not in _STRUCTURE)
    try:
        return torch.func.functional_call(module, state, args, kwargs)
    finally:  # what its forward assigned (`self.calls += 1`) is the model's module's, as in the plain model
        for mine, theirs in pairs:
            changed = [(key, value) for key, value in mine.__dict__.items() if key not in _STRUCTURE and theirs.__dict__.get(key) is not value]
            theirs.__dict__.update(changed)


def private_copy(module: nn.Module) -> nn.Module:
    """A structural copy of `module` on its own parameters and buffers (the same tensors), that
    follows the module's other attributes at every call (`call_with_state`)."""
    memo = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    copied = copy.deepcopy(module, memo)
    copied.__dict__[ORIGINAL] = module  # not a child: the copy's parameters stay its own
    return copied


def resolve(owner: nn.Module, gm: fx.GraphModule, target: str) -> Any:
    """What a stage reads at `target`: the owner's attribute as it is now, else the graph's own
    (a constant the trace made)."""
    try:
        return fetch_attr(owner, target)
    except AttributeError:
        return fetch_attr(gm, target)


def tensors_held(gm: fx.GraphModule, owner: nn.Module, node: fx.Node) -> dict[str, torch.Tensor]:
    """`tensors_read`, each as `owner` holds it now. The graph keeps the tensor each of its
    `get_attr`s read when traced: after `model.w = nn.Parameter(...)` it still holds the old one,
    where the stage reads the new one."""
    return {name: resolve(owner, gm, name) for name in tensors_read(gm, node)}


Held = dict[fx.Node, dict[str, torch.Tensor]]


def shared_tensors(held: Held, runs: Sequence[Sequence[fx.Node]]) -> dict[int, str]:
    """Tensors read by more than one stage, as `owner` holds them now (`held`: `tensors_held`
    of each node), keyed by `id`, with the first name they are read by."""
    names: dict[int, str] = {}
    readers: dict[int, set[int]] = {}
    for index, run in enumerate(runs):
        for node in run:
            for name, tensor in held[node].items():
                names.setdefault(id(tensor), name)
                readers.setdefault(id(tensor), set()).add(index)
    return {key: names[key] for key, stages in readers.items() if len(stages) > 1}


def refuse_written_shared_buffers(gm: fx.GraphModule, owner: nn.Module, runs: Sequence[Sequence[fx.Node]], held: Held, shared: dict[int, str]) -> None:
    """A buffer that forward writes, held under several names by modules in several stages, goes
    to each as the model's tensor itself (as a tied weight does), which a recompute would write
    again: refused, naming each of its names."""
    written = {id(t): name for run in runs for node in run for name, t in buffers_written(gm, node).items()} if shared else {}
    if not any(key in written for key in shared):
        return
    names = buffer_names(owner)
    # (One name: the stages read it as one value of the graph, or a copy made after its write.)
    said = [" and ".join(names[key]) for key in shared if key in written and len(names.get(key, ())) > 1]
    if said:
        refuse(
            [f"the buffer {name} (one tensor), which forward writes, is read by more than one stage" for name in said],
            "How to fix: register the buffer under one name, or cut so that the modules that hold it share a stage "
            "(split_points=[...]): a recompute writes each stage's buffers on a copy, and a buffer read by several "
            "stages is their shared tensor, which it would write again.",
        )


def _placeholder_name(name: str) -> str:
    return "shared_" + re.sub(r"\W", "_", name)


class _StageBuilder:
    """Copies one stage's nodes into a fresh graph, resolving attributes against `owner`."""

    def __init__(self, gm: fx.GraphModule, owner: nn.Module, held: Held, shared: dict[int, str]) -> None:
        self.gm, self.owner, self.held, self.shared = gm, owner, held, shared
        self.graph = fx.Graph()
        self.env: dict[str, fx.Node] = {}
        self.attrs: dict[str, Any] = {}
        self.shared_inputs: dict[str, fx.Node] = {}

    def resolve(self, target: str) -> Any:
        return resolve(self.owner, self.gm, target)

    def attribute(self, node: fx.Node) -> fx.Node:
        value = self.resolve(str(node.target))
        if isinstance(value, torch.Tensor) and id(value) in self.shared:
            return self.shared_inputs[self.shared[id(value)]]
        if node.name not in self.env:
            self.attrs[str(node.target)] = value
            self.env[node.name] = self.graph.get_attr(str(node.target))
        return self.env[node.name]

    def arg(self, node: fx.Node) -> fx.Node:
        return self.attribute(node) if node.op == "get_attr" else self.env[node.name]

    def copy(self, node: fx.Node) -> None:
        state = self.held[node] if node.op == "call_module" else {}
        tied = {name: t for name, t in state.items() if id(t) in self.shared}
        if not tied:
            if node.op == "call_module":
                self.attrs[str(node.target)] = self.resolve(str(node.target))
            self.env[node.name] = self.graph.node_copy(node, self.arg)
            return
        # A module whose state other stages read too: call a private structural copy of it
        # (so two stage threads never swap attributes of one module object) with that state
        # passed in.
        # Held under the module's own name, so the stage's parameter names are the model's.
        private = str(node.target)
        self.attrs[private] = private_copy(self.resolve(private))
        local = {name[len(str(node.target)) + 1 :]: self.shared_inputs[self.shared[id(t)]] for name, t in tied.items()}
        args = fx.map_arg(node.args, self.arg)
        kwargs = fx.map_arg(node.kwargs, self.arg)
        target = self.graph.get_attr(private)
        self.env[node.name] = self.graph.call_function(call_with_state, (target, local, *args), kwargs)
        self.env[node.name].name = node.name
        self.env[node.name].meta[CALLS_MODULE] = private  # a call of that module, for the passes that look for one


def _stage_shared(held: Held, run: Sequence[fx.Node], shared: dict[int, str]) -> list[str]:
    found = {shared[id(t)]: None for node in run for t in held[node].values() if id(t) in shared}
    return list(found)


def generate_stages(
    gm: fx.GraphModule,
    runs: Sequence[Sequence[fx.Node]],
    edges: Sequence[Edge],
    owner: nn.Module | None = None,
) -> list[StageCode]:
    """One `GraphModule` per run of nodes, its code generated on first use (or by `ready`);
    attributes are resolved against `owner` (the user's model, whose modules and tensors the
    stages share) and then against `gm`."""
    owner = owner if owner is not None else gm
    # Shared are the tensors the stages will read, the owner's now: the graph's own may be those
    # the model held when traced, replaced since.
    held = {node: tensors_held(gm, owner, node) for run in runs for node in run}
    shared = shared_tensors(held, runs)
    refuse_written_shared_buffers(gm, owner, runs, held, shared)
    codes = []
    for index, run in enumerate(runs):
        builder = _StageBuilder(gm, owner, held, shared)
        inputs, outputs = stage_inputs(edges, index), stage_outputs(edges, index)
        for name in inputs:
            builder.env[name] = builder.graph.placeholder(name)
        names = _stage_shared(held, run, shared)
        for name in names:
            builder.shared_inputs[name] = builder.graph.placeholder(_placeholder_name(name))
        mutated = sorted(mutated_inputs(gm, run, inputs), key=inputs.index)
        for name in mutated:
            builder.env[name] = builder.graph.call_function(clone_tree, (builder.env[name],))
        from_caller = {e.value for e in edges if e.dst == index and e.src == CALLER}
        written = [name for name in mutated if name in from_caller]
        copies = [builder.env[name] for name in written]
        for node in run:
            builder.copy(node)
        builder.graph.output((*(builder.env[name] for name in outputs), *copies))
        # Its code is generated on first use: the passes after this one rewrite some stages, and
        # generating the code is the dearest part of building one (`ready` does it once, after them).
        module = _LazyGraphModule(builder.attrs, builder.graph, f"Stage{index}")
        codes.append(StageCode(module=module, inputs=inputs, outputs=outputs, shared=names, written=written))
    return codes


class BoundOperator(functools.partial):  # type: ignore[type-arg]
    """An operator overload's C++ entry point, called without `OpOverload.__call__`'s frame.

    A graph captured by torch.export calls every op as `torch.ops.aten.add.Tensor(...)`: four
    attribute lookups, then a Python frame that only forwards to the overload's `_op`, about a
    microsecond per op (a third of a small op's call), hundreds per forward. `partial`'s own call
    is C. The generated code names it `aten_add_Tensor`, a global of its own."""

    __name__: str


# Bind only while `OpOverload.__call__` does nothing but forward to `_op`; a torch whose wrapper
# does more keeps it (its subclasses, TorchBind's, are never bound).
_FORWARDS_ONLY = torch._ops.OpOverload.__call__.__code__.co_names == ("_op",)


@functools.cache
def bound_operator(op: torch._ops.OpOverload) -> BoundOperator:
    """The one `BoundOperator` of `op`, named for the generated code (`aten`, `add_Tensor`)."""
    bound = BoundOperator(op._op)
    bound.__module__ = op.namespace  # not "torch...": fx then names a global, not the full path
    bound.__name__ = f"{op._overloadpacket.__name__}_{op._overloadname}"
    return bound


def _bindable(target: Any) -> bool:
    return _FORWARDS_ONLY and type(target) is torch._ops.OpOverload and target.namespace != "torch"


def ready(stage: fx.GraphModule, *, bind_operators: bool = True) -> fx.GraphModule:
    """`stage` with its code generated, once every pass that rewrites it has run.

    `bind_operators`: the code calls each operator overload through its `BoundOperator`. Only the
    code changes: the graph's nodes keep their overloads, which the passes and pictures read."""
    nodes = [n for n in stage.graph.nodes if n.op == "call_function" and _bindable(n.target)] if bind_operators else []
    overloads = [node.target for node in nodes]
    for node, op in zip(nodes, overloads):
        node.target = bound_operator(op)
    try:
        _LazyGraphModule.force_recompile(stage)
    finally:
        for node, op in zip(nodes, overloads):
            node.target = op
    return stage


def direct_lookups(stages: Sequence[fx.GraphModule], owner: nn.Module) -> None:
    """Let the stages' code reach their submodules without `nn.Module.__getattr__`.

    The generated code reaches each module it calls from the stage, through the containers that
    building it made for the module's path (`getattr(self.blocks, "0").attn.qkv`); a submodule
    lives in its parent's `_modules`, so each step of a path first misses in the instance's
    `__dict__`, raising and catching an AttributeError, then runs `__getattr__` in Python: a
    microsecond each, hundreds per forward of a deep model. Each child of the stage and of its
    containers is also put in that `__dict__`, where a lookup finds it at once. Only objects the
    stage owns are touched (never a module of the model), and no name a class attribute has
    (`forward`, say), which the `__dict__` would shadow. `nn.Module.__setattr__` drops such an
    entry when a child is set again, so a later swap is seen as before.
    """
    theirs = {id(module) for module in owner.modules()}
    todo: list[nn.Module] = list(stages)
    while todo:
        container = todo.pop()
        found = vars(container)
        for name, child in container._modules.items():
            if child is None or name in found or hasattr(type(container), name):
                continue
            found[name] = child
            if type(child) is nn.Module and id(child) not in theirs:
                todo.append(child)
