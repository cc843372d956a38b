"""What a loss_fn keeps in its own attributes, which train_step's several calls of it would move on: refused, and put back.

train_step calls `loss_fn` once per micro-batch and once more on the whole batch (the check
that the micro-batches' losses combine into its loss): a step counter, a running mean or a queue
that a loss object keeps would move as many times per step, where the plain loop moves it once.
Of a loss object (an `nn.Module`, the module of a bound method, an instance of a callable class,
what a functools.partial holds, and the plain objects they hold) the plain values, tensors,
lists, dicts and sets its attributes hold are noted before the step and compared after it; a
change is put back and refused. State a plain function keeps (a closure, a global)
cannot be seen: docs/schedules.md says so.
"""
from __future__ import annotations

import collections
import copy
import math
import functools
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

_TORCH_OWN = frozenset(vars(nn.Module()))  # what every module holds for torch, hooks and flags
_MISSING = object()


@dataclass
class _Tensor:
    """A tensor attribute as the step found it: the tensor, its version and its values (None
    for a large one, which is refused but not put back)."""

    tensor: torch.Tensor
    version: int
    values: Optional[torch.Tensor]


@dataclass
class _Container:
    """A list, dict or set attribute as the step found it: the container and a shallow copy."""

    held: Any
    copy: Any


_PUT_BACK_ELEMENTS = 1 << 16  # a larger tensor is compared by version alone
_DEPTH = 3  # how deep objects held by the loss are followed


def _holders(loss_fn: Any) -> list[Any]:
    """The objects whose attributes the loss keeps its state in: the loss object (a bound
    method's, a functools.partial's function and arguments), its modules, and the plain objects
    they hold, a few levels down."""
    found: list[Any] = []
    todo, seen = [(loss_fn, 0)], set()
    while todo:
        held, depth = todo.pop()
        if id(held) in seen or depth > _DEPTH:
            continue
        seen.add(id(held))
        if isinstance(held, types.MethodType):
            todo.append((held.__self__, depth))
        elif isinstance(held, functools.partial):
            todo += [(v, depth) for v in (held.func, *held.args, *held.keywords.values())]
        elif _object(held):
            owners = list(held.modules()) if isinstance(held, nn.Module) else [held]
            found += [owner for owner in owners if owner is held or id(owner) not in seen]  # (each module once)
            seen.update(id(owner) for owner in owners)
            todo += [(value, depth + 1) for owner in owners for value in vars(owner).values() if _object(value) and not isinstance(value, nn.Module)]
    return found


def _object(value: Any) -> bool:
    """An object whose attributes may hold state: not a function, class, module of code or tensor."""
    plain_kinds = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType, type, torch.Tensor)
    return hasattr(value, "__dict__") and not isinstance(value, plain_kinds)


def _state(holder: Any) -> dict[str, Any]:
    """The attributes of `holder` that a call may change: plain values, tensors, containers."""
    found: dict[str, Any] = {}
    for name, value in {**vars(holder), **getattr(holder, "_buffers", {})}.items():
        if name in _TORCH_OWN:
            continue
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
            values = value.detach().clone() if value.numel() <= _PUT_BACK_ELEMENTS else None
            found[name] = _Tensor(value, value._version, values)
        elif value is None or type(value) in (bool, int, float, str):
            found[name] = value
        elif type(value) in (list, dict, set, collections.deque):
            found[name] = _Container(value, copy.copy(value))
    return found


def _changed(before: Any, now: Any) -> bool:
    if isinstance(before, _Tensor):
        # By value too, where kept: BatchNorm's CPU kernel writes its running statistics without
        # moving their version.
        moved = now is not before.tensor or now._version != before.version
        return moved or (before.values is not None and not equal_values(before.values, now))
    if isinstance(before, _Container):
        return now is not before.held or _contents_changed(before.copy, now)
    return type(now) is not type(before) or not (now is before or now == before or _same(now, before))


def _contents_changed(then: Any, now: Any) -> bool:
    if len(then) != len(now):
        return True
    if isinstance(now, dict):
        return then.keys() != now.keys() or any(not _same(then[k], now[k]) for k in now)
    if isinstance(now, set):
        return then != now
    return any(not _same(a, b) for a, b in zip(then, now))


def _same(a: Any, b: Any) -> bool:
    """The same object, or plain values equal (NaN where NaN was: a loss kept for logging may be one)."""
    if a is b:
        return True
    if type(a) is not type(b) or type(a) not in (bool, int, float, str):
        return False
    return a == b or (type(a) is float and math.isnan(a) and math.isnan(b))


def _shown(value: Any) -> str:
    if isinstance(value, _Container):
        value = value.copy
    if isinstance(value, (list, dict, set, collections.deque)):
        items = value.values() if isinstance(value, dict) else value
        few = len(value) <= 4 and all(v is None or type(v) in (bool, int, float, str) for v in items)
        return repr(value) if few else f"a {type(value).__name__} of {len(value)}"
    return "deleted" if value is _MISSING else "a tensor" if isinstance(value, (_Tensor, torch.Tensor)) else repr(value)


def _put_back(holder: Any, name: str, before: Any) -> None:
    if isinstance(before, _Tensor):
        if before.values is not None:
            with torch.no_grad():
                before.tensor.copy_(before.values)
        setattr(holder, name, before.tensor)
    elif isinstance(before, _Container):
        held = before.held
        held.clear()
        held.update(before.copy) if isinstance(held, (dict, set)) else held.extend(before.copy)
        setattr(holder, name, held)
    else:
        setattr(holder, name, before)


def calls_of_loss_fn(micro_batches: int) -> int:
    """How many times a step calls loss_fn: once per micro-batch, and once more on the whole
    batch where there are several (the check of their combination)."""
    return micro_batches + (micro_batches > 1)


class LossStateKept:
    """Noted on creation (before the step calls `loss_fn` `calls` times), compared when its block
    ends: a change to the state the loss object keeps is put back as it was, and refused
    (ValueError); but for state the last call leaves as the plain loop's one call would (a loss
    kept for logging, `self.last = loss.detach()`): where `replay` (that one call: loss_fn on the
    whole batch's outputs, set once they are known) leaves the state as the step left it, it stays."""

    def __init__(self, loss_fn: Optional[Any], calls: int) -> None:
        self.calls = calls
        self.holders = _holders(loss_fn) if loss_fn is not None and calls > 1 else []
        self.before = [_state(holder) for holder in self.holders]
        self.replay: Optional[Callable[[], bool]] = None  # False where the call cannot tell (it drew)

    def __enter__(self) -> "LossStateKept":
        return self

    def moved(self) -> list[str]:
        """Each attribute changed since the state was noted, as `name (then -> now)`."""
        return [
            f"{name} ({_shown(value)} -> {_shown(now)})"
            for holder, state in zip(self.holders, self.before) for name, value in state.items()
            if _changed(value, now := getattr(holder, name, _MISSING))
        ]  # fmt: skip

    def put_back(self) -> list[str]:
        """Each attribute changed since the state was noted, put back as it was; `moved()` before."""
        moved = self.moved()
        for holder, state in zip(self.holders, self.before):
            for name, value in state.items():
                if _changed(value, getattr(holder, name, _MISSING)):
                    _put_back(holder, name, value)
        return moved

    def _as_one_call_leaves_it(self) -> bool:
        """Whether the state now is what the plain loop's one call leaves (the state put back,
        `replay` run, compared by value); the state is left as that call leaves it."""
        if self.replay is None:
            return False
        after = [_state(holder) for holder in self.holders]
        self.put_back()
        if not self.replay():
            return False
        once = [_state(holder) for holder in self.holders]
        return all(a.keys() == b.keys() and all(_alike(a[k], b[k]) for k in a) for a, b in zip(after, once))

    def __exit__(self, kind: Any, failure: Optional[BaseException], trace: Any) -> None:
        moved = self.moved()
        if not moved or (failure is None and self._as_one_call_leaves_it()):
            return
        self.put_back()
        raise ValueError(
            f"loss_fn changes its own state when called: {', '.join(moved)}, over this step's {self.calls} calls of it. "
            "train_step calls it once per micro-batch and once more on the whole batch (to check that the micro-batches' "
            "losses combine into its loss), so state it keeps moves that many times a step where the plain loop moves it "
            "once. Its state is put back as it was, and no gradient was accumulated.\nHow to fix: keep the state outside "
            "loss_fn and move it once per step (after train_step, or in after_step= of train_steps), or compute the loss "
            "yourself: loss_fn(pipe(x), target).backward()."
        ) from failure


def _alike(a: Any, b: Any) -> bool:
    """Whether two notes of an attribute hold the same values (tensors by value)."""
    if isinstance(a, _Tensor) and isinstance(b, _Tensor):
        return a.values is not None and b.values is not None and _same_values(a.values, b.values)
    if isinstance(a, _Container) and isinstance(b, _Container):
        x, y = a.copy, b.copy
        if type(x) is not type(y) or len(x) != len(y):
            return False
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(_same_values(x[k], y[k]) for k in x)
        return x == y if isinstance(x, set) else all(_same_values(u, v) for u, v in zip(x, y))
    return type(a) is type(b) and not isinstance(a, (_Tensor, _Container)) and (a is b or a == b or _same(a, b))


def equal_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and values, NaN where NaN was."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):  # the common case, a few times faster than allclose
        return True
    return (a.is_floating_point() or a.is_complex()) and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)


def _same_values(a: Any, b: Any) -> bool:
    """`_same`, with tensors compared by value."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return equal_values(a, b)
    return _same(a, b)
