"""Cost model: what each node weighs, from the facts that shape propagation recorded."""
from __future__ import annotations

import torch.fx as fx

from fxpipe.passes.attrs import parameters_of


def annotate_costs(gm: fx.GraphModule) -> fx.GraphModule:
    """Set `param_bytes` (the parameters a node is first to use) and `size` on each node.

    `size` = parameter bytes + output activation bytes: what a stage made of these nodes holds,
    the default balancing weight.
    """
    seen: set[int] = set()
    for node in gm.graph.nodes:
        fresh = [p for p in parameters_of(gm, node) if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        node.meta["param_bytes"] = sum(p.numel() * p.element_size() for p in fresh)
        node.meta["size"] = node.meta["param_bytes"] + node.meta.get("bytes", 0)
    return gm
