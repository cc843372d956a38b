"""One call of a pipeline, prepared: its inputs split into micro-batches and checked, and what it asks of autograd."""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from fxpipe.compiled.program import Program
from fxpipe.core.own_code import caller_stacklevel
from fxpipe.core.microbatch import Dims, ExampleLeaves, off_batch, scatter, split_dim, split_sizes
from fxpipe.runtime.autograd import InputSlot
from fxpipe.runtime.context import CallerContext
from fxpipe.runtime.gather import Gathered, ValueRef, as_returned
from fxpipe.runtime.slices import SliceGrid
from fxpipe.runtime.transforms import refuse_transforms
from fxpipe.schedules.slices import SliceSpec


@dataclass
class Call:
    """One call's inputs, split into micro-batches, and what it asks of autograd."""

    program: Program
    values: dict[str, Any]
    batch: Optional[int]
    dims: Dims
    sizes: list[int]
    micro_batches: list[dict[str, Any]]
    context: CallerContext
    input_slots: list[InputSlot]
    params: list[nn.Parameter]
    grad: bool
    gather: Callable[..., Gathered]  # (per-micro-batch outputs, template=the program's)
    slices: Optional[SliceGrid] = None  # the micro-batches are slices of a sequence, cut from these rows

    @property
    def caller_micro_batches(self) -> list[dict[str, Any]]:
        """The pieces the caller's inputs were split into: the micro-batches, or the rows their
        slices were cut from."""
        return self.slices.rows_values if self.slices is not None else self.micro_batches


def split_call(
    program: Program, values: dict[str, Any], batch: Optional[int], dims: Dims, chunks: int, example_leaves: ExampleLeaves,
    check_micro_batch: Optional[Callable[[list[dict[str, Any]]], None]], across: bool,
) -> Call:
    """The call's input values split into micro-batches, checked against what the stages can run
    as the plain model does, with what the call asks of autograd."""
    refuse_shared_written_inputs(program, values)
    sizes = split_sizes(batch, chunks) if batch is not None else [1]
    if batch is not None and len(sizes) > 1:
        refuse_off_batch(values, example_leaves, batch, dims)
        check_written_inputs(program, values, batch, dims)
    pieces = {name: scatter(value, sizes, batch or 0, dims) for name, value in values.items()}
    micro_batches = [{name: pieces[name][i] for name in values} for i in range(len(sizes))]
    if check_micro_batch is not None and len(sizes) > 1:
        check_micro_batch(micro_batches)
    context = CallerContext.capture()
    slots = input_slots(values, batch, dims)
    grad_mode = torch.is_grad_enabled() and not context.inference
    refuse_transforms(values, program.unreached, grad_mode, program.state_read, program.tensors_read, program.held.named)
    params = [p for p in program.parameters if p.requires_grad] if grad_mode else []
    grad = grad_mode and bool(slots or params)
    if across and grad and slots:
        raise ValueError(
            "across processes, inputs that require grad are not supported: their gradients would be "
            "made on several ranks.\nHow to fix: pass inputs that do not require grad (x.detach())."
        )
    if context.saved_hooks is not None and grad and any(stage.compiled is not None for stage in program.stages):
        warnings.warn(
            "compile_stages: under saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks, save_on_cpu) the "
            "stages run uncompiled, as the model does: a compiled backward saves tensors the model never saves "
            "(a ReLU's bool mask), which a hook that casts what it packs would hand back in another dtype.",
            stacklevel=caller_stacklevel(),
        )
    by_spec = any(dim is not None for dim in dims.values())  # outputs follow the spec's sizes
    given = given_values(program, values)

    def gather(per_micro_batch: list[dict[str, Any]], template: Any = None) -> Gathered:
        return Gathered(program.template if template is None else template, per_micro_batch, given, sizes, not by_spec)

    return Call(program, values, batch, dims, sizes, micro_batches, context, slots, params, grad, gather)


def refuse_shared_written_inputs(program: Program, values: dict[str, Any]) -> None:
    """An input written in place that shares memory with another (`model(t, t)`, or a view
    of t): the plain model's write shows through the other, where a stage writes a copy."""
    written = program.written_inputs
    if not written:
        return
    holders: dict[int, list[tuple[str, torch.Tensor]]] = {}  # storage -> the inputs' tensors in it
    for name, value in values.items():
        for leaf in tree_flatten(value)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.numel() and not leaf.is_meta:
                holders.setdefault(leaf.untyped_storage().data_ptr(), []).append((name, leaf))
    for held in holders.values():
        for i, (name, tensor) in enumerate(held):
            other = next((n for k, (n, t) in enumerate(held) if k != i and overlap(t, tensor)), None) if name in written else None
            if other is not None:
                raise ValueError(
                    f"the model writes its input {name!r} in place, and {other!r} shares its memory (the same "
                    "tensor, or a view of it): the plain model's write shows through it, where each stage writes "
                    "a copy of what it is given.\nHow to fix: pass a copy of one of them (y.clone())."
                )


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one storage share an element (views of its disjoint parts do not;
    a tensor passed twice does); of different dtypes, taken to."""
    if a.dtype != b.dtype or a.device != b.device:
        return True
    if a.size() == b.size() and a.stride() == b.stride() and a.storage_offset() == b.storage_offset():
        return True
    marks = torch.zeros(a.untyped_storage().nbytes() // a.element_size(), dtype=torch.bool, device=a.device)
    marks.as_strided(a.size(), a.stride(), a.storage_offset()).fill_(True)
    return bool(marks.as_strided(b.size(), b.stride(), b.storage_offset()).any())


def refuse_off_batch(values: dict[str, Any], example_leaves: ExampleLeaves, batch: int, dims: Dims) -> None:
    """An input split with the batch in the example (or broadcast against it), given another size
    there than the batch's."""
    wrong = off_batch(values, example_leaves, batch, dims)
    if wrong:
        raise ValueError(
            f"the example split these inputs with the batch along dim 0 (or gave them 1 there, broadcast against "
            f"the batch), and this call gives them another "
            f"size there than the batch's {batch} (nor 1): {', '.join(wrong)}. Kept whole, each "
            "micro-batch would broadcast against all of them, where the plain model takes them row by "
            "row with the batch.\nHow to fix: give every batched input the same batch size, or "
            "keep such an input whole in every call (chunk_spec={name: None})."
        )


def check_written_inputs(program: Program, values: dict[str, Any], batch: Optional[int], dims: Dims) -> None:
    """An input written in place must be split: each micro-batch then writes its own slice,
    as the plain model writes the batch. One passed whole would be written once per
    micro-batch."""
    for stage in program.stages:
        for name in stage.written:
            leaves = [t for t in tree_flatten(values.get(name))[0] if isinstance(t, torch.Tensor)]
            if batch is None or any(split_dim(t, batch, dims) is None for t in leaves):
                raise ValueError(
                    f"the model writes its input {name!r} in place, and that input is not split "
                    "into micro-batches: every micro-batch would write it again.\nHow to fix: use "
                    "chunks=1, or write a copy of the input in the model."
                )


def given_values(program: Program, values: dict[str, Any]) -> dict[str, Any]:
    """Output values not made by a stage: inputs, and attributes returned as they are."""
    return {**program.given, **values}


def input_slots(values: dict[str, Any], batch: Optional[int], dims: Dims) -> list[InputSlot]:
    """Where each input tensor that requires grad gets its gradient: its place in the inputs, and its split dim."""
    slots = []
    for name, value in values.items():
        for index, leaf in enumerate(tree_flatten(value)[0]):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                dim = split_dim(leaf, batch, dims) if batch is not None else None
                slots.append(InputSlot(name, index, leaf, dim))
    return slots


def differentiable(program: Program, values: dict[str, Any], name: str) -> bool:
    """Whether the output value `name` requires grad: it depends on an input or a parameter
    that does (a constant made in forward does not)."""
    if name not in program.output_inputs:
        return True
    inputs = (leaf for n in program.output_inputs[name] for leaf in tree_flatten(values.get(n))[0])
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
        return True
    return any(getattr(p, "requires_grad", True) for p in program.output_params[name])


def devices_of(values: dict[str, Any]) -> dict[str, torch.device]:
    """Each input's device: that of its first tensor (the CPU for one without tensors)."""
    devices = {}
    for name, value in values.items():
        leaves = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
        devices[name] = leaves[0].device if leaves else torch.device("cpu")
    return devices


def rebuild(template: Any, values: dict[str, Any], given: dict[str, Any]) -> Any:
    """One micro-batch's output in the model's structure, its tensors as they are (not copied)."""
    return as_returned(tree_map(lambda ref: (given if ref.given else values)[ref.name] if isinstance(ref, ValueRef) else ref, template))


def sliced_call(call: Call, spec: Optional[SliceSpec]) -> Call:
    """`call` with its micro-batches cut into slices of their sequence as `spec` says (as it is
    where `spec` is None), and its outputs joined again."""
    if spec is None:
        return call
    grid, gather = SliceGrid(call.micro_batches, spec), call.gather

    def joined(per_slice: list[dict[str, Any]], template: Any = None) -> Gathered:
        return grid.gathered(gather(grid.join(per_slice), template))

    sizes = [size for size in call.sizes for _ in grid.lengths]
    return dataclasses.replace(call, micro_batches=grid.micro_batches, sizes=sizes, gather=joined, slices=grid)
