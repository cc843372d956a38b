"""Linearization: the order in which a graph's compute nodes are laid out across the stages."""
from __future__ import annotations

import torch.fx as fx

COMPUTE_OPS = ("call_module", "call_function", "call_method")


def linearize(gm: fx.GraphModule) -> list[fx.Node]:
    """The compute nodes in a topological order; stages are contiguous runs of this list.

    Placeholders, `get_attr` and the output node are not placed: inputs come from the caller,
    attributes are read in every stage that uses them, and the output is gathered at the end.
    The traced order is topological and follows the model's own forward, so runs of it keep a
    module's nodes together.
    """
    return [node for node in gm.graph.nodes if node.op in COMPUTE_OPS]
