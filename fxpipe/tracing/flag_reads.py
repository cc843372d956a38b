"""Reads of the modules' `training` flags in an eager run: where the model's code reads none, eval mode runs its code alike.

Compiling runs the model eagerly in each mode to find the Python effects a trace would lose
(fxpipe/compiler/effects.py). A forward whose code never asks whether it is training runs the
same Python in either mode, and the second run can be left out. torch's built-in layers
(`torch/nn/modules`: batch norm, attention, a dropout of rate 0) read their own flags to choose
their ops, and in eval mode they have no Python effect that training mode lacks (no hooks, no
assignments, no writes but their own buffers'): their reads are not counted. A dropout of a rate
above 0 is the exception: in eval mode it returns its input itself, which an in-place op on its
output then writes. Every other read is counted, from any thread (a read through the module's
`__dict__` goes around the watch).

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
    """How many times a `training` flag of the model's modules was read, by code other than
    torch's built-in layers (or by a dropout of a rate above 0); `unknown` where a class could not
    be watched (reads may have gone uncounted)."""

    def __init__(self) -> None:
        self.count = 0
        self.unknown = False

    @property
    def none(self) -> bool:
        """Nothing read a flag, for certain."""
        return self.count == 0 and not self.unknown


def _returns_its_input_in_eval(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.dropout._DropoutNd) and module.p != 0


@contextmanager
def flag_reads_counted(model: nn.Module) -> Iterator[FlagReads]:
    """Within this block, reads of `training` on the modules of `model`'s classes are counted."""
    reads = FlagReads()

    def read(module: nn.Module) -> bool:
        if not sys._getframe(1).f_code.co_filename.startswith(_BUILT_IN_LAYERS) or _returns_its_input_in_eval(module):
            reads.count += 1
        try:
            return module.__dict__["training"]  # type: ignore[no-any-return]
        except KeyError:
            raise AttributeError(f"'{type(module).__name__}' object has no attribute 'training'") from None

    def write(module: nn.Module, value: Any) -> None:
        module.__dict__["training"] = value

    watched: list[type] = []
    classes = list(dict.fromkeys(type(m) for m in model.modules()))
    # A class with a `training` of its own making (a descriptor, a constant), or one it inherits,
    # keeps it: found before any is watched, whose properties would be inherited too.
    own = [cls for cls in classes if any("training" in vars(c) for c in cls.__mro__)]
    reads.unknown = bool(own)
    try:
        for cls in classes:
            if cls in own:
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
