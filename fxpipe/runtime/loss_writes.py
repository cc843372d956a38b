"""What a loss function writes in place of what it is given: copies handed to it, its writes learned, the caller's target written back.

A loss that writes the outputs or the target in place (`logits.div_(t)`, `pred.clamp_(eps)`,
`y.mul_(1 - eps)`) is handed copies of them: the outputs a stage sent are leaves, which autograd
lets no one write; and the step keeps the outputs as the model returned them, and the target as
given, for the checks of the batch's loss, which call the loss on them again. What the loss
wrote into its copies of the target, and of inputs or buffers the model returns as they are,
goes into the caller's once the step is done, as the plain model's loss writes it.

    targets, returned inputs and buffers   copied on every call (small beside the outputs, as a rule)
    the stages' outputs                    copied on the first step of each loss function, which
                                           learns whether it writes; one that does not is handed
                                           them as they are from then on, and one that writes
                                           later after all refuses that step, and gets copies
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from fxpipe.core.microbatch import leaves_of
from fxpipe.runtime.loss_state import equal_values
from fxpipe.runtime.losses import handed

_LEAF_WRITTEN = "leaf Variable that requires grad is being used in an in-place operation"


@dataclass
class Handed:
    """What one call of the loss reads: the stages' output values and the inputs or buffers the
    output returns as they are (copies, where `copied`), the target (copies), and, of outputs
    handed as they are, each tensor with its version then; with the tensors of each, found once
    (a walk of a tree costs as much as a small loss)."""

    values: Any
    returned: Any
    target: Any
    copied: bool
    watched: list[tuple[torch.Tensor, int]]
    tensors: dict[str, list[torch.Tensor]]  # "values", "returned", "target": the originals'; "given ...": the copies'


class LossWrites:
    """One step's calls of a loss function (key `key` in `table`: whether it writes the outputs)."""

    def __init__(self, table: dict[Any, bool], key: Any, across: bool, overlapped: bool = False, caller_copies: frozenset[str] = frozenset()) -> None:
        self.table, self.key, self.across, self.overlapped = table, key, across, overlapped
        self.caller_copies = caller_copies  # the stages' outputs that are, in the plain model, the caller's memory (a buffer, a view of an input)
        self.outputs_copied = key is not None and table.get(key) is not False
        # micro-batch: (what the caller holds, the copy the loss was handed), for `write_back`
        self.written: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.any_written = False

    def handed(self, values: dict[str, Any], returned: dict[str, Any], target: Any) -> Handed:
        """What the loss reads of the output (`values`, the stages'; `returned`, inputs or buffers
        returned as they are) and of `target`. Outputs made under inference_mode have no versions
        to show a write: they are copied too."""
        if self.key is None:
            return Handed(values, returned, target, False, [], {})
        found = {"values": _tensors(values), "returned": _tensors(returned), "target": _tensors(target)}
        copied = self.outputs_copied or any(t.is_inference() for t in found["values"] + found["returned"])
        watched = [] if copied else [(t, t._version) for t in found["values"]]
        given = Handed(handed(values, copied), handed(returned, True) if returned else returned, handed(target, True), copied, watched, found)
        found.update({"given values": _tensors(given.values) if copied else [], "given returned": _tensors(given.returned), "given target": _tensors(given.target)})
        return given

    def refusal(self, error: BaseException, given: Handed, loss_fn: Any) -> Optional[ValueError]:
        """For an error of the loss: the refusal to raise where it wrote an output it was handed
        as it is (a leaf, which autograd refuses to write); None otherwise, and where the leaf may
        be another one the loss holds (a loss module's own parameter: autograd's error stands)."""
        if self.key is None or given.copied or _LEAF_WRITTEN not in str(error):
            return None
        if not any(t.is_leaf and t.requires_grad for t in given.tensors["values"]):
            return None
        if isinstance(loss_fn, torch.nn.Module) and any(p.requires_grad for p in loss_fn.parameters()):
            return None
        self.table[self.key] = True
        return ValueError(_LATE)

    def note(self, i: int, values: dict[str, Any], given: Handed) -> None:
        """After micro-batch i's loss: what it wrote, learned; refused where a write cannot be
        kept as the plain model keeps it."""
        if self.key is None:
            return
        t = given.tensors
        kept = list(zip(t["returned"] + t["target"], t["given returned"] + t["given target"]))  # (caller's, copy)
        written = [(held, copy) for held, copy in kept if _written(copy, held)]  # (by value too: `.data` moves no version)
        wrote_returned = any(held is r for held, _ in written for r in t["returned"])
        wrote_values = any(_differs(c, o) for c, o in zip(t["given values"], t["values"])) if given.copied else any(x._version != v for x, v in given.watched)
        wrote = wrote_values or wrote_returned
        if (wrote or written) and _aliased(t["values"] + t["returned"] + t["target"]):
            raise ValueError(_ALIASED)
        if written and self.across:
            raise ValueError(_ACROSS)
        if any(held.is_leaf and held.requires_grad for held, _ in written):
            raise ValueError(_LEAF)  # (a parameter the model returns, an input that requires grad: as autograd refuses)
        if wrote_returned and self.overlapped and any(held._base is None for held, _ in written if any(held is r for r in t["returned"])):
            raise ValueError(_OVERLAPPED)  # (a buffer, an input kept whole: not a piece of this batch's input)
        if given.copied and any(_wrote(given.values[name], values[name]) for name in self.caller_copies & values.keys()):
            raise ValueError(_STATE_COPY)
        if wrote_values and not given.copied:
            self.table[self.key] = True
            raise ValueError(_LATE)
        if wrote_returned or (self.outputs_copied and not any(x.is_inference() for x in t["given values"])):  # (no versions to read there)
            self.table[self.key] = self.table.get(self.key, False) or wrote
        self.written[i] = kept  # (a piece left as it was counts in `write_back`)
        self.any_written = self.any_written or bool(written)

    def write_back(self) -> None:
        """What the loss wrote into its copies of the micro-batches' targets, and of the inputs or
        buffers the output returns as they are, into the caller's (a micro-batch's piece is a view
        of the caller's tensor): once the step is done, and before its gradients are accumulated.
        A tensor every micro-batch gets whole (a buffer, a target's class weights) must have been
        written alike by each: refused otherwise (each wrote its own copy, where the plain model's
        one loss writes it once)."""
        if not self.any_written:
            self.written.clear()
            return
        given: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # each piece, with what each micro-batch left in its copy
        for _, pairs in sorted(self.written.items()):
            for piece, left in pairs:
                given.setdefault(id(piece), (piece, []))[1].append(left)
        self.written.clear()
        writes = [(piece, each) for piece, each in given.values() if any(_written(left, piece) for left in each)]
        if any(any(not equal_values(each[0], other) for other in each[1:]) for _, each in writes):
            raise ValueError(_APART)  # (a micro-batch that wrote nothing left it as it was: apart too)
        if any(stride == 0 and n > 1 for piece, _ in writes for n, stride in zip(piece.shape, piece.stride())):
            raise ValueError(_BROADCAST)
        for piece, each in writes:
            with torch.inference_mode() if piece.is_inference() else torch.no_grad():
                piece.copy_(each[-1])


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):  # (the common cases, without a walk of the tree)
        return [tree]
    if isinstance(tree, dict) and all(isinstance(v, torch.Tensor) for v in tree.values()):
        return list(tree.values())
    return [t for t in leaves_of(tree) if isinstance(t, torch.Tensor)]


def _wrote(copies: Any, originals: Any) -> bool:
    """Whether the loss wrote any of the copies it was handed of `originals` (by their versions)."""
    return any(_differs(c, o) for c, o in zip(_tensors(copies), _tensors(originals)))


def _written(copy: torch.Tensor, original: torch.Tensor) -> bool:
    """`_differs`, or a write through `.data`, which moves no version (for the targets and what the
    model returns as it is, small as a rule: compared by value)."""
    return _differs(copy, original) or not equal_values(copy, original)


def _differs(copy: torch.Tensor, original: torch.Tensor) -> bool:
    """A copy written since it was made: by its version, or by value where it has none (made
    under inference_mode)."""
    return copy._version > 0 if not copy.is_inference() else not equal_values(copy, original)


def _aliased(tensors: list[torch.Tensor]) -> bool:
    """Whether two of the tensors share an element (one tensor twice, or views that overlap: not
    `mean, logvar = h.chunk(2, -1)`, whose halves are apart)."""
    by_storage: dict[int, list[torch.Tensor]] = {}
    for t in tensors:
        if t.layout == torch.strided and t.numel() and not t.is_meta:
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    return any(_overlap(group) for group in by_storage.values() if len(group) > 1)


_MARKED_AT_MOST = 1 << 24  # elements: larger views of one memory are taken to overlap


def _overlap(views: list[torch.Tensor]) -> bool:
    """Whether views of one memory share an element: each marks the elements it covers."""
    if len({t.dtype for t in views}) > 1 or sum(t.numel() for t in views) > _MARKED_AT_MOST:
        return True
    if any(stride == 0 and n > 1 for t in views for n, stride in zip(t.shape, t.stride())):
        return True  # (a broadcast view: its elements share memory among themselves)
    size = views[0].untyped_storage().nbytes() // views[0].element_size()
    covered = torch.zeros(size, dtype=torch.int32)
    for t in views:
        covered.as_strided(t.shape, t.stride(), t.storage_offset()).add_(1)
    return bool((covered > 1).any())


_LATE = (
    "loss_fn wrote the outputs it is given in place at this step, and not at the first step of this loss function, "
    "which handed it copies to learn whether it writes. The step is refused, and no gradient was accumulated; from now "
    "on it is handed copies.\nHow to fix: call train_step again (a train_steps loop: start it again from this batch)."
)
_ALIASED = (
    "loss_fn writes in place what it is given, and the outputs or the target hold one tensor twice, or views that share "
    "elements: the loss is handed a copy of each (the outputs a stage sent are leaves, which autograd lets no one write), "
    "so a write into one would not reach the other as it does in the plain model. The step is refused, and no gradient "
    "was accumulated.\nHow to fix: write a copy in loss_fn (`out = out.clone()` before writing it), or return (and give) "
    "each tensor once."
)
_ACROSS = (
    "loss_fn writes its target, or an input or buffer the model returns as it is, in place: across processes only the "
    "rank of the loss stage runs the loss, and what every other rank holds would stay as given, where the plain model's "
    "is written. The step is refused, and no gradient was accumulated.\nHow to fix: write a copy in loss_fn (`y = "
    "y.clone()` before writing it)."
)
_OVERLAPPED = (
    "loss_fn writes in place an input or a buffer the model returns as it is: in a loop whose steps overlap (2bw) the "
    "next batch's forward runs before this batch's loss, and would read it as it was, where the plain loop's reads it "
    "written. The loop is refused at this batch.\nHow to fix: write it outside loss_fn (after_step= of train_steps), "
    "or train with schedule='1f1b'."
)
_STATE_COPY = (
    "loss_fn writes in place an output that is, in the plain model, the caller's memory: a buffer forward wrote, a view "
    "of a buffer or of an input (`x[:, :2]`, `x.detach()`), a tensor an input holds (`pack['m']`). The pipeline returns a "
    "copy of it, so the loss's write would not reach the buffer or the input as in the plain model. The step is "
    "refused, and no gradient was accumulated.\nHow to fix: write a copy in loss_fn, or write the buffer or the input "
    "itself outside loss_fn."
)
_BROADCAST = (
    "loss_fn writes in place a tensor of the target that is a broadcast view (`t.expand(...)`), whose elements share "
    "memory: no one can write it in place (the plain model's loss raises so). The step is refused, and no gradient "
    "was accumulated.\nHow to fix: give the target made whole (`t.expand(...).clone()`), or write a copy in loss_fn."
)
_LEAF = (
    "loss_fn writes in place a parameter the model returns as it is, or an input (or target) that requires grad: a "
    "leaf that requires grad, which autograd lets no one write (the plain model's loss raises so). The step is "
    "refused, and no gradient was accumulated.\nHow to fix: write a copy in loss_fn (`w = w.clone()` before writing it)."
)
_APART = (
    "loss_fn writes in place a tensor that every micro-batch gets whole (a buffer or an input the model returns as it "
    "is, a tensor of the target with no dim of the batch's size), and the micro-batches wrote different values into it: "
    "the plain model's one loss writes it once, from the whole batch. The step is refused, and no gradient was "
    "accumulated.\nHow to fix: update it outside loss_fn, once per step (after train_step), or use chunks=1."
)
