"""Which dim of each output holds the batch, from the graph run on the example and on two parts of it.

Micro-batches compute what the whole batch does only when every sample is computed on its own.
The graph runs on the example, then on each of two parts of it (any split tells what the
micro-batches' would; `_parts` says which: 3 and 5 of 8 samples, for chunks=2), and each output
leaf gets:

    whole (8, 5)   parts (3, 5) (5, 5)   ->  dim 0: micro-batches' are concatenated along it
    whole (5, 8)   parts (5, 4) (5, 4)   ->  dim 1 (an input split along dim 1, into halves)
    whole (3,)     parts (3,) (3,)       ->  SAME, when each part's equals the whole's, bit for bit
    whole ()       parts () ()           ->  VARIES: made from the batch (a loss, x.mean(0))

When the concatenation differs from the whole example's output (`h / x.shape[0]`, `x - x.mean(0)`,
`torch.cumsum(x, 0)`), compiling is refused, naming the nodes where the difference starts. Random
ops draw fixed values and BatchNorm uses fixed statistics in these runs: they are per micro-batch
by design (README, "Limits worth knowing"). A model too large to run on the CPU at compile time
runs on the meta device, which gives the dims (not SAME from VARIES) and checks nothing; so does
a model whose forward writes its buffers, whose micro-batches compute as the plain model would
on them in turn (a value no split input reaches, which each part gives as the whole does, is
still SAME: made from parameters alone), for the outputs that depend on what it writes.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import keystr, tree_flatten_with_path

from fxpipe.core.attrs import fetch_attr
from fxpipe.core.microbatch import SAME, VARIES, BatchDim, Dims, batch_size_of, joined, scatter, split_dim, split_sizes
from fxpipe.core.own_loss import SUMMED_ON_EXAMPLE
from fxpipe.core.randomness import TORCH_NAMESPACES
from fxpipe.core.wording import listed
from fxpipe.core.writes import op_namespace
from fxpipe.passes.example_runs import DrawsOf, WholeRun, run_on, run_whole
from fxpipe.passes.random_ops import WHOLE_BATCH_DRAW, RandomSources, random_sources
from fxpipe.passes.shapes import small_on_cpu
from fxpipe.passes.sources import output_sources
from fxpipe.passes.state import statistics_written, writable_buffer_names
from fxpipe.passes.batch_hints import failing_part_message, split_for_their_size, written_parameters
from fxpipe.passes.summed_loss import summed_over_the_batch
from fxpipe.passes.validate import dense, source_line

# node.meta key: for each leaf of a returned value made from the whole batch, how it comes from
# the parts' (`_combines`): 'sum', 'mean', 'neither' or None; SUMMED_ON_EXAMPLE for a sum the
# graph does not make one on every batch (a sum divided by a count the model is given).
COMBINES = "combines"
# Relative difference (to the whole output's largest magnitude) taken as rounding, by dtype.
_ROUNDING = {torch.float64: 1e-9, torch.float32: 1e-3, torch.complex128: 1e-9, torch.complex64: 1e-3}
_LOW_PRECISION = 5e-2


# scale_grad_by_freq's position among each embedding function's arguments.
_FREQUENCY_ARGUMENT = {F.embedding: 5, F.embedding_bag: 5, torch.ops.aten.embedding.default: 3}


def _scales_by_frequency(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_module":
        module = fetch_attr(gm, str(node.target))
        return any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.scale_grad_by_freq for m in module.modules())
    position = _FREQUENCY_ARGUMENT.get(node.target) if node.op == "call_function" else None  # type: ignore[call-overload]
    if position is None:
        return False
    value = node.args[position] if position < len(node.args) else node.kwargs.get("scale_grad_by_freq", False)
    return value is not False


def _refuse_counts_across_the_batch(gm: fx.GraphModule, chunks: int) -> None:
    """An embedding with scale_grad_by_freq divides each row's gradient by how often its index
    occurs in the batch: the forward is per sample (the parts agree), the backward is not."""
    found = [str(n.target) if n.op == "call_module" else n.name for n in gm.graph.nodes if _scales_by_frequency(gm, n)]
    if found:
        raise ValueError(
            f"with chunks={chunks}, {'the embedding' if len(found) == 1 else 'the embeddings'} {', '.join(found)} "
            f"scale{'s' if len(found) == 1 else ''} each row's gradient by how often its index "
            "occurs in the batch (scale_grad_by_freq=True): each micro-batch would count its own indices, and the "
            "gradients would differ from the plain model's.\nHow to fix: scale_grad_by_freq=False, or chunks=1."
        )


# Why the check waits for a later call, where it is not for one sample or samples alike.
CHECK_DEFERRED = "batch_check_deferred"


def annotate_batch_dims(
    gm: fx.GraphModule, inputs: tuple[Any, ...], chunks: int, dims: Optional[Dims] = None, serves_eval: bool = False,
    defer_one_sample: bool = False, whole_run: Optional[WholeRun] = None,
) -> bool:
    """Write `node.meta["batch_dims"]` (a BatchDim per tensor leaf) on each node the graph
    returns; raises ValueError when two parts of the example compute otherwise than the whole
    example. Nothing is written with one micro-batch, or when the graph cannot run on the parts.
    A graph that `serves_eval` too is compared in eval mode as well where its runs wrote state
    (so that nothing was compared), or where it calls whole a module whose own code may take
    another path there. An example of one sample has no
    two parts: with `chunks` > 1 it is refused, or, with `defer_one_sample`, nothing is checked and
    False returned (the check is to run on inputs of two samples or more); so too an example
    whose samples are all alike, which nothing could be seen on, and one of two or three samples
    whose parts of one sample the graph cannot run (`gm.meta[CHECK_DEFERRED]` says so); True otherwise.
    `whole_run`: the run on the whole example, made already (`run_whole`)."""
    dims = dims or {}
    batch = batch_size_of(list(inputs), dims)
    if chunks < 2 or not batch:
        return True
    _refuse_counts_across_the_batch(gm, chunks)
    if batch < 2 and defer_one_sample:
        return False
    if batch < 2:
        raise ValueError(
            f"with chunks={chunks} the example needs at least two samples: compiling checks, on the example's "
            "halves, that micro-batches compute what the whole batch does, and one sample has no halves.\n"
            "How to fix: pass an example batch of two or more different samples, or use chunks=1."
        )
    # Two parts tell what `chunks` micro-batches would, in fewer runs (each costs a forward).
    sizes = _parts(batch, chunks, dims)
    parts = _split(inputs, sizes, batch, dims)
    if _samples_alike(inputs, batch, dims):  # (zeros, one sample repeated): a mean over them is each of them
        if defer_one_sample:
            return False
        raise ValueError(
            f"with chunks={chunks} the example needs samples that differ: compiling checks, on two parts of the "
            "example, that micro-batches compute what the whole batch does, and on samples that are all alike (zeros, "
            "one sample repeated) a statistic of the batch is the same as on any part of it.\n"
            "How to fix: pass an example batch of samples that differ (real data, or torch.randn of its shape), or use chunks=1."
        )
    real = small_on_cpu(gm, inputs)
    returned = next(n for n in gm.graph.nodes if n.op == "output").all_input_nodes
    whole_run = whole_run or run_whole(gm, inputs, records=False)
    if whole_run is None:  # not even the example runs here (on meta, say): nothing to tell
        return True
    whole, written = whole_run.values, set(whole_run.written)
    _refuse_sparse_outputs(returned, whole, chunks)
    keep = {*returned, *whole_run.fixed}
    each, error = _run_parts(gm, parts, real, keep, whole_run.fixed)
    if error is not None and sizes != split_sizes(batch, 2):  # a model of groups of samples (x.view(-1, 2, d): pairs)
        sizes = split_sizes(batch, 2)
        parts = _split(inputs, sizes, batch, dims)
        each, error = _run_parts(gm, parts, real, keep, whole_run.fixed)
    if error is not None:
        if batch < 4 and defer_one_sample:  # a part of one sample: a squeeze() may drop its batch dim, which larger calls keep
            gm.meta[CHECK_DEFERRED] = f"the model fails on a part of one sample of the example of {batch} ({type(error).__name__})"
            return False
        message = failing_part_message(gm, inputs, batch, chunks, dims, error)
        if batch < 4:
            message += " Or compile on an example of four samples or more, whose parts hold two each."
        raise ValueError(message) from error
    _mark_whole_batch_draws(whole_run.fixed, whole, each)
    compare = real and not _keeps_state(gm, written)
    reading = _reading_written(gm, written) if real and not compare else None
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    split = {name for name, value in zip(placeholders, inputs) if _is_split(value, batch, dims)}
    problems, bad = _compared(gm, returned, whole, each, compare, split, annotate=True, real=real, sizes=sizes, reading=reading)
    # Eval mode is compared too where the training runs compared nothing (they wrote state), or
    # where a module called whole may take another path there (a fast path of its own).
    if not problems and real and serves_eval and (not compare or _called_whole_may_switch(gm)):
        with _in_eval(gm):
            problems, bad = _compared_in_eval(gm, inputs, parts, returned, whole_run.fixed, split)
            if problems:  # (where it starts, in eval mode too)
                hint = split_for_their_size(gm, inputs, batch, dims) + nested_fast_paths(gm)
                raise ValueError(_mixing_message(gm, inputs, parts, chunks, problems, bad, hint))
    if problems:
        hint = split_for_their_size(gm, inputs, batch, dims) + (written_parameters(gm, inputs) if real else "") + nested_fast_paths(gm)
        raise ValueError(_mixing_message(gm, inputs, parts, chunks, problems, bad, hint))
    return True


def _refuse_sparse_outputs(returned: list[fx.Node], whole: dict[Any, Any], chunks: int) -> None:
    """Micro-batches' outputs are put together, and their gradients split, along the batch dim:
    a sparse tensor has no strided views to split into."""
    sparse = [n.name for n in returned if any(isinstance(t, torch.Tensor) and t.layout != torch.strided for t in _leaves(whole.get(n)))]
    if sparse:
        raise ValueError(
            f"the model returns sparse tensors ({', '.join(sparse)}), and with chunks={chunks} the pipeline puts "
            "the micro-batches' outputs together and splits their gradients along the batch dim, which a sparse "
            "tensor cannot be split along.\nHow to fix: return it dense (.to_dense()), or use chunks=1."
        )


def _mark_whole_batch_draws(drawing: set[fx.Node], whole: dict[Any, Any], each: list[dict[Any, Any]]) -> None:
    """`WHOLE_BATCH_DRAW` on each drawing node whose value has one shape on the whole example and
    on each part, or whose draws do (a function or module that draws one number for the batch
    and returns a value per sample: stochastic depth's mode='batch'): it draws for the whole
    batch, not per sample."""
    for node in drawing:
        shapes = [_shapes(run.get(node)) for run in (whole, *each)]
        draws = [run.get(DrawsOf(node)) for run in (whole, *each)]
        alike = shapes[0] is not None and all(shape == shapes[0] for shape in shapes[1:])
        if alike or (draws[0] and all(d == draws[0] for d in draws[1:])):
            node.meta[WHOLE_BATCH_DRAW] = True


def _shapes(value: Any) -> Optional[tuple[Any, ...]]:
    """The shape of a tensor, or of each of a tuple's; None for anything else."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(tuple(v.shape) for v in value)
    return None


def _compared(
    gm: fx.GraphModule, returned: list[fx.Node], whole: dict[fx.Node, Any], each: list[dict[fx.Node, Any]], compare: bool,
    split: set[str], annotate: bool, mode: str = "", real: bool = True, sizes: Optional[list[int]] = None,
    reading: Optional[set[fx.Node]] = None,
) -> tuple[list[str], set[fx.Node]]:
    """What is wrong with each returned value of the parts' runs (`each`) against the whole's,
    and the nodes at fault; with `annotate`, where the batch lies in each (`meta["batch_dims"]`).
    `real`: the runs computed values (not on the meta device), even where not `compare`d; where
    `reading` is given (the nodes that read state the runs wrote), an output made without any of
    them is compared all the same (a call counter beside `h - h.mean(0)`)."""
    sources = output_sources(gm, gradients=False, every=True)
    apart = _apart_in_each_micro_batch(gm)
    problems, bad = [], set()
    for node in returned:
        leaves = [_leaves(e[node]) for e in each]
        if any(len(p) != len(_leaves(whole[node])) for p in leaves):
            if not any(isinstance(leaf, torch.Tensor) for leaf in _leaves(whole[node])):
                continue  # numbers per sample (.tolist()): the call says so, naming them
            problems.append(f"{node.name}{mode}: the parts return {' and '.join(str(len(p)) for p in leaves)} values, the whole "
                            f"example {len(_leaves(whole[node]))}: the structure of the outputs follows the batch's size "
                            "(torch.split, chunk or unbind over the batch dim, a list of its samples), and micro-batches' "
                            "outputs put together would hold other samples than the plain model's (return the batch whole, "
                            "and cut it after the pipeline)")  # fmt: skip
            bad.add(node)
            continue
        # A value read from state the forward writes (a running mean), or drawn, differs between
        # micro-batches run in turn, though the parts here, run on the same state and draws, agree.
        made = namedtuple_fields(node, len(leaves[0])) or [node] * len(leaves[0])
        from_batch = [bool(sources[m.name].inputs & split) or m in apart for m in made]
        compared = [compare or (reading is not None and m not in reading) for m in made]
        found = [_batch_dim(w, [p[k] for p in leaves], compared[k], from_batch[k], real) for k, w in enumerate(_leaves(whole[node]))]
        if annotate:
            node.meta["batch_dims"] = [dim for dim, _ in found]
            wholes = _leaves(whole[node])
            combines = [
                _combines(w, [p[k] for p in leaves], sizes) if dim == VARIES and compared[k] and sizes else None
                for k, (w, (dim, _)) in enumerate(zip(wholes, found))
            ]  # fmt: skip
            # A sum on the example is one on every batch where the graph makes it so (passes/summed_loss.py).
            reaches = lambda n: bool(sources[n.name].inputs & split)  # noqa: E731
            node.meta[COMBINES] = [c if c != "sum" or summed_over_the_batch(gm, made[k], reaches) else SUMMED_ON_EXAMPLE for k, c in enumerate(combines)]
        for (_, why), path in zip(found, _paths(whole[node])):
            if why:
                problems.append(f"{node.name}{path}{mode}: {why}")
                bad.add(node)
    return problems, bad


def namedtuple_fields(node: fx.Node, leaves: int) -> Optional[list[fx.Node]]:
    """For a namedtuple made by one node of its fields (torch.fx records `Out(logits, reg)` so),
    the node each leaf is; None for any other node (a tuple or dict returned is its values)."""
    target = node.target
    if node.op != "call_function" or not (isinstance(target, type) and issubclass(target, tuple) and hasattr(target, "_fields")):
        return None
    given = [*node.args, *(node.kwargs[name] for name in target._fields[len(node.args) :] if name in node.kwargs)]
    fields = [f for f in given if isinstance(f, fx.Node)]
    return fields if len(fields) == len(given) == leaves else None


def _compared_in_eval(
    gm: fx.GraphModule, inputs: tuple[Any, ...], parts: list[tuple[Any, ...]], returned: list[fx.Node], fixed: set[fx.Node], split: set[str],
) -> tuple[list[str], set[fx.Node]]:
    """`_compared` on runs in the mode the graph is in (eval); nothing where they write state, or
    where the model fails in that mode, which its calls there will say."""
    written: set[str] = set()
    try:
        (whole,) = run_on(gm, [inputs], True, keep=set(returned), written=written, fixed=fixed)
        each = run_on(gm, parts, True, keep=set(returned), fixed=fixed)
    except Exception:  # noqa: BLE001 - the same call on the model fails alike
        return [], set()
    if _keeps_state(gm, written):
        return [], set()
    return _compared(gm, returned, whole, each, True, split, annotate=False, mode=" in eval mode")


def _called_whole_may_switch(gm: fx.GraphModule) -> bool:
    """Whether the graph calls whole a module that holds others, or one defined outside torch: its
    own code may read the mode and take another path in eval (nn.TransformerEncoder's nested
    tensors under torch.no_grad), which the graph cannot see. A single torch layer computes per
    sample in eval as in training, or mixes less (BatchNorm's running statistics)."""
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = fetch_attr(gm, str(node.target))
            if next(module.children(), None) is not None or not type(module).__module__.startswith("torch."):
                return True
    return False


@contextmanager
def _in_eval(gm: fx.GraphModule) -> Iterator[None]:
    """`gm` and every module it holds in eval mode, their flags put back after."""
    flags = [(module, module.training) for module in gm.modules()]
    gm.eval()
    try:
        yield
    finally:
        for module, training in flags:
            module.training = training


def _apart_in_each_micro_batch(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes whose values differ between micro-batches run in turn, whatever their inputs:
    what depends on a buffer the forward writes (read by name), or on random numbers drawn."""
    written = set(writable_buffer_names(gm, list(gm.graph.nodes)))
    found: set[fx.Node] = set()
    for node in gm.graph.nodes:
        reads_written = node.op == "get_attr" and str(node.target) in written
        draws = node.op != "get_attr" and random_sources(gm, [node]) != RandomSources()
        if reads_written or draws or any(p in found for p in node.all_input_nodes):
            found.add(node)
    return found


def _keeps_state(gm: fx.GraphModule, written: set[str]) -> bool:
    """Whether forward wrote buffers on the whole example (`written`; BatchNorm's running
    statistics aside, which these runs do not use): the micro-batches then compute as the plain
    model run on them in turn, by design (README), and what the whole batch computes is no
    measure of them. A buffer a module only holds (a pruning mask) or reads keeps nothing."""
    return bool(state_written(gm, written))


def state_written(gm: fx.GraphModule, written: set[str]) -> list[str]:
    """The buffers of `written` (that a run wrote) but normalisation's running statistics: state
    the forward keeps by a rule of its own (a step counter, an EMA), sorted."""
    norms = _norms_called_as_ops(gm)
    kept = []
    for name in written:
        path, _, buffer = name.rpartition(".")
        owner = fetch_attr(gm, path) if path else gm
        if not isinstance(owner, nn.modules.batchnorm._NormBase) and not (path in norms and buffer in _STATISTICS):
            kept.append(name)
    return sorted(kept)


_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def _reading_written(gm: fx.GraphModule, written: set[str]) -> set[fx.Node]:
    """The nodes whose values depend on a buffer in `written`: read by name, or by a module
    called whole that holds it, and all that is made from them."""
    found: set[fx.Node] = set()
    for node in gm.graph.nodes:
        target = str(node.target)
        holds = node.op in ("get_attr", "call_module") and any(name == target or name.startswith(f"{target}.") for name in written)
        if holds or any(p in found for p in node.all_input_nodes):
            found.add(node)
    return found


def _norms_called_as_ops(gm: fx.GraphModule) -> set[str]:
    """The paths of the modules whose running statistics a norm op of the graph normalises
    with: torch.export's graph holds `aten.batch_norm` on them, and a bare container where the
    BatchNorm module was."""
    return {str(stat.target).rpartition(".")[0] for node in gm.graph.nodes for stat in statistics_written(node)}


def _leaves(value: Any) -> list[Any]:
    return [leaf for _, leaf in tree_flatten_with_path(value)[0]]


def _paths(value: Any) -> list[str]:
    return [keystr(path) for path, _ in tree_flatten_with_path(value)[0]]


def _split(inputs: tuple[Any, ...], sizes: list[int], batch: int, dims: Dims) -> list[tuple[Any, ...]]:
    """The inputs cut into parts of `sizes` samples, each part a tuple of inputs."""
    pieces = [scatter(value, sizes, batch, dims) for value in inputs]
    return [tuple(p[i] for p in pieces) for i in range(len(sizes))]


def _run_parts(gm: fx.GraphModule, parts: list[tuple[Any, ...]], real: bool, keep: set[fx.Node], fixed: set[fx.Node]) -> tuple[list[dict[fx.Node, Any]], Optional[Exception]]:
    """The graph's values on each part, or the error it raised on one."""
    try:
        return run_on(gm, parts, real, keep=keep, fixed=fixed), None
    except Exception as e:  # noqa: BLE001 - named in the refusal
        return [], e


def _parts(batch: int, chunks: int, dims: Dims) -> list[int]:
    """The sizes of the two parts of the batch the check runs the graph on: the first a sample
    short of a micro-batch (or over it), not half the batch, so that the parts seldom line up
    with groups of samples the example holds (two point clouds of 8 points, split into halves,
    pool each cloud whole: split as 3 and 5 they do not); halves where a part would hold one
    sample, or where an input is cut along a dim `chunk_spec` names (into even pieces)."""
    micro_batch = split_sizes(batch, min(chunks, batch))[0]
    fits = [n for n in (micro_batch - 1, micro_batch + 1) if 2 <= n <= batch - 2 and 2 * n != batch]
    if not fits or any(dim is not None for dim in dims.values()):
        return split_sizes(batch, 2)
    return [fits[0], batch - fits[0]]


def _samples_alike(inputs: tuple[Any, ...], batch: int, dims: Dims) -> bool:
    """Whether every sample of the batch holds the same values: then what mixes samples (a mean
    over the batch) gives the whole batch what it gives any part, and comparing them shows nothing."""
    split = [(t, d) for t in _leaves(inputs) if isinstance(t, torch.Tensor) and (d := split_dim(t, batch, dims)) is not None]
    return bool(split) and all(
        t.layout == torch.strided and t.device.type != "meta" and torch.equal(t, t.narrow(d, 0, 1).expand_as(t)) for t, d in split
    )


def _is_split(value: Any, batch: int, dims: Dims) -> bool:
    return any(isinstance(t, torch.Tensor) and split_dim(t, batch, dims) is not None for t in _leaves(value))


def _combines(whole: Any, parts: list[Any], sizes: list[int]) -> Optional[str]:
    """How a number made from the whole batch (a loss, of one element) comes from the parts':
    'sum' where it is their sum (a sum over samples, or one divided by a count given whole),
    'mean' where it is their mean weighted by their sizes, 'neither' where it is neither; None
    where both (0), or it is no such number."""
    if not (isinstance(whole, torch.Tensor) and whole.numel() == 1 and whole.is_floating_point()):
        return None
    if not all(isinstance(p, torch.Tensor) and p.shape == whole.shape and p.dtype == whole.dtype for p in parts):
        return None
    rtol, atol = (1e-9, 1e-12) if whole.dtype == torch.float64 else (1e-5, 1e-7) if whole.dtype == torch.float32 else (1e-2, 1e-3)
    sum_ = torch.isclose(whole, sum(parts), rtol=rtol, atol=atol)  # type: ignore[arg-type]
    mean = torch.isclose(whole, sum(p * n for p, n in zip(parts, sizes)) / sum(sizes), rtol=rtol, atol=atol)  # type: ignore[arg-type]
    return "sum" if sum_ and not mean else "mean" if mean and not sum_ else "neither" if not sum_ else None


def _batch_dim(whole: Any, parts: list[Any], compare: bool, from_batch: bool = False, real: bool = True) -> tuple[BatchDim, str]:
    """Where the batch lies in one output leaf, and what is wrong with it ('' if nothing);
    without `compare`, from the shapes alone (a number, made from shapes, is compared always),
    but for a leaf of `real` values that no split input reaches and the parts gave bit for bit
    as the whole (made from parameters alone: returned once, as the plain model's). A leaf whose
    values depend on a split input (`from_batch`) is never the same in every micro-batch, even
    where the parts' values are (a loss from a zero-initialised head)."""
    if isinstance(whole, (int, float)):  # a bool too: x.shape[0] > 4
        return (VARIES, "") if any(p != whole for p in parts) else (None, "")  # x.shape[0], say
    if not isinstance(whole, torch.Tensor) or not all(isinstance(p, torch.Tensor) for p in parts):
        return None, ""
    if any(p.dim() != whole.dim() for p in parts):
        return VARIES, ""
    changed = [d for d in range(whole.dim()) if any(p.shape[d] != whole.shape[d] for p in parts)]
    if not changed:
        if from_batch:
            return VARIES, ""
        # Bit for bit: a loss near its starting value (ln V for a fresh language model) is the
        # same in each part within rounding, and is still made from the batch.
        same = real and all(_identical(p, whole) for p in parts)
        if not compare:  # state the runs write may make the parts differ: unknown, unless alike
            return (SAME, "") if same else (None, "")
        return (SAME, "") if same else (VARIES, "")
    if len(changed) > 1 and _trimmed_to_the_longest(whole, parts, changed):
        return 0, ""  # put together only where the micro-batches agree (core/microbatch.py says why not)
    if len(changed) > 1 or sum(p.shape[changed[0]] for p in parts) != whole.shape[changed[0]]:
        return VARIES, ""
    dim = changed[0]
    if not compare:
        return dim, ""
    if not (whole.is_floating_point() or whole.is_complex()):
        return dim, _exact_difference(joined(parts, dim), whole, dim)
    off = _difference(joined(parts, dim), whole)
    return dim, (f"the parts' values, concatenated along dim {dim}, differ from the whole example's by {off:.3g} "
                 f"(relative to its largest value)" if off else "")  # fmt: skip


def _exact_difference(got: torch.Tensor, expected: torch.Tensor, dim: int) -> str:
    """An integer or bool output (a mask, an index, an argmax) whose parts differ from the whole:
    in more than one element in a hundred, the model mixes samples (`h > h.mean(0)`, an
    `arange` of the batch size, row indices of `nonzero`); fewer may be an argmax flipped by a
    rounding that differs between batch sizes."""
    if got.shape != expected.shape:
        return f"the parts' values, concatenated along dim {dim}, have shape {tuple(got.shape)}, the whole example's {tuple(expected.shape)}"
    differs = dense(got) != dense(expected)
    differing = int(differs.sum())
    # A rounding flips isolated elements; a value computed across the batch differs in several
    # samples at one place (a column `h[:, :1] > h[:, :1].mean(0)` beside per-sample ones).
    rows_at_one_place = int(differs.movedim(dim, 0).flatten(1).sum(0).max()) if differs.dim() > 1 and differing else 0
    if differing <= expected.numel() // 100 and rows_at_one_place < 2:
        return ""
    return (f"the parts' values, concatenated along dim {dim}, differ from the whole example's in {differing} of "
            f"{expected.numel()} elements" + (f", {rows_at_one_place} samples at one place" if rows_at_one_place > 1 else ""))  # fmt: skip


def _trimmed_to_the_longest(whole: torch.Tensor, parts: list[torch.Tensor], changed: list[int]) -> bool:
    """Whether the parts hold the batch along dim 0 and, in their other dims that differ, are as
    long as their own longest sample, the whole as the whole's (`pad_packed_sequence` without
    `total_length`): micro-batches that happen to agree there make the whole batch's value."""
    if changed[0] != 0 or sum(p.shape[0] for p in parts) != whole.shape[0]:
        return False
    return all(max(p.shape[d] for p in parts) == whole.shape[d] for d in changed[1:])


def _identical(got: torch.Tensor, expected: torch.Tensor) -> bool:
    got, expected = dense(got), dense(expected)
    if not (expected.is_floating_point() or expected.is_complex()):
        return torch.equal(got, expected)
    return bool(torch.isclose(got, expected, rtol=0, atol=0, equal_nan=True).all())


def _difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference relative to the expected value's largest magnitude; 0 within rounding."""
    if got.shape != expected.shape:
        return float("inf")
    got, expected = dense(got), dense(expected)
    if not (expected.is_floating_point() or expected.is_complex()):
        return 0.0 if torch.equal(got, expected) else 1.0
    if not expected.numel():
        return 0.0
    same = torch.isclose(got, expected, rtol=0, atol=0, equal_nan=True)  # NaN and inf where both have them
    scale = expected.abs().nan_to_num(0.0, 0.0, 0.0).max().item()
    off = torch.where(same, 0.0, (got - expected).abs()).nan_to_num(float("inf")).max().item()
    relative = off / scale if scale > 0 else off
    return relative if relative > _ROUNDING.get(expected.dtype, _LOW_PRECISION) else 0.0


def nested_fast_paths(gm: fx.GraphModule) -> str:
    """A hint where the graph calls an `nn.TransformerEncoder` that may take its nested-tensor
    path: in eval under no_grad, only where every row's padding mask is left-aligned, and then
    with zeros at the padded positions; a micro-batch of such rows alone takes it where the whole
    batch does not."""
    names = [name for name, m in gm.named_modules() if isinstance(m, nn.TransformerEncoder) and getattr(m, "use_nested_tensor", False)]
    if not names:
        return ""
    return (
        f"nn.TransformerEncoder {listed(names, most=3)} takes its fast path in eval under torch.no_grad() "
        "(enable_nested_tensor=True) only where every row's padding mask is left-aligned, and gives the padded "
        "positions zeros there, computed values elsewhere: a micro-batch and the whole batch may differ at them. "
        "How to fix, then: nn.TransformerEncoder(..., enable_nested_tensor=False).\n"
    )


def _mixing_message(
    gm: fx.GraphModule, whole: tuple[Any, ...], parts: list[tuple[Any, ...]], chunks: int, problems: list[str], bad: set[fx.Node], hint: str
) -> str:
    starts = _where_it_starts(gm, whole, parts, bad)
    return (
        f"with chunks={chunks} the micro-batches would compute otherwise than the whole batch: run on two parts "
        "of the inputs checked (the example's, or the first call that could be checked where the example could not: "
        "one sample, samples all alike, parts of one sample the model fails on), the model gives other outputs than "
        "on the whole of them. It mixes samples "
        "along the batch dim, or computes with the batch size.\n"
        + "".join(f"  - output {p}\n" for p in problems)
        + (f"The difference starts at: {'; '.join(starts)}.\n" if starts else "")
        + hint
        + "How to fix: compute each sample on its own (reduce over other dims than the batch's; "
        "x.view(x.shape[0], -1) is fine, h / x.shape[0] is not); pass a value that needs the whole batch "
        "as an input (kept whole with chunk_spec={name: None}); or use chunks=1."
    )


def _where_it_starts(gm: fx.GraphModule, whole: tuple[Any, ...], parts: list[tuple[Any, ...]], bad: set[fx.Node]) -> list[str]:
    """The first nodes (up to 3) on a path of disagreeing values to a `bad` output whose
    parts' values disagree with the whole example's while their inputs' agree. (A
    disagreeing value that a later node makes agree again, the batch size given to `view`,
    starts nothing.)"""
    try:
        every, *each = run_on(gm, [whole, *parts], real=True, keep=None)
    except Exception:  # noqa: BLE001 - it ran once already; nothing more to say if not again
        return []
    agree = {n: _agrees(every[n], [e[n] for e in each]) for n in every if isinstance(n, fx.Node)}  # (not DrawsOf keys)
    leading, stack = set(), list(bad)
    while stack:  # back from the bad outputs, through values that disagree
        node = stack.pop()
        if node not in leading:
            leading.add(node)
            stack += [i for i in node.all_input_nodes if not agree.get(i, True)]
    starts = [n for n in gm.graph.nodes if n in leading and all(agree.get(i, True) for i in n.all_input_nodes)]
    return [_describe(n, every[n], each[0][n]) for n in starts[:3]]


def _describe(node: fx.Node, whole: Any, part: Any) -> str:
    """'name = target(args)', what it was if a number (the batch size, say), and its line."""
    args = [a.name if isinstance(a, fx.Node) else repr(a) for a in node.args]
    args += [f"{k}={v.name if isinstance(v, fx.Node) else repr(v)}" for k, v in node.kwargs.items()]
    call = f"{args.pop(0)}.{node.target}" if node.op == "call_method" and args else _target(node)
    text = f"{node.name} = {call}({', '.join(args)})"
    numbers = isinstance(whole, tuple) and all(isinstance(v, (int, float)) for v in whole)
    if (isinstance(whole, (int, float)) or numbers) and not isinstance(whole, bool):  # a size, or a shape
        shown = tuple(whole) if isinstance(whole, tuple) else whole
        text += f", {shown} for the whole example and {tuple(part) if isinstance(part, tuple) else part} for a part"
    line = source_line(node)
    text = text if line == "an unknown line" else f"{text} at {line}"
    library = op_namespace(node.target) if isinstance(node.target, torch._ops.OpOverload) else None
    if library is not None and library not in TORCH_NAMESPACES:  # (torch's own random ops draw fixed values here)
        text += (f" (an op of the library {library!r}: if it draws random numbers, this check cannot hold them fixed "
                 "nor tell them from samples mixed, and such an op runs with chunks=1 alone)")
    return text


def _agrees(whole: Any, parts: list[Any]) -> bool:
    """Whether the parts' values of a node put together give the whole example's, leaf by leaf
    (a module's tuple of outputs, say)."""
    if isinstance(whole, (tuple, list)) and all(isinstance(p, type(whole)) and len(p) == len(whole) for p in parts):
        return all(_agrees(w, [p[k] for p in parts]) for k, w in enumerate(whole))
    if isinstance(whole, torch.Tensor):
        dim, why = _batch_dim(whole, parts, compare=True)
        return dim != VARIES and not why
    if isinstance(whole, (int, float, bool)):
        return all(p == whole for p in parts)
    return True


def _target(node: fx.Node) -> str:
    name = getattr(node.target, "__name__", str(node.target))
    return f"self.{name}" if node.op == "call_module" else name
