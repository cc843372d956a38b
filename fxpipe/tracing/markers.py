"""`pipe_split()`: a mark in a model's forward where a new stage begins.

It does nothing when the model runs (eagerly, scripted or exported); traced, it is a graph node
(the custom op `fxpipe::pipe_split`, kept by torch.export as an op with a side effect), and each
one is a stage boundary of the plan.

    def forward(self, x):
        x = self.encoder(x)
        pipe_split()          # stage 1 begins here
        return self.decoder(x)
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import torch
import torch.fx as fx

from fxpipe.core.scoped import scoped

_library = torch.library.Library("fxpipe", "DEF")
_library.define("pipe_split() -> ()")
_library.impl("pipe_split", lambda: None, "CompositeExplicitAutograd")
_library.impl("pipe_split", lambda: None, "Meta")
SPLIT_OP = torch.ops.fxpipe.pipe_split.default
fx.node.has_side_effect(SPLIT_OP)

_local = threading.local()


@torch.jit.ignore
def pipe_split() -> None:
    """Begin a new pipeline stage here. A no-op when the model runs on its own."""
    tracer: Optional[fx.Tracer] = getattr(_local, "tracer", None)
    if tracer is not None:
        tracer.create_proxy("call_function", SPLIT_OP, (), {})
        return
    SPLIT_OP()


@contextmanager
def marking(tracer: fx.Tracer) -> Iterator[None]:
    """While `tracer` traces on this thread, `pipe_split()` records a node in its graph."""
    with scoped(_local, "tracer", tracer):
        yield


def is_split(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is SPLIT_OP


def cuts_from_markers(order: Sequence[fx.Node]) -> list[int]:
    """Positions in `order` where a stage begins: at each `pipe_split` node."""
    return [i for i, node in enumerate(order) if is_split(node)]
