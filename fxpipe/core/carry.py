"""What a graph that runs one slice of a sequence calls: the carried keys and values, and attention from a later slice."""
from __future__ import annotations

from typing import Optional

import torch


def with_carry(carry: Optional[torch.Tensor], value: torch.Tensor, dim: int) -> torch.Tensor:
    """`value`, the keys (or values) of this slice, after those of the slices before it (`carry`,
    None for the first slice): every position up to this slice's last, along `dim`."""
    return value if carry is None else torch.cat([carry, value], dim)


def causal_mask(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Which keys each query of a slice may read (True), along the last two dims of attention's
    scores: the keys are every position up to the slice's last, the queries the slice's own, its
    last positions. Causal attention's mask, aligned to the lower right."""
    length, seen = queries.size(-2), keys.size(-2)
    return torch.ones(length, seen, dtype=torch.bool, device=queries.device).tril(seen - length)
