"""What a front end makes of a model: its graphs by mode, how a call binds to them, and what the trace read."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, TypeVar

import torch.fx as fx
from torch import nn

from fxpipe.compiled.program import Binder
from fxpipe.compiler.binding import MicroBatchCheck
from fxpipe.tracing.attribute_reads import Reads, unnoted
from fxpipe.tracing.mode_reads import ModeReads

T = TypeVar("T")


@dataclass
class Traced:
    """A graph, how a call's arguments map onto its placeholders, and how it was made.

    `graph` was traced in training mode. `eval_graph` was traced in eval mode, and is None when
    its code is the same as `graph`'s (no Python branch on `self.training`): then `graph` serves
    both modes. Both take the same arguments (`bind`), and both read the model's own parameters
    and buffers (the same objects).
    """

    graph: fx.GraphModule
    bind: Binder
    note: Optional[str] = None
    eval_graph: Optional[fx.GraphModule] = None
    fx_failure: str = ""  # why torch.fx could not, where torch.export made the graph
    check_micro_batch: Optional[MicroBatchCheck] = None  # export's guards on a call's micro-batches
    stored_with_grad: frozenset[tuple[str, str]] = frozenset()  # tensors forward stores that require grad
    reads: Optional[Reads] = None  # what the traces read of the modules' attributes, by mode
    attributes: dict[str, Any] = field(default_factory=dict)  # the plain ones, as compiled, by qualified name
    modes_read: ModeReads = field(default_factory=dict)  # what the forward asked of autocast, answered when traced
    eval_only: str = ""  # why training mode could not be traced, where `graph` was traced in eval mode alone
    grad_mode_only: dict[bool, tuple[bool, str]] = field(default_factory=dict)  # by training flag: the grad mode its graph serves alone, and why


@contextmanager
def in_mode(model: nn.Module, training: bool) -> Iterator[None]:
    """The model in training (or eval) mode: as it is when it is in that mode already (modules
    set apart keep their flags), else as `model.train(training)` sets it; flags restored after."""
    flags = [(module, module.training) for module in model.modules()]
    if model.training != training:
        with unnoted():  # a train() override's reads are not the trace's
            model.train(training)
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag


BOTH: tuple[bool, ...] = (True, False)


def in_both_modes(model: nn.Module, make: Callable[[], T], modes: tuple[bool, ...] = BOTH) -> dict[bool, T]:
    """`make()` in training mode (key True) and in eval mode (False): `self.training` branches
    are decided while tracing. With `modes=(False,)`, the eval one serves both keys."""
    made = {}
    for training in modes:
        with in_mode(model, training):
            made[training] = make()
    made.setdefault(True, made[False])
    return made
