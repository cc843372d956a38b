"""Custom autograd Functions while tracing: kept as one call, so their own backward runs.

torch.fx would trace through `MyFn.apply(x)` into its forward, and autograd of that forward would
replace the Function's backward (a straight-through estimator would lose its gradient). While
tracing, `Function.apply` on a traced value records one call of `apply_<MyFn>` instead. Through
torch.export, whose tracing always inlines the forward, `functions_applied` lists the Functions
met, so that the front end can refuse the graph by name.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from fxpipe.core.writes import version_of

_Function = torch.autograd.function.Function
_original_apply = _Function.__dict__["apply"].__func__
_appliers: dict[type, Callable[..., Any]] = {}
_patch_lock = threading.Lock()
_CUSTOM_OPS = "torch._library.autograd"  # where torch.library makes a custom op's autograd Function


def applier(function: type) -> Callable[..., Any]:
    """One function per autograd Function class, that applies it: a graph node's target."""
    if function not in _appliers:

        def apply(*args: Any, **kwargs: Any) -> Any:
            if not _watchers:
                return function.apply(*args, **kwargs)  # type: ignore[attr-defined]
            versions = _versions(args)
            out = function.apply(*args, **kwargs)  # type: ignore[attr-defined]
            if versions:
                apply.writes |= {k for k, version in versions.items() if version_of(args[k]) != version}  # type: ignore[attr-defined]
            return out

        apply.__name__ = apply.__qualname__ = f"apply_{function.__name__}"
        apply.__module__ = __name__
        apply.applies = function  # type: ignore[attr-defined]  # what the passes ask of its node (passes/random_ops.py)
        # The positional arguments a call wrote in place (a Function that marks them dirty), as
        # the runs of the graph while compiling find them (the example's, before the passes that
        # ask: core/writes.py). A stage's calls look only then: each look is two torch calls per
        # argument, and on a worker each torch call may wait for the interpreter lock.
        apply.writes = set()  # type: ignore[attr-defined]
        _appliers[function] = apply
    return _appliers[function]


_watchers = 0  # compiles in progress, in any thread
_watchers_lock = threading.Lock()


@contextmanager
def writes_watched() -> Iterator[None]:
    """While this is open (a compile), applied Functions note which arguments they write."""
    global _watchers
    with _watchers_lock:
        _watchers += 1
    try:
        yield
    finally:
        with _watchers_lock:
            _watchers -= 1


def _versions(args: tuple[Any, ...]) -> dict[int, int]:
    """The version counters of the positional tensor arguments, by position."""
    found = {k: version_of(a) for k, a in enumerate(args) if isinstance(a, torch.Tensor)}
    return {k: v for k, v in found.items() if v is not None}


def _proxy_in(args: Any) -> Optional[fx.Proxy]:
    return next((leaf for leaf in tree_flatten(args)[0] if isinstance(leaf, fx.Proxy)), None)


@contextmanager
def _patched_apply(replacement: Callable[..., Any]) -> Iterator[None]:
    with _patch_lock:
        _Function.apply = classmethod(replacement)  # type: ignore[assignment, method-assign]
        try:
            yield
        finally:
            _Function.apply = classmethod(_original_apply)  # type: ignore[assignment, method-assign]


@contextmanager
def functions_as_calls() -> Iterator[None]:
    """While this is open, applying a Function to an fx proxy records one call node."""

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        proxy = _proxy_in((args, kwargs))
        if proxy is None:
            return _original_apply(cls, *args, **kwargs)
        return proxy.tracer.create_proxy("call_function", applier(cls), args, kwargs)

    with _patched_apply(apply):
        yield


@contextmanager
def functions_applied(seen: list[type]) -> Iterator[None]:
    """While this is open, every Function applied to a tensor that could require grad (of a
    floating or complex dtype) is listed in `seen` (torch.export runs the model with its own
    tensors and inlines the forward); whether the example's did is no measure, as a call's input
    may require grad, or a layer frozen while compiling be trained later. But not the one
    torch.library makes for a custom op's registered backward, whose op torch.export keeps as one
    node of the graph (its backward runs)."""

    tracing = threading.get_ident()

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        leaves = tree_flatten((args, kwargs))[0]
        differentiable = any(isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) for t in leaves)
        if differentiable and threading.get_ident() == tracing and cls.__module__ != _CUSTOM_OPS:  # not another pipeline's workers
            seen.append(cls)
        return _original_apply(cls, *args, **kwargs)

    with _patched_apply(apply):
        yield
