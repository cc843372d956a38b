"""Chain or DAG: the stage graph that the cost model predicts faster, under the plan's schedule."""
from __future__ import annotations

import itertools
import math
from typing import Any, Optional, Sequence

import torch.fx as fx

from fxpipe.compiler.in_flight import in_flight_of, layout_of
from fxpipe.passes.costs import cut_model, report_model
from fxpipe.passes.dag_partition import dag_partition
from fxpipe.passes.inplace import input_write_spans
from fxpipe.passes.linearize import keeps_traced_order
from fxpipe.passes.partition import mark_stages, over_caps, split_apart
from fxpipe.passes.state import state_write_spans, view_write_spans
from fxpipe.schedules.check import make_schedule
from fxpipe.schedules.simulate import StageCosts, simulate
from fxpipe.schedules.two_bw import refuse_too_few_micro_batches

STAGE_GRAPHS = ("auto", "chain", "dag")


def choose_stage_graph(
    gm: fx.GraphModule, order: list[fx.Node], chain: list[list[fx.Node]], weights: Sequence[float], *, stage_graph: str,
    costs: dict[str, Any], caps: Optional[list[float]], schedule: str, ranks: list[int],
) -> list[list[fx.Node]]:
    """`chain` (runs of `order`, cut on `weights`), or the stage DAG of the graph search on the
    same weights where it can run: with 'dag' whenever the search finds one, with 'auto' where
    it is predicted faster."""
    if stage_graph == "chain" or len(chain) < 2:  # one stage is a chain and a DAG alike
        return chain
    # 'dag' takes every region of branches the search finds (force), or, where predicted faster,
    # only those that count, as 'auto' does: a cheap running sum of branches nests regions.
    found = [dag_partition(order, weights, len(chain), costs["chunks"], force=force) for force in ([False, True] if stage_graph == "dag" else [False])]
    dags = [d for d in found if d is not None and _fits(gm, d, costs, caps, schedule, ranks)]
    if not dags or keeps_traced_order(gm, order):
        return chain
    dag = min(dags, key=lambda d: predicted_seconds(d, costs, schedule, ranks)) if len(dags) > 1 else dags[0]
    if stage_graph == "auto" and predicted_seconds(dag, costs, schedule, ranks) >= predicted_seconds(chain, costs, schedule, ranks) * (1 - 1e-6):
        return chain
    mark_stages(dag)
    return dag


def kept_together(gm: fx.GraphModule, order: Sequence[fx.Node], state: Optional[dict[str, tuple[int, int]]] = None) -> dict[str, tuple[int, int]]:
    """The spans of `order` that an automatic cut keeps in one stage: a buffer's writes (`state`,
    when found already), an in-place write through views, an input written at several places."""
    state = state_write_spans(gm, order) if state is None else state
    return {**state, **view_write_spans(gm, order), **input_write_spans(gm, order)}


def predicted_seconds(runs: Sequence[Sequence[fx.Node]], costs: dict[str, Any], schedule: str, ranks: Sequence[int]) -> float:
    """Seconds per batch of `runs` under `schedule`, simulated from the predicted stage times
    (measured where every node is, else from FLOPs; a forward is a third of a stage's time)."""
    order = [node for run in runs for node in run]
    report, chunks = report_model(order, costs), costs["chunks"]
    bounds = [0, *itertools.accumulate(len(run) for run in runs)]
    times = [report.time(a, b) / chunks for a, b in zip(bounds, bounds[1:])]
    actions = [(t / 3, t / 3, t / 3) for t in times]  # F, I and W, as the plan splits a stage's time without measures
    layout = layout_of(runs, ranks, actions)  # zb-h1 orders by the actions' times
    try:
        if schedule == "2bw":
            refuse_too_few_micro_batches(layout, chunks)
        made = make_schedule(schedule, layout, chunks, costs["checkpointed"])
    except ValueError:  # a cut the schedule cannot run (2bw's deeper than chunks) is never the faster; refused later
        return math.inf
    stage_costs = [StageCosts.split(*action) for action in actions]
    return simulate(made, layout, stage_costs, costs["checkpointed"]).timeline.makespan


def _fits(
    gm: fx.GraphModule, runs: list[list[fx.Node]], costs: dict[str, Any], caps: Optional[list[float]], schedule: str, ranks: Sequence[int],
) -> bool:
    """Whether a DAG cut keeps together what must stay in one stage, and fits `caps` (each
    stage holding what the schedule holds on it at once)."""
    order = [node for run in runs for node in run]
    lengths = [len(run) for run in runs]
    cuts = list(itertools.accumulate(lengths))[:-1]
    if split_apart(order, cuts, kept_together(gm, order)):
        return False
    return caps is None or not over_caps(cut_model(order, "memory", **costs, in_flight=in_flight_of(runs, ranks, schedule, costs)), lengths, caps)
