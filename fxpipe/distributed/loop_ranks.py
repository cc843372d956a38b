"""The ranks of a loop whose steps overlap (2BW) agreeing batch by batch: before each batch runs, and at its end before any rank updates on it.

Each rank's stage thread runs its list of actions without a flush; the caller's thread of every
rank meets the others four times per batch, on the world's group (the stage threads' values
travel on the pipeline's own groups meanwhile):

    start(t)      every rank read batch t and made the same call of it, or every rank's batches
                  ended there, or every rank raises: nothing of batch t runs before
    finish(t)     every rank ran its actions of batch t, or every rank raises; the loss rank
                  hands over the loss (and the caller's generator as its loss_fn left it), and
                  the ranks that hold a tied weight sum their gradients of it, in rank order:
                  the same bits on each
    hooks_ran(t)  every rank's after_backward ran: no rank updates on batch t unless every
                  rank does
    code_ran(t)   every rank's code after the loss of batch t left what the update of batch t
                  reads as a synchronous loop's step would have read it, or every rank raises;
                  and the copies of each tied weight, all holding batch t - 1's update now,
                  are alike (a rank that stepped its copy apart is heard of a batch late)

A rank meets the others at finish(t) once its own actions of batch t are done, while its stage
thread goes on with batch t + 1, and its update of batch t comes only before its first forward of
batch t + 2: by then every rank is done with batch t (chunks >= depth), so no stage waits there.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

from fxpipe.compiled.placement import RankPlacement
from fxpipe.core.failures import Failure
from fxpipe.distributed.rank_call import Host, first_line, refuse_calls_that_differ, refuse_tied_copies_that_differ, tied_fingerprints
from fxpipe.distributed.ranks import LOOP_LATE, gathered, holders, summed_in_rank_order
from fxpipe.runtime.stage_error import StageError, raised_here

TiedParts = dict[int, tuple[bool, Optional[torch.Tensor]]]  # by place among the program's parameters
TiedSums = dict[int, list[tuple[bool, Optional[torch.Tensor]]]]  # every holder's part, in rank order
Told = tuple[str, Optional[Failure]]  # a rank's failure in words ("" for none), and where, for a stage's


def as_before(index: int) -> str:
    return "the parameters are as the loop was given them" if index == 0 else f"the parameters are those after batch {index - 1}'s update"


# Where a 2bw loop stops while it reads a batch: it completes the update of the last loss given.
OVERLAPPED = "the parameters hold the updates of the batches whose losses were given (the loop's note says which)"


def read_or_failed(said: str, failure: Optional[BaseException]) -> str:
    """What a rank says of the batch it read: "batch", "end", or "failed: " and its error's first line."""
    return said if failure is None else f"failed: {first_line(failure)}"


def agree_on_the_next_batch(said: list[str], index: int, failure: Optional[BaseException], held: str = "") -> None:
    """What every rank said of its batch `index` ("batch", "end" or "failed: why", in rank
    order): all a batch, or all the end, or every rank raises, saying what the parameters hold
    (`held`; by default, a synchronous loop's: the updates of the batches before)."""
    words = [word.partition(": ")[0] for word in said]
    if failure is not None or len(set(words)) == 1:
        return
    held = held or as_before(index)
    failed = [rank for rank, word in enumerate(words) if word == "failed"]
    if failed:
        why = "; ".join(f"rank {rank}: {said[rank].partition(': ')[2]}" for rank in failed)
        raise RuntimeError(
            f"train_steps: rank(s) {failed} failed as they read batch {index} ({why}: their batches raised, or the loop "
            f"was refused there); {held} on every rank."
        )
    ended = [rank for rank, word in enumerate(words) if word == "end"]
    raise ValueError(
        f"train_steps: the batches of rank(s) {ended} ended after {index} batches, where the other ranks' went on; "
        f"{held} on every rank.\nHow to fix: give every rank the same batches (each rank's stages "
        "run on the same batch), and as many."
    )


def ran_on_every_rank(
    placement: Optional[RankPlacement], what: str, index: int, failure: Optional[BaseException], where: str = "",
) -> None:
    """`what` (the caller's code, run on each rank alone) ran on every rank for batch `index`, or
    every rank raises: this one `failure` (in `where`, a part of `what`), its own, the others an
    error naming the ranks that failed and how. In one process (`placement` None) `failure` is
    raised as it is."""
    told = f"{where + ': ' if where else ''}{first_line(failure)}" if failure is not None else ""
    said = [] if placement is None else gathered(told, placement, f"{what} of train_steps' batch {index}", LOOP_LATE)
    if failure is not None:
        raise failure
    failed = {rank: text for rank, text in enumerate(said) if text}
    if failed:
        raise RuntimeError(
            f"train_steps: {what} of batch {index} failed on rank(s) {sorted(failed)}: "
            + "; ".join(f"rank {rank}: {text}" for rank, text in failed.items()) + " (their own output says more)."
        )


class LoopRanks:
    """This rank's side of the agreements of one loop."""

    def __init__(self, host: Host, placement: RankPlacement) -> None:
        self.host, self.placement = host, placement
        self.me, self.ranks = host.channel.me, host.channel.ranks  # global rank per pipeline coordinate
        self.global_rank = self.ranks[self.me]

    def _gathered(self, payload: Any, what: str) -> dict[int, Any]:
        """Every rank's `payload`, by pipeline coordinate."""
        every = gathered(payload, self.placement, what, LOOP_LATE)
        return {coord: every[rank] for coord, rank in enumerate(self.ranks)}

    def start(self, index: int, said: str, call: Optional[dict[str, Any]], failure: Optional[BaseException]) -> None:
        """Batch `index`: read on every rank ("batch", with `call` its signature), or the end on
        every rank, or every rank raises (`failure`, this rank's own error, first)."""
        got = self._gathered((said, call), f"train_steps' batch {index}")
        agree_on_the_next_batch([got[coord][0] for coord in sorted(got)], index, failure, OVERLAPPED)
        if failure is not None:
            raise failure
        if said == "batch":  # tied copies are compared here on the first batch, later in code_ran: here their updates may be apart in time
            refuse_calls_that_differ(self.host, {coord: c for coord, (_, c) in got.items()}, tied=index == 0)

    def finish(
        self, index: int, failure: Optional[BaseException], loss: Optional[torch.Tensor], tied: TiedParts, drawn: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, TiedSums, Optional[torch.Tensor]]:
        """Batch `index` done on every rank, or every rank raises (`failure` first): the loss,
        every holder's part of each tied weight this rank holds (in rank order), and the
        caller's generator as the loss rank's `loss_fn` left it (None: it drew nothing)."""
        got = self._gathered((_told(failure), loss, tied, drawn), f"the end of train_steps' batch {index}")
        self._raise_if_any_failed(index, {coord: told for coord, (told, *_) in got.items()}, failure, "")
        loss_coord = self.host.program().layout.ranks[self.host.program().layout.loss_stage]
        parts = {k: [got[coord][2][k] for coord in sorted(got) if k in got[coord][2]] for k in tied}
        return got[loss_coord][1], parts, got[loss_coord][3]

    def hooks_ran(self, index: int, failure: Optional[BaseException]) -> None:
        """`after_backward` ran on every rank for batch `index`, or every rank raises: no rank
        updates on the batch unless every rank's hook ran."""
        got = self._gathered(_told(failure), f"after_backward of train_steps' batch {index}")
        self._raise_if_any_failed(index, got, failure, " in after_backward")

    def code_ran(self, index: int, failure: Optional[BaseException]) -> None:
        """The caller's code after the loss of batch `index` ran on every rank without a refusal,
        or every rank raises: no rank updates on the batch unless every rank does; then the
        copies of each tied weight, which all hold batch `index - 1`'s update, compared."""
        tied = tied_fingerprints(self.host, self.host.program()) if index >= 1 else {}
        got = self._gathered((_told(failure), tied), f"the code after the loss of train_steps' batch {index}")
        self._raise_if_any_failed(index, {coord: told for coord, (told, _) in got.items()}, failure, " in the code after its loss")
        if index >= 1:
            refuse_tied_copies_that_differ({self.ranks[coord]: fingerprints for coord, (_, fingerprints) in got.items()}, after=index - 1)

    def _raise_if_any_failed(self, index: int, said: dict[int, Told], failure: Optional[BaseException], where: str) -> None:
        if failure is not None:
            raise failure
        stages = [stage for _, (_, stage) in sorted(said.items()) if stage is not None]
        if stages:  # a stage's failure, heard here late (a batch after the one it struck): the same error
            raise raised_here(stages[0])
        failed = {self.ranks[coord]: text for coord, (text, _) in sorted(said.items()) if text}
        if failed:
            # At a batch's end the update of the batch before it runs, and its after_step.
            what = f"batch {index}" + ("" if where or not index else f" (or the update of batch {index - 1}, or its after_step, run as it ended)")
            raise RuntimeError(
                f"train_steps (schedule='2bw'): {what} failed{where} on rank(s) {sorted(failed)}: "
                + "; ".join(f"rank {rank}: {text}" for rank, text in failed.items()) + " (their own output says more)."
            )


def _told(failure: Optional[BaseException]) -> Told:
    """A failure as the other ranks are told of it: its type and first line ("" for none), and,
    for a stage's, where it struck, which every rank raises as the same StageError."""
    if failure is None:
        return "", None
    stage = failure.failure() if isinstance(failure, StageError) and failure.rank is not None else None
    return first_line(failure), stage


def tied_parts(program: Any, params: Sequence[nn.Parameter], grads: Sequence[Optional[torch.Tensor]], me: int) -> TiedParts:
    """This rank's gradient of each parameter other ranks read too, and whether it trains here."""
    mine = {id(p): (True, g) for p, g in zip(params, grads)}
    return {
        k: mine.get(id(p), (False, None))
        for k, (p, ranks) in enumerate(zip(program.parameters, holders(program, program.parameters)))
        if me in ranks and len(ranks) > 1
    }


def summed_tied(
    program: Any, params: Sequence[nn.Parameter], grads: list[Optional[torch.Tensor]], parts: TiedSums, owner: nn.Module,
) -> list[Optional[torch.Tensor]]:
    """`grads` with each tied weight's the sum of every holder's part, added in rank order."""
    summed = {id(p): g for p, g in zip(params, grads)}
    for k, held in parts.items():
        p = program.parameters[k]
        if len({trains for trains, _ in held}) > 1:
            name = next((n for n, q in owner.named_parameters(remove_duplicate=False) if q is p), f"parameter {k}")
            raise ValueError(
                f"{name!r} is read on several ranks and requires grad on some of them only.\nHow to fix: set "
                "requires_grad alike on every rank that holds it (through the model, or pipe.named_parameters())."
            )
        present = [g.to(p.device) for _, g in held if g is not None]
        summed[id(p)] = summed_in_rank_order(present)
    return [summed[id(p)] for p in params]
