"""The plan: which nodes run on which device, and which values travel between stages."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from fxpipe.passes.edges import ACTIVATION, INPUT, OUTPUT, SKIP, Edge

__all__ = ["Edge", "Plan", "StagePlan"]


@dataclass
class StagePlan:
    """One stage: its device, its nodes in order, what it receives and what it sends on."""

    index: int
    device: str
    nodes: list[str]
    inputs: list[str]
    outputs: list[str]
    param_bytes: int
    size: int = 0
    modules: list[str] = field(default_factory=list)  # the module path of each node
    flops: int = 0  # forward
    time: float = 0.0  # predicted forward + backward seconds per batch, receiving included
    memory: int = 0  # predicted bytes held: parameters (scaled) and activations in flight


@dataclass
class Plan:
    """The contract between the passes and the runtime: small, printable, serialisable."""

    stages: list[StagePlan]
    edges: list[Edge]
    chunks: int
    checkpoint: str
    balance: str = "memory"
    notes: list[str] = field(default_factory=list)

    def edges_of_kind(self, kind: str) -> list[Edge]:
        return [e for e in self.edges if e.kind == kind]

    @property
    def skip_edges(self) -> list[Edge]:
        """The stash/pop edges: values that jump over at least one stage."""
        return self.edges_of_kind(SKIP)

    def _bytes(self, stage: int, kinds: tuple[str, ...], incoming: bool) -> int:
        return sum(e.nbytes for e in self.edges if e.kind in kinds and (e.dst if incoming else e.src) == stage)

    def predicted_time(self) -> float:
        """Seconds per batch by the GPipe model: `sum(t_i) + (chunks - 1) * max(t_i)` over
        per-micro-batch stage times."""
        times = [s.time / self.chunks for s in self.stages]
        return sum(times) + (self.chunks - 1) * max(times)

    def predicted_bubble(self) -> float:
        """The share of device time spent idle, from the predicted stage times."""
        busy = sum(s.time for s in self.stages)
        total = len(self.stages) * self.predicted_time()
        return 1 - busy / total if total > 0 else 0.0

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
        footer = (
            f"chunks={self.chunks}  checkpoint={self.checkpoint!r}  balance={self.balance!r}  "
            f"predicted: {self.predicted_time() * 1e3:.3g} ms per batch, bubble {self.predicted_bubble():.0%}\n"
            f"stash/pop edges: {skips}"
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
