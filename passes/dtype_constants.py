"""Which floating dtypes a graph holds as constants (`x.to(torch.float32)`, `torch.zeros(n, dtype=...)`)."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves


def floating_dtypes_held(gm: fx.GraphModule) -> frozenset[torch.dtype]:
    """The floating dtypes among the arguments of `gm`'s nodes: what a dtype read while tracing
    (a model's `self.dtype`) became, beside those its code names."""
    found: set[torch.dtype] = set()
    for node in gm.graph.nodes:
        for value in tree_leaves((node.args, node.kwargs)):
            if _floating(value):
                found.add(value)
    return frozenset(found)


def _floating(value: Any) -> bool:
    return isinstance(value, torch.dtype) and value.is_floating_point
