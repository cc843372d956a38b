"""Lists of names in messages: the first few, and how many more there are."""
from __future__ import annotations

from typing import Iterable


def listed(items: Iterable[str], most: int = 5) -> str:
    """'a, b, c' for up to `most` items; the first `most` and 'and N more' for more."""
    items = list(items)
    shown = ", ".join(items[:most])
    return f"{shown} and {len(items) - most} more" if len(items) > most else shown
