"""`Pipeline.train_steps`: a loop that owns several steps, batches in and each batch's loss out, the optimizer stepped after each."""
from __future__ import annotations

import inspect
import itertools
import sys
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Generator, Iterable, Iterator, Optional

import torch

from fxpipe.compiled.placement import RankPlacement
from fxpipe.core.own_code import is_ours
from fxpipe.distributed.loop_ranks import agree_on_the_next_batch, as_before, ran_on_every_rank, read_or_failed
from fxpipe.distributed.ranks import LOOP_LATE, gathered
from fxpipe.guards import refuse_own_hooks, refuse_without_gradients
from fxpipe.overlapped_steps import overlapped_steps, refuse_where_steps_cannot_overlap

# The Pipeline the loop runs (fxpipe/pipeline.py, which imports this module: not imported here).
PipelineLike = Any

Hook = Optional[Callable[[], Any]]


def train_steps(
    pipe: PipelineLike,
    batches: Iterable[Any],
    *,
    optimizer: torch.optim.Optimizer,
    loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
    reduction: str = "mean",
    after_backward: Hook = None,
    after_step: Hook = None,
) -> Losses:
    """Per batch: `optimizer.zero_grad()`, `pipe.train_step`, `after_backward()`,
    `optimizer.step()`, `after_step()`, then the batch's loss is yielded. Between two losses the
    parameters are those after the last update, whole; a failure says which batch it struck and
    what the parameters are. The arguments are checked here, the batches read as the losses are."""
    _refuse_bad_arguments(batches, optimizer, reduction, after_backward, after_step)
    if pipe._plan.schedule == "2bw":
        if pipe._channel is None:  # (across processes every rank refuses at once, as it reads the first batch)
            refuse_own_hooks(pipe, "train_steps")
            refuse_where_steps_cannot_overlap(pipe, optimizer)
        return Losses(_noted(overlapped_steps(pipe, _unpacked_batches(iter(batches)), loss_fn, optimizer, reduction, after_backward, after_step)))
    return Losses(_loop(pipe, iter(batches), loss_fn, optimizer, reduction, after_backward, after_step))


class Losses(Iterator[torch.Tensor]):
    """What `pipe.train_steps` returns: the loop's losses, one per batch as it is trained; `close()`
    stops the loop early. A loop is lazy, as a generator is: one dropped before its first loss was
    asked for trained nothing, which is said (as Python says of a coroutine never awaited)."""

    def __init__(self, losses: Generator[torch.Tensor, None, None]) -> None:
        self._losses, self._started, self._made_at = losses, False, _call_site()

    def __next__(self) -> torch.Tensor:
        self._started = True
        return next(self._losses)

    def close(self) -> None:
        """Stop the loop (what it has in flight too); a loop closed on purpose is not warned of."""
        self._started = True
        self._losses.close()

    def __del__(self) -> None:
        if not self._started:
            warnings.warn(
                f"pipe.train_steps(...) made at {self._made_at} was never iterated, so it trained nothing: the loop "
                "reads its batches and steps the optimizer as its losses are asked for.\nHow to fix: iterate it "
                "(for loss in pipe.train_steps(...): ...), or, to discard the losses, "
                "collections.deque(pipe.train_steps(...), maxlen=0).",
                RuntimeWarning,
                stacklevel=2,
            )


def _call_site() -> str:
    """'file:line' of the first frame outside fxpipe: where the caller made the loop."""
    frame = sys._getframe(1)
    while frame.f_back is not None and is_ours(frame.f_code.co_filename):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _loop(
    pipe: PipelineLike, source: Iterator[Any], loss_fn: Any, optimizer: torch.optim.Optimizer, reduction: str,
    after_backward: Hook, after_step: Hook,
) -> Generator[torch.Tensor, None, None]:
    placement = pipe._compiled.placement
    for index in itertools.count():
        batch = _next_batch(source, index, placement)
        if batch is None:
            return
        args, kwargs, target = _unpacked(batch, index)
        yield _one_step(pipe, index, args, kwargs, target, loss_fn, optimizer, reduction, after_backward, after_step)


def _unpacked_batches(source: Iterator[Any]) -> Iterator[tuple[int, tuple[Any, ...], dict[str, Any], Any]]:
    for index, batch in enumerate(source):
        yield (index, *_unpacked(batch, index))


def _noted(losses: Generator[torch.Tensor, None, None]) -> Generator[torch.Tensor, None, None]:
    """The overlapping loop's losses; a failure says which updates the parameters hold: those of
    every batch whose loss was given, and no other (the loop completes the last, drops the rest)."""
    given = 0
    try:
        for loss in losses:
            given += 1
            yield loss
    except BaseException as error:
        if not isinstance(error, GeneratorExit) and not getattr(error, "fxpipe_loop_not_started", False):
            whole = getattr(error, "fxpipe_failed_update", given)  # an update that failed is held in part
            held = "no update" if whole == 0 else "the update of batch 0" if whole == 1 else f"the updates of batches 0 to {whole - 1}"
            if whole < given:
                held = ("" if whole == 0 else f"{held} whole, and ") + f"batch {whole}'s update in part (above)"
            first, dropped = getattr(error, "fxpipe_dropped", (given, 0))
            which = f"batch {first}" if dropped == 1 else f"batches {first} to {first + dropped - 1}"
            ahead = f" {which.capitalize()}, read ahead, went untrained (dropped with the loop)." if dropped else ""
            error.add_note(f"train_steps (schedule='2bw'): {given} loss{'' if given == 1 else 'es'} {'was' if given == 1 else 'were'} given; the parameters hold {held}.{ahead}")
        raise
    finally:
        losses.close()  # a loop stopped early stops what it has in flight (see fxpipe/overlapped_steps.py)


def _one_step(
    pipe: PipelineLike, index: int, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, loss_fn: Any,
    optimizer: torch.optim.Optimizer, reduction: str, after_backward: Hook, after_step: Hook,
) -> torch.Tensor:
    """One batch. Across processes `train_step` fails on every rank or on none; what runs on each
    rank alone after it (the hooks, the optimizer's step) is agreed on before the loop goes on:
    after_backward before any rank updates, the update and after_step before the loss is given."""
    placement: Optional[RankPlacement] = pipe._compiled.placement
    before = as_before(index)
    try:
        optimizer.zero_grad()
        loss = pipe.train_step(*args, target=target, loss_fn=loss_fn, reduction=reduction, **kwargs)
        if after_backward is not None:
            ran_on_every_rank(placement, "after_backward", index, _failure_of(after_backward))
    except BaseException as error:
        error.add_note(f"train_steps: batch {index} failed before its update; {before}.")
        raise
    stepped = _failure_of(optimizer.step)
    failure = stepped if stepped is not None or after_step is None else _failure_of(after_step)
    try:
        ran_on_every_rank(placement, "the optimizer's step or after_step", index, failure, "the optimizer's step" if stepped is not None else "after_step")
    except BaseException as error:
        if stepped is not None:
            error.add_note(
                f"train_steps: the optimizer's step on batch {index} failed; parameters it reached first may hold "
                f"their update while others do not (an optimizer's step is not undone); {before} otherwise."
            )
        elif failure is not None:
            error.add_note(f"train_steps: after_step failed after batch {index}'s update, which the parameters hold.")
        else:
            error.add_note(f"train_steps: this rank's parameters hold batch {index}'s update (a rank whose optimizer's step failed may hold part of it).")
        raise
    return loss


def _failure_of(call: Callable[[], Any]) -> Optional[BaseException]:
    """What `call()` raised, or None."""
    try:
        call()
    except BaseException as error:  # noqa: BLE001 - raised once the other ranks know of it
        return error
    return None


def _next_batch(source: Iterator[Any], index: int, placement: Optional[RankPlacement]) -> Optional[Any]:
    """The next batch, or None at the end; across processes, every rank reaches the end (or a
    failure of its batches) at the same batch, or every rank raises."""
    failure: Optional[BaseException] = None
    batch: Any = _END
    try:
        refuse_without_gradients(index)  # (before the batch is read: the caller's loop may go on)
    except RuntimeError as error:  # told to the other ranks, then raised here
        failure = error
        error.add_note(f"train_steps: {as_before(index)}.")
    if failure is None:
        try:
            batch = next(source, _END)
        except BaseException as error:  # noqa: BLE001 - told to the other ranks, then raised here
            failure = error
            error.add_note(f"train_steps: the batches raised before batch {index}; {as_before(index)}.")
    if placement is not None:
        said = read_or_failed("end" if batch is _END else "batch", failure)
        agree_on_the_next_batch(gathered(said, placement, f"train_steps' batch {index}", LOOP_LATE), index, failure)
    if failure is not None:
        raise failure
    return None if batch is _END else batch


_END = object()


def _unpacked(batch: Any, index: int) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """A batch `(inputs, target)` as train_step's arguments: inputs a tensor, a tuple or list
    of positional inputs, or a dict (any mapping) of keyword inputs."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        kind = f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list)) else f"a {type(batch).__name__}"
        raise TypeError(
            f"train_steps takes (inputs, target) pairs, and batch {index} is {kind}.\nHow to fix: yield "
            "(x, y) from the batches; inputs may be a tensor, a tuple of the forward's positional inputs, "
            "or a dict of its keyword inputs; target is None for a model that returns its own loss."
        )
    inputs, target = batch
    if isinstance(inputs, Mapping):  # a dict, or a mapping of another type (Hugging Face's BatchEncoding)
        return (), dict(inputs), target
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}, target
    return (inputs,), {}, target


def _needs_a_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step` must be given a closure (LBFGS evaluates the loss again)."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def _refuse_bad_arguments(batches: Any, optimizer: Any, reduction: str, after_backward: Any, after_step: Any) -> None:
    problems = []
    if not isinstance(batches, Iterable):
        problems.append(f"batches must be an iterable of (inputs, target) pairs, not a {type(batches).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        problems.append(
            f"optimizer must be a torch.optim.Optimizer over the pipeline's parameters, not a {type(optimizer).__name__}"
        )
    elif _needs_a_closure(optimizer):
        problems.append(
            f"{type(optimizer).__name__}.step needs a closure that evaluates the loss again, which train_steps does not "
            "give: write the loop, `for x, y in batches: optimizer.step(lambda: (optimizer.zero_grad(), "
            "pipe.train_step(x, target=y, loss_fn=loss_fn))[1])`"
        )
    if reduction not in ("mean", "sum"):
        problems.append(f"reduction must be 'mean' or 'sum', not {reduction!r}")
    for name, hook in (("after_backward", after_backward), ("after_step", after_step)):
        if hook is not None and not callable(hook):
            problems.append(f"{name} must be a callable taking no arguments, or None, not a {type(hook).__name__}")
    if problems:
        raise TypeError(
            "train_steps cannot start:\n" + "\n".join(f"  - {p}" for p in problems)
            + "\nHow to fix: pipe.train_steps(batches, loss_fn=..., optimizer=torch.optim.SGD(pipe.parameters(), lr=...), "
            "after_backward=lambda: pipe.clip_grad_norm_(1.0), after_step=scheduler.step)."
        )
