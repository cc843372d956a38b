"""A loss_fn that differentiates what lies behind the outputs (a gradient penalty on the inputs or the weights): refused, since it sees the outputs with no graph behind them."""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch.autograd.graph import Node, get_gradient_edge
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from fxpipe.core.wording import listed


class GradsBehindOutputs(TorchFunctionMode):
    """Around loss_fn on one micro-batch (its thread alone: modes are per thread): a call of
    `torch.autograd.grad` whose inputs the loss does not reach is refused. loss_fn gets each
    output as a leaf (the stages hold the graph before it), so a weight of the model or an input
    of the call is reached by no loss it computes: its gradient would be None (allow_unused) or
    zero (materialize_grads), where the plain model's is not."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Sequence[Any] = (), kwargs: Optional[dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.autograd.grad:
            outputs = kwargs.get("outputs", args[0] if args else None)
            inputs = kwargs.get("inputs", args[1] if len(args) > 1 else None)
            _refuse_unreached(outputs, inputs)
        return func(*args, **kwargs)


def _refuse_unreached(outputs: Any, inputs: Any) -> None:
    wanted = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if not wanted:
        return
    reached = set(_nodes(t.grad_fn for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor)))
    unreached = [t for t in wanted if _node_of(t) not in reached]
    if unreached:
        shapes = listed(f"{tuple(t.shape)}{' (a leaf)' if t.grad_fn is None else ''}" for t in unreached)
        error = RuntimeError(
            f"loss_fn differentiates with respect to tensors its loss does not reach here, of shapes {shapes}"
            ": a weight of the "
            "model or an input of the call, in a gradient penalty, say. train_step hands loss_fn each micro-batch's "
            "outputs with no graph behind them (the stages hold it), so such a gradient would be None or zero where the "
            "plain model's is not.\nHow to fix: compute a penalty on the inputs or the weights with the plain model (a "
            "Pipeline does not differentiate its own gradients: pipe(x) refuses create_graph=True too); loss_fn may "
            "differentiate the outputs themselves (torch.autograd.grad(loss, out, create_graph=True))."
        )
        error.fxpipe_refusal = True  # type: ignore[attr-defined]  # (no note on how the target was split)
        raise error


def _node_of(t: torch.Tensor) -> Node:
    return t.grad_fn if t.grad_fn is not None else get_gradient_edge(t).node


def _nodes(starts: Any) -> Iterator[Node]:
    """Every node of the graphs behind `starts` (grad_fns, None skipped)."""
    seen: set[int] = set()
    stack = [node for node in starts if node is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
