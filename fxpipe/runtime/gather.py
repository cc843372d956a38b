"""Putting the micro-batches' outputs back into the model's output, and splitting gradients back."""
from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch.utils._pytree import MappingKey, keystr, register_pytree_node, tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten

from fxpipe.core.microbatch import BatchDim, flatten, gather_leaf, split_along, unflatten
from fxpipe.runtime.aliases import output_aliases, realiased


@dataclass(frozen=True)
class ValueRef:
    """A leaf of the output structure that is a value of the graph: a stage's output (gathered
    from the micro-batches), or a value `given` whole (an input, a module attribute). `dims`:
    where the batch lies in each of its leaves, as compiling found it (None: not known)."""

    name: str
    given: bool
    dims: Optional[tuple[BatchDim, ...]] = None

    def dim(self, leaf: int) -> BatchDim:
        return self.dims[leaf] if self.dims is not None and leaf < len(self.dims) else None


def _path_of(template: Any, ref: ValueRef, value: Any, leaf: int) -> str:
    """Where leaf `leaf` of `ref`'s value is in the model's output (`['logits']`, `[1]`), for messages."""
    outer = next((keystr(path) for path, found in tree_flatten_with_path(template)[0] if found == ref), "")
    inner = tree_flatten_with_path(value)[0]
    return outer + (keystr(inner[leaf][0]) if leaf < len(inner) else "")


def output_batch_dims(template: Any) -> frozenset[int]:
    """The dims the outputs of a program hold their batch in, as compiling found them."""
    return frozenset(d for dims in output_batch_dims_by_path(template).values() for leaf in dims for d in leaf)


def output_batch_dims_by_path(template: Any) -> dict[str, tuple[frozenset[int], ...]]:
    """Where each output value holds the batch, by its path in the outputs (`keystr`): a dim, or
    none, for each of its leaves (an RNN's `(output, state)` as one value: two). A target of the
    outputs' structure splits each leaf as its output holds the batch."""
    return {
        keystr(path): tuple(frozenset([d]) if isinstance(d, int) and not isinstance(d, bool) else frozenset() for d in leaf.dims or ())
        for path, leaf in tree_flatten_with_path(template)[0] if isinstance(leaf, ValueRef)
    }  # fmt: skip


class DataclassOutput(dict):  # type: ignore[type-arg]
    """In an output's structure, a dataclass the model returns that pytree does not know (its own
    output type): its fields by name, a pytree node of fxpipe's own (the model's type is never
    registered), made the dataclass again by `as_returned`."""

    def __init__(self, kind: type, fields: dict[str, Any]) -> None:
        super().__init__(fields)
        self.kind = kind


register_pytree_node(
    DataclassOutput,
    lambda d: (list(d.values()), (d.kind, list(d))),
    lambda values, context: DataclassOutput(context[0], dict(zip(context[1], values))),
    flatten_with_keys_fn=lambda d: ([(MappingKey(k), v) for k, v in d.items()], (d.kind, list(d))),
)


def as_returned(value: Any) -> Any:
    """`value` with each DataclassOutput made the model's dataclass again: its fields that
    `__init__` takes passed to it, the others set after."""
    if isinstance(value, DataclassOutput):
        fields = {name: as_returned(v) for name, v in value.items()}
        init = {f.name for f in dataclasses.fields(value.kind) if f.init}
        made = value.kind(**{k: v for k, v in fields.items() if k in init})
        for name, v in fields.items():
            if name not in init:
                object.__setattr__(made, name, v)
        return made
    if type(value) in (list, tuple):
        return type(value)(as_returned(v) for v in value)
    if type(value) in (dict, collections.OrderedDict):
        return type(value)((key, as_returned(v)) for key, v in value.items())
    return value


class Gathered:
    """The outputs of every micro-batch, concatenated along their batch dims (dim 0 unless
    compiling found another).

    `tensors` are the gathered tensors in a fixed order; `rebuild(tensors)` puts (autograd's
    versions of) them into the model's output structure, once, and lets go of them (autograd's
    nodes hold this object: holding their outputs too would make a cycle through C++ that the
    garbage collector cannot see); `route(grads)` splits their gradients into per-micro-batch
    gradients of each value.
    """

    def __init__(
        self, template: Any, per_micro_batch: Sequence[dict[str, Any]], given: dict[str, Any], sizes: Sequence[int], checked: bool = True
    ) -> None:
        self.template = template
        self.values: dict[str, tuple[list[Any], Any]] = {}
        self.tensors: list[torch.Tensor] = []
        # value, leaf index, the dim its gradient splits along (None: whole to the first), sizes
        self.slots: list[tuple[str, int, Optional[int], list[int]]] = []
        refs = [leaf for leaf in tree_flatten(template)[0] if isinstance(leaf, ValueRef)]
        parts_of: list[list[torch.Tensor]] = []  # each gathered tensor's micro-batch parts, for `aliases`
        for ref in dict.fromkeys(refs):
            if ref.given:
                self.values[ref.name] = flatten(given[ref.name])
                continue
            flats = [flatten(mb[ref.name]) for mb in per_micro_batch]
            leaves = []
            for k in range(len(flats[0][0])):
                parts = [flat[0][k] for flat in flats]
                try:
                    leaf = gather_leaf(parts, sizes if checked else None, ref.dim(k))
                except ValueError as error:
                    error.add_note(f"(It is the model's output{_path_of(template, ref, per_micro_batch[0][ref.name], k)}.)")
                    raise
                if isinstance(leaf, torch.Tensor):
                    along = split_along(ref.dim(k))
                    self.tensors.append(leaf)
                    self.slots.append((ref.name, k, along, [p.shape[along] if p.dim() and along is not None else 1 for p in parts]))
                    parts_of.append(parts)
                leaves.append(leaf)
            self.values[ref.name] = (leaves, flats[0][1])
        self.micro_batches = len(per_micro_batch)
        along_of = [along for _, _, along, _ in self.slots]
        self.aliases = output_aliases(parts_of, along_of, [t.shape for t in self.tensors]) if len(self.tensors) > 1 else []

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Any:
        values = {name: list(leaves) for name, (leaves, _) in self.values.items()}
        for (name, k, _, _), tensor in zip(self.slots, realiased(tensors, self.aliases)):
            values[name][k] = tensor
        built = {name: unflatten(values[name], spec) for name, (_, spec) in self.values.items()}
        self.tensors = []
        self.values = {name: ([None] * len(leaves), spec) for name, (leaves, spec) in self.values.items()}
        return as_returned(tree_map(lambda leaf: built[leaf.name] if isinstance(leaf, ValueRef) else leaf, self.template))

    def route(self, grads: Sequence[Optional[torch.Tensor]]) -> list[dict[str, Any]]:
        per_value: list[dict[str, list[Optional[torch.Tensor]]]] = [{} for _ in range(self.micro_batches)]
        for (name, k, along, sizes), grad in zip(self.slots, grads):
            if grad is None:
                continue
            if self.micro_batches == 1:
                pieces: Sequence[Optional[torch.Tensor]] = [grad]
            elif along is None:  # returned as the first micro-batch's
                pieces = [grad] + [None] * (self.micro_batches - 1)
            else:  # (a contiguous gradient's pieces contiguous too: its backward meets the plain model's layout)
                cut = grad.split(sizes, along)
                pieces = [p.contiguous() for p in cut] if along and grad.is_contiguous() else cut
            for i, piece in enumerate(pieces):
                leaves = per_value[i].setdefault(name, [None] * len(self.values[name][0]))
                leaves[k] = piece  # each (value, leaf) is one slot: refs were deduplicated
        return [
            {name: unflatten(leaves, self.values[name][1]) for name, leaves in mb.items()} for mb in per_value
        ]
