"""Random streams per (step, micro-batch, stage) task, so dropout is reproducible and replayable.

All CPU stage threads share one default generator: the order in which concurrent tasks draw from
it would be a race. Inside a task, every random op (an aten op tagged `nondeterministic_seeded`)
draws instead from a generator of the task's own, seeded from the step's seed and the task's
coordinates. The recompute of a checkpointed task reseeds the same way and gets the same masks.
"""
from __future__ import annotations

import threading
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_MASK = (1 << 64) - 1
# Guards the swap of a device's default generator, for random ops that take no generator.
_SWAP_LOCK = threading.Lock()


def task_seed(step_seed: int, micro_batch: int, stage: int) -> int:
    """A well-mixed 63-bit seed from the step's seed and the task's coordinates (splitmix64)."""
    x = (step_seed * 0x9E3779B97F4A7C15 + micro_batch * 0xBF58476D1CE4E5B9 + stage) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return (x ^ (x >> 31)) >> 1


def draw_step_seed() -> int:
    """A seed for one pipeline step, drawn from the caller's default generator, so that
    `torch.manual_seed` before a step fixes all of its random masks."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    if kwargs.get("device") is not None:
        return torch.device(kwargs["device"])
    leaves, _ = tree_flatten((args, kwargs))
    return next((t.device for t in leaves if isinstance(t, torch.Tensor)), torch.device("cpu"))


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


class TaskRandomness(TorchDispatchMode):
    """Within this mode, random ops draw from generators seeded by `seed`, one per device."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator] = {}
        self.drew = False

    def generator(self, device: torch.device) -> torch.Generator:
        if device not in self.generators:
            self.generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self.generators[device]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags or kwargs.get("generator") is not None:
            return func(*args, **kwargs)
        self.drew = True
        own = self.generator(_device_of(args, kwargs))
        if any(a.name == "generator" and a.kwarg_only for a in func._schema.arguments):
            return func(*args, **kwargs, generator=own)
        # No generator argument (native_dropout, say): swap the device's default generator.
        with _SWAP_LOCK:
            default = _default_generator(own.device)
            saved = default.get_state()
            default.set_state(own.get_state())
            try:
                result = func(*args, **kwargs)
                own.set_state(default.get_state())
            finally:
                default.set_state(saved)
        return result
