"""Chain or DAG: the stage graph that the cost model predicts faster, under the plan's schedule."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch.fx as fx

from fxpipe.passes.costs import cut_model, report_model
from fxpipe.passes.dag_partition import dag_partition, stage_links
from fxpipe.passes.inplace import input_write_spans
from fxpipe.passes.linearize import keeps_traced_order
from fxpipe.passes.state import state_write_spans, view_write_spans
from fxpipe.schedules.actions import Layout
from fxpipe.schedules.check import make_schedule
from fxpipe.schedules.simulate import StageCosts, simulate

STAGE_GRAPHS = ("auto", "chain", "dag")


def choose_stage_graph(
    gm: fx.GraphModule, order: list[fx.Node], chain: list[list[fx.Node]], *, stage_graph: str, mode: str,
    costs: dict[str, Any], caps: Optional[list[float]], schedule: str, ranks: list[int],
) -> list[list[fx.Node]]:
    """`chain` (runs of `order`), or the stage DAG of the graph search where it can run:
    with 'dag' whenever the search finds one, with 'auto' where it is predicted faster."""
    if stage_graph == "chain":
        return chain
    weights = cut_model(order, mode, **costs).times
    dag = dag_partition(order, weights, len(chain), costs["chunks"], force=stage_graph == "dag")
    if dag is None or keeps_traced_order(gm, order) or not _fits(gm, dag, costs, caps):
        return chain
    if stage_graph == "auto" and predicted_seconds(dag, costs, schedule, ranks) >= predicted_seconds(chain, costs, schedule, ranks) * (1 - 1e-6):
        return chain
    for index, run in enumerate(dag):
        for node in run:
            node.meta["stage"] = index
    return dag


def predicted_seconds(runs: Sequence[Sequence[fx.Node]], costs: dict[str, Any], schedule: str, ranks: Sequence[int]) -> float:
    """Seconds per batch of `runs` under `schedule`, simulated from the predicted stage times
    (measured where every node is, else from FLOPs; a forward is a third of a stage's time)."""
    order = [node for run in runs for node in run]
    report, chunks = report_model(order, costs), costs["chunks"]
    bounds = [0]
    for run in runs:
        bounds.append(bounds[-1] + len(run))
    times = [report.time(a, b) / chunks for a, b in zip(bounds, bounds[1:])]
    layout = Layout(tuple(ranks), frozenset(stage_links(runs)), _output_stages(runs))
    try:
        made = make_schedule(schedule, layout, chunks, costs["checkpointed"])
    except ValueError:  # a schedule this cut cannot run is refused later, with its reason
        made = make_schedule("gpipe", layout, chunks, costs["checkpointed"])
    stage_costs = [StageCosts(t / 3, 2 * t / 3) for t in times]
    return simulate(made, layout, stage_costs, costs["checkpointed"]).timeline.makespan


def _output_stages(runs: Sequence[Sequence[fx.Node]]) -> tuple[int, ...]:
    """The stages that make a value the output reads."""
    return tuple(k for k, run in enumerate(runs) if any(user.op == "output" for node in run for user in node.users))


def _fits(gm: fx.GraphModule, runs: list[list[fx.Node]], costs: dict[str, Any], caps: Optional[list[float]]) -> bool:
    """Whether a DAG cut keeps in one stage what must stay in one (a buffer's writes, an input
    written at several places) and fits `caps`."""
    order = [node for run in runs for node in run]
    cuts, start = [], 0
    for run in runs[:-1]:
        start += len(run)
        cuts.append(start)
    spans = {**state_write_spans(gm, order), **view_write_spans(gm, order), **input_write_spans(gm, order)}
    if any(first < cut <= last for first, last in spans.values() for cut in cuts):
        return False
    if caps is None:
        return True
    memory = cut_model(order, "memory", **costs)
    bounds = [0, *cuts, len(order)]
    return all(memory.memory(a, b) <= cap for a, b, cap in zip(bounds, bounds[1:], caps))
