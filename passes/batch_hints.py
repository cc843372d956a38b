"""Why a model that runs on the whole example fails or differs on its micro-batches: lines naming the likely cause in the inputs, buffers or parameters, each with its fix."""
from __future__ import annotations

from typing import Any, Collection, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.core.attrs import fetch_attr
from fxpipe.core.microbatch import Dims, split_dim
from fxpipe.core.snapshot import preserved
from fxpipe.passes.example_runs import ExampleRunner, cloned, drawing_or_normalising
from fxpipe.passes.state import RENORMS, parameters_written


def failing_part_message(gm: fx.GraphModule, inputs: tuple[Any, ...], batch: int, chunks: int, dims: Dims, error: Exception) -> str:
    """The model runs on the whole example and fails on a part of it: say so, and name the inputs
    kept whole that have a dim of the batch's size (an LSTM's initial state holds the batch on
    dim 1, say), with the chunk_spec that would split them there."""
    names = [n.meta.get("argument", n.name) for n in gm.graph.nodes if n.op == "placeholder"]
    hints: dict[str, Optional[int]] = {}
    shapes: dict[str, str] = {}
    for name, value in zip(names, inputs):
        # A tensor, or a tuple of them (an LSTM's `(h0, c0)`): where each has the batch's size.
        tensors = [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
        if not tensors or any(split_dim(t, batch, dims) is not None for t in tensors):
            continue
        at = set.intersection(*({d for d in range(t.dim()) if t.shape[d] == batch} for t in tensors))
        if at:
            hints[name] = min(at)
            shapes[name] = ", ".join(str(tuple(t.shape)) for t in tensors)
    hint = (
        f"These inputs are passed whole to every micro-batch, and have a dim of the batch's size {batch}: "
        f"{', '.join(f'{n} {shapes[n]}' for n in hints)}. If that dim holds "
        f"their batch, split them there: chunk_spec={hints!r}.\n" if hints else ""
    )
    hint = _first_may_be_shared(names, inputs, batch, dims) + hint + _between_samples(names, inputs, batch)
    hint += split_for_their_size(gm, inputs, batch, dims, named=hints) + _batch_read_from(names, inputs, batch, dims) + _state_of_the_batch_size(gm, batch)
    if "view size is not compatible with input tensor's size and stride" in str(error) and any(d not in (None, 0) for d in dims.values()):
        hint += (
            "A micro-batch of an input cut along a dim other than 0 is a slice of it, not contiguous, which "
            "x.view(...) refuses: use x.reshape(...) there (or x.contiguous().view(...)).\n"
        )
    if isinstance(error, IndexError) or "out of bounds" in str(error) or "index out of range" in str(error):
        hint += (
            "An index out of range on a part of the batch: an input may hold indices into the batch (a box's image "
            "index, as roi_align's boxes do in their first column), which a micro-batch's own rows cannot "
            "follow, split or whole: use chunks=1 for such a model.\n"
        )
    return (
        f"with chunks={chunks} the micro-batches cannot run: the model runs on the whole example ({batch} "
        f"samples) and fails on a part of it: {type(error).__name__}: {str(error).strip().splitlines()[0]}\n{hint}"
        "How to fix: split every input that holds the batch along its batch dim (chunk_spec={name: dim}), "
        "or use chunks=1."
    )


def _between_samples(names: list[str], inputs: tuple[Any, ...], batch: int) -> str:
    """A line naming the inputs with the batch's size on two dims or more: a matrix between the
    samples (a graph's adjacency over its nodes), which makes each sample read the others."""
    square = [f"{name} {tuple(value.shape)}" for name, value in zip(names, inputs)
              if isinstance(value, torch.Tensor) and sum(size == batch for size in value.shape) >= 2]  # fmt: skip
    return (
        f"These inputs have the batch's size {batch} on two dims: {', '.join(square)}. If one is a matrix between the "
        "samples (a graph's adjacency over its nodes, an affinity), each sample reads the others, which no split "
        "into micro-batches computes, split or whole: such a model runs with chunks=1.\n" if square else ""
    )


def _first_may_be_shared(names: list[str], inputs: tuple[Any, ...], batch: int, dims: Dims) -> str:
    """A line saying where the batch's size was read, dim 0 of the first input chunk_spec does not
    name, when another input has more dims or another size there: a table every sample shares
    (positions) passed first, whose split the other inputs' sizes then follow; '' otherwise."""
    tensors = [(name, value) for name, value in zip(names, inputs) if isinstance(value, torch.Tensor) and value.dim() > 0]
    if len(tensors) < 2 or id(tensors[0][1]) in dims:
        return ""
    first, value = tensors[0]
    if not any(t.dim() > value.dim() or (id(t) not in dims and t.shape[0] != batch) for _, t in tensors[1:]):
        return ""
    return (f"The batch's size, {batch}, is read from the first input, {first} {tuple(value.shape)}, along dim 0. If "
            f"{first} holds no batch (a table every sample shares), keep it whole: chunk_spec={{{first!r}: None}}.\n")


def _state_of_the_batch_size(gm: fx.GraphModule, batch: int) -> str:
    """A line naming the buffers the graph reads that have a dim of the batch's size (an RNN's
    state kept between calls, one row per sample), which micro-batches cannot split; '' if none."""
    read = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    found = {name: tuple(b.shape) for name, b in gm.named_buffers() if name in read and batch in b.shape} if batch > 1 else {}
    if not found:
        return ""
    return (f"These buffers the model holds have a dim of the batch's size {batch}: "
            f"{', '.join(f'{name} {shape}' for name, shape in found.items())}. State kept per sample (an RNN's, carried "
            "between calls) cannot be split into micro-batches: pass it as an input, split with chunk_spec={name: dim}, "
            "or use chunks=1.\n")


def _batch_read_from(names: list[str], inputs: tuple[Any, ...], batch: int, dims: Dims) -> str:
    """Where the batch's size was read (dim 0 of the first input chunk_spec does not name), when
    chunk_spec names inputs whose dims have another size: a line with the dim of that first input
    that has theirs (a sequence-first input holds the batch on dim 1); '' otherwise."""
    tensors = [(name, value) for name, value in zip(names, inputs) if isinstance(value, torch.Tensor) and value.dim() > 0]
    if not tensors or id(tensors[0][1]) in dims:
        return ""
    first, value = tensors[0]
    named = {name: (d, t.shape[d]) for name, t in tensors if isinstance(d := dims.get(id(t)), int)}
    others = {size for _, size in named.values() if size != batch}
    if not others:
        return ""
    size = others.pop()
    at = [d for d in range(1, value.dim()) if value.shape[d] == size]
    given = ", ".join(f"{name} along dim {d} ({n})" for name, (d, n) in named.items())
    fix = f" If {first} holds the batch on dim {at[0]}, name it too: chunk_spec={{..., {first!r}: {at[0]}}}." if at else ""
    return (f"The batch's size, {batch}, is that of {first} {tuple(value.shape)} along dim 0, which chunk_spec does not "
            f"name, while it splits {given}.{fix}\n")


def split_for_their_size(gm: fx.GraphModule, inputs: tuple[Any, ...], batch: int, dims: Dims, named: Collection[str] = ()) -> str:
    """A line naming the inputs after the first that are split along dim 0 only because it has
    the batch's size (a table every sample shares may, by chance), with the chunk_spec that
    passes them whole; '' when there are none. Inputs kept whole with a dim a multiple of the
    batch's size are named too, but for those `named` (already told of a dim of the batch's size)."""
    names = [n.meta.get("argument", n.name) for n in gm.graph.nodes if n.op == "placeholder"]
    tensors = [(name, value) for name, value in zip(names, inputs) if isinstance(value, torch.Tensor)]
    split = {name: None for name, value in tensors[1:] if id(value) not in dims and split_dim(value, batch, dims) == 0}
    # Kept whole, with a dim a multiple of the batch's size: per-sample parts in one dim (an
    # attention mask of (batch x heads, T, T)), which chunk_spec splits evenly.
    multiple = {name: d for name, value in tensors if split_dim(value, batch, dims) is None and batch > 1 and name not in named
                for d in [next((d for d, size in enumerate(value.shape) if size > batch and size % batch == 0), None)] if d is not None}  # fmt: skip
    shapes = {name: tuple(value.shape) for name, value in tensors}
    lines = _bags_by_offsets(gm)
    if split:
        lines += (
            f"These inputs are split along dim 0 as it has the batch's size {batch}: "
            f"{', '.join(f'{n} {shapes[n]}' for n in split)}. One that holds no batch (a mask or a table "
            f"that every sample shares) goes whole with chunk_spec={split!r}.\n"
        )
    if multiple:
        lines += (
            f"These inputs go whole to every micro-batch, with a dim a multiple of the batch's size {batch}: "
            f"{', '.join(f'{n} {shapes[n]} (dim {d})' for n, d in multiple.items())}. One that holds a part per sample "
            f"there (an attention mask of batch x heads) is split with chunk_spec={multiple!r}.\n"
        )
    return lines


def _bags_by_offsets(gm: fx.GraphModule) -> str:
    """A line saying that an EmbeddingBag given flat indices and offsets cannot be cut into
    micro-batches ('' where none is): its batch is the offsets' count, not any input's dim 0."""
    for node in gm.graph.nodes:
        module = fetch_attr(gm, str(node.target)) if node.op == "call_module" else None
        offsets = node.kwargs.get("offsets", node.args[1] if len(node.args) > 1 else None)
        bag = isinstance(module, nn.EmbeddingBag) or (node.op == "call_function" and node.target is F.embedding_bag)
        if bag and offsets is not None:
            return (
                f"{node.name} is an EmbeddingBag given flat indices and offsets: its bags cannot be cut into "
                "micro-batches along an input's dim 0; give it 2-D indices (batch, bag length; padded with "
                "padding_idx, or a per_sample_weights of 0), or use chunks=1.\n"
            )
    return ""


def written_parameters(gm: fx.GraphModule, inputs: tuple[Any, ...]) -> str:
    """Lines naming the parameters the graph's forward writes in place on `inputs`, with why
    micro-batches change them: an Embedding with max_norm renormalises the rows it looks up (what
    reads them after depends on which samples ran before); any other write (an average of other
    parameters, as a momentum encoder keeps) runs once per micro-batch, not once per batch.
    '' when it writes none."""
    before = {name: p.detach().clone() for name, p in gm.named_parameters()}
    try:
        with preserved(gm), torch.no_grad():
            ExampleRunner(gm, on_meta=False, keep=set(), fixed=drawing_or_normalising(gm)).run(*cloned(inputs))
            written = sorted(name for name, p in gm.named_parameters() if not torch.equal(p, before[name]))
    except Exception:  # noqa: BLE001 - it ran before; nothing more to say if not now
        return ""
    writers = parameters_written(gm, list(gm.graph.nodes))
    renormed = [name for name in written if name in writers and RENORMS in writers[name][1]]
    updated = [name for name in written if name not in renormed]
    lines = ""
    if renormed:
        lines += (f"Its forward renormalises these parameters in place: {', '.join(renormed)} (an Embedding with max_norm "
                  "renormalises the rows it looks up); what reads them after depends on the samples that ran before: "
                  "max_norm=None, or renormalise outside forward.\n")  # fmt: skip
    if updated:
        lines += (f"Its forward writes these parameters in place: {', '.join(updated)}; with chunks > 1 the write runs "
                  "once per micro-batch, not once per batch as in the plain model (an average of other parameters, "
                  "a momentum encoder's): make it outside forward, after optimizer.step(), or use chunks=1.\n")  # fmt: skip
    return lines
