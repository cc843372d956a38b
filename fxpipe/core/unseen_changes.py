"""What a caller's hook may change that no version counter sees: a parameter written through `.data`, and the attributes of modules run whole."""

import copy
from dataclasses import dataclass
from typing import Any, Collection

import torch
from torch import nn


@dataclass
class Unseen:
    """The model's parameters' places and values: two sums of each, which a write through `.data`,
    counted by no version, changes. (Buffers are left out: a stage that reads no parameter runs
    its forward, which may write them, while a hook runs.)"""

    tensors: dict[str, tuple[int, float, float]]

    @classmethod
    def of(cls, model: nn.Module) -> "Unseen":
        named = model.named_parameters(remove_duplicate=False)
        return cls({name: _fingerprint(t) for name, t in named if t.layout == torch.strided and t.device.type != "meta"})

    def written(self, now: "Unseen") -> list[str]:
        """The parameters whose place or values differ in `now`."""
        return [f"{name} (through .data)" for name, print_ in now.tensors.items() if self.tensors.get(name, print_) != print_]


def attributes_changed(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The names of `whole_attributes` whose values differ, or that are gone (one added, a
    cached property read for the first time, say, changes nothing the module read before)."""
    return sorted(name for name in before if not _same(before[name], now.get(name, _ABSENT)))


_ABSENT = object()


def _fingerprint(t: torch.Tensor) -> tuple[int, float, float]:
    if t.numel() == 0:
        return (t.data_ptr(), 0.0, 0.0)
    values = t.detach()
    values = torch.view_as_real(values) if values.is_complex() else values
    values = torch.nan_to_num(values.double(), nan=0.5, posinf=2.0**60, neginf=-(2.0**60))  # NaNs alike where they stay
    total, squares = torch.stack([values.sum(), values.pow(2).sum()]).tolist()
    return (t.data_ptr(), total, squares)


def whole_attributes(model: nn.Module, whole: Collection[str]) -> dict[str, Any]:
    """The public plain attributes (no tensor, no module) of the modules in `whole`, which read
    them as they run, and of the modules inside them; containers copied, so that one changed in
    place shows."""
    found = {}
    for name, module in model.named_modules():
        if any(name == w or name.startswith(w + ".") for w in whole):
            for key, value in vars(module).items():
                if not key.startswith("_") and key != "training" and not isinstance(value, (torch.Tensor, nn.Module)):
                    found[f"{name}.{key}"] = copy.copy(value) if isinstance(value, (list, dict, set)) else value
    return found


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - a value with no truth of its equality (an array): its identity decides
        return False
