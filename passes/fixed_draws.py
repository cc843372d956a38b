"""Random ops with fixed draws and BatchNorm by its running statistics: a run whose values do not
depend on how the batch is split, which the batch-dim check and the slice check compare runs by."""
from __future__ import annotations

from typing import Any

import torch

from fxpipe.core.eager_mode import EagerDispatchMode, is_higher_order, run_higher_order

_BATCH_NORMS = ("native_batch_norm", "_native_batch_norm_legit")


class FixedDraws(EagerDispatchMode):
    """Random ops draw fixed values (a permutation draws none), and BatchNorm normalises by its
    running statistics: what either does differs between micro-batches by design."""

    def __init__(self) -> None:
        super().__init__()
        # The shape of each draw, in order: a node whose draws keep their shapes on the batch's
        # parts draws for the whole batch (stochastic depth's one number), whatever it returns.
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if is_higher_order(func):
            return run_higher_order(self, func, args, kwargs)
        name = func._overloadpacket.__name__
        if name in _BATCH_NORMS:
            return _batch_norm_by_statistics(func, args, kwargs)
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        if seeded and _gated(func):  # dropout, attention with dropout: run without, the values still tell
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            self.shapes.append(tuple(first.shape) if first is not None else ())
            positional, named = _ungated(func, args, kwargs)
            return func(*positional, **named)
        out = func(*args, **kwargs)
        if seeded:
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor):
                    self.shapes.append(tuple(t.shape))
                    _fix(t, name)
        return out


_PROBABILITIES, _TRAINING = ("dropout_p",), ("train", "training")


def _gated(func: Any) -> bool:
    """An op that draws only for a dropout probability or in training (attention, rrelu)."""
    return any(a.name in (*_PROBABILITIES, *_TRAINING) for a in func._schema.arguments)


def _ungated(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """The op's arguments with the dropout probability 0 and training off."""
    positional, named = [], {}
    for k, argument in enumerate(func._schema.arguments):
        if k < len(args):
            value = args[k]
        elif argument.name in kwargs:
            value = kwargs[argument.name]
        elif argument.has_default_value():
            value = argument.default_value
        else:
            continue
        value = 0.0 if argument.name in _PROBABILITIES else False if argument.name in _TRAINING else value
        if argument.kwarg_only:
            named[argument.name] = value
        else:
            positional.append(value)
    return positional, named


def _fix(t: torch.Tensor, name: str) -> None:
    """A random op's output as a draw the same in every run: a permutation reverses the order (one
    that left it would hide a model that shuffles its batch: `h[torch.randperm(batch)]`, whose
    halves, each reversed, then read other rows than the whole)."""
    if name == "randperm":
        t.copy_(torch.arange(t.numel() - 1, -1, -1, dtype=t.dtype, device=t.device))
    else:
        t.fill_(1 if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool else 0)


def _batch_norm_by_statistics(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """BatchNorm in eval form: the running statistics, or 0 and 1 where it keeps none."""
    x, weight, bias = args[:3]
    stats = func._overloadname != "no_stats"
    mean, var = args[3:5] if stats else (None, None)
    eps = args[-1]
    channels = x.shape[1]
    mean = mean if mean is not None else torch.zeros(channels, dtype=x.dtype, device=x.device)
    var = var if var is not None else torch.ones(channels, dtype=x.dtype, device=x.device)
    return torch.ops.aten.native_batch_norm.default(x, weight, bias, mean, var, False, 0.0, eps)
