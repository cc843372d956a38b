"""What a micro-batch's forward keeps for its backward, and the refusals of in-place writes that would give it another forward's backward."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from fxpipe.core.wording import listed
from fxpipe.runtime.checkpoint import Attributes
from fxpipe.runtime.weight_grad import PendingWeights


@dataclass
class Saved:
    """What a forward keeps for its backward, per stage and micro-batch."""

    inputs: list[Any]
    outputs: Optional[tuple[Any, ...]]  # None when checkpointed: recomputed in backward
    buffers: Optional[dict[str, torch.Tensor]] = None  # for the recompute: as the forward saw them
    pending: Optional[PendingWeights] = None  # between I and W: what W starts from
    attributes: Optional[Attributes] = None  # for the recompute: of modules called whole, as the forward saw them
    versions: Optional[list[int]] = None  # for the recompute: of the stage's parameters, as the forward saw them
    buffer_versions: Optional[list[int]] = None  # the same, of the buffers it reads that no stage writes
    # The caller's tensors it reads, by input name, with their versions then: for the recompute,
    # and to name one written since where autograd finds a saved tensor written.
    input_versions: list[tuple[str, torch.Tensor, int]] = field(default_factory=list)
    # For a compiled stage's backward: the positions of the outputs a gradient reaches.
    given: Optional[frozenset[int]] = None


def refuse_parameters_written_since(params: list[torch.Tensor], versions: Optional[list[int]]) -> None:
    """A recompute reads the parameters as they are now: one written in place since its forward
    (an optimizer's step between forward and backward) would give the backward of another
    forward. The plain model's backward raises for a parameter autograd saved, and otherwise
    reads what it saved of the forward that ran."""
    written = [p for p, version in zip(params, versions or ()) if p._version != version]
    if written:
        shapes = listed((str(tuple(p.shape)) for p in written), most=4)
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"{len(written)} parameter(s) of this stage (shapes {shapes}) were written in place between its forward "
            "and its backward, and its recompute would not see what its forward saw.\nHow to fix: write parameters "
            "after the backward (optimizer.step() after loss.backward()), or use checkpoint='never', whose backward "
            "reads what its forward kept, as the plain model's does. A forward that writes its own parameters "
            "(`self.w.clamp_(...)` under no_grad) writes them once per micro-batch: write them before the call."
        )


def refuse_buffers_written_since(buffers: dict[str, torch.Tensor], versions: Optional[list[int]]) -> None:
    """A recompute reads the buffers as they are now: one that the model only reads, written in
    place since its forward (`load_state_dict`, a `fill_`), would give the backward of another
    forward. The plain model's backward raises for a buffer autograd saved, and otherwise reads
    what it saved of the forward that ran."""
    written = [name for (name, b), version in zip(buffers.items(), versions or ()) if b._version != version]
    if written:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"the buffer(s) {', '.join(written)} of this stage, which the model's forward only reads, were written in "
            "place between its forward and its backward (by the caller, or by a backward of the model's own: an "
            "autograd Function's keeping a statistic of its gradient, in another micro-batch), and its recompute "
            "would not see what its forward saw.\nHow to fix: write buffers after the backward (load_state_dict after "
            "loss.backward()), or use checkpoint='never', whose backward reads what its forward kept, as the plain "
            "model's does."
        )


def refuse_inputs_written_since(micro_batch: int, versions: list[tuple[str, torch.Tensor, int]], recomputed: bool = True) -> None:
    """A recompute reads the caller's inputs as they are now: one written in place since its
    forward (a reused input buffer, a second forward into it) would give the backward of another
    forward. The plain model's backward raises for an input autograd saved, as a stage's does
    that is not `recomputed` (called when it did, to say which input it was)."""
    written = sorted({name for name, t, version in versions if t._version != version})
    if not written:
        return
    why = "a checkpointed stage would recompute from the new values" if recomputed else "autograd saved it: the plain model's backward fails alike"
    instead = ", or use checkpoint='never', whose backward reads what its forward kept, as the plain model's does" if recomputed else ""
    raise RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"the pipeline's input {', '.join(map(repr, written))} was written in place between the forward and the "
        f"backward (micro-batch {micro_batch}'s rows), and {why}.\n"
        f"How to fix: write the input after the backward (or pass a copy, x.clone(), to the pipeline){instead}."
    )


def refuse_written_leaves(name: str, written: list[torch.Tensor]) -> None:
    """Under grad mode, an input written in place that requires grad (a micro-batch's slice of
    it): a leaf, or a view of one, as the plain model's write refuses it; any other, since the
    pipeline writes the caller's tensor outside autograd, and a gradient through its value after
    the call would reach what it was before the write."""
    for t in written:
        base = t._base if t._is_view() and t._base is not None else t
        if t.requires_grad and base.is_leaf:
            raise RuntimeError(
                f"the model writes its input {name!r} in place, and it is a leaf that requires grad (or a view of "
                "one): PyTorch refuses that (\"a leaf Variable that requires grad is being used in an in-place "
                "operation\").\nHow to fix: pass a copy (x.clone()), or write a copy of the input in the model."
            )
        if t.requires_grad:
            raise RuntimeError(
                f"the model writes its input {name!r} in place, and it requires grad: the pipeline writes the "
                "caller's tensor outside autograd, so a gradient through its value after the call would miss the "
                "write.\nHow to fix: write a copy of the input in the model (x = x * 2 in place of x.mul_(2)); or, "
                "when the input's gradient is not needed, pass x.detach(), or call the pipeline under torch.no_grad()."
            )
