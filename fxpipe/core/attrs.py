"""Which parameters, buffers and constant tensors each node of a graph reads, by qualified name."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx
from torch import nn

COMPUTE_OPS = ("call_module", "call_function", "call_method")  # the nodes that compute a value
_MISSING = object()


def fetch_attr(root: nn.Module, target: str) -> Any:
    """The object at a dotted path below `root`, with an error that names the missing part."""
    obj: Any = root
    for i, part in enumerate(target.split(".")):
        obj = getattr(obj, part, _MISSING)  # one lookup: a module's goes through its __getattr__
        if obj is _MISSING:
            raise AttributeError(f"{type(root).__name__} has no attribute {'.'.join(target.split('.')[: i + 1])!r}")
    return obj


def submodule_or_none(root: nn.Module, path: str) -> Optional[nn.Module]:
    """The submodule at `path` below `root`, or None where there is none."""
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def buffer_or_none(root: nn.Module, path: str) -> Optional[torch.Tensor]:
    """The buffer at `path` below `root`, or None where there is none."""
    try:
        return root.get_buffer(path)
    except AttributeError:
        return None


def buffer_names(root: nn.Module) -> dict[int, list[str]]:
    """Each buffer's qualified names, by the tensor's id: one tensor registered in several
    modules has several."""
    names: dict[int, list[str]] = {}
    for name, buffer in root.named_buffers(remove_duplicate=False):
        names.setdefault(id(buffer), []).append(name)
    return names


def tensor_held(root: nn.Module, path: str) -> Optional[torch.Tensor]:
    """The parameter or buffer at `path` below `root` (under a parametrization registered on
    it, the original it computes from), or None where there is none."""
    module_path, _, name = path.rpartition(".")
    module = submodule_or_none(root, module_path)
    if module is None:
        return None
    parametrized = getattr(module, "parametrizations", None)
    if isinstance(parametrized, nn.ModuleDict) and name in parametrized:
        return getattr(parametrized[name], "original", None)
    return module._parameters.get(name) if name in module._parameters else module._buffers.get(name)


def tied_names(root: nn.Module) -> list[list[str]]:
    """The names of each parameter held under several (a tied weight; a buffer registered on it
    counts as one of its names)."""
    names: dict[int, list[str]] = {}
    for name, tensor in [*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), []).append(name)
    params = {id(p) for p in root.parameters()}
    return [group for key, group in names.items() if len(group) > 1 and key in params]


def tensors_read(gm: fx.GraphModule, node: fx.Node) -> dict[str, torch.Tensor]:
    """The state a node reads: a called module's parameters and buffers, and the tensors of the
    `get_attr` nodes it takes as arguments (a parameter given to a module as its input too);
    keyed by qualified name."""
    if node.op not in COMPUTE_OPS:  # a get_attr's tensor is read by the nodes that take it
        return {}
    found: dict[str, torch.Tensor] = {}
    if node.op == "call_module":
        module = fetch_attr(gm, str(node.target))
        found.update(module.named_parameters(prefix=str(node.target), remove_duplicate=False))
        found.update(module.named_buffers(prefix=str(node.target), remove_duplicate=False))
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            value = fetch_attr(gm, str(arg.target))
            if isinstance(value, torch.Tensor):
                found[str(arg.target)] = value
    return found


def parameters_of(gm: fx.GraphModule, node: fx.Node) -> list[torch.Tensor]:
    """The tensors of `tensors_read`, without names."""
    return list(tensors_read(gm, node).values())
