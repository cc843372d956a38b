"""Dispatch modes that run only while compiling, never under torch.compile; and how a mode of ours runs torch's higher-order operators (`torch.cond`)."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode


class CondRunsEagerly(TorchDispatchMode):
    """A dispatch mode of ours within which `torch.cond` runs as its eager form computes
    (`cond_run_eagerly`), and a higher-order operator goes to `run_higher_order`."""

    supports_higher_order_operators = True

    def __enter__(self) -> Any:
        entered = cond_run_eagerly()
        entered.__enter__()
        self.__dict__.setdefault("_conds", []).append(entered)  # (entered again within itself: `run_higher_order`)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self.__dict__["_conds"].pop().__exit__(*exc)


class EagerDispatchMode(CondRunsEagerly):
    """A TorchDispatchMode that torch does not wrap for dynamo to skip: the wrapper imports
    torch._dynamo on its first call, 1-3 s in a fresh process, and these modes (shape and FLOP
    propagation, the checks that run the model on its example) run at compile time, eagerly."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


_COND_LOCK = threading.Lock()
_cond_entered = 0
_cond_kept: Any = None


def _cond_eagerly(pred: Any, true_fn: Any, false_fn: Any, operands: Any = ()) -> Any:
    return (true_fn if bool(pred) else false_fn)(*operands)


@contextmanager
def cond_run_eagerly() -> Iterator[None]:
    """Within this block (any thread's, nested), `torch.cond` runs its branch in Python, as its
    eager form computes: torch's own compiles the call with dynamo first, which fails under a
    dispatch mode of Python (it traces the mode), and the failure stays with `torch.cond` for the
    rest of the process: the plain model's next call fails too."""
    global _cond_entered, _cond_kept
    with _COND_LOCK:
        if _cond_entered == 0:
            _cond_kept, torch.cond = torch.cond, _cond_eagerly  # type: ignore[assignment]
        _cond_entered += 1
    try:
        yield
    finally:
        with _COND_LOCK:
            _cond_entered -= 1
            if _cond_entered == 0:
                torch.cond = _cond_kept


def run_higher_order(mode: TorchDispatchMode, func: HigherOrderOperator, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A higher-order operator met under `mode` (which torch has taken off the stack meanwhile):
    `torch.cond` runs its branch as eager PyTorch does, and torch.export's grad-mode region its
    subgraph, under the mode, which sees their operations as the model's; any other runs as it
    is, unseen by the mode. torch refuses a mode
    without such a rule, and its failure, met in `torch.cond`'s own compile, would stay with the
    function for the rest of the process (the plain model's next call fails too)."""
    if func is torch.ops.higher_order.cond:
        with mode:
            return _cond_eagerly(*args)
    if func is torch.ops.higher_order.wrap_with_set_grad_enabled:  # torch.export's no_grad region: under the mode too
        enabled, subgraph, *operands = args
        with mode, torch.set_grad_enabled(enabled):
            return subgraph(*operands)
    return func(*args, **kwargs)


def is_higher_order(func: Any) -> bool:
    return isinstance(func, HigherOrderOperator)
