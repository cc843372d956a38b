"""Reads of a parameter's or buffer's autograd state (`w.requires_grad`, `w.grad is None`) by the model's code while it is captured."""
from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

from fxpipe.core.attrs import tensor_held
from fxpipe.tracing.attribute_reads import GradHeld, Reads, from_the_model

# A branch on either (`if self.weight.requires_grad:`, `if w.grad is None:`, the fast paths of
# nn.MultiheadAttention and nn.TransformerEncoderLayer in eval with gradients on) is taken once
# when captured, and the graph holds it: a layer frozen or unfrozen since, or a gradient set or
# cleared, would run the other branch in the plain model. torch.export reads them of the
# example's fakes, so the reads are noted by the tensor's names in the model as it is then.
# Each is watched as an attribute (fxpipe/tracing/attribute_reads.py): `0.a.weight.requires_grad`
# by value, `0.a.weight.grad` by whether it is None.
_STATES = ("requires_grad", "grad")

_lock = threading.Lock()
_watching: dict[int, tuple[nn.Module, Reads]] = {}  # by thread
_patched = 0


@contextmanager
def autograd_state_reads(model: nn.Module, reads: Reads) -> Iterator[None]:
    """Within this block, the model's code's reads on this thread of its own tensors'
    `requires_grad` and `grad` are noted in `reads`, as plain attributes of their modules."""
    global _patched
    with _lock:
        if not _patched:
            for name in _STATES:
                setattr(torch.Tensor, name, _noting(name))
        _patched += 1
        _watching[threading.get_ident()] = (model, reads)
    try:
        yield
    finally:
        with _lock:
            del _watching[threading.get_ident()]
            _patched -= 1
            if not _patched:
                for name in _STATES:
                    delattr(torch.Tensor, name)  # torch.Tensor holds none of its own: TensorBase's again


def _noting(name: str) -> property:
    state = torch._C.TensorBase.__dict__[name]

    def get(tensor: torch.Tensor) -> Any:
        value = state.__get__(tensor)
        watching = _watching.get(threading.get_ident())
        if watching is not None and from_the_model(sys._getframe(1).f_code.co_filename):
            _note(*watching, tensor, name, value)
        return value

    def put(tensor: torch.Tensor, value: Any) -> None:
        state.__set__(tensor, value)

    def remove(tensor: torch.Tensor) -> None:
        state.__delete__(tensor)

    return property(get, put, remove, state.__doc__)


def traced_grad_read(target: str, filename: str) -> None:
    """torch.fx's read of the `.grad` of the parameter or buffer `target` (of its Proxy, which is
    never None: `w.grad is None` takes the branch of a gradient held), by code in `filename`."""
    watching = _watching.get(threading.get_ident())
    if watching is None or not from_the_model(filename):
        return
    held = tensor_held(watching[0], target)
    if held is not None:
        _note(*watching, held, "grad", state_of(held, "grad"))


def state_of(tensor: torch.Tensor, name: str) -> Any:
    """`tensor.requires_grad` or `tensor.grad`, read past the watch."""
    return torch._C.TensorBase.__dict__[name].__get__(tensor)


def _note(model: nn.Module, reads: Reads, tensor: torch.Tensor, name: str, value: Any) -> None:
    for path in _names_of(model, tensor):
        qualified = f"{path}.{name}"
        reads.values[reads.mode].add(qualified)
        reads.first.setdefault(qualified, GradHeld(value is not None) if name == "grad" else value)


def _names_of(model: nn.Module, tensor: torch.Tensor) -> list[str]:
    """Every name `model` holds `tensor` under, as a parameter or a buffer."""
    named: Callable[..., Iterator[tuple[str, torch.Tensor]]]
    found = []
    for named in (model.named_parameters, model.named_buffers):
        found += [path for path, held in named(remove_duplicate=False) if held is tensor]
    return found
