"""train_step's loss: the target split like the inputs, each micro-batch's loss and the
gradients of its outputs, and the micro-batches' losses checked against the whole batch's."""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import re
import warnings
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map, tree_map_only, tree_unflatten

from fxpipe.core.microbatch import SAME, VARIES, BatchDim, leaves_of, scatter, takes_gradients
from fxpipe.core.own_code import caller_stacklevel
from fxpipe.core.own_loss import own_loss_in
from fxpipe.runtime.gather import ValueRef
from fxpipe.runtime.loss_reach import GradsBehindOutputs
from fxpipe.runtime.raw_grads import raw_grads


def split_target(
    target: Any, sizes: list[int], batch: Optional[int], dim: int = 0, outputs: frozenset[int] = frozenset(),
    seen: Optional[dict[str, int]] = None, outputs_by_path: Optional[dict[str, tuple[frozenset[int], ...]]] = None,
) -> list[Any]:
    """The target's piece for each micro-batch (a tensor with no dim of the batch's size whole
    to each): split like the inputs, along their batch dim
    `dim` (a chunk spec's), or along dim 0 where that one is not of the batch's size. Where both
    are: along the one an earlier call split the same leaf along (`seen`, by its path in the
    target, which this call adds to: ctc_loss's padded targets of (batch, longest label) are as
    long as the batch in some batches alone), else along the one the outputs hold their batch in
    (`outputs`: their batch dims), if one of them (a batch-first target of a sequence-first model
    whose classes are as many as the samples); of a leaf at the path of an output
    (`outputs_by_path`: a target of the outputs' structure), first the dims that output holds
    it in, any of them."""
    if target is None or len(sizes) == 1:
        return [target] * len(sizes)
    unsplit = _per_sample_but_no_tensor(target, batch)
    if unsplit:
        raise ValueError(
            f"the target holds values per sample that are not tensors: {'; '.join(unsplit)}. train_step splits the target's "
            "tensors into micro-batches and gives each micro-batch the rest whole, so its loss would see every sample's.\n"
            "How to fix: pass them as tensors (torch.as_tensor(...)), which are split like the inputs."
        )
    seen = {} if seen is None else seen
    leaves = [(keystr(path), t) for path, t in tree_flatten_with_path(target)[0] if isinstance(t, torch.Tensor)]
    along = {}
    held_at = _held_by_leaf(outputs_by_path or {}, [path for path, _ in leaves])
    for path, t in leaves:
        at_path = sorted(held_at.get(path, ()))
        held = at_path or outputs
        # The dims the output at its path holds the batch in first (an RNN's final state (layers,
        # batch, hidden) of a batch-first model), then the inputs' and dim 0.
        order = (*at_path, 0, dim) if dim and 0 in held and dim not in held else (*at_path, dim, 0)
        fits = [d for d in dict.fromkeys(order) if t.dim() > d and t.shape[d] == batch]
        along[id(t)] = seen[path] if len(fits) > 1 and seen.get(path) in fits else fits[0] if fits else None
        if len(fits) == 1 and dim:
            seen[path] = fits[0]
    # A leaf with no dim of the batch's size holds no sample (a count of the whole batch's tokens,
    # a class weight, a statistic of the batch): it goes whole to every micro-batch, as such an
    # input does.
    if any(along[id(t)] is None and batch in t.shape for _, t in leaves):
        shapes = [tuple(t.shape) for _, t in leaves]
        where = f"along dim {dim} (the inputs') or dim 0" if dim else "along dim 0"
        raise ValueError(
            f"the target must be split into micro-batches like the inputs, {where} of size {batch}; "
            f"it has shapes {shapes}.\nHow to fix: give per-sample targets, with the batch where the inputs have it; a tensor "
            "that holds no sample (a statistic of the whole batch, class weights) with a dim of the batch's size by chance "
            "goes to loss_fn itself, whole: loss_fn=functools.partial(my_loss, weight=w)."
        )
    return scatter(target, sizes, batch or 0, {key: d for key, d in along.items() if d})


def target_note(target: Any, batch: Optional[int], micro_batches: int) -> str:
    """What a loss that fails on a micro-batch is told of the target's tensors: those that went
    whole to each (no dim of the batch's size), and those split along the batch (class weights as
    many as the samples are, by chance); '' for a target of one micro-batch."""
    if target is None or micro_batches == 1 or batch is None:
        return ""
    tensors = [t for t in tree_flatten(target)[0] if isinstance(t, torch.Tensor)]
    whole = [tuple(t.shape) for t in tensors if batch not in t.shape]
    split = [tuple(t.shape) for t in tensors if batch in t.shape]
    notes = [
        f"The target's tensors with no dim of the batch's size ({batch}) went whole to every micro-batch: "
        f"{', '.join(str(shape) for shape in whole)}. One that holds a value per sample must have the batch's size where "
        "the inputs have it."
    ] if whole else []  # fmt: skip
    flattened = [(tuple(t.shape), d) for t in tensors if batch not in t.shape for d, n in enumerate(t.shape) if n > batch and n % batch == 0]
    notes += [
        f"Of those, {shape} holds {shape[d] // batch} x the batch's {batch} along dim {d}: a target flattened over the batch "
        "and another dim (a token's label, batch x sequence)? Each micro-batch's loss got all of it, with the outputs of its "
        "own samples alone.\nHow to fix: give it with a dim "
        f"of its own for the batch (target.unflatten({d}, ({batch}, -1))), and flatten it in loss_fn "
        "(loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))."
        for shape, d in flattened[:1]
    ]  # fmt: skip
    notes += [
        f"The target's tensors with a dim of the batch's size ({batch}) were split into the micro-batches along it: "
        f"{', '.join(str(shape) for shape in split)}. One that holds no sample (class weights as many as the samples) goes "
        "to loss_fn itself, whole: loss_fn=functools.partial(my_loss, weight=w)."
    ] if split else []  # fmt: skip
    return "\n".join(notes)


_SIZES = re.compile(r"size|shape|dim|match|broadcast|bound|index|expected|element|length", re.IGNORECASE)


def about_sizes(error: BaseException) -> bool:
    """Whether a loss's error may be about its inputs' sizes (the target's split bears on it),
    not its own logic (`raise ValueError("my loss is broken")`)."""
    return isinstance(error, (IndexError, KeyError)) or bool(_SIZES.search(str(error)))


def sizes_note(output: Any, target: Any) -> str:
    """What a loss that fails on a micro-batch is told where an output and the target's piece
    hold as many samples and dims but other sizes: a model that sizes its outputs by the
    micro-batch's own samples (its longest sequence) gives each micro-batch its own size, where
    the plain model's whole batch has one."""
    outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.dim() > 1]
    targets = [t for t in tree_flatten(target)[0] if isinstance(t, torch.Tensor) and t.dim() > 1]
    for out in outputs:
        for piece in targets:
            if out.dim() == piece.dim() and out.shape[0] == piece.shape[0] and out.shape != piece.shape:
                return (
                    f"This micro-batch's output of shape {tuple(out.shape)} meets a target of shape {tuple(piece.shape)}: a "
                    "model whose outputs take a size from the micro-batch's own samples (pad_packed_sequence without "
                    "total_length, a batch padded to its longest sequence) gives each micro-batch its own, where the "
                    "plain model's whole batch has one.\nHow to fix, then: pad to a fixed length in the model "
                    "(pad_packed_sequence(..., total_length=x.shape[1]))."
                )
    return ""


def _held_by_leaf(outputs_by_path: dict[str, tuple[frozenset[int], ...]], paths: list[str]) -> dict[str, frozenset[int]]:
    """For each target leaf (by path, in order), the dims the output there holds the batch in: at
    its own path, or, inside an output value of several leaves (an LSTM's state `(h, c)` at `[1]`,
    for `[1][0]`; an RNN's `(output, state)` returned whole), the leaf of that value it matches
    in order (all of the value's dims where the target has more leaves there than it)."""
    found: dict[str, frozenset[int]] = {}
    counted: dict[str, int] = {}
    for path in paths:
        if path in outputs_by_path:
            found[path] = frozenset().union(*outputs_by_path[path])
            continue
        holders = [key for key in outputs_by_path if path.startswith(key) and len(path) > len(key) and path[len(key)] == "["]
        if not holders:
            continue
        key = max(holders, key=len)
        dims, k = outputs_by_path[key], counted.get(key, 0)
        counted[key] = k + 1
        found[path] = dims[k] if k < len(dims) else frozenset().union(*dims)
    return found


def _per_sample_but_no_tensor(target: Any, batch: Optional[int], where: str = "target") -> list[str]:
    """The parts of `target` that hold one value per sample and are no tensor: an array (numpy's)
    or a list or tuple of numbers as long as the batch (ctc_loss's lengths given as lists)."""
    if not batch or batch < 2 or isinstance(target, torch.Tensor):
        return []
    shape = getattr(target, "shape", None)
    if hasattr(target, "__array__") and isinstance(shape, tuple) and batch in shape:
        return [f"{where}, an array of shape {shape}"]
    if type(target) in (list, tuple) and len(target) == batch and all(type(v) in (int, float, bool) for v in target):
        return [f"{where}, a {type(target).__name__} of {batch} numbers"]
    if type(target) is dict:
        return [found for key, value in target.items() for found in _per_sample_but_no_tensor(value, batch, f"{where}[{key!r}]")]
    if isinstance(target, (list, tuple)):
        return [found for i, value in enumerate(target) for found in _per_sample_but_no_tensor(value, batch, f"{where}[{i}]")]
    return []


def check_loss_arguments(target: Any, loss_fn: Any) -> None:
    """What train_step is told of the loss fits together, before any stage runs."""
    problems = []
    if loss_fn is None and target is not None:
        problems.append("it got a target and no loss_fn: without loss_fn the model's output is its loss, and the target "
                        "would go unused.\nHow to fix: pass loss_fn=... (called as loss_fn(output, target)), or give the "
                        "labels to the model as an argument of its forward")  # fmt: skip
    elif loss_fn is not None and not callable(loss_fn):
        problems.append(f"loss_fn must be callable, not {describe(loss_fn)}")
    elif loss_fn is not None and not _takes_two(loss_fn):
        problems.append(f"loss_fn is called as loss_fn(output, target), and {_name(loss_fn)} takes {inspect.signature(loss_fn)}.\n"
                        "How to fix: take two arguments, output and target, and leave the target unused if the loss needs none "
                        "(loss_fn=lambda output, _: ...)")  # fmt: skip
    if problems:
        raise ValueError("train_step cannot compute the loss: " + "\n".join(problems))


def _takes_two(function: Callable[..., Any]) -> bool:
    """Whether the function can be called with two positional arguments (True where no signature says)."""
    try:
        inspect.signature(function).bind(None, None)
    except TypeError:
        return False
    except ValueError:  # a builtin without a signature: its call says
        pass
    return True


def _name(function: Callable[..., Any]) -> str:
    return getattr(function, "__qualname__", type(function).__name__)


def loss_of(loss_fn: Callable[[Any, Any], torch.Tensor], output: Any, target: Any) -> Any:
    """loss_fn on a micro-batch; a failure on a target of None says that none was given; a
    gradient it takes of what lies behind the outputs is refused (fxpipe/runtime/loss_reach.py)."""
    try:
        with GradsBehindOutputs():
            return loss_fn(output, target)
    except Exception as e:
        if target is not None:
            raise
        raise ValueError(f"loss_fn raised {type(e).__name__}: {e}, on a target of None: train_step was given no target.\n"
                         "How to fix: pass target=... to train_step") from e


def own_loss(output: Any) -> Any:
    """The loss a model returns itself (fxpipe/core/own_loss.py): the output, its `loss` field or
    key, or the first of a tuple or list that is a 0-dim tensor (`(loss, logits)`, Hugging
    Face's return_dict=False)."""
    loss = own_loss_in(output, lambda v: isinstance(v, torch.Tensor), lambda t: t.dim() == 0)
    if loss is None:
        raise ValueError(
            f"train_step without loss_fn needs a model that returns its loss (a 0-dim tensor, an output "
            f"with a `loss` field, or a tuple that begins with it), and this one returns {describe(output)}.\n"
            "How to fix: pass loss_fn=..., and target=... if it takes one."
        )
    return loss


def own_loss_ref(template: Any, leaf: Optional[int] = None) -> Optional[ValueRef]:
    """Where `own_loss` finds the model's own loss in the output's template: a value made from
    the whole batch, which train_step combines from the micro-batches'; with `leaf`, the value
    that holds it as that leaf (a namedtuple's `loss` field, `Program.own_loss_leaf`); None
    where there is none."""
    found = own_loss_in(template, lambda v: isinstance(v, ValueRef), lambda ref: True)
    if not isinstance(found, ValueRef) or found.given:
        return None
    return found if (found.dims == (VARIES,) if leaf is None else found.dim(leaf) == VARIES) else None


def with_own_loss_whole(template: Any, leaf: Optional[int] = None) -> Any:
    """The template with the model's own loss returned whole (the step's combined loss), not
    put together from the micro-batches: for return_outputs=True without loss_fn."""
    ref = own_loss_ref(template, leaf)
    if ref is None or ref.dims is None:
        return template
    dims = list(ref.dims)
    dims[leaf or 0] = SAME
    whole = dataclasses.replace(ref, dims=tuple(dims))
    return tree_map(lambda found: whole if found == ref else found, template)


def own_loss_whole_in(values: dict[str, Any], ref: ValueRef, leaf: Optional[int], loss: torch.Tensor) -> dict[str, Any]:
    """One micro-batch's output values with the model's own loss (value `ref`, or its leaf
    `leaf`) replaced by the batch's `loss`."""
    if leaf is None:
        return {**values, ref.name: loss}
    leaves, spec = tree_flatten(values[ref.name])
    leaves[leaf] = loss
    return {**values, ref.name: tree_unflatten(leaves, spec)}


def output_leaves(template: Any, outputs: Optional[dict[str, Any]] = None) -> list[tuple[str, BatchDim, Any]]:
    """Each leaf of the model's output that a stage makes: where it is (`output['aux_loss']`),
    where its batch lies as compiling found it, and its value in `outputs` (one micro-batch's
    values by name; None without)."""
    found = []
    for path, ref in tree_flatten_with_path(template)[0]:
        if not isinstance(ref, ValueRef) or ref.given:
            continue
        inner = tree_flatten_with_path(outputs[ref.name])[0] if outputs is not None else [((), None)] * len(ref.dims or [None])
        for k, (within, value) in enumerate(inner):
            found.append((f"output{keystr(path)}{keystr(within)}", ref.dim(k), value))
    return found


def refuse_outputs_of_the_whole_batch(template: Any, micro_batches: int, asked: bool) -> None:
    """train_step hands loss_fn each micro-batch's outputs and checks their losses against the
    whole batch's outputs, put together from them: an output made from the whole batch (a loss
    over it, a similarity matrix between its samples) has no such pieces. Refused before any
    stage runs, where compiling saw one."""
    varying = [where for where, dim, _ in output_leaves(template) if dim == VARIES]
    if varying and micro_batches > 1:
        raise ValueError(_unsplittable(varying, micro_batches, asked))


def refuse_whole_batch_outputs_of_a_call(template: Any, micro_batches: int) -> None:
    """pipe(x) puts its outputs together from the micro-batches': an output made from the whole
    batch has no such pieces. Refused before any stage runs (and writes a buffer), where
    compiling saw one."""
    varying = [where for where, dim, _ in output_leaves(template) if dim == VARIES]
    if varying and micro_batches > 1:
        named = ", ".join(o if o != "output" else "its output" for o in varying)
        raise ValueError(
            f"the model returns {named}, a value made from the whole batch (a loss or a statistic over it, its size, a "
            "matrix between its samples, a value drawn or read from state forward writes), and pipe(x) puts the outputs "
            f"of the {micro_batches} micro-batches together: the plain model's cannot be made from theirs.\n"
            "How to fix: for a loss, train with pipe.train_step(...), which combines the micro-batches' losses; for "
            "other values, return tensors with one entry per sample (batch first) and reduce them outside the "
            "pipeline; or use chunks=1."
        )


def check_gatherable(template: Any, outputs: dict[str, Any], micro_batches: int, asked: bool) -> None:
    """The outputs, put together from the micro-batches along dim 0: when `asked` for them
    (return_outputs=True), or for the check of the loss. A 0-dim value the micro-batches make
    alike (from parameters alone) is returned once; another cannot be put together."""
    scalars = [where for where, dim, value in output_leaves(template, outputs)
               if isinstance(value, torch.Tensor) and value.dim() == 0 and dim != SAME]  # fmt: skip
    if scalars and micro_batches > 1:
        raise ValueError(_unsplittable(scalars, micro_batches, asked))


def _unsplittable(outputs: list[str], micro_batches: int, asked: bool) -> str:
    why = (f"return_outputs=True puts the outputs of the {micro_batches} micro-batches together along their batch dim"
           if asked else f"train_step gives loss_fn each of the {micro_batches} micro-batches' outputs, and checks their "
           "losses against loss_fn on the whole batch's outputs, put together from them")  # fmt: skip
    named = ", ".join(o if o != "output" else "its output" for o in outputs)
    return (
        f"{why}; the model returns {named}, made from the whole batch (a loss or a statistic over it, a matrix "
        "between its samples): one per micro-batch, which are no pieces of the whole batch's.\n"
        "How to fix: chunks=1; for an auxiliary loss, add it into a loss the model returns itself and call "
        "train_step without loss_fn (its micro-batches' are combined as their mean or sum, unchecked); for "
        "values between samples, return per-sample values (batch first) and compute the loss from pipe(x)'s "
        "output (loss_fn(pipe(x), y).backward(), in one process; across processes, chunks=1). No gradient was "
        "accumulated."
    )


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


class LeafGrads:
    """The `.grad` of the tensors a step's losses reach besides the outputs (a learnable
    temperature `loss_fn` reads, a parameter the model returns), as they were before the step.
    Each micro-batch's backward accumulates into them at once, so a step that fails or is refused
    after one puts them back: it accumulates nothing anywhere."""

    def __init__(self) -> None:
        self.before: dict[int, tuple[torch.Tensor, Optional[torch.Tensor]]] = {}
        self.undo: list[weakref.WeakMethod[Callable[[], None]]] = []  # what else the step puts back (its buffer writes)
        self.through: list[tuple[torch.Tensor, torch.Tensor]] = []  # (a target computed with grad, its leaf)

    def leaf_target(self, target: Any) -> Any:
        """`target` with each tensor computed with gradients (a jointly trained teacher's output)
        made a leaf of its own: every micro-batch's backward reaches its piece of the leaf, and
        `backward_targets` takes the sum through the target's graph once, after the step, as the
        plain model's one backward does (each micro-batch's would free that graph for the next)."""

        def leaf(t: torch.Tensor) -> torch.Tensor:
            if not t.requires_grad or t.grad_fn is None:
                return t
            made = t.detach().requires_grad_()
            self.through.append((t, made))
            return made

        return tree_map_only(torch.Tensor, leaf, target)

    def backward_targets(self) -> None:
        """The gradients the step's losses gave the targets' leaves, on through the targets' graphs."""
        pairs = [(t, made.grad) for t, made in self.through if made.grad is not None]
        self.through = []
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [grad for _, grad in pairs])

    def note(self, loss: torch.Tensor, own: Iterable[Any]) -> None:
        """Before `loss`'s backward: the leaves it reaches, less `own` (the outputs: fresh leaves,
        or the loss stage's own values, whose graph is the stage's business and is not walked)."""
        tensors = [t for t in own if isinstance(t, torch.Tensor)]
        skip = {id(t) for t in tensors}
        stack, seen = [loss.grad_fn], {t.grad_fn for t in tensors if t.grad_fn is not None}
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            leaf = getattr(node, "variable", None)  # an AccumulateGrad node's tensor
            if leaf is None:
                stack.extend(child for child, _ in node.next_functions)
            elif id(leaf) not in skip and id(leaf) not in self.before:
                self.before[id(leaf)] = (leaf, None if leaf.grad is None else leaf.grad.clone())

    @contextmanager
    def put_back_on_error(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            for leaf, grad in self.before.values():
                leaf.grad = grad
            for undo in self.undo:
                put_back = undo()
                if put_back is not None:  # (held weakly: a step the caller let go of wrote nothing since)
                    put_back()
            raise


def value_grads(loss: torch.Tensor, values: dict[str, Any]) -> dict[str, Any]:
    """The gradient of `loss` with respect to each output value (trees like the values, whose
    tensors are fresh leaves). The backward runs through the loss's whole graph, as
    `loss.backward()` does: a tensor the loss function reads besides the outputs (a learnable
    temperature, say) gets its gradient too, one micro-batch's share at a time."""
    if not loss.requires_grad:
        return {}
    leaves = [t for value in values.values() for t in leaves_of(value) if isinstance(t, torch.Tensor) and t.requires_grad]
    with raw_grads(leaves) as raw:  # in the layout the last stage's backward would get
        torch.autograd.backward(loss)

    def grad_of(leaf: Any) -> Any:
        return raw.of(leaf) if isinstance(leaf, torch.Tensor) and leaf.requires_grad else None

    return {name: tree_map(grad_of, value) for name, value in values.items()}


@contextmanager
def generators_kept(device: torch.device) -> Iterator[Callable[[], bool]]:
    """Within this block, draws from the CPU generator (and `device`'s, on CUDA) are undone at
    its end; the block gets a function that says whether any was made."""
    cuda = device.type == "cuda"
    cpu_before = torch.get_rng_state()
    cuda_before = torch.cuda.get_rng_state(device) if cuda else cpu_before
    moved: list[bool] = []

    def drew() -> bool:
        if not moved:
            moved.append(not torch.equal(torch.get_rng_state(), cpu_before)
                         or (cuda and not torch.equal(torch.cuda.get_rng_state(device), cuda_before)))  # fmt: skip
        return moved[0]

    try:
        yield drew
    finally:
        drew()
        torch.set_rng_state(cpu_before)
        if cuda:
            torch.cuda.set_rng_state(cuda_before, device)


def replay_once(loss_fn: Callable[[Any, Any], torch.Tensor], outputs: Any, target: Any, device: torch.device) -> Callable[[], bool]:
    """loss_fn called once on the whole batch's outputs, as the check calls it (with gradients,
    on leaves), its draws undone: for `LossStateKept`, which the call returns True to where it
    drew nothing (a loss that draws leaves no state to compare)."""
    def replay() -> bool:
        with torch.enable_grad(), generators_kept(device) as drew:
            loss_fn(handed(once_each(output_leaf, outputs), True), handed(target, True))
        return not drew()

    return replay


def handed(tree: Any, writes: bool) -> Any:
    """What loss_fn is given (outputs, or a target): `tree` itself, or, where loss_fn may write
    what it is given in place (`logits.div_(t)`, `y.mul_(1 - eps)`), copies (see
    fxpipe/runtime/loss_writes.py)."""
    return once_each(torch.Tensor.clone, tree) if writes else tree


def once_each(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """`fn` of each tensor in `tree`, once per tensor: one held twice (`return h, h`) stays one."""
    if isinstance(tree, torch.Tensor):  # (the common case, without a walk of the tree)
        return fn(tree)
    made: dict[int, torch.Tensor] = {}

    def one(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            made[id(t)] = fn(t)
        return made[id(t)]

    return tree_map_only(torch.Tensor, one, tree)


def output_leaf(t: torch.Tensor) -> torch.Tensor:
    """A copy of an output that a loss_fn may differentiate (autograd.grad(loss, out), a hook on
    out), as it may the micro-batches' outputs, with no graph behind it."""
    return t.detach().requires_grad_(takes_gradients(t))


def _combined_loss_problem(reduction: str) -> str:
    other = "sum" if reduction == "mean" else "mean"
    return (
        f"the loss is not a {reduction} over samples.\nHow to fix: pass reduction={other!r} if the loss is a {other} "
        "over samples. A loss that is neither (a mean over a varying count of tokens, say) cannot be split into "
        "micro-batches as it is: divide its sum by the whole batch's count, counted before the step, and pass "
        "reduction='sum' (count = (y != -100).sum(); loss_fn = lambda out, t: F.cross_entropy(out, t, "
        "ignore_index=-100, reduction='sum') / count; with class weights, count = weight[y].sum()). A loss that "
        "compares samples with each other (contrastive, InfoNCE, a CLIP loss over the batch's pairs) has no such "
        "form: in one process, use pipe(x) and loss.backward(), which computes it on the whole batch's outputs."
    )


def _sliced_loss_problem(reduction: str) -> str:
    return (
        f"with sequence_chunks, each micro-batch is a slice of the sequences, and its loss the loss of that slice's "
        f"positions: the loss must be a {reduction} over positions as well as samples. A mean over the targets that "
        "count (ignore_index=-100 on padding) divides each slice's sum by that slice's own count, which differs from "
        "slice to slice; a loss_fn that shifts the positions itself (out[:, :-1] against t[:, 1:]) drops each slice's "
        "last position.\nHow to fix: give "
        "train_step the target shifted already, aligned with the outputs position by position (t = F.pad(idx[:, 1:], "
        "(0, 1), value=-100)), and a loss_fn that does not shift, summed (reduction='sum') or divided by the whole "
        "batch's count of targets; or sequence_chunks=1."
    )


def _float_dtypes(outputs: Any) -> list[torch.dtype]:
    return [t.dtype for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _rounding_allowed(dtypes: list[torch.dtype]) -> float:
    """The relative difference a few roundings in the least precise of `dtypes` may make."""
    if all(dtype == torch.float64 for dtype in dtypes):
        return 1e-10
    return max(1e-4, max(4 * torch.finfo(dtype).eps for dtype in dtypes))


def ambiguous_split_note(target: Any, first_piece: Any, batch: Optional[int]) -> str:
    """For each tensor of the target with several dims of the batch's size (a (batch, tokens)
    target of a sequence-first model, as many tokens as samples): the dim it was split along,
    and how to say which holds the samples; '' where there is none."""
    if batch is None or target is None:
        return ""
    notes = []
    for whole, piece in zip(tree_flatten(target)[0], tree_flatten(first_piece)[0]):
        if not isinstance(whole, torch.Tensor) or not isinstance(piece, torch.Tensor) or list(whole.shape).count(batch) < 2:
            continue
        split = [d for d, (n, m) in enumerate(zip(whole.shape, piece.shape)) if n != m]
        notes.append(
            f" The target's tensor of shape {tuple(whole.shape)} has several dims of the batch's size ({batch}), and was split "
            f"along dim {split[0] if split else '?'} (where the outputs hold their batch, or where an earlier call split it): "
            "if its samples lie along another, that is why. Give it with its batch where the outputs hold theirs "
            "(transposed), or make a first call whose batch size differs from the sizes of its other dims: later calls "
            "split it along the dim that call did."
        )
    return "".join(notes)


def check_combined_loss(
    loss_fn: Callable[[Any, Any], torch.Tensor], outputs: Any, target: Any, total: torch.Tensor, reduction: str, sliced: bool = False,
    pieces: Optional[Callable[[], list[tuple[Any, Any, float]]]] = None, writes: bool = True, note: str = "",
) -> None:
    """The micro-batches' losses, combined, must be the loss of the whole batch (`sliced`: the
    micro-batches are slices of the sequences). The check draws nothing from the caller's
    generators; a loss that draws (label noise) cannot be checked. `pieces` (each micro-batch's
    outputs, target and weight, made when asked): where the outputs are in half precision, whose
    rounding would hide a loss that does not combine, the check runs again on them in float64.
    `writes`: loss_fn may write the outputs it is given in place (see `handed`). `note`: told
    with a refusal (how an ambiguous target was split)."""
    with torch.enable_grad(), generators_kept(total.device) as drew:  # a loss_fn may differentiate its outputs
        whole = loss_fn(handed(once_each(output_leaf, outputs), writes), handed(target, True))
    if drew():
        warnings.warn(
            "loss_fn draws random numbers: on the whole batch it draws others than on the micro-batches, so "
            f"train_step cannot check that reduction={reduction!r} combines the micro-batches' losses into the "
            "whole batch's. Each micro-batch's loss draws its own, as dropout does: alike in distribution to the "
            "plain model's, not in value (chunks=1 draws the plain model's).",
            stacklevel=caller_stacklevel(),
        )
        return
    whole_dtype = whole.dtype
    whole = whole.detach().to(total.device, total.dtype)
    # What reordering the sums may change: a few roundings in the lowest precision the loss went
    # through (a bfloat16 term of a float32 loss under autocast rounds as bfloat16). A NaN in
    # both is the plain model's NaN (a diverged step, or a bad sample): returned as it is, for
    # the caller (or a GradScaler) to see.
    rtol = _rounding_allowed([total.dtype, whole_dtype, *_float_dtypes(outputs)])
    atol = rtol * 1e-2 * max(1.0, float(whole.abs())) if whole.isfinite() else 0.0
    exact = _in_float64(loss_fn, outputs, target, pieces(), writes) if rtol > 1e-4 and pieces is not None else None
    if exact is not None:  # the same check without the half precision's rounding
        total, whole, rtol, atol = exact[0], exact[1], 1e-6, 1e-8 * max(1.0, float(exact[1].abs()))
    if not torch.allclose(total, whole, rtol=rtol, atol=atol, equal_nan=True):
        again = " (recomputed in float64 from the outputs)" if exact is not None else ""
        said = f"the micro-batches' losses combined with reduction={reduction!r} give {float(total):.6g}, but the loss of the whole batch is {float(whole):.6g}{again}"
        problem = _sliced_loss_problem(reduction) if sliced else _combined_loss_problem(reduction)
        raise ValueError(f"{said}: {problem}{note} No gradient was accumulated into the model's parameters.")


def _in_float64(
    loss_fn: Callable[[Any, Any], torch.Tensor], outputs: Any, target: Any, pieces: list[tuple[Any, Any, float]], writes: bool,
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The micro-batches' losses combined, and the whole batch's, from the outputs in float64 with
    autocast off; None where loss_fn cannot run on them (a class weight it holds in float32, say)."""
    def wide(tree: Any) -> Any:
        return handed(tree_map_only(torch.Tensor, lambda t: t.detach().double() if t.is_floating_point() else t.detach(), tree), writes)

    try:
        with torch.no_grad(), torch.autocast("cpu", enabled=False), _autocast_off_on_cuda():
            losses = [(loss_fn(wide(out), handed(t, True)), weight) for out, t, weight in pieces]
            whole = loss_fn(wide(outputs), handed(target, True))
    except Exception:  # noqa: BLE001 - the check in the outputs' own precision stands
        return None
    if any(loss.dtype in (torch.float16, torch.bfloat16) for loss, _ in [*losses, (whole, 1.0)]):
        return None  # loss_fn casts down itself (`out.bfloat16()`): its own rounding stays, and the check in it stands
    total = sum((loss.double().cpu() * weight for loss, weight in losses), torch.zeros((), dtype=torch.float64))
    return total, whole.double().cpu()


def _autocast_off_on_cuda() -> Any:
    return torch.autocast("cuda", enabled=False) if torch.cuda.is_available() else contextlib.nullcontext()
