"""What forward does that a traced graph loses, watched as the model runs eagerly (in eval mode too where its code asks).

    a write in place to a tensor    a trace makes it once, while tracing (when it involves no
    the model does not own          traced value), or the pipeline makes it again in each
    (an attribute never registered  recompute (it keeps only buffers as they were): refused,
    as a buffer, a global)          the tensor put back
    a buffer rebound to a new       the graph computes the new value but never stores it:
    tensor (self.n = self.n + 1)    refused, the buffer put back
    a hook on a tensor              torch.export drops it: the export front end is refused
    (h.register_hook)
    buffers written inside the      its recompute in backward writes them again (BatchNorm
    model's own checkpoint          counts each micro-batch twice), which no graph does:
    (torch.utils.checkpoint)        refused, naming them
"""
from __future__ import annotations

import functools
import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.utils.checkpoint as checkpoints
from torch import nn
from torch.utils._pytree import tree_flatten

from fxpipe.core.eager_mode import EagerDispatchMode, is_higher_order, run_higher_order
from fxpipe.core.wording import listed
from fxpipe.core.writes import storage_key
from fxpipe.tracing.trace import TraceError


# Ops whose schema declares no alias for their result, which returns a view of its input all the same.
_UNDECLARED_VIEWS = ("_unsafe_view",)


class _Schema:
    """What an aten op's schema says, read once per op: the arguments it writes (`self` of
    `add_`, `out=`), by position and name; and whether its results are new storages (no result
    aliases an argument: not a view, not an in-place op's `self`)."""

    def __init__(self, func: Any) -> None:
        schema = func._schema
        self.writes = [(k, a.name) for k, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
        self.fresh = all(r.alias_info is None for r in schema.returns) and func._overloadpacket.__name__ not in _UNDECLARED_VIEWS

    def written(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
        for position, name in self.writes:
            value = args[position] if position < len(args) else kwargs.get(name)
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(t, torch.Tensor):
                    yield t


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in an op's arguments or results: tensors, in tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


class _Outside(EagerDispatchMode):
    """Records each write to a storage that is neither `owned` nor made by an op while the
    mode is on, with a copy of the storage as it was before the first write."""

    def __init__(self, owned: set[int]) -> None:
        super().__init__()
        self.owned = owned
        self.written: dict[int, tuple[torch.Tensor, torch.UntypedStorage]] = {}
        self.schemas: dict[Any, _Schema] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if is_higher_order(func):
            return run_higher_order(self, func, args, kwargs)
        schema = self.schemas.get(func) or self.schemas.setdefault(func, _Schema(func))
        if schema.writes:
            for t in schema.written(args, kwargs):
                key = storage_key(t)
                if key not in self.owned and key not in self.written and key != id(t):
                    self.written[key] = (t, t.untyped_storage().clone())
        out = func(*args, **kwargs)
        # A new storage is the model's own; a view, or an in-place op's result, shares its
        # argument's storage, which is the model's own only if the argument's is.
        if schema.fresh:
            self.owned.update(storage_key(t) for t in _tensors(out))
        return out

    def put_back(self) -> None:
        for t, before in self.written.values():
            t.untyped_storage().copy_(before)


def _names(model: nn.Module, t: torch.Tensor) -> str:
    """Where the written tensor lives: a module's attribute, a global of a forward's module."""
    key = storage_key(t)
    for path, module in model.named_modules():
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor) and storage_key(value) == key:
                return f"the tensor attribute {'.'.join(filter(None, [path, name]))} of {type(module).__name__} (not a buffer)"
    for module in model.modules():
        found = getattr(type(module).forward, "__globals__", {})
        for name, value in found.items():
            if isinstance(value, torch.Tensor) and storage_key(value) == key:
                return f"the global tensor {name} of {found.get('__name__', 'its module')}"
    return f"a tensor of shape {tuple(t.shape)} that is not a parameter, buffer or input of the model (a global, or one a closure holds)"


@contextmanager
def outside_writes_refused(model: nn.Module, inputs: Any) -> Iterator[None]:
    """Run the model within this block: a write in place to a tensor that is not one of its
    parameters, buffers or `inputs` is refused, the tensor put back as it was."""
    owned = {storage_key(t) for t in [*model.parameters(), *model.buffers()]}
    owned |= {storage_key(t) for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)}
    mode = _Outside(owned)
    try:
        with mode:
            yield
    finally:
        mode.put_back()
    if mode.written:
        names = sorted({_names(model, t) for t, _ in mode.written.values()})
        raise TraceError(
            f"{type(model).__name__} cannot be compiled: its forward writes in place to tensors that are not its "
            "parameters, buffers or inputs:\n" + "\n".join(f"  - {name}" for name in names) + "\nA traced graph "
            "makes such a write once, while tracing (or, when it writes a traced value, again in each recompute), "
            "so the pipeline would compute otherwise than the model.\nHow to fix: register each as a buffer of its module (self.register_buffer(name, "
            "tensor), with persistent=False to keep it out of the state dict); a buffer written in place is "
            "carried exactly."
        )


@contextmanager
def rebound_buffers_refused(model: nn.Module) -> Iterator[None]:
    """Run the model within this block: a buffer it replaces with another tensor is refused,
    and put back."""
    before = [(path, module, dict(module._buffers)) for path, module in model.named_modules()]
    yield
    rebound: list[str] = []
    built: list[str] = []
    for path, module, buffers in before:
        for name, buffer in buffers.items():
            now = module._buffers.get(name)
            if now is not buffer:
                resized = buffer is None or not isinstance(now, torch.Tensor) or now.shape != buffer.shape
                (built if resized else rebound).append(f"{path}.{name}" if path else name)
                module._buffers[name] = buffer
    problems = []
    if rebound:
        problems.append(
            f"its forward replaces the buffers {', '.join(rebound)} with new tensors (self.n = self.n + 1), "
            "which a pipeline's generated stages cannot store.\nHow to fix: write each in place (self.n += 1, "
            "self.n.add_(1), self.n.copy_(value)); a buffer written in place is carried exactly."
        )
    if built:
        problems.append(
            f"its forward builds the buffers {', '.join(built)} anew at another size (a cache made on first use, "
            "or grown for a longer input), which a pipeline's generated stages cannot store.\nHow to fix: call "
            "the model once before compiling, at the largest size it will see, so that the cache is built (or "
            "build it in __init__); a forward that then only reads it compiles."
        )
    if problems:
        raise TraceError(f"{type(model).__name__} cannot be compiled: " + "\n".join(problems))


class _HookCount:
    """How many hooks were registered on tensors, by the thread that counts."""

    def __init__(self) -> None:
        self.count = 0


# The counting thread's count while a block counts; `Tensor.register_hook` is wrapped while
# any thread counts. A wrapped method, not a TorchFunctionMode, which would put a Python call
# in front of every op of the run.
_counting = threading.local()
_wrapping = threading.Lock()
_wrapped: list[Callable[..., Any]] = []  # the method as it was, while wrapped


def _counted(register_hook: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(register_hook)
    def register_hook_counted(self: torch.Tensor, hook: Callable[..., Any]) -> Any:
        counter = getattr(_counting, "hooks", None)
        if counter is not None:
            counter.count += 1
        return register_hook(self, hook)

    return register_hook_counted


@contextmanager
def tensor_hooks_counted() -> Iterator[_HookCount]:
    """Within this block, `.count` of what it yields counts the hooks this thread registers on
    tensors."""
    counter, outer = _HookCount(), getattr(_counting, "hooks", None)
    with _wrapping:
        _wrapped.append(torch.Tensor.register_hook)
        if len(_wrapped) == 1:
            torch.Tensor.register_hook = _counted(_wrapped[0])  # type: ignore[method-assign]
    _counting.hooks = counter
    try:
        yield counter
    finally:
        _counting.hooks = outer
        with _wrapping:
            original = _wrapped.pop()
            if not _wrapped:
                torch.Tensor.register_hook = original  # type: ignore[method-assign]


# A region of the model's own activation checkpointing that drew random numbers in its forward:
# whether reentrant, and the paths of the modules whose forwards it ran within (innermost first).
DrawingRegion = tuple[bool, list[str]]


@contextmanager
def own_checkpoints_refused(model: nn.Module) -> Iterator[list[DrawingRegion]]:
    """Run the model within this block: buffers written inside a region of its own activation
    checkpointing (torch.utils.checkpoint, reentrant or not) are refused, put back by the caller's
    runs as any buffer is. The block gets the regions that drew random numbers (whose recompute
    in backward draws again: `refuse_checkpointed_draws` says where that cannot be replayed)."""
    owners = {id(b): name.rpartition(".")[0] or type(model).__name__ for name, b in model.named_buffers()}
    written: dict[str, None] = {}
    drew: list[DrawingRegion] = []
    paths = {id(m): name for name, m in model.named_modules()}

    def note_draws(before: torch.Tensor, reentrant: bool, run: Any = None) -> None:
        if not torch.equal(torch.get_rng_state(), before):
            ran = [paths[id(run)]] if isinstance(run, nn.Module) and id(run) in paths else []  # the module checkpointed
            drew.append((reentrant, ran + _modules_on_the_stack(paths)))

    def versions() -> dict[int, int]:
        return {id(b): b._version for b in model.buffers() if not b.is_inference()}

    def note(before: dict[int, int]) -> None:
        written.update((owners[key], None) for key, version in versions().items() if before.get(key, version) != version)

    generator, reentrant = checkpoints._checkpoint_without_reentrant_generator, checkpoints.CheckpointFunction.forward

    def watched_generator(*args: Any, **kwargs: Any) -> Iterator[None]:
        inner = generator(*args, **kwargs)
        next(inner)  # before the checkpointed forward
        before, state = versions(), torch.get_rng_state()
        try:
            yield
        except BaseException as e:  # noqa: BLE001 - handed on as checkpoint hands it on
            inner.throw(e)
            return
        note(before)
        note_draws(state, reentrant=False)
        yield from inner

    def watched_forward(ctx: Any, run: Callable[..., Any], *args: Any) -> Any:
        before, state = versions(), torch.get_rng_state()
        try:
            return reentrant(ctx, run, *args)
        finally:
            note(before)
            note_draws(state, reentrant=True, run=run)

    checkpoints._checkpoint_without_reentrant_generator = watched_generator  # type: ignore[assignment]
    checkpoints.CheckpointFunction.forward = staticmethod(watched_forward)  # type: ignore[method-assign,assignment]
    try:
        yield drew
    finally:
        checkpoints._checkpoint_without_reentrant_generator = generator
        checkpoints.CheckpointFunction.forward = staticmethod(reentrant)  # type: ignore[method-assign,assignment]
    if written:
        raise TraceError(
            f"{type(model).__name__} cannot be compiled: its own activation checkpointing (torch.utils.checkpoint) "
            f"runs modules that write their buffers: {listed(written)}. Its recompute in backward writes them a second "
            "time, which the pipeline's graph does not (BatchNorm's running statistics would count each micro-batch "
            "once where the plain model counts it twice).\nHow to fix: turn the model's own checkpointing off "
            "(torchvision's memory_efficient=False, timm's set_grad_checkpointing(False), Hugging Face's "
            "gradient_checkpointing_disable()); the pipeline's checkpoint= recomputes its stages instead, and "
            "writes buffers once."
        )


def _modules_on_the_stack(paths: dict[int, str]) -> list[str]:
    """The paths of the model's modules whose code is running on this thread, innermost first."""
    found: list[str] = []
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in paths and paths[id(owner)] not in found:
            found.append(paths[id(owner)])
        frame = frame.f_back  # type: ignore[assignment]
    return found


def checkpointed_draws(model: nn.Module, drew: list[DrawingRegion], called_whole: set[str]) -> str:
    """A region of the model's own activation checkpointing that draws random numbers (dropout)
    recomputes in backward, by torch's code: where the pipeline runs that code (a region
    reentrant, or within a module called whole), the recompute draws other numbers than its
    forward drew from the pipeline's per-micro-batch streams. A region of non-reentrant
    checkpointing that a trace goes through (torch.fx's, torch.export's) is part of the graph,
    which the pipeline's own checkpointing replays exactly. What is wrong, or ''."""
    def replayed_by_torch(reentrant: bool, stack: list[str]) -> bool:
        return reentrant or any(p == w or p.startswith(w + ".") for p in stack for w in called_whole)

    where = list(dict.fromkeys(stack[0] or type(model).__name__ for reentrant, stack in drew if stack and replayed_by_torch(reentrant, stack)))
    if not where:
        return ""
    return (
        f"its own activation checkpointing (torch.utils.checkpoint) recomputes random ops (dropout) in backward, in "
        f"{listed(where)}: the pipeline draws them from streams of its own per micro-batch, which torch's recompute "
        "does not replay, so the backward would use other masks than the forward"
    )


CHECKPOINTED_DRAWS_FIX = (
    "turn the model's own checkpointing off (Hugging Face's gradient_checkpointing_disable(), timm's "
    "set_grad_checkpointing(False), torchvision's memory_efficient=False); the pipeline's checkpoint= recomputes its "
    "stages and replays dropout exactly. Or use torch.utils.checkpoint(..., use_reentrant=False) in modules the trace "
    "goes through (not kept whole)."
)

