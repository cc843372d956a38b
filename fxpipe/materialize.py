"""Models built on the meta device: each stage's tensors made on its device, then initialised.

A model too big for one host is built under `torch.device("meta")` (shapes, no memory) and
compiled as it is. Each stage that runs in this process gets its parameters and buffers made on
its device (`torch.empty`), and every module whose tensors are all made runs its own
`reset_parameters()`. What no module initialises is filled with NaN (0 for integers), named in a
warning: load a checkpoint into it (`dcp.load` into `pipe.state_dict()`) before training.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch
from torch import nn


def is_on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def materialize(
    owner: nn.Module, programs: Sequence[Any], runs_here: Callable[[Any, int], bool], also: Sequence[tuple[torch.Tensor, torch.device]] = ()
) -> None:
    """Make the meta tensors of every stage that runs here on that stage's device, and `also`
    (tensors no stage reads, held here) on theirs; initialise them with their modules'
    `reset_parameters()`, or NaN and a warning."""
    wanted = [(t, runtime.device) for program in programs for index, runtime in enumerate(program.stages)
              if runs_here(program, index) for t in program.stage_tensors(index)]  # fmt: skip
    made: set[int] = set()
    for tensor, device in [*wanted, *also]:
        if tensor.is_meta and id(tensor) not in made:
            torch.utils.swap_tensors(tensor, _empty_like(tensor, device))
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
            initialised.update(id(t) for t in own)
    _fill_the_rest(owner, made - initialised)


def _empty_like(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    empty = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    return nn.Parameter(empty, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty


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
            stacklevel=3,
        )
