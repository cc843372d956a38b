"""The plan: which nodes run on which device, and which values travel between stages."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import networkx as nx

from fxpipe.core.edges import ACTIVATION, CALLER, INPUT, OUTPUT, SKIP, Edge
from fxpipe.schedules.actions import INPUT_GRAD, Layout, Schedule, checkpoint_stop
from fxpipe.schedules.check import make_schedule
from fxpipe.schedules.simulate import Prediction, StageCosts, simulate
from fxpipe.schedules.timeline import UPDATE
from fxpipe.schedules.two_bw import two_bw

__all__ = ["ACTIVATION", "CALLER", "INPUT", "OUTPUT", "SKIP", "Edge", "Plan", "StagePlan"]

@dataclass
class StagePlan:
    """One stage: its device, its nodes in order, what it receives and what it sends on."""

    index: int
    device: str
    nodes: list[str]
    inputs: list[str]
    outputs: list[str]
    param_bytes: int
    modules: list[str] = field(default_factory=list)  # the module path of each node
    flops: int = 0  # forward
    time: float = 0.0  # predicted forward + backward seconds per batch, receiving included
    memory: int = 0  # predicted bytes held: parameters (scaled) and activations in flight
    activation_bytes: int = 0  # what the stage's nodes make, per batch (held until backward)
    carry_bytes: int = 0  # slices of a sequence: the keys and values its slices carry, per batch (in `memory`)
    forward_share: float = 1 / 3  # of `time`: measured where times are, else a forward in three
    input_share: float = 0.5  # of the backward, the inputs' gradients (zb-h1's I): measured for zb-h1 with balance='time'


@dataclass
class Plan:
    """The contract between the passes and the runtime: small, printable, serialisable."""

    stages: list[StagePlan]
    edges: list[Edge]
    chunks: int
    checkpoint: str
    balance: str = "memory"
    notes: list[str] = field(default_factory=list)
    schedule: str = "gpipe"  # what train_step runs; pipe(x) + backward() runs GPipe
    ranks: list[int] = field(default_factory=list)  # the worker (device slot) of each stage
    # Where the stage times (and so every prediction) come from: measured, or FLOPs at a rate.
    times: str = "measured"
    # The micro-batches the example runs as, which every prediction is for: `chunks`, or one per
    # sample of an example smaller than it (0: `chunks`).
    example_micro_batches: int = 0

    @property
    def micro_batches(self) -> int:
        return self.example_micro_batches or self.chunks

    def edges_of_kind(self, kind: str) -> list[Edge]:
        return [e for e in self.edges if e.kind == kind]

    @property
    def skip_edges(self) -> list[Edge]:
        """The stash/pop edges: values that jump over at least one stage."""
        return self.edges_of_kind(SKIP)

    @property
    def stage_graph(self) -> nx.DiGraph:
        """The stages as a graph: an edge s -> t where stage t reads values stage s makes, with
        `values`, their names in the order they travel. Nodes are the stage indices alone: the
        caller, which gives the inputs, and the output are not stages."""
        graph = nx.DiGraph()
        graph.add_nodes_from(range(len(self.stages)))
        for edge in self.edges:
            if edge.src == CALLER or edge.dst >= len(self.stages):
                continue
            if not graph.has_edge(edge.src, edge.dst):
                graph.add_edge(edge.src, edge.dst, values=[])
            values = graph.edges[edge.src, edge.dst]["values"]
            if edge.value not in values:
                values.append(edge.value)
        return graph

    @property
    def depth(self) -> int:
        """Stages on the longest path of `stage_graph`: a chain in which every stage feeds the
        next has its stage count; stages that read only the inputs run side by side."""
        return self.layout().depth

    def _graph_line(self) -> str:
        """`stage_graph` in one line for the summary: each edge, and the depth."""
        graph = self.stage_graph
        edges = ", ".join(f"{s}->{t}" for s, t in sorted(graph.edges)) or "none"
        return f"stage graph: {edges}; depth {self.depth} of {len(self.stages)} stages"

    def _bytes(self, stage: int, kinds: tuple[str, ...], incoming: bool) -> int:
        return sum(e.nbytes for e in self.edges if e.kind in kinds and (e.dst if incoming else e.src) == stage)

    def layout(self) -> Layout:
        """What a schedule needs of this plan: each stage's worker, the links between stages,
        and the predicted F, I and W seconds per micro-batch of each stage."""
        return Layout.of(self.edges, self.ranks or range(len(self.stages)), self.action_costs())

    def action_costs(self) -> list[tuple[float, float, float]]:
        """Per stage, the predicted seconds per micro-batch of its F, I and W."""
        costs = []
        for s in self.stages:
            forward, backward = s.forward_share * s.time / self.micro_batches, (1 - s.forward_share) * s.time / self.micro_batches
            costs.append((forward, s.input_share * backward, (1 - s.input_share) * backward))
        return costs

    def prediction(self, schedule: Optional[str] = None) -> Prediction:
        """The simulated timeline of one training step under `schedule` (the plan's own by
        default), from the predicted stage times: a forward is a third of a stage's time, a
        backward the rest (each as measured, with balance='time'); a micro-batch's activations
        are the stage's over `chunks`."""
        return self.simulate(self._stage_costs(), schedule)

    def _stage_costs(self) -> list[StageCosts]:
        return [
            StageCosts.split(
                *actions, activation_bytes=s.activation_bytes / self.micro_batches,
                input_bytes=self._bytes(s.index, (ACTIVATION, INPUT, SKIP), True) / self.micro_batches,
            )
            for s, actions in zip(self.stages, self.action_costs())
        ]  # fmt: skip

    def loop_time(self) -> float:
        """Seconds per batch of a `train_steps` loop once it is under way: under 2bw, whose steps
        overlap, the simulated time of four batches' streams less that of two, halved (the fill
        and the drain cancel); under the other schedules, a step's."""
        if self.schedule != "2bw":
            return self.predicted_time()
        costs, layout = self._stage_costs(), self.layout()
        checkpointed = checkpoint_stop(self.checkpoint, self.micro_batches)

        def makespan(batches: int) -> float:
            streams = [tuple(a for a in acts if a.kind != UPDATE) for acts in two_bw(layout, self.micro_batches, batches, checkpointed)]
            return simulate(Schedule("2bw", tuple(streams), self.micro_batches * batches), layout, costs).timeline.makespan

        return (makespan(4) - makespan(2)) / 2

    def simulate(self, costs: list[StageCosts], schedule: Optional[str] = None) -> Prediction:
        """The simulated timeline of one training step of this plan under `schedule` (the plan's
        own by default) on the given per-micro-batch stage costs."""
        checkpointed = checkpoint_stop(self.checkpoint, self.micro_batches)
        layout = self.layout()
        sched = make_schedule(schedule or self.schedule, layout, self.micro_batches, checkpointed)
        return simulate(sched, layout, costs, checkpointed)

    def predicted_time(self) -> float:
        """Seconds per batch of the plan's schedule, simulated from the predicted stage times."""
        return self.prediction().timeline.makespan

    def predicted_bubble(self) -> float:
        """The share of device time spent idle under the plan's schedule."""
        return self.prediction().timeline.bubble()

    def summary(self) -> str:
        """A table a person reads: one row per stage."""
        header = ("stage", "device", "nodes", "params", "GFLOP", "time ms", "memory",
                  "in: act", "in: skip", "out: act", "out: skip")  # fmt: skip
        rows = [header]
        for s in self.stages:
            rows.append(
                (
                    str(s.index),
                    s.device,
                    str(len(s.nodes)),
                    human_bytes(s.param_bytes),
                    f"{s.flops / 1e9:.3f}",
                    f"{s.time * 1e3:.3g}",
                    human_bytes(s.memory),
                    human_bytes(self._bytes(s.index, (ACTIVATION, INPUT), True)),
                    human_bytes(self._bytes(s.index, (SKIP,), True)),
                    human_bytes(self._bytes(s.index, (ACTIVATION, OUTPUT), False)),
                    human_bytes(self._bytes(s.index, (SKIP,), False)),
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        skips = ", ".join(f"{e.value} {e.src}->{e.dst}" for e in self.skip_edges) or "none"
        predicted = self.prediction()
        peaks = ", ".join(human_bytes(predicted.peak_bytes.get(s.index, 0)) for s in self.stages)
        footer = (
            f"chunks={self.chunks}  checkpoint={self.checkpoint!r}  balance={self.balance!r}  schedule={self.schedule!r}  "
            f"predicted ({self.times}): {predicted.timeline.makespan * 1e3:.3g} ms per batch, bubble {predicted.timeline.bubble():.0%}\n"
            + (f"in a train_steps loop, no flush between batches: {self.loop_time() * 1e3:.3g} ms per batch\n" if self.schedule == "2bw" and self.micro_batches >= self.layout().depth else "")
            + ("zb-h1 keeps 1F1B's order here: on these stage times its split backward (I, then W) finishes no sooner\n"
               if self.schedule == "zb-h1" and not any(r.kind == INPUT_GRAD for r in predicted.timeline.records) else "")
            + f"predicted peak activations per stage: {peaks}\n"
            f"stash/pop edges: {skips}\n"
            f"{self._graph_line()}"
        )
        return "\n".join([*lines, footer, *self.notes])

    def __str__(self) -> str:
        return self.summary()

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists, dicts, strings, numbers) for JSON and for comparing plans."""
        data = asdict(self)
        for edge in data["edges"]:
            edge["dtype"] = str(edge["dtype"])
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, default=str)


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
