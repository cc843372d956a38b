"""The torch.Generator objects a forward draws from (`generator=G`), other than torch's default ones."""
from __future__ import annotations

import os
import sys
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

from fxpipe.core.own_code import is_ours

_TORCH = os.path.dirname(torch.__file__) + os.sep


@dataclass
class Drawn:
    """A generator drawn from: held weakly (one the forward made dies with the run), with its
    state before the first draw and the line of the model's code that drew first."""

    generator: "weakref.ref[torch.Generator]"
    state: torch.Tensor
    where: str


class _Watch(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.drawn: dict[int, Drawn] = {}

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        generator = kwargs.get("generator")
        if isinstance(generator, torch.Generator) and not _default(generator) and id(generator) not in self.drawn:
            self.drawn[id(generator)] = Drawn(weakref.ref(generator), generator.get_state(), _models_line())
        return func(*args, **kwargs)


@contextmanager
def generators_drawn() -> Iterator[list[Drawn]]:
    """Within this block, on this thread: the generators drawn from that outlive it (held by the
    model, a module of its code, a closure), each put back at the block's end to its state before
    the first draw, so that running the model here moves none of them."""
    watch, alive = _Watch(), list[Drawn]()
    try:
        with watch:
            yield alive
    finally:
        for drawn in watch.drawn.values():
            generator = drawn.generator()
            if generator is not None:
                generator.set_state(drawn.state)
                alive.append(drawn)


def _default(generator: torch.Generator) -> bool:
    if generator is torch.default_generator:
        return True
    cuda = generator.device.type == "cuda" and torch.cuda.is_initialized()
    return cuda and generator is torch.cuda.default_generators[generator.device.index or 0]


def _models_line() -> str:
    """'file:line' of the innermost frame outside torch and fxpipe: the model's code that drew."""
    frame = sys._getframe(2)
    while frame.f_back is not None and (frame.f_code.co_filename.startswith(_TORCH) or is_ours(frame.f_code.co_filename)):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"
