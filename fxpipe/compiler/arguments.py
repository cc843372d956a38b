"""Checking compile_pipeline's arguments and example: every problem collected, each with its fix."""
from __future__ import annotations

import difflib
import inspect
import numbers
import re
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.utils._pytree import tree_flatten

from fxpipe.compiled.program import ChunkSpec
from fxpipe.compiler.stage_graph import STAGE_GRAPHS
from fxpipe.core.microbatch import batch_size_of, spec_dims
from fxpipe.core.wording import listed
from fxpipe.passes.costs import BALANCE_MODES
from fxpipe.passes.partition import conflicting_options
from fxpipe.schedules.actions import CHECKPOINT_MODES, SCHEDULES


Device = Union[str, int, torch.device]


_STAGE_DEVICE_TYPES = ("cpu", "cuda")
_UNWRITABLE = re.compile(r'["\\\n]')  # in a name: what the generated code's string literals cannot hold


def _parse_device(device: Any) -> tuple[Optional[torch.device], Optional[str]]:
    """The device, or the problem with it and its fix."""
    if isinstance(device, int) and not isinstance(device, bool) and not torch.cuda.is_available():
        return None, f"{device!r}: a number names a CUDA device, and CUDA is not available on this machine; use 'cpu' devices"
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
    if parsed.type == "cpu":
        # The one CPU ('cpu:1' names it too): torch puts its tensors on 'cpu', whatever the index.
        parsed = torch.device("cpu")
    return parsed, None


def plain_values(value: Any) -> Any:
    """`value` with NumPy's numbers and arrays as Python ints, floats and lists, and an iterator
    as a list (read once here: a call of another kind compiles again from the same options)."""
    if isinstance(value, (bool, str, bytes, torch.device, torch.Tensor)) or value is None:
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, float):
        return float(value)
    if type(value).__module__ == "numpy" and callable(getattr(value, "tolist", None)):
        return plain_values(value.tolist())
    if isinstance(value, Iterator):
        value = list(value)
    if type(value) in (list, tuple):
        return type(value)(plain_values(v) for v in value)
    return value


def _listed(devices: Any) -> Optional[list[Any]]:
    """The devices as a list, or None when `devices` is not a list of them (one device, say)."""
    if isinstance(devices, (str, int, torch.device)) or not isinstance(devices, Iterable):
        return None
    return list(devices)


def _device_problems(devices: Any, listed: Optional[list[Any]]) -> tuple[list[torch.device], list[str]]:
    if listed is None:
        if isinstance(devices, int) and not isinstance(devices, bool):
            shown = ["cpu"] * devices if 1 <= devices <= 8 else ["cpu", "cpu"]
            return [], [f"devices must be a list with one device per stage, not a count: e.g. devices={shown!r}, or "
                        f"{[f'cuda:{i}' for i in range(len(shown))]!r} (got {devices!r})"]  # fmt: skip
        example = [str(devices)] if isinstance(devices, (str, torch.device)) else ["cpu", "cpu"]
        return [], [f"devices must be a list with one device per stage, e.g. devices={example!r} (got {devices!r})"]
    if not listed:
        return [], ["devices is empty: give one device per stage, e.g. devices=['cpu', 'cpu']"]
    found = [_parse_device(device) for device in listed]
    return [d for d, _ in found if d is not None], list(dict.fromkeys(p for _, p in found if p is not None))


def _balance_problems(balance: Any, stages: Optional[int]) -> list[str]:
    """`stages`: how many the devices make, where they parse."""
    modes = ", ".join(map(repr, BALANCE_MODES))
    if balance is None or (isinstance(balance, str) and balance in BALANCE_MODES):
        return []
    counts = not isinstance(balance, (str, bytes)) and isinstance(balance, Sequence)
    if not counts or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in balance):
        return [f"balance must be one of {modes}, or a list of node counts per stage, each at least 1 (got {balance!r})"]
    if stages is not None and len(balance) != stages:
        return [f"balance has {len(balance)} entries for {stages} stages (devices times stages_per_device): give one node count per stage"]
    return []  # their sum the partition checks against the graph


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


def refuse_lazy(model: nn.Module) -> None:
    """Lazy modules' parameters have no shape until a first call: nothing can be cut or placed."""
    lazy = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if is_lazy(t)]
    if lazy:
        raise ValueError(
            f"the model has parameters without a shape yet (lazy modules, LazyLinear say): {listed(lazy)}.\n"
            "How to fix: run the model once on an example batch before compiling (model(example)), which gives them "
            "their shapes."
        )


def _is_pipeline(module: nn.Module) -> bool:
    """A Pipeline (fxpipe/pipeline.py, which imports this module: known by its class)."""
    return any(cls.__name__ == "Pipeline" and cls.__module__ == "fxpipe.pipeline" for cls in type(module).__mro__)


def _overrides_torch(cls: type) -> bool:
    """Whether a tensor class runs code of its own on torch's calls (weight noise in
    __torch_function__, a quantised or distributed tensor's __torch_dispatch__)."""
    override = getattr(cls, "__torch_function__")
    function = getattr(override, "__func__", override)
    own_function = function not in (getattr(torch.Tensor.__torch_function__, "__func__"), torch._C._disabled_torch_function_impl)
    return own_function or getattr(cls, "__torch_dispatch__") is not torch._C._disabled_torch_dispatch_impl


def model_problems(model: Any, leaf_modules: list[Any]) -> list[str]:
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
    pipelines = [name or "the model itself" for name, m in model.named_modules() if _is_pipeline(m)]
    if pipelines:
        problems.append(f"the model is or holds a Pipeline ({listed(pipelines)}): a pipeline runs its stages on "
                        "threads of its own and is compiled once; compile the plain model it was compiled from (it "
                        "holds the same parameters), or call the pipeline from a module of your own that is not compiled")  # fmt: skip
    if scripted:
        problems.append(f"the model holds TorchScript modules ({listed(scripted)}), which fxpipe cannot trace nor "
                        "keep whole: compile the Python module itself (the one given to torch.jit.script)")  # fmt: skip
    unwritable: list[str] = []
    for name in [*names, *(n for n, _ in model.named_parameters()), *(n for n, _ in model.named_buffers())]:
        if _UNWRITABLE.search(name) and not any(name.startswith(f"{outer}.") for outer in unwritable):
            unwritable.append(name)
    if unwritable:
        shown = listed(f"'{name}'" for name in unwritable)
        problems.append(f"the model holds modules or tensors whose names torch.fx and torch.export cannot write into the "
                        f"code they generate ({shown}): a double quote or a backslash ends the "
                        "string it is written in; rename them (a ModuleDict's keys, say) without those characters")  # fmt: skip
    overriding = [f"{name} ({type(t).__name__})" for name, t in [*model.named_parameters(), *model.named_buffers()] if _overrides_torch(type(t))]
    if overriding:
        problems.append(f"the model holds tensors of classes that override __torch_function__ or __torch_dispatch__ "
                        f"({listed(overriding)}): its stages run on plain tensors that stand for the model's "
                        "parameters and buffers, and the override would not run there; apply what it does in a module's "
                        "forward (or with torch.nn.utils.parametrize), on a plain nn.Parameter")  # fmt: skip
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


def cost_problems(device_memory: Any, param_scale: Any, bandwidth: Any, flop_rate: Any) -> list[str]:
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


def mapping_problems(chunk_spec: Any, example_kwargs: Any) -> list[str]:
    """The two arguments given as dicts, or what is wrong with each."""
    problems = []
    if chunk_spec is not None and not isinstance(chunk_spec, Mapping):
        problems.append(f"chunk_spec must be a dict from an argument's name to the dim that holds its batch, e.g. {{'h0': 1}} (got {chunk_spec!r})")
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        problems.append(f"example_kwargs must be a dict of the example call's keyword arguments, e.g. {{'mask': mask}} (got {type(example_kwargs).__name__})")
    return problems


def timeout_problems(timeout: Any) -> list[str]:
    if timeout is not None and not _number_at_least(timeout, True):
        return [f"timeout must be a positive number of seconds (got {timeout!r})"]
    return []


def check_arguments(
    devices: Sequence[Device], chunks: int, checkpoint: str, split_points: Any, balance: Any,
    schedule: Any = "gpipe", stages_per_device: Any = 1, model_problems: Sequence[str] = (), stage_graph: Any = "auto",
    device_memory: Any = None,
) -> list[torch.device]:
    """The devices parsed; or one ValueError that lists every bad argument with its fix."""
    listed = _listed(devices)
    parsed, problems = _device_problems(devices, listed)
    problems = [*model_problems, *problems]
    if listed and isinstance(device_memory, (list, tuple)) and len(device_memory) != len(listed):
        entries = f"{len(device_memory)} entr{'y' if len(device_memory) == 1 else 'ies'}"
        problems.append(f"device_memory has {entries} for {len(listed)} devices: give one per device, or one number")
    whole = isinstance(stages_per_device, int) and not isinstance(stages_per_device, bool) and stages_per_device >= 1
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        problems.append(f"chunks must be a whole number of micro-batches, at least 1 (got {chunks!r})")
    if checkpoint not in CHECKPOINT_MODES:
        problems.append(f"checkpoint must be one of {', '.join(map(repr, CHECKPOINT_MODES))} (got {checkpoint!r})")
    problems += _split_point_problems(split_points, balance)
    problems += _balance_problems(balance, len(listed) * stages_per_device if listed and whole else None)
    problems += _schedule_problems(schedule, stages_per_device, chunks, len(parsed))
    problems += _stage_graph_problems(stage_graph, split_points, balance)
    if problems:
        raise ValueError("compile_pipeline got bad arguments:\n" + "\n".join(f"  - {p}" for p in problems))
    return parsed


def _stage_graph_problems(stage_graph: Any, split_points: Any, balance: Any) -> list[str]:
    if stage_graph not in STAGE_GRAPHS:
        return [f"stage_graph must be one of {', '.join(map(repr, STAGE_GRAPHS))} (got {stage_graph!r})"]
    if stage_graph == "dag" and (split_points is not None or (balance is not None and not isinstance(balance, str))):
        given = "split_points" if split_points is not None else "balance (node counts)"
        return [f"stage_graph='dag' searches the cut, and {given} gives one by hand: give one of them (a cut by hand runs as the graph it gives)"]
    return []


def refuse_an_example_forward_does_not_take(
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


def refuse_bad_chunk_spec(signature: Optional[inspect.Signature], spec: ChunkSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
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


def refuse_nothing_split(chunks: int, signature: Optional[inspect.Signature], spec: ChunkSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """With chunks > 1, some input holds the batch: one that chunk_spec keeps whole, or without
    a dim, is split into nothing, and every call would run a single micro-batch."""
    dims = spec_dims(signature, spec, args, kwargs) if spec and signature is not None else {}
    if chunks > 1 and any(isinstance(t, torch.Tensor) for t in tree_flatten((args, kwargs))[0]) and batch_size_of([args, kwargs], dims) is None:
        raise ValueError(
            f"chunks={chunks}, but no input of the example is split into micro-batches (chunk_spec keeps every "
            "one whole, or none has a dim to split): every call would run one micro-batch.\nHow to fix: chunks=1, "
            "or name the input and the dim that holds the batch in chunk_spec."
        )
