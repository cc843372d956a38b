"""The forward's Python effects a graph would lose, refused or warned of: assignments, stored tensors, caches."""
from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import nn

from fxpipe.compiled.materialize import is_on_meta
from fxpipe.compiler.traced import Traced, in_mode
from fxpipe.core.own_code import caller_stacklevel
from fxpipe.core.randomness import seed_started_generators
from fxpipe.core.snapshot import preserved
from fxpipe.passes.shapes import small_on_cpu
from fxpipe.passes.state import ASSIGNS
from fxpipe.tracing.assignments import (
    AssignmentError, Changes, StableAssignments, assignments_recorded, cached, differing_entries, outside, refuse_assignments,
)
from fxpipe.tracing.attribute_reads import Reads, assigned_while_traced, counted_while_traced
from fxpipe.tracing.flag_reads import flag_reads_counted
from fxpipe.tracing.generators import generators_drawn
from fxpipe.tracing.lost_effects import (
    CHECKPOINTED_DRAWS_FIX, DrawingRegion, checkpointed_draws, outside_writes_refused, own_checkpoints_refused, rebound_buffers_refused, tensor_hooks_counted,
)
from fxpipe.tracing.trace import TraceError


def refuse_lost_assignments(model: nn.Module, traced: Traced, changed: Changes) -> None:
    """Attributes the model's forward assigned while tracing and checking are put back; those
    outside the modules the graph calls whole would never be assigned by the pipeline."""
    try:
        refuse_assignments(changed, _called_whole(traced), exported=traced.fx_failure)
    except AssignmentError as error:
        raise TraceError(f"{type(model).__name__} cannot be compiled: {error}") from None
    for gm in [traced.graph, *([traced.eval_graph] if traced.eval_graph is not None else [])]:
        for node in gm.graph.nodes:
            if node.op == "call_module" and len(outside(changed, [str(node.target)])) < len(changed):
                node.meta[ASSIGNS] = True


def refuse_lost_counters(model: nn.Module, read: Reads) -> None:
    """A value the forward assigns that the check of assignments cannot follow is lost from any
    graph, whichever front end traced it: a module-level one (`global calls; calls += 1`), or one
    in a settings object with `__slots__`, or with a table of its own for its fields."""
    for counted, where in ((assigned_while_traced(read), "module-level values"), (counted_while_traced(model, read), "attributes")):
        if counted:
            raise TraceError(
                f"{type(model).__name__} cannot be compiled: its forward assigns {where}, which changed as it was "
                f"traced: {', '.join(counted)}. A pipeline runs the traced graph, which never assigns them and holds "
                "the value they had then.\nHow to fix: keep such a value in the module that changes it (self.calls "
                "+= 1), which is then called whole; or in a buffer (self.register_buffer) updated in place; or return "
                "it from forward."
            )


def refuse_reads_of_stored_tensors(model: nn.Module, traced: Traced, stable: StableAssignments) -> None:
    """A tensor a module called whole stores as it runs (`self.hidden = h`), read by the code
    torch.fx traced (`self.a.hidden` after `self.a(x)`): the graph reads what it held when
    traced, a constant, where the plain model reads what this call stored."""
    stored = {f"{path}.{name}" if path else name for end in stable.ends for (path, name), value in end.items() if isinstance(value, torch.Tensor)}
    graphs = [g for g in (traced.graph, traced.eval_graph) if g is not None]
    read = sorted({str(n.target) for g in graphs for n in g.graph.nodes if n.op == "get_attr" and str(n.target) in stored})
    if read:
        raise TraceError(
            f"{type(model).__name__}'s forward reads {', '.join(read)}, which a module called whole stores as it runs: "
            "the pipeline's graph would read the tensor stored when it was traced, where the plain model reads the "
            "one this call stores.\nHow to fix: return the value from that module's forward (return out, hidden) "
            "and use what it returns."
        )


def refuse_containers_filled_at_random(model: nn.Module, example: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A cache the forward fills and then reads (put back after compiling's runs) is computed
    again by the graph on every call: the plain model's value only if it is one of the
    parameters, not of random numbers drawn once (a random projection made on first use). Runs
    in each mode from other seeds tell; a store each run writes anew is no cache."""
    differ: list[str] = []
    with preserved(model), assignments_recorded(model), torch.no_grad():
        for training in (True, False):
            with in_mode(model, training):
                runs = []
                try:
                    for seed in (1, 2):
                        seed_started_generators(seed)
                        runs.append(cached(model, lambda: model(*example, **kwargs)))
                except Exception:  # noqa: BLE001 - a mode the model does not run in fills nothing
                    continue
                differ += [path for path in differing_entries(*runs) if path not in differ]
    if differ:
        raise TraceError(
            f"{type(model).__name__}'s forward fills {', '.join(differ)} with random values (another draw on each "
            "run): the pipeline's generated stages would draw them again on every call and micro-batch, where the "
            "plain model draws them once and keeps them.\nHow to fix: draw them in __init__ and register them as a "
            "buffer (or a parameter), so that forward only reads them."
        )


def _called_whole(traced: Traced) -> set[str]:
    """The paths of the modules the graphs call whole: their forwards run on every call."""
    graphs = [traced.graph, *([traced.eval_graph] if traced.eval_graph is not None else [])]
    return {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_module"}


def warn_of_containers_left(model: nn.Module, traced: Traced, filled: list[str]) -> None:
    """The dicts, lists and sets the forward filled (put back after compiling's runs) outside the
    modules called whole, whose forwards fill them on every call: the pipeline leaves those."""
    left = outside(filled, _called_whole(traced))
    if left:
        owners = sorted({name.rpartition(".")[0] for name in left} - {""})
        whole = f"keep the modules that fill them whole (leaf_modules={owners!r}), whose forwards run on every micro-batch" if owners else ""
        root = "return from forward what the root module fills" if len(owners) < len({name.rpartition(".")[0] for name in left}) else ""
        warnings.warn(
            f"{type(model).__name__}'s forward changes the contents of {', '.join(left)}, which the pipeline's "
            "generated stages do not: the graph computes from what the model held when compiled (a cache is "
            "computed again on each call), and those containers stay as they were.\nTo have them filled: "
            + "; or ".join(filter(None, [whole, root])) + ".",
            stacklevel=caller_stacklevel(),
        )


def refuse_effects_a_trace_loses(
    model: nn.Module, example: tuple[Any, ...], kwargs: dict[str, Any], stable: StableAssignments,
) -> tuple[int, list[DrawingRegion]]:
    """Run the model eagerly in each mode, with gradients (hooks on tensors are registered only
    then), and refuse what a trace would lose (fxpipe/tracing/lost_effects.py); return how many
    hooks forward registered on tensors, and the regions of the model's own checkpointing that
    drew. Each run is told to `stable`, which keeps the plain values every run assigns alike. A
    model that does not run is left to the front ends, whose errors say why. Only a model small enough to run whole is run, as for the graph's check (on the
    CPU, under 1 GiB of parameters): a larger one, or one on the meta device, is not."""
    if is_on_meta(model) or not small_on_cpu(model, (example, kwargs)):
        return 0, []
    generators = _held_generators(model)
    before = [g.get_state() for _, g in generators]
    with outside_writes_refused(model, (example, kwargs)), rebound_buffers_refused(model), own_checkpoints_refused(model) as drew, \
            tensor_hooks_counted() as hooks, generators_drawn() as drawn:  # fmt: skip
        try:
            with torch.enable_grad():
                def run() -> None:
                    model(*example, **kwargs)
                    stable.ran()

                _in_both_modes_where_they_differ(model, run, stable)
        except Exception:  # noqa: BLE001 - the front ends say why the model does not run
            stable.ends.clear()
    seen = {id(d.generator()): d.where for d in drawn}  # (their states put back already)
    moved = [name for (name, g), state in zip(generators, before) if id(g) in seen or not torch.equal(g.get_state(), state)]
    for (_, g), state in zip(generators, before):
        g.set_state(state)
    held = {id(g) for _, g in generators}
    elsewhere = list(dict.fromkeys(where for key, where in seen.items() if key not in held))
    if moved or elsewhere:
        which = [
            *([f"torch.Generator objects it holds ({', '.join(moved)})"] if moved else []),
            *([f"a torch.Generator of its code's own, not torch's default (generator= at {'; '.join(elsewhere)})"] if elsewhere else []),
        ]  # fmt: skip
        raise TraceError(
            f"{type(model).__name__} cannot be compiled: its forward draws from {' and from '.join(which)}: a pipeline "
            "draws each micro-batch's numbers from a stream of its own, which a checkpointed micro-batch's recompute "
            "replays, and such a generator moves on with each draw instead.\nHow to fix: draw without generator= "
            "(every checkpoint mode then draws alike, from the step's seed: torch.manual_seed before a call makes it "
            "reproducible); or keep fixed noise in a buffer, drawn once in __init__."
        )
    return hooks.count, drew


def _held_generators(model: nn.Module) -> list[tuple[str, torch.Generator]]:
    """The torch.Generator objects the model's modules hold as attributes, by qualified name."""
    return [
        (f"{name}.{attribute}" if name else attribute, value)
        for name, module in model.named_modules() for attribute, value in vars(module).items() if isinstance(value, torch.Generator)
    ]  # fmt: skip


def _in_both_modes_where_they_differ(model: nn.Module, run: Callable[[], None], stable: StableAssignments) -> None:
    """`run()` in training mode, then in eval mode unless the training run shows that eval mode
    runs the same code: it read no module's `training` flag (no module overrides `train()`, which
    could change more than the flags), and it left every attribute and container as it found them
    (a cache filled by the first run sends the second down another path)."""
    with in_mode(model, True), flag_reads_counted(model) as flags:
        run()
    if flags.none and stable.left_as_found() and all(type(m).train is nn.Module.train for m in model.modules()):
        return
    with in_mode(model, False):
        run()


def refuse_draws_torch_recomputes(model: nn.Module, traced: Traced, drew: list[DrawingRegion]) -> None:
    """`checkpointed_draws`, with the modules the graphs call whole: refused for a model compiled
    in training mode; one compiled in eval mode, which draws nothing, refuses calls in training
    mode (`eval_only`)."""
    problem = checkpointed_draws(model, drew, _called_whole(traced)) if drew else ""
    if not problem:
        return
    if any(m.training for m in model.modules()):
        raise TraceError(f"{type(model).__name__} cannot be compiled: {problem}.\nHow to fix: {CHECKPOINTED_DRAWS_FIX}")
    traced.eval_only = traced.eval_only or f"in training mode {problem} ({CHECKPOINTED_DRAWS_FIX})"
