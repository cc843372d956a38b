"""The compiled record: everything `compile_pipeline` hands the runtime, and nothing it must work out.

    Compiled ── plan            stages, devices, edges (each value's producer and consumers)
             ── cuts            per mode, the graph cut into runs of nodes (for rebuilding)
             ── build(model, cut) -> Program: the generated stages on the model's tensors,
                                   run again after a dtype cast or on a copied model
             ── bind            the caller's arguments -> the graph's input values
             ── placement       across processes: this rank's coordinate, group and device
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, ContextManager, Hashable, Iterable, Optional, Sequence

import torch
import torch.fx as fx
from torch import nn

from fxpipe.compiled.placement import RankPlacement
from fxpipe.compiled.plan import Plan
from fxpipe.compiled.stage_compile import CompiledForward
from fxpipe.core.edges import Edge
from fxpipe.core.hooks import hook_tables, output_hook
from fxpipe.core.microbatch import ExampleLeaves
from fxpipe.core.randomness import Unseen, draws_now, runs_hooks
from fxpipe.schedules.actions import Layout
from fxpipe.schedules.slices import SliceSpec
from fxpipe.tracing.attribute_reads import CONTAINERS, Held, changed, holder
from fxpipe.tracing.mode_reads import ModeReads

Binder = Callable[[tuple[Any, ...], dict[str, Any]], dict[str, Any]]
ChunkSpec = dict[str, Optional[int]]

Slot = tuple[dict[str, Any], str]  # a module's parameter or buffer table, and a name in it


@dataclass
class StageRuntime:
    """What the runtime needs of one stage."""

    index: int
    device: torch.device
    module: Callable[..., tuple[Any, ...]]
    inputs: list[str]
    outputs: list[str]
    sources: dict[str, int]  # input value -> producing stage (CALLER for the pipeline's inputs)
    consumers: dict[str, list[int]]  # output value -> consuming stages (n stands for the output)
    params: list[nn.Parameter] = field(default_factory=list)  # read by this stage alone
    param_slots: list[list[Slot]] = field(default_factory=list)  # where each is held in `module`
    random_always: bool = False  # some node always draws
    random_modules: list[nn.Module] = field(default_factory=list)  # dropout-holding, by their flags
    hidden_always: bool = False  # the same, for random ops the stage's code cannot hand a generator
    hidden_modules: list[nn.Module] = field(default_factory=list)
    # The modules it calls: a forward hook on one (or a global one) may draw, and the graph
    # does not show it; read at each step, as a hook may be added after compiling.
    called: list[nn.Module] = field(default_factory=list)
    writable_buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # name in `module`
    # The buffers it reads that no stage writes: a write between a forward and its recompute
    # comes from outside the model (a load_state_dict), and is refused as for parameters.
    read_buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    # Outputs that are the model's state (a buffer it writes, say): sent as a copy, so that a
    # later stage sees the value of this micro-batch, not of one written since.
    state_outputs: set[str] = field(default_factory=set)
    # Outputs that are the caller's memory in the plain model (a view of an input, a tensor an input
    # holds), which the stage sends as values of its own: a loss may not write them as the caller's.
    caller_views: set[str] = field(default_factory=set)
    # By pattern of inputs and parameters requiring grad: which outputs' tensors do, learnt from
    # a forward under grad (a checkpointed forward under no_grad cannot tell).
    output_grads: dict[Any, list[bool]] = field(default_factory=dict)
    whole_modules: list[nn.Module] = field(default_factory=list)  # called whole: their forward runs
    # What they store that requires grad (module, attribute, its path): no gradient can flow
    # back through it into the stage's graph, and a backward that reaches it is refused.
    stored: list[tuple[nn.Module, str, str]] = field(default_factory=list)
    # Inputs the stage writes in place (on its own copy, returned after `outputs`): the
    # caller's tensor gets the final value, as the plain model writes it.
    written: list[str] = field(default_factory=list)
    # The forward under torch.compile (compile_stages), or None: `module.forward`, eagerly.
    compiled: Optional[CompiledForward] = None
    # The modules whose training flag and dropout rate decide what the stage computes.
    flagged: list[nn.Module] = field(default_factory=list)
    # Whether its backward may run the model's modules again (a reentrant checkpoint's
    # recompute, a module called whole): they must find the step's leaves in their slots then too.
    reenters: bool = False
    # Where it may, but shares a parameter with another stage (a weight tied across stages):
    # those parameters, which its modules then read as the model holds them in backward, and
    # whose gradients they put in `.grad` themselves.
    reads_in_backward: list[nn.Parameter] = field(default_factory=list)

    def draws(self) -> tuple[bool, Unseen]:
        """Whether a call now may draw random numbers, and where through ops that need the
        dispatch mode (read once per step; the modules' hooks are walked once for both)."""
        if runs_hooks(self.called):
            return True, Unseen.ANYWHERE
        hidden = self.hidden_always or draws_now(self.hidden_modules)
        return self.random_always or draws_now(self.random_modules), Unseen.MARKED if hidden else Unseen.NOWHERE



# Settings of PyTorch's modules that compiling plans by when the graph calls one whole: whether
# it writes its input (which values are copied before), whether micro-batches may split the batch
# it sees (its gradient scaled by counts in the batch, its batch on dim 1), whether forward writes
# its weight.
SETTINGS = ("inplace", "scale_grad_by_freq", "batch_first", "max_norm")
UNSET = object()


def settings_of(module: nn.Module) -> tuple[Any, ...]:
    """The module's `SETTINGS`, `UNSET` for those it has not."""
    return tuple(getattr(module, name, UNSET) for name in SETTINGS)


Hooks = tuple[tuple[int, ...], ...]
# What a traced-through module's code was: its class, a forward set on the module itself, the
# class's forward, and a container's members (the graph holds one pass over them).
Code = tuple[type, Any, Any, Optional[tuple[str, ...]]]


def hooks_of(module: Optional[nn.Module]) -> Hooks:
    """Which hooks a module has (their handles' ids, so a hook swapped for another counts), or,
    for None, which global module hooks are registered."""
    return tuple(map(tuple, hook_tables(module)))  # read at every call: no generator per table


def hooks_that_count(module: Optional[nn.Module]) -> Hooks:
    """`hooks_of`, without the hooks whose whole effect is in the model's own output, which a
    trace captures (`output_hook`): those a library adds after compiling change nothing."""
    return tuple(tuple(key for key, hook in table.items() if not output_hook(hook)) for table in hook_tables(module))


def code_of(module: nn.Module, listed: bool = True) -> Code:
    """The module's `Code`; a container's members only if forward `listed` them (iterated, or
    asked their count): one read by key alone may take more."""
    members = (*module._modules, *module._parameters) if listed and isinstance(module, CONTAINERS) else None
    return type(module), module.__dict__.get("forward"), _class_forward(type(module)), members


def _class_forward(cls: type) -> Any:
    """The class's forward as stored (a descriptor may make a new object at every lookup)."""
    for c in cls.__mro__:
        found = c.__dict__.get("forward")
        if found is not None:
            return found
    return None


def code_changes(was: Code, now: Code) -> list[str]:
    """What changed between two `code_of` a module: none when it is the same code."""
    if was == now:
        return []
    (cls, own, forward, members), (cls_now, own_now, forward_now, members_now) = was, now
    found = [f"its class, {cls.__name__} -> {cls_now.__name__}"] if cls is not cls_now else []
    if own is not own_now or (cls is cls_now and forward is not forward_now):
        found.append("its forward")
    if members != members_now:
        found.append(f"its members, {len(members or ())} -> {len(members_now or ())}")
    return found


@dataclass
class Cut:
    """One graph of the model, cut into runs of nodes, one per stage, and its edges."""

    graph: fx.GraphModule
    runs: list[list[fx.Node]]
    edges: list[Edge]

    def copy(self, memo: dict[int, Any]) -> "Cut":
        """A copy on copied parameters (those in `memo`), with its own graph and nodes."""
        graph = copy.deepcopy(self.graph, memo)
        nodes = {node.name: node for node in graph.graph.nodes}
        return Cut(graph, [[nodes[n.name] for n in run] for run in self.runs], list(self.edges))


@dataclass
class HeldState:
    """The model's submodules, parameters and buffers as the stages were built on them, by the
    table that held each: a cast of the model itself (`model.double()` puts new buffers in place)
    or an assignment (`model.w = nn.Parameter(...)`) is seen at the next call."""

    modules: list[tuple[str, dict[str, Any], str, nn.Module]]  # qualified name, parent's table, key, module
    tensors: list[tuple[dict[str, Any], str, Optional[torch.Tensor]]]  # a module's table, key, tensor
    # The plain attributes the trace read: qualified name, what holds it (a module, or a Python
    # module for a module-level value), the path from it, the value when compiled.
    attributes: list[tuple[str, Any, str, Any]] = field(default_factory=list)
    named: dict[str, nn.Module] = field(default_factory=dict)  # the modules by qualified name
    # Each module's parameter, buffer and submodule tables with their sizes: a parameter or a
    # module added after compiling (an adapter, read by a hook or a patched forward of a module
    # called whole) must be seen.
    sizes: list[tuple[dict[str, Any], int]] = field(default_factory=list)

    @staticmethod
    def of(owner: nn.Module, read: Iterable[str] = (), attributes: Optional[dict[str, Any]] = None) -> "HeldState":
        """What `owner` holds; with the tensor attributes among `read` (the graph's get_attr
        targets: `self.scale = torch.tensor(2.0)`, never registered), which a call may rebind,
        and where it holds the plain `attributes` the trace read (their values when compiled)."""
        modules, tensors, held, sizes = [], [], [], []
        found = dict(owner.named_modules())
        for path, module in found.items():
            modules += [(f"{path}.{key}" if path else key, module._modules, key, child) for key, child in module._modules.items()]
            for table in (module._parameters, module._buffers):
                tensors += [(table, key, tensor) for key, tensor in table.items()]
                sizes.append((table, len(table)))
            sizes.append((module._modules, len(module._modules)))
        for target in read:
            path, _, key = target.rpartition(".")
            module = found.get(path)
            value = vars(module).get(key) if module is not None else None
            if isinstance(value, torch.Tensor):
                tensors.append((vars(module), key, value))
        for qualified, value in (attributes or {}).items():
            place = holder(found, qualified)
            if place is not None:
                held.append((qualified, *place, value))
        return HeldState(modules, tensors, held, found, sizes)

    def modules_replaced(self) -> list[str]:
        """The modules the trace went through that are no longer there, or another one is (a
        parametrization removed counts: its module was the trace's)."""
        return [name if key in table else f"{name} (removed)" for name, table, key, module in self.modules if table.get(key) is not module]

    def attributes_changed(self, read: frozenset[str]) -> list[str]:
        """Of the plain attributes in `read`, those changed since compiling."""
        return changed([held for held in self.attributes if held[0] in read])

    def tensors_replaced(self) -> bool:
        """Whether a parameter or buffer was replaced, added or removed since, or a module added."""
        for table, key, tensor in self.tensors:  # at every call: a loop, not a generator
            if table.get(key) is not tensor:
                return True
        for table, size in self.sizes:
            if len(table) != size:
                return True
        return False

    def replaced_across(self) -> list[str]:
        """Across processes, what was replaced that the ranks cannot build again on: a parameter
        replaced (on every rank: each refuses, whether its stage holds it or another's does),
        and a buffer slot that held another rank's tensor (its shape alone, on the meta device)
        and holds a tensor of this rank's now. (A cast keeps the parameters, and turns another
        rank's buffers into meta buffers again.)"""
        held = {(id(table), key): tensor for table, key, tensor in self.tensors}
        found = []
        for path, module in self.named.items():
            for table in (module._parameters, module._buffers):
                for key, now in table.items():
                    was = held.get((id(table), key))
                    if was is None or now is None or was is now:
                        continue
                    if table is module._parameters or (was.is_meta and not now.is_meta):
                        found.append(f"{path}.{key}" if path else key)
        return found

    def tensors_added(self) -> list[str]:
        """The parameters and buffers added since, by qualified name."""
        held = {id(table): {key for t, key, _ in self.tensors if t is table} for table, _ in self.sizes}
        known = {id(module) for module in self.named.values()}
        found = []
        for path, module in self.named.items():
            for table in (module._parameters, module._buffers):
                found += [f"{path}.{key}" if path else key for key in table if key not in held.get(id(table), set())]
            for key, child in module._modules.items():
                if child is not None and id(child) not in known:  # a module added, with all it holds
                    prefix = f"{path}.{key}" if path else key
                    found += [f"{prefix}.{name}" for name, _ in [*child.named_parameters(), *child.named_buffers()]]
        return found


@dataclass
class Program:
    """A cut built for the runtime: what each stage runs, and what the outputs are made of."""

    cut: Cut
    stages: list[StageRuntime]
    modules: list[fx.GraphModule]  # the generated stage modules
    shared: list[list[Any]]  # per stage, its copies' sources: tensors other stages read too
    layout: Layout
    template: Any  # the output's structure, with ValueRefs for the values in it
    given: dict[str, Any]  # attributes the output returns as they are (resolved)
    parameters: list[nn.Parameter]  # every one some stage reads, once
    output_inputs: dict[str, list[str]] = field(default_factory=dict)  # inputs each output depends on
    output_params: dict[str, list[Any]] = field(default_factory=dict)  # parameters each depends on
    # The modules the trace went through, with the hooks each had then (`hooks_of`): the graph
    # holds what those hooks did at compile time; and the global module hooks then, by "*".
    traced_hooks: list[tuple[str, Optional[nn.Module], Hooks]] = field(default_factory=list)
    # The same modules' code then (`code_of`): the graph holds what it computed.
    traced_code: list[tuple[str, nn.Module, Code]] = field(default_factory=list)
    # Each module the graph calls whole that has settings compiling planned by, with their values
    # then (`SETTINGS`): a change since would run the plan made for the old ones.
    settings: list[tuple[str, nn.Module, tuple[Any, ...]]] = field(default_factory=list)

    # The loss functions (`batch_loss._loss_key`) whose gradient was checked against the whole
    # batch's on these stages' outputs: once each.
    gradients_checked: set[Any] = field(default_factory=set)
    # The same loss functions, by whether they write the outputs they are given in place (see
    # `batch_loss.MicroBatchLoss`): one not yet met is handed copies, to learn it.
    losses_writing: dict[Any, bool] = field(default_factory=dict)

    # Where the model held each submodule, parameter and buffer when the stages were built.
    held: "HeldState" = field(default_factory=lambda: HeldState([], []))
    # Tensors swapped in for parameters that require grad but are not Parameters, by name.
    unreached: list[str] = field(default_factory=list)
    # The parameters, buffers and tensor attributes the stages read, by the model's names.
    state_read: dict[str, torch.Tensor] = field(default_factory=dict)
    # How many targets the model's own mean cross-entropy counts in a micro-batch, from its
    # inputs (passes/loss_counts.py); None where its own loss is no such mean.
    loss_counter: Optional[Callable[[dict[str, Any]], Optional[float]]] = None
    # How the model's own loss on the example came from two parts': 'sum' or 'mean' over
    # samples, or 'neither' (passes/batch_dims.py); None where compiling could not tell.
    own_loss_combines: Optional[str] = None
    # Where the own loss is the `loss` field of a namedtuple one output value holds: its
    # position among that value's leaves (passes/loss_counts.py); None otherwise.
    own_loss_leaf: Optional[int] = None

    @functools.cached_property
    def tensors_read(self) -> dict[str, torch.Tensor]:
        """Those of `state_read` that are no Parameters (buffers, tensor attributes), which each
        call looks at: fewer than the parameters."""
        return {name: t for name, t in self.state_read.items() if not isinstance(t, torch.nn.Parameter)}

    def hooks_changed(self) -> list[str]:
        """The traced-through modules whose hooks were added, removed or swapped since ("*": the
        global module hooks)."""
        return [name for name, m, hooks in self.traced_hooks if hooks_of(m) != hooks and hooks_that_count(m) != hooks]

    def hooks_added_by(self) -> list[str]:
        """The Python modules that define the hooks added since to traced-through modules (a
        library may add its own on a call with some option), each once."""
        found: dict[str, None] = {}
        for _, m, hooks in self.traced_hooks:
            if m is None:
                continue
            for table, before in zip(hook_tables(m), hooks):
                for key, hook in table.items():
                    if key not in before:
                        function = getattr(hook, "func", hook)  # a functools.partial's function
                        found.setdefault(getattr(function, "__module__", None) or "an unknown module")
        return list(found)

    @cached_property
    def written_inputs(self) -> frozenset[str]:
        """The inputs some stage writes in place."""
        return frozenset(name for stage in self.stages for name in stage.written)

    def settings_changed(self) -> list[str]:
        """The settings of modules called whole that changed since compiling, each with its values."""
        found = []
        for name, module, values in self.settings:
            now = settings_of(module)
            if now != values:
                found += [f"{name}.{attr} ({then!r} -> {value!r})" for attr, then, value in zip(SETTINGS, values, now) if then != value]
        return found

    def code_changed(self, but_the_model: bool = False) -> list[str]:
        """The traced-through modules whose code changed since, each with what changed (but the
        model itself's, with `but_the_model`: a forward of its that calls the pipeline)."""
        found = []
        for name, module, code in self.traced_code:
            if but_the_model and name == "":
                continue
            cls, own, forward, members = code
            if type(module) is cls and module.__dict__.get("forward") is own and _class_forward(cls) is forward and members is None:
                continue  # the same code (the check of every call, made short)
            changes = code_changes(code, code_of(module, members is not None))
            if changes:
                found.append(f"{name or 'the model itself'}: {' and '.join(changes)}")
        return found

    def model_code(self) -> Optional[Code]:
        """The model itself's code when traced (`code_of`), or None where the trace did not go
        through its forward."""
        entry = self._model_entry()
        return None if entry is None else entry[1]

    def model_code_replaced(self) -> bool:
        """Whether the model's class or own forward is another than when traced (the check of
        every call, made short)."""
        entry = self._model_entry()
        if entry is None:
            return False
        model, (cls, own, _, _) = entry
        return type(model) is not cls or model.__dict__.get("forward") is not own

    def _model_entry(self) -> Optional[tuple[nn.Module, Code]]:
        return next(((module, code) for name, module, code in self.traced_code if name == ""), None)

    @property
    def graph(self) -> fx.GraphModule:
        return self.cut.graph

    @property
    def runs(self) -> list[list[fx.Node]]:
        return self.cut.runs

    @property
    def edges(self) -> list[Edge]:
        return self.cut.edges

    def stage_tensors(self, stage: int) -> list[torch.Tensor]:
        """The parameters and buffers one stage reads."""
        runtime = self.stages[stage]
        module = self.modules[stage]
        return [*module.parameters(), *module.buffers(), *self.shared[stage], *runtime.writable_buffers.values()]

    def tied_reads_in_backward(self, owner: nn.Module) -> dict[str, nn.Parameter]:
        """By name in `owner`, the parameters a stage's own modules read in backward as the
        model holds them (`StageRuntime.reads_in_backward`): their gradients skip the step."""
        found = {id(p): p for stage in self.stages for p in stage.reads_in_backward}
        names: dict[int, str] = {}
        for name, p in owner.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
        return {names.get(key, "a parameter"): p for key, p in found.items()}

    @cached_property
    def readers(self) -> dict[int, set[int]]:
        """By `id`, each tensor some stage reads, and the ranks (worker coordinates) of those
        stages; worked out once, as a train step across processes asks for it every step."""
        found: dict[int, set[int]] = {}
        for index, rank in enumerate(self.layout.ranks):
            for tensor in self.stage_tensors(index):
                found.setdefault(id(tensor), set()).add(rank)
        return found


Builder = Callable[[nn.Module, Cut], Program]


class OtherCall(TypeError):
    """Raised by a binder: a call whose arguments differ in kind from the example's (one left
    None where the example gave it, a keyword left out), which the graph was not traced for.
    `key` names the kind of call, for a pipeline compiled for it; `numbers`, the arguments that
    are numbers of other values than the example's (an exported graph holds each value)."""

    def __init__(self, message: str, key: Hashable) -> None:
        super().__init__(message)
        self.key = key
        self.numbers: tuple[str, ...] = ()

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.key), {k: v for k, v in self.__dict__.items() if k != "key"}


def first_floating_dtype(model: nn.Module) -> Optional[torch.dtype]:
    """The dtype of the model's first floating parameter (what `self.dtype` reads); None without one."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


@dataclass
class Compiled:
    """The one contract between compile_pipeline and the runtime."""

    plan: Plan
    cuts: dict[bool, Cut]  # by training mode; one object when the graph does not read the mode
    bind: Binder
    build: Builder
    devices: list[torch.device]  # of each stage
    chunk_spec: ChunkSpec = field(default_factory=dict)
    deferred_batch_norm: bool = False
    placement: Optional[RankPlacement] = None  # across processes: this rank's place
    # Per input, the example's tensor leaves: how many dims, and whether kept whole (a leaf with
    # as many dims stays whole when its dim 0 happens to equal a later batch's size).
    example_leaves: ExampleLeaves = field(default_factory=dict)
    # torch.export's guards on a call's micro-batches (inputs by placeholder name); None under torch.fx.
    check_micro_batch: Optional[Callable[[Sequence[dict[str, Any]]], None]] = None
    # By mode, the `training` flags its graph's trace read (module path: flag): the graph holds
    # what they decided, as the plain attributes it read (`attributes_read`) hold their values.
    flags: dict[bool, dict[str, bool]] = field(default_factory=dict)
    attributes_read: dict[bool, frozenset[str]] = field(default_factory=dict)
    front_end: str = "torch.fx"
    # What the forward asked of autocast while traced, with the answers the graph holds.
    modes_read: ModeReads = field(default_factory=dict)
    # Why training mode could not be traced, for a model traced in eval mode alone (else "").
    eval_only: str = ""
    # By training flag, the grad mode its graph serves alone (torch.is_grad_enabled()), and why.
    grad_mode_only: dict[bool, tuple[bool, str]] = field(default_factory=dict)
    # The inputs (placeholder names) the forward marks as requiring grad (`x.requires_grad_()`):
    # the caller's tensors, which the stages see only micro-batches of, are marked at each call.
    marked_for_grad: frozenset[str] = frozenset()
    # Where the example had one sample, or samples all alike: the parts' check, to run on the first
    # call of two samples or more not all alike (inputs by name, their split dims, the call's args
    # and kwargs; False where this call's are alike too); None once run.
    unchecked: Optional[Callable[[dict[str, Any], Any, tuple[tuple[Any, ...], dict[str, Any]]], bool]] = None
    # How each call's micro-batches are cut into slices of their sequence; None: they are not.
    slicing: Optional[SliceSpec] = None
    # With slicing: the proof of causality run again on a micro-batch (inputs by name) of a length
    # it has not run at, in the mode given (True: training), refusing where it fails.
    check_length: Optional[Callable[[list[dict[str, Any]], bool, Any, Callable[[], ContextManager[Any]]], None]] = None
    # Buffers that were one tensor under several names when traced (registered in two modules):
    # the graph reads that tensor under one name, so the names must keep one value.
    aliased_buffers: list[list[str]] = field(default_factory=list)
    # The names of each parameter the model holds under several (a tied weight; a buffer too).
    tied_parameters: list[list[str]] = field(default_factory=list)
    # The dtype of the model's first floating parameter when traced, and the floating dtypes the
    # graphs hold as constants: one of them read from the model (`self.dtype`) stays in the graph
    # through a later cast of the model, as the plain model's forward would not.
    traced_dtype: Optional[torch.dtype] = None
    graph_dtypes: frozenset[torch.dtype] = frozenset()

    def copy(self, memo: dict[int, Any]) -> "Compiled":
        if self.unchecked is not None:
            raise TypeError(
                "this pipeline was compiled on an example of one sample (or of samples all alike) and has not yet checked "
                "its micro-batches (on its first call of two samples or more that differ): a copy would not check "
                "them.\nHow to fix: call it once with such a batch before copying it, or compile it with an example of "
                "two samples or more that differ."
            )
        if self.placement is not None:
            raise TypeError(
                "a pipeline across processes cannot be copied: each rank holds its own stages only.\n"
                "How to fix: compile_pipeline a copy of the model (on every rank)."
            )
        cuts = {id(c): c.copy(memo) for c in self.cuts.values()}
        build = self.build
        if isinstance(build, functools.partial) and "attributes" in build.keywords:  # a tensor or an object held: the copy's
            attributes = build.keywords["attributes"]
            build = functools.partial(build, attributes={k: _copied(v, memo) for k, v in attributes.items()})
        return Compiled(
            copy.deepcopy(self.plan), {mode: cuts[id(c)] for mode, c in self.cuts.items()}, self.bind,
            build, self.devices, self.chunk_spec, self.deferred_batch_norm, None, self.example_leaves,
            self.check_micro_batch, self.flags, self.attributes_read, self.front_end, self.modes_read, self.eval_only,
            slicing=self.slicing, check_length=self.check_length, aliased_buffers=self.aliased_buffers, tied_parameters=self.tied_parameters,
            grad_mode_only=self.grad_mode_only, marked_for_grad=self.marked_for_grad,
        )  # fmt: skip


def _copied(value: Any, memo: dict[int, Any]) -> Any:
    """An attribute's value as compiled, for a copy of the model: a tensor or an object it holds
    (watched as itself) is the copy's."""
    if isinstance(value, torch.Tensor):
        return memo.get(id(value), value)
    if isinstance(value, Held):
        return Held(memo.get(id(value.value), value.value), value.by_class)
    return value
