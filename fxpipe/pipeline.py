"""The Pipeline module: the model's own parameters, run stage by stage over micro-batches."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from fxpipe.autograd import InputSlot, Run, run_with_autograd
from fxpipe.checkpoint import checkpoint_stop
from fxpipe.frontend import Binder
from fxpipe.gather import Gathered, ValueRef
from fxpipe.microbatch import batch_size_of, is_batched, scatter, split_sizes
from fxpipe.passes.attrs import fetch_attr
from fxpipe.passes.codegen import StageCode, generate_stages
from fxpipe.passes.edges import Edge
from fxpipe.plan import Plan
from fxpipe.randomness import draw_step_seed
from fxpipe.step import StageRuntime, Step
from fxpipe.worker import Workers


class PlacementError(RuntimeError):
    """Devices of a Pipeline are chosen at compile time."""


class Pipeline(nn.Module):
    """A model cut into stages, one per device, run as a GPipe pipeline.

    Made by `compile_pipeline`. `pipe(*args)` takes what the model takes and returns what it
    returns, on the last stage's device; its parameters are the model's own, moved to the device
    of the first stage that uses them, under the model's own names.
    """

    # Held outside the module tree (in __dict__), so that state_dict() keys stay the model's own.
    _owner: nn.Module
    _graph: fx.GraphModule
    _runs: list[Sequence[fx.Node]]
    _edges: list[Edge]
    _codes: list[StageCode]

    def __init__(
        self,
        model: nn.Module,
        graph: fx.GraphModule,
        bind: Binder,
        runs: Sequence[Sequence[fx.Node]],
        edges: Sequence[Edge],
        plan: Plan,
        devices: Sequence[torch.device],
    ) -> None:
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, param in model.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buffer in model.named_buffers(recurse=False):
            self.register_buffer(name, buffer, persistent=name not in model._non_persistent_buffers_set)
        # Held outside the module tree, so that state_dict() keys stay the model's own.
        self.__dict__.update(_owner=model, _graph=graph, _runs=list(runs), _edges=list(edges))
        self.plan = plan
        self.devices = list(devices)
        self.chunks = plan.chunks
        self.checkpoint = plan.checkpoint
        self.last_timeline: list[tuple[str, int, int, float, float]] = []
        self._bind = bind
        output = next(n for n in graph.graph.nodes if n.op == "output")
        self._template = tree_map(lambda n: _ref(n) if isinstance(n, fx.Node) else n, output.args[0])
        self._workers = Workers(self.devices)
        self._workers.bind(self)
        self._build()

    # -- stages ----------------------------------------------------------------------------
    def _build(self) -> None:
        """(Re)generate the stage modules; after a dtype cast they must see the new buffers."""
        codes = generate_stages(self._graph, self._runs, self._edges, self._owner)
        self.__dict__["_codes"] = codes
        self.stages: list[fx.GraphModule] = [code.module for code in codes]
        self._runtimes = [self._runtime(index, code) for index, code in enumerate(codes)]

    def _runtime(self, index: int, code: StageCode) -> StageRuntime:
        sources = {e.value: e.src for e in self._edges if e.dst == index}
        consumers: dict[str, list[int]] = {name: [] for name in code.outputs}
        for e in self._edges:
            if e.src == index:
                consumers[e.value].append(e.dst)
        return StageRuntime(index, self.devices[index], code.module, code.inputs, code.outputs, sources, consumers)

    def _shared(self, grad: bool) -> list[list[torch.Tensor]]:
        """Each stage's own copy, for this step, of the tensors several stages read."""
        shared = []
        for code, device in zip(self._codes, self.devices):
            copies = []
            for name in code.shared:
                tensor = fetch_attr(self._owner, name)
                if isinstance(tensor, nn.Parameter):
                    copy = tensor.detach().to(device)  # on the owner's device: a new leaf, same memory
                    copies.append(copy.requires_grad_() if grad and tensor.requires_grad else copy)
                else:
                    copies.append(tensor.to(device))  # a buffer on its own device is the buffer itself
            shared.append(copies)
        return shared

    def _reduce_shared(self, shared: list[list[torch.Tensor]]) -> None:
        """Sum the copies' gradients into the one Parameter, in stage order (deterministic)."""
        totals: dict[str, torch.Tensor] = {}
        for code, copies in zip(self._codes, shared):
            for name, copy in zip(code.shared, copies):
                if copy.grad is not None:
                    param = fetch_attr(self._owner, name)
                    grad = copy.grad.to(param.device)
                    totals[name] = grad if name not in totals else totals[name] + grad
        for name, total in totals.items():
            param = fetch_attr(self._owner, name)
            if param.grad is None:
                param.grad = total
            else:
                param.grad += total

    # -- running ---------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        values = self._bind(args, kwargs)
        batch = batch_size_of(list(values.values()))
        if batch == 0:
            raise ValueError("the input batch is empty (size 0 along dim 0); give at least one sample")
        sizes = split_sizes(batch, self.chunks) if batch is not None else [1]
        pieces = {name: scatter(value, sizes, batch or 0) for name, value in values.items()}
        micro_batches = [{name: pieces[name][i] for name in values} for i in range(len(sizes))]
        input_slots = self._input_slots(values, batch)
        grad = torch.is_grad_enabled() and (
            bool(input_slots) or any(p.requires_grad for p in self.parameters())
        )
        shared = self._shared(grad)
        step = Step(
            self._runtimes,
            self._workers,
            micro_batches,
            grad=grad,
            checkpoint_stop=checkpoint_stop(self.checkpoint, len(sizes)) if self.training else 0,
            seed=draw_step_seed(),
            shared=shared,
            output_device=self.devices[-1],
            input_devices=_devices_of(values),
        )
        self.last_timeline = step.timeline

        def gather(per_micro_batch: list[dict[str, Any]]) -> Gathered:
            return Gathered(self._template, per_micro_batch, self._given(values))

        if not grad:
            gathered = gather(step.forward())
            return gathered.rebuild(gathered.tensors)
        run = Run(step, input_slots, gather, lambda: self._reduce_shared(shared))
        return run_with_autograd(run)

    def _given(self, values: dict[str, Any]) -> dict[str, Any]:
        """Output values not made by a stage: inputs, and attributes returned as they are."""
        attrs = [leaf.name for leaf in tree_flatten(self._template)[0] if isinstance(leaf, ValueRef) and leaf.given]
        return {name: values[name] if name in values else fetch_attr(self._owner, name) for name in attrs}

    def _input_slots(self, values: dict[str, Any], batch: Optional[int]) -> list[InputSlot]:
        slots = []
        for name, value in values.items():
            for index, leaf in enumerate(tree_flatten(value)[0]):
                if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                    slots.append(InputSlot(name, index, leaf, batch is not None and is_batched(leaf, batch)))
        return slots

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
        if "_codes" in self.__dict__:
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

    def close(self) -> None:
        """Stop the stage workers now (they stop anyway when the pipeline is garbage-collected)."""
        self._workers.close()

    def extra_repr(self) -> str:
        devices = ", ".join(str(d) for d in self.devices)
        return f"stages={len(self.devices)}, devices=[{devices}], chunks={self.chunks}, checkpoint={self.checkpoint!r}"


_PLACEMENT_MESSAGE = (
    "a Pipeline's placement is managed: each stage's parameters live on that stage's device.\n"
    "How to fix: choose devices when compiling (compile_pipeline(model, example, devices=[...])); "
    "dtype casts such as pipe.to(torch.float64) or pipe.double() are allowed."
)


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
