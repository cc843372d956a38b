"""The GPipe clock-cycle schedule: which (micro-batch, stage) pairs run at each tick."""
from __future__ import annotations

from typing import Iterator


def clock_cycles(micro_batches: int, stages: int) -> Iterator[list[tuple[int, int]]]:
    """Yield, tick by tick, the (micro-batch, stage) pairs that run in forward.

    Micro-batch i runs on stage j at tick i + j: the pipeline fills, then drains.
    For 3 micro-batches on 3 stages:

        tick 0: (0,0)
        tick 1: (1,0) (0,1)
        tick 2: (2,0) (1,1) (0,2)
        tick 3:       (2,1) (1,2)
        tick 4:             (2,2)

    Backward runs the same ticks in reverse, and each tick's pairs in reverse.
    """
    for tick in range(micro_batches + stages - 1):
        yield [(tick - j, j) for j in range(max(0, tick - micro_batches + 1), min(tick + 1, stages))]
