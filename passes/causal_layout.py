"""The causality proof's rules for ops that size, index, reshape, move, split, join or reduce dims.

Each takes the tags of an op's inputs and gives its output's (passes/causal.py runs them over
the graph): a position dim follows the dim it moves to, a table indexed or narrowed to the
sequence's length takes a role variable, and an op that mixes position dims is refused.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.fx as fx

from fxpipe.passes.position_tags import CUMULATIVE, P_FIRST, STD_LIKE, K, Q, Length, Positions, Proof, Refused, Sizes, positions_of


class LayoutRules:
    """The prover's rules for ops that move dims; `proof` holds the tags and role variables."""

    proof: Proof

    # -- sizes and tables -------------------------------------------------------------------
    def _size(self, tag: Any, x: torch.Tensor, dim: Optional[int]) -> Any:
        if not isinstance(tag, Positions):
            return None
        if dim is None:
            return Sizes(tag.dims)
        role = tag.role(int(dim) % x.dim())
        return Length(role) if role is not None else None

    def _attribute(self, tag: Any, x: Any, name: str) -> Any:
        if name == "shape":
            return self._size(tag, x, None)
        if name in ("device", "dtype", "ndim", "is_cuda", "requires_grad", "layout", "is_sparse"):
            return None
        if name in ("T", "mT") and isinstance(tag, Positions):
            last = x.dim() - 1
            return self._moved(tag, x, {last: last - 1, last - 1: last} if name == "mT" or x.dim() == 2 else {d: last - d for d in range(x.dim())})
        raise Refused(f"this check does not know what .{name} of a value made of positions is")

    def _getitem(self, n: fx.Node, value: Any, args: tuple[Any, ...], tags: tuple[Any, ...]) -> Any:
        tag, index = tags[0], args[1]
        if isinstance(tag, Sizes):
            if not isinstance(index, int):
                raise Refused("a slice of a size that holds the sequence's length")
            return Length(dict(tag.dims)[index % len(args[0])]) if index % len(args[0]) in dict(tag.dims) else None
        if isinstance(tag, tuple):
            return tag[index]
        if not isinstance(args[0], torch.Tensor):
            raise Refused("an item of a value made of positions")
        return self._indexed(n, tag, args[0], index, tags[1])

    def _indexed(self, n: fx.Node, tag: Optional[Positions], x: torch.Tensor, index: Any, index_tags: Any) -> Optional[Positions]:
        """`x[index]`: ints drop a dim, None adds one, a slice keeps one (and cuts a table by the
        length: `rope[:T]`)."""
        items = list(index) if isinstance(index, tuple) else [index]
        item_tags = list(index_tags) if isinstance(index_tags, tuple) else [index_tags]
        if any(isinstance(i, (torch.Tensor, list)) for i in items):
            raise Refused("indexing by tensors (a table read by position: cut it with table[:T], or look it up with F.embedding(positions, table))")
        if Ellipsis in items:
            at = items.index(Ellipsis)
            fill = x.dim() - sum(1 for i in items if i is not None and i is not Ellipsis)
            items[at : at + 1], item_tags[at : at + 1] = [slice(None)] * fill, [None] * fill
        dims = dict(tag.dims) if tag is not None else {}
        out: list[tuple[int, str]] = []
        source, target = 0, 0
        for item, item_tag in zip(items, item_tags + [None] * (len(items) - len(item_tags))):
            if item is None:
                target += 1
                continue
            role = dims.get(source)
            if isinstance(item, int):
                if role is not None:
                    raise Refused("it reads one position of the sequence")
            elif isinstance(item, slice):
                cut = self._window(n, item, item_tag, x.shape[source], role)
                if cut is not None:
                    self.proof.tables.setdefault(n.name, []).append((cut, target))
                    out.append((target, cut))
                elif role is not None:
                    out.append((target, role))
                target += 1
            source += 1
        for d in range(source, x.dim()):  # the dims after the index
            if d in dims:
                out.append((target, dims[d]))
            target += 1
        return Positions(tuple(out), tag.masked if tag is not None else "") if out else None

    def _window(self, n: fx.Node, item: slice, item_tag: Any, size: int, role: Optional[str]) -> Optional[str]:
        """The role variable of a table cut to the length (`[:T]`, `[0:T]`); None for a slice
        that cuts nothing; refused for any other cut of a position dim or by the length."""
        stop_tag = item_tag.stop if isinstance(item_tag, slice) else None
        whole = item.start in (None, 0) and item.step in (None, 1) and (item.stop is None or item.stop >= size) and stop_tag is None
        if whole:
            return None
        if isinstance(stop_tag, Length) and stop_tag.role == Q and item.start in (None, 0) and item.step in (None, 1) and role is None:
            return self.proof.new_variable()
        if isinstance(stop_tag, Length) and stop_tag.role == K:  # in a slice, the keys are every position up to its end
            raise Refused("it cuts a table by the keys' length (`mask[:, :, :T, :att.size(-1)]`): cut both dims by the sequence's "
                          "length, `mask[:, :, :T, :T]` with T = x.size(1)")  # fmt: skip
        if role is not None or isinstance(item_tag, slice) and any(isinstance(t, Length) for t in (item_tag.start, item_tag.step)):
            raise Refused("it cuts the sequence (a slice other than [:T] of a table)")
        return None

    def _narrow(self, n: fx.Node, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any], tags: tuple[Any, ...]) -> Positions:
        x, dim, start, length = args[0], int(args[1]) % args[0].dim(), args[2], args[3]
        tag: Optional[Positions] = tags[0]
        if tag is not None and tag.role(dim) is not None:
            raise Refused("it cuts the sequence")
        if not (isinstance(tags[3], Length) and tags[3].role == Q and start == 0 and tags[2] is None):
            raise Refused("it cuts a dim by the sequence's length other than from 0 (narrow(dim, 0, T))")
        variable = self.proof.new_variable()
        self.proof.tables[n.name] = [(variable, dim)]
        return Positions(tuple(sorted([*(tag.dims if tag else ()), (dim, variable)])))

    def _arange(self, n: fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any], tags: tuple[Any, ...], kwtags: dict[str, Any]) -> Positions:
        numbers = [a for a in args]
        if len(numbers) == 1 and isinstance(tags[0], Length) and tags[0].role == Q or (
            len(numbers) == 2 and numbers[0] == 0 and tags[0] is None and isinstance(tags[1], Length) and tags[1].role == Q
        ):
            variable = self.proof.new_variable()
            self.proof.tables[n.name] = [(variable, 0)]
            return Positions(((0, variable),))
        raise Refused("an arange made from the sequence's length other than arange(T) (or arange(0, T), with no step)")

    # -- reshapes -------------------------------------------------------------------------
    def _reshaped(self, tag: Any, x: torch.Tensor, out: torch.Tensor) -> Positions:
        """The dim of `out` that holds each position dim of `x`: the one with the same elements
        before it and through it (a reshape that merges or splits it is refused)."""
        tag = positions_of(tag)
        before = [math.prod(x.shape[:d]) for d in range(x.dim() + 1)]
        after = [math.prod(out.shape[:d]) for d in range(out.dim() + 1)]
        dims = []
        for d, role in tag.dims:
            found = [e for e in range(out.dim()) if after[e] == before[d] and after[e + 1] == before[d + 1] and out.shape[e] == x.shape[d]]
            if not found:
                raise Refused("a reshape merges the sequence dim with another, or splits it")
            dims.append((found[-1] if x.shape[d] == 1 else found[0], role))
        return Positions(tuple(sorted(dims)), tag.masked)

    def _moved(self, tag: Any, x: torch.Tensor, to: dict[int, int]) -> Positions:
        tag = positions_of(tag)
        return Positions(tuple(sorted((to.get(d, d), role) for d, role in tag.dims)), tag.masked)

    def _expanded(self, tag: Any, x: torch.Tensor, out: torch.Tensor) -> Positions:
        tag = positions_of(tag)
        shift = out.dim() - x.dim()
        if any(out.shape[d + shift] != x.shape[d] for d, _ in tag.dims):
            raise Refused("it expands a position dim")
        return Positions(tuple((d + shift, role) for d, role in tag.dims), tag.masked)

    def _split(self, key: Any, args: tuple[Any, ...], kwargs: dict[str, Any], tags: tuple[Any, ...], value: Any) -> tuple[Any, ...]:
        x, tag = args[0], tags[0]
        dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
        if key in ("unbind", torch.unbind):
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        dim = int(dim) % x.dim()
        if not isinstance(tag, Positions) or tag.role(dim) is not None:
            raise Refused("it splits the sequence")
        if key in ("unbind", torch.unbind):
            part = Positions(tuple((d - (d > dim), role) for d, role in tag.dims), tag.masked)
        else:
            part = tag
        return tuple(part for _ in value)

    def _joined(self, key: Any, args: tuple[Any, ...], kwargs: dict[str, Any], tags: tuple[Any, ...]) -> Positions:
        parts, part_tags = args[0], tags[0]
        dim = int(args[1] if len(args) > 1 else kwargs.get("dim", 0))
        tensors = [p for p in parts if isinstance(p, torch.Tensor)]
        rank = tensors[0].dim() + (key is torch.stack)
        dim %= rank
        found = [t for t in part_tags if t is not None]
        if len(found) != len(parts):
            raise Refused("it joins values made of positions with values that are not")
        dims = found[0].dims
        for other in found[1:]:
            if [d for d, _ in other.dims] != [d for d, _ in dims] or any(self.proof.unify(a, b) is None for (_, a), (_, b) in zip(dims, other.dims)):
                raise Refused("it joins values whose positions lie on other dims")
        if key is torch.stack:
            dims = tuple((d + (d >= dim), role) for d, role in dims)
        if any(d == dim for d, _ in dims):
            raise Refused("it joins along the sequence dim")
        return Positions(dims)

    def _reduced(self, key: Any, args: tuple[Any, ...], kwargs: dict[str, Any], tags: tuple[Any, ...], value: Any) -> Any:
        x, tag = args[0], tags[0]
        at = 2 if key in P_FIRST else 1  # where dim is given by position
        dim = args[at] if len(args) > at else kwargs.get("dim")
        if key in STD_LIKE and isinstance(dim, bool):  # x.std(False): unbiased, over every dim
            dim = None
        if not isinstance(tag, Positions) or dim is None:
            raise Refused("it reduces over every position of the sequence")
        dims = [int(d) % x.dim() for d in (dim if isinstance(dim, (list, tuple)) else [dim])]
        if any(tag.role(d) is not None for d in dims):
            raise Refused("it reduces over the sequence (a sum, mean or cumulative op over positions)")
        keep_at = 3 if key in P_FIRST or key in STD_LIKE else 2
        keep = key in CUMULATIVE or (args[keep_at] if len(args) > keep_at else kwargs.get("keepdim", False))
        result = Positions(tuple((d if keep else d - sum(r < d for r in dims), role) for d, role in tag.dims))
        return tuple(result for _ in value) if isinstance(value, tuple) else result
