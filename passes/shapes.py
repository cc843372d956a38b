"""Shape propagation: what each node produces (shape, dtype, bytes) and its forward FLOPs, from one
example input."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry


class FlopCount(TorchDispatchMode):
    """Counts FLOPs with torch.utils.flop_counter's formulas, without its per-module tracking."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        return out


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


_FLOP_WORDS = ("mm", "matmul", "linear", "conv", "einsum", "attention", "addbmm", "tensordot", "bilinear")


class _Recorder(fx.Interpreter):
    """Runs the graph and writes a description of each node's value into `node.meta`.

    On the meta device (`on_meta`), a module's parameters and buffers are swapped for meta
    copies for the call, so nothing is computed and nothing is allocated.
    """

    def __init__(self, gm: fx.GraphModule, on_meta: bool) -> None:
        super().__init__(gm)
        self.on_meta = on_meta
        self.copies: dict[int, Any] = {}

    def meta(self, value: Any) -> Any:
        if not self.on_meta:
            return value

        def copy(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in self.copies:
                self.copies[id(t)] = t.detach().to("meta")
            return self.copies[id(t)]

        return tree_map(lambda v: copy(v) if isinstance(v, torch.Tensor) else v, value)

    def placeholder(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self.meta(super().placeholder(target, args, kwargs))

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self.meta(super().get_attr(target, args, kwargs))

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        if not self.on_meta:
            return super().call_module(target, args, kwargs)
        module = self.fetch_attr(target)
        state = {name: self.meta(t) for name, t in [*module.named_parameters(), *module.named_buffers()]}
        return torch.func.functional_call(module, state, args, kwargs)

    def run_node(self, n: fx.Node) -> Any:
        if not self.may_count(n):
            value = super().run_node(n)
            flops = 0
        else:
            with FlopCount() as counter:
                value = super().run_node(n)
            flops = counter.flops
        if n.op != "output":
            n.meta.update(_describe(value), flops=flops)
        return value

    def may_count(self, n: fx.Node) -> bool:
        """Whether a node can run an op that has a FLOP formula (matmuls, convolutions,
        attention): counting costs a Python dispatch per op, so the rest are passed by."""
        if n.op == "call_module":
            module = self.fetch_attr(str(n.target))
            built_in = type(module).__module__.startswith("torch.nn.")
            return not built_in or any(p.dim() >= 2 for p in module.parameters())
        if n.op in ("call_function", "call_method"):
            name = getattr(n.target, "__name__", str(n.target))
            return any(word in name for word in _FLOP_WORDS)
        return False


# Below this many parameter bytes (all on the CPU), one real forward of the example is faster than
# the meta device, whose first use alone takes seconds.
REAL_RUN_LIMIT = 1 << 30


def _small_on_cpu(gm: fx.GraphModule, example: tuple[Any, ...]) -> bool:
    tensors = [*gm.parameters(), *gm.buffers(), *(t for t in tree_flatten(example)[0] if isinstance(t, torch.Tensor))]
    return all(t.device.type == "cpu" for t in tensors) and sum(t.numel() * t.element_size() for t in gm.parameters()) < REAL_RUN_LIMIT


def propagate_shapes(gm: fx.GraphModule, example: tuple[Any, ...], on_meta: Optional[bool] = None) -> fx.GraphModule:
    """Annotate every node with `shape`, `dtype` and `bytes` of what it produces, and `flops`
    (forward, as `torch.utils.flop_counter` counts them).

    On the meta device nothing is computed or allocated; by default a model under
    `REAL_RUN_LIMIT` bytes on the CPU runs once for real instead (faster), as does a graph that
    cannot run on the meta device (a leaf module that reads values, say).
    """
    if on_meta is None:
        on_meta = not _small_on_cpu(gm, example)
    if on_meta:
        try:
            with torch.no_grad():
                _Recorder(gm, on_meta=True).run(*example)
            return gm
        except Exception:
            pass
    with torch.no_grad():
        _Recorder(gm, on_meta=False).run(*example)
    return gm
