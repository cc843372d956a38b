"""Autocast and torch's other process-wide state a trace read (`torch.is_autocast_enabled()`,
`torch.get_default_dtype()`): the graph holds what it said then, so a call under another must be refused.

The stages run under the caller's autocast, which casts each op as the plain model's would; but
a forward that asks whether autocast is on (to upcast an attention, say) asked once, when traced.
For the length of a trace, torch's autocast queries are wrapped to note what the model's code
asked (not torch's own code, nor other threads) and what it was told: in `torch` and wherever the
modules of the model's classes hold them under a name of their own (`from torch import ...`).
"""
from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

from fxpipe.tracing.attribute_reads import from_the_model

_AUTOCAST = ("is_autocast_enabled", "get_autocast_dtype", "is_autocast_cpu_enabled", "get_autocast_gpu_dtype", "get_autocast_cpu_dtype")
# torch's other process-wide state a forward may branch on, asked alike.
_QUERIES = (*_AUTOCAST, "get_default_dtype", "are_deterministic_algorithms_enabled", "is_deterministic_algorithms_warn_only_enabled",
            "is_inference_mode_enabled", "get_num_threads")  # fmt: skip

ModeReads = dict[tuple[str, tuple[Any, ...], tuple[tuple[str, Any], ...]], Any]  # query, args, kwargs: answer


@contextmanager
def mode_reads_recorded(model: nn.Module) -> Iterator[ModeReads]:
    """Within this block, what `model`'s code on this thread asks torch of autocast and its other
    state (`_QUERIES`), and the answers, by query and arguments (the first answer of each)."""
    read: ModeReads = {}
    thread = threading.get_ident()
    originals = _originals()
    homes = [vars(torch), *_aliasing(model, originals)]
    put_back = [(home, key, value) for home in homes for key, value in list(home.items()) if id(value) in originals]

    def noting(name: str, query: Callable[..., Any]) -> Callable[..., Any]:
        def noted(*args: Any, **kwargs: Any) -> Any:
            answer = query(*args, **kwargs)
            if threading.get_ident() == thread and from_the_model(sys._getframe(1).f_code.co_filename):
                read.setdefault((name, args, tuple(sorted(kwargs.items()))), answer)
            return answer

        return noted

    for home, key, query in put_back:
        home[key] = noting(originals[id(query)], query)
    try:
        yield read
    finally:
        for home, key, query in put_back:
            home[key] = query


def _originals() -> dict[int, str]:
    """torch's queries of its state, by id: the name in torch of each."""
    return {id(getattr(torch, name)): name for name in _QUERIES if hasattr(torch, name)}


def _aliasing(model: nn.Module, originals: dict[int, str]) -> list[dict[str, Any]]:
    """The globals of the Python modules that define `model`'s classes, where they hold a query."""
    found: dict[int, dict[str, Any]] = {}
    for cls in {type(m) for m in model.modules()}:
        home = sys.modules.get(cls.__module__)
        table = vars(home) if home is not None and home is not torch else None
        if table is not None and any(id(value) in originals for value in list(table.values())):
            found[id(table)] = table
    return list(found.values())


def autocast_alone(changed: list[str]) -> bool:
    """Whether `modes_changed`'s answers are all of autocast."""
    return all(line.removeprefix("torch.").startswith(_AUTOCAST) for line in changed)


def modes_changed(read: ModeReads) -> list[str]:
    """Of `read`, each query whose answer differs now, as `torch.query(args): then -> now`."""
    changed = []
    for (name, args, kwargs), answer in read.items():
        now = getattr(torch, name)(*args, **dict(kwargs))
        if now != answer:
            shown = ", ".join([*map(repr, args), *(f"{key}={value!r}" for key, value in kwargs)])
            changed.append(f"torch.{name}({shown}): {answer!r} when traced, {now!r} now")
    return changed
