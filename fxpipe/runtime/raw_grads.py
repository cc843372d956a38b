"""Gradients of a stage's inputs as autograd made them, strides included, not as `.grad` keeps them.

A leaf's `.grad` takes the leaf's own strides (autograd's layout contract), copying when the
gradient came in another layout. In the plain model no leaf stands between stages: the producer's
backward receives the gradient in the layout its consumer's backward made. A stage that sent back
`.grad` would run its backward on other layouts than the plain model's, and some kernels are
wrong on some layouts: with torch 2.13 on CPU, batch_norm's backward given a channels-last
gradient of a one-sample batch whose batch stride is not the full size (what a permute's backward
makes of a contiguous gradient) is off by whole units, so one-sample micro-batches of a model with
BatchNorm before a permute (MaxViT's blocks) trained on wrong gradients.
"""
from __future__ import annotations

from functools import partial
from typing import Optional, Sequence

import torch


class RawGrads:
    """The gradients the hooked tensors received in a backward, by tensor."""

    def __init__(self) -> None:
        self._grads: dict[int, torch.Tensor] = {}

    def keep(self, key: int, grad: torch.Tensor) -> None:
        """A tensor hook's body: the gradient is kept, and passed on as it is."""
        before = self._grads.get(key)
        self._grads[key] = grad if before is None else before + grad

    def of(self, tensor: object) -> Optional[torch.Tensor]:
        """The gradient `tensor` received; `.grad` where no hook saw one (a tensor autograd
        reached without running its hooks), None for anything else."""
        if not isinstance(tensor, torch.Tensor):
            return None
        return self._grads.get(id(tensor), tensor.grad)


class raw_grads:
    """Within this block, the gradients that backward gives `tensors` (which require grad) are
    kept as they come, before `.grad` copies them into the tensors' layout. A class, not a
    generator: every backward task enters one."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors, self.kept = tensors, RawGrads()

    def __enter__(self) -> RawGrads:
        kept = self.kept
        self.handles = [t.register_hook(partial(kept.keep, id(t))) for t in self.tensors]
        return kept

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
