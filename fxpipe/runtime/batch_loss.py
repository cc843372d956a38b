"""The batch's loss in a train step: the micro-batches' losses summed on the loss stage, and
checked against the loss of the whole batch's outputs."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from fxpipe.core.microbatch import leaves_of
from fxpipe.runtime.call import Call, given_values, rebuild
from fxpipe.runtime.losses import LeafGrads, check_combined_loss, check_gatherable, describe, loss_of, own_loss
from fxpipe.runtime.step import Step


def loss_and_outputs(
    call: Call, step: Step, loss_fn: Any, target: Any, reduction: str, return_outputs: bool
) -> tuple[torch.Tensor, Any]:
    """The batch's loss from the micro-batches' (on the loss stage), and the outputs when asked
    or when the combination is checked: raises ValueError if it does not match."""
    losses = [step.losses[i] for i in range(len(call.sizes))]
    total = torch.stack([loss.to(losses[-1].device) for loss in losses]).sum()
    outputs = None
    # Every step: whether a loss combines over micro-batches can depend on the batch (a mean
    # over the targets not ignored, whose count differs between micro-batches in some steps).
    check = loss_fn is not None and len(call.sizes) > 1  # one micro-batch: nothing to combine
    if return_outputs or check:
        check_gatherable(call.program.template, step.outputs[0], len(call.sizes), asked=return_outputs)
        gathered = call.gather([step.outputs[i] for i in range(len(call.sizes))])
        outputs = gathered.rebuild(gathered.tensors)
        if check:
            assert loss_fn is not None
            check_combined_loss(loss_fn, outputs, target, total, reduction)
    return total, outputs


def micro_batch_losses(
    call: Call, loss_fn: Optional[Callable[[Any, Any], torch.Tensor]], targets: list[Any], weights: list[float], kept: LeafGrads
) -> Callable[[int, dict[str, Any]], torch.Tensor]:
    """The loss of micro-batch i from its outputs' values, weighted to combine into the batch's
    (`kept` notes what else its backward reaches)."""
    program = call.program

    def micro_batch_loss(i: int, values: dict[str, Any]) -> torch.Tensor:
        output = rebuild(program.template, values, given_values(program, call.micro_batches[i]))
        loss = loss_of(loss_fn, output, targets[i]) if loss_fn is not None else own_loss(output)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError(f"the loss of a micro-batch must be a 0-dim tensor, not {describe(loss)}")
        scaled = loss * weights[i]
        if not call.grad:
            return scaled.detach()
        if scaled.requires_grad:
            kept.note(scaled, leaves_of(values))
        return scaled

    return micro_batch_loss
