"""Shape propagation: what each node produces (shape, dtype, bytes) and its forward FLOPs, from one
example input."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode


def _describe(value: Any) -> dict[str, Any]:
    """Shapes, dtypes and total bytes of every tensor in a (nested) value."""
    leaves, _ = tree_flatten(value)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    shapes = tree_map(lambda v: tuple(v.shape) if isinstance(v, torch.Tensor) else None, value)
    return {
        "shape": shapes,
        "dtype": tensors[0].dtype if len(tensors) == 1 else tuple(t.dtype for t in tensors),
        "bytes": sum(t.numel() * t.element_size() for t in tensors),
    }


class _Recorder(fx.Interpreter):
    """Runs the graph and writes a description of each node's value into `node.meta`."""

    def run_node(self, n: fx.Node) -> Any:
        with FlopCounterMode(display=False) as counter:
            value = super().run_node(n)
        if n.op != "output":
            n.meta.update(_describe(value), flops=counter.get_total_flops())
        return value


def propagate_shapes(gm: fx.GraphModule, example: tuple[Any, ...]) -> fx.GraphModule:
    """Annotate every node with `shape`, `dtype` and `bytes` of what it produces, and `flops`
    (forward, as `torch.utils.flop_counter` counts them).

    Runs on fake tensors (no compute, no memory); a graph that fake tensors cannot run (a leaf
    module with data-dependent output shapes, say) is run once for real on the example.
    """
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = tree_map(lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v, example)
            _Recorder(gm).run(*fake)
    except Exception:
        with torch.no_grad():
            _Recorder(gm).run(*example)
    return gm
