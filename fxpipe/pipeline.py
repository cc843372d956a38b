"""The Pipeline module: the model's own parameters, run stage by stage over micro-batches."""
from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from fxpipe.autograd import InputSlot, Run, run_with_autograd
from fxpipe.batchnorm import BatchStatistics, defer_batch_norm
from fxpipe.checkpoint import checkpoint_stop, slot_of
from fxpipe.context import CallerContext
from fxpipe.frontend import Binder
from fxpipe.gather import Gathered, ValueRef
from fxpipe.microbatch import Dims, batch_size_of, scatter, split_dim, split_sizes
from fxpipe.passes.attrs import fetch_attr
from fxpipe.passes.codegen import StageCode, generate_stages
from fxpipe.passes.edges import Edge
from fxpipe.passes.random_ops import random_sources
from fxpipe.passes.sources import Sources, output_sources
from fxpipe.passes.state import aliases_state, writable_buffers
from fxpipe.plan import Plan
from fxpipe.randomness import draw_from_task_streams, draw_step_seed
from fxpipe.step import StageRuntime, Step
from fxpipe.worker import Workers

ChunkSpec = dict[str, Optional[int]]


class PlacementError(RuntimeError):
    """Devices of a Pipeline are chosen at compile time."""


@dataclass
class Program:
    """One graph of the model cut into stages, and its generated stages. A model whose forward
    reads `self.training` has one per mode."""

    graph: fx.GraphModule
    runs: list[list[fx.Node]]
    edges: list[Edge]
    codes: list[StageCode] = field(default_factory=list)
    runtimes: list[StageRuntime] = field(default_factory=list)
    template: Any = None
    sources: dict[str, Sources] = field(default_factory=dict)  # of each output value
    # Resolved when the stages are built (again after a dtype cast), not on every call:
    parameters: list[nn.Parameter] = field(default_factory=list)  # every one a stage reads, once
    output_params: dict[str, list[Any]] = field(default_factory=dict)  # what each output depends on

    def __post_init__(self) -> None:
        output = next(n for n in self.graph.graph.nodes if n.op == "output")
        returned = _mutable(output.args[0], output.meta.get("containers"))
        if "out_spec" in output.meta:  # exported: the output's structure as the model returned it
            returned = tree_unflatten(tree_flatten(output.args[0])[0], output.meta["out_spec"])
        self.template = tree_map(lambda n: _ref(n) if isinstance(n, fx.Node) else n, returned)
        self.sources = output_sources(self.graph)

    def copy(self, memo: dict[int, Any]) -> "Program":
        """A copy on copied parameters (those in `memo`), with its own graph and nodes."""
        graph = copy.deepcopy(self.graph, memo)
        nodes = {node.name: node for node in graph.graph.nodes}
        return Program(graph, [[nodes[n.name] for n in run] for run in self.runs], list(self.edges))


class Pipeline(nn.Module):
    """A model cut into stages, one per device, run as a GPipe pipeline.

    Made by `compile_pipeline`. `pipe(*args)` takes what the model takes and returns what it
    returns, on the last stage's device; its parameters are the model's own, moved to the device
    of the first stage that uses them, under the model's own names.
    """

    # Held outside the module tree (in __dict__), so that state_dict() keys stay the model's own
    # and no name of the model's can clash with the pipeline's own attributes.
    _owner: nn.Module
    _programs: dict[bool, Program]
    _bind: Binder
    _workers: Workers
    _signature: Optional[inspect.Signature]
    _chunk_spec: ChunkSpec
    _deferred_batch_norm: bool
    _closed: bool
    last_timeline: list[tuple[str, int, int, float, float]]
    plan: Plan
    stages: list[fx.GraphModule]
    devices: list[torch.device]
    chunks: int
    checkpoint: str

    def __init__(
        self,
        model: nn.Module,
        programs: dict[bool, Program],
        bind: Binder,
        plan: Plan,
        devices: Sequence[torch.device],
        chunk_spec: Optional[ChunkSpec] = None,
        deferred_batch_norm: bool = False,
    ) -> None:
        super().__init__()
        # Straight into the module's tables: a child called `stages` or `plan` is the model's,
        # and an alias (`self.p1 = self.p0`) keeps its name, as in the model's state dict.
        self._modules.update(model._modules)
        self._parameters.update(model._parameters)
        self._buffers.update(model._buffers)
        self._non_persistent_buffers_set.update(model._non_persistent_buffers_set)
        self.training = model.training
        own = dict(
            _owner=model, _programs=programs, _bind=bind, plan=plan, devices=list(devices),
            chunks=plan.chunks, checkpoint=plan.checkpoint, last_timeline=[], _closed=False,
            _chunk_spec=dict(chunk_spec or {}), _signature=_signature(model),
            _deferred_batch_norm=deferred_batch_norm,
        )  # fmt: skip
        self.__dict__.update(own)
        self.__dict__["_workers"] = Workers(self.devices)
        self._workers.bind(self)
        self._build()

    # -- stages ----------------------------------------------------------------------------
    def _build(self) -> None:
        """(Re)generate the stage modules; after a dtype cast they must see the new buffers."""
        for program in {id(p): p for p in self._programs.values()}.values():
            program.codes = generate_stages(program.graph, program.runs, program.edges, self._owner)
            for code in program.codes:
                draw_from_task_streams(code.module)
                if self._deferred_batch_norm:
                    defer_batch_norm(code.module)
            program.runtimes = [self._runtime(program, index) for index in range(len(program.codes))]
            program.parameters = self._parameters_read(program)
            program.output_params = {name: [self._resolve(p) for p in s.params] for name, s in program.sources.items()}
        self.__dict__["stages"] = [code.module for code in self._programs[True].codes]

    def program(self, training: bool = True) -> Program:
        """The graph, its cut and the generated stages that run in training (or eval) mode."""
        return self._programs[training]

    def _runtime(self, program: Program, index: int) -> StageRuntime:
        code = program.codes[index]
        sources = {e.value: e.src for e in program.edges if e.dst == index}
        consumers: dict[str, list[int]] = {name: [] for name in code.outputs}
        for e in program.edges:
            if e.src == index:
                consumers[e.value].append(e.dst)
        shared = {id(self._resolve(name)) for name in code.shared}
        params = [p for p in code.module.parameters() if id(p) not in shared]
        paths: dict[int, list[str]] = {}
        for name, p in code.module.named_parameters(remove_duplicate=False):
            paths.setdefault(id(p), []).append(name)
        random = random_sources(program.graph, program.runs[index])
        hidden = random_sources(code.module, list(code.module.graph.nodes))
        nodes = {node.name: node for node in program.runs[index]}
        return StageRuntime(
            index, self.devices[index], code.module, code.inputs, code.outputs, sources, consumers,
            params=params,
            param_slots=[[slot_of(code.module, path) for path in paths[id(p)]] for p in params],
            random_always=random.always,
            random_modules=[fetch_attr(program.graph, name) for name in random.modules],
            hidden_always=hidden.always,
            hidden_modules=[code.module.get_submodule(name) for name in hidden.modules],
            writable_buffers=writable_buffers(code.module, program.graph, program.runs[index]),
            state_outputs={name for name in code.outputs if aliases_state(program.graph, nodes[name])},
            written=code.written,
            whole_modules=_called_whole(code.module),
        )  # fmt: skip

    def _resolve(self, name: str) -> Any:
        try:
            return fetch_attr(self._owner, name)
        except AttributeError:
            return fetch_attr(self._programs[True].graph, name)

    def _program(self) -> Program:
        """The program for the modules' training flags now."""
        train, evaluate = self._programs[True], self._programs[False]
        if train is evaluate:
            return train
        flags = {self.training, *(m.training for m in self._owner.modules())}
        if len(flags) > 1:
            raise RuntimeError(
                "the model's forward reads `self.training` (its graph differs between train and eval "
                "mode), and its modules are now in mixed modes, a graph that was not compiled.\n"
                "How to fix: put the whole pipeline in one mode (pipe.train() or pipe.eval()), or "
                "compile the model in the mixed mode you need."
            )
        return self._programs[flags.pop()]

    def _shared(self, program: Program, grad: bool) -> list[list[torch.Tensor]]:
        """Each stage's own copy, for this step, of the tensors several stages read."""
        shared = []
        for code, device in zip(program.codes, self.devices):
            copies = []
            for name in code.shared:
                tensor = self._resolve(name)
                if isinstance(tensor, nn.Parameter):
                    copy_ = tensor.detach().to(device)  # on the owner's device: a new leaf, same memory
                    copies.append(copy_.requires_grad_() if grad and tensor.requires_grad else copy_)
                else:
                    copies.append(tensor.to(device))  # a buffer on its own device is the buffer itself
            shared.append(copies)
        return shared

    def _parameters_read(self, program: Program) -> list[nn.Parameter]:
        """The parameters that some stage of `program` reads, once each."""
        found: dict[int, nn.Parameter] = {}
        for runtime, code in zip(program.runtimes, program.codes):
            for p in [*runtime.params, *(self._resolve(name) for name in code.shared)]:
                if isinstance(p, nn.Parameter):
                    found.setdefault(id(p), p)
        return list(found.values())

    @staticmethod
    def _parameter_grads(program: Program, step: Step, params: list[nn.Parameter], resolve: Any) -> list[Optional[torch.Tensor]]:
        """The step's gradient of each of `params`: its own stage's sum over micro-batches, plus
        the sums of other stages' copies, added in stage order (deterministic)."""
        totals: dict[int, torch.Tensor] = {}
        for index, runtime in enumerate(program.runtimes):
            for p, grad in zip(runtime.params, step.parameter_grads(index)):
                if grad is not None:
                    totals[id(p)] = grad
        for index, code in enumerate(program.codes):
            for name, grad in zip(code.shared, step.shared_grads(index)):
                if grad is not None:
                    param = resolve(name)
                    grad = grad.to(param.device)
                    totals[id(param)] = totals[id(param)] + grad if id(param) in totals else grad
        return [totals.get(id(p)) for p in params]

    # -- running ---------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise RuntimeError("this Pipeline was closed (pipe.close()); compile the model again to run it")
        program = self._program()
        values = self._bind(args, kwargs)
        dims = self._dims(args, kwargs)
        batch = batch_size_of(list(values.values()), dims)
        if batch == 0:
            raise ValueError("the input batch is empty (size 0 along dim 0); give at least one sample")
        sizes = split_sizes(batch, self.chunks) if batch is not None else [1]
        if len(sizes) > 1:
            self._check_written_inputs(program, values, batch, dims)
        pieces = {name: scatter(value, sizes, batch or 0, dims) for name, value in values.items()}
        micro_batches = [{name: pieces[name][i] for name in values} for i in range(len(sizes))]
        context = CallerContext.capture()
        input_slots = self._input_slots(values, batch, dims)
        grad_mode = torch.is_grad_enabled() and not context.inference
        params = [p for p in program.parameters if p.requires_grad] if grad_mode else []
        grad = grad_mode and bool(input_slots or params)
        shared = self._shared(program, grad)
        step = Step(
            program.runtimes,
            self._workers,
            micro_batches,
            grad=grad,
            checkpoint_stop=checkpoint_stop(self.checkpoint, len(sizes)) if self.training else 0,
            seed=draw_step_seed(),
            shared=shared,
            output_device=self.devices[-1],
            input_devices=_devices_of(values),
            context=context,
            batch_stats=BatchStatistics() if self._deferred_batch_norm and self.training else None,
        )
        self.__dict__["last_timeline"] = step.timeline

        def gather(per_micro_batch: list[dict[str, Any]]) -> Gathered:
            by_spec = any(dim is not None for dim in dims.values())  # outputs follow the spec's sizes
            return Gathered(program.template, per_micro_batch, self._given(program, values), sizes, not by_spec)

        if not grad:
            gathered = gather(step.forward())
            return gathered.rebuild(gathered.tensors)
        resolve = self._resolve
        run = Run(step, input_slots, params, gather, lambda: self._parameter_grads(program, step, params, resolve))
        run.differentiable = lambda name: Pipeline._differentiable(program, values, name)
        return run_with_autograd(run)

    @staticmethod
    def _differentiable(program: Program, values: dict[str, Any], name: str) -> bool:
        """Whether the output value `name` requires grad: it depends on an input or a parameter
        that does (a constant made in forward does not)."""
        sources = program.sources.get(name)
        if sources is None:
            return True
        inputs = (leaf for n in sources.inputs for leaf in tree_flatten(values.get(n))[0])
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
            return True
        return any(getattr(p, "requires_grad", True) for p in program.output_params[name])

    def _dims(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Dims:
        """How to split each input tensor that `chunk_spec` names, keyed by the tensor's id."""
        if not self._chunk_spec or self._signature is None:
            return {}
        try:
            bound = self._signature.bind(*args, **kwargs).arguments
        except TypeError:
            return {}
        dims: Dims = {}
        for name, dim in self._chunk_spec.items():
            for leaf in tree_flatten(bound.get(name))[0]:
                if isinstance(leaf, torch.Tensor):
                    dims[id(leaf)] = dim
        return dims

    @staticmethod
    def _check_written_inputs(program: Program, values: dict[str, Any], batch: Optional[int], dims: Dims) -> None:
        """An input written in place must be split: each micro-batch then writes its own slice,
        as the plain model writes the batch. One passed whole would be written once per
        micro-batch."""
        for runtime in program.runtimes:
            for name in runtime.written:
                leaves = [t for t in tree_flatten(values.get(name))[0] if isinstance(t, torch.Tensor)]
                if batch is None or any(split_dim(t, batch, dims) is None for t in leaves):
                    raise ValueError(
                        f"the model writes its input {name!r} in place, and that input is not split "
                        "into micro-batches: every micro-batch would write it again.\nHow to fix: use "
                        "chunks=1, or write a copy of the input in the model."
                    )

    def _given(self, program: Program, values: dict[str, Any]) -> dict[str, Any]:
        """Output values not made by a stage: inputs, and attributes returned as they are."""
        leaves = tree_flatten(program.template)[0]
        attrs = [leaf.name for leaf in leaves if isinstance(leaf, ValueRef) and leaf.given]
        return {name: values[name] if name in values else self._resolve(name) for name in attrs}

    def _input_slots(self, values: dict[str, Any], batch: Optional[int], dims: Dims) -> list[InputSlot]:
        slots = []
        for name, value in values.items():
            for index, leaf in enumerate(tree_flatten(value)[0]):
                if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                    dim = split_dim(leaf, batch, dims) if batch is not None else None
                    slots.append(InputSlot(name, index, leaf, dim))
        return slots

    # -- modes, copies, lifetime -------------------------------------------------------------
    def train(self, mode: bool = True) -> "Pipeline":
        self._owner.training = mode  # the model's own forward reads its flag too
        return super().train(mode)

    def __deepcopy__(self, memo: dict[int, Any]) -> "Pipeline":
        """A pipeline on a deep copy of the model, with its own stage workers."""
        owner = copy.deepcopy(self._owner, memo)
        programs = {id(p): p.copy(memo) for p in self._programs.values()}
        copied = {mode: programs[id(p)] for mode, p in self._programs.items()}
        pipe = Pipeline(
            owner, copied, self._bind, copy.deepcopy(self.plan), self.devices, self._chunk_spec, self._deferred_batch_norm
        )
        return pipe.train(self.training)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a Pipeline cannot be pickled: it holds stage threads and generated code.\n"
            "How to fix: save pipe.state_dict() (its keys are the model's own), and load it into the "
            "plain model, or into a pipeline compiled again."
        )

    def close(self) -> None:
        """Stop the stage workers now (they stop anyway when the pipeline is garbage-collected);
        the pipeline cannot run afterwards."""
        self.__dict__["_closed"] = True
        self._workers.close()

    # -- placement is managed ----------------------------------------------------------------
    def to(self, *args: Any, **kwargs: Any) -> "Pipeline":  # type: ignore[override]
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None:
            raise PlacementError(_PLACEMENT_MESSAGE)
        return super().to(*args, **kwargs)

    def cuda(self, device: Any = None) -> "Pipeline":
        raise PlacementError(_PLACEMENT_MESSAGE)

    def cpu(self) -> "Pipeline":
        raise PlacementError(_PLACEMENT_MESSAGE)

    def _apply(self, fn: Any, recurse: bool = True) -> "Pipeline":  # type: ignore[override]
        super()._apply(fn, recurse)
        if "_programs" in self.__dict__:
            self._owner._buffers.update(self._buffers)  # the model's own, cast: its new objects
            self._build()
        return self

    # -- pictures ----------------------------------------------------------------------------
    def to_svg(self, path: Optional[str] = None) -> str:
        """The stage graph as SVG text; also written to `path` when given."""
        from fxpipe.viz import plan_to_svg

        svg = plan_to_svg(self.plan)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(svg)
        return svg

    def _repr_svg_(self) -> str:
        return self.to_svg()

    def extra_repr(self) -> str:
        devices = ", ".join(str(d) for d in self.devices)
        return f"stages={len(self.devices)}, devices=[{devices}], chunks={self.chunks}, checkpoint={self.checkpoint!r}"


_PLACEMENT_MESSAGE = (
    "a Pipeline's placement is managed: each stage's parameters live on that stage's device.\n"
    "How to fix: choose devices when compiling (compile_pipeline(model, example, devices=[...])); "
    "dtype casts such as pipe.to(torch.float64) or pipe.double() are allowed."
)


def _called_whole(stage: fx.GraphModule) -> list[nn.Module]:
    """The modules a stage calls whole that are not PyTorch's own (whose forwards assign nothing)."""
    modules = [stage.get_submodule(str(n.target)) for n in stage.graph.nodes if n.op == "call_module"]
    return list({id(m): m for m in modules if not type(m).__module__.startswith("torch.")}.values())


def _mutable(value: Any, containers: Any = None) -> Any:
    """fx's immutable dicts and lists in an output as the containers the model made: the types
    the tracer recorded (`containers`, an OrderedDict say), else plain dicts and lists."""
    kind, inner = containers if isinstance(containers, tuple) else (None, None)
    if type(value) in (dict, immutable_dict):
        items = {key: _mutable(v, inner.get(key) if isinstance(inner, dict) else None) for key, v in value.items()}
        return kind(items) if kind is not None and issubclass(kind, dict) else items
    if type(value) in (list, immutable_list, tuple):
        parts = [_mutable(v, inner[i] if isinstance(inner, list) and i < len(inner) else None) for i, v in enumerate(value)]
        return tuple(parts) if type(value) is tuple else parts
    return value


def _signature(model: nn.Module) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None


def _ref(node: fx.Node) -> ValueRef:
    if node.op == "get_attr":
        return ValueRef(str(node.target), given=True)
    return ValueRef(node.name, given=node.op == "placeholder")


def _devices_of(values: dict[str, Any]) -> dict[str, torch.device]:
    devices = {}
    for name, value in values.items():
        leaves = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
        devices[name] = leaves[0].device if leaves else torch.device("cpu")
    return devices
