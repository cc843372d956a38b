"""Timelines of a step, measured or predicted: per action its worker, start and end; the bubble,
the micro-batches each stage holds, a Chrome trace and a Gantt chart."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence
from xml.sax.saxutils import escape

from fxpipe.schedules.actions import BACKWARD, FORWARD, INPUT_GRAD, RECOMPUTE, WEIGHT_GRAD

UPDATE = "U"  # a stage's share of the optimizer's step, in a loop whose steps overlap (2bw)
COLOURS = {FORWARD: "#4c78a8", BACKWARD: "#f58518", INPUT_GRAD: "#e45756", WEIGHT_GRAD: "#72b7b2", RECOMPUTE: "#b279a2", UPDATE: "#54a24b"}


@dataclass(frozen=True)
class Record:
    kind: str  # F, B, I, W, R or U
    stage: int
    micro_batch: int
    rank: int  # the worker that ran it
    start: float  # seconds
    end: float


@dataclass
class Timeline:
    records: list[Record]
    workers: int
    peak_bytes: dict[int, float] = field(default_factory=dict)  # per stage, when measured
    device_peak_bytes: dict[str, int] = field(default_factory=dict)  # per CUDA device, when measured
    levels: dict[int, int] = field(default_factory=dict)  # per stage, its level in the stage graph (Layout.levels)

    @property
    def makespan(self) -> float:
        if not self.records:
            return 0.0
        return max(r.end for r in self.records) - min(r.start for r in self.records)

    def bubble(self) -> float:
        """The share of worker time spent waiting, from the first start to the last end."""
        total = self.workers * self.makespan
        busy = sum(r.end - r.start for r in self.records)
        return max(0.0, 1 - busy / total) if total > 0 else 0.0

    def order(self, rank: int) -> list[tuple[str, int, int]]:
        """(kind, stage, micro-batch) of the actions a worker ran, in the order they started."""
        mine = sorted((r for r in self.records if r.rank == rank), key=lambda r: r.start)
        return [(r.kind, r.stage, r.micro_batch) for r in mine]

    def most_alive(self) -> dict[int, int]:
        """Per stage, the most micro-batches it held at once: from the start of a forward to the
        end of the micro-batch's last backward action (B, or W)."""
        last = {}
        for r in self.records:
            if r.kind in (BACKWARD, WEIGHT_GRAD):
                last[(r.stage, r.micro_batch)] = r.end
        events: dict[int, list[tuple[float, float]]] = {}
        for r in self.records:
            if r.kind == FORWARD:
                events.setdefault(r.stage, []).append((r.start, 1))
                end = last.get((r.stage, r.micro_batch))
                if end is not None:
                    events[r.stage].append((end, -1))
        return {stage: int(peak) for stage, peak in running_peaks(events).items()}

    def to_dict(self) -> dict[str, object]:
        return {"workers": self.workers, "records": [asdict(r) for r in self.records], "peak_bytes": self.peak_bytes,
                "device_peak_bytes": self.device_peak_bytes, "levels": self.levels}  # fmt: skip

    def to_chrome_trace(self, path: Optional[str] = None) -> str:
        """The timeline as Chrome trace JSON (Perfetto, chrome://tracing): one track per stage,
        grouped by the worker that runs it, one complete event per action. Written to `path`
        when given."""
        origin = min((r.start for r in self.records), default=0.0)
        events: list[dict[str, object]] = []
        for rank, stage in sorted({(r.rank, r.stage) for r in self.records}):
            events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"worker {rank}"}})
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": stage, "args": {"name": f"stage {stage}"}})
        for r in self.records:
            events.append(
                {
                    "name": f"{r.kind}{r.micro_batch}", "cat": r.kind, "ph": "X", "pid": r.rank, "tid": r.stage,
                    "ts": (r.start - origin) * 1e6, "dur": (r.end - r.start) * 1e6,
                    "args": {"stage": r.stage, "micro_batch": r.micro_batch},
                }  # fmt: skip
            )
        text = json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text

    def to_svg(
        self, path: Optional[str] = None, predicted: Optional["Timeline"] = None, title: str = "measured", predicted_title: str = "predicted",
    ) -> str:
        """A Gantt chart, one row per worker; with `predicted`, the prediction is drawn below on
        the same time scale (`predicted_title`: say where its times come from, `plan.times`).
        Workers whose stages run side by side (one level of a stage DAG) sit in one shaded band."""
        charts = [(title, self)] + ([(predicted_title, predicted)] if predicted is not None else [])
        svg = _gantt(charts)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(svg)
        return svg


def running_peaks(events: dict[int, list[tuple[float, float]]]) -> dict[int, float]:
    """Per key, the highest a running sum gets: each event is (time, change), taken in time
    order, a release before a take at the same time."""
    peaks = {}
    for key, points in events.items():
        now = peak = 0.0
        for _, change in sorted(points):
            now += change
            peak = max(peak, now)
        peaks[key] = peak
    return peaks


def _rows_by_level(timeline: Timeline) -> list[tuple[Optional[int], list[int]]]:
    """The workers grouped by the level of their first stage (in level order), or all in one
    group when the timeline has no levels."""
    if not timeline.levels:
        return [(None, list(range(timeline.workers)))]
    first: dict[int, int] = {}
    for r in sorted(timeline.records, key=lambda r: r.stage):
        first.setdefault(r.rank, timeline.levels.get(r.stage, 0))
    groups: dict[int, list[int]] = {}
    for rank in range(timeline.workers):
        groups.setdefault(first.get(rank, 0), []).append(rank)
    return sorted(groups.items())


def _stages_label(timeline: Timeline, rank: int, level: Optional[int]) -> str:
    """What a worker's row says besides its number: the stages it ran where it ran several
    (interleaved: worker 0 runs stages 0 and 2), else its stage's level in the stage graph."""
    stages = sorted({r.stage for r in timeline.records if r.rank == rank})
    if len(stages) > 1:
        return " · stages " + ", ".join(map(str, stages))
    return f" · level {level}" if level is not None else ""


def _bar(r: Record, x: float, w: float, y: float, row: float) -> str:
    bar = (f'<rect x="{x:.2f}" y="{y:.1f}" width="{w:.2f}" height="{row - 4:.1f}" fill="{COLOURS[r.kind]}">'
           f"<title>{r.kind}{r.micro_batch} stage {r.stage}</title></rect>")  # fmt: skip
    if w > 14:
        bar += f'<text x="{x + 2:.2f}" y="{y + 13:.1f}" font-size="9" fill="white">{r.kind}{r.micro_batch}</text>'
    return bar


def _gantt(charts: Sequence[tuple[str, Timeline]]) -> str:
    width, row, gap = 900.0, 22.0, 30.0
    left = 130.0 if any(t.levels for _, t in charts) else 90.0
    span = max((t.makespan for _, t in charts), default=0.0) or 1.0
    scale = (width - left - 10) / span
    parts, y = [], 10.0
    for title, timeline in charts:
        parts.append(f'<text x="4" y="{y + 12:.1f}" font-size="12" font-weight="bold">{escape(title)}: '
                     f"{timeline.makespan * 1e3:.3g} ms, bubble {timeline.bubble():.0%}</text>")  # fmt: skip
        y += 18
        origin = min((r.start for r in timeline.records), default=0.0)
        rows = _rows_by_level(timeline)
        for level, ranks in rows:
            if level is not None and len(ranks) > 1:  # concurrent stages: one band
                parts.append(f'<rect x="2" y="{y - 1:.1f}" width="{width - 4:.0f}" height="{row * len(ranks):.1f}" fill="#f2f2f2"/>')
            for rank in ranks:
                label = f"worker {rank}" + _stages_label(timeline, rank, level)
                parts.append(f'<text x="4" y="{y + 15:.1f}" font-size="11">{label}</text>')
                for r in (r for r in timeline.records if r.rank == rank):
                    parts.append(_bar(r, left + (r.start - origin) * scale, max((r.end - r.start) * scale, 0.5), y, row))
                y += row
        y += gap
    height = y
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="sans-serif">\n' + "\n".join(parts) + "\n</svg>\n"
    )
