"""The batch's loss in a train step: the micro-batches' losses summed on the loss stage, and
checked against the loss of the whole batch's outputs."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.utils._pytree import tree_leaves

from fxpipe.core.microbatch import leaves_of
from fxpipe.core.own_loss import SUMMED_ON_EXAMPLE
from fxpipe.runtime.backward_tasks import add_grads
from fxpipe.runtime.call import Call, given_values, rebuild
from fxpipe.runtime.gather import ValueRef
from fxpipe.runtime.loss_gradients import check_combined_gradient
from fxpipe.runtime.loss_state import LossStateKept
from fxpipe.runtime.loss_writes import LossWrites
from fxpipe.runtime.losses import (
    LeafGrads, about_sizes, ambiguous_split_note, check_combined_loss, check_gatherable, describe, generators_kept, loss_of, own_loss, own_loss_ref, own_loss_whole_in,
    sizes_note, with_own_loss_whole,
)
from fxpipe.runtime.step import Step


def loss_and_outputs(
    call: Call, step: Step, loss_fn: Any, target: Any, reduction: str, return_outputs: bool
) -> tuple[torch.Tensor, Any]:
    """The batch's loss from the micro-batches' (on the loss stage), and the outputs when asked
    or when the combination is checked: raises ValueError if it does not match."""
    losses = [step.losses[i] for i in range(len(call.sizes))]
    # Outside the caller's autocast: its rule for stack refuses a half dtype not its own (a loss in
    # float16 under bfloat16's autocast), which the plain model's one loss never meets.
    with torch.autocast(losses[-1].device.type, enabled=False):
        total = torch.stack([loss.to(losses[-1].device) for loss in losses]).sum()
    outputs = None
    # Every step: whether a loss combines over micro-batches can depend on the batch (a mean
    # over the targets not ignored, whose count differs between micro-batches in some steps).
    check = loss_fn is not None and len(call.sizes) > 1  # one micro-batch: nothing to combine
    if return_outputs or check:
        template, per_micro_batch = call.program.template, [step.outputs[i] for i in range(len(call.sizes))]
        leaf = call.program.own_loss_leaf
        own = own_loss_ref(template, leaf) if loss_fn is None and call.slices is None else None
        if own is not None:  # the model's own loss, returned as the step combined it
            template = with_own_loss_whole(template, leaf)
            per_micro_batch = [own_loss_whole_in(values, own, leaf, total.detach()) for values in per_micro_batch]
        check_gatherable(template, per_micro_batch[0], len(call.sizes), asked=return_outputs)
        gathered = call.gather(per_micro_batch, template)
        outputs = gathered.rebuild(gathered.tensors)
        if check:
            assert loss_fn is not None
            parts = step.loss if isinstance(step.loss, MicroBatchLoss) else None

            def pieces() -> list[tuple[Any, Any, float]]:  # for a check in float64, made only where it runs
                assert parts is not None
                return [(parts.output(i, values), parts.targets[i], parts.weights[i]) for i, values in enumerate(per_micro_batch)]

            key = parts.writes.key if parts is not None else _loss_key(loss_fn)
            writes = call.program.losses_writing.get(key, True)
            note = ambiguous_split_note(target, parts.targets[0], call.batch) if parts is not None and call.slices is None else ""
            check_combined_loss(
                loss_fn, outputs, target, total, reduction, sliced=call.slices is not None, pieces=pieces if parts is not None else None, writes=writes,
                note=note,
            )  # fmt: skip
            if parts is not None and call.slices is None and call.grad and key not in call.program.gradients_checked:
                # Once per loss function: a loss whose gradient does not combine where its value
                # does is so by its code (a detached statistic of the batch), not by a batch. A loss
                # that draws is not checked; what a loss object keeps is put back as the value's
                # check left it (a loss that keeps its last value for logging keeps the batch's).
                state = LossStateKept(loss_fn, calls=2)
                try:
                    with generators_kept(total.device) as drew:
                        check_combined_gradient(
                            loss_fn, per_micro_batch, lambda values: call.gather(values, template), parts.output, parts.targets,
                            parts.weights, target, reduction, drew, writes,
                        )
                finally:
                    state.put_back()
                call.program.gradients_checked.add(key)
    return total, outputs


def add_returned_grads(step: Step, input_grads: list[dict[str, Any]]) -> None:
    """Into the step's gradients of the caller's inputs, those its losses gave the inputs the
    model returns as they are (`MicroBatchLoss._returned_leaf`)."""
    if isinstance(step.loss, MicroBatchLoss):
        for i, leaves in step.loss.returned_leaves.items():
            for name, leaf in leaves.items():
                if leaf.grad is not None and i < len(input_grads):
                    input_grads[i][name] = add_grads(input_grads[i].get(name), leaf.grad)


def write_targets_back(step: Step) -> None:
    """Once a train step is done, and refused by nothing: what its loss wrote into its copies of
    the target, into the caller's (`loss_writes.LossWrites`)."""
    if isinstance(step.loss, MicroBatchLoss):
        step.loss.writes.write_back()


def _loss_key(loss_fn: Any) -> Any:
    """What identifies a loss function's computation: a function's code and the settings its
    closure holds (a lambda made anew at each step is the same one), a partial's function and
    arguments, a loss module's type and settings; a tensor among them counts by its shape and
    dtype (a statistic given anew at each step), a number or another object by its type (a
    temperature annealed at every step, a loss kept for logging), a flag or a name by its value."""
    if isinstance(loss_fn, functools.partial):
        return (_loss_key(loss_fn.func), tuple(map(_setting, loss_fn.args)), tuple(sorted((k, _setting(v)) for k, v in loss_fn.keywords.items())))
    if isinstance(loss_fn, torch.nn.Module):
        return (type(loss_fn), tuple(sorted((k, _setting(v)) for k, v in vars(loss_fn).items() if not k.startswith("_"))))
    code = getattr(loss_fn, "__code__", None)
    if code is None:
        return loss_fn
    cells = getattr(loss_fn, "__closure__", None) or ()
    return (code, tuple(_setting(_content(cell)) for cell in cells), _setting(getattr(loss_fn, "__self__", None)))


def _setting(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if value is None or isinstance(value, (bool, str)):
        return value
    return type(value)  # (a number by its type: a temperature annealed at every step is one loss function)


def _content(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not yet filled
        return None


@dataclass
class MicroBatchLoss:
    """The loss of micro-batch i from its outputs' values, weighted to combine into the batch's
    (`kept` notes what else its backward reaches)."""

    call: Call
    loss_fn: Optional[Callable[[Any, Any], torch.Tensor]]
    targets: list[Any]
    weights: list[float]
    kept: LeafGrads
    target_note: str = ""  # told to a loss that fails: how the target's tensors were given to each micro-batch
    across: bool = False  # the step runs across processes (only the loss stage's rank runs the loss)
    overlapped: bool = False  # a batch of a loop whose steps overlap (2bw)

    def __post_init__(self) -> None:
        key = _loss_key(self.loss_fn) if self.loss_fn is not None else None
        program = self.call.program
        caller_copies = frozenset(name for stage in program.stages for name in stage.state_outputs | stage.caller_views)
        self.writes = LossWrites(program.losses_writing, key, self.across, self.overlapped, caller_copies)
        # The inputs and buffers the model returns as they are (`return out, self.memory`): the
        # loss may write them too.
        self.returned = {ref.name for ref in tree_leaves(program.template) if isinstance(ref, ValueRef) and ref.given}
        self.returned_leaves: dict[int, dict[str, torch.Tensor]] = {}  # see `_returned_leaf`

    def _returned_leaf(self, i: int, name: str, value: Any) -> Any:
        """An input the model returns as it is, computed with gradients (a non-leaf): a leaf of its
        own for the loss, whose gradient goes into the input's with the stages' (`add_returned_grads`),
        once through the input's graph, as the plain model's one backward goes."""
        if not (isinstance(value, torch.Tensor) and value.requires_grad and value.grad_fn is not None and self.call.grad):
            return value
        leaf = value.detach().requires_grad_()
        self.returned_leaves.setdefault(i, {})[name] = leaf
        return leaf

    def output(self, i: int, values: dict[str, Any]) -> Any:
        """Micro-batch i's output, as the model returns it, from its values."""
        program = self.call.program
        return rebuild(program.template, values, given_values(program, self.call.micro_batches[i]))

    def __call__(self, i: int, values: dict[str, Any]) -> torch.Tensor:
        whole = given_values(self.call.program, self.call.micro_batches[i])
        returned = {name: self._returned_leaf(i, name, whole[name]) for name in self.returned}
        given = self.writes.handed(values, returned, self.targets[i])
        output = rebuild(self.call.program.template, given.values, {**whole, **given.returned} if returned else whole)
        loss_fn = self.loss_fn
        try:
            loss = loss_of(loss_fn, output, given.target) if loss_fn is not None else own_loss(output)
        except Exception as error:
            refusal = self.writes.refusal(error, given, loss_fn)
            if refusal is not None:
                raise refusal from error
            if not getattr(error, "fxpipe_refusal", False):
                for note in (sizes_note(output, given.target), self.target_note if about_sizes(error) else ""):
                    if note:
                        error.add_note(note)
            raise
        self.writes.note(i, values, given)
        if isinstance(loss, torch.Tensor) and loss.dim() > 0 and loss.numel() == 1:
            # (1,): a count given as a tensor of one element (Hugging Face's num_items_in_batch
            # under DataParallel); backward takes one element as it takes a 0-dim tensor.
            loss = loss.reshape(())
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            whose = "loss_fn" if loss_fn is not None else "the model's own loss"
            raise ValueError(
                f"the loss of a micro-batch must be a tensor of one element, and {whose} gave {describe(loss)}.\nHow to fix: "
                + ("return the loss alone (a loss returned with values to log, `(loss, logs)`: loss_fn=lambda out, y: "
                   "my_loss(out, y)[0], and log them from the outputs, train_step(..., return_outputs=True)); a loss per "
                   "sample: reduce it in loss_fn (.mean(), or .sum() with reduction='sum')." if loss_fn is not None else
                   "pass loss_fn=..., which computes the loss from the outputs.")
            )
        scaled = loss * self.weights[i]
        if not self.call.grad:
            return scaled.detach()
        if scaled.requires_grad:
            self.kept.note(scaled, leaves_of(values))
        return scaled


def own_loss_reduction(call: Call, reduction: str, sliced: bool) -> str:
    """How the model's own loss combines over micro-batches: as compiling found it on the
    example's two parts where it could tell ('sum' for a sum over samples, or for a sum divided by
    a count given for the whole batch, as `num_items_in_batch`), else as `reduction` says.
    Sliced calls keep `reduction`: their slices' losses are not the parts'."""
    found = None if sliced else call.program.own_loss_combines
    if found == "mean" and reduction == "sum":
        raise ValueError(
            "reduction='sum', but the model's own loss is a mean over samples: on the example it is the mean of its "
            "parts' losses (weighted by their sizes), not their sum. Summed, the micro-batches' losses would give "
            f"{len(call.sizes)} times the plain model's loss and gradients.\nHow to fix: leave reduction at 'mean' (the default)."
        )
    if reduction == "sum" and not sliced and _own_counts(call) is not None:
        raise ValueError(
            "reduction='sum', but the model's own loss is a mean cross-entropy over the targets it counts (those not "
            "ignore_index): summed, the micro-batches' means would give about "
            f"{len(call.sizes)} times the plain model's loss and gradients.\nHow to fix: leave reduction at 'mean' (the "
            "default), which weights each micro-batch's mean by the targets it counts."
        )
    if found == SUMMED_ON_EXAMPLE and reduction == "mean":
        raise ValueError(
            "reduction='mean', but on the example the model's own loss is the sum of its parts' losses, not their "
            f"mean: averaged, the micro-batches' losses would give 1/{len(call.sizes)} of the plain model's loss and "
            "gradients.\nHow to fix: pass reduction='sum' (for a loss summed over samples, or divided by a count given "
            "to the model for the whole batch, as num_items_in_batch), or pass loss_fn."
        )
    return found if found in ("sum", "mean") else reduction


def _own_counts(call: Call) -> Optional[list[float]]:
    """How many targets the model's own mean cross-entropy counts in each micro-batch (with class
    weights, their weights' sum); None where its loss is no such mean, or its target holds class
    probabilities."""
    counter = call.program.loss_counter
    if counter is None:
        return None
    found = [counter(values) for values in call.micro_batches]
    counts = [count for count in found if count is not None]
    return counts if len(counts) == len(found) else None


def own_mean_size(call: Call, reduction: str) -> float:
    """What this call's mean loss is a mean over, for the replicas' shares of the whole batch's:
    the targets the model's own mean cross-entropy counts (passes/loss_counts.py), else the samples."""
    counts = _own_counts(call) if reduction == "mean" and call.slices is None else None
    return sum(counts) if counts is not None else sum(call.sizes)


def own_mean_weights(call: Call) -> Optional[list[float]]:
    """Each micro-batch's share of the batch's loss where the model's own loss is a mean
    cross-entropy over the targets it counts (passes/loss_counts.py): its count over the
    batch's, so that the sum of the weighted losses is the plain model's mean; None where the
    loss is no such mean, or one micro-batch holds the batch."""
    counts = _own_counts(call)
    if counts is None or len(call.micro_batches) == 1:
        return None
    total = sum(counts)
    if total == 0:  # no target counts: the plain model's mean is NaN too
        return None
    empty = [i for i, count in enumerate(counts) if count == 0]
    if empty:
        raise ValueError(
            f"the model's own loss is a mean over the targets it counts (not ignore_index), and micro-batch"
            f"{'es' if len(empty) > 1 else ''} {', '.join(map(str, empty))} of this batch count{'' if len(empty) > 1 else 's'} "
            "none: its mean is 0 / 0, whose gradient is NaN, where the plain model's mean over the whole batch is "
            "defined.\nHow to fix: fewer chunks, or batches whose micro-batches each hold a counted target."
        )
    return [count / total for count in counts]
