"""Putting back what a failed step wrote: the buffers its stages may write, the caller's inputs it
wrote into, and what modules called whole assigned."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from fxpipe.compiled.program import StageRuntime
from fxpipe.runtime.checkpoint import Attributes, attributes_of, put_back_attributes

# Bytes of buffers a step copies to put back if it fails: running statistics and counters are
# far below; a larger buffer (a queue of features) would cost a copy on every step, and keeps
# what a failed step wrote.
PUT_BACK_LIMIT = 16 << 20


class Rollback:
    """What a step's forwards may write, as it was before them: a step that fails puts it back, so
    that it changes nothing (as it adds nothing to `.grad`)."""

    def __init__(self) -> None:
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.inputs: list[tuple[torch.Tensor, torch.Tensor]] = []  # the caller's, as written back
        self.attributes: Attributes = []

    def keep(self, stages: Sequence[StageRuntime]) -> None:
        """Copy the buffers `stages` may write (up to PUT_BACK_LIMIT bytes), and note the
        attributes of the modules they call whole."""
        seen: dict[int, torch.Tensor] = {}
        wholes: dict[int, nn.Module] = {}
        for stage in stages:
            seen.update({id(b): b for b in stage.writable_buffers.values() if not b.is_meta})
            wholes.update({id(m): m for m in stage.whole_modules})
        if sum(b.numel() * b.element_size() for b in seen.values()) <= PUT_BACK_LIMIT:
            self.buffers = [(b, b.detach().clone()) for b in seen.values()]
        self.attributes = attributes_of(list(wholes.values()))  # a counter a module called whole keeps

    def write_input(self, target: torch.Tensor, final: torch.Tensor) -> None:
        """Write a stage's final value of an input into the caller's tensor, keeping what it was."""
        self.inputs.append((target, target.detach().clone()))
        copy_into(target, final)

    def put_back(self) -> None:
        """What the step's forwards wrote into buffers and into the caller's inputs, and assigned
        to the attributes of modules called whole, undone."""
        with torch.no_grad():
            for buffer, values in self.buffers:
                if buffer.shape != values.shape:  # resized in place (an observer's first statistics)
                    buffer.resize_(values.shape)
                # Through `.data`, which moves no version counter: an earlier call's backward that
                # saved the buffer (BatchNorm saves its running statistics, which its kernel
                # writes without a bump) runs after a failed call as after none.
                buffer.data.copy_(values)
            for target, values in reversed(self.inputs):
                copy_into(target, values)
        put_back_attributes(self.attributes)


def copy_into(target: torch.Tensor, values: torch.Tensor) -> None:
    """Values into a caller's tensor, outside autograd; an inference tensor is written in
    inference mode, the only one that may write it."""
    with torch.inference_mode() if target.is_inference() else torch.no_grad():
        target.copy_(values)
