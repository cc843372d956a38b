"""A stage's failure in a step: which stage, micro-batch and phase, what torch's error means there,
and the same error on every rank."""
from __future__ import annotations

from typing import Any, Optional, Union

from fxpipe.core.failures import Failure, RemoteFailure
from fxpipe.runtime.hints import hint_for
from fxpipe.schedules.actions import BACKWARD, FORWARD, INPUT_GRAD, RECOMPUTE, WEIGHT_GRAD, Action


class StageError(RuntimeError):
    """An exception raised inside a stage; `__cause__` is the original. Across processes, `rank`
    is the rank the stage ran on, and every rank raises the same error."""

    def __init__(
        self, stage: int, micro_batch: int, phase: str, error: Union[BaseException, str], rank: Optional[int] = None, micro_batches: int = 2,
        one_of: int = 0,
    ) -> None:
        """`error`: what the stage raised, or what it said (a StageError unpickled); the step ran
        `micro_batches`, which some hints need more than one of; `one_of`: the micro-batch held
        one sample of a call of this many (0: more than one, or not known)."""
        where = f"stage {stage}" if rank is None else f"stage {stage} (rank {rank})"
        if isinstance(error, str):
            detail = error
        elif isinstance(error, RemoteFailure):
            detail = error.failure.error
        else:
            hint = hint_for(error, micro_batches)
            if not hint and one_of and phase == "forward":
                hint = (f"\nThis micro-batch holds one sample of the call's {one_of}. If the plain model runs the whole "
                        "batch, code that drops the batch dim of a single sample (squeeze(), h.chunk(2) over the batch, a view "
                        "sized by another dim) may be what fails on it.\nHow to fix, then: a batch that gives every micro-batch "
                        "two samples or more (fewer chunks), or code that keeps the batch dim (squeeze(-1)).")  # fmt: skip
            notes = "".join(f"\n{note}" for note in getattr(error, "__notes__", ()) if isinstance(note, str))  # (said across ranks too)
            detail = f"{type(error).__name__}: {error}{hint}{notes}"
        super().__init__(f"{where} failed on micro-batch {micro_batch} in {phase}: {detail}")
        self.stage, self.micro_batch, self.phase, self.rank, self.detail = stage, micro_batch, phase, rank, detail

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (multiprocessing hands errors back that way) with what it says; its cause,
        # which may not pickle, is not.
        return type(self), (self.stage, self.micro_batch, self.phase, self.detail, self.rank), _picklable_state(self)

    def failure(self, rank: Optional[int] = None) -> Failure:
        """What the other ranks are told of it; `rank` is where it struck where the error does
        not say (raised in one process)."""
        struck = self.rank if self.rank is not None else rank
        assert struck is not None, "a stage's failure names its rank"
        return Failure(struck, self.stage, self.micro_batch, self.phase, self.detail)


def raised_here(failure: Failure) -> Exception:
    """The error this rank raises for a failure on another: that stage's StageError, or, for a
    failure outside any stage (a rank lost at the end of a step), a RuntimeError that says so."""
    if failure.stage < 0:
        return RuntimeError(failure.describe())
    return StageError(failure.stage, failure.micro_batch, failure.phase, RemoteFailure(failure), rank=failure.rank)


def _picklable_state(error: BaseException) -> dict[str, Any]:
    """An error's own attributes (its notes among them) but those the constructor sets."""
    return {k: v for k, v in error.__dict__.items() if k not in ("stage", "micro_batch", "phase", "rank", "detail")}


class LossError(Exception):
    """The loss function raised (the cause)."""


PHASES = {FORWARD: "forward", RECOMPUTE: "backward", BACKWARD: "backward", INPUT_GRAD: "backward", WEIGHT_GRAD: "backward"}


_RECOMPUTING = (
    "(Raised as the stage ran this micro-batch's forward again for its backward: checkpointing recomputes the "
    "forward, so the model's forward code runs twice for a checkpointed micro-batch.)"
)


def phase_and_cause(action: Action, error: BaseException) -> tuple[str, BaseException]:
    """Where `error`, raised by `action`'s task, struck, and the error to report: a loss
    function's own error, in the phase 'loss'; one the forward's recompute raised, noted so."""
    if isinstance(error, LossError):
        return "loss", error.__cause__ if error.__cause__ is not None else error
    if action.kind == RECOMPUTE and _RECOMPUTING not in getattr(error, "__notes__", ()):
        error.add_note(_RECOMPUTING)
    return getattr(error, "fxpipe_phase", PHASES[action.kind]), error  # (an interrupt in the loss says so)


def marked(action: Action, error: BaseException) -> BaseException:
    """`error` with where it struck, for the other ranks' message (distributed.failing_together)."""
    phase = getattr(error, "fxpipe_phase", PHASES[action.kind])  # (an interrupt in the loss says so)
    error.fxpipe_where = (action.stage, action.micro_batch, phase)  # type: ignore[attr-defined]
    return error
