"""The hooks on the model itself: set aside while compiling, run around each pipe(x) as the model's own call runs them."""

import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils.hooks import BackwardHook

from fxpipe.core.hooks import KINDS, hook_name, hook_tables, hooked


@contextmanager
def model_hooks_set_aside(model: nn.Module) -> Iterator[None]:
    """Compile the model's forward alone: a trace calls forward, never the model, so its own hooks
    belong around the pipeline's call (`call_with_hooks`), not in the graph, nor in the checks
    that compare the graph with the model. Hooks registered meanwhile are kept, after the others."""
    held = [dict(table) for table in hook_tables(model)]
    for table in hook_tables(model):
        for key in [key for key, hook in table.items() if not weight_hook(hook)]:
            del table[key]
    try:
        yield
    finally:
        for table, before in zip(hook_tables(model), held):
            added = {key: hook for key, hook in table.items() if key not in before}
            table.clear()
            table.update(before)
            table.update(added)


def pre_hooks_note(model: nn.Module) -> str:
    """What a failed compile of a model with forward pre-hooks of its own says: they were set
    aside, and the example went to forward as it was given."""
    held = [f"forward pre-hook {hook_name(hook)}" for hook in model._forward_pre_hooks.values() if not weight_hook(hook)]
    return (
        f"The model's own {', '.join(held)} did not run while compiling: the pipeline runs them around each call, and "
        "traces forward on the example as given. If they change the inputs (a pad, a cast, a keyword added), give "
        "compile_pipeline the example as they leave it."
    ) if held else ""


def weight_hook(hook: Any) -> bool:
    """A hook of torch.nn.utils that assigns a weight before each forward (pruning, the hook forms
    of weight_norm and spectral_norm): kept while compiling, which refuses it with its own fix."""
    return type(hook).__module__.startswith("torch.nn.utils")


def weight_hooks(model: nn.Module) -> dict[str, str]:
    """The weights that `weight_hook`s on the model itself assign, each with the hook's kind."""
    return {
        name: type(hook).__name__ for hook in model._forward_pre_hooks.values() if weight_hook(hook)
        for name in [getattr(hook, "_tensor_name", None) or getattr(hook, "name", None)] if isinstance(name, str)
    }  # fmt: skip


def weight_hooks_refusal(assigned: dict[str, str]) -> str:
    """Why weight hooks on the model itself are refused, and what to do instead."""
    which = ", ".join(f"{name!r} ({kind})" for name, kind in assigned.items())
    return (f"a hook of torch.nn.utils on the model itself assigns {which} before each forward: the generated "
            "stages read the weight it assigned when traced, and cannot keep it up to date.\nHow to fix: make it "
            "permanent before compiling (torch.nn.utils.prune.remove(model, name), remove_weight_norm, "
            "remove_spectral_norm); or use torch.nn.utils.parametrizations.weight_norm or spectral_norm (for a mask, "
            "a parametrization that applies it: torch.nn.utils.parametrize.register_parametrization), which the "
            "stages compute on every call; or apply it to a submodule, which is then called whole with its hooks.")


def refuse_weight_hooks(model: nn.Module) -> None:
    """Weight hooks registered on the model itself after compiling: refused as compiling refuses them."""
    assigned = weight_hooks(model)
    if assigned:
        raise RuntimeError(weight_hooks_refusal(assigned))


def own_hooks_named(model: nn.Module) -> list[str]:
    """The model's own hooks, each with its kind, for messages."""
    return [f"{kind} {hook_name(hook)}" for kind, table in zip(KINDS, hook_tables(model)) for hook in table.values()]


def call_with_hooks(model: nn.Module, call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`call(*args, **kwargs)` in the place of `model.forward`, with the model's own hooks around it
    as `model(*args, **kwargs)` runs them: pre-hooks (which may replace the arguments), full backward
    hooks and backward pre-hooks (on the inputs' and the outputs' gradients), forward hooks (which
    may replace the output; those registered with always_call=True run on an error too). Global
    module hooks are not run here: the pipeline's own call runs them."""
    if not hooked(model):
        return call(*args, **kwargs)
    refuse_weight_hooks(model)
    called: set[int] = set()
    result = None
    try:
        backward = _backward_hook(model)  # the hooks there before the pre-hooks ran, as torch takes them
        args, kwargs = _pre_hooked(model, args, kwargs)
        if backward is not None:
            args = backward.setup_input_hook(args)
        result = call(*args, **kwargs)
        for key, hook in list(model._forward_hooks.items()):
            called.add(key)
            returned = hook(model, args, kwargs, result) if key in model._forward_hooks_with_kwargs else hook(model, args, result)
            result = result if returned is None else returned
        if backward is None:
            return result
        if not isinstance(result, (torch.Tensor, tuple)):
            warnings.warn(f"For backward hooks to be called, module output should be a Tensor or a tuple of Tensors but received {type(result)}", stacklevel=4)
        return backward.setup_output_hook(result)
    except Exception:
        _always_called(model, args, kwargs, result, called)
        raise


def _pre_hooked(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    for key, hook in list(model._forward_pre_hooks.items()):
        if key in model._forward_pre_hooks_with_kwargs:
            returned = hook(model, args, kwargs)
            if returned is not None:
                if not (isinstance(returned, tuple) and len(returned) == 2):
                    raise RuntimeError(f"forward pre-hook must return None or a tuple of (new_args, new_kwargs), but got {returned}.")
                args, kwargs = returned
        else:
            returned = hook(model, args)
            if returned is not None:
                args = returned if isinstance(returned, tuple) else (returned,)
    return args, kwargs


def _backward_hook(model: nn.Module) -> Any:
    """torch's own handler of full backward hooks, which wraps the inputs and the outputs of a call."""
    full = list(model._backward_hooks.values()) if model._is_full_backward_hook else []
    pre = list(model._backward_pre_hooks.values())
    return BackwardHook(model, full, pre) if full or pre else None


def _always_called(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any, called: set[int]) -> None:
    """The forward hooks registered with always_call=True that the error kept from running, each
    run once; one that raises too is warned of, and the first error goes on."""
    for key, hook in list(model._forward_hooks.items()):
        if key in model._forward_hooks_always_called and key not in called:
            try:
                if key in model._forward_hooks_with_kwargs:
                    hook(model, args, kwargs, result)
                else:
                    hook(model, args, result)
            except Exception as error:  # noqa: BLE001 - the call's own error is the one raised
                warnings.warn(f"a forward hook of the model with always_call=True raised {type(error).__name__}: {error}", stacklevel=3)


def refuse_model_hooks_across(model: nn.Module) -> None:
    """Across processes the output is on the last stage's rank alone: the model's forward hooks
    would see None on the others."""
    if hooked(model):
        raise RuntimeError(
            f"across processes, pipe(x) cannot run the hooks registered on the model itself ({', '.join(own_hooks_named(model))}): "
            "the output is on the last stage's rank alone.\nHow to fix: register them on the model's modules "
            "(model.some_layer.register_forward_hook) before compiling, or remove them (handle.remove()) and apply "
            "what they do to the output on the last stage's rank."
        )
