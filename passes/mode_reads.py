"""Autocast state a trace read (`torch.is_autocast_enabled()`, `torch.get_autocast_dtype(...)`):
the graph holds what it said then, so a call under another autocast must be refused.

The stages run under the caller's autocast, which casts each op as the plain model's would; but
a forward that asks whether autocast is on (to upcast an attention, say) asked once, when traced.
For the length of a trace, torch's autocast queries are wrapped to note what the model's code
asked (not torch's own code, nor other threads) and what it was told.
"""
from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from fxpipe.passes.attribute_reads import from_the_model

_QUERIES = ("is_autocast_enabled", "get_autocast_dtype", "is_autocast_cpu_enabled", "get_autocast_gpu_dtype", "get_autocast_cpu_dtype")

ModeReads = dict[tuple[str, tuple[Any, ...]], Any]


@contextmanager
def mode_reads_recorded() -> Iterator[ModeReads]:
    """Within this block, what the model's code on this thread asks torch of autocast, and the
    answers, by query and arguments (the first answer of each)."""
    read: ModeReads = {}
    thread = threading.get_ident()
    originals = {name: getattr(torch, name) for name in _QUERIES if hasattr(torch, name)}

    def noting(name: str, query: Callable[..., Any]) -> Callable[..., Any]:
        def noted(*args: Any) -> Any:
            answer = query(*args)
            if threading.get_ident() == thread and from_the_model(sys._getframe(1).f_code.co_filename):
                read.setdefault((name, args), answer)
            return answer

        return noted

    for name, query in originals.items():
        setattr(torch, name, noting(name, query))
    try:
        yield read
    finally:
        for name, query in originals.items():
            setattr(torch, name, query)


def modes_changed(read: ModeReads) -> list[str]:
    """Of `read`, each query whose answer differs now, as `torch.query(args): then -> now`."""
    changed = []
    for (name, args), answer in read.items():
        now = getattr(torch, name)(*args)
        if now != answer:
            shown = ", ".join(map(repr, args))
            changed.append(f"torch.{name}({shown}): {answer!r} when traced, {now!r} now")
    return changed
