"""compile_pipeline: from a model and an example input to a Pipeline, through the passes."""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional, ParamSpec, Sequence, Union

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_map_only

from fxpipe.compiled.materialize import FreedState, freed_needed, freed_note, is_on_meta, unfillable
from fxpipe.compiled.placement import RankPlacement
from fxpipe.compiled.plan import Plan
from fxpipe.compiled.program import ChunkSpec, Compiled, Cut, first_floating_dtype
from fxpipe.compiled.stage_compile import compile_options
from fxpipe.compiler.arguments import (
    Device, check_arguments, cost_problems, mapping_problems, model_problems, plain_values, refuse_an_example_forward_does_not_take,
    refuse_bad_chunk_spec, refuse_lazy, refuse_nothing_split, timeout_problems,
)
from fxpipe.compiler.build import build_program
from fxpipe.compiler.cuts import cut_runs, eval_cut, memory_caps, refuse_recomputed_writes, stage_plans, times_basis
from fxpipe.compiler.frontend import none_in, refuse_an_example_the_model_refuses, to_graph
from fxpipe.compiler.in_flight import in_flight_of
from fxpipe.compiler.placement import place_state
from fxpipe.compiler.sequence import (
    SequenceChunks, count_carries, example_length, sequence_problems, slice_graphs, slices_note, with_costs,
)
from fxpipe.compiler.traced import Traced
from fxpipe.core.attrs import buffer_names, tensors_read, tied_names
from fxpipe.core.collector import collector_paused
from fxpipe.core.hooks import hooks_put_back_on_failure
from fxpipe.core.model_hooks import model_hooks_set_aside, pre_hooks_note
from fxpipe.core.microbatch import Dims, batch_size_of, example_leaves, forward_signature, is_one_sample, scatter, spec_dims, split_sizes
from fxpipe.core.own_code import caller_stacklevel
from fxpipe.core.own_forward import calls_of_its_pipelines_noted
from fxpipe.core.snapshot import inputs_preserved, preserved
from fxpipe.distributed.ranks import check_same_plan, connect, placement_of, what_it_computes
from fxpipe.passes.batch_dims import CHECK_DEFERRED, annotate_batch_dims, state_written
from fxpipe.passes.batch_layout import sequence_first_calls
from fxpipe.passes.costs import annotate_costs, cut_model, report_model
from fxpipe.passes.dtype_constants import floating_dtypes_held
from fxpipe.passes.edges import find_edges
from fxpipe.passes.example_runs import run_whole
from fxpipe.passes.inplace import redirect_reads_after_writes
from fxpipe.passes.linearize import COMPUTE_OPS, linearize
from fxpipe.passes.partition import NodeCountError
from fxpipe.passes.placement import pin_devices
from fxpipe.passes.shapes import propagate_shapes
from fxpipe.passes.state import reads_after_hidden_writes
from fxpipe.pipeline import Pipeline
from fxpipe.schedules.actions import checkpoint_stop
from fxpipe.tracing.assignments import assignments_recorded
from fxpipe.tracing.export import shapes_note
from fxpipe.tracing.functions import writes_watched
from fxpipe.tracing.global_reads import put_back_on_failure
from fxpipe.tracing.markers import is_split
from fxpipe.tracing.mode_reads import ModeReads
from fxpipe.tracing.trace import LeafSpec, TraceError, trace


P = ParamSpec("P")


def _leaves_the_model_as_it_was(compile: Callable[P, Pipeline]) -> Callable[P, Pipeline]:
    """Compiling runs the model (checks, shapes, timing). Each pass puts back what it changed;
    this puts back anything one missed, even when compiling fails: parameter values, buffers,
    `.grad`, `training` flags, the random states, and the example's tensors that a forward
    writes in place; and when it fails, the module-level values the model's code assigned.
    A tensor placement moved keeps its device. The cyclic garbage collector is held off for the
    length of the compile (fxpipe/core/collector.py).
    Then, across processes, data-parallel replicas copy replica 0's parameters, which that
    restore would undo."""

    @functools.wraps(compile)
    def compile_and_restore(*args: P.args, **kwargs: P.kwargs) -> Pipeline:
        model = kwargs["model"] if "model" in kwargs else args[0] if args else None
        if not isinstance(model, nn.Module):
            return compile(*args, **kwargs)
        inference = torch.is_inference_mode_enabled()
        given, options = _out_of_inference_mode(args, kwargs) if inference else (args, kwargs)
        example = (options.get("example", given[1] if len(given) > 1 else None), options.get("example_kwargs"))
        refuse_lazy(model)  # before anything reads its tensors
        try:
            with calls_of_its_pipelines_noted(model) as called:
                try:
                    with collector_paused(), writes_watched(), preserved(model), inputs_preserved(example), put_back_on_failure(model), \
                            hooks_put_back_on_failure(model), model_hooks_set_aside(model), _out_of_inference(inference):
                        pipe = compile(*given, **options)  # type: ignore[arg-type]
                except Exception as e:
                    if called:
                        raise _forward_calls_its_pipeline(model, called[0]) from e
                    raise
        except Exception as e:  # a model freed in part by an earlier compile says so
            if freed_note(model) and not isinstance(e, FreedState):
                e.add_note(freed_note(model))
            if pre_hooks_note(model):
                e.add_note(pre_hooks_note(model))
            raise
        pipe._join_replicas()
        return pipe

    return compile_and_restore


def _forward_calls_its_pipeline(model: nn.Module, pipe: Pipeline) -> RuntimeError:
    """Why a model whose forward calls a pipeline of it cannot be compiled, with the forward that
    pipeline traced, to put back."""
    code = pipe._programs[True].model_code()
    fixes = []
    if code is not None and type(model) is not code[0]:
        fixes.append(f"model.__class__ = {code[0].__name__}")
    if code is not None and model.__dict__.get("forward") is not code[1]:
        fixes.append("del model.forward" if code[1] is None else "model.forward = <the forward it had>")
    return RuntimeError(
        f"compile_pipeline: {type(model).__name__}'s forward calls a Pipeline of the model (its forward or class was "
        "replaced since that pipeline was compiled, so that model(x), or model.generate(), runs on it). A compile "
        "traces the model's forward, and cannot go through a pipeline.\nHow to fix: call that pipeline, or the model, "
        "whose call runs it on the forward it traced; to compile the model again, put that forward back first"
        + (f" ({'; '.join(fixes)})" if fixes else "") + ", and replace it again after."
    )


@contextlib.contextmanager
def _out_of_inference(inference: bool) -> Iterator[None]:
    """Outside torch.inference_mode(), where autograd may record the trace's runs, with gradients
    off as they are inside it (a pipeline compiled so serves calls without them)."""
    if not inference:
        yield
        return
    with torch.inference_mode(False), torch.no_grad():
        yield


def _out_of_inference_mode(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Compiling under torch.inference_mode() (a call of another kind made inside one, say) traces
    outside it, on copies of the example's inference tensors made there, which a forward may write
    as it does inside. The call's own values are untouched."""

    def usable(t: torch.Tensor) -> torch.Tensor:
        if not t.is_inference():
            return t
        with torch.inference_mode(False):
            return t.clone()

    return (*args[:1], *tree_map_only(torch.Tensor, usable, args[1:])), {
        name: value if name == "model" else tree_map_only(torch.Tensor, usable, value) for name, value in kwargs.items()
    }


def _check_example_micro_batches(
    traced: Traced, bound: dict[str, Any], chunks: int, split: Dims, model: nn.Module, example: tuple[tuple[Any, ...], dict[str, Any]]
) -> None:
    """torch.export's guards on the example's micro-batches (a branch on the batch size). A guard
    may be the model's own check of its input (BatchNorm's more than one value per channel):
    where the model itself fails on a micro-batch, that failure is named."""
    batch = batch_size_of(list(bound.values()), split)
    if traced.check_micro_batch is None or chunks == 1 or batch is None:
        return
    sizes = split_sizes(batch, chunks)
    pieces = {name: scatter(value, sizes, batch, split) for name, value in bound.items()}
    try:
        traced.check_micro_batch([{name: pieces[name][i] for name in bound} for i in range(len(sizes))])
    except Exception:
        if not split and not is_on_meta(model):
            _refuse_micro_batches_the_model_refuses(model, example, sizes, batch)
        raise


def _refuse_micro_batches_the_model_refuses(model: nn.Module, example: tuple[tuple[Any, ...], dict[str, Any]], sizes: list[int], batch: int) -> None:
    """The model itself, run on each micro-batch of the example (split along dim 0): its failure
    on one, named, if it fails."""
    for i, size in enumerate(sizes):
        start = sum(sizes[:i])
        args, kwargs = tree_map_only(torch.Tensor, lambda t: t[start:start + size] if t.dim() and t.shape[0] == batch else t, example)
        try:
            with torch.no_grad(), preserved(model):
                model(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - named in the refusal
            raise ValueError(
                f"{type(model).__name__} does not run on micro-batch {i} of the example ({size} of its {batch} samples): "
                f"{type(e).__name__}: {e}\nHow to fix: fewer chunks, or a larger batch, so that each micro-batch is one "
                "the model takes (BatchNorm in training mode needs more than one value per channel)."
            ) from e


def _refuse_sequence_first(gm: fx.GraphModule, chunks: int, spec: ChunkSpec, inputs: tuple[Any, ...], dims: Dims) -> None:
    """Micro-batches split inputs along dim 0; a sequence-first layer's dim 0 is the sequence,
    unless the model feeds it the batch on dim 1 itself."""
    splits_elsewhere = any(dim not in (None, 0) for dim in spec.values())  # {"x": 1}
    found = sequence_first_calls(gm, inputs, dims) if chunks > 1 and not splits_elsewhere else []
    if found:
        raise ValueError(
            f"these modules take the batch along dim 1 (batch_first=False): {', '.join(found)}, and "
            "micro-batches split the inputs along dim 0, which for them is the sequence.\nHow to "
            "fix: build them with batch_first=True and pass batch-first inputs; or name the dim that holds "
            "the batch of each input that holds it (chunk_spec={'x': 1, 'h0': 1} for a sequence-first x and "
            "an initial state h0); or use chunks=1."
        )


@_leaves_the_model_as_it_was
def compile_pipeline(
    model: nn.Module,
    example: Any,
    devices: Optional[Sequence[Device]] = None,
    *,
    mesh: Any = None,
    timeout: Optional[float] = None,
    chunks: int = 1,
    checkpoint: str = "except_last",
    split_points: Optional[Sequence[str]] = None,
    balance: Union[None, str, Sequence[int]] = None,
    leaf_modules: Union[None, LeafSpec, Iterable[LeafSpec]] = (),
    device_memory: Union[None, float, Sequence[float]] = None,
    param_scale: float = 4.0,
    bandwidth: Optional[float] = None,
    flop_rate: Optional[float] = None,
    chunk_spec: Optional[ChunkSpec] = None,
    deferred_batch_norm: bool = False,
    example_kwargs: Optional[dict[str, Any]] = None,
    schedule: str = "gpipe",
    stages_per_device: int = 1,
    compile_stages: Union[bool, dict[str, Any]] = False,
    stage_graph: str = "auto",
    sequence_chunks: SequenceChunks = 1,
    sequence_dim: int = 1,
) -> Pipeline:
    """Trace `model`, cut it into `len(devices)` stages and return them as a Pipeline.

    Args:
        model: an `nn.Module`, or a `torch.fx.GraphModule` traced already. Models torch.fx
            cannot trace go through torch.export.
        example: one input batch as the model takes it: a tensor, or a tuple of positional args.
        example_kwargs: keyword arguments of the example call, if the model takes some.
        devices: one device per stage; repeats are allowed (`["cpu", "cpu"]`).
        mesh: instead of `devices`, to run across processes (under torchrun): a DeviceMesh with
            a dimension named "pp"; stage s runs on the rank at pp coordinate `s % pp size`, on
            that rank's device. Every rank calls compile_pipeline with the same model and example.
        timeout: across processes, seconds a rank waits for another before it raises (default 300).
        chunks: micro-batches per batch.
        checkpoint: 'always', 'except_last' or 'never': which micro-batches drop their
            activations in forward and recompute them in backward.
        split_points: qualified module names where stages 1, 2, ... begin.
        balance: a node count per stage, or what to balance: 'memory' (the default: parameters,
            gradients and optimizer state, plus activations in flight), 'params', 'flops', or
            'time' (measures every node's forward and backward on `devices[0]`). Node counts are
            the example's graph's: a call of another kind whose graph has another count is cut
            as with None, with a warning.
        leaf_modules: module types or qualified names to keep whole instead of tracing into.
        device_memory: bytes each device may hold (one number, or one per device), shared
            evenly among a device's stages with stages_per_device; a cut given by hand must fit too.
        param_scale: bytes held per parameter byte: 4 for weights, gradients and Adam's state.
        bandwidth: bytes per second between devices, for the time to receive a stage's inputs
            ('time' and 'flops'); by default free between CPU devices, else 12e9.
        flop_rate: FLOPs per second, to turn FLOPs into time ('flops'); by default 5e10 on CPU
            devices, else 1e13.
        chunk_spec: how to split named arguments of the model's forward into micro-batches:
            `{"mask": None}` passes `mask` whole to every micro-batch, `{"x": 1}` splits `x` along
            dim 1. Unnamed arguments are split along dim 0 when their dim 0 is the batch size.
        deferred_batch_norm: BatchNorm layers normalise each micro-batch on its own (as in any
            GPipe), and their running statistics are updated once per step from the whole
            batch, as the plain model's would be on it.
        schedule: what `pipe.train_step` runs: 'gpipe', '1f1b', 'interleaved-1f1b' or 'zb-h1'
            (fxpipe/schedules/actions.py draws them); or '2bw', 1F1B in a step, whose steps in
            `pipe.train_steps` overlap with no flush (fxpipe/schedules/two_bw.py). `pipe(x)` and
            `loss.backward()` always run GPipe.
        stages_per_device: with 'interleaved-1f1b', the model is cut into this many stages per
            device, placed round-robin: stage s on `devices[s % len(devices)]`.
        compile_stages: run each generated stage under `torch.compile`, forward and backward:
            True, or a dict of torch.compile's `mode`, `dynamic`, `backend`, `fullgraph` and
            `options`, passed through (`{"mode": "reduce-overhead"}` for CUDA graphs).
            `pipe.compile_stats()` counts each stage's graphs, compile time and recompiles.
        stage_graph: the shape of the automatic cut: 'chain' cuts one linear order of the
            nodes; 'dag' also puts parallel branches of the model (towers, encoders of several
            inputs) in stages of their own that run side by side; 'auto' keeps whichever the
            cost model predicts faster under `schedule`. A cut by hand runs as the graph it gives.
        sequence_chunks: for a causal model (each position computed from itself and earlier
            ones: causal attention, position-wise layers), each micro-batch is cut into this many
            slices of its sequence (or slices of these lengths; 'auto': as many as the cost model
            finds fastest for each length), which flow through the stages one
            after another, each slice's attention reading the keys and values of the slices before
            it: stages keep busy with few sequences, one even. Compiling proves the model causal
            (naming each op that reads later positions otherwise) and checks the slices against
            the whole example. `pipe(x)`, `train_step` and `train_steps` run them, under every schedule.
        sequence_dim: the dim of the inputs that holds the sequence (0 for sequence-first inputs,
            whose batch's dim chunk_spec names).

    The automatic modes find the cut of the linear order with the least predicted pipeline time
    `sum(t_i) + (chunks - 1) * max(t_i)` that fits `device_memory`; a stage DAG, the one with the
    least time on its longest path in place of the sum.
    """
    devices, chunks, split_points, balance, device_memory, stages_per_device, sequence_chunks, timeout = (
        plain_values(v) for v in (devices, chunks, split_points, balance, device_memory, stages_per_device, sequence_chunks, timeout)
    )
    placement = _placement(devices, mesh, timeout)
    given = devices if placement is None else [placement.device] * placement.size
    assert given is not None
    leaf_modules = [leaf_modules] if isinstance(leaf_modules, (str, type)) else list(leaf_modules or ())
    stage_compile, compile_problems = compile_options(compile_stages)
    problems = [*model_problems(model, leaf_modules), *cost_problems(device_memory, param_scale, bandwidth, flop_rate), *compile_problems]
    problems += timeout_problems(timeout)
    problems += sequence_problems(sequence_chunks, sequence_dim, stage_compile is not None)
    problems += mapping_problems(chunk_spec, example_kwargs)
    parsed = check_arguments(given, chunks, checkpoint, split_points, balance, schedule, stages_per_device, problems, stage_graph, device_memory)
    ranks = [s % len(parsed) for s in range(stages_per_device * len(parsed))]
    parsed = [parsed[r] for r in ranks]
    example_args = example if isinstance(example, tuple) else (example,)
    example_kwargs = dict(example_kwargs or {})
    signature, spec = forward_signature(model), dict(chunk_spec or {})
    refuse_an_example_forward_does_not_take(model, signature, example_args, example_kwargs)
    refuse_bad_chunk_spec(signature, spec, example_args, example_kwargs)
    # (an input chunk_spec keeps whole, an empty table, holds no batch)
    example_batch = batch_size_of([*example_args, *example_kwargs.values()], spec_dims(signature, spec, example_args, example_kwargs))
    if example_batch == 0:
        raise ValueError("the example batch is empty (size 0 along dim 0): give at least one sample")
    planned = _micro_batches_planned(chunks, example_batch, schedule, len(parsed))
    refuse_nothing_split(chunks, signature, spec, example_args, example_kwargs)
    if is_on_meta(model):  # compiled on shapes alone; each stage is made where it runs
        if balance == "time":
            raise ValueError("balance='time' times the model's nodes, and a model on the meta device cannot run: pass balance='flops'")
        example_args, example_kwargs = tree_map_only(torch.Tensor, lambda t: t.to("meta"), (example_args, example_kwargs))
    traced = to_graph(model, example_args, leaf_modules, chunks, example_kwargs, spec_dims(signature, spec, example_args, example_kwargs))
    # The passes run the graph: what a module called whole assigns (a call counter) is put back.
    with assignments_recorded(model):
        bound = traced.bind(example_args, example_kwargs)
        inputs = tuple(bound.values())
        split = spec_dims(signature, spec, example_args, example_kwargs)
        _refuse_sequence_first(traced.graph, chunks, spec, inputs, split)
        slicing, check_length = None, None
        if sequence_chunks != 1:
            lined = functools.partial(trace, model, leaf_modules, record_lines=True, none=none_in(model, example_args, example_kwargs))
            slicing, check_length = slice_graphs(traced, inputs, sequence_chunks, sequence_dim, lined, model, split if chunks > 1 else None)
        gm = reads_after_hidden_writes(redirect_reads_after_writes(traced.graph, inputs))
        whole = run_whole(gm, inputs)  # the shapes, and the batch dims' run on the whole example
        if whole is None:
            try:
                propagate_shapes(gm, inputs)
            except Exception:
                refuse_an_example_the_model_refuses(model, example_args, example_kwargs)
                raise
        # One process may check micro-batches on its first call of two samples or more, where an
        # example of one has no two parts; across processes every rank must refuse alike, here.
        checked = annotate_batch_dims(
            gm, inputs, chunks, split, serves_eval=traced.eval_graph is None, defer_one_sample=placement is None, whole_run=whole,
        )  # fmt: skip
        _check_example_micro_batches(traced, bound, chunks, split, model, (example_args, example_kwargs))  # after the parts' check
        annotate_costs(gm)
        # Split points and pipe_split() marks name places in the order the forward runs: cut that order.
        traced_order = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
        chosen = split_points is not None or any(is_split(n) for n in traced_order)
        order = traced_order if chosen else linearize(gm)
        on_cpu = all(d.type == "cpu" for d in parsed)
        rate = flop_rate if flop_rate is not None else (5e10 if on_cpu else 1e13)
        costs: dict[str, Any] = dict(
            chunks=planned,
            checkpointed=checkpoint_stop(checkpoint, planned),
            param_scale=param_scale + (1.0 if schedule == "2bw" else 0.0),  # 2bw keeps a second version of each weight
            bandwidth=bandwidth if bandwidth is not None else (None if on_cpu else 12e9),
            flop_rate=rate,
        )
        if slicing is not None:
            slicing = with_costs(slicing, gm, inputs, len(parsed), rate, parsed[0].type)
        caps = memory_caps(device_memory, ranks)
        runs, stage_times = cut_runs(
            gm, order, parsed, inputs, split_points=split_points, balance=balance, costs=costs, caps=caps, split=split,
            stage_graph=stage_graph, schedule=schedule, ranks=ranks,
            # CPU stages in one process share its cores and interpreter lock: their workers are timed at once.
            placement=placement, workers=ranks if on_cpu and placement is None else None,
        )  # fmt: skip
        order = [node for run in runs for node in run]  # a stage DAG lays the stages out in another order
        refuse_recomputed_writes(gm, runs, checkpoint, chunks)
        edges = find_edges(gm, len(parsed))
        pin_devices(gm, parsed)
        cuts = {True: Cut(gm, [list(run) for run in runs], edges)}
        if traced.eval_graph is not None:
            cuts[False] = eval_cut(traced.eval_graph, gm, inputs, parsed, lambda g: annotate_batch_dims(g, inputs, chunks, split, serves_eval=True, defer_one_sample=not checked))
        else:
            cuts[False] = cuts[True]
        place_state(model, gm, runs, parsed)  # after every pass that runs the model on the example
    report = report_model(order, costs)
    memory = cut_model(order, "memory", **costs, in_flight=in_flight_of(runs, ranks, schedule, costs))
    plan = Plan(
        stages=stage_plans(runs, parsed, edges, report, memory, stage_times),
        edges=edges,
        chunks=chunks,
        example_micro_batches=planned if planned != chunks else 0,
        checkpoint=checkpoint,
        balance=balance if isinstance(balance, str) else ("split_points" if split_points else "counts" if balance else "memory"),
        notes=[*([traced.note, shapes_note(gm)] if traced.note else ["input shapes: every dim dynamic (torch.fx)"]),
               *([f"chunks={chunks}: the example's {example_batch} samples run as {planned} micro-batches, which the plan is for"] if planned != chunks else [])],
        schedule=schedule,
        ranks=ranks,
        times=times_basis(order, costs),
    )
    if slicing is not None:
        length = example_length(slicing, bound)
        count_carries(plan.stages, runs, slicing, length)
        plan.notes.append(slices_note(slicing, sequence_dim, length, plan.stages))
    _say_batch_norm_per_micro_batch(model, chunks, deferred_batch_norm, plan)
    _say_state_per_micro_batch(state_written(gm, whole.written) if whole is not None else [], chunks, plan)
    build = functools.partial(
        build_program, devices=parsed, ranks=ranks, deferred_batch_norm=deferred_batch_norm, stored=traced.stored_with_grad,
        attributes=traced.attributes, listed=None if traced.reads is None else frozenset(traced.reads.iterated),
        compile_stages=stage_compile, costs=plan.action_costs(),
    )
    compiled = Compiled(
        plan, cuts, traced.bind, build, parsed, spec, deferred_batch_norm, placement, example_leaves(bound, split), traced.check_micro_batch,
        *_reads(traced), traced.eval_only,
    )
    compiled.slicing, compiled.check_length = slicing, check_length
    compiled.grad_mode_only = traced.grad_mode_only
    compiled.marked_for_grad = inputs_marked_for_grad(traced.graph)
    compiled.aliased_buffers = aliased_buffers(model)
    compiled.tied_parameters = tied_names(model)
    compiled.traced_dtype = first_floating_dtype(model)
    compiled.graph_dtypes = frozenset().union(*(floating_dtypes_held(cut.graph) for cut in cuts.values()))
    if not checked:
        compiled.unchecked = functools.partial(_check_micro_batches_later, traced, cuts, chunks, model)
        deferred = gm.meta.get(CHECK_DEFERRED)
        why = (
            "the example has one sample, which cannot be split in two" if not example_batch or example_batch < 2 else
            f"{deferred}, where a squeeze() may drop its batch dim" if deferred else
            "the example's samples all hold the same values (zeros, or one sample repeated), on which a statistic of "
            "the batch is the same as on any part of it"
        )  # fmt: skip
        warnings.warn(
            f"{why}: the check that {chunks} micro-batches compute what the whole batch does runs on the first call of "
            f"{'four' if deferred else 'two'} samples or more whose samples differ (until then, a call runs as one "
            "micro-batch).",
            stacklevel=caller_stacklevel(),
        )
    if placement is not None:
        read_here = [t for run, rank in zip(runs, ranks) if rank == placement.me for node in run for t in tensors_read(gm, node).values()]
        computes = [what_it_computes(gm, run) for run in runs]
        check_same_plan(plan, placement, freed_needed(model, read_here), unfillable(model, read_here), computes)
        connect(placement)
        for stage in plan.stages:
            stage.device = f"rank {placement.ranks[ranks[stage.index]]} {stage.device}"
    pipe = Pipeline(model, compiled)
    if placement is None:  # another kind of call compiles a pipeline of its own, with these options
        options = dict(
            devices=devices, chunks=chunks, checkpoint=checkpoint, split_points=split_points, balance=balance,
            leaf_modules=leaf_modules, device_memory=device_memory, param_scale=param_scale, bandwidth=bandwidth,
            flop_rate=flop_rate, chunk_spec=chunk_spec, deferred_batch_norm=deferred_batch_norm, schedule=schedule,
            stages_per_device=stages_per_device, compile_stages=compile_stages, stage_graph=stage_graph,
            sequence_chunks=sequence_chunks, sequence_dim=sequence_dim,
        )  # fmt: skip
        pipe.__dict__["_recompile"] = functools.partial(_compiled_for_call, options)
    return pipe


def _say_batch_norm_per_micro_batch(model: nn.Module, chunks: int, deferred: bool, plan: Plan) -> None:
    """BatchNorm in training mode normalises each micro-batch by its own statistics, as in every
    GPipe: said once at compile (a warning, and a note of the plan), since the outputs and the
    gradients then differ from the plain model's on the whole batch."""
    norms = [name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    if chunks < 2 or not norms:
        return
    said = (
        f"BatchNorm in training mode ({', '.join(norms[:3])}{', ...' if len(norms) > 3 else ''}) normalises each of the "
        f"chunks={chunks} micro-batches by its own statistics, as in every GPipe: the outputs and gradients differ from "
        "the plain model's on the whole batch"
        + (" (deferred_batch_norm=True keeps the whole batch's running statistics, not its normalisation)" if deferred else "")
        + ". For the plain model's numbers: GroupNorm or LayerNorm, or chunks=1"
        + ("" if deferred else "; deferred_batch_norm=True keeps the running statistics of the whole batch")
        + "."
    )
    plan.notes.append(said)
    warnings.warn(said, stacklevel=caller_stacklevel())


def _say_state_per_micro_batch(written: list[str], chunks: int, plan: Plan) -> None:
    """Buffers the forward writes by a rule of its own (a step counter, an EMA) are written once per
    micro-batch, as by the plain model run on the micro-batches in turn (README): said once at
    compile, as BatchNorm's statistics are, since a counter then counts `chunks` a call."""
    if chunks < 2 or not written:
        return
    said = (
        f"the forward writes buffers ({', '.join(written[:3])}{', ...' if len(written) > 3 else ''}) as it runs: with "
        f"chunks={chunks} it writes them once per micro-batch, as the plain model run on the micro-batches in turn "
        f"does (a step counter counts {chunks} a call, an EMA takes {chunks} steps), where the plain model on the "
        "whole batch writes them once. For once per batch: update them outside forward (after the optimizer's "
        "step), or use chunks=1."
    )
    plan.notes.append(said)
    warnings.warn(said, stacklevel=caller_stacklevel())


def _micro_batches_planned(chunks: int, batch: Optional[int], schedule: str, devices: int) -> int:
    """How many micro-batches the example runs as, which the plan and the cut search are for: a
    batch smaller than `chunks` runs one per sample. An example of one sample stands for the
    calls (its check waits for a larger one), and interleaved-1f1b needs a multiple of the
    devices: `chunks` for both."""
    if batch is None or batch < 2 or batch >= chunks or (schedule == "interleaved-1f1b" and batch % devices):
        return chunks
    return batch


def aliased_buffers(model: nn.Module) -> list[list[str]]:
    """The names of each buffer the model holds under several (one tensor in two modules)."""
    return [names for names in buffer_names(model).values() if len(names) > 1]


def _compiled_for_call(options: dict[str, Any], model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], whole: list[str]) -> Pipeline:
    """A pipeline for a call of another kind than the example, the call as its example; the
    arguments `whole` kept whole, as the example kept them (unless chunk_spec says otherwise)."""
    chunk_spec = {**{name: None for name in whole}, **(options["chunk_spec"] or {})}
    options = {**options, "chunk_spec": chunk_spec or None}
    try:
        return _compiled_counting_nodes(options, model, args, kwargs)
    except TraceError:
        # torch.export makes a graph for one sample alone from a call of one sample: that call
        # runs as one micro-batch anyway. Stages of one micro-batch serve it, and the first call of
        # this kind with more samples compiles stages of its own (`PipelineCalls._variant`).
        if options["chunks"] < 2 or not is_one_sample(args, kwargs):
            raise
        # (interleaving needs micro-batches as many as the devices: one stage per device serves one)
        one = {"schedule": "1f1b", "stages_per_device": 1} if options["schedule"] == "interleaved-1f1b" else {}
        pipe = _compiled_counting_nodes({**options, "chunks": 1, **one}, model, args, kwargs)
        pipe.__dict__["_for_one_sample"] = True
        return pipe


def _compiled_counting_nodes(options: dict[str, Any], model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Pipeline:
    try:
        return compile_pipeline(model, args, example_kwargs=kwargs or None, **options)
    except NodeCountError:  # counted on the example's graph: this kind of call has its own
        if not isinstance(options["balance"], (list, tuple)):
            raise
        warnings.warn(
            f"balance={list(options['balance'])} counts the nodes of the example's graph; this kind of call has a graph "
            "of its own, with another count, which is cut as with balance=None (by memory). Give split_points=[...] (module "
            "names) to cut every kind of call at the same modules.",
            stacklevel=caller_stacklevel(),
        )
        return compile_pipeline(model, args, example_kwargs=kwargs or None, **{**options, "balance": None})


def _check_micro_batches_later(
    traced: Traced, cuts: dict[bool, Cut], chunks: int, model: nn.Module, bound: dict[str, Any], dims: Dims,
    call: tuple[tuple[Any, ...], dict[str, Any]],
) -> bool:
    """The parts' check of compiling, on a call's inputs (`bound`, split along `dims`) where the
    example had one sample or samples all alike; raises as compiling would have. False where this
    call's samples are all alike too: nothing checked, the check waits for another call."""
    inputs = tuple(bound.values())
    train, evaluation = cuts[True], cuts[False]
    if not annotate_batch_dims(train.graph, inputs, chunks, dims, serves_eval=evaluation is train, defer_one_sample=True):
        return False
    if evaluation is not train:
        annotate_batch_dims(evaluation.graph, inputs, chunks, dims, serves_eval=True)
    _check_example_micro_batches(traced, bound, chunks, dims, model, call)
    return True


def inputs_marked_for_grad(gm: fx.GraphModule) -> frozenset[str]:
    """The placeholders the forward calls `requires_grad_()` (or `requires_grad_(True)`) on."""
    found = set()
    for node in gm.graph.nodes:
        method = node.op == "call_method" and node.target == "requires_grad_"
        function = node.op == "call_function" and node.target is torch.Tensor.requires_grad_
        if (method or function) and node.args and isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder":
            flag = node.args[1] if len(node.args) > 1 else node.kwargs.get("requires_grad", True)
            if flag is True:
                found.add(node.args[0].name)
    return frozenset(found)


def _reads(traced: Traced) -> tuple[dict[bool, dict[str, bool]], dict[bool, frozenset[str]], str, ModeReads]:
    """What the traces read that the runtime watches (Compiled's fields, in order)."""
    reads = traced.reads
    flags = {mode: dict(reads.training[mode]) for mode in (True, False)} if reads is not None else {}
    values = {mode: frozenset(reads.values[mode]) for mode in (True, False)} if reads is not None else {}
    return flags, values, "torch.export" if traced.fx_failure else "torch.fx", traced.modes_read


def _placement(devices: Any, mesh: Any, timeout: Any) -> Optional[RankPlacement]:
    """Across processes when a mesh is given: this rank's place in it."""
    if (devices is None) == (mesh is None):
        raise ValueError(
            "compile_pipeline needs one of devices=[...] (one process, a device per stage) and mesh=... "
            "(a DeviceMesh with a 'pp' dimension, one process per stage)"
            + (f", not both (got devices={devices!r})" if mesh is not None else "")
        )
    # A bad timeout is listed with the other arguments' problems (placing reads the mesh alone).
    return None if mesh is None else placement_of(mesh, None if timeout_problems(timeout) else timeout)


