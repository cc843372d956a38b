"""Queries of a tensor's layout in memory by the model's code (`x.is_contiguous()`, `x.stride()`) while it is captured."""
from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from fxpipe.tracing.attribute_reads import from_the_model

# torch.export answers these from the example's tensors, and the graph holds the branches they
# took: a call whose tensors lie otherwise in memory is then another kind of call.
_QUERIES = ("is_contiguous", "stride", "storage_offset")

_lock = threading.Lock()
_watching: dict[int, list[str]] = {}  # by thread: the lines that asked
_originals: dict[str, tuple[bool, Callable[..., Any]]] = {}  # by query: whether torch.Tensor held its own, and it


@contextmanager
def layout_reads() -> Iterator[list[str]]:
    """Within this block, 'file:line' of each query of a tensor's layout that the model's code
    (not torch's, nor fxpipe's) makes on this thread."""
    lines: list[str] = []
    with _lock:
        if not _watching:
            for name in _QUERIES:
                _originals[name] = (name in vars(torch.Tensor), getattr(torch.Tensor, name))
                setattr(torch.Tensor, name, _watched(name, _originals[name][1]))
        _watching[threading.get_ident()] = lines
    try:
        yield lines
    finally:
        with _lock:
            del _watching[threading.get_ident()]
            if not _watching:
                for name, (own, original) in _originals.items():
                    setattr(torch.Tensor, name, original) if own else delattr(torch.Tensor, name)


def _watched(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def query(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        lines = _watching.get(threading.get_ident())
        if lines is not None:
            caller = sys._getframe(1)
            if from_the_model(caller.f_code.co_filename):
                lines.append(f"{caller.f_code.co_filename}:{caller.f_lineno}")
        return original(self, *args, **kwargs)

    query.__name__ = query.__qualname__ = name
    return query
