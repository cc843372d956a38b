"""Placing the model's parameters and buffers on the device of the first stage that reads them."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.fx as fx
from torch import nn

from fxpipe.core.attrs import fetch_attr, tensors_read


def _place(owner: nn.Module, gm: fx.GraphModule, name: str, tensor: torch.Tensor, device: torch.device) -> None:
    """Move one parameter (in place, keeping the object) or buffer to its stage's device (one
    on the meta device is made there when the pipeline is built: fxpipe/compiled/materialize.py)."""
    if tensor.device == device or tensor.is_meta:
        return
    if isinstance(tensor, nn.Parameter):
        tensor.data = tensor.data.to(device)
        if tensor.grad is not None:
            tensor.grad = tensor.grad.to(device)
        return
    parent_name, _, attr = name.rpartition(".")
    for root in (owner, gm):
        try:
            parent = fetch_attr(root, parent_name) if parent_name else root
        except AttributeError:
            continue
        if getattr(parent, attr, None) is tensor:
            if attr in parent._buffers:
                parent._buffers[attr] = tensor.to(device)
            else:
                setattr(parent, attr, tensor.to(device))


def place_state(owner: nn.Module, gm: fx.GraphModule, runs: Sequence[Sequence[fx.Node]], devices: Sequence[torch.device]) -> None:
    """Every parameter and buffer goes to the device of the first stage that reads it."""
    placed: set[int] = set()
    for run, device in zip(runs, devices):
        for node in run:
            for name, tensor in tensors_read(gm, node).items():
                if id(tensor) not in placed:
                    placed.add(id(tensor))
                    _place(owner, gm, name, tensor, device)
