"""Models built on the meta device: each stage's tensors made on its device, then initialised.

A model too big for one host is built under `torch.device("meta")` (shapes, no memory) and
compiled as it is. Each stage that runs in this process gets its parameters and buffers made on
its device (holding NaN, 0 if integer), and every module whose tensors are all made runs its own
`reset_parameters()`. What no module initialises keeps its NaN (0 for integers), named in a
warning: load a checkpoint into it (`dcp.load` into `pipe.state_dict()`) before training. A buffer
no checkpoint holds either (persistent=False) and no module makes is refused.

Across processes a rank frees the tensors of the stages other ranks run (fxpipe/distributed/ranks.py),
and the model remembers which: compiled again, they are not made anew as if the model had been
built on the meta device (its values are gone; `reset_parameters()` would train another model).
"""
from __future__ import annotations

import contextlib
import gc
import warnings
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from fxpipe.core.own_code import caller_stacklevel
from fxpipe.core.wording import listed


_FREED = "_fxpipe_freed"  # in a model's __dict__: the names of the tensors freed on this rank


class FreedState(ValueError):
    """A compile needs tensors that an earlier compile across processes freed on this rank."""


def is_on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def mark_freed(owner: nn.Module, tensors: Sequence[torch.Tensor]) -> None:
    """Remember that `tensors` of `owner` were freed on this rank (a deep copy remembers too)."""
    ids = {id(t) for t in tensors}
    owner.__dict__.setdefault(_FREED, set()).update(name for name, t in _named_state(owner) if id(t) in ids)


def freed_note(owner: nn.Module) -> str:
    """What a failed compile of a model freed before should add; empty for any other model."""
    freed = sorted(owner.__dict__.get(_FREED, ()))
    return _freed_text({"this rank": freed}, "the model can no longer run whole there") if freed else ""


def freed_needed(owner: nn.Module, needed: Sequence[torch.Tensor]) -> list[str]:
    """The names of `needed` tensors that an earlier compile freed on this rank."""
    ids, freed = {id(t) for t in needed if t.is_meta}, owner.__dict__.get(_FREED, set())
    return sorted({name for name, t in _named_state(owner) if id(t) in ids and name in freed})


def freed_refusal(needed: dict[str, list[str]]) -> FreedState:
    """The refusal of a cut that runs stages where their tensors were freed, by rank."""
    return FreedState(_freed_text(needed, "this cut runs their stages there, and their values are gone"))


def _freed_text(names: dict[str, list[str]], consequence: str) -> str:
    shown = _by_place(names)
    return (
        "an earlier compile_pipeline across processes freed tensors of this model, on each rank those of the "
        f"stages other ranks ran ({shown}): {consequence}.\nHow to fix: compile a fresh model (build it again, or "
        "load it from a checkpoint), or keep a copy (copy.deepcopy(model)) before the first compile; compiled "
        "again with the same cut (split_points=...), the model needs only what each rank holds."
    )


def _by_place(names: dict[str, list[str]]) -> str:
    """'on rank 1: a, b, ... and 3 more; on rank 2: c': at most six names per place."""
    return "; ".join(f"on {where}: {listed(n, most=6)}" for where, n in names.items())


def _named_state(owner: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*owner.named_parameters(remove_duplicate=False), *owner.named_buffers(remove_duplicate=False)]


def materialize(
    owner: nn.Module, programs: Sequence[Any], runs_here: Callable[[Any, int], bool], also: Sequence[tuple[torch.Tensor, torch.device]] = ()
) -> None:
    """Make the meta tensors of every stage that runs here on that stage's device, and `also`
    (tensors no stage reads, held here) on theirs; initialise them with their modules'
    `reset_parameters()`, or NaN and a warning."""
    wanted = [(t, runtime.device) for program in programs for index, runtime in enumerate(program.stages)
              if runs_here(program, index) for t in program.stage_tensors(index)]  # fmt: skip
    _refuse_freed(owner, [t for t, _ in [*wanted, *also] if t.is_meta])
    names = unfillable(owner, [t for t, _ in [*wanted, *also]])
    if names:
        raise unfillable_refusal({"this rank": names})
    release_for_swap([t for t, _ in [*wanted, *also] if t.is_meta])
    made: set[int] = set()
    with rnn_weight_refs_let_go(owner):
        for tensor, device in [*wanted, *also]:
            if tensor.is_meta and id(tensor) not in made:
                torch.utils.swap_tensors(tensor, _made_like(tensor, device))
                made.add(id(tensor))
    if not made:
        return
    initialised: set[int] = set()
    for module in owner.modules():
        own = [t for t in [*module._parameters.values(), *module._buffers.values()] if t is not None]
        reset = getattr(module, "reset_parameters", None)
        if own and callable(reset) and any(id(t) in made for t in own) and not any(t.is_meta for t in own):
            with torch.no_grad():
                reset()
            initialised.update(id(t) for t in own if not _left_unset(t))
    _fill_the_rest(owner, made - initialised)


def _left_unset(tensor: torch.Tensor) -> bool:
    """Whether a made tensor still holds NaN where it was made (`_made_like`) after its module's
    reset_parameters(), which set only some of the module's tensors (a subclass's own scale)."""
    return (tensor.is_floating_point() or tensor.is_complex()) and bool(tensor.isnan().any())


def unfillable(owner: nn.Module, tensors: Sequence[torch.Tensor]) -> list[str]:
    """The names of the meta `tensors` nothing can fill: buffers the model makes at construction
    and leaves out of its state dict (persistent=False), in a module without reset_parameters()
    (a position table, a rotary embedding's frequencies): no checkpoint holds them either."""
    ids = {id(t) for t in tensors if t.is_meta}
    found = []
    for prefix, module in owner.named_modules(remove_duplicate=False):
        if callable(getattr(module, "reset_parameters", None)):
            continue
        for name in module._non_persistent_buffers_set:
            buffer = module._buffers.get(name)
            if buffer is not None and id(buffer) in ids:
                found.append(f"{prefix}.{name}" if prefix else name)
    return sorted(set(found))


def unfillable_refusal(names: dict[str, list[str]]) -> ValueError:
    """The refusal of a model built on the meta device whose stages read buffers nothing can fill."""
    shown = _by_place(names)
    return ValueError(
        f"the model was built on the meta device, and its stages read buffers that nothing can fill ({shown}): "
        "the model makes them at construction and leaves them out of its state dict (persistent=False), so no "
        "checkpoint holds them, and no reset_parameters() makes them.\nHow to fix: build the model on the CPU "
        "(or on each rank's device) instead of the meta device, or register those buffers persistent."
    )


@contextlib.contextmanager
def rnn_weight_refs_let_go(owner: nn.Module) -> Iterator[None]:
    """Swap the tensors of the model's RNNs (nn.LSTM, nn.GRU, nn.RNN): each keeps weak references
    to its weights (`_flat_weight_refs`), which torch.utils.swap_tensors refuses; they are made
    again, to the swapped tensors, after."""
    rnns = [m for m in owner.modules() if isinstance(m, nn.RNNBase) and getattr(m, "_flat_weight_refs", None)]
    for rnn in rnns:
        rnn._flat_weight_refs = []
    try:
        yield
    finally:
        for rnn in rnns:
            rnn._init_flat_weights()


def release_for_swap(tensors: Sequence[torch.Tensor]) -> None:
    """Let go of what would stop torch.utils.swap_tensors on `tensors`: it refuses a tensor that
    something else refers to weakly. torch.export leaves such references in the memos
    (WeakIdKeyDictionary) of the fake tensors it traced with, and autocast in its cache of cast
    weights (when compiling under it); their entries describe contents the swap takes away.
    The memos are found in one pass over the live objects, only when there are any."""
    torch.clear_autocast_cache()
    ids = {id(t) for t in tensors if weakref.getweakrefcount(t)}
    if not ids:
        return
    for memo in gc.get_objects():
        # issubclass of its type: isinstance would follow a weakref.proxy, and one whose object died raises.
        if issubclass(type(memo), WeakIdKeyDictionary):
            for key in [k for k in memo.keys() if id(k) in ids]:
                del memo[key]


def _refuse_freed(owner: nn.Module, needed: list[torch.Tensor]) -> None:
    names = freed_needed(owner, needed)
    if names:
        raise freed_refusal({"this rank": names})


def _made_like(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` made on `device`, holding NaN (0 if integer) until something initialises it."""
    filler = float("nan") if tensor.is_floating_point() or tensor.is_complex() else 0
    made = torch.full(tensor.shape, filler, dtype=tensor.dtype, device=device)
    return nn.Parameter(made, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else made


def _fill_the_rest(owner: nn.Module, left: set[int]) -> None:
    names = []
    for name, tensor in [*owner.named_parameters(remove_duplicate=False), *owner.named_buffers(remove_duplicate=False)]:
        if id(tensor) in left:
            names.append(name)
            with torch.no_grad():
                tensor.fill_(float("nan") if tensor.is_floating_point() or tensor.is_complex() else 0)
    if names:
        warnings.warn(
            f"the model was built on the meta device, and no reset_parameters() initialises {', '.join(sorted(set(names)))}: "
            "they hold NaN (0 if integer). Load a checkpoint into the pipeline (dcp.load into pipe.state_dict(), "
            "or pipe.load_state_dict) before training.",
            stacklevel=caller_stacklevel(),
        )
