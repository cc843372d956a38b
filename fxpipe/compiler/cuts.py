"""Choosing the cut: the stages' runs of nodes from split points, markers, a balance or the cost model, and their plans."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.fx as fx

from fxpipe.compiled.placement import RankPlacement
from fxpipe.compiled.plan import StagePlan
from fxpipe.compiled.program import Cut
from fxpipe.compiler.in_flight import chain_layout, in_flight, in_flight_of
from fxpipe.compiler.stage_graph import choose_stage_graph, kept_together
from fxpipe.core.microbatch import Dims, batch_size_of, scatter, split_sizes
from fxpipe.distributed.ranks import agree_on_times, gathered
from fxpipe.passes.costs import cut_model, measured, profile_stages, profile_times
from fxpipe.passes.edges import find_edges, stage_inputs, stage_outputs
from fxpipe.passes.inplace import redirect_reads_after_writes
from fxpipe.passes.modes import follow_stages
from fxpipe.passes.objective import CutModel
from fxpipe.passes.partition import cuts_from_split_points, over_caps, partition, refuse
from fxpipe.passes.placement import pin_devices
from fxpipe.passes.shapes import propagate_shapes
from fxpipe.passes.state import rewritten_by_recompute, state_write_spans
from fxpipe.schedules.actions import checkpoint_stop
from fxpipe.tracing.markers import cuts_from_markers


StageTimes = list[tuple[float, float, float]]  # per stage: seconds per batch of its forward, of forward plus backward, and the inputs' share of its backward




def _module_path(node: fx.Node) -> str:
    scope = str(node.meta.get("scope", ""))
    return scope or (str(node.target) if node.op == "call_module" else "")


def memory_caps(device_memory: Union[None, float, Sequence[float]], ranks: list[int]) -> Optional[list[float]]:
    """Bytes per stage, from bytes per device (`ranks`: each stage's device): a device's cap is
    shared evenly among the stages it runs (with stages_per_device)."""
    if device_memory is None:
        return None
    devices = max(ranks) + 1
    caps = [float(device_memory)] * devices if isinstance(device_memory, (int, float)) else [float(m) for m in device_memory]
    if len(caps) != devices:
        raise ValueError(f"device_memory has {len(caps)} entries for {devices} devices: give one per device, or one number")
    return [caps[d] / ranks.count(d) for d in ranks]


def _refuse_over_caps(runs: list[list[fx.Node]], model: CutModel, caps: Optional[list[float]]) -> None:
    """A cut the caller chose must fit device_memory too (the automatic ones are searched under it)."""
    refuse(over_caps(model, [len(run) for run in runs], caps), "How to fix: move the cut, or leave it to balance='memory' (or another mode), which fits "
                     "device_memory; or raise device_memory.")


def cut_runs(
    gm: fx.GraphModule,
    order: list[fx.Node],
    devices: list[torch.device],
    example: tuple[Any, ...],
    *,
    split_points: Optional[Sequence[str]],
    balance: Union[None, str, Sequence[int]],
    costs: dict[str, Any],
    caps: Optional[list[float]],
    split: Dims,
    stage_graph: str = "auto",
    schedule: str = "gpipe",
    ranks: Optional[list[int]] = None,
    placement: Optional[RankPlacement] = None,
    workers: Optional[list[int]] = None,
) -> tuple[list[list[fx.Node]], Optional[StageTimes]]:
    """The stages: by split points, by node counts, or the best cut under a balance mode, a chain
    or a DAG as `stage_graph` says (see compiler/stage_graph.py); and, under balance='time', each
    stage's measured times (`workers`: each stage's worker, where the stages are timed at once)."""
    together = state_write_spans(gm, order)
    chosen = _chosen_cut(order, len(devices), split_points, balance, together)
    ranks = ranks or list(range(len(devices)))
    if chosen is not None:
        if stage_graph == "dag":  # split points and node counts are refused with the other arguments
            refuse(["the model marks its stage boundaries with pipe_split(), and stage_graph='dag' searches the cut"],
                   "How to fix: give one of them (a cut by hand runs as the graph it gives).")
        _refuse_over_caps(chosen, cut_model(order, "memory", **costs, in_flight=in_flight_of(chosen, ranks, schedule, costs)), caps)
        return chosen, None
    mode = balance if isinstance(balance, str) else "memory"
    timed_on = None
    if mode == "time":
        timed_on = _profile_micro_batch(gm, example, devices[0], costs["chunks"], split)
        if placement is not None:
            agree_on_times(gm, placement)
    # An automatic cut also avoids the writes through views, and the inputs written by two
    # stages, that no cut can carry; a cut the caller chose is checked by the edges pass, whose
    # error names the line.
    together = kept_together(gm, order, together)
    # Each stage holds as many micro-batches at once as the schedule has it hold (1F1B: fewer on
    # later stages), in its memory under device_memory and under balance='memory'.
    held = in_flight(schedule, chain_layout(ranks), costs["chunks"], costs["checkpointed"])
    model = cut_model(order, mode, **costs, in_flight=held)
    runs = partition(order, len(devices), model=model, caps=caps, together=together)
    runs = choose_stage_graph(gm, order, runs, model.times, stage_graph=stage_graph, costs=costs, caps=caps, schedule=schedule, ranks=ranks)
    if timed_on is None:
        return runs, None
    try:
        times: Optional[StageTimes] = profile_stages(
            gm, timed_on[0], devices[0], runs, per_batch=timed_on[1], workers=workers, split_backward=schedule == "zb-h1"
        )
    except Exception:  # noqa: BLE001 - a stage that cannot run alone here is predicted from its nodes' times
        times = None
    return runs, times if placement is None else gathered(times, placement, "comparing the measured times")[0]


def _profile_micro_batch(gm: fx.GraphModule, example: tuple[Any, ...], device: torch.device, chunks: int, split: Dims) -> tuple[tuple[Any, ...], int]:
    """balance='time': each node timed on the example's first micro-batch, what it runs on in the
    pipeline (an op's fixed cost does not shrink with its rows, so the whole batch's time over
    `chunks` would miss it); on the whole example where the graph does not run on a micro-batch.
    Returns what it timed on, and how many of it make the batch."""
    batch = batch_size_of(list(example), split)
    sizes = split_sizes(batch, chunks) if batch else []
    if batch and len(sizes) > 1:
        first = tuple(scatter(value, sizes, batch, split)[0] for value in example)
        try:
            profile_times(gm, first, device, per_batch=len(sizes))
            return first, len(sizes)
        except Exception:  # noqa: BLE001 - timed on the whole example instead, as it ran in every pass before
            pass
    profile_times(gm, example, device)
    return example, 1


def _chosen_cut(
    order: list[fx.Node], stages: int, split_points: Optional[Sequence[str]], balance: Union[None, str, Sequence[int]],
    together: dict[str, tuple[int, int]],
) -> Optional[list[list[fx.Node]]]:
    """The stages the caller chose (pipe_split marks, split points, node counts), if any."""
    marks = cuts_from_markers(order)
    if marks:
        if balance is not None:
            refuse(
                [f"the model marks {len(marks)} stage boundaries with pipe_split(), and balance={balance!r} chooses another cut"],
                "How to fix: give one of them.",
            )
        named = cuts_from_split_points(order, split_points, len(split_points) + 1) if split_points else []
        return partition(order, stages, cuts=[*marks, *named], together=together)
    if split_points is not None:
        return partition(order, stages, split_points=split_points, together=together)
    if balance is not None and not isinstance(balance, str):
        return partition(order, stages, balance=balance, together=together)
    return None


def refuse_recomputed_writes(gm: fx.GraphModule, runs: Sequence[Sequence[fx.Node]], checkpoint: str, chunks: int) -> None:
    """A checkpointed stage whose forward writes a parameter in place (that another stage reads,
    or with several micro-batches) would find it written again when it recomputes, as autograd
    would fail in backward; with one micro-batch, its recompute would write it a second time.
    Refused."""
    problems = rewritten_by_recompute(gm, runs, chunks) if checkpoint_stop(checkpoint, chunks) > 0 else []
    if problems:
        raise ValueError(
            f"with checkpoint={checkpoint!r} a recompute would find these parameters written in place since its "
            "forward, while autograd holds them for backward, or write them again:\n" + "\n".join(f"  - {p}" for p in problems) + "\n"
            "How to fix: write them outside forward (after optimizer.step(), under torch.no_grad(); an Embedding's "
            "max_norm=None, and its rows renormalised before the step); or chunks=1, cut so that one stage holds "
            "every use (split_points=[...]), with checkpoint='except_last' or 'never' where the stage writes it again "
            "(one micro-batch runs no recompute then). checkpoint='never' serves only where no op holds them for backward "
            "(an Embedding's renorm): the next micro-batch's forward writes them before this one's backward too."
        )


def times_basis(order: list[fx.Node], costs: dict[str, Any]) -> str:
    """Where the plan's stage times come from, said beside every prediction made from them."""
    if measured(order):
        return "from measured times"
    return f"from FLOPs at an assumed {costs['flop_rate']:.3g} FLOP/s; balance='time' measures them"


def stage_plans(
    runs: list[list[fx.Node]], devices: list[torch.device], edges: list[Any], report: CutModel, memory: CutModel,
    stage_times: Optional[StageTimes],
) -> list[StagePlan]:
    """Each stage's plan: its device, nodes and edges, its predicted time (measured whole where
    `stage_times` has it) and the memory it holds."""
    plans, start = [], 0
    for index, (run, device) in enumerate(zip(runs, devices)):
        end = start + len(run)
        time, forward_share, input_share = report.time(start, end), 1 / 3, 0.5
        if stage_times is not None:  # measured whole: what receiving costs is added as the nodes' sum has it
            forward, whole, input_share = stage_times[index]
            time, forward_share = whole + time - report.compute(start, end), forward / whole if whole > 0 else 1 / 3
        plans.append(
            StagePlan(
                index=index,
                device=str(device),
                nodes=[node.name for node in run],
                inputs=stage_inputs(edges, index),
                outputs=stage_outputs(edges, index),
                param_bytes=sum(int(node.meta.get("param_bytes", 0)) for node in run),
                activation_bytes=int(report.prefix_activations[end] - report.prefix_activations[start]),
                modules=[_module_path(node) for node in run],
                flops=sum(int(node.meta.get("flops", 0)) for node in run),
                time=time,
                memory=int(memory.memory(start, end, index)),
                forward_share=forward_share,
                input_share=input_share,
            )
        )
        start = end
    return plans


def eval_cut(
    graph: fx.GraphModule, train: fx.GraphModule, inputs: tuple[Any, ...], devices: list[torch.device], annotate: Callable[[fx.GraphModule], object]
) -> Cut:
    """The eval-mode graph, cut like the training graph (see passes/modes.py)."""
    graph = redirect_reads_after_writes(graph, inputs)
    propagate_shapes(graph, inputs)
    annotate(graph)
    runs = follow_stages(graph, train, len(devices))
    edges = find_edges(graph, len(devices))
    pin_devices(graph, devices)
    return Cut(graph, runs, edges)
