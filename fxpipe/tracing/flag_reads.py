"""Reads of the modules' `training` flags in an eager run: where the model's code reads none, eval mode runs its code alike.

Compiling runs the model eagerly in each mode to find the Python effects a trace would lose
(fxpipe/compiler/effects.py). A forward whose code never asks whether it is training runs the
same Python in either mode, and the second run can be left out. torch's built-in layers
(`torch/nn/modules`: dropout, batch norm, attention) read their own flags to choose their ops,
and in eval mode they have no Python effect that training mode lacks (no hooks, no assignments,
no writes but their own buffers'): their reads are not counted. Every other read is, from any
thread.

The flag lives in each module's `__dict__`, so a plain read of it goes around any `__getattr__`;
for the length of the block each of the model's classes gets a property in its place (a data
descriptor on the class comes before the instance's `__dict__`).
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator

from torch import nn

_BUILT_IN_LAYERS = os.path.join(os.path.dirname(nn.__file__), "modules", "")


class FlagReads:
    """How many times code other than torch's built-in layers read a `training` flag of the
    model's modules; `unknown` where a class could not be watched (reads may have gone uncounted)."""

    def __init__(self) -> None:
        self.count = 0
        self.unknown = False

    @property
    def none(self) -> bool:
        """Nothing read a flag, for certain."""
        return self.count == 0 and not self.unknown


@contextmanager
def flag_reads_counted(model: nn.Module) -> Iterator[FlagReads]:
    """Within this block, reads of `training` on the modules of `model`'s classes are counted."""
    reads = FlagReads()

    def read(module: nn.Module) -> bool:
        if not sys._getframe(1).f_code.co_filename.startswith(_BUILT_IN_LAYERS):
            reads.count += 1
        try:
            return module.__dict__["training"]  # type: ignore[no-any-return]
        except KeyError:
            raise AttributeError(f"'{type(module).__name__}' object has no attribute 'training'") from None

    def write(module: nn.Module, value: Any) -> None:
        module.__dict__["training"] = value

    watched: list[type] = []
    try:
        for cls in dict.fromkeys(type(m) for m in model.modules()):
            if "training" in vars(cls):  # a class of its own making: a descriptor, or a constant
                reads.unknown = True
                continue
            try:
                setattr(cls, "training", property(read, write))
            except TypeError:  # a class that cannot be changed
                reads.unknown = True
                continue
            watched.append(cls)
        yield reads
    finally:
        for cls in watched:
            delattr(cls, "training")
