"""This process's place in a pipeline across processes: its coordinate, its groups and its device."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class RankPlacement:
    """This process's place in the pipeline group."""

    group: Any  # the "pp" process group
    ranks: list[int]  # the global rank at each pipeline coordinate
    me: int  # this process's pipeline coordinate
    device: torch.device  # where this rank's stages run
    timeout: float
    dp_group: Any = None  # the "dp" process group, when the mesh has one (one of fxpipe's, once connected)
    lines: list[list[int]] = field(default_factory=list)  # the global ranks of every pipeline of the mesh
    replica_lines: list[list[int]] = field(default_factory=list)  # the global ranks of each stage's replicas
    directions: dict[tuple[int, int], Any] = field(default_factory=dict)  # (from, to) -> its group

    @property
    def size(self) -> int:
        return len(self.ranks)
