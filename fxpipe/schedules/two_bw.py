"""PipeDream-2BW's schedule: 1F1B over the micro-batches of many batches, with no flush between them.

Micro-batch i of batch t is global micro-batch g = t * m + i. Every stage runs 1F1B over the
global micro-batches, and its update of batch t, U(t), right before its first forward of batch
t + 2 (at the end of the list for the last two batches). For 2 stages and m = 2 (columns are
turns, not times):

    worker 0: F0 F1 F2 B0 F3 B1 U0 F4 B2 F5 B3 U1 F6 B4 F7 B5 B6 B7 U2 U3
    worker 1: F0 B0 F1 B1 F2 B2 F3 B3 U0 F4 B4 F5 B5 U1 F6 B6 F7 B7 U2 U3

A stage with stages after it runs one forward more before its first backward than 1F1B's
minimum (worker 0 above: F2 before B0). With no flush, the stages stay busy together for the
whole loop, and the slowest one sets its pace: the last, which computes the loss, or any stage
a little behind the rest. With one forward in hand, the stage after this one finds its next
input ready when it ends a backward, however late this stage's forward ran (its update, a slower
kernel), where 1F1B's minimum leaves it no slack. The cost is one micro-batch's activations more
on each such stage, which the plan's memory counts (`two_bw_step`).

With m at least the stages after a stage on the longest path plus one (chunks >= depth), a
stage's first forward of batch t comes after its U(t - 2) and before its U(t - 1): batch t runs on
the weights W(t - 1), which U(t - 1) turns into W(t) once batch t has started. The stage keeps
W(t - 1) for batch t's in-flight micro-batches and updates the newest: two versions.
"""
from __future__ import annotations

from fxpipe.schedules.actions import BACKWARD, FORWARD, RECOMPUTE, Action, Layout, by_rows, one_f_one_b
from fxpipe.schedules.timeline import UPDATE  # an update: Action(UPDATE, stage, batch)


def two_bw_step(layout: Layout, m: int) -> list[list[Action]]:
    """One batch alone in 2bw's order (a `train_step`, and the plan's memory and time): 1F1B
    with one forward more in hand on every stage that has stages after it."""
    return one_f_one_b(layout, m, ahead=1)


def two_bw(layout: Layout, m: int, batches: int, checkpointed: int = 0, slices: int = 1) -> list[list[Action]]:
    """Per worker, the actions of `batches` batches of `m` micro-batches each (global indices;
    the first `checkpointed` of each batch recompute before their backward). With `slices` per
    row (slices of a sequence), 1F1B runs over the rows, each made its slices (`by_rows`)."""
    refuse_too_few_micro_batches(layout, m // slices)
    streams = by_rows(two_bw_step(layout, m // slices * batches), slices)
    streams = [_with_recompute_per_batch(acts, m, checkpointed) for acts in streams]
    out = []
    for stage, acts in enumerate(streams):  # one stage per worker (1F1B's own rule)
        row: list[Action] = []
        for action in acts:
            if action.kind == FORWARD and action.micro_batch % m == 0 and action.micro_batch >= 2 * m:
                row.append(Action(UPDATE, action.stage, action.micro_batch // m - 2))
            row.append(action)
        row += [Action(UPDATE, stage, t) for t in range(max(0, batches - 2), batches)]
        out.append(row)
    return out


def _with_recompute_per_batch(actions: list[Action], m: int, checkpointed: int) -> list[Action]:
    """R(g) right before the B of each global micro-batch g whose index within its batch is
    below `checkpointed`."""
    out = []
    for action in actions:
        if action.kind == BACKWARD and action.micro_batch % m < checkpointed:
            out.append(Action(RECOMPUTE, action.stage, action.micro_batch))
        out.append(action)
    return out


def segment(streams: list[list[Action]], m: int, batch: int) -> list[int]:
    """Per worker, how many leading actions do not wait on batch `batch + 1` being known: all
    before its first forward of that batch or its update of batch `batch - 1`, which the lists of
    every later length share."""
    cuts = []
    for acts in streams:
        cut = len(acts)
        for k, a in enumerate(acts):
            if (a.kind == UPDATE and a.micro_batch >= batch - 1) or (a.kind == FORWARD and a.micro_batch >= (batch + 1) * m):
                cut = k
                break
        cuts.append(cut)
    return cuts


def refuse_too_few_micro_batches(layout: Layout, m: int) -> None:
    if m < layout.depth:
        raise ValueError(
            f"schedule='2bw' needs at least as many micro-batches as the pipeline is deep ({layout.depth} stages on "
            f"its longest path), and chunks={m}: a stage would start batch t + 1 before its update of batch t - 1, on "
            f"weights it no longer keeps.\nHow to fix: compile with chunks={layout.depth} or more, and give each batch at "
            f"least {layout.depth} samples (the slices of one sequence, with sequence_chunks, count as one: a batch of "
            "one sequence runs under a synchronous schedule, pipe.train_step with schedule='1f1b')."
        )
