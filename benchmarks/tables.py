"""Markdown tables of the benchmarks' rows, each column as wide as its widest cell."""
from __future__ import annotations

from typing import Sequence


def print_markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(n) for h, n in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (n + 2) for n in widths) + "|")
    for row in rows:
        print("| " + " | ".join(c.ljust(n) for c, n in zip(row, widths)) + " |")
