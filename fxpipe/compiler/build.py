"""Building a cut for the runtime: generated stage modules and what each stage's runtime needs.

Runs at compile time, and again when the runtime asks (a dtype cast makes new buffers, a deep
copy new parameters): the runtime calls it through `Compiled.build` and never reads the graph.
"""
from __future__ import annotations

import dataclasses
import operator
import warnings
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from fxpipe.compiled.program import UNSET, Cut, HeldState, Program, StageRuntime, code_of, hooks_that_count, settings_of
from fxpipe.compiled.stage_compile import CompiledForward
from fxpipe.core.attrs import fetch_attr
from fxpipe.core.own_code import caller_stacklevel
from fxpipe.core.writes import operands_written_inside
from fxpipe.core.hooks import GLOBAL_BACKWARD_HOOKS, global_backward_hooks
from fxpipe.passes.codegen import ORIGINAL, StageCode, called_module, direct_lookups, generate_stages, ready
from fxpipe.passes.loss_counts import loss_counter, own_loss_combines, own_loss_leaf
from fxpipe.passes.random_ops import draw_from_task_streams, random_sources
from fxpipe.passes.sources import output_sources
from fxpipe.passes.state import aliases_input, aliases_state, has_forward_hooks, statistics_written, writable_buffer_names, writable_buffers
from fxpipe.runtime.batchnorm import defer_batch_norm, drop_batch_counts
from fxpipe.runtime.checkpoint import slot_of
from fxpipe.runtime.gather import DataclassOutput, ValueRef
from fxpipe.schedules.actions import Layout


def build_program(
    owner: nn.Module, cut: Cut, *, devices: Sequence[torch.device], ranks: Sequence[int], deferred_batch_norm: bool,
    stored: frozenset[tuple[str, str]] = frozenset(), attributes: Optional[dict[str, Any]] = None,
    listed: Optional[frozenset[str]] = None, compile_stages: Optional[dict[str, Any]] = None,
    costs: Sequence[tuple[float, float, float]] = (),
) -> Program:
    """The stages of `cut` generated on `owner`'s parameters and buffers. `stored`: the tensors
    that requiring grad, modules called whole store in forward (by module path and name);
    `attributes`: the plain attributes the trace read, with their values when compiled;
    `listed`: the containers whose members the trace listed (None: not known, every one);
    `compile_stages`: torch.compile's arguments for every stage's forward (None: eager);
    `costs`: each stage's predicted F, I and W seconds per micro-batch, which zb-h1 orders by."""
    codes = generate_stages(cut.graph, cut.runs, cut.edges, owner)
    _refuse_opaque_values(cut)
    traced = _traced_through(owner, cut.graph)
    _refuse_backward_hooks_traced_through(traced)
    # What sits in the model's parameter tables and is no Parameter (a functional_call's swap) the
    # call refuses, by its name.
    in_tables = {id(t) for _, module in owner.named_modules() for t in module._parameters.values() if t is not None}
    _refuse_grad_tensors_held([found for code in codes for found in _grad_tensors_held(code.module, in_tables)])
    exported: set[str] = set()
    for index, code in enumerate(codes):
        draw_from_task_streams(code.module)
        if deferred_batch_norm:
            exported |= defer_batch_norm(code.module, owner, index)
    if deferred_batch_norm:
        for code in codes:
            drop_batch_counts(code.module, exported)
        _refuse_undeferred_statistics(codes)
    eager = compile_stages is None  # torch.compile reads the attributes and the overloads itself
    for code in codes:
        ready(code.module, bind_operators=eager)
    if eager:
        direct_lookups([code.module for code in codes], owner)

    def resolve(name: str) -> Any:
        try:
            return fetch_attr(owner, name)
        except AttributeError:
            return fetch_attr(cut.graph, name)

    shared = [[resolve(name) for name in code.shared] for code in codes]
    stored_by = _stored_by_module(owner, stored)
    written = set(writable_buffer_names(cut.graph, [n for run in cut.runs for n in run]))
    stages = [_stage(cut, codes, index, devices[index], shared[index], stored_by, written) for index in range(len(codes))]
    _refuse_slots_two_stages_hold(stages, owner)
    _reentered_by_one_stage(stages)
    if compile_stages is not None:
        for stage in stages:
            if not _writes_lost_by_compile(stage):
                stage.compiled = CompiledForward(stage.index, stage.module, compile_stages, owner)  # type: ignore[arg-type]
    template = _template(cut.graph)
    refs = [leaf for leaf in tree_flatten(template)[0] if isinstance(leaf, ValueRef) and leaf.given]
    inputs = {n.name for n in cut.graph.graph.nodes if n.op == "placeholder"}
    sources = output_sources(cut.graph)
    return Program(
        cut=cut,
        stages=stages,
        modules=[code.module for code in codes],
        shared=shared,
        layout=Layout.of(cut.edges, ranks, costs),
        template=template,
        given={ref.name: resolve(ref.name) for ref in refs if ref.name not in inputs},
        parameters=_parameters_read(stages, shared),
        output_inputs={name: list(s.inputs) for name, s in sources.items()},
        output_params={name: [resolve(p) for p in s.params] for name, s in sources.items()},
        # (the model's own hooks run around each call, read then: fxpipe/core/model_hooks.py)
        traced_hooks=[("*", None, hooks_that_count(None)), *((name, m, hooks_that_count(m)) for name, m in traced if name)],
        traced_code=[(name, m, code_of(m, listed is None or name in listed)) for name, m in traced],
        settings=_settings(cut.graph),
        held=HeldState.of(owner, [str(n.target) for n in cut.graph.graph.nodes if n.op == "get_attr"], attributes or {}),
        unreached=_unreached(owner),
        state_read=_state_read(codes, shared),
        loss_counter=loss_counter(cut.graph, template, _made_by_a_stage),
        own_loss_combines=own_loss_combines(cut.graph, template, _made_by_a_stage),
        own_loss_leaf=own_loss_leaf(cut.graph, template, _made_by_a_stage),
    )


def _made_by_a_stage(leaf: Any) -> Optional[str]:
    """The name of an output leaf that a stage makes; None for any other."""
    return leaf.name if isinstance(leaf, ValueRef) and not leaf.given else None


def _unreached(owner: nn.Module) -> list[str]:
    """The tensors in the model's parameter tables that require grad but are not Parameters
    (swapped in by torch.func.functional_call, say): no gradient of the pipeline reaches them."""
    return [
        f"{path}.{key}" if path else key
        for path, module in owner.named_modules()
        for key, tensor in module._parameters.items()
        if tensor is not None and not isinstance(tensor, nn.Parameter) and tensor.requires_grad
    ]


def _state_read(codes: Sequence[StageCode], shared: Sequence[Sequence[Any]]) -> dict[str, torch.Tensor]:
    """The parameters, buffers and tensor attributes the stages read, once each, by the model's
    names (the stage modules hold them under those; a tied one by its first)."""
    found: dict[int, tuple[str, torch.Tensor]] = {}
    for code, copies in zip(codes, shared):
        held = [*code.module.named_parameters(), *code.module.named_buffers(), *zip(code.shared, copies)]
        for name, tensor in held:
            if isinstance(tensor, torch.Tensor):
                found.setdefault(id(tensor), (name, tensor))
    return dict(found.values())


def _stored_by_module(owner: nn.Module, stored: frozenset[tuple[str, str]]) -> dict[int, list[tuple[str, str]]]:
    """By module id: the names its forward stores tensors requiring grad under, each with its path."""
    found: dict[int, list[tuple[str, str]]] = {}
    for path, name in sorted(stored):
        try:
            module = owner.get_submodule(path)
        except AttributeError:
            continue
        found.setdefault(id(module), []).append((name, f"{path}.{name}" if path else name))
    return found


def _stage(
    cut: Cut, codes: Sequence[StageCode], index: int, device: torch.device, shared: Sequence[Any], stored_by: dict[int, list[tuple[str, str]]],
    written: set[str],
) -> StageRuntime:
    code = codes[index]
    whole = _called_whole(code.module)
    sources = {e.value: e.src for e in cut.edges if e.dst == index}
    consumers: dict[str, list[int]] = {name: [] for name in code.outputs}
    for e in cut.edges:
        if e.src == index:
            consumers[e.value].append(e.dst)
    shared_ids = {id(t) for t in shared}
    params = [p for p in code.module.parameters() if id(p) not in shared_ids]
    paths: dict[int, list[str]] = {}
    for name, p in code.module.named_parameters(remove_duplicate=False):
        paths.setdefault(id(p), []).append(name)
    handed = _handed(code.module)
    shared_read = list({id(p): p for m in handed for p in m.parameters() if id(p) in shared_ids}.values())
    reentered = [*whole, *handed]
    random = random_sources(cut.graph, cut.runs[index])
    hidden = random_sources(code.module, list(code.module.graph.nodes))
    nodes = {node.name: node for node in cut.runs[index]}
    return StageRuntime(
        index, device, code.module, code.inputs, code.outputs, sources, consumers,
        params=params,
        param_slots=[[slot_of(code.module, path) for path in paths[id(p)]] for p in params],
        random_always=random.always,
        random_modules=[fetch_attr(cut.graph, name) for name in random.modules],
        hidden_always=hidden.always,
        hidden_modules=[code.module.get_submodule(name) for name in hidden.modules],
        called=_calls(code.module),
        writable_buffers=writable_buffers(code.module, cut.graph, cut.runs[index]),
        read_buffers={name: b for name, b in code.module.named_buffers() if name not in written and not b.is_inference()},
        state_outputs={name for name in code.outputs if _holds_state(cut.graph, nodes[name])},
        caller_views={name for name in code.outputs if aliases_input(cut.graph, nodes[name])},
        written=code.written,
        whole_modules=whole,
        stored=[(m, name, path) for m in whole for name, path in stored_by.get(id(m), [])],
        flagged=_flagged(code.module),
        reenters=bool(reentered) and not any(id(p) in shared_ids for m in reentered for p in m.parameters()),
        reads_in_backward=shared_read,
    )  # fmt: skip


def _holds_state(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether `node`'s value is a parameter or buffer (or a view of one), or holds one: a no_grad
    region's outputs, one of which is the buffer it wrote (read from them in a later stage)."""
    if aliases_state(gm, node):
        return True
    return any(user.target is operator.getitem and aliases_state(gm, user) for user in node.users)


def _refuse_slots_two_stages_hold(stages: list[StageRuntime], owner: nn.Module) -> None:
    """Each stage holds its own parameters' slots while it runs, on its worker: a slot two stages
    hold (a module each hands to an autograd Function, torch.utils.checkpoint's reentrant one)
    would be swapped by both at once. (One parameter in two slots, a weight tied between two
    modules, is two stages' own without a clash.)"""
    holders: dict[tuple[int, str], list[int]] = {}
    for stage in stages:
        for slots in stage.param_slots:
            for table, attr in slots:
                holders.setdefault((id(table), attr), []).append(stage.index)
    clashes = {key: held for key, held in holders.items() if len(set(held)) > 1}
    if clashes:
        tables = {id(m._parameters): name for name, m in owner.named_modules(remove_duplicate=False)}
        both = sorted(f"{tables.get(table, '?')}.{attr} (stages {', '.join(map(str, sorted(set(held))))})".lstrip(".")
                      for (table, attr), held in clashes.items())  # fmt: skip
        raise ValueError(
            f"parameters are held in their slots by several stages: {', '.join(both)}, through a module each stage "
            "hands to an autograd Function (torch.utils.checkpoint(self.block, ..., use_reentrant=True), say), whose "
            "code reads the module's own slots: the stages, running at once, would swap those slots under each "
            "other.\nHow to fix: torch.utils.checkpoint(..., use_reentrant=False), which the trace goes through (its "
            "parameters are then shared between the stages as any are), or split_points that put every call of "
            "the module in one stage."
        )


def _reentered_by_one_stage(stages: list[StageRuntime]) -> None:
    """A stage whose parameters another stage reads as its own too (a weight tied between a module
    each runs) cannot hold their slots in backward for both: it does not."""
    seen: dict[int, int] = {}
    for stage in stages:
        for p in stage.params:
            seen[id(p)] = seen.get(id(p), 0) + 1
    for stage in stages:
        if stage.reenters and any(seen[id(p)] > 1 for p in stage.params):
            stage.reenters = False
            handed = {id(p) for m in _handed(stage.module) for p in m.parameters()}  # type: ignore[arg-type]
            stage.reads_in_backward = [p for p in stage.params if seen[id(p)] > 1 and id(p) in handed]


def _settings(graph: fx.GraphModule) -> list[tuple[str, nn.Module, tuple[Any, ...]]]:
    """Each module the graph calls whole that has any of `SETTINGS`, with their values now."""
    found = {}
    for node in graph.graph.nodes:
        if node.op == "call_module":
            module = fetch_attr(graph, str(node.target))
            values = settings_of(module)
            if any(value is not UNSET for value in values):
                found[str(node.target)] = (str(node.target), module, values)
    return list(found.values())


def _writes_lost_by_compile(stage: StageRuntime) -> bool:
    """Whether torch.compile would lose what the stage writes: in-place writes to a 0-dim float64
    buffer (a counter, a running scalar) vanish from its graphs (torch 2.13), which the eager
    stage keeps. Such a stage runs eagerly, with a warning that names the buffers."""
    lost = [name for name, buffer in stage.writable_buffers.items() if buffer.dim() == 0 and buffer.dtype == torch.float64]
    if lost:
        warnings.warn(
            f"compile_stages: stage {stage.index} runs eagerly: it writes the 0-dim float64 buffer{'s' if len(lost) > 1 else ''} "
            f"{', '.join(lost)} in place, and torch.compile loses such writes. To compile it, give "
            f"{'them' if len(lost) > 1 else 'it'} shape (1,) or another dtype.",
            stacklevel=caller_stacklevel(),
        )
    return bool(lost)


def _handed(stage: fx.GraphModule) -> list[nn.Module]:
    """The model's modules the stage hands to an autograd Function (torch.utils.checkpoint's
    reentrant one): its backward runs them again, outside the stage's forward. With those it
    calls whole, they are the modules its backward may run: on parameters shared with no other
    stage, the step's leaves stand for them in their slots while it runs (`reenters`); where it
    shares one (a weight tied across stages), they read the model's own parameters there, as in
    forward (`_reentered_by_one_stage` sees the rest)."""
    return list(_handed_by_target(stage).values())


def _handed_by_target(gm: fx.GraphModule) -> dict[str, nn.Module]:
    """The modules the graph hands to an autograd Function, by the get_attr target that reads each."""
    return {
        str(arg.target): module for node in gm.graph.nodes if getattr(node.target, "applies", None) is not None
        for arg in node.all_input_nodes if arg.op == "get_attr" and isinstance(module := fetch_attr(gm, str(arg.target)), nn.Module)
    }  # fmt: skip


def _flagged(stage: fx.GraphModule) -> list[nn.Module]:
    """The model's modules a stage calls, and those inside them, once each: a private copy of
    one (`call_with_state`) takes the flags of the model's module at every call."""
    found: dict[int, nn.Module] = {}
    for module in stage.modules():
        original = module.__dict__.get(ORIGINAL, module)
        if module is not stage:
            found.update((id(m), m) for m in original.modules())
    return list(found.values())


def _parameters_read(stages: Sequence[StageRuntime], shared: Sequence[Sequence[Any]]) -> list[nn.Parameter]:
    """The parameters that some stage reads, once each."""
    found: dict[int, nn.Parameter] = {}
    for stage, copies in zip(stages, shared):
        for p in [*stage.params, *copies]:
            if isinstance(p, nn.Parameter):
                found.setdefault(id(p), p)
    return list(found.values())


def _refuse_undeferred_statistics(codes: Sequence[StageCode]) -> None:
    """With deferred_batch_norm, the running statistics that stay written per micro-batch: a
    BatchNorm whose forward is its own, another norm (InstanceNorm), one that a module called
    whole holds, a norm called as a function (`F.batch_norm`, `aten.batch_norm` in an exported
    graph), and one in training inside a `no_grad` region torch.export captured."""
    problems = []
    for code in codes:
        for node in code.module.graph.nodes:
            if node.op == "call_module":
                module = code.module.get_submodule(str(node.target))
                inner = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._NormBase) and m.running_mean is not None]
                if inner and inner[0] is module and isinstance(module, nn.modules.batchnorm._BatchNorm):
                    problems.append(f"{node.target} ({type(module).__name__}), a BatchNorm with a forward of its own")
                elif inner and inner[0] is module:
                    problems.append(f"{node.target} ({type(module).__name__}), a norm other than BatchNorm1d/2d/3d (SyncBatchNorm "
                                    "and InstanceNorm with running statistics update them per micro-batch)")
                elif inner:
                    problems.append(f"{node.target} ({type(module).__name__}), called whole, with a norm inside that keeps running statistics")
            for buffer in statistics_written(node) if not _in_eval(node) else []:
                problems.append(f"{buffer.target}, which {getattr(node.target, '__name__', node.target)} writes (a norm called as a function)")
            for buffer in operands_written_inside(code.module, node, _training_norm_writes) or []:
                problems.append(f"{getattr(buffer, 'target', buffer)}, which a norm in training writes inside a no_grad region (torch.export's subgraph)")
    if problems:
        raise ValueError(
            "deferred_batch_norm cannot defer these running statistics, which would still be updated once per "
            "micro-batch:\n" + "\n".join(f"  - {p}" for p in problems) + "\nHow to fix: use torch's BatchNorm1d, "
            "BatchNorm2d or BatchNorm3d as they are (for a SyncBatchNorm, the BatchNorm of its dims), outside "
            "modules kept whole (leaf_modules) and outside no_grad regions (a "
            "teacher's norm in eval mode is fine there), or compile with "
            "deferred_batch_norm=False (each micro-batch then updates the statistics, as the model run on the "
            "micro-batches in turn does)."
        )


def _training_norm_writes(subgraph: fx.GraphModule, node: fx.Node) -> list[fx.Node]:
    """The running statistics a norm in training writes, within a higher-order op's subgraph."""
    inside = operands_written_inside(subgraph, node, _training_norm_writes)
    return inside if inside is not None else [] if _in_eval(node) else statistics_written(node)


def _in_eval(node: fx.Node) -> bool:
    """Whether a functional norm's `training` (`use_input_stats`) is False: it writes nothing.
    Every norm `statistics_written` knows takes it sixth."""
    flag = node.args[5] if len(node.args) > 5 else node.kwargs.get("training", node.kwargs.get("use_input_stats"))
    return flag is False


def _refuse_opaque_values(cut: Cut) -> None:
    """Values that go between stages or out of the pipeline are split, sent and gathered through
    pytree: one that keeps tensors where pytree cannot see them would go whole, unsplit and
    without gradients."""
    nodes = {n.name: n for n in cut.graph.graph.nodes}
    opaque = {e.value: nodes[e.value].meta.get("opaque") for e in cut.edges if e.value in nodes}
    found = sorted(f"{name} ({', '.join(types)})" for name, types in opaque.items() if types)
    if found:
        raise ValueError(
            f"the model passes values that hold tensors pytree cannot see: {', '.join(found)}.\n"
            "A pipeline splits, sends and gathers values through torch.utils._pytree.\nHow to fix: "
            "register the type (torch.export.register_dataclass(T) for a dataclass, "
            "torch.utils._pytree.register_pytree_node(T, flatten_fn, unflatten_fn, flatten_with_keys_fn=...) for another "
            "class: values are named by their keys), or use a tuple or dict in its place (what "
            "a submodule returns, or what the model takes as an argument)."
        )


def _traced_through(owner: nn.Module, graph: fx.GraphModule) -> list[tuple[str, nn.Module]]:
    """The modules the trace went through: neither called whole by the graph (nor handed to an
    autograd Function that calls them, torch.utils.checkpoint's reentrant one) nor inside one
    that is (their hooks ran at compile time, or run inside the whole one's call)."""
    whole = {str(n.target) for n in graph.graph.nodes if n.op == "call_module"} | set(_handed_by_target(graph))

    def inside_whole(name: str) -> bool:
        parts = name.split(".")
        return any(".".join(parts[:k]) in whole for k in range(1, len(parts) + 1)) if name else False

    return [(name, m) for name, m in owner.named_modules() if not inside_whole(name)]


def _refuse_backward_hooks_traced_through(traced: list[tuple[str, nn.Module]]) -> None:
    """A module the trace went through is no call in the stages: its backward hooks, and the global
    ones, would never fire for it. Those of a module called whole (and of the modules inside it) do."""
    if traced and global_backward_hooks():
        raise ValueError(GLOBAL_BACKWARD_HOOKS)
    hooked = [name for name, m in traced if name and (m._backward_hooks or m._backward_pre_hooks)]  # the model's own run around the call
    if hooked:
        raise ValueError(
            f"backward hooks on modules that are traced through would never fire: {', '.join(hooked)}.\n"
            f"How to fix: keep each such module whole (compile_pipeline(..., leaf_modules={hooked!r})), "
            "or hook a tensor or a parameter instead (tensor.register_hook)."
        )


def _grad_tensors_held(stage: fx.GraphModule, parameters: set[int]) -> list[tuple[str, bool]]:
    """The stage's tensor attributes and buffers that require grad but are not parameters, each
    with whether it is an autograd leaf (the plain model's backward would give it a `.grad`) or,
    read by the graph itself, was computed from parameters outside forward (its one graph serves
    one backward). A view of a parameter (`self.w_t = self.lin.weight.t()`) saves nothing for
    backward and serves any number; what a module called whole holds, its own forward makes again
    at every call (an output it keeps, the weight a weight_norm hook computes). Those in the
    model's `parameters` tables (ids), swapped in for its parameters, are the call's to refuse."""
    read = {str(n.target) for n in stage.graph.nodes if n.op == "get_attr"}
    found = []
    for prefix, module in stage.named_modules():
        held = {**{k: v for k, v in vars(module).items() if not k.startswith("_")}, **module._buffers}
        for name, value in held.items():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and value.requires_grad and id(value) not in parameters:
                if value.is_leaf or (path in read and not value._is_view()):
                    found.append((path, value.is_leaf))
    return found


def _refuse_grad_tensors_held(found: list[tuple[str, bool]]) -> None:
    leaves = sorted({name for name, leaf in found if leaf})
    computed = sorted({name for name, leaf in found if not leaf})
    problems = []
    if leaves:
        problems.append(
            f"tensors that require grad but are not parameters: {', '.join(leaves)}. A pipeline hands gradients to "
            "parameters only, and would leave these without theirs"
        )
    if computed:
        problems.append(
            f"tensors computed with gradients outside forward (self.scale = self.log_scale.exp() in __init__, say): "
            f"{', '.join(computed)}. Their one graph serves one backward: each micro-batch's runs through it (the plain "
            "model's second backward would fail on it)"
        )
    if problems:
        raise ValueError(
            f"the model reads {'; and '.join(problems)}.\nHow to fix: register each tensor that learns as an "
            "nn.Parameter (self.x = nn.Parameter(...)), or call .requires_grad_(False) on one that does not; compute "
            "one made from parameters inside forward (self.log_scale.exp() there), where each call makes its own."
        )


def _calls(stage: fx.GraphModule) -> list[nn.Module]:
    """The modules a stage calls (whole), once each: through `call_module`, or through
    `call_with_state` (a module whose state another stage reads too)."""
    modules = [m for n in stage.graph.nodes if (m := called_module(stage, n)) is not None]
    return list({id(m): m for m in modules}.values())


def _called_whole(stage: fx.GraphModule) -> list[nn.Module]:
    """The modules a stage calls whole whose forwards may assign attributes: those that are not
    PyTorch's own, and those with forward hooks (spectral_norm's sets `weight`)."""
    return [m for m in _calls(stage) if not type(m).__module__.startswith("torch.") or has_forward_hooks(m)]


def _template(graph: fx.GraphModule) -> Any:
    """The output's structure as the model returns it, each graph value a ValueRef."""
    output = next(n for n in graph.graph.nodes if n.op == "output")
    returned = _mutable(output.args[0], output.meta.get("containers"))
    if "out_spec" in output.meta:  # exported: the output's structure as the model returned it
        returned = _mutable(tree_unflatten(tree_flatten(output.args[0])[0], output.meta["out_spec"]), output.meta.get("containers"))
    return tree_map(lambda n: _ref(n) if isinstance(n, fx.Node) else n, returned)


def _mutable(value: Any, containers: Any = None) -> Any:
    """fx's immutable dicts and lists in an output as the containers the model made: the types
    the tracer recorded (`containers`, an OrderedDict say), else plain dicts and lists."""
    kind, inner = containers if isinstance(containers, tuple) else (None, None)
    if type(value) in (dict, immutable_dict):
        items = {key: _mutable(v, inner.get(key) if isinstance(inner, dict) else None) for key, v in value.items()}
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            return DataclassOutput(kind, items)
        return kind(items) if kind is not None and issubclass(kind, dict) else items
    if type(value) in (list, immutable_list, tuple):
        parts = [_mutable(v, inner[i] if isinstance(inner, list) and i < len(inner) else None) for i, v in enumerate(value)]
        return tuple(parts) if type(value) is tuple else parts
    return value


def _ref(node: fx.Node) -> ValueRef:
    if node.op == "get_attr":
        return ValueRef(str(node.target), given=True)
    dims = node.meta.get("batch_dims")
    return ValueRef(node.name, given=node.op == "placeholder", dims=tuple(dims) if dims is not None else None)

