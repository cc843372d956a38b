"""Modules that take the batch along dim 1 (sequence first), where micro-batches split dim 0."""
from __future__ import annotations

import torch.fx as fx
from torch import nn

from fxpipe.core.attrs import fetch_attr

# PyTorch's modules whose `batch_first=False` (the default for most) puts the batch in dim 1.
_SEQUENCE_FIRST_CAPABLE = (nn.RNNBase, nn.MultiheadAttention)


def sequence_first_calls(gm: fx.GraphModule) -> list[str]:
    """The modules the graph calls whole that hold a layer with `batch_first=False`: an RNN,
    attention, or a Transformer layer built of them. Their inputs' dim 0 is the sequence."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = fetch_attr(gm, str(node.target))
        layers = [m for m in module.modules() if isinstance(m, _SEQUENCE_FIRST_CAPABLE)]
        if any(not getattr(m, "batch_first", True) for m in layers):
            found.append(f"{node.target} ({type(module).__name__})")
    return found
