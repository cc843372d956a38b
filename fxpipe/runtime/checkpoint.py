"""Checkpointing flags: whether the current stage call is a checkpointed forward or a recompute."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from functools import partial
from typing import Any, ContextManager, Iterator, Optional, Sequence

import torch
from torch import nn

from fxpipe.compiled.program import Slot
from fxpipe.core.microbatch import takes_gradients
from fxpipe.core.scoped import scoped
from fxpipe.core.settings import holds_fields
from fxpipe.runtime.versions import SlotWatch


_state = threading.local()


def is_checkpointing() -> bool:
    """True while a stage runs a forward whose activations are dropped, to be recomputed later."""
    return getattr(_state, "checkpointing", False)


def is_recomputing() -> bool:
    """True while a stage recomputes a checkpointed forward, during backward."""
    return getattr(_state, "recomputing", False)


def checkpointing() -> ContextManager[None]:
    return scoped(_state, "checkpointing", True, unset=False)


def recomputing() -> ContextManager[None]:
    return scoped(_state, "recomputing", True, unset=False)


@contextmanager
def swapped_state(module: nn.Module, tensors: dict[str, torch.Tensor], watch: Optional[SlotWatch] = None) -> Iterator[None]:
    """Run `module` with some parameters or buffers (by qualified name) replaced, and put the
    originals back.

    A recompute runs on the buffers as its forward saw them, so that what it writes to them
    (running statistics, counters) goes to copies: the model's buffers are updated once, in
    forward. A stage runs on per-step views of its parameters, so that its gradients stop there
    instead of reaching the parameters' `.grad` and hooks.
    """
    with swapped_slots([(*slot_of(module, name), tensor) for name, tensor in tensors.items()], watch):
        yield


# Modules called whole and the settings objects they hold (`self.state`), and their attributes.
Attributes = list[tuple[Any, dict[str, Any]]]


def slot_of(module: nn.Module, name: str) -> Slot:
    """Where the parameter or buffer `name` (qualified, below `module`) is held."""
    path, _, attr = name.rpartition(".")
    owner = module.get_submodule(path)
    return (owner._parameters if attr in owner._parameters else owner._buffers), attr


class swapped_slots:
    """`swapped_state` on slots found already (a stage finds its parameters' once). A class, not
    a generator: every forward task enters one. Under overlapping steps, `watch` sees the
    caller's code assign a slot meanwhile (`SlotWatch`)."""

    def __init__(self, swaps: Sequence[tuple[dict[str, Any], str, torch.Tensor]], watch: Optional[SlotWatch] = None) -> None:
        self.swaps, self.watch = swaps, watch

    def __enter__(self) -> None:
        if self.watch is not None:
            self.held = [self.watch.enter(table, attr, tensor) for table, attr, tensor in self.swaps]
            return
        self.originals = [table[attr] for table, attr, _ in self.swaps]
        for table, attr, tensor in self.swaps:
            table[attr] = tensor

    def __exit__(self, *exc: object) -> None:
        if self.watch is not None:
            for (table, attr, tensor), (found, before) in zip(reversed(self.swaps), reversed(self.held)):
                self.watch.leave(table, attr, tensor, found, before)
            return
        for (table, attr, _), original in zip(reversed(self.swaps), reversed(self.originals)):
            table[attr] = original


# Above this many entries a dict a module called whole holds is not kept for a recompute: copying
# it would slow every micro-batch.
KEPT_ENTRIES = 1000


def attributes_of(modules: Sequence[nn.Module]) -> Attributes:
    """The attributes of modules called whole, of the settings objects they hold (a counter in
    `self.state`), and the entries of their dicts (a counter in `self.d`), as a forward is about
    to see them."""
    holders: dict[int, Any] = {id(m): m for m in modules}
    for module in modules:
        holders.update((id(v), v) for name, v in vars(module).items() if not name.startswith("_") and _holds_state(v))
    return [(holder, dict(_table(holder))) for holder in holders.values()]


def _holds_state(value: Any) -> bool:
    return holds_fields(value) or (type(value) is dict and len(value) <= KEPT_ENTRIES)


def _table(holder: Any) -> dict[Any, Any]:
    """A holder's attributes (a dict's entries)."""
    return holder if type(holder) is dict else vars(holder)


def _public(name: Any) -> bool:
    return not (isinstance(name, str) and name.startswith("_"))


def put_back_attributes(attributes: Attributes) -> None:
    """The attributes as `attributes_of` found them."""
    for holder, before in attributes:
        table = _table(holder)
        put, remove = (table.__setitem__, table.__delitem__) if table is holder else (partial(setattr, holder), partial(delattr, holder))
        for name in [n for n in table if _public(n) and n not in before]:
            remove(name)
        for name, value in before.items():
            if _public(name) and table.get(name) is not value:
                put(name, value)


@contextmanager
def attributes_kept(modules: Sequence[nn.Module], start: Optional[Attributes] = None) -> Iterator[None]:
    """A recompute runs from the attributes its forward saw (`start`: a counter forward reads),
    and leaves those a module's forward assigns (`self.hidden = h`) as the forwards left them:
    the last micro-batch's, as in the plain model."""
    saved = attributes_of(modules)
    if start is not None:
        put_back_attributes(start)
    try:
        yield
    finally:
        put_back_attributes(saved)


# Per module: its training flag, and its dropout rate (None for a module without one).
Flags = list[tuple[bool, Optional[float]]]


def flags_of(modules: Sequence[nn.Module]) -> Flags:
    """What decides what these modules compute, besides their tensors: mode and rate."""
    return [(m.training, dropout_rate_of(m)) for m in modules]


def dropout_rate_of(module: nn.Module) -> Optional[float]:
    """A dropout's `p`, an RNN's or attention's `dropout`, or None."""
    rate = module.p if isinstance(module, nn.modules.dropout._DropoutNd) else getattr(module, "dropout", None)
    return float(rate) if isinstance(rate, (int, float)) and not isinstance(rate, bool) else None


# The modules whose flags recomputes hold now, by id: the flags held, how many recomputes hold
# them, and the module's own flags to put back when the last lets go. A module called in two
# stages is one object: their recomputes, on two workers at once, share its flags.
_held: dict[int, tuple[tuple[bool, Optional[float]], int, tuple[bool, Optional[float]]]] = {}
_held_changed = threading.Condition()


@contextmanager
def flags_kept(modules: Sequence[nn.Module], flags: Flags) -> Iterator[None]:
    """The modules' flags and rates as `flags` holds them, for the block (a recompute runs under
    its forward's), and as they are now after it. Recomputes on other workers that need the
    same flags share them; one that needs others waits for them to end."""
    with _held_changed:
        _held_changed.wait_for(lambda: all(_held.get(id(m), (flag,))[0] == flag for m, flag in zip(modules, flags)))
        for module, flag in zip(modules, flags):
            _, holders, own = _held.get(id(module), (flag, 0, flags_of([module])[0]))
            _held[id(module)] = (flag, holders + 1, own)
            _set_flags([module], [flag])
    try:
        yield
    finally:
        with _held_changed:
            for module in modules:
                flag, holders, own = _held.pop(id(module))
                if holders > 1:
                    _held[id(module)] = (flag, holders - 1, own)
                else:
                    _set_flags([module], [own])
            _held_changed.notify_all()


def _set_flags(modules: Sequence[nn.Module], flags: Flags) -> None:
    for module, (training, rate) in zip(modules, flags):
        module.training = training
        if rate is not None:
            setattr(module, "p" if isinstance(module, nn.modules.dropout._DropoutNd) else "dropout", rate)


class _Stored(torch.autograd.Function):
    """A tensor a module stored in forward, as the caller reads it: its values, requiring grad
    as the plain model's does, and a backward that says why no gradient can flow through it."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, path: str, *anchors: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.path = path
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:  # type: ignore[override]
        raise RuntimeError(
            f"a gradient reached {ctx.path}, a tensor that its module stored in forward: a pipeline runs each stage's "
            "backward on the stage's own graph, and cannot carry a gradient through a stored tensor into it.\n"
            "How to fix: return the tensor from forward (as an output of the model) and compute the loss from the "
            "output; or store it detached (.detach()) if no gradient should flow through it."
        )


def refuse_gradients_through(stored: Sequence[tuple[nn.Module, str, str]], upstream: Sequence[torch.Tensor]) -> None:
    """The tensors requiring grad that modules called whole stored in forward (by attribute, with
    their paths), swapped for what `_Stored` makes of them: a loss that reads one and reaches it
    in backward raises, where a gradient would be lost (a checkpointed forward stores a tensor
    without a graph) or would run into a stage's freed graph. `upstream`: the parameters and
    inputs requiring grad that the stored tensor may come from; made inputs of `_Stored`, so
    that a backward asked for any of them alone (`torch.autograd.grad`, `backward(inputs=)`)
    reaches it too, and none goes without a word."""
    for module, name, path in stored:
        value = vars(module).get(name)
        if isinstance(value, torch.Tensor) and takes_gradients(value) and not isinstance(value.grad_fn, _Stored._backward_cls):
            anchors = upstream or [torch.zeros((), device=value.device, requires_grad=True)]
            vars(module)[name] = _Stored.apply(value.detach(), path, *anchors)
