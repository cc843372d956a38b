"""A call's micro-batches cut into slices of their sequence, which the stages run one after another, and the outputs joined again.

    rows (micro-batches)    slices, run as micro-batches in this order
    row 0                   0: [0, 4)   1: [4, 8)   2: [8, 12)
    row 1                   3: [0, 4)   4: [4, 8)   5: [8, 12)

Every schedule runs a row's forwards in this order and its backwards in the reverse one
(`by_rows` in fxpipe/schedules/actions.py): a slice's forward finds the keys and values its row's
earlier slice carried (on the same stage), and its backward the gradients of what it carried,
from the later slice's backward (fxpipe/runtime/tasks.py, fxpipe/runtime/backward_tasks.py).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from fxpipe.core.microbatch import leaves_of
from fxpipe.runtime.gather import Gathered
from fxpipe.schedules.slices import SliceSpec


class SliceGrid:
    """The slices of a call's micro-batches (`rows`), as `spec` cuts them."""

    def __init__(self, rows: Sequence[dict[str, Any]], spec: SliceSpec) -> None:
        self.spec, self.rows, self.rows_values = spec, len(rows), list(rows)
        self.length = _length(rows[0], spec)
        if isinstance(spec.chunks, int) and spec.chunks > self.length:
            raise ValueError(
                f"this call's sequence has {self.length} positions, fewer than the sequence_chunks={spec.chunks} slices "
                f"each sequence is cut into.\nHow to fix: give sequences of {spec.chunks} positions or more, or compile "
                "with sequence_chunks='auto', which cuts each length its own way."
            )
        self.lengths = spec.lengths(self.length)
        self.starts = [sum(self.lengths[:k]) for k in range(len(self.lengths))]
        self.micro_batches = [
            {name: self._cut(name, value, start, size) for name, value in row.items()}
            for row in rows for start, size in zip(self.starts, self.lengths)
        ]  # fmt: skip

    @property
    def per_row(self) -> int:
        return len(self.lengths)

    def offset(self, i: int) -> int:
        """Where micro-batch `i` starts in its sequence."""
        return self.starts[i % self.per_row]

    def last(self, i: int) -> bool:
        return i % self.per_row == self.per_row - 1

    def _cut(self, name: str, value: Any, start: int, size: int) -> Any:
        dim = self.spec.inputs.get(name)
        if dim is None or not isinstance(value, torch.Tensor):
            return value
        return value.narrow(dim, start, size)

    def join(self, per_slice: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each row's outputs: its slices' joined along the sequence's dim of each leaf."""
        rows = []
        for r in range(self.rows):
            parts = per_slice[r * self.per_row : (r + 1) * self.per_row]
            rows.append({name: self._joined(name, [p[name] for p in parts]) for name in parts[0]})
        return rows

    def _dim(self, name: str, leaf: int) -> Optional[int]:
        """The sequence's dim in leaf `leaf` of output value `name` (None: it holds none)."""
        dims = self.spec.outputs.get(name, ())
        return dims[leaf] if leaf < len(dims) else None

    def _joined(self, name: str, parts: list[Any]) -> Any:
        flats = [tree_flatten(p) for p in parts]
        leaves = []
        for k in range(len(flats[0][0])):
            dim = self._dim(name, k)
            pieces = [f[0][k] for f in flats]
            leaves.append(torch.cat(pieces, dim) if dim is not None and isinstance(pieces[0], torch.Tensor) else pieces[0])
        return tree_unflatten(leaves, flats[0][1])

    def split(self, per_row: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each row's output gradients, cut into its slices'."""
        out: list[dict[str, Any]] = []
        for grads in per_row:
            for start, size in zip(self.starts, self.lengths):
                out.append({name: self._sliced_grad(name, g, start, size) for name, g in grads.items()})
        return out

    def _sliced_grad(self, name: str, grad: Any, start: int, size: int) -> Any:
        leaves, spec = tree_flatten(grad)
        cut = []
        for k, g in enumerate(leaves):
            dim = self._dim(name, k)
            cut.append(g.narrow(dim, start, size) if isinstance(g, torch.Tensor) and dim is not None else g)
        return tree_unflatten(cut, spec)

    def join_input_grads(self, per_slice: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each row's input gradients from its slices': joined along the sequence's dim where the
        input was cut (zeros for a slice that gave none), summed where every slice read it whole."""
        rows = []
        for r in range(self.rows):
            first = r * self.per_row
            names = {name for grads in per_slice[first : first + self.per_row] for name in grads}
            rows.append({name: self._joined_grad(name, first, per_slice) for name in names})
        return rows

    def _joined_grad(self, name: str, first: int, per_slice: Sequence[dict[str, Any]]) -> Any:
        parts = [per_slice[first + k].get(name) for k in range(self.per_row)]
        dim = self.spec.inputs.get(name)
        if dim is None:  # read whole by every slice
            found = [p for p in parts if p is not None]
            return tree_map(lambda *leaves: sum(leaves[1:], leaves[0]), *found) if found else None
        if all(p is None for p in parts):
            return None
        pieces = [
            p if p is not None else tree_map(lambda t: torch.zeros_like(t) if isinstance(t, torch.Tensor) else t, self.micro_batches[first + k][name])
            for k, p in enumerate(parts)
        ]  # fmt: skip
        return tree_map(lambda *leaves: torch.cat(leaves, dim), *pieces)

    def targets(self, rows: Sequence[Any]) -> list[Any]:
        """Each row's target (of a train step), cut into its slices' along the sequence's dim."""
        return [tree_map(lambda t: self._target_piece(t, start, size), target) for target in rows for start, size in zip(self.starts, self.lengths)]

    def _target_piece(self, t: Any, start: int, size: int) -> Any:
        d = self.spec.dim
        if not isinstance(t, torch.Tensor) or t.dim() <= d or t.shape[d] != self.length:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"with sequence_chunks, each slice's loss takes its positions of the target, and the target {shape} "
                f"does not hold the sequence ({self.length} positions) along dim {d}.\nHow to fix: give a target per "
                f"position (next-token labels), its positions along dim {d} as the inputs' (sequence_dim), or train with "
                "loss = loss_fn(pipe(x), y); loss.backward()."
            )
        return t.narrow(d, start, size)

    def weights(self, rows: Sequence[float], reduction: str) -> list[float]:
        """Each slice's weight in the batch's loss: its row's, times its share of the positions
        for a mean (a mean over positions combines so), the row's for a sum."""
        return [w * (size / self.length if reduction == "mean" else 1.0) for w in rows for size in self.lengths]

    def gathered(self, rows: Gathered) -> Gathered:
        """The rows' outputs, gathered: their gradients go back to the slices."""
        return _SlicedGathered(rows, self)


class _SlicedGathered(Gathered):
    """The rows' outputs gathered; their gradients routed to the rows, then cut into slices."""

    def __init__(self, rows: Gathered, grid: SliceGrid) -> None:  # takes the rows' state, made already
        self.__dict__.update(rows.__dict__)
        self.grid = grid

    def route(self, grads: Sequence[Optional[torch.Tensor]]) -> list[dict[str, Any]]:
        return self.grid.split(super().route(grads))


def _length(row: dict[str, Any], spec: SliceSpec) -> int:
    """The sequence's length in a call: that of the first input that holds it."""
    for name, dim in spec.inputs.items():
        for t in leaves_of(row.get(name)):
            if isinstance(t, torch.Tensor) and t.dim() > dim:
                return int(t.shape[dim])
    raise ValueError(f"sequence_chunks: no input of this call holds the sequence (inputs {', '.join(spec.inputs)})")
