"""The schedule simulator: a schedule and per-stage costs in, the predicted timeline out.

Each action starts when its worker is free and everything it receives has arrived (the producer's
end plus the transfer time of the link); the actions are taken in an order of the checker's
dependency graph (fxpipe/schedules/actions.py), so every start is known when it is needed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from fxpipe.schedules.actions import BACKWARD, FORWARD, INPUT_GRAD, RECOMPUTE, WEIGHT_GRAD, Action, Layout, Schedule, dependency_graph
from fxpipe.schedules.timeline import Record, Timeline, running_peaks


@dataclass
class StageCosts:
    """Seconds per micro-batch of one stage's actions, and the bytes it holds per micro-batch."""

    forward: float
    backward: float  # B; I and W take `input_share` and the rest of it
    activation_bytes: float = 0.0  # held from F to the end of backward (not when checkpointed)
    input_bytes: float = 0.0  # held by a checkpointed micro-batch until its recompute
    input_share: float = 0.5

    @classmethod
    def split(cls, forward: float, input_grad: float, weight_grad: float, **held: float) -> "StageCosts":
        """From the seconds of F, I and W (a Layout's `costs`), and the bytes `held`."""
        backward = input_grad + weight_grad
        return cls(forward, backward, **held, input_share=input_grad / backward if backward > 0 else 0.5)

    def seconds(self, kind: str) -> float:
        return {
            FORWARD: self.forward, RECOMPUTE: self.forward, BACKWARD: self.backward,
            INPUT_GRAD: self.backward * self.input_share, WEIGHT_GRAD: self.backward * (1 - self.input_share),
        }[kind]  # fmt: skip


@dataclass
class Prediction:
    timeline: Timeline
    peak_bytes: dict[int, float] = field(default_factory=dict)  # per stage, activations held


def simulate(
    schedule: Schedule,
    layout: Layout,
    costs: list[StageCosts],
    checkpointed: int = 0,
    transfer: dict[tuple[int, int], float] | None = None,
) -> Prediction:
    """Predict the timeline of `schedule`; `transfer[(src, dst)]` is the seconds to move one
    micro-batch's values over that link (gradients take the same the other way)."""
    transfer = transfer or {}
    graph = dependency_graph(schedule, layout, checkpointed)
    end: dict[Action, float] = {}
    records = []
    for action in nx.topological_sort(graph):
        ready = 0.0
        for dep in graph.predecessors(action):
            link = (dep.stage, action.stage) if dep.kind == FORWARD else (action.stage, dep.stage)
            delay = transfer.get(link, 0.0) if dep.stage != action.stage else 0.0
            ready = max(ready, end[dep] + delay)
        start = ready
        end[action] = start + costs[action.stage].seconds(action.kind)
        records.append(Record(action.kind, action.stage, action.micro_batch, layout.ranks[action.stage], start, end[action]))
    records.sort(key=lambda r: (r.start, r.rank))
    return Prediction(Timeline(records, layout.workers, levels=layout.levels), _peak_bytes(records, costs, checkpointed))


def _peak_bytes(records: list[Record], costs: list[StageCosts], checkpointed: int) -> dict[int, float]:
    """Per stage, the most activation bytes held at once, by the rule of each action:
    F keeps activations (inputs only, if checkpointed), R restores them, B or W frees them."""
    events: dict[int, list[tuple[float, float]]] = {}
    for r in records:
        c = costs[r.stage]
        held = c.input_bytes if r.micro_batch < checkpointed else c.activation_bytes
        change = {FORWARD: (r.start, held), RECOMPUTE: (r.start, c.activation_bytes - c.input_bytes),
                  BACKWARD: (r.end, -c.activation_bytes), WEIGHT_GRAD: (r.end, -c.activation_bytes)}.get(r.kind)  # fmt: skip
        if change is not None:
            events.setdefault(r.stage, []).append(change)
    return running_peaks(events)
