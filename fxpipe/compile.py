"""compile_pipeline: from a model and an example input to a Pipeline, through the passes."""
from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence, Union

import torch
import torch.fx as fx
from torch import nn

from fxpipe.checkpoint import CHECKPOINT_MODES
from fxpipe.microbatch import batch_size_of
from fxpipe.passes.attrs import fetch_attr, tensors_read
from fxpipe.passes.costs import annotate_costs
from fxpipe.frontend import to_graph
from fxpipe.passes.devices import pin_devices
from fxpipe.passes.edges import find_edges
from fxpipe.passes.inplace import redirect_reads_after_writes
from fxpipe.passes.linearize import linearize
from fxpipe.passes.partition import partition
from fxpipe.passes.shapes import propagate_shapes
from fxpipe.passes.trace import LeafSpec
from fxpipe.pipeline import Pipeline
from fxpipe.plan import Plan, StagePlan

Device = Union[str, int, torch.device]


def _check_arguments(
    devices: Sequence[Device], chunks: int, checkpoint: str, split_points: Any, balance: Any
) -> list[torch.device]:
    problems = []
    parsed = []
    if not devices:
        problems.append("devices is empty: give one device per stage, e.g. devices=['cpu', 'cpu']")
    for device in devices or ():
        try:
            parsed.append(torch.device(device))
        except (RuntimeError, TypeError):
            problems.append(f"{device!r} is not a device")
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        problems.append(f"chunks must be a whole number of micro-batches, at least 1 (got {chunks!r})")
    if checkpoint not in CHECKPOINT_MODES:
        problems.append(f"checkpoint must be one of {', '.join(map(repr, CHECKPOINT_MODES))} (got {checkpoint!r})")
    if split_points is not None and balance is not None:
        problems.append("split_points and balance were both given: give one of them")
    if problems:
        raise ValueError("compile_pipeline got bad arguments:\n" + "\n".join(f"  - {p}" for p in problems))
    return parsed


def _place(owner: nn.Module, gm: fx.GraphModule, name: str, tensor: torch.Tensor, device: torch.device) -> None:
    """Move one parameter (in place, keeping the object) or buffer to its stage's device."""
    if tensor.device == device:
        return
    if isinstance(tensor, nn.Parameter):
        tensor.data = tensor.data.to(device)
        if tensor.grad is not None:
            tensor.grad = tensor.grad.to(device)
        return
    parent_name, _, attr = name.rpartition(".")
    for root in (owner, gm):
        try:
            parent = fetch_attr(root, parent_name) if parent_name else root
        except AttributeError:
            continue
        if getattr(parent, attr, None) is tensor:
            if attr in parent._buffers:
                parent._buffers[attr] = tensor.to(device)
            else:
                setattr(parent, attr, tensor.to(device))


def place_state(owner: nn.Module, gm: fx.GraphModule, runs: Sequence[Sequence[fx.Node]], devices: Sequence[torch.device]) -> None:
    """Every parameter and buffer goes to the device of the first stage that reads it."""
    placed: set[int] = set()
    for run, device in zip(runs, devices):
        for node in run:
            for name, tensor in tensors_read(gm, node).items():
                if id(tensor) not in placed:
                    placed.add(id(tensor))
                    _place(owner, gm, name, tensor, device)


def _module_path(node: fx.Node) -> str:
    scope = str(node.meta.get("scope", ""))
    return scope or (str(node.target) if node.op == "call_module" else "")


def compile_pipeline(
    model: nn.Module,
    example: Any,
    devices: Sequence[Device],
    *,
    chunks: int = 1,
    checkpoint: str = "except_last",
    split_points: Optional[Sequence[str]] = None,
    balance: Optional[Sequence[int]] = None,
    leaf_modules: Iterable[LeafSpec] = (),
) -> Pipeline:
    """Trace `model`, cut it into `len(devices)` stages and return them as a Pipeline.

    Args:
        model: an `nn.Module`, or a `torch.fx.GraphModule` traced already.
        example: one input batch as the model takes it: a tensor, or a tuple of positional args.
        devices: one device per stage; repeats are allowed (`["cpu", "cpu"]`).
        chunks: micro-batches per batch.
        checkpoint: 'always', 'except_last' or 'never': which micro-batches drop their
            activations in forward and recompute them in backward.
        split_points: qualified module names where stages 1, 2, ... begin.
        balance: the number of graph nodes per stage.
        leaf_modules: module types or qualified names to keep whole instead of tracing into.

    With neither `split_points` nor `balance`, the stages are as equal as possible in parameter
    plus activation bytes.
    """
    parsed = _check_arguments(devices, chunks, checkpoint, split_points, balance)
    example_args = example if isinstance(example, tuple) else (example,)
    if batch_size_of(list(example_args)) == 0:
        raise ValueError("the example batch is empty (size 0 along dim 0): give at least one sample")
    traced = to_graph(model, example_args, leaf_modules, chunks)
    gm = redirect_reads_after_writes(traced.graph)
    propagate_shapes(gm, tuple(traced.bind(example_args, {}).values()))
    annotate_costs(gm)
    order = linearize(gm)
    runs = partition(order, len(parsed), split_points=split_points, balance=balance)
    edges = find_edges(gm, len(parsed))
    pin_devices(gm, parsed)
    place_state(model, gm, runs, parsed)
    plan = Plan(
        stages=[
            StagePlan(
                index=index,
                device=str(device),
                nodes=[node.name for node in run],
                inputs=list(dict.fromkeys(e.value for e in edges if e.dst == index)),
                outputs=list(dict.fromkeys(e.value for e in edges if e.src == index)),
                param_bytes=sum(int(node.meta.get("param_bytes", 0)) for node in run),
                size=sum(int(node.meta.get("size", 0)) for node in run),
                modules=[_module_path(node) for node in run],
            )
            for index, (run, device) in enumerate(zip(runs, parsed))
        ],
        edges=edges,
        chunks=chunks,
        checkpoint=checkpoint,
        notes=[traced.note] if traced.note else [],
    )
    return Pipeline(model, gm, traced.bind, runs, edges, plan, parsed)
