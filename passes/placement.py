"""Device constants in a graph (a `device=` argument on a factory op), moved to each node's stage."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.fx as fx


def pin_devices(gm: fx.GraphModule, devices: Sequence[torch.device]) -> fx.GraphModule:
    """Rewrite every constant `device=` keyword to the device of the stage that runs the node.

    torch.export bakes the example's device into factory ops (`arange(..., device=cpu)`); a stage
    on another device must make its tensors there. Needs `node.meta["stage"]`.
    """
    pinned = False
    for node in gm.graph.nodes:
        device = node.kwargs.get("device")
        if "stage" in node.meta and isinstance(device, (torch.device, str)):
            node.update_kwarg("device", devices[node.meta["stage"]])
            pinned = True
    if pinned:  # else its code stands: generating it again costs milliseconds
        gm.recompile()
    return gm
