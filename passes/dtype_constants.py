"""Which floating dtypes a graph holds as constants (`x.to(torch.float32)`, `torch.zeros(n, dtype=...)`)."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx


def floating_dtypes_held(gm: fx.GraphModule) -> frozenset[torch.dtype]:
    """The floating dtypes among the arguments of `gm`'s nodes: what a dtype read while tracing
    (a model's `self.dtype`) became, beside those its code names."""
    found: set[torch.dtype] = set()
    for node in gm.graph.nodes:
        _collect(node.args, found)
        _collect(node.kwargs, found)
    return frozenset(found)


def _collect(value: Any, found: set[torch.dtype]) -> None:
    """The floating dtypes in `value`, through tuples, lists and dicts (no pytree walk: every
    node's arguments are read)."""
    if isinstance(value, torch.dtype):
        if value.is_floating_point:
            found.add(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _collect(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _collect(item, found)
