"""Attributes a forward assigns (`self.hidden = h`): refused at compile time, and put back.

A pipeline runs the forward as stages of generated code, which never runs those assignments of
the modules it traced through; after tracing such an attribute would hold a traced value (an fx
Proxy). A module the graph calls whole runs its own forward, assignments included.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import torch
from torch import nn


class AssignmentError(RuntimeError):
    """The forward assigns module attributes, which a pipeline cannot keep up to date;
    `modules` are the paths of the modules whose attributes were assigned ('' for the root)."""

    def __init__(self, message: str, modules: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.modules = sorted(set(modules))


def _public(module: nn.Module) -> dict[str, Any]:
    return {name: value for name, value in vars(module).items() if not name.startswith("_") and name != "training"}


@contextmanager
def assignments_recorded(model: nn.Module) -> Iterator[list[str]]:
    """Within this block, public attributes and buffers assigned on `model`'s modules are listed
    (by path, once the block ends) and put back as they were. A buffer counts: `self.count += 1`
    assigns it the traced sum, which a graph does not write into the buffer."""
    before = {name: (module, _public(module), dict(module._buffers)) for name, module in model.named_modules()}
    changed: list[str] = []
    try:
        yield changed
    finally:
        for path, (module, values, buffers) in before.items():
            for name, value in _public(module).items():
                if name not in values or _changed(values[name], value):
                    changed.append(f"{path}.{name}" if path else name)
                    if name in values:
                        setattr(module, name, values[name])
                    else:
                        delattr(module, name)
            for name, buffer in buffers.items():
                if module._buffers.get(name) is not buffer:
                    changed.append(f"{path}.{name}" if path else name)
                    module._buffers[name] = buffer


def _changed(before: Any, after: Any) -> bool:
    """A new object that is not an equal plain value (torch.export swaps some attributes, such
    as a LayerNorm's `normalized_shape`, for equal copies)."""
    if before is after:
        return False
    if isinstance(before, torch.Tensor) or isinstance(after, torch.Tensor):
        return True
    try:
        return bool(before != after)
    except Exception:  # noqa: BLE001 - a value that cannot say whether it is equal counts as changed
        return True


def refuse_assignments(changed: Iterable[str], called_whole: Iterable[str] = ()) -> None:
    """Raise `AssignmentError` for the assignments of `changed` outside the modules (by path)
    that a graph calls whole."""
    wholes = [f"{path}." for path in called_whole]
    lost = [name for name in changed if not any(name.startswith(prefix) for prefix in wholes)]
    if lost:
        raise AssignmentError(
            f"the model's forward assigns {', '.join(repr(name) for name in lost)}: a pipeline runs the "
            "forward as generated stages, which cannot keep such an attribute up to date.\n"
            "How to fix: return the value from forward instead of storing it on the module, or keep "
            "the module that stores it whole (leaf_modules=[...]).",
            [name.rpartition(".")[0] for name in lost],
        )


@contextmanager
def assignments_refused(model: nn.Module) -> Iterator[None]:
    """Trace `model` within this block: an attribute the trace assigned is put back and refused."""
    with assignments_recorded(model) as changed:
        yield
    refuse_assignments(changed)
