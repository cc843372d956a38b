"""Checkpointing flags: whether the current stage call is a checkpointed forward or a recompute."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import ContextManager, Iterator

CHECKPOINT_MODES = ("always", "except_last", "never")

_state = threading.local()


def is_checkpointing() -> bool:
    """True while a stage runs a forward whose activations are dropped, to be recomputed later."""
    return getattr(_state, "checkpointing", False)


def is_recomputing() -> bool:
    """True while a stage recomputes a checkpointed forward, during backward."""
    return getattr(_state, "recomputing", False)


@contextmanager
def _flag(name: str) -> Iterator[None]:
    previous = getattr(_state, name, False)
    setattr(_state, name, True)
    try:
        yield
    finally:
        setattr(_state, name, previous)


def checkpointing() -> ContextManager[None]:
    return _flag("checkpointing")


def recomputing() -> ContextManager[None]:
    return _flag("recomputing")


def checkpoint_stop(mode: str, micro_batches: int) -> int:
    """Micro-batches below this index are checkpointed.

    'except_last' leaves the last one out: its backward comes first, right after the forward,
    so recomputing it would buy no memory.
    """
    return {"always": micro_batches, "except_last": micro_batches - 1, "never": 0}[mode]
