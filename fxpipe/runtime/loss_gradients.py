"""The gradient a loss sends the outputs: the micro-batches' losses against the whole batch's, so that a loss whose value combines but whose gradient does not (a statistic of the batch taken detached, a hook on the outputs) is refused."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from fxpipe.core.microbatch import flatten, unflatten
from fxpipe.runtime.gather import Gathered
from fxpipe.runtime.losses import handed, output_leaf

# The relative difference of the outputs' gradient (in norm) taken as rounding, by dtype; lower
# precisions, and losses under autocast, are not checked (their rounding would hide as much as it
# shows).
_ROUNDING = {torch.float64: 1e-9, torch.float32: 1e-4}


def check_combined_gradient(
    loss_fn: Callable[[Any, Any], torch.Tensor],
    per_micro_batch: Sequence[dict[str, Any]],
    gather: Callable[[list[dict[str, Any]]], Gathered],
    output: Callable[[int, dict[str, Any]], Any],
    targets: Sequence[Any],
    weights: Sequence[float],
    target: Any,
    reduction: str,
    drew: Callable[[], bool],
    writes: bool = True,
) -> None:
    """Each micro-batch's weighted loss differentiated by its outputs, against the whole batch's
    loss differentiated by the same outputs put together (the concatenation autograd goes
    through): they must agree where the micro-batches' outputs are parts of the batch's. Raises
    ValueError naming the difference; nothing else is touched (the outputs are fresh leaves; the
    caller undoes what loss_fn draws, and `drew` says whether it did). `writes`: loss_fn may
    write the outputs or the target it is given in place (`losses.handed`)."""
    leaves = [_as_leaves(values) for values in per_micro_batch]
    tensors = [_tensors(values) for values in leaves]
    dtypes = {t.dtype for found in tensors for t in found if t.requires_grad}
    if not dtypes or any(d not in _ROUNDING for d in dtypes) or _under_autocast():
        return  # (nothing to differentiate; or a half precision's rounding, in the outputs or the loss's ops)
    rounding = max(_ROUNDING[d] for d in dtypes)
    with torch.enable_grad():
        gathered = gather(leaves)
        gathered.aliases = []  # an output that is a view of another stays one leaf's (each micro-batch's are apart too)
        split = _split_leaves(gathered, leaves)
        whole = loss_fn(handed(gathered.rebuild(gathered.tensors), writes), handed(target, True))
        if not isinstance(whole, torch.Tensor) or not whole.requires_grad or not split:
            return
        flat = [t for found in tensors for t in found if t.requires_grad]
        want = torch.autograd.grad(whole, flat, allow_unused=True)
        got: list[Optional[torch.Tensor]] = []
        for i, values in enumerate(leaves):
            loss = loss_fn(handed(output(i, values), writes), handed(targets[i], True)) * weights[i]
            mine = [t for t in tensors[i] if t.requires_grad]
            got += torch.autograd.grad(loss, mine, allow_unused=True) if loss.requires_grad else [None] * len(mine)
    if drew():  # a loss that draws draws other values on the micro-batches: nothing to compare
        return
    differs = _difference([(g, w) for t, g, w in zip(flat, got, want) if id(t) in split])
    if differs > rounding:
        raise ValueError(
            f"the micro-batches' losses combined with reduction={reduction!r} give the loss of the whole batch, but not its "
            f"gradient: the gradient loss_fn sends the outputs differs by {differs:.3g} of its size. The loss reads "
            "a statistic of the whole batch that the micro-batches take each of their own (a normalisation by the batch's "
            "mean or std taken detached, an advantage normalised over the batch, a hook on the outputs' gradient), whose "
            "value cancels out of the loss but not out of its gradient.\nHow to fix: compute that statistic outside "
            "loss_fn on the whole batch and give it to loss_fn whole (loss_fn=functools.partial(my_loss, stat=s), or in "
            "the target, which gives each micro-batch a tensor with no dim of the batch's size whole), or compute the loss "
            "outside the pipeline: out = pipe(x); loss_fn(out, y).backward(), which runs the whole batch's loss. No "
            "gradient was accumulated into the model's parameters."
        )


def _under_autocast() -> bool:
    return torch.is_autocast_enabled("cpu") or (torch.cuda.is_available() and torch.is_autocast_enabled("cuda"))


def _as_leaves(values: dict[str, Any]) -> dict[str, Any]:
    """A micro-batch's output values with each tensor a fresh leaf (that requires grad where
    the output can: a loss_fn differentiates it as it differentiates the pipeline's)."""
    found = {}
    for name, value in values.items():
        flat, spec = flatten(value)
        found[name] = unflatten([output_leaf(t) if isinstance(t, torch.Tensor) else t for t in flat], spec)
    return found


def _tensors(values: dict[str, Any]) -> list[torch.Tensor]:
    return [t for value in values.values() for t in flatten(value)[0] if isinstance(t, torch.Tensor)]


def _split_leaves(gathered: Gathered, leaves: Sequence[dict[str, Any]]) -> set[int]:
    """The micro-batches' output leaves that are parts of a batch's output (not a value each gives
    alike, which the batch's takes from the first)."""
    found: set[int] = set()
    for name, k, along, _ in gathered.slots:
        if along is not None:
            for values in leaves:
                found.add(id(flatten(values[name])[0][k]))
    return found


def _difference(pairs: Sequence[tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]) -> float:
    """The norm of the gradients' difference over the norm of the whole batch's (0 where both
    are none)."""
    diff, size = 0.0, 0.0
    for got, want in pairs:
        g = 0.0 if got is None else got.double()
        w = 0.0 if want is None else want.double()
        diff += float(torch.as_tensor(g - w).pow(2).sum())
        size += float(torch.as_tensor(w).pow(2).sum())
    if size == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return (diff / size) ** 0.5
