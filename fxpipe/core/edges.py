"""What travels between stages: an edge, its kind, and the stage index of the pipeline's caller."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CALLER = -1  # the stage index of the pipeline's caller: the source of its inputs
INPUT, ACTIVATION, SKIP, OUTPUT = "input", "activation", "skip", "output"  # kinds of edge


@dataclass(frozen=True)
class Edge:
    """One value sent from stage `src` to stage `dst`, once per micro-batch (`src` is CALLER
    for the pipeline's inputs, `dst` the stage count for its output)."""

    value: str
    src: int
    dst: int
    kind: str
    shape: Any
    dtype: Any
    nbytes: int
