"""Snapshots of a module's state, so that running it at compile time leaves no trace on it."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from fxpipe.core.writes import version_of

# Parameters are copied only up to this many bytes in all: compile-time passes run a model whole
# only below it (passes/shapes.py), and above it they run nodes one at a time or on the meta
# device, which write no parameter of an ordinary model. Buffers and gradients are always copied.
PARAMETER_COPY_LIMIT = 1 << 30


@dataclass
class _Slot:
    """One parameter or buffer: where it lives, the object that was there, and its values."""

    owner: nn.Module
    name: str
    kind: str  # "_parameters" or "_buffers"
    tensor: torch.Tensor
    values: Optional[torch.Tensor]


@dataclass
class _Grad:
    """One parameter's `.grad`: the object, and its values (backward accumulates in place)."""

    param: nn.Parameter
    grad: Optional[torch.Tensor]
    values: Optional[torch.Tensor]


@dataclass
class Snapshot:
    """Parameters, buffers, `.grad`, `training` flags and the CPU and CUDA random states."""

    slots: list[_Slot]
    grads: list[_Grad]
    training: list[tuple[nn.Module, bool]]
    cpu_rng: torch.Tensor
    cuda_rng: Optional[list[torch.Tensor]]

    def restore(self) -> None:
        """Put everything back. A tensor moved to another device since (placement) keeps its
        device and gets its old values there."""
        for slot in self.slots:
            _restore_slot(slot)
        for grad in self.grads:
            _restore_grad(grad)
        for module, flag in self.training:
            module.training = flag
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


def _copy(tensor: torch.Tensor, copies: dict[int, torch.Tensor]) -> torch.Tensor:
    """One copy per tensor, however many modules hold it (tied weights)."""
    if id(tensor) not in copies:
        copies[id(tensor)] = tensor.detach().clone()
    return copies[id(tensor)]


def take_snapshot(module: nn.Module) -> Snapshot:
    """The state of `module` and every module below it, and the global random states."""
    modules = list(module.modules())
    params = {id(p): p for m in modules for p in m._parameters.values() if p is not None}
    copy_params = sum(p.numel() * p.element_size() for p in params.values()) <= PARAMETER_COPY_LIMIT
    slots: list[_Slot] = []
    copies: dict[int, torch.Tensor] = {}
    for owner in modules:
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(owner, kind).items():
                if tensor is not None:
                    keep = kind == "_buffers" or copy_params
                    slots.append(_Slot(owner, name, kind, tensor, _copy(tensor, copies) if keep else None))
    grads = [_Grad(p, p.grad, None if p.grad is None else _copy(p.grad, copies)) for p in params.values()]
    # CUDA's states exist once CUDA is initialised; a run that initialises it starts from the seed.
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return Snapshot(slots, grads, [(m, m.training) for m in modules], torch.get_rng_state(), cuda_rng)


def _put(target: torch.Tensor, values: torch.Tensor) -> None:
    """Values into `target` on its own device; through `.data`, which leaves its version alone.
    A tensor that was on the meta device had no values to put back."""
    if values.is_meta:
        return
    if target.shape == values.shape and target.dtype == values.dtype:
        target.data.copy_(values)
    else:
        target.data = values.to(target.device)


def _restore_slot(slot: _Slot) -> None:
    table = getattr(slot.owner, slot.kind)
    current = table[slot.name] if slot.name in table else None  # (a ScriptModule's table has no .get)
    # Not a tensor: a traced value (`self.count += 1` assigns a buffer an fx Proxy) put back too.
    if not isinstance(current, torch.Tensor) or (current is not slot.tensor and current.device == slot.tensor.device):
        table[slot.name] = current = slot.tensor  # replaced by the run, not moved by placement
    if slot.values is not None:
        _put(current, slot.values)


def _restore_grad(saved: _Grad) -> None:
    param = saved.param
    if saved.grad is None or saved.values is None:
        param.grad = None
        return
    if saved.grad.device == param.device:
        param.grad = saved.grad
    elif param.grad is None or param.grad.device != param.device:
        param.grad = saved.grad.to(param.device)
    _put(param.grad, saved.values)


@contextmanager
def preserved(module: nn.Module) -> Iterator[Snapshot]:
    """Run the body, then put `module`'s state and the random states back as they were."""
    snapshot = take_snapshot(module)
    try:
        yield snapshot
    finally:
        snapshot.restore()


@contextmanager
def inputs_preserved(inputs: Any) -> Iterator[None]:
    """Run the body, then put back the values of every tensor in `inputs` that it wrote in place
    (a forward that writes its input, run at compile time on the user's example)."""
    tensors = {id(t): t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and not t.is_meta}
    # An inference tensor keeps no version counter: its values tell (and it is written in inference mode).
    saved = [(t, version_of(t), t.detach().clone()) for t in tensors.values()]
    try:
        yield
    finally:
        for tensor, version, values in saved:
            if version is not None and tensor._version != version:
                _put(tensor, values)
            elif version is None and not torch.equal(tensor, values):
                with torch.inference_mode():
                    tensor.copy_(values)
