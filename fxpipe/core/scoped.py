"""A thread-local value, set for the length of a block and put back after it."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator


@contextmanager
def scoped(local: threading.local, name: str, value: Any, unset: Any = None) -> Iterator[None]:
    """`local.name` is `value` within this block, on this thread; what it was (`unset` if
    nothing), after."""
    previous = getattr(local, name, unset)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, previous)
