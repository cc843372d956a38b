"""Manipulation of micro-batches: splitting a batch into them and putting their outputs back together."""
from __future__ import annotations

import inspect
from typing import Any, Iterator, NamedTuple, Optional, Sequence, Union

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map, tree_unflatten


# How the caller asked to split particular input tensors, by `id`: along a dim, or None (whole).
Dims = dict[int, Optional[int]]

# Where the batch lies in an output leaf (passes/batch_dims.py): a dim, one of these, or None
# (not known: the rule of `gather_leaf` decides).
SAME = "same"  # equal in every micro-batch: the first micro-batch's is returned
VARIES = "varies"  # made from the whole batch (a loss, x.mean(0)): the micro-batches' cannot be put together
BatchDim = Union[int, str, None]


def forward_signature(model: Any) -> Optional[inspect.Signature]:
    """The signature of the model's forward, to find arguments by name (None if it has none)."""
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError, AttributeError):
        return None


def spec_dims(signature: Optional[inspect.Signature], spec: dict[str, Optional[int]], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Dims:
    """How to split each input tensor that the chunk spec names, keyed by the tensor's id."""
    if not spec or signature is None:
        return {}
    try:
        bound = signature.bind(*args, **kwargs).arguments
    except TypeError:
        return {}
    dims: Dims = {}
    for name, dim in spec.items():
        for leaf in tree_flatten(bound.get(name))[0]:
            if isinstance(leaf, torch.Tensor):
                dims[id(leaf)] = dim
    return dims


class ExampleLeaf(NamedTuple):
    """A tensor leaf of an input as the example gave it."""

    ndim: int
    whole: bool  # it went whole to every micro-batch
    # Whole, of size 1 in the batch's dim (0, or the one chunk_spec names) where the batch was
    # larger: broadcast against it. That dim, or None.
    broadcast: Optional[int] = None


# Per input, for each of its leaves as the example gave it; None for what is not a tensor.
ExampleLeaves = dict[str, tuple[Optional[ExampleLeaf], ...]]


def example_leaves(values: dict[str, Any], dims: Dims) -> ExampleLeaves:
    """For each input, its tensor leaves' dims and whether they go whole to every micro-batch."""
    batch = batch_size_of(list(values.values()), dims)
    found = {}
    for name, value in values.items():
        leaves = tree_flatten(value)[0]
        found[name] = tuple(_example_leaf(t, batch, dims) if isinstance(t, torch.Tensor) else None for t in leaves)
    return found


def _example_leaf(t: torch.Tensor, batch: Optional[int], dims: Dims) -> ExampleLeaf:
    whole = batch is None or split_dim(t, batch, dims) is None
    named = {dim for dim in dims.values() if dim is not None}
    along = named.pop() if len(named) == 1 else 0  # the batch's dim, where chunk_spec names one for all
    broadcast = whole and batch is not None and batch > 1 and t.dim() > along and t.shape[along] == 1 and id(t) not in dims
    return ExampleLeaf(t.dim(), whole, along if broadcast else None)


def kept_whole(values: dict[str, Any], example: ExampleLeaves, dims: Dims) -> Dims:
    """`dims`, with every tensor leaf that the example kept whole, and that has as many dims as
    the example's, kept whole again: its dim 0 may now equal the batch size by chance (a table
    of positions, or a (T, T) mask, at a batch as long as the sequence; its sizes follow the
    sequence length, so they need not be the example's). But a leaf the example gave with dim 0
    of 1, broadcast against the batch (a mask of (1, T)), that now has more: per sample, as the
    plain model broadcasts it, it is split (or refused) by the batch rule, or along the dim
    chunk_spec names for the inputs that hold the batch."""
    found = dict(dims)
    for name, leaf, seen in _known_leaves(values, example):
        if not seen.whole or seen.ndim != leaf.dim() or id(leaf) in found:
            continue
        if seen.broadcast is None or leaf.shape[seen.broadcast] == 1:
            found[id(leaf)] = None
        elif seen.broadcast:  # along the dim chunk_spec names for the others, as they are
            found[id(leaf)] = seen.broadcast
    return found


def fewer_dims(values: dict[str, Any], example: ExampleLeaves) -> list[str]:
    """The inputs with a tensor that the example split into micro-batches and that now has fewer
    dims than the example's: a sample without its batch dim, whose features would be split."""
    return [
        f"{name} {tuple(leaf.shape)} (the example's had {ndim} dims)"
        for name, leaf, (ndim, whole, _) in _known_leaves(values, example) if not whole and leaf.dim() < ndim
    ]  # fmt: skip


def off_batch(values: dict[str, Any], example: ExampleLeaves, batch: int, dims: Dims) -> list[str]:
    """The inputs with a tensor that the example split into micro-batches, or gave with dim 0 of
    1 broadcast against the batch, and whose dim 0 is now neither the batch size nor 1: kept
    whole, each micro-batch would broadcast against all of it, where the plain model broadcasts
    the batch against it (or refuses the sizes)."""
    return [
        f"{name} {tuple(leaf.shape)}{' (1 there in the example)' if whole else ''}"
        for name, leaf, (ndim, whole, broadcast) in _known_leaves(values, example)
        if (not whole or broadcast == 0) and id(leaf) not in dims and leaf.dim() == ndim and leaf.dim() > 0 and leaf.shape[0] not in (batch, 1)
    ]


def _known_leaves(values: dict[str, Any], example: ExampleLeaves) -> Iterator[tuple[str, torch.Tensor, ExampleLeaf]]:
    """(input name, tensor leaf, what the example's leaf was) where both are tensors, for inputs
    of the example's structure (another structure: the batch rule decides)."""
    for name, value in values.items():
        leaves = tree_flatten(value)[0]
        known = example.get(name)
        if known is None or len(known) != len(leaves):
            continue
        for leaf, seen in zip(leaves, known):
            if isinstance(leaf, torch.Tensor) and seen is not None:
                yield name, leaf, seen


def is_batched(value: Any, batch_size: int) -> bool:
    """A tensor is split across micro-batches when its first dimension is the batch."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch_size


def split_dim(t: torch.Tensor, batch_size: int, dims: Dims) -> Optional[int]:
    """The dim `t` is split along: as the caller asked, else 0 when dim 0 is the batch."""
    if id(t) in dims:
        return dims[id(t)]
    return 0 if is_batched(t, batch_size) else None


def batch_dim_of(values: Sequence[Any], dims: Optional[Dims] = None) -> int:
    """The dim the first input tensor is split along (see `batch_size_of`): 0 but where a chunk
    spec names another."""
    dims = dims or {}
    for t in tree_flatten(list(values))[0]:
        if isinstance(t, torch.Tensor):
            dim = dims.get(id(t), 0 if t.dim() > 0 else None)
            if dim is not None:
                return dim
    return 0


def batch_size_of(values: Sequence[Any], dims: Optional[Dims] = None) -> Optional[int]:
    """The batch size: the size of the first input tensor along the dim it is split along
    (dim 0 unless `dims` says otherwise; tensors kept whole do not count)."""
    dims = dims or {}
    leaves, _ = tree_flatten(list(values))
    for t in leaves:
        if isinstance(t, torch.Tensor):
            dim = dims.get(id(t), 0 if t.dim() > 0 else None)
            if dim is not None:
                return t.shape[dim]
    return None


def is_one_sample(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call holds one sample, as the front ends count it (its first batched tensor's dim 0)."""
    return batch_size_of([*args, *kwargs.values()]) == 1


def split_sizes(batch_size: int, chunks: int) -> list[int]:
    """Micro-batch sizes as `torch.tensor_split` makes them: uneven allowed, none empty."""
    base, extra = divmod(batch_size, chunks)
    sizes = [base + 1] * extra + [base] * (chunks - extra)
    return [s for s in sizes if s > 0]


def scatter(value: Any, sizes: Sequence[int], batch_size: int, dims: Optional[Dims] = None) -> list[Any]:
    """One copy of `value` per micro-batch; batched tensors are split, the rest is shared.

    A tensor split by the batch rule is cut into `sizes`; one the caller named a dim for is cut
    into as many even pieces along it (`torch.tensor_split`), whatever its size there: views of
    the caller's tensor, which a forward that writes its input writes through (a slice along
    dim 1 is not contiguous: `x.view(...)` on it fails, `x.reshape(...)` runs).
    """
    dims = dims or {}
    leaves, spec = flatten(value)
    pieces: list[Sequence[Any]] = []
    for t in leaves:
        dim = split_dim(t, batch_size, dims) if isinstance(t, torch.Tensor) else None
        if dim is None or (len(sizes) == 1 and t.layout != torch.strided):  # (a sparse one, whole: split has no kernel)
            pieces.append([t] * len(sizes))
        elif t.layout != torch.strided:
            raise ValueError(
                f"an input that holds the batch is a {str(t.layout).removeprefix('torch.')} tensor of shape {tuple(t.shape)}, "
                "which cannot be split into micro-batches.\nHow to fix: pass it dense (x.to_dense()); or keep it whole "
                "(chunk_spec={name: None}) if every sample reads all of it; or use chunks=1."
            )
        elif id(t) not in dims:
            pieces.append(t.split(list(sizes)))
        elif t.shape[dim] < len(sizes):
            raise ValueError(
                f"an input split along dim {dim} has size {t.shape[dim]} there, fewer than the "
                f"{len(sizes)} micro-batches.\nHow to fix: use fewer chunks, or keep it whole "
                "(chunk_spec={name: None})."
            )
        else:
            pieces.append(torch.tensor_split(t, len(sizes), dim))
    return [unflatten([p[i] for p in pieces], spec) for i in range(len(sizes))]


def gather_leaf(parts: Sequence[Any], sizes: Optional[Sequence[int]], dim: BatchDim = None) -> Any:
    """Put one output back together: along the output's batch `dim` when compiling found it,
    else along dim 0, which must be the micro-batch's (unless `sizes` is None: the caller split
    inputs by a chunk spec, and outputs follow its sizes); with one micro-batch the output is as
    it is."""
    first = parts[0]
    if not isinstance(first, torch.Tensor):
        if dim == VARIES or any(not _same_constant(p, first) for p in parts[1:]):
            raise ValueError(
                f"the model returns a value that is not a tensor and depends on the batch (the micro-batches "
                f"gave {', '.join(repr(p) for p in parts)}: a size of the batch, or one entry of a list of "
                "per-sample values (.tolist())?), and the plain model's cannot be made from them.\nHow to fix: "
                "return it as a tensor with one entry per sample, compute it outside the pipeline, or use chunks=1."
            )
        return first
    if len(parts) == 1 or dim == SAME:
        return first.detach()
    along = dim if isinstance(dim, int) else 0
    _refuse_other_sizes(parts, along)
    if isinstance(dim, int):
        return joined(parts, dim)
    if first.dim() == 0:
        raise ValueError(
            "the model returns a 0-dim tensor (a loss or a scalar?), and outputs are concatenated "
            "from the micro-batches along dim 0.\nHow to fix: train with pipe.train_step(...), which "
            "combines the micro-batches' losses; or return per-sample values and reduce them outside "
            "the pipeline; or use chunks=1."
        )
    shapes = [tuple(p.shape) for p in parts]
    if dim == VARIES:
        raise ValueError(
            f"the model returns a tensor made from the whole batch (not one row per sample: micro-batches "
            f"gave shapes {shapes}, and compiling saw it differ between them), so the plain model's "
            "cannot be made from the micro-batches'.\nHow to fix: return per-sample values (batch first) "
            "and reduce them outside the pipeline, or use chunks=1."
        )
    if sizes is not None and any(p.shape[0] != size for p, size in zip(parts, sizes)):
        raise ValueError(
            f"the model returns a tensor whose dim 0 is not the batch (micro-batches of {list(sizes)} "
            f"gave shapes {shapes}), so the micro-batches' outputs cannot be concatenated into the "
            "plain model's.\nHow to fix: return per-sample values (batch first) and reduce them "
            "outside the pipeline, or use chunks=1."
        )
    return joined(parts, 0)


def joined(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """`torch.cat` of the micro-batches' pieces outside the caller's autocast, which would cast
    them (and refuses pieces of another low precision than its own: a float16 output under
    bfloat16): put together, they keep the dtype the model gave them."""
    device = parts[0].device.type
    if torch.is_autocast_enabled(device):
        with torch.autocast(device, enabled=False):
            return torch.cat(list(parts), dim)
    return torch.cat(list(parts), dim)


def _refuse_other_sizes(parts: Sequence[torch.Tensor], along: int) -> None:
    """Micro-batches' outputs that differ in a dim besides the batch's (a model that trims
    padding to the longest sequence in its batch) cannot be put together into one tensor."""
    shapes = [tuple(p.shape) for p in parts]
    if len({len(shape) for shape in shapes}) == 1 and len(shapes[0]) > along:
        others = {shape[:along] + shape[along + 1 :] for shape in shapes}
        if len(others) == 1:
            return
        differ = [d for d in range(len(shapes[0])) if d != along and len({shape[d] for shape in shapes}) > 1]
        raise ValueError(
            f"the micro-batches' outputs differ in dim {', '.join(map(str, differ))} besides the batch's (dim {along}): "
            f"shapes {shapes}, which no tensor of the whole batch holds: does the model size its output by its batch "
            "(padding trimmed to the longest sequence in it, say)?\nHow to fix: pad to a fixed length (the tokenizer's "
            "padding='max_length'), return per-sample values of one size, or use chunks=1."
        )


def split_along(dim: BatchDim) -> Optional[int]:
    """The dim a gathered output's gradient is split along into the micro-batches' (None: the
    gradient goes whole to the first micro-batch, whose output was returned)."""
    if dim == SAME:
        return None
    return dim if isinstance(dim, int) else 0


def _same_constant(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - a value whose == does not give a bool: take it as the same
        return True


def gather_grads(parts: Sequence[Optional[torch.Tensor]], like: Sequence[torch.Tensor], dim: Optional[int]) -> Optional[torch.Tensor]:
    """The gradient of one input from the gradients of its micro-batch pieces.

    A split input's gradient is the concatenation along its split `dim`; a whole one's is the
    sum. A piece that got no gradient counts as zeros.
    """
    if all(p is None for p in parts):
        return None
    filled = [p if p is not None else torch.zeros_like(piece) for p, piece in zip(parts, like)]
    if dim is not None:
        return joined(filled, dim)
    total = filled[0].clone()
    for p in filled[1:]:
        total += p
    return total


def map_tensors(fn: Any, value: Any) -> Any:
    """Apply `fn` to every tensor in a nested value, leaving everything else as it is."""
    if isinstance(value, torch.Tensor):  # the common case, without a pytree walk
        return fn(value)
    if isinstance(value, torch.Size):  # no tensor in it, and pytree would make it a tuple
        return value
    return tree_map(lambda v: fn(v) if isinstance(v, torch.Tensor) else v, value)


def flatten(value: Any) -> tuple[list[Any], Optional[TreeSpec]]:
    """`tree_flatten`, where a tensor is its own leaf with None for a spec: the common case, once
    per micro-batch and value, without a pytree walk."""
    return ([value], None) if isinstance(value, torch.Tensor) else tree_flatten(value)


def unflatten(leaves: list[Any], spec: Optional[TreeSpec]) -> Any:
    """What `flatten` took apart, put back together; a torch.Size as one (pytree makes it a tuple)."""
    if spec is None:
        return leaves[0]
    value = tree_unflatten(leaves, spec)
    return torch.Size(value) if spec.type is torch.Size else value


def takes_gradients(t: torch.Tensor) -> bool:
    """Whether a tensor's dtype can carry a gradient: a floating or a complex one."""
    return t.is_floating_point() or t.is_complex()


def leaves_of(value: Any) -> list[Any]:
    """The leaves of a nested value (a tensor is its own only leaf)."""
    return flatten(value)[0]


def clone_tree(value: Any) -> Any:
    """A copy of every tensor in a (nested) value: a stage's own copy of an input it writes."""
    return map_tensors(torch.Tensor.clone, value)
