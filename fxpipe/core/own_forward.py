"""A model whose forward now calls its own pipeline (so that `model(x)`, or `model.generate()`, runs on it): that call found, and the forward traced put back while stages are compiled inside it."""

import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from torch import nn

# The frames of a module's call (`model(x)`), whose `self` is the module called.
_CALL_CODES = (nn.Module._call_impl.__code__, nn.Module._wrapped_call_impl.__code__)


def in_the_models_own_call(model: nn.Module) -> bool:
    """Whether this thread is inside a call of `model` as a module (its `__call__`), as it is
    where the model's forward, replaced since compiling, calls the pipeline."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _CALL_CODES and frame.f_locals.get("self") is model:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


@contextmanager
def traced_forward_put_back(model: nn.Module, cls: type, own_forward: Any) -> Iterator[None]:
    """The model with the class and the instance forward it was traced with (`own_forward`: None
    where it had none), for a compile inside its own call: the forward that replaced them calls
    the pipeline, and a trace of it would trace the pipeline."""
    now_cls, had, now_forward = type(model), "forward" in model.__dict__, model.__dict__.get("forward")
    model.__class__ = cls
    if own_forward is None:
        model.__dict__.pop("forward", None)
    else:
        model.__dict__["forward"] = own_forward
    try:
        yield
    finally:
        model.__class__ = now_cls
        if had:
            model.__dict__["forward"] = now_forward
        else:
            model.__dict__.pop("forward", None)


# The models being compiled on this thread, each with the pipelines of it that its forward called.
_COMPILING = threading.local()


@contextmanager
def calls_of_its_pipelines_noted(model: nn.Module) -> Iterator[list[Any]]:
    """While `model` compiles: the pipelines of it that its forward calls (`pipeline_called`),
    which a trace cannot go through: its forward was replaced by one that calls them."""
    held: dict[int, list[Any]] = _COMPILING.__dict__.setdefault("models", {})
    before = held.get(id(model))
    found: list[Any] = []
    held[id(model)] = found
    try:
        yield found
    finally:
        if before is None:
            held.pop(id(model), None)
        else:
            held[id(model)] = before


def pipeline_called(model: nn.Module, pipe: Any) -> bool:
    """Notes a call of `pipe`, a pipeline of `model`; whether `model` is compiling on this thread."""
    found = _COMPILING.__dict__.get("models", {}).get(id(model))
    if found is None:
        return False
    found.append(pipe)
    return True
