"""Functions a compiled stage calls eagerly, outside its graph: the runtime's own bookkeeping."""
from __future__ import annotations

from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

# Calls a generated stage makes that dynamo would trace into, guarding on the runtime's state
# (a thread's batch statistics, say) and recompiling for it: run as they are, between graphs.
EAGER_IN_COMPILED: set[Callable[..., Any]] = set()


def runs_eagerly(function: F) -> F:
    """Mark `function`, which generated stages call, to run outside a compiled stage's graph."""
    EAGER_IN_COMPILED.add(function)
    return function
