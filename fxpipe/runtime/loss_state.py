"""What a loss_fn keeps in its own attributes, which train_step's several calls of it would move on: refused, and put back.

train_step calls `loss_fn` once per micro-batch and once more on the whole batch (the check
that the micro-batches' losses combine into its loss): a step counter, a running mean or a queue
that a loss object keeps would move as many times per step, where the plain loop moves it once.
Of a loss object (an `nn.Module`, the module of a bound method, an instance of a callable class)
the plain values and the tensors its attributes hold are noted before the step and compared
after it; a change is put back and refused. State a plain function keeps (a closure, a global)
cannot be seen: docs/limits.md says so.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

_TORCH_OWN = frozenset(vars(nn.Module()))  # what every module holds for torch, hooks and flags
_MISSING = object()


@dataclass
class _Tensor:
    """A tensor attribute as the step found it: the tensor, its version and its values."""

    tensor: torch.Tensor
    version: int
    values: torch.Tensor


def _holders(loss_fn: Any) -> list[Any]:
    """The objects whose attributes the loss keeps its state in."""
    owner = loss_fn.__self__ if isinstance(loss_fn, types.MethodType) else loss_fn
    if isinstance(owner, (types.FunctionType, types.BuiltinFunctionType, type)) or not hasattr(owner, "__dict__"):
        return []
    return list(owner.modules()) if isinstance(owner, nn.Module) else [owner]


def _state(holder: Any) -> dict[str, Any]:
    """The attributes of `holder` that a call may change: plain values, and tensors."""
    found: dict[str, Any] = {}
    for name, value in {**vars(holder), **getattr(holder, "_buffers", {})}.items():
        if name in _TORCH_OWN:
            continue
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
            found[name] = _Tensor(value, value._version, value.detach().clone())
        elif value is None or type(value) in (bool, int, float, str):
            found[name] = value
    return found


def _changed(before: Any, now: Any) -> bool:
    if isinstance(before, _Tensor):
        return now is not before.tensor or now._version != before.version
    return type(now) is not type(before) or not (now is before or now == before)


def _shown(value: Any) -> str:
    return "deleted" if value is _MISSING else "a tensor" if isinstance(value, (_Tensor, torch.Tensor)) else repr(value)


def _put_back(holder: Any, name: str, before: Any) -> None:
    if isinstance(before, _Tensor):
        with torch.no_grad():
            before.tensor.copy_(before.values)
        setattr(holder, name, before.tensor)
    else:
        setattr(holder, name, before)


class LossStateKept:
    """Noted on creation (before the step calls `loss_fn` `calls` times), compared when its block
    ends: a change to the state the loss object keeps is put back as it was, and refused
    (ValueError)."""

    def __init__(self, loss_fn: Optional[Any], calls: int) -> None:
        self.calls = calls
        self.holders = _holders(loss_fn) if loss_fn is not None and calls > 1 else []
        self.before = [_state(holder) for holder in self.holders]

    def __enter__(self) -> None:
        pass

    def put_back(self) -> list[str]:
        """Each attribute changed since the state was noted, put back as it was, as `name (then -> now)`."""
        moved = []
        for holder, state in zip(self.holders, self.before):
            for name, value in state.items():
                now = getattr(holder, name, _MISSING)
                if _changed(value, now):
                    moved.append(f"{name} ({_shown(value)} -> {_shown(now)})")
                    _put_back(holder, name, value)
        return moved

    def __exit__(self, kind: Any, failure: Optional[BaseException], trace: Any) -> None:
        moved = self.put_back()
        if moved:
            raise ValueError(
                f"loss_fn changes its own state when called: {', '.join(moved)}, over this step's {self.calls} calls of it. "
                "train_step calls it once per micro-batch and once more on the whole batch (to check that the micro-batches' "
                "losses combine into its loss), so state it keeps moves that many times a step where the plain loop moves it "
                "once. Its state is put back as it was, and no gradient was accumulated.\nHow to fix: keep the state outside "
                "loss_fn and move it once per step (after train_step, or in after_step= of train_steps), or compute the loss "
                "yourself: loss_fn(pipe(x), target).backward()."
            ) from failure
