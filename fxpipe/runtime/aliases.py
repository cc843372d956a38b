"""Outputs that share memory in the plain model (`return h, h[:, :2]`), made views of one another again once gathered.

In the plain model the second output is a view of the first: a write in place to either
changes the other, and autograd follows it. Gathered from the micro-batches (or handed out by
the pipeline's autograd Function) they would be two unrelated tensors. Where every
micro-batch's pair shares memory in one way that the gathered base can hold too, the gathered
view is made again from the gathered base, with `as_strided`:

    micro-batch k:   b_k  (rows r_k, contiguous)     a_k = b_k.as_strided(size_k, stride, offset)
    gathered:        B = cat(b_0, b_1, ...) on dim 0  A = B.as_strided(sizes summed on a's batch dim, stride, offset)

which holds when each micro-batch's piece of a starts where its rows of b start (h[:, :2], h.t()
and h.view(-1) do; h[:2] does not). Where it does not hold (a view across the batch dim, a
transposed base), the outputs stay apart, as docs/limits.md says.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from fxpipe.core.writes import storage_key


@dataclass(frozen=True)
class Alias:
    """Gathered output `view` is `tensors[base].as_strided(size, stride, base's offset + offset)`."""

    view: int
    base: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def _within(view: torch.Tensor, base: torch.Tensor) -> Optional[int]:
    """`view`'s offset from `base`'s start when every element of `view` lies in contiguous `base`."""
    if not base.is_contiguous() or storage_key(view) != storage_key(base) or view.numel() == 0:
        return None
    offset = view.storage_offset() - base.storage_offset()
    last = offset + sum((n - 1) * s for n, s in zip(view.shape, view.stride()))
    return int(offset) if offset >= 0 and last < base.numel() and min(view.stride(), default=0) >= 0 else None


def _alias(view: int, base: int, parts: Sequence[Sequence[torch.Tensor]], dims: Sequence[Optional[int]], sizes: Sequence[torch.Size]) -> Optional[Alias]:
    """How gathered `view` is a view of gathered `base`, or None where it is not one (or not
    one view for every micro-batch)."""
    views, bases = parts[view], parts[base]
    offsets = [_within(v, b) for v, b in zip(views, bases)]
    if any(o is None for o in offsets) or len(set(offsets)) > 1 or len({v.stride() for v in views}) > 1:
        return None
    stride, offset = views[0].stride(), offsets[0]
    assert offset is not None
    whole = len(views) == 1 or dims[view] is None and dims[base] is None  # both the first micro-batch's
    if not whole and not _continues(views, bases, dims[view], dims[base]):
        return None
    return Alias(view, base, tuple(sizes[view]), stride, offset)


def _continues(views: Sequence[torch.Tensor], bases: Sequence[torch.Tensor], along: Optional[int], base_along: Optional[int]) -> bool:
    """Whether each micro-batch's view is the gathered view's piece along `along` that lies in
    that micro-batch's rows of the base gathered along dim 0: its piece starts where its rows
    start (h[:, :2], h.t(), h.view(-1) do; h[:2] of each micro-batch does not)."""
    if base_along != 0 or along is None or bases[0].dim() == 0:
        return False
    if len({v.shape[:along] + v.shape[along + 1:] for v in views}) > 1:
        return False
    row, stride = bases[0].stride(0), views[0].stride(along)
    piece = rows = 0
    for v, b in zip(views, bases):
        if piece * stride != rows * row:
            return False
        piece, rows = piece + v.shape[along], rows + b.shape[0]
    return piece * stride == rows * row  # the last piece ends where the rows do


def output_aliases(parts: Sequence[Sequence[torch.Tensor]], dims: Sequence[Optional[int]], sizes: Sequence[torch.Size]) -> list[Alias]:
    """For the gathered outputs (`parts[i]`: output i of each micro-batch; `dims[i]`: the dim it
    was gathered along, None for one returned whole; `sizes[i]`: its gathered size), those that
    are views of another output in every micro-batch. A base is never itself a view."""
    found: list[Alias] = []
    bases: set[int] = set()
    by_storage: dict[tuple[int, ...], list[int]] = {}
    for i, tensors in enumerate(parts):
        by_storage.setdefault(tuple(storage_key(t) for t in tensors), []).append(i)
    for group in by_storage.values():
        if len(group) < 2:
            continue
        # the largest contiguous one is the base the others are views of (`h` of `h, h[:, :2]`)
        base = max(group, key=lambda i: (parts[i][0].is_contiguous(), parts[i][0].numel(), -i))
        for view in group:
            alias = None if view == base else _alias(view, base, parts, dims, sizes)
            if alias is not None and view not in bases:
                found.append(alias)
                bases.add(base)
    return found


def realiased(tensors: Sequence[torch.Tensor], aliases: Sequence[Alias]) -> list[torch.Tensor]:
    """`tensors` with each alias's view made from its base again (autograd's version of it)."""
    made = list(tensors)
    for alias in aliases:
        base = made[alias.base]
        if base.requires_grad and not tensors[alias.view].requires_grad:
            base = base.detach()  # a view the model detached (`h.detach()`): its memory, not its gradient
        made[alias.view] = base.as_strided(alias.size, alias.stride, base.storage_offset() + alias.offset)
    return made
