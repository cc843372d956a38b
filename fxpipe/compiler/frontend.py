"""Front ends: from a model to checked graphs, by torch.fx or, when fx fails, by torch.export."""
from __future__ import annotations

import inspect
import re
import warnings
from typing import Any, Callable, Iterable, Optional

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map_only

from fxpipe.compiled.materialize import is_on_meta
from fxpipe.compiled.program import Binder
from fxpipe.compiler.binding import leaf_binder, micro_batch_check, none_as_traced, signature_binder
from fxpipe.compiler.effects import (
    refuse_containers_filled_at_random, refuse_effects_a_trace_loses, refuse_lost_assignments, refuse_lost_counters,
    refuse_draws_torch_recomputes, refuse_reads_of_stored_tensors, warn_of_containers_left,
)
from fxpipe.compiler.traced import BOTH, Traced, in_both_modes, in_mode
from fxpipe.core.microbatch import Dims, batch_size_of
from fxpipe.core.model_hooks import weight_hooks, weight_hooks_refusal
from fxpipe.core.own_code import caller_stacklevel
from fxpipe.core.snapshot import preserved
from fxpipe.core.wording import listed
from fxpipe.passes.asserts import show_values_in_asserts
from fxpipe.passes.validate import check_graph, first_line, raising_line
from fxpipe.tracing.assignments import AssignmentError, StableAssignments, assignments_recorded
from fxpipe.tracing.attribute_reads import Reads, attribute_reads_recorded, values_of
from fxpipe.tracing.autograd_state_reads import autograd_state_reads
from fxpipe.tracing.context_watch import grad_mode_reads
from fxpipe.tracing.draws import drawn_message, traced_checking_draws
from fxpipe.tracing.export import batch_is_specialized, export_graph, hooks_export_runs_once
from fxpipe.tracing.functions import functions_applied
from fxpipe.tracing.layout_reads import layout_reads
from fxpipe.tracing.tensor_decisions import decisions_watched
from fxpipe.tracing.mode_reads import ModeReads, mode_reads_recorded
from fxpipe.tracing.seeding import generators_held, refuse_seeding, seeding_recorded
from fxpipe.tracing.trace import UNKNOWN_TYPE_FIX, LeafSpec, TraceError, trace, unknown_type


# The hooks torch.nn.utils registers on a module: pruning's methods, and the hook forms of
# spectral_norm and weight_norm (named by their classes in `hooks_export_runs_once`).
_TORCH_WEIGHT_HOOKS = re.compile(r"SpectralNorm|WeightNorm|Unstructured|Structured|PruningContainer|CustomFromMask|Identity")


class _Rejected(Exception):
    """A front end's graph cannot be used: `detail` for the error, `summary` for a warning, and
    `fix` where the reason has a fix of its own."""

    def __init__(self, detail: str, summary: Optional[str] = None, fix: str = "") -> None:
        super().__init__(detail)
        self.detail, self.summary, self.fix = detail, summary or detail, fix


def _traced_in_modes(model: nn.Module, read: Reads, traced: Callable[[], fx.GraphModule], traced_in: tuple[bool, ...]) -> dict[bool, fx.GraphModule]:
    """`in_both_modes(model, traced, traced_in)`, but the training trace serves eval mode where
    nothing in it can differ there: it read no module's `training` flag, and setting the mode sets
    the flags alone (no module overrides `train()`). Tracing twice is most of compiling's time."""
    if traced_in != BOTH:
        return in_both_modes(model, traced, traced_in)
    with in_mode(model, True):
        graph = traced()
    if read.flags_read[True] == 0 and all(type(m).train is nn.Module.train for m in model.modules()):
        read.same_in_eval()
        return {True: graph, False: graph}
    with in_mode(model, False):
        return {True: graph, False: traced()}


def _check(
    model: nn.Module, graphs: dict[bool, fx.GraphModule], example: tuple[Any, ...], kwargs: dict[str, Any], bind: Binder,
    modes: tuple[bool, ...] = BOTH,
) -> Optional[str]:
    """What goes wrong when each graph runs in its mode (of `modes`) next to the model, or None."""
    inputs = tuple(bind(example, kwargs).values())
    for training in modes:
        gm = graphs[training]
        if not training and True in modes and gm.code == graphs[True].code:
            continue  # the same code as the training graph, checked already
        with in_mode(model, training):
            try:
                problem = check_graph(model, gm, example, inputs, kwargs)
            except Exception:  # the model itself fails on the example (the graph's failures are problems)
                refuse_an_example_the_model_refuses(model, example, kwargs)
                raise
        if problem is not None:
            return f"its graph (traced in {'training' if training else 'eval'} mode) {problem}"
    return None


def _traced(graphs: dict[bool, fx.GraphModule], bind: Binder, read: Reads, modes: ModeReads) -> Traced:
    same = graphs[False].code == graphs[True].code
    return Traced(graphs[True], bind, eval_graph=None if same else graphs[False], reads=read, modes_read=modes)


def _assigning_modules(error: TraceError) -> list[str]:
    """The submodules whose forward assigned attributes while traced (none if the root did)."""
    cause = error.__cause__
    modules = cause.modules if isinstance(cause, AssignmentError) else []
    return [] if "" in modules else modules


def none_in(model: nn.Module, example: tuple[Any, ...], kwargs: dict[str, Any]) -> frozenset[str]:
    """The forward's arguments the example leaves None, given so or by default."""
    try:
        bound = inspect.signature(model.forward).bind(*example, **kwargs)
    except (TypeError, ValueError):  # the trace says what is wrong
        return frozenset()
    bound.apply_defaults()
    return frozenset(name for name, value in bound.arguments.items() if value is None)


def _by_fx(model: nn.Module, example: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[LeafSpec], traced_in: tuple[bool, ...] = BOTH) -> Traced:
    none = none_in(model, example, kwargs)
    try:
        with attribute_reads_recorded(model) as read, autograd_state_reads(model, read), mode_reads_recorded(model) as modes:
            def traced() -> fx.GraphModule:
                read.begin(model.training)
                with decisions_watched(read) as decisions:
                    gm = show_values_in_asserts(trace(model, leaves, none=none))
                    decisions.constants_in(gm)
                    return gm

            graphs = _traced_in_modes(model, read, traced, traced_in)
        refuse_lost_counters(model, read)
    except TraceError as error:
        # A submodule that stores attributes in forward is called whole: its assignments run. So
        # is one whose forward calls a function that takes real tensors only (einops, packing).
        named: list[Optional[str]] = [*_assigning_modules(error)] or [error.whole]
        wholes = [w for w in named if w is not None and w not in leaves]
        if not wholes:  # none, or none that is not called whole already
            raise _Rejected(str(error), first_line(error.__cause__ or error)) from error
        return _by_fx(model, example, kwargs, [*leaves, *wholes], traced_in)
    binder = signature_binder(graphs[True], model)
    bind = none_as_traced(binder, binder(example, kwargs), graphs[True])
    if _check(model, graphs, example, kwargs, bind, traced_in) is None:
        return _traced(graphs, bind, read, modes)
    # Again with source lines, which tracing records only for messages (it is slow).
    lined = in_both_modes(model, lambda: trace(model, leaves, record_lines=True, none=none), traced_in)
    raise _Rejected(_check(model, lined, example, kwargs, bind, traced_in) or "its graph computes otherwise than the model")


def _cache_fix(model: nn.Module, error: Exception, kwargs: dict[str, Any]) -> str:
    """A language model returning its key/value cache: how to turn the cache off; or, where it is
    off and the model returns one all the same (peft's prefix tuning), how to leave it out."""
    if "Cache" not in str(error):
        return ""
    if getattr(getattr(model, "config", None), "use_cache", False) and kwargs.get("use_cache") is not False:
        return (
            "How to fix: the model returns its key/value cache, which a pipeline cannot carry; compile the "
            "model with model.config.use_cache = False, or with use_cache=False in example_kwargs."
        )
    if not unknown_type(str(error)):
        return ""
    return (
        "How to fix: the model returns a key/value cache with use_cache off (as peft's prefix tuning does), which a "
        "pipeline cannot carry; compile a module that calls the model and returns what is needed of its output "
        "(`return self.model(*args, **kwargs).logits`)."
    )


def _unaliased(example: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The example with a copy in place of each tensor given a second time (`labels=input_ids`):
    export would make one input of both, and the graph would read one for the other."""
    seen: set[int] = set()

    def once(t: torch.Tensor) -> torch.Tensor:
        if id(t) in seen:
            return t.clone()
        seen.add(id(t))
        return t

    return tree_map_only(torch.Tensor, once, (example, kwargs))  # type: ignore[no-any-return]


def _exported(model: nn.Module, example: tuple[Any, ...], kwargs: dict[str, Any], dims: Dims) -> tuple[fx.GraphModule, Any]:
    """torch.export's graph, refused where draws made in Python decide it (fxpipe/tracing/draws.py)."""
    made, decided = traced_checking_draws(lambda: export_graph(model, example, kwargs, dims), lambda made: made[0])
    if decided:
        raise TraceError(drawn_message(type(model).__name__, "torch.export"))
    return made


def _functorch_levels(gm: fx.GraphModule) -> list[str]:
    """The torch.func transforms (vmap, grad, jvp) whose levels the graph enters."""
    names = (getattr(node.target, "__name__", "") for node in gm.graph.nodes if node.op == "call_function")
    return [name.removeprefix("_").removesuffix("_increment_nesting") for name in names if name.endswith("_increment_nesting")]


def _by_export(
    model: nn.Module, example: tuple[Any, ...], kwargs: dict[str, Any], chunks: int, dims: Dims, traced_in: tuple[bool, ...] = BOTH,
) -> Traced:
    given = tree_leaves((example, kwargs))
    example, kwargs = _unaliased(example, kwargs)
    dims = {id(now): dims[id(was)] for was, now in zip(given, tree_leaves((example, kwargs))) if id(was) in dims}  # (copies too)
    functions: list[type] = []
    try:
        with functions_applied(functions), attribute_reads_recorded(model) as read, autograd_state_reads(model, read), \
                mode_reads_recorded(model) as modes, layout_reads() as layout:  # fmt: skip
            def exported_now() -> tuple[fx.GraphModule, Any]:
                read.begin(model.training)
                return _exported(model, example, kwargs, dims)

            exported = in_both_modes(model, exported_now, traced_in)
        refuse_lost_counters(model, read)
    except TraceError as error:  # a value forward assigns, which the graph would hold
        detail, _, fix = str(error).partition("\nHow to fix: ")
        raise _Rejected(detail, first_line(error), f"How to fix: {fix}") from error
    except Exception as error:
        at = raising_line(error)
        raise _Rejected(first_line(error) + (f"\n  - at {at}" if at else ""), first_line(error), _cache_fix(model, error, kwargs)) from error
    if functions:
        names = ", ".join(sorted({f.__qualname__ for f in functions}))
        checkpoint = "torch.utils.checkpoint's reentrant Function: use_reentrant=False (Hugging Face: gradient_checkpointing_kwargs=" \
            "{'use_reentrant': False}), which torch.export goes through, or the pipeline's checkpoint= in its place; " \
            if any(f.__qualname__ == "CheckpointFunction" for f in functions) else ""  # fmt: skip
        if any(f.__qualname__ == "CondAutogradOp" for f in functions):  # torch.cond's own
            checkpoint = "for torch.cond: move it into a submodule kept whole (leaf_modules=[...]), where it runs as it is; "
        raise _Rejected(
            f"it inlines the forward of the autograd Function {names}, which would lose its backward; "
            f"{checkpoint}make the model traceable by torch.fx, which keeps the Function's call (and keeps a module "
            "whole with leaf_modules=[...], which torch.export cannot)"
        )
    graphs = {training: gm for training, (gm, _) in exported.items()}
    transforms = sorted({name for gm in graphs.values() for name in _functorch_levels(gm)})
    if transforms:
        raise _Rejected(
            f"it applies torch.func transforms in forward ({', '.join(transforms)}), whose levels its graph holds as "
            "calls that must run in their order, on one thread, around the calls they transform: a stage cannot "
            "keep that",
            fix="How to fix: move the transformed call into a submodule and keep that whole (leaf_modules=[...], "
            "with torch.fx): a module kept whole runs its own forward, transforms included.",
        )
    if chunks > 1 and any(batch_is_specialized(gm) for gm in graphs.values()):
        if batch_size_of([*example, *kwargs.values()]) == 1:
            raise _Rejected(
                "it fixes every dim of size 1 to that size, so from an example of one sample it makes a graph for "
                "one sample alone, and micro-batches of other sizes cannot run",
                fix="How to fix: give an example of two samples or more (torch.fx, which reads sizes as it runs, "
                "takes one), or use chunks=1.",
            )
        raise _Rejected(
            "it fixed the batch size to the example's (the model's code depends on it), so micro-batches "
            "of other sizes cannot run",
            fix="How to fix: use chunks=1, or avoid Python code that depends on the batch size (shapes "
            "computed from x.shape[0], asserts on it); or make the model traceable by torch.fx, which "
            "reads sizes as it runs.",
        )
    bind = leaf_binder(graphs, exported[True][1], model, tree_flatten((example, kwargs))[0], layout_read=bool(layout))
    problem = _check(model, graphs, example, kwargs, bind, traced_in)
    if problem is not None:
        raise _Rejected(problem)
    traced = _traced(graphs, bind, read, modes)
    traced.check_micro_batch = micro_batch_check(model, graphs, exported[True][1])
    traced.grad_mode_only = {training: gm.meta["grad_mode_only"] for training, gm in graphs.items() if gm.meta.get("grad_mode_only")}
    return traced


def to_graph(
    model: nn.Module, example: tuple[Any, ...], leaf_modules: Iterable[LeafSpec], chunks: int, kwargs: Optional[dict[str, Any]] = None,
    dims: Optional[Dims] = None,
) -> Traced:
    """Trace with torch.fx; when that fails, export; when both fail, one error with both reasons.

    Each graph is traced in training and in eval mode, and checked against the model on the
    example (passes/validate.py): a graph that computes otherwise counts as a failure of its front
    end. The model's state and the random states are left as they were.
    """
    leaves = list(leaf_modules)
    if isinstance(model, fx.GraphModule) or not isinstance(model, nn.Module):
        gm = trace(model, leaves)  # traced already: the graph is the model
        return Traced(gm, signature_binder(gm))
    kwargs = kwargs or {}
    hooked = weight_hooks(model)
    if hooked:  # (before tracing: its assignment fails either front end, each in words of its own)
        raise TraceError(f"{type(model).__name__} cannot be compiled: {weight_hooks_refusal(hooked)}")
    with preserved(model):
        with StableAssignments(model) as stable:
            hooks, drew = refuse_effects_a_trace_loses(model, example, kwargs, stable)
        try:
            with assignments_recorded(model) as changed, seeding_recorded() as seeded:
                try:
                    traced = _in_its_modes(model, example, kwargs, leaves, chunks, hooks, dims or {})
                except TraceError:  # a graph that computes otherwise, for a forward that seeds what it draws from
                    refuse_seeding(seeded, [])
                    raise
            graphs = [traced.graph, *([traced.eval_graph] if traced.eval_graph is not None else [])]
            refuse_seeding(seeded, [name for gm in graphs for name in generators_held(gm)])
            refuse_lost_assignments(model, traced, changed)
            refuse_reads_of_stored_tensors(model, traced, stable)
            refuse_draws_torch_recomputes(model, traced, drew)
        except BaseException:
            stable.undo()
            raise
    if stable.filled:
        refuse_containers_filled_at_random(model, example, kwargs)
    traced.stored_with_grad = stable.differentiable
    if traced.reads is not None:
        traced.attributes = values_of(model, traced.reads)
    warn_of_containers_left(model, traced, stable.filled)
    return traced


def refuse_an_example_the_model_refuses(model: nn.Module, example: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """When neither front end captures the model, or its graph fails on the example: whether the
    model itself runs on the example (a float32 example for a float64 model, an inference tensor
    forward writes in place), which no graph of it could then."""
    if is_on_meta(model):  # shapes only: a check of values fails there, and is not the example's fault
        return
    try:
        with torch.no_grad():
            model(*example, **kwargs)
    except Exception as e:  # noqa: BLE001 - named in the refusal
        _refuse_a_forward_that_needs_gradients(model, example, kwargs, e)
        raise ValueError(
            f"{type(model).__name__} does not run on the example: {type(e).__name__}: {e}\n"
            "How to fix: give compile_pipeline an example the model takes as it is: model(*example) must run "
            "(the same dtype and device as the model's parameters, the shapes forward expects)."
        ) from e


def _refuse_a_forward_that_needs_gradients(model: nn.Module, example: tuple[Any, ...], kwargs: dict[str, Any], error: Exception) -> None:
    """A model that fails on the example under torch.no_grad() and runs with gradients (a hook
    registered on a tensor that then does not require grad): say so, and how to fix it."""
    try:
        with torch.enable_grad(), preserved(model):
            model(*example, **kwargs)
    except Exception:  # noqa: BLE001 - it does not run at all: the example's refusal says so
        return
    raise ValueError(
        f"{type(model).__name__} runs on the example only with gradients on: under torch.no_grad() it raises "
        f"{type(error).__name__}: {first_line(error).partition(': ')[2]}\nA pipeline checks its graph, and runs "
        "checkpointed forwards, without gradients.\nHow to fix: let forward compute the same values under "
        "torch.no_grad() too: a derivative it takes (torch.autograd.grad in forward) under `with torch.enable_grad():`, "
        "a hook registered on a tensor only `if h.requires_grad:` (a hook changes no forward value); never a branch "
        "on torch.is_grad_enabled() that computes otherwise. And for a hook, keep the module that registers it whole "
        "too (leaf_modules=[...]), so that it is registered as the module runs: a trace holds no hook, and cannot "
        "follow `if h.requires_grad:`. Both together."
    ) from error


def _grad_mode_read(model: nn.Module, example: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """Where the model's code reads torch.is_grad_enabled() in a run without gradients, as the
    graph's check runs it; the model's state and the random states are left as they were."""
    with preserved(model), torch.no_grad(), grad_mode_reads() as read:
        try:
            model(*example, **kwargs)
        except Exception:  # noqa: BLE001 - the front ends' reasons say why it fails
            pass
    return read


def _swapped_parameters(model: nn.Module) -> list[str]:
    """The names in the model's parameter tables that hold a tensor that is no Parameter."""
    return [f"{path}.{name}" if path else name for path, module in model.named_modules()
            for name, t in module._parameters.items() if t is not None and not isinstance(t, nn.Parameter)]  # fmt: skip


def _fix_for(export_failure: _Rejected, fx_failure: _Rejected, grad_mode_read: Callable[[], list[str]]) -> str:
    """How to fix a model neither front end captures: the fix of torch.export's reason where it
    has one (a key/value cache returned), else what stops both most often (control flow on
    values), unless the reason asks for torch.fx (an autograd Function), where torch.fx's reason
    says what stops it. leaf_modules needs torch.fx: a forward it cannot trace (one that takes
    **kwargs) is told so. `grad_mode_read`: where the model's code reads the grad mode."""
    global_hooks = nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks
    if global_hooks and "computes otherwise" in fx_failure.detail:
        return (
            "How to fix: global forward hooks are registered (nn.modules.module.register_module_forward_hook or "
            "register_module_forward_pre_hook): one that changes what a module computes runs inside the trace and "
            "again where the stages call modules, and never around the model itself. Remove it (handle.remove()) and "
            "register it on the modules it is meant for (module.register_forward_hook) before compiling."
        )
    read = grad_mode_read() if "computes otherwise" in fx_failure.detail + export_failure.detail else []
    if read:
        return (
            f"How to fix: its forward reads torch.is_grad_enabled() ({listed(list(dict.fromkeys(read)), most=3)}), and a "
            "pipeline checks its graph, and runs checkpointed forwards, without gradients: let forward compute the same "
            "values either way (a branch on it that only registers a hook, `if h.requires_grad:`, changes no value)."
        )
    if export_failure.fix or "make the model traceable by torch.fx" in export_failure.detail:
        return export_failure.fix
    if "Inference tensors cannot be saved for backward" in export_failure.detail:
        return (
            "How to fix: the example holds tensors made under torch.inference_mode(), on which torch.export records no "
            "gradient outside it: compile under torch.inference_mode() too (a pipeline compiled so serves calls without "
            "gradients), or give an example made outside it (x.clone() there)."
        )
    if any(reason in fx_failure.detail for reason in ("cannot keep such an attribute up to date", "switches gradients", "enters torch.inference_mode",
                                                     "writes parameters or buffers on their values")):  # fmt: skip
        return ""  # torch.fx's reason (an assignment forward makes, a grad mode it sets) says how to fix it
    if unknown_type(export_failure.detail):
        return UNKNOWN_TYPE_FIX
    if "needs each input named" in fx_failure.detail:
        return (
            "How to fix: write the branch as tensor operations (torch.where), or turn off "
            "what takes it (a random layer drop, say), or compile the model in eval mode to run it there; or name "
            "forward's arguments, so that torch.fx traces the model, and keep the module with the branch whole "
            "with leaf_modules=[...]."
        )
    return (
        "How to fix: keep the module with data-dependent control flow (or with checks that "
        "a traced value fails, such as torch.jit.isinstance) whole with leaf_modules=[...], "
        "(torch.cond runs there), or write the branch as tensor operations (torch.where)."
        + (_ROOT_FIX if _IN_ROOT in fx_failure.detail else "")
    )


_IN_ROOT = "in module: the root module"
_ROOT_FIX = " The model's own forward is never kept whole: move that code into a submodule, and keep the submodule whole."


def _in_its_modes(
    model: nn.Module, example: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[LeafSpec], chunks: int, hooks: int, dims: Dims,
) -> Traced:
    """Traced in both modes; or, for a model compiled in eval mode whose training forward
    neither front end can capture (a layer drop, a mask drawn with numpy), in eval mode alone:
    the pipeline then refuses calls in training mode, saying why."""
    try:
        return _front_ends(model, example, kwargs, leaves, chunks, hooks, dims)
    except TraceError as error:
        if any(m.training for m in model.modules()):
            raise
        try:
            traced = _front_ends(model, example, kwargs, leaves, chunks, hooks, dims, traced_in=(False,))
        except TraceError as in_eval:  # what stops eval mode, where the model is: the training failure aside
            in_eval.add_note(f"(Traced in training mode too, for pipe.train(): {str(error).partition(chr(10))[0]} {_first_reasons(error)})")
            raise in_eval from None
        traced.eval_only = str(error).partition("\nHow to fix")[0]
        why = traced.eval_only.splitlines()[0]
    note = f"{type(model).__name__} is compiled for eval mode alone: in training mode, {why} A call in training mode is refused."
    traced.note = f"{traced.note}; {note}" if traced.note else note
    warnings.warn(note, stacklevel=caller_stacklevel())
    return traced


def _first_reasons(error: TraceError) -> str:
    """The first line of each front end's reason in `error`, as 'torch.fx: ...; torch.export: ...'."""
    return "; ".join(line for line in str(error).splitlines() if line.startswith(("torch.fx: ", "torch.export: ")))


def _front_ends(
    model: nn.Module, example: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[LeafSpec], chunks: int, hooks: int, dims: Dims,
    traced_in: tuple[bool, ...] = BOTH,
) -> Traced:
    """torch.fx, then torch.export (refused where forward registers hooks on tensors, which it
    drops); one error with both reasons when both fail."""
    try:
        return _by_fx(model, example, kwargs, leaves, traced_in)
    except _Rejected as rejected:  # kept without its traceback, whose frames hold the trace's tensors
        fx_failure = _Rejected(rejected.detail, rejected.summary, rejected.fix)
    try:
        if hooks:
            raise _Rejected(
                "it drops the hooks forward registers on tensors (register_hook), and the gradients "
                "would miss what they do; torch.fx keeps them (and keeps a module whole with "
                "leaf_modules=[...], whose forward then runs as it is)"
            )
        swapped = _swapped_parameters(model)
        if swapped:
            raise _Rejected(
                f"it takes only nn.Parameters as parameters, and {listed(swapped, most=3)} "
                "hold other tensors (as torch.func.functional_call swaps them in)",
                fix="How to fix: make the call of this kind once outside functional_call (its stages are kept, and serve "
                "later calls inside it), or give it as the example when compiling (example_kwargs=...).",
            )
        once = hooks_export_runs_once(model)
        if once:
            raise _Rejected(
                f"it would run the model's hooks once, while capturing it, and never at a call: {', '.join(once)}",
                fix="How to fix: make the model traceable by torch.fx, which calls a module with hooks whole at every "
                "call; or remove those hooks (handle.remove()) before compiling."
                + (" Those of torch.nn.utils are removed by its own functions, not handle.remove(), which would leave "
                   "the weight the hook last computed: prune.remove(module, 'weight') makes a pruned weight permanent; "
                   "torch.nn.utils.parametrizations.spectral_norm and weight_norm, which torch.export captures, replace "
                   "the hook forms." if any(_TORCH_WEIGHT_HOOKS.search(hook) for hook in once) else "")
                + (" Hugging Face's gradient_checkpointing_enable() registers make_inputs_require_grads: "
                   "model.disable_input_require_grads() removes it (gradient_checkpointing_disable() may not); the "
                   "model's own checkpointing with use_reentrant=False may stay, or the pipeline's checkpoint= "
                   "recomputes stages in its place." if any("make_inputs_require_grads" in hook for hook in once) else ""),
            )
        traced = _by_export(model, example, kwargs, chunks, dims, traced_in)
    except _Rejected as export_failure:
        refuse_an_example_the_model_refuses(model, example, kwargs)
        raise TraceError(
            f"neither torch.fx nor torch.export can capture {type(model).__name__}.\n"
            f"torch.fx: {fx_failure.detail}\n"
            f"torch.export: {export_failure.detail}\n"
            f"{_fix_for(export_failure, fx_failure, lambda: _grad_mode_read(model, example, kwargs))}".rstrip()
        ) from export_failure.__cause__
    traced.note = f"torch.fx could not trace {type(model).__name__} ({fx_failure.summary}); used torch.export" + (
        ", which keeps no module whole: leaf_modules has no effect" if leaves else ""
    )
    traced.fx_failure = fx_failure.summary
    warnings.warn(traced.note, stacklevel=caller_stacklevel())
    return traced
