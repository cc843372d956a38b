"""Where a model's output holds its own loss: the output itself, the first item of a tuple or list, or its `loss` key or field."""
from __future__ import annotations

from typing import Any, Callable

# How the own loss came from the losses of two parts of the example where it was their sum but the graph
# does not make it one on every batch (a sum divided by a count the model is given): a mean of
# the micro-batches' losses is then wrong for certain, their sum right on the example at least.
SUMMED_ON_EXAMPLE = "sum on the example"


def own_loss_in(output: Any, is_leaf: Callable[[Any], bool], zero_dim: Callable[[Any], bool]) -> Any:
    """The part of `output` that is the model's own loss, or None.

    `output` is what a call returned, or a program's template of it; `is_leaf` tells a value of
    the graph (a tensor, or a template's reference to one) and `zero_dim` one of no dims. The
    output itself, or the first item of a tuple or list (`(loss, logits)`), is the loss only
    where it is such a value of no dims; a `loss` key or field is, whatever it holds (the
    callers say what is wrong with it)."""
    if is_leaf(output):
        return output if zero_dim(output) else None
    if type(output) in (tuple, list):
        first = output[0] if output else None
        return first if first is not None and is_leaf(first) and zero_dim(first) else None
    return output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
