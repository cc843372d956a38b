"""Checks at each call: that the model is still what was traced (its modules, their code and
hooks, the attributes and modes the trace read, the autocast it asked about), and that the call
is one a pipeline can run (not captured, not inside a parametrization cache, no hooks on itself,
a loop's batch with gradients on)."""
from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.fx
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.utils import parametrize
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves

from fxpipe.compiled.program import Compiled, Program, first_floating_dtype
from fxpipe.core.attrs import buffer_or_none, submodule_or_none, tensor_held
from fxpipe.core.hooks import GLOBAL_BACKWARD_HOOKS, KINDS, global_backward_hooks, hook_tables
from fxpipe.core.own_code import caller_stacklevel
from fxpipe.core.own_forward import in_the_models_own_call
from fxpipe.core.wording import listed
from fxpipe.tracing.mode_reads import autocast_alone, modes_changed

F = TypeVar("F", bound=Callable[..., Any])


def _cast_since(owner: nn.Module, compiled: Compiled) -> str:
    """'from float32 to float64' where the model was cast since compiling and the graph torch.fx
    traced holds the dtype it had; '' otherwise."""
    before = compiled.traced_dtype
    if before is None or before not in compiled.graph_dtypes or compiled.front_end != "torch.fx":
        return ""  # (an exported graph's binder compiles stages for the model as it is now)
    now = first_floating_dtype(owner)
    return f"from {before} to {now}" if now is not None and now != before else ""


def traced_mode(owner: nn.Module, programs: dict[bool, Program], compiled: Compiled) -> bool:
    """The mode whose graph runs now (training's or eval's); refused, saying why and what to do,
    where the model holds another module, a traced-through module's code or hooks changed, or an
    attribute the trace read did, whose forward or values the graph may not hold."""
    # Replaced modules first: one that read its mode is out of pipe.train()'s reach, and its
    # stale mode would be blamed.
    replaced = programs[True].held.modules_replaced()
    if replaced:
        raise RuntimeError(
            f"modules of the model were replaced or removed since compiling: {', '.join(replaced)}. The graph holds what "
            "the modules there computed when it was traced.\nHow to fix: compile the model again."
        )
    split = _aliases_apart(owner, compiled.aliased_buffers)
    if split:
        raise RuntimeError(
            f"buffers that were one tensor under several names when compiling now hold different tensors: {', '.join(split)}. "
            "The graph reads that tensor under one of the names, and would not see the others' new tensors.\nHow to "
            "fix: compile the model again after rebinding them (or keep them one tensor)."
        )
    untied = _untied(owner, compiled.tied_parameters, across=compiled.placement is not None)
    if untied:
        raise RuntimeError(
            f"names that held one parameter when compiling (a tied weight, or a buffer registered on it) now hold "
            f"different tensors: {', '.join(untied)}. The stages read that tensor under one of the names, and would not see the "
            "others' new tensors.\nHow to fix: compile the model again after untying them; or keep them tied "
            "(torch.func.functional_call(..., tie_weights=True), its default, hands every name of a tied weight the same "
            "tensor; load_state_dict without assign=True copies into the tied weight)."
        )
    rewritten = programs[True].code_changed()
    forward_replaced = bool(rewritten) and programs[True].model_code_replaced()
    if forward_replaced and in_the_models_own_call(owner):
        # The model's forward, replaced since, calls the pipeline (model.generate() on it, say),
        # which runs the forward it traced: the one the replacement stands in for.
        rewritten = programs[True].code_changed(but_the_model=True)
    if rewritten:
        ours = " If the model's new forward calls this pipeline (so that model(x) or model.generate() runs on it), call " \
               "the model: called from the model's own call, the pipeline runs the forward it traced (put that forward back " \
               "around a train_step, which calls no model). A copy of the model (copy.deepcopy, an EMA or a teacher) whose " \
               "forward calls this pipeline would run the original's weights: compile a pipeline of the copy." if forward_replaced else ""
        raise RuntimeError(
            f"the code of modules the trace went through changed since compiling: {'; '.join(rewritten)}. The graph "
            f"holds what their code computed when it was traced (one pass over a container's members).{ours}\nHow to fix: "
            "compile the model again after changing them"
            + _or_kept_whole(compiled, ", or keep such modules whole (compile_pipeline(..., leaf_modules=[...])): a "
                             "module kept whole runs its own code on every call") + "."
        )
    settings = programs[True].settings_changed()
    if settings:
        raise RuntimeError(
            f"settings of modules the graph calls whole changed since compiling: {', '.join(settings)}. Compiling "
            "planned the stages by them (which values are copied before a module writes them in place, whether "
            "micro-batches may split the batch a module sees, which weights forward writes).\nHow to fix: compile "
            "the model again after changing them."
        )
    cast = _cast_since(owner, compiled)
    if cast:
        raise RuntimeError(
            f"the model was cast {cast} since compiling (or holds tensors of that dtype that torch.func.functional_call "
            f"swapped in), and the graph holds {compiled.traced_dtype} where the trace read it (the model's own dtype, "
            "`self.dtype`, say, or a dtype its code names): its stages would still compute in it, where the plain model "
            "follows its new dtype.\nHow to fix: compile the model again after casting it (or cast it before compiling; "
            "a pipeline for each dtype it runs in)."
        )
    mode = _mode(owner.training, programs[True].held.named, compiled.flags)
    if compiled.eval_only and (mode or owner.training):
        raise RuntimeError(
            f"this pipeline was compiled for eval mode alone, and it is called in training mode (or with modules in "
            f"it): {compiled.eval_only}\nHow to fix: call it in eval mode (pipe.eval(), every module); to "
            "train, make the training forward traceable and compile again."
        )
    only = compiled.grad_mode_only.get(mode)
    if only is not None and only[0] != torch.is_grad_enabled():
        enabled, why = only
        then, now = ("with gradients on", "under torch.no_grad()") if enabled else ("under torch.no_grad()", "with gradients on")
        problem, _, fix = why.partition("\nHow to fix: ")
        raise RuntimeError(
            f"this pipeline was compiled {then}, and its graph for {'training' if mode else 'eval'} mode serves calls made so "
            f"alone; this one is made {now}: {problem}\n"
            f"How to fix: call it {then}; or {fix[:1].lower()}{fix[1:]}"
        )
    program = programs[mode]
    attributes = program.held.attributes_changed(compiled.attributes_read.get(mode, frozenset()))
    if attributes:
        whole = _or_kept_whole(compiled, ", or in a module kept whole (leaf_modules=[...]), which reads its own attributes as it runs")
        raise RuntimeError(
            f"attributes the graph read when it was traced have changed since compiling: {listed(attributes, most=5)}. "
            "The graph holds the values they had then.\nHow to fix: compile again after changing them; a value "
            "meant to change between calls belongs in a buffer (self.register_buffer(name, torch.tensor(value))), "
            f"which the pipeline reads as it runs{whole}.{_norm_momentum_hint(owner, attributes)}{_autograd_state_hint(attributes)}"
        )
    changed = program.hooks_changed()
    if "*" in changed and global_backward_hooks():
        raise RuntimeError(GLOBAL_BACKWARD_HOOKS)
    if "*" in changed:
        modes = _modes_entered()
        by_mode = (
            f" The call runs under {', '.join(modes)}: a mode that tracks modules (FlopCounterMode does) adds such "
            "hooks while it is entered; enter it around the plain model."
        ) if modes else ""
        raise RuntimeError(
            "global module hooks (nn.modules.module.register_module_forward_hook, ...) were added or removed "
            "since compiling: the graph holds what they did then, on every module the trace went through.\n"
            "How to fix: compile again after registering them." + by_mode
        )
    if changed:
        added = program.hooks_added_by()
        libraries = [name for name in added if name != "__main__"]
        origin = f" (the hooks added are defined in {', '.join(added)})" if added else ""
        first_call = (
            " If a library added them on a call with some option (transformers adds hooks that record outputs on "
            "the first call with output_attentions=True or output_hidden_states=True), make such a call of the "
            "model once before compiling, so that they are there when it is traced."
        ) if libraries else ""
        raise RuntimeError(
            f"hooks were added to, removed from or swapped on {', '.join(changed)} "
            f"since compiling{origin}: the trace went through these modules, and their graph holds what their "
            f"hooks did then.\nHow to fix: compile again"
            + _or_kept_whole(compiled, f", or keep such modules whole (compile_pipeline(..., leaf_modules={changed!r})), "
                             "whose hooks run on every call") + "." + first_call
        )
    return mode


def refuse_other_autocast(compiled: Compiled) -> None:
    """A forward that asked whether autocast is on (to upcast, say) was answered once, when
    traced: a call under another autocast would run the other answer's graph."""
    changed = modes_changed(compiled.modes_read)
    if changed:
        about, state = ("autocast", "the autocast") if autocast_alone(changed) else ("its state", "the state")
        raise RuntimeError(
            f"the model's forward asks torch about {about}, and the answers differ from when it was traced: "
            f"{'; '.join(changed)}. The graph holds the answers it got then.\nHow to fix: compile the model "
            f"under {state} it runs under (a pipeline for each)"
            + _or_kept_whole(compiled, ", or keep the module that asks whole (leaf_modules=[...]), which asks as it runs") + "."
        )


def _or_kept_whole(compiled: Compiled, advice: str) -> str:
    """`advice` to keep a module whole, where the graph came from torch.fx: torch.export keeps no
    module whole, whatever leaf_modules says."""
    return advice if compiled.front_end == "torch.fx" else ""


def refuse_moved_stages(program: Program, across: bool) -> None:
    """Stages whose parameters live elsewhere than the plan placed them (the model itself moved
    since compiling: `model.to(device)`, `model.cuda()`; `pipe.to(device)` is refused): refused,
    naming each, before a stage fails on a tensor of the wrong device. Across processes, the
    stages of other ranks hold no memory here (the meta device)."""
    moved = [
        f"stage {stage.index}'s on {stage.params[0].device} (placed on {stage.device})" for stage in program.stages
        if stage.params and stage.params[0].device != stage.device and not (across and stage.params[0].is_meta)
    ]  # fmt: skip
    if moved:
        raise RuntimeError(
            f"the model's parameters were moved since compiling: {', '.join(moved)}. Each stage runs on the device the "
            "plan placed it on.\nHow to fix: move them back (model.to(...) as before), or compile the model again with "
            "devices=[...] that place its stages where you want them."
        )


def _aliases_apart(owner: nn.Module, groups: list[list[str]]) -> list[str]:
    """Of the buffers that were one tensor under several names, those whose names now hold
    different values (different tensors of one value, as after `model.double()`, are alike)."""
    apart = []
    for names in groups:
        held = [buffer_or_none(owner, name) for name in names]
        if any(t is not held[0] for t in held) and not all(
            isinstance(t, torch.Tensor) and isinstance(held[0], torch.Tensor) and t.shape == held[0].shape and torch.equal(t, held[0]) for t in held
        ):
            apart.append(" and ".join(names))
    return apart


def _untied(owner: nn.Module, groups: list[list[str]], across: bool) -> list[str]:
    """Of the tied weights' names, those now holding different tensors (untied, one name swapped
    by functional_call, a buffer registered on the weight rebound). Under a parametrization
    registered since, a name holds the original it computes from. Across processes load_state_dict(assign=True) unties them as
    the plain model does, each rank keeping the copies its stages read: refused only where one
    rank holds two of them."""
    found = []
    for names in groups:
        held = [tensor_held(owner, name) for name in names]
        if across:
            held = [t for t in held if t is not None and t.device.type != "meta"]
        if len({id(t) for t in held}) > 1:
            found.append(" and ".join(names))
    return found


def _mode(training: bool, named: dict[str, nn.Module], traced: dict[bool, dict[str, bool]]) -> bool:
    """Whose graph runs now: training's or eval's. Each holds what the `training` flags its
    trace read decided (a module set apart in eval mode when compiling, say): the graph of the
    model's mode if the modules hold those flags now, else the other's if they hold its."""
    for mode in (training, not training):
        if all(named[path].training == flag for path, flag in traced.get(mode, {}).items() if path in named):
            return mode
    apart = [f"{path or 'the model'} in {'eval' if flag else 'training'} mode"
             for path, flag in traced.get(training, {}).items() if path in named and named[path].training != flag]  # fmt: skip
    # A whole pipeline in one mode runs where a graph was traced with every module read in it.
    uniform = [call for flag, call in ((True, "pipe.train()"), (False, "pipe.eval()"))
               if any(traced.get(mode) and all(f == flag for f in traced[mode].values()) for mode in (True, False))]  # fmt: skip
    whole = f", or the whole pipeline in one mode ({' or '.join(uniform)})" if uniform else ""
    raise RuntimeError(
        f"the model's forward reads `self.training`, and no graph was traced with its modules in the modes they "
        f"are in: {', '.join(apart)} now, where the {'training' if training else 'eval'} graph has them in the "
        f"other.\nHow to fix: put those modules back in the modes they had when compiling{whole}, or compile the "
        "model in the modes it runs in."
    )


def refuse_capture(*values: Any) -> None:
    """A call while torch.jit.trace or torch.export captures it, or given torch.fx's proxies of
    `values` (before any state is read)."""
    if torch.compiler.is_exporting() and torch.compiler.is_dynamo_compiling():
        _refused_capture()  # strict export: where torch says why it stops (a raise here it would bury)
    if torch.jit.is_tracing() or torch.compiler.is_exporting() or any(isinstance(v, torch.fx.Proxy) for v in tree_leaves(values)):
        raise RuntimeError(NOT_CAPTURED)


def refuse_outer_checkpoint() -> None:
    """A call inside torch.utils.checkpoint(..., use_reentrant=False): its saved-tensor hooks
    would recompute the pipeline from a stage's backward (a call from inside its own stages)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is not None and getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint":
        raise RuntimeError(
            "the pipeline is called inside torch.utils.checkpoint(..., use_reentrant=False), whose recompute in "
            "backward would run the pipeline again from inside its own stages' backward.\nHow to fix: let the "
            "pipeline checkpoint its stages itself (compile_pipeline(..., checkpoint='always'), which recomputes each "
            "micro-batch's forward in its backward), keep the pipeline out of the checkpointed function, or use "
            "torch.utils.checkpoint(..., use_reentrant=True), which runs the pipeline again as a call of its own."
        )


def warn_compiled_whole() -> None:
    """A call traced by torch.compile (`torch.compile(pipe)`) of a pipeline whose stages are eager:
    it runs them as they are."""
    warnings.warn(
        "torch.compile(pipe) runs the pipeline as it is, compiling none of it: its stages run on worker threads "
        "under the schedule, which torch.compile does not trace.\nHow to compile the stages: "
        "compile_pipeline(..., compile_stages=True), or a dict of torch.compile's options.",
        stacklevel=caller_stacklevel(),
    )


def refuse_modes_the_stages_would_miss(off_thread: bool) -> None:
    """A call under TorchFunctionModes or TorchDispatchModes (FlopCounterMode, `with
    torch.device(...)`, a mode of one's own), which PyTorch keeps per thread, where the stages
    run on threads of their own (`off_thread`): the modes would see none of their ops."""
    if not off_thread:
        return
    modes = _modes_entered()
    if modes:
        # A mode that tracks modules (FlopCounterMode) registers global module hooks, which a
        # pipeline on one device refuses too: that route is no fix for it.
        tracks = bool(nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)
        raise RuntimeError(
            f"this call runs under {', '.join(modes)}, which PyTorch keeps per thread: the pipeline's stages run "
            "on threads of their own, where the mode would see none of their ops, so the call would not compute "
            "(nor count) what the plain model does under it.\nHow to fix: enter the mode around the plain model"
            + (" (it tracks modules with global hooks, which a pipeline refuses on any device)." if tracks else
               "; or compile the pipeline for one device, whose pipe(x) and train_step run the stages on the calling "
               "thread, under the mode.")
        )


def _modes_entered() -> list[str]:
    """The TorchFunctionModes and TorchDispatchModes this thread is under, each named with its kind."""
    return [f"{type(m).__name__} (a TorchFunctionMode)" for m in _get_current_function_mode_stack()] + [
        f"{type(m).__name__} (a TorchDispatchMode)" for m in _get_current_dispatch_mode_stack()
    ]


def refuse_parametrization_cache() -> None:
    """A call inside `torch.nn.utils.parametrize.cached()`: the plain model computes each
    parametrized weight once for the block and differentiates through that one tensor; the
    stages, reading it per micro-batch on their workers (under no_grad where checkpointed),
    would share one computed for another micro-batch, and lose gradients or backward twice."""
    if parametrize._cache_enabled:
        raise RuntimeError(
            "a Pipeline cannot run inside torch.nn.utils.parametrize.cached(): its stages read each parametrized "
            "weight per micro-batch, and the cache would hand them one computed for another micro-batch (its "
            "gradient lost, or a backward through it run twice).\nHow to fix: call the pipeline outside the "
            "cached() block; the stages compute each parametrized weight as the plain model without the cache does."
        )


def refuse_own_hooks(pipe: nn.Module, caller: str = "train_step") -> None:
    """train_step (and train_steps) run the stages under their schedule without calling the
    pipeline as a module, nor the model: hooks registered on the pipeline itself, or on the model
    itself, would not run, where `pipe(x)` runs them."""
    held = []
    owner: nn.Module = pipe._owner  # type: ignore[assignment]
    for where, module in (("Pipeline itself", pipe), ("model itself", owner)):
        kinds = [kind + "s" for kind, table in zip(KINDS, hook_tables(module)) if table]
        if kinds:
            held.append(f"{', '.join(kinds[:-1])}{' and ' if len(kinds) > 1 else ''}{kinds[-1]} registered on the {where}")
    if held:
        raise RuntimeError(
            f"{caller} cannot run the {' and the '.join(held)}: it runs the stages under its schedule, a micro-batch at "
            "a time, without calling the pipeline or the model as a module, so they would be skipped, where "
            "loss_fn(pipe(x), target).backward() runs them.\nHow to fix: call loss_fn(pipe(x), target).backward() "
            "instead; or register the hooks on the model's modules (model.some_layer.register_forward_hook) before "
            "compiling; or remove them (handle.remove())."
        )


def refuse_partial_backward_hooks(module: nn.Module, where: str = "the Pipeline") -> None:
    """A hook of the deprecated `register_backward_hook` on the pipeline (or on the model, whose
    own hooks run around its call) sees the gradients of the last operation the call ran, which on
    a pipeline is its own, not the model's."""
    if module._backward_hooks and module._is_full_backward_hook is False and torch.is_grad_enabled():
        raise RuntimeError(
            f"a backward hook registered on {where} with register_backward_hook (deprecated by torch) would see "
            "the gradients of the pipeline's own last operation, not those of the model's output, and what it "
            "returns would reach no parameter.\nHow to fix: register it with register_full_backward_hook, which "
            "the pipeline runs as the plain model does (its grad_input is the gradients of the inputs)."
        )


NOT_CAPTURED = (
    "a Pipeline cannot be captured by torch.jit.script, torch.jit.trace, torch.export, torch.fx or ONNX export: it runs "
    "its stages on worker threads (or in other processes) under its schedule, which no captured graph holds.\n"
    "How to fix: capture the plain model. It has the same parameters: the pipeline shares them (across "
    "processes, load pipe.state_dict() into it through torch.distributed.checkpoint first)."
)


def stops_torch_compile(why: str) -> Callable[[F], F]:
    """Mark `fn` as `torch.compiler.disable(fn, reason=why)` marks it, without importing
    torch._dynamo with fxpipe: a call of it breaks the graph being compiled (fullgraph=True and
    strict export stop there, saying `why`)."""
    def mark(fn: F) -> F:
        fn._torchdynamo_disable = True  # type: ignore[attr-defined]
        fn._torchdynamo_disable_msg = why  # type: ignore[attr-defined]
        return fn

    return mark


@stops_torch_compile(NOT_CAPTURED)
def _refused_capture() -> None:
    raise RuntimeError(NOT_CAPTURED)


def _norm_momentum_hint(owner: nn.Module, attributes: Sequence[str]) -> str:
    """For a BatchNorm's momentum among the attributes changed (torch.optim.swa_utils.update_bn
    sets it to None, to average over a loader, and puts it back after): where that can run."""
    names = [a.partition(" ")[0] for a in attributes]
    norms = [n for n in names if n.endswith(".momentum") and isinstance(submodule_or_none(owner, n.rpartition(".")[0]), _BatchNorm)]
    if not norms:
        return ""
    return (
        f" For {', '.join(norms)}: torch.optim.swa_utils.update_bn(loader, model) on the plain model sets the "
        "statistics the pipeline reads (put the momentum back first, if a refused call left it changed)."
    )


def _autograd_state_hint(attributes: Sequence[str]) -> str:
    """For a tensor's `requires_grad` or `grad` among the attributes changed: what reads them."""
    names = [a.partition(" ")[0] for a in attributes]
    if not any(n.endswith((".requires_grad", ".grad")) for n in names):
        return ""
    return (
        " The model's code branches on a tensor's requires_grad or on whether it holds a gradient (.grad is None), "
        "and the graph holds the branch taken: compile after freezing or unfreezing, with the gradients as they "
        "will be at each call (set to None or kept by zero_grad), or branch on what the call is given instead."
    )


def refuse_without_gradients(index: int) -> None:
    """The loop's batches run as the caller iterates it, under the grad mode of that moment: a
    loop begun with gradients may be iterated without them (a validation's `torch.no_grad()`
    around the wrong lines), where its steps would compute a loss alone, and no update."""
    if torch.is_grad_enabled():
        return
    where = "torch.inference_mode()" if torch.is_inference_mode_enabled() else "torch.no_grad()"
    raise RuntimeError(
        f"train_steps: batch {index} was asked for under {where}: the loop computes gradients and steps the optimizer "
        "on them, and would update nothing there (the plain loop's backward raises).\nHow to fix: iterate the loop "
        f"with gradients on, and keep {where} around the evaluation alone."
    )
