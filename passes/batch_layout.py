"""Modules that take the batch along dim 1 (sequence first), where micro-batches split dim 0."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx
from torch import nn

from fxpipe.core.attrs import fetch_attr
from fxpipe.core.microbatch import Dims, batch_size_of, scatter, split_sizes
from fxpipe.passes.example_runs import run_on
from fxpipe.passes.shapes import small_on_cpu

# PyTorch's modules whose `batch_first=False` (the default for most) puts the batch in dim 1.
_SEQUENCE_FIRST_CAPABLE = (nn.RNNBase, nn.MultiheadAttention)


def sequence_first_calls(gm: fx.GraphModule, inputs: Optional[tuple[Any, ...]] = None, dims: Optional[Dims] = None) -> list[str]:
    """The modules the graph calls whole that hold a layer with `batch_first=False`: an RNN,
    attention, or a Transformer layer built of them, whose inputs' dim 0 is the sequence. With
    the example's `inputs` (split along `dims`), not those the model feeds the batch on dim 1
    (`x.transpose(0, 1)`), which micro-batches split as they should."""
    found = {}
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = fetch_attr(gm, str(node.target))
        layers = [m for m in module.modules() if isinstance(m, _SEQUENCE_FIRST_CAPABLE)]
        if any(not getattr(m, "batch_first", True) for m in layers):
            found[node] = f"{node.target} ({type(module).__name__})"
    fed_right = _fed_the_batch_on_dim_1(gm, list(found), inputs, dims or {}) if found and inputs is not None else set()
    return [label for node, label in found.items() if node not in fed_right]


def _fed_the_batch_on_dim_1(gm: fx.GraphModule, calls: list[fx.Node], inputs: tuple[Any, ...], dims: Dims) -> set[fx.Node]:
    """The calls whose first input has the batch on dim 1: between the example and its first
    half, its size there, and there alone, changes. None where the graph cannot run here."""
    batch = batch_size_of(list(inputs), dims)
    if batch is None or batch < 2 or not small_on_cpu(gm, inputs):
        return set()
    half = tuple(scatter(value, split_sizes(batch, 2), batch, dims)[0] for value in inputs)
    firsts = {call: call.args[0] for call in calls if call.args and isinstance(call.args[0], fx.Node)}
    try:
        whole, part = run_on(gm, [inputs, half], True, keep=set(firsts.values()))
    except Exception:  # noqa: BLE001 - the refusal stands; the batch check says why it cannot run
        return set()
    right = set()
    for call, first in firsts.items():
        a, b = whole.get(first), part.get(first)
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim() >= 2:
            if [d for d in range(a.dim()) if a.shape[d] != b.shape[d]] == [1]:
                right.add(call)
    return right
