"""Random states a forward sets itself (`torch.manual_seed(42)` before drawing, a generator made
and seeded in forward): a traced graph keeps the draws and loses the seeding, so the pipeline
would draw other numbers than the plain model. Refused, naming the call.
"""
from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx

from fxpipe.tracing.attribute_reads import from_the_model

# Where torch's seeding functions live, by the names a model calls them by.
_SEEDING = [(torch, "manual_seed"), (torch, "seed"), (torch, "set_rng_state"),
            (torch.random, "manual_seed"), (torch.random, "seed"), (torch.random, "set_rng_state")]  # fmt: skip


@contextmanager
def seeding_recorded() -> Iterator[list[str]]:
    """Within this block, the lines of the model's code on this thread that seed torch's
    generator (`torch.manual_seed`, `torch.set_rng_state`, ...)."""
    found: list[str] = []
    thread = threading.get_ident()
    originals = [(home, name, getattr(home, name)) for home, name in _SEEDING]

    def noting(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def noted(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            if threading.get_ident() == thread and from_the_model(caller.f_code.co_filename):
                found.append(f"torch.{name} at {caller.f_code.co_filename}:{caller.f_lineno}")
            return call(*args, **kwargs)

        return noted

    for home, name, call in originals:
        setattr(home, name, noting(name, call))
    try:
        yield found
    finally:
        for home, name, call in originals:
            setattr(home, name, call)


def generators_held(gm: fx.GraphModule) -> list[str]:
    """The nodes of `gm` that draw from a generator the graph holds as a constant (one the
    forward made while traced): it would go on from where the last call left it."""
    found = []
    for node in gm.graph.nodes:
        values = [*node.args, *node.kwargs.values()]
        for value in values:
            if isinstance(value, fx.Node) and value.op == "get_attr":
                value = getattr(gm, str(value.target), None)
            if isinstance(value, torch.Generator):
                found.append(node.name)
                break
    return found


def refuse_seeding(seeded: list[str], held: list[str]) -> None:
    if not seeded and not held:
        return
    where = "; ".join(dict.fromkeys(seeded)) or f"a generator made in forward, drawn from by {', '.join(dict.fromkeys(held))}"
    raise ValueError(
        f"the model's forward sets the random state it draws from ({where}): a traced graph keeps the draws and "
        "not the seeding, and the pipeline would draw other numbers than the model.\nHow to fix: draw the fixed "
        "numbers once, in __init__, and register them as a buffer (self.register_buffer('noise', ...)); or seed "
        "outside the model, before the call."
    )

