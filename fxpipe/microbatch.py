"""Manipulation of micro-batches: splitting a batch along dim 0 and putting the pieces back."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten


def is_batched(value: Any, batch_size: int) -> bool:
    """A tensor is split across micro-batches when its first dimension is the batch."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch_size


def batch_size_of(values: Sequence[Any]) -> Optional[int]:
    """The size of dim 0 of the first tensor (with a dim 0) among the inputs."""
    leaves, _ = tree_flatten(list(values))
    return next((t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0), None)


def split_sizes(batch_size: int, chunks: int) -> list[int]:
    """Micro-batch sizes as `torch.tensor_split` makes them: uneven allowed, none empty."""
    base, extra = divmod(batch_size, chunks)
    sizes = [base + 1] * extra + [base] * (chunks - extra)
    return [s for s in sizes if s > 0]


def scatter(value: Any, sizes: Sequence[int], batch_size: int) -> list[Any]:
    """One copy of `value` per micro-batch; batched tensors are split, the rest is shared."""
    leaves, spec = tree_flatten(value)
    pieces = [t.split(list(sizes)) if is_batched(t, batch_size) else [t] * len(sizes) for t in leaves]
    return [tree_unflatten([p[i] for p in pieces], spec) for i in range(len(sizes))]


def gather_leaf(parts: Sequence[Any]) -> Any:
    """Put one output back together: tensors are concatenated along dim 0."""
    first = parts[0]
    if not isinstance(first, torch.Tensor):
        return first
    if first.dim() == 0:
        raise ValueError(
            "a stage output gathered from the micro-batches is a 0-dim tensor (a loss or a scalar?): "
            "outputs are concatenated along dim 0.\nHow to fix: return per-sample values and reduce "
            "them outside the pipeline, or use chunks=1."
        )
    return torch.cat(list(parts)) if len(parts) > 1 else first.detach()


def gather_grads(parts: Sequence[Optional[torch.Tensor]], like: Sequence[torch.Tensor], split: bool) -> Optional[torch.Tensor]:
    """The gradient of one input from the gradients of its micro-batch pieces.

    A split input's gradient is the concatenation; a shared one's is the sum. A piece that got
    no gradient counts as zeros.
    """
    if all(p is None for p in parts):
        return None
    filled = [p if p is not None else torch.zeros_like(piece) for p, piece in zip(parts, like)]
    if split:
        return torch.cat(filled)
    total = filled[0].clone()
    for p in filled[1:]:
        total += p
    return total


def map_tensors(fn: Any, value: Any) -> Any:
    """Apply `fn` to every tensor in a nested value, leaving everything else as it is."""
    if isinstance(value, torch.Tensor):  # the common case, without a pytree walk
        return fn(value)
    return tree_map(lambda v: fn(v) if isinstance(v, torch.Tensor) else v, value)


def leaves_of(value: Any) -> list[Any]:
    """The leaves of a nested value (a tensor is its own only leaf)."""
    return [value] if isinstance(value, torch.Tensor) else tree_flatten(value)[0]
