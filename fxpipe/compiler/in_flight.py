"""How many micro-batches each stage holds at its peak under a schedule: what a stage's memory counts.

GPipe runs every forward before any backward: each stage holds every micro-batch at once. 1F1B
holds fewer, and fewer the later the stage (stage k of n a chain: n - k at most), so a cut that
balances GPipe's memory overloads the first stages under it. The counts come from the schedule's
own action lists, simulated with one byte per micro-batch:

    whole   micro-batches whose activations the stage holds at once (not checkpointed, or
            recomputed and not yet through their backward)
    held    micro-batches it holds anything of (a checkpointed one keeps its inputs)
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch.fx as fx

from fxpipe.passes.dag_partition import stage_links
from fxpipe.schedules.actions import Layout
from fxpipe.schedules.check import make_schedule
from fxpipe.schedules.simulate import StageCosts, simulate

InFlight = list[tuple[float, float]]  # per stage: (whole, held)


def chain_layout(ranks: Sequence[int]) -> Layout:
    """The stages in a chain, each on its worker: the layout a cut of the linear order makes
    (before the cut is known: what else a stage sends further on changes no stage's order)."""
    stages = len(ranks)
    return Layout(tuple(ranks), frozenset((k, k + 1) for k in range(stages - 1)), (stages - 1,))


def layout_of(runs: Sequence[Sequence[fx.Node]], ranks: Sequence[int], actions: Sequence[tuple[float, float, float]] = ()) -> Layout:
    """The layout of the stages `runs` make: which reads which, and which make the output."""
    outputs = tuple(k for k, run in enumerate(runs) if any(user.op == "output" for node in run for user in node.users))
    return Layout(tuple(ranks), frozenset(stage_links(runs)), outputs, tuple(actions))


def in_flight_of(runs: Sequence[Sequence[fx.Node]], ranks: Sequence[int], schedule: str, costs: dict[str, Any]) -> Optional[InFlight]:
    """`in_flight` of the stages `runs` make, for the chunks and checkpointing of `costs`."""
    return in_flight(schedule, layout_of(runs, ranks), costs["chunks"], costs["checkpointed"])


def in_flight(schedule: str, layout: Layout, chunks: int, checkpointed: int) -> Optional[InFlight]:
    """Per stage of `layout`, (whole, held) at its peak under `schedule`; None where the schedule
    cannot run this layout (too few micro-batches for it, say), which its own check refuses later."""
    try:
        made = make_schedule(schedule, layout, chunks, checkpointed)
    except ValueError:
        return None
    # Activation bytes 1 and input bytes 0 count whole micro-batches; 1 and 1, every one held
    # (a checkpointed one holds its inputs from its forward to its backward).
    whole = simulate(made, layout, [StageCosts(1.0, 2.0, 1.0, 0.0)] * layout.stages, checkpointed).peak_bytes
    held = simulate(made, layout, [StageCosts(1.0, 2.0, 1.0, 1.0)] * layout.stages, checkpointed).peak_bytes
    return [(whole.get(stage, 0.0), held.get(stage, 0.0)) for stage in range(layout.stages)]
