"""Where a trace turns a module's plain tensor attribute into a Python value (`if self.temperature > 1:`), which the graph keeps as traced.

torch.fx runs the operations on a tensor a module holds as a plain attribute (no parameter, no
buffer) as they are, outside the graph: a branch on its value, an `int()` or `.item()` of it,
is decided once, while tracing, and a graph that reads the attribute live elsewhere would take
the traced branch after the attribute changed; a tensor made from one (`self.scale * 2`) is
stored in the graph as a constant. For the length of a trace a function mode follows what is
made from such tensors, and where one of them (or what was made from it) becomes a Python value
or a constant of the graph, the attribute is watched by value: a change to it is refused at the
call, as a changed float attribute is.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from fxpipe.tracing.attribute_reads import Reads

# What makes a Python value (or a numpy array) of a tensor's values.
_TO_PYTHON = frozenset({
    torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__complex__, torch.Tensor.is_nonzero, torch.is_nonzero,
    torch.Tensor.equal, torch.equal, torch.Tensor.allclose, torch.allclose, torch.Tensor.numpy, torch.Tensor.__array__,
})  # fmt: skip


class _Decisions(TorchFunctionMode):
    """Follows the values made from the tensors `reads` noted, to where one becomes a Python value."""

    def __init__(self, reads: Reads) -> None:
        super().__init__()
        self.reads = reads
        self.made: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}  # made tensor's id: (it, the attributes it came from)

    def _sources(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if id(tensor) in self.reads.tensors:
            return (tensor,)
        made = self.made.get(id(tensor))
        return made[1] if made is not None and made[0] is tensor else ()

    def constants_in(self, gm: torch.fx.GraphModule) -> None:
        """The attributes a constant of the traced graph was made from, watched by value: the
        graph keeps the constant as traced."""
        for node in gm.graph.nodes:
            if node.op == "get_attr" and str(node.target).startswith("_tensor_constant"):
                value = getattr(gm, str(node.target), None)
                if isinstance(value, torch.Tensor) and id(value) not in self.reads.tensors:
                    for source in self._sources(value):
                        self.reads.decided_on(source)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Optional[dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if not self.reads.tensors:  # (no plain tensor attribute read yet: nothing to follow)
            return func(*args, **kwargs)
        sources = list(dict.fromkeys(found for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) for found in self._sources(t)))
        if sources and func in _TO_PYTHON:
            for source in sources:
                self.reads.decided_on(source)
        out = func(*args, **kwargs)
        if sources:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.made[id(t)] = (t, tuple(sources))
        return out


@contextmanager
def decisions_watched(reads: Reads) -> Iterator[_Decisions]:
    """Within this block (a torch.fx trace), a plain tensor attribute `reads` notes is watched
    by value where what is made from it becomes a Python value; give the traced graph to the
    mode's `constants_in` for the constants made from one."""
    with _Decisions(reads) as decisions:
        yield decisions
