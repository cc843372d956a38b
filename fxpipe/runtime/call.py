"""One call of a pipeline, prepared: its inputs split into micro-batches, and what it asks of autograd."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch import nn

from fxpipe.compiled.program import Program
from fxpipe.core.microbatch import Dims
from fxpipe.runtime.autograd import InputSlot
from fxpipe.runtime.context import CallerContext
from fxpipe.runtime.gather import Gathered


@dataclass
class Call:
    """One call's inputs, split into micro-batches, and what it asks of autograd."""

    program: Program
    values: dict[str, Any]
    batch: Optional[int]
    dims: Dims
    sizes: list[int]
    micro_batches: list[dict[str, Any]]
    context: CallerContext
    input_slots: list[InputSlot]
    params: list[nn.Parameter]
    grad: bool
    gather: Callable[[list[dict[str, Any]]], Gathered]
