"""compile_pipeline: from a model and an example input to a Pipeline, through the passes."""
from __future__ import annotations

import difflib
import functools
import inspect
import warnings
from typing import Any, Callable, Iterable, Optional, ParamSpec, Sequence, Union

import torch
import torch.fx as fx
from torch import nn
from torch.nn.parameter import is_lazy
from torch.utils._pytree import tree_flatten, tree_map_only

from fxpipe.compiled.materialize import FreedState, freed_needed, freed_note, is_on_meta, unfillable
from fxpipe.compiled.placement import RankPlacement
from fxpipe.compiled.plan import Plan, StagePlan
from fxpipe.compiled.program import ChunkSpec, Compiled, Cut
from fxpipe.compiled.stage_compile import compile_options
from fxpipe.compiler.build import build_program
from fxpipe.compiler.frontend import Traced, refuse_an_example_the_model_refuses, to_graph
from fxpipe.core.attrs import fetch_attr, tensors_read
from fxpipe.core.microbatch import Dims, batch_size_of, example_leaves, forward_signature, scatter, spec_dims, split_sizes
from fxpipe.core.snapshot import inputs_preserved, preserved
from fxpipe.distributed.ranks import agree_on_times, check_same_plan, connect, gathered, placement_of
from fxpipe.passes.batch_dims import annotate_batch_dims
from fxpipe.passes.batch_layout import sequence_first_calls
from fxpipe.passes.costs import BALANCE_MODES, annotate_costs, cut_model, profile_stages, profile_times
from fxpipe.passes.edges import find_edges, stage_inputs, stage_outputs
from fxpipe.passes.inplace import input_write_spans, redirect_reads_after_writes
from fxpipe.passes.linearize import COMPUTE_OPS, linearize
from fxpipe.passes.modes import follow_stages
from fxpipe.passes.objective import CutModel
from fxpipe.passes.partition import conflicting_options, cuts_from_split_points, partition, refuse
from fxpipe.passes.placement import pin_devices
from fxpipe.passes.shapes import propagate_shapes
from fxpipe.passes.state import reads_after_hidden_writes, rewritten_by_recompute, state_write_spans, view_write_spans
from fxpipe.pipeline import Pipeline
from fxpipe.schedules.schedule import CHECKPOINT_MODES, SCHEDULES, checkpoint_stop
from fxpipe.tracing.assignments import assignments_recorded
from fxpipe.tracing.export import shapes_note
from fxpipe.tracing.global_reads import put_back_on_failure
from fxpipe.tracing.markers import cuts_from_markers, is_split
from fxpipe.tracing.mode_reads import ModeReads
from fxpipe.tracing.trace import LeafSpec

Device = Union[str, int, torch.device]
_STAGE_DEVICE_TYPES = ("cpu", "cuda")


def _parse_device(device: Any) -> tuple[Optional[torch.device], Optional[str]]:
    """The device, or the problem with it and its fix."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        return None, f"{device!r} is not a device: write one like 'cpu' or 'cuda:0'"
    if parsed.type not in _STAGE_DEVICE_TYPES:
        return None, f"{device!r}: stages run on 'cpu' and 'cuda' devices only; {parsed.type!r} cannot run one"
    if parsed.type == "cuda" and not torch.cuda.is_available():
        return None, f"{device!r}: CUDA is not available on this machine; use 'cpu' devices"
    if parsed.type == "cuda" and (parsed.index or 0) >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        return None, f"{device!r}: this machine has {count} CUDA device{'s' * (count != 1)} (cuda:0 to cuda:{count - 1})"
    if parsed.type == "cuda" and parsed.index is None:
        # "cuda" is the current device: one name per device in the plan, its summary and pictures.
        parsed = torch.device("cuda", torch.cuda.current_device())
    return parsed, None


def _listed(devices: Any) -> Optional[list[Any]]:
    """The devices as a list, or None when `devices` is not a list of them (one device, say)."""
    if isinstance(devices, (str, int, torch.device)) or not isinstance(devices, Iterable):
        return None
    return list(devices)


def _device_problems(devices: Any, listed: Optional[list[Any]]) -> tuple[list[torch.device], list[str]]:
    if listed is None:
        example = [str(devices)] if isinstance(devices, (str, int, torch.device)) else ["cpu", "cpu"]
        return [], [f"devices must be a list with one device per stage, e.g. devices={example!r} (got {devices!r})"]
    if not listed:
        return [], ["devices is empty: give one device per stage, e.g. devices=['cpu', 'cpu']"]
    found = [_parse_device(device) for device in listed]
    return [d for d, _ in found if d is not None], [p for _, p in found if p is not None]


def _balance_problems(balance: Any) -> list[str]:
    modes = ", ".join(map(repr, BALANCE_MODES))
    if balance is None or (isinstance(balance, str) and balance in BALANCE_MODES):
        return []
    counts = not isinstance(balance, (str, bytes)) and isinstance(balance, Sequence)
    if not counts or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in balance):
        return [f"balance must be one of {modes}, or a list of node counts per stage, each at least 1 (got {balance!r})"]
    return []  # how many, and their sum, the partition checks against the graph


def _split_point_problems(split_points: Any, balance: Any) -> list[str]:
    if split_points is None:
        return []
    conflicts = conflicting_options(split_points, balance)
    if conflicts:
        return conflicts
    names = not isinstance(split_points, str) and isinstance(split_points, Sequence)
    if not names or not all(isinstance(p, str) for p in split_points):
        return [f"split_points must be a list of module names where stages 1, 2, ... begin, e.g. ['blocks.4'] (got {split_points!r})"]
    return []  # how many, and whether they name modules, the partition checks against the graph


def _schedule_problems(schedule: Any, stages_per_device: Any, chunks: Any, devices: int) -> list[str]:
    if schedule not in SCHEDULES:
        return [f"schedule must be one of {', '.join(map(repr, SCHEDULES))} (got {schedule!r})"]
    if not isinstance(stages_per_device, int) or isinstance(stages_per_device, bool) or stages_per_device < 1:
        return [f"stages_per_device must be a whole number, at least 1 (got {stages_per_device!r})"]
    if stages_per_device > 1 and schedule != "interleaved-1f1b":
        return [f"stages_per_device={stages_per_device} places several stages on each device, which only "
                f"schedule='interleaved-1f1b' runs (got schedule={schedule!r})"]  # fmt: skip
    if schedule == "interleaved-1f1b" and isinstance(chunks, int) and devices and chunks % devices:
        return [f"interleaved-1f1b needs chunks to be a multiple of the device count, {devices} (got chunks={chunks})"]
    return []


def _refuse_lazy(model: nn.Module) -> None:
    """Lazy modules' parameters have no shape until a first call: nothing can be cut or placed."""
    lazy = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if is_lazy(t)]
    if lazy:
        more = f" and {len(lazy) - 5} more" if len(lazy) > 5 else ""
        raise ValueError(
            f"the model has parameters without a shape yet (lazy modules, LazyLinear say): {', '.join(lazy[:5])}{more}.\n"
            "How to fix: run the model once on an example batch before compiling (model(example)), which gives them "
            "their shapes."
        )


def _model_problems(model: Any, leaf_modules: list[Any]) -> list[str]:
    """The model is a module, and each name in leaf_modules one of its submodules (a misspelt
    name would keep nothing whole, without a word)."""
    if not isinstance(model, nn.Module):
        return [f"model must be an nn.Module (or a torch.fx.GraphModule), not {type(model).__name__}: "
                "wrap a function in a module whose forward calls it"]  # fmt: skip
    names = [name for name, _ in model.named_modules(remove_duplicate=False) if name]  # a module shared under two names
    problems = []
    scripted: list[str] = []
    for name, m in model.named_modules():
        if isinstance(m, torch.jit.ScriptModule) and not any(name.startswith(f"{outer}.") for outer in scripted):
            scripted.append(name or "the model")
    if scripted:
        problems.append(f"the model holds TorchScript modules ({', '.join(scripted[:5])}), which fxpipe cannot trace nor "
                        "keep whole: compile the Python module itself (the one given to torch.jit.script)")  # fmt: skip
    for leaf in leaf_modules:
        if isinstance(leaf, str) and leaf not in names:
            close = difflib.get_close_matches(leaf, names, n=3)
            hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
            problems.append(f"leaf_modules names {leaf!r}, which is no submodule of {type(model).__name__}{hint}")
        elif not isinstance(leaf, str) and not (isinstance(leaf, type) and issubclass(leaf, nn.Module)):
            problems.append(f"leaf_modules takes module types or qualified submodule names, not {leaf!r}")
        elif leaf is type(model) and not any(type(m) is leaf for name, m in model.named_modules() if name):
            problems.append(f"leaf_modules names {leaf.__name__}, the model's own class, which no submodule is: the "
                            "model itself is what is cut into stages, never kept whole; name its submodules")  # fmt: skip
    return problems


def _cost_problems(device_memory: Any, param_scale: Any, bandwidth: Any, flop_rate: Any) -> list[str]:
    """The cost model's numbers: a rate of 0 would divide by zero, and a negative number would
    turn the search's costs around."""
    problems = []
    for name, value, least in (("bandwidth", bandwidth, "positive"), ("flop_rate", flop_rate, "positive"), ("param_scale", param_scale, "zero or more")):
        if value is not None and not _number_at_least(value, least == "positive"):
            problems.append(f"{name} must be a number, {least} (got {value!r})")
    entries = [device_memory] if not isinstance(device_memory, (list, tuple)) else list(device_memory)
    if device_memory is not None and not all(_number_at_least(m, True) for m in entries):
        problems.append(f"device_memory must be bytes, positive: one number, or one per device (got {device_memory!r})")
    return problems


def _number_at_least(value: Any, positive: bool) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return value > 0 if positive else value >= 0


def _check_arguments(
    devices: Sequence[Device], chunks: int, checkpoint: str, split_points: Any, balance: Any,
    schedule: Any = "gpipe", stages_per_device: Any = 1, model_problems: Sequence[str] = (),
) -> list[torch.device]:
    """The devices parsed; or one ValueError that lists every bad argument with its fix."""
    listed = _listed(devices)
    parsed, problems = _device_problems(devices, listed)
    problems = [*model_problems, *problems]
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        problems.append(f"chunks must be a whole number of micro-batches, at least 1 (got {chunks!r})")
    if checkpoint not in CHECKPOINT_MODES:
        problems.append(f"checkpoint must be one of {', '.join(map(repr, CHECKPOINT_MODES))} (got {checkpoint!r})")
    problems += _split_point_problems(split_points, balance)
    problems += _balance_problems(balance)
    problems += _schedule_problems(schedule, stages_per_device, chunks, len(parsed))
    if problems:
        raise ValueError("compile_pipeline got bad arguments:\n" + "\n".join(f"  - {p}" for p in problems))
    return parsed


def _place(owner: nn.Module, gm: fx.GraphModule, name: str, tensor: torch.Tensor, device: torch.device) -> None:
    """Move one parameter (in place, keeping the object) or buffer to its stage's device (one
    on the meta device is made there when the pipeline is built: fxpipe/compiled/materialize.py)."""
    if tensor.device == device or tensor.is_meta:
        return
    if isinstance(tensor, nn.Parameter):
        tensor.data = tensor.data.to(device)
        if tensor.grad is not None:
            tensor.grad = tensor.grad.to(device)
        return
    parent_name, _, attr = name.rpartition(".")
    for root in (owner, gm):
        try:
            parent = fetch_attr(root, parent_name) if parent_name else root
        except AttributeError:
            continue
        if getattr(parent, attr, None) is tensor:
            if attr in parent._buffers:
                parent._buffers[attr] = tensor.to(device)
            else:
                setattr(parent, attr, tensor.to(device))


def place_state(owner: nn.Module, gm: fx.GraphModule, runs: Sequence[Sequence[fx.Node]], devices: Sequence[torch.device]) -> None:
    """Every parameter and buffer goes to the device of the first stage that reads it."""
    placed: set[int] = set()
    for run, device in zip(runs, devices):
        for node in run:
            for name, tensor in tensors_read(gm, node).items():
                if id(tensor) not in placed:
                    placed.add(id(tensor))
                    _place(owner, gm, name, tensor, device)


def _module_path(node: fx.Node) -> str:
    scope = str(node.meta.get("scope", ""))
    return scope or (str(node.target) if node.op == "call_module" else "")


def _caps(device_memory: Union[None, float, Sequence[float]], ranks: list[int]) -> Optional[list[float]]:
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
    if caps is None:
        return
    problems, start = [], 0
    for index, (run, cap) in enumerate(zip(runs, caps)):
        needs = model.memory(start, start + len(run))
        if needs > cap:
            problems.append(f"stage {index} needs {needs:.0f} bytes, more than device_memory allows it ({cap:.0f})")
        start += len(run)
    refuse(problems, "How to fix: move the cut, or leave it to balance='memory' (or another mode), which fits "
                     "device_memory; or raise device_memory.")


def _cut(
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
    placement: Optional[RankPlacement] = None,
    workers: Optional[list[int]] = None,
) -> tuple[list[list[fx.Node]], Optional[StageTimes]]:
    """The stages: by split points, by node counts, or the best cut under a balance mode; and,
    under balance='time', each stage's measured times (`workers`: each stage's worker, where
    the stages are timed at once)."""
    together = state_write_spans(gm, order)
    chosen = _chosen_cut(order, len(devices), split_points, balance, together)
    if chosen is not None:
        _refuse_over_caps(chosen, cut_model(order, "memory", **costs), caps)
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
    together.update(view_write_spans(gm, order))
    together.update(input_write_spans(gm, order))
    runs = partition(order, len(devices), model=cut_model(order, mode, **costs), caps=caps, together=together)
    if timed_on is None:
        return runs, None
    try:
        times: Optional[StageTimes] = profile_stages(gm, timed_on[0], devices[0], runs, per_batch=timed_on[1], workers=workers)
    except Exception:  # noqa: BLE001 - a stage that cannot run alone here is predicted from its nodes' times
        times = None
    return runs, times if placement is None else gathered(times, placement, "comparing the measured times")[0]


StageTimes = list[tuple[float, float]]  # per stage: seconds per batch of its forward, and of forward plus backward


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


def _refuse_recomputed_writes(gm: fx.GraphModule, runs: Sequence[Sequence[fx.Node]], checkpoint: str, chunks: int) -> None:
    """A checkpointed stage whose forward writes a parameter in place that another stage reads
    would write it again in its recompute; refused, as autograd would fail in backward."""
    problems = rewritten_by_recompute(gm, runs) if checkpoint_stop(checkpoint, chunks) > 0 else []
    if problems:
        raise ValueError(
            f"with checkpoint={checkpoint!r} a recompute would write these parameters in place a second time, while "
            "another stage holds them for its backward:\n" + "\n".join(f"  - {p}" for p in problems) + "\n"
            "How to fix: checkpoint='never' (or 'except_last' with chunks=1); cut so that one stage holds every use "
            "(split_points=[...]); or write them outside forward (an Embedding's max_norm=None, and its rows "
            "renormalised before the step)."
        )


def _report_model(order: list[fx.Node], costs: dict[str, Any]) -> CutModel:
    """Predicted seconds: measured where measured, else from FLOPs."""
    return cut_model(order, "time" if _measured(order) else "flops", **costs)


def _measured(order: list[fx.Node]) -> bool:
    return all("time" in n.meta for n in order)


def _times_basis(order: list[fx.Node], costs: dict[str, Any]) -> str:
    """Where the plan's stage times come from, said beside every prediction made from them."""
    if _measured(order):
        return "from measured times"
    return f"from FLOPs at an assumed {costs['flop_rate']:.3g} FLOP/s; balance='time' measures them"


def _stage_plans(
    runs: list[list[fx.Node]], devices: list[torch.device], edges: list[Any], report: CutModel, memory: CutModel,
    stage_times: Optional[StageTimes],
) -> list[StagePlan]:
    plans, start = [], 0
    for index, (run, device) in enumerate(zip(runs, devices)):
        end = start + len(run)
        time, forward_share = report.time(start, end), 1 / 3
        if stage_times is not None:  # measured whole: what receiving costs is added as the nodes' sum has it
            forward, whole = stage_times[index]
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
                memory=int(memory.memory(start, end)),
                forward_share=forward_share,
            )
        )
        start = end
    return plans


P = ParamSpec("P")


def _leaves_the_model_as_it_was(compile: Callable[P, Pipeline]) -> Callable[P, Pipeline]:
    """Compiling runs the model (checks, shapes, timing). Each pass puts back what it changed;
    this puts back anything one missed, even when compiling fails: parameter values, buffers,
    `.grad`, `training` flags, the random states, and the example's tensors that a forward
    writes in place; and when it fails, the module-level values the model's code assigned.
    A tensor placement moved keeps its device.
    Then, across processes, data-parallel replicas copy replica 0's parameters, which that
    restore would undo."""

    @functools.wraps(compile)
    def compile_and_restore(*args: P.args, **kwargs: P.kwargs) -> Pipeline:
        model = kwargs["model"] if "model" in kwargs else args[0] if args else None
        if not isinstance(model, nn.Module):
            return compile(*args, **kwargs)
        example = (kwargs.get("example", args[1] if len(args) > 1 else None), kwargs.get("example_kwargs"))
        _refuse_lazy(model)  # before anything reads its tensors
        try:
            with preserved(model), inputs_preserved(example), put_back_on_failure(model):
                pipe = compile(*args, **kwargs)
        except Exception as e:  # a model freed in part by an earlier compile says so
            if freed_note(model) and not isinstance(e, FreedState):
                e.add_note(freed_note(model))
            raise
        pipe._join_replicas()
        return pipe

    return compile_and_restore


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


def _refuse_sequence_first(gm: fx.GraphModule, chunks: int, spec: ChunkSpec) -> None:
    """Micro-batches split inputs along dim 0; a sequence-first layer's dim 0 is the sequence."""
    splits_elsewhere = any(dim not in (None, 0) for dim in spec.values())  # {"x": 1}
    found = sequence_first_calls(gm) if chunks > 1 and not splits_elsewhere else []
    if found:
        raise ValueError(
            f"these modules take the batch along dim 1 (batch_first=False): {', '.join(found)}, and "
            "micro-batches split the inputs along dim 0, which for them is the sequence.\nHow to "
            "fix: build them with batch_first=True and pass batch-first inputs; or name the dim that holds "
            "the batch of each input that holds it (chunk_spec={'x': 1, 'h0': 1} for a sequence-first x and "
            "an initial state h0); or use chunks=1."
        )


def _refuse_an_example_forward_does_not_take(
    model: nn.Module, signature: Optional[inspect.Signature], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """The example gives forward's arguments: one value for each, no more, none it does not name."""
    if signature is None or model._forward_pre_hooks:  # a pre-hook may take arguments forward does not
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(
            f"the example does not fit {type(model).__name__}.forward{_unannotated(signature)}: {e}\n"
            "How to fix: give compile_pipeline the arguments of one call of the model: a tensor, or a tuple "
            "with one value for each positional argument (a single tuple argument goes inside another: "
            "example=((a, b),)), and example_kwargs={name: value} for the arguments forward takes by name."
        ) from None


def _unannotated(signature: inspect.Signature) -> inspect.Signature:
    """The signature as the arguments' names and defaults, which a call gives."""
    empty = inspect.Parameter.empty
    parameters = [p.replace(annotation=empty) for p in signature.parameters.values()]
    return signature.replace(parameters=parameters, return_annotation=inspect.Signature.empty)


def _refuse_bad_chunk_spec(signature: Optional[inspect.Signature], spec: ChunkSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Every name chunk_spec gives is an argument of forward, and every dim one its tensors have."""
    if not spec or signature is None:
        return
    named = [n for n, p in signature.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    takes_any = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())
    problems = [f"{name!r} is not an argument of forward (it takes {', '.join(named) or 'none by name'})"
                for name in spec if name not in named and not takes_any]  # fmt: skip
    problems += [f"{name!r}: {dim!r} is not a dim; give a whole number, or None to keep it whole"
                 for name, dim in spec.items() if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int))]  # fmt: skip
    if not problems:
        dims = spec_dims(signature, spec, args, kwargs)
        for leaf in tree_flatten((args, kwargs))[0]:
            dim = dims.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
            if dim is not None and not -leaf.dim() <= dim < leaf.dim():
                problems.append(f"dim {dim} of a tensor of shape {tuple(leaf.shape)} does not exist")
    if problems:
        raise ValueError("chunk_spec cannot split the inputs:\n" + "\n".join(f"  - {p}" for p in problems)
                         + "\nHow to fix: name forward's arguments, each with the dim that holds the batch, or None.")


def _refuse_nothing_split(chunks: int, signature: Optional[inspect.Signature], spec: ChunkSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """With chunks > 1, some input holds the batch: one that chunk_spec keeps whole, or without
    a dim, is split into nothing, and every call would run a single micro-batch."""
    dims = spec_dims(signature, spec, args, kwargs) if spec and signature is not None else {}
    if chunks > 1 and any(isinstance(t, torch.Tensor) for t in tree_flatten((args, kwargs))[0]) and batch_size_of([args, kwargs], dims) is None:
        raise ValueError(
            f"chunks={chunks}, but no input of the example is split into micro-batches (chunk_spec keeps every "
            "one whole, or none has a dim to split): every call would run one micro-batch.\nHow to fix: chunks=1, "
            "or name the input and the dim that holds the batch in chunk_spec."
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
            'time' (measures every node's forward and backward on `devices[0]`).
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
            (fxpipe/schedules/schedule.py draws them). `pipe(x)` and `loss.backward()` always run GPipe.
        stages_per_device: with 'interleaved-1f1b', the model is cut into this many stages per
            device, placed round-robin: stage s on `devices[s % len(devices)]`.
        compile_stages: run each generated stage under `torch.compile`, forward and backward:
            True, or a dict of torch.compile's `mode`, `dynamic`, `backend`, `fullgraph` and
            `options`, passed through (`{"mode": "reduce-overhead"}` for CUDA graphs).
            `pipe.compile_stats()` counts each stage's graphs, compile time and recompiles.

    The automatic modes find the cut of the linear order with the least predicted pipeline time
    `sum(t_i) + (chunks - 1) * max(t_i)` that fits `device_memory`.
    """
    placement = _placement(devices, mesh, timeout)
    given = devices if placement is None else [placement.device] * placement.size
    assert given is not None
    leaf_modules = [leaf_modules] if isinstance(leaf_modules, (str, type)) else list(leaf_modules or ())
    stage_compile, compile_problems = compile_options(compile_stages)
    problems = [*_model_problems(model, leaf_modules), *_cost_problems(device_memory, param_scale, bandwidth, flop_rate), *compile_problems]
    parsed = _check_arguments(given, chunks, checkpoint, split_points, balance, schedule, stages_per_device, problems)
    ranks = [s % len(parsed) for s in range(stages_per_device * len(parsed))]
    parsed = [parsed[r] for r in ranks]
    example_args = example if isinstance(example, tuple) else (example,)
    if batch_size_of(list(example_args)) == 0:
        raise ValueError("the example batch is empty (size 0 along dim 0): give at least one sample")
    example_kwargs = dict(example_kwargs or {})
    signature, spec = forward_signature(model), dict(chunk_spec or {})
    _refuse_an_example_forward_does_not_take(model, signature, example_args, example_kwargs)
    _refuse_bad_chunk_spec(signature, spec, example_args, example_kwargs)
    _refuse_nothing_split(chunks, signature, spec, example_args, example_kwargs)
    if is_on_meta(model):  # compiled on shapes alone; each stage is made where it runs
        if balance == "time":
            raise ValueError("balance='time' times the model's nodes, and a model on the meta device cannot run: pass balance='flops'")
        example_args, example_kwargs = tree_map_only(torch.Tensor, lambda t: t.to("meta"), (example_args, example_kwargs))
    traced = to_graph(model, example_args, leaf_modules, chunks, example_kwargs)
    # The passes run the graph: what a module called whole assigns (a call counter) is put back.
    with assignments_recorded(model):
        _refuse_sequence_first(traced.graph, chunks, spec)
        bound = traced.bind(example_args, example_kwargs)
        inputs = tuple(bound.values())
        gm = reads_after_hidden_writes(redirect_reads_after_writes(traced.graph, inputs))
        try:
            propagate_shapes(gm, inputs)
        except Exception:
            refuse_an_example_the_model_refuses(model, example_args, example_kwargs)
            raise
        split = spec_dims(signature, spec, example_args, example_kwargs)
        # One process may check micro-batches on its first call of two samples or more, where an
        # example of one has no halves; across processes every rank must refuse alike, here.
        checked = annotate_batch_dims(gm, inputs, chunks, split, serves_eval=traced.eval_graph is None, defer_one_sample=placement is None)
        _check_example_micro_batches(traced, bound, chunks, split, model, (example_args, example_kwargs))  # after the halves' check
        annotate_costs(gm)
        # Split points and pipe_split() marks name places in the order the forward runs: cut that order.
        traced_order = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
        chosen = split_points is not None or any(is_split(n) for n in traced_order)
        order = traced_order if chosen else linearize(gm)
        on_cpu = all(d.type == "cpu" for d in parsed)
        costs = dict(
            chunks=chunks,
            checkpointed=checkpoint_stop(checkpoint, chunks),
            param_scale=param_scale,
            bandwidth=bandwidth if bandwidth is not None else (None if on_cpu else 12e9),
            flop_rate=flop_rate if flop_rate is not None else (5e10 if on_cpu else 1e13),
        )
        caps = _caps(device_memory, ranks)
        runs, stage_times = _cut(
            gm, order, parsed, inputs, split_points=split_points, balance=balance, costs=costs, caps=caps, split=split,
            # CPU stages in one process share its cores and interpreter lock: their workers are timed at once.
            placement=placement, workers=ranks if on_cpu and placement is None else None,
        )  # fmt: skip
        _refuse_recomputed_writes(gm, runs, checkpoint, chunks)
        edges = find_edges(gm, len(parsed))
        pin_devices(gm, parsed)
        cuts = {True: Cut(gm, [list(run) for run in runs], edges)}
        if traced.eval_graph is not None:
            cuts[False] = _eval_cut(traced.eval_graph, gm, inputs, parsed, lambda g: annotate_batch_dims(g, inputs, chunks, split, serves_eval=True, defer_one_sample=not checked))
        else:
            cuts[False] = cuts[True]
        place_state(model, gm, runs, parsed)  # after every pass that runs the model on the example
    report, memory = _report_model(order, costs), cut_model(order, "memory", **costs)
    plan = Plan(
        stages=_stage_plans(runs, parsed, edges, report, memory, stage_times),
        edges=edges,
        chunks=chunks,
        checkpoint=checkpoint,
        balance=balance if isinstance(balance, str) else ("split_points" if split_points else "counts" if balance else "memory"),
        notes=[traced.note, shapes_note(gm)] if traced.note else ["input shapes: every dim dynamic (torch.fx)"],
        schedule=schedule,
        ranks=ranks,
        times=_times_basis(order, costs),
    )
    build = functools.partial(
        build_program, devices=parsed, ranks=ranks, deferred_batch_norm=deferred_batch_norm, stored=traced.stored_with_grad,
        attributes=traced.attributes, listed=None if traced.reads is None else frozenset(traced.reads.iterated),
        compile_stages=stage_compile,
    )
    compiled = Compiled(
        plan, cuts, traced.bind, build, parsed, spec, deferred_batch_norm, placement, example_leaves(bound, split), traced.check_micro_batch,
        *_reads(traced), traced.eval_only,
    )
    if not checked:
        compiled.unchecked = functools.partial(_check_micro_batches_later, traced, cuts, chunks, model)
        warnings.warn(
            f"the example has one sample, which has no halves: the check that {chunks} micro-batches compute what the "
            "whole batch does runs on the first call of two samples or more (a call of one runs as one micro-batch).",
            stacklevel=2,
        )
    if placement is not None:
        read_here = [t for run, rank in zip(runs, ranks) if rank == placement.me for node in run for t in tensors_read(gm, node).values()]
        check_same_plan(plan, placement, freed_needed(model, read_here), unfillable(model, read_here))
        connect(placement)
        for stage in plan.stages:
            stage.device = f"rank {placement.ranks[ranks[stage.index]]} {stage.device}"
    pipe = Pipeline(model, compiled)
    if placement is None:  # another kind of call compiles a pipeline of its own, with these options
        options = dict(
            devices=devices, chunks=chunks, checkpoint=checkpoint, split_points=split_points, balance=balance,
            leaf_modules=leaf_modules, device_memory=device_memory, param_scale=param_scale, bandwidth=bandwidth,
            flop_rate=flop_rate, chunk_spec=chunk_spec, deferred_batch_norm=deferred_batch_norm, schedule=schedule,
            stages_per_device=stages_per_device, compile_stages=compile_stages,
        )  # fmt: skip
        pipe.__dict__["_recompile"] = functools.partial(_compiled_for_call, options)
    return pipe


def _compiled_for_call(options: dict[str, Any], model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Pipeline:
    """A pipeline for a call of another kind than the example, the call as its example."""
    return compile_pipeline(model, args, example_kwargs=kwargs or None, **options)


def _check_micro_batches_later(
    traced: Traced, cuts: dict[bool, Cut], chunks: int, model: nn.Module, bound: dict[str, Any], dims: Dims,
    call: tuple[tuple[Any, ...], dict[str, Any]],
) -> None:
    """The halves' check of compiling, on a call's inputs (`bound`, split along `dims`) where the
    example had one sample; raises as compiling would have."""
    inputs = tuple(bound.values())
    train, evaluation = cuts[True], cuts[False]
    annotate_batch_dims(train.graph, inputs, chunks, dims, serves_eval=evaluation is train)
    if evaluation is not train:
        annotate_batch_dims(evaluation.graph, inputs, chunks, dims, serves_eval=True)
    _check_example_micro_batches(traced, bound, chunks, dims, model, call)


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
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds (got {timeout!r})")
    return None if mesh is None else placement_of(mesh, timeout)


def _eval_cut(
    graph: fx.GraphModule, train: fx.GraphModule, inputs: tuple[Any, ...], devices: list[torch.device], annotate: Callable[[fx.GraphModule], None]
) -> Cut:
    """The eval-mode graph, cut like the training graph (see passes/modes.py)."""
    graph = redirect_reads_after_writes(graph, inputs)
    propagate_shapes(graph, inputs)
    annotate(graph)
    runs = follow_stages(graph, train, len(devices))
    edges = find_edges(graph, len(devices))
    pin_devices(graph, devices)
    return Cut(graph, runs, edges)
