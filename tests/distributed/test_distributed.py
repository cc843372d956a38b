"""Across processes (gloo on 127.0.0.1): one stage per rank, every schedule, the plain model's
loss and gradients; failures on one rank raised on all of them, in bounded time."""
from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch

import distributed_cases as cases
from helpers import FanOut, covering
from fxpipe import compile_pipeline
from spawn_ranks import results_of, spawn_ranks

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
MODES = ("always", "except_last", "never")
TOL = 1e-10
# Random graphs per feature in the sweep below; FXPIPE_DISTRIBUTED_SEEDS=10 searches harder.
SEEDS = int(os.environ.get("FXPIPE_DISTRIBUTED_SEEDS", "1"))

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")


def test_every_schedule_and_mode_gives_the_plain_models_loss_and_gradients() -> None:
    """Every case on one group of three processes, started once (a fixture shared by several
    tests would start it once per test process). Each model runs every schedule and every mode,
    and the models together every (schedule, mode) (helpers.covering); one process runs the first
    three in all of them in tests/runtime/test_train_step.py. Then: the stage DAG is shallower
    than its stage count on every rank, and each rank holds its own stages' state."""
    matrix: list[tuple[str, ...]] = covering(["unet", "gpt", "fan_out", "dag_1", "dag_2"], [SCHEDULES], MODES)
    # Receives posted only when read (the NCCL path), under the schedules whose orders of sends
    # and receives interleave most: stages per device, and the I/W split.
    matrix += [("unet", s, "except_last", "posted when read") for s in ("interleaved-1f1b", "zb-h1")]
    matrix += [("branches", s, MODES[k % 3]) for k, s in enumerate(SCHEDULES)]
    three_ranks = results_of(spawn_ranks(cases.train_cases, 3, matrix, timeout=400))
    for name in ("unet", "gpt", "fan_out", "dag_1", "dag_2", "branches"):
        reports = _reports(three_ranks, name)
        assert reports, name
        for per_rank in reports:
            _check_case(per_rank)
    _check_the_dag_is_shallower(_reports(three_ranks, "branches"))
    _check_each_rank_holds_its_own(_reports(three_ranks, "gpt"))


def test_compiled_stages_across_two_processes() -> None:
    """compile_stages on each rank's stages, under zb-h1 (a compiled stage's I computes every
    gradient) and except_last: a value with skips to several stages (tied weights compiled are
    in tests/compiled/test_compiled_stages.py)."""
    per_rank = results_of(spawn_ranks(cases.train_cases, 2, [("fan_out", "zb-h1", "except_last", "compiled")], timeout=300))
    reports = [report[0] for report in per_rank]
    assert reports[0]["losses"] == reports[1]["losses"]
    for got, expected in zip(reports[0]["losses"], reports[0]["expected"]):
        assert abs(got - expected) <= TOL
    for rank, report in enumerate(reports):
        assert not report["missing"], f"rank {rank} has no gradient for {report['missing']}"
        assert max(report["grads"].values(), default=0.0) <= TOL, f"rank {rank}: {report['grads']}"


def _reports(three_ranks: list[list[dict[str, Any]]], name: str) -> list[tuple[dict[str, Any], ...]]:
    return [per_rank for per_rank in zip(*three_ranks) if per_rank[0]["case"][0] == name]


def _check_case(per_rank: tuple[dict[str, Any], ...]) -> None:
    """One case's losses, gradients, outputs and state keys on every rank."""
    case = per_rank[0]["case"]
    losses = [r["losses"] for r in per_rank]
    assert all(loss == losses[0] for loss in losses), f"{case}: ranks returned different losses {losses}"
    for got, expected in zip(losses[0], per_rank[0]["expected"]):
        assert abs(got - expected) <= TOL, f"{case}: loss {got} != {expected}"
    checked: set[str] = set()
    for rank, report in enumerate(per_rank):
        assert not report["missing"], f"{case}: rank {rank} has no gradient for {report['missing']}"
        worst = max(report["grads"].values(), default=0.0)
        assert worst <= TOL, f"{case}: rank {rank}: gradient differs by {worst}"
        checked |= set(report["grads"])
    assert checked == set(per_rank[0]["names"]), f"{case}: no rank holds {set(per_rank[0]['names']) - checked}"
    outputs = [r["out_error"] for r in per_rank]
    assert outputs[:-1] == [None] * (len(outputs) - 1) and outputs[-1] is not None and outputs[-1] <= TOL, (case, outputs)
    keys = [set(r["state_keys"]) for r in per_rank]
    assert set().union(*keys) == set(per_rank[0]["all_state_keys"]), f"{case}: a state key is on no rank"
    assert sum(map(len, keys)) < 2 * len(per_rank[0]["all_state_keys"]), f"{case}: ranks hold far more than their part"


def _check_the_dag_is_shallower(reports: list[tuple[dict[str, Any], ...]]) -> None:
    """Three feature towers on the mesh, cut with stage_graph='dag': the plan is shallower than
    its stage count on every rank, and the same on each."""
    assert reports
    for per_rank in reports:
        depths = {(r["depth"], r["stages"]) for r in per_rank}
        assert len(depths) == 1, depths
        depth, stages = depths.pop()
        assert depth < stages, (per_rank[0]["case"], depth, stages)


def _check_each_rank_holds_its_own(reports: list[tuple[dict[str, Any], ...]]) -> None:
    """State keys are the model's own, split between the ranks; only tied weights are on two."""
    assert reports
    for per_rank in reports:
        keys = [set(r["state_keys"]) for r in per_rank]
        shared = (keys[0] & keys[1]) | (keys[1] & keys[2]) | (keys[0] & keys[2])
        assert shared <= {"tok_emb.weight", "head.weight"}, (per_rank[0]["case"], shared)


def test_a_forward_that_fails_on_a_later_rank_leaves_the_earlier_rank_s_buffers_as_they_were() -> None:
    got = results_of(spawn_ranks(cases.failing_forward, 2, timeout=120))
    assert all("marked row reached the check" in r["error"] for r in got), [r["error"] for r in got]
    assert [r["holds"] for r in got] == [True, False], "the first stage's rank holds the counter"
    assert all(r["put_back"] for r in got), "the counter and the running statistics are as before the call"


@pytest.mark.parametrize("layout", ["pp", "pp-untied", "dp"])
def test_a_sparse_embedding_s_gradient_crosses_ranks_as_the_plain_model_s(layout: str) -> None:
    got = results_of(spawn_ranks(cases.sparse_embeddings, 2, layout, timeout=120))
    assert all(r["grads"] <= TOL for r in got), [r["grads"] for r in got]
    if layout == "dp":  # each replica's own sparse gradient, averaged, stays sparse as DDP keeps it
        assert all(r["sparse"] == ["emb.weight"] for r in got), got
    if layout == "pp-untied":  # clipping takes no sparse gradient, as torch's does not: every rank says so at once
        assert all("clip_grad_norm_ got sparse gradients" in r["clipped"] and r["took"] < 10 for r in got), got
    if layout == "pp":  # (the tied weight's gradient is dense: the head's adds to the embedding's)
        assert [r["clipped"] for r in got] == ["no error"] * 2, got


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_an_exception_on_one_rank_is_raised_on_every_rank(schedule: str) -> None:
    got = results_of(spawn_ranks(cases.failing_step, 2, schedule, timeout=120))
    errors = [r["error"] for r in got]
    assert all(e is not None for e in errors), errors
    assert len({e[0] for e in errors}) == 1, f"ranks raised different errors: {errors}"
    text, stage, micro_batch, phase, rank = errors[0]
    assert (micro_batch, phase) == (2, "forward") and "marked row reached the check" in text, text
    assert f"stage {stage} (rank {rank})" in text
    assert all(r["took"] < 15 for r in got), [r["took"] for r in got]
    assert len({r["next_loss"] for r in got}) == 1, "the next step runs, with one loss on every rank"
    assert abs(got[0]["next_loss"] - got[0]["expected"]) <= TOL, "the failed step left the model as it was"
    assert got[-1]["held"], "the last rank, which runs the loss, holds the temperature's gradient"
    assert all(r["put_back"] for r in got), "the failed step left the temperature's gradient and the counter as they were"
    # A KeyboardInterrupt: bare on its rank, and the others name where it struck.
    interrupted = [r["interrupted"] for r in got]
    assert interrupted.count("KeyboardInterrupt: ") == 1, interrupted
    named = [text for text in interrupted if text != "KeyboardInterrupt: "]
    assert all(f"stage {stage} (rank {rank}) failed on micro-batch 2 in forward: KeyboardInterrupt" in text for text in named), named
    in_loss = [r["in_loss"] for r in got]
    assert in_loss.count("KeyboardInterrupt: ") == 1 and all("failed on micro-batch 0 in loss: KeyboardInterrupt" in t for t in in_loss if t != "KeyboardInterrupt: "), in_loss


def test_clip_grad_norm_clips_by_the_norm_of_every_ranks_gradients() -> None:
    """Each rank alone would clip by its own part of the norm, unlike the plain model, and the
    copies of a tied weight would drift apart."""
    ranks = results_of(spawn_ranks(cases.clipped, 2, timeout=180))
    for per_rank in zip(*ranks):
        for report in per_rank:
            for got, expected in report["norms"]:
                assert abs(got - expected) <= 1e-10 * max(1.0, expected), (report["norm_type"], report["norms"])
            assert max(report["params"].values()) <= TOL, report["params"]
        assert per_rank[0]["tied"] == per_rank[1]["tied"], "the copies of the tied weight stay equal"


def test_clip_grad_norm_across_ranks_takes_every_order_and_a_nan_on_any_rank() -> None:
    """Before, norm_type=0 raised ZeroDivisionError, -inf gave the largest of the smallest entries
    (0.165 for 0.00057), and a NaN on the second rank was dropped by the max of p=inf: a finite
    norm, no error with error_if_nonfinite=True, the NaN left in its gradient alone."""
    for report in results_of(spawn_ranks(cases.clipped_by_any_norm, 2, timeout=180)):
        *clipped, dtype = report
        for found in clipped:
            if isinstance(found["plain"], str):
                assert found["pipe"] == found["plain"] == "non-finite", found
            elif math.isnan(found["plain"]):
                assert math.isnan(found["pipe"]) and math.isnan(found["grads"]), found  # every gradient NaN, as the plain model's
            else:
                assert abs(found["pipe"] - found["plain"]) <= 1e-10 * max(1.0, abs(found["plain"])), found
                assert found["grads"] <= TOL, found
        assert dtype == {"dtype": "torch.float32"}, dtype


def test_a_sharded_grad_scaler_skips_an_overflowing_step_on_every_rank() -> None:
    for log in results_of(spawn_ranks(cases.scaled, 2, timeout=120)):
        assert [(scale, expected) for scale, expected, _ in log] == [(1024.0, 1024.0), (512.0, 512.0), (512.0, 512.0)], log
        assert max(diff for _, _, diff in log) <= TOL, log


def test_a_call_that_differs_or_is_refused_on_one_rank_is_refused_on_every_rank() -> None:
    """Refused on one rank alone, a call would leave the others to pair their step with its next
    one (training on another step's targets); a batch, grad mode or mode of its own would pair
    other micro-batches, or wait for values never sent; data of its own (each rank loading its own
    batch, as under DDP) would pair one rank's inputs with another's targets, a loss no plain
    model computes (before, with no error). Another pipeline called on one rank left each rank
    waiting for the whole timeout (300 s by default), and the process group broken. One rank in
    eval mode, with a model that draws, was blamed on the ranks' generators (a call in eval mode
    draws no seed)."""
    for report in results_of(spawn_ranks(cases.calls_that_differ, 2, timeout=120)):
        refused, _ = report["a target refused on one rank"]
        assert "rank 1 failed in preparing the call" in refused or refused.startswith("the target must be split"), refused
        assert "like the inputs, along dim 0 of size 8" in refused, refused
        for what, differing in [("another batch size", "micro-batch sizes: rank 0 (2, 2, 2, 2), rank 1 (2, 2, 1, 1)"),
                                ("no_grad on one rank", "grad: rank 0 True, rank 1 False"),
                                ("eval on one rank", "mode: rank 0 ('train'"),
                                ("eval on one rank, a model that draws", "mode: rank 0 ('train'"),
                                ("a plain argument of its own", "rank 0 {'x': [((8, 6), 'float64')], 'scale': [2.0]}, rank 1 {'x': [((8, 6), 'float64')], 'scale': [3.0]}"),
                                ("autocast on one rank", "autocast: rank 0 off, rank 1 cpu torch.bfloat16"),
                                ("another reduction", "call: rank 0 train_step, reduction='mean', rank 1 train_step, reduction='sum'"),
                                ("other inputs on one rank", "data of x: rank(s) [1] differ from rank(s) [0]"),
                                ("other targets on one rank", "data of target: rank(s) [1] differ from rank(s) [0]"),
                                ("other inputs on one rank, forward", "data of x: rank(s) [1] differ from rank(s) [0]")]:  # fmt: skip
            message, _ = report[what]
            assert "the ranks of the pipeline were called differently" in message and differing in message, (what, message)
        message, _ = report["another pipeline on one rank"]  # each rank waited for the whole timeout
        assert "the ranks called different pipelines" in message and "the one compiled" in message, message
        assert "compiled 1st" in message and "compiled 2nd" in message and "same order on every rank" in message, message
        # (before, two values swapped or one 1e-9 apart went through, 1.2e-2 and 1.2e-10 from the plain model)
        for what in ("tied copies apart, forward", "tied copies apart, step", "tied copies two values swapped, step", "tied copies 1e-9 apart, step"):
            message, _ = report[what]
            assert "the copies of a tied parameter differ" in message and "'a.weight', held on ranks [0, 1]" in message, (what, message)
        calls = ["a target refused on one rank", "another batch size", "no_grad on one rank", "eval on one rank", "eval on one rank, a model that draws",
                 "a plain argument of its own", "autocast on one rank",
                 "another reduction", "other inputs on one rank", "other targets on one rank", "other inputs on one rank, forward", "another pipeline on one rank",
                 "tied copies apart, forward", "tied copies apart, step"]  # fmt: skip
        assert all(report[what][1] < 10 for what in calls), report
        assert report["grads after"] == [], "no refused call left a gradient"
        assert report["next step"] <= TOL


def test_a_pipeline_dropped_after_a_refused_call_leaves_the_next_one_exact() -> None:
    for found in results_of(spawn_ranks(cases.dropped_after_refusal, 2, timeout=120)):
        assert max(found) <= TOL, found


@pytest.mark.parametrize("name", list(cases.EXPORTED))
def test_a_model_captured_by_torch_export_trains_across_processes_each_rank_holding_its_own(name: str) -> None:
    first, second = results_of(spawn_ranks(cases.exported_across, 2, name, timeout=120))
    for report in (first, second):
        assert "torch.export" in report["note"], report["note"]
        assert report["loss"] <= TOL and report["grads"] <= TOL and not report["no_grads"], report
        assert report["autocast"] <= 2e-2, "compiled under bfloat16 autocast, it trains under it"
        assert report["held"] and not set(report["held"]) & set(report["freed"]), report
        assert report["freed"] or name == "penalty", "the penalty reads every parameter on the last rank"
    assert set(first["held"]) | set(second["held"]) == set(first["held"]) | set(first["freed"])


def test_a_model_compiled_again_trains_on_the_same_cut_and_is_refused_on_another() -> None:
    """A first compile across processes frees, on each rank, the tensors of the other ranks'
    stages; another cut would run stages whose values are gone (made anew by reset_parameters,
    the model would silently train from other weights)."""
    for report in results_of(spawn_ranks(cases.compiled_again, 2, timeout=120)):
        assert report["1f1b"] <= TOL and report["zb-h1"] <= TOL, report
        refused = report["another cut"]
        assert refused.startswith("FreedState: an earlier compile_pipeline across processes freed"), refused
        assert "(on rank 1: layers.2.bias, layers.2.weight, layers.3.bias, layers.3.weight)" in refused, refused
        assert "copy.deepcopy(model)" in refused, refused
        notes = report["captured again"]
        assert len(notes) == 1 and "can no longer run whole there" in notes[0], notes


def test_a_rank_that_dies_makes_the_others_raise() -> None:
    got = spawn_ranks(cases.dying_rank, 2, timeout=120)
    assert got[1] == ("exited", 3)
    status, report = got[0]
    assert status == "ok" and report["error"] is not None, got[0]
    assert "rank 1" in report["error"] and report["took"] < 15, report


@pytest.mark.parametrize("dies", [False, True], ids=["stays-alive", "dies"])
def test_a_rank_that_never_compiles_makes_the_others_raise_within_the_timeout(dies: bool) -> None:
    got = spawn_ranks(cases.never_compiles, 2, dies, timeout=60)
    assert got[1] == ("exited", 0)
    status, report = got[0]
    assert status == "ok" and report["error"] is not None, got[0]
    assert "not every rank took part in comparing the plans" in report["error"], report
    assert "timeout=seconds" in report["error"] and report["took"] < 6, report


def test_a_meta_model_with_a_buffer_no_checkpoint_holds_is_refused_on_every_rank() -> None:
    for message in results_of(spawn_ranks(cases.unfillable_across, 2, timeout=120)):
        assert "buffers that nothing can fill (on rank 1: 2.table)" in message, message


def test_ranks_with_different_plans_refuse_naming_the_difference() -> None:
    for cut_elsewhere, wider, settings in results_of(spawn_ranks(cases.mismatched_plans, 2, timeout=120)):
        assert "compiled different plans" in cut_elsewhere and "stage 0" in cut_elsewhere and "How to fix" in cut_elsewhere, cut_elsewhere
        # Before, a layer wider on one rank compiled, and failed at the first step on a shape.
        assert "rank 1 differs from rank 0 in: stage 0, stage 1" in wider, wider
        # Before, other settings compiled and trained a mix of the two ranks' models, with no error.
        assert "rank 1 differs from rank 0 in: stage 0, stage 1" in settings, settings


def test_what_is_not_supported_across_processes_is_refused_on_every_rank() -> None:
    """And a rank left without parameters by the cut warns, before its optimizer would raise. A
    model that writes its input in place is refused: before, the loss rank read a target that
    was the input unwritten (loss 0.22 off). A weight tied across ranks that a reentrant
    checkpoint reads is refused: before, its gradient there reached one rank's copy alone. A hook
    on the model itself is refused: its output is on one rank alone."""
    for rank, errors in enumerate(results_of(spawn_ranks(cases.refusals, 2, timeout=120))):
        assert "pipe(x) runs forward only" in errors[0] and "torch.no_grad()" in errors[0], errors[0]
        assert "inputs that require grad" in errors[1], errors[1]
        assert errors[2].startswith("loss "), errors[2]
        assert "the model returns output[1], a value made from the whole batch" in errors[3], errors[3]
        assert ("this rank (1) holds none of the model's parameters" in errors[4]) == (rank == 1), errors[4]
        assert errors[5] == ("0 parameters" if rank == 1 else "2 parameters"), errors[5]
        assert "the model writes its input 'x' in place: across processes only the rank" in errors[6], errors[6]
        assert "reads emb.weight, tied to a stage on another rank" in errors[7] and "use_reentrant=False" in errors[7], errors[7]
        assert all(f in errors[8] for f in ("timeout must be a positive", "chunks must be", "checkpoint must be")), errors[8]  # before, the timeout alone
        assert errors[9] == "2 chunks", errors[9]  # before, a NumPy timeout was "not a positive number"
        assert "pipe(x) cannot run the hooks registered on the model itself (forward hook" in errors[10], errors[10]
        assert errors[11] == "ran", errors[11]  # and refusing sent nothing: the next call runs
        # A hook on one rank's model alone: train_step refuses on every rank (before, rank 1 alone,
        # and rank 0 was paired with rank 1's next call), and the next step runs.
        assert "train_step cannot run the forward pre-hooks registered on the model itself" in errors[12], errors[12]
        assert errors[13] == errors[2], (errors[13], errors[2])
        assert "loss_fn writes its target, or an input or buffer the model returns as it is, in place: across processes only" in errors[14], errors[14]
        assert errors[15] == "target as given", errors[15]


def test_devices_or_mesh_one_of_them() -> None:
    model, x = FanOut(), torch.randn(4, 6)
    with pytest.raises(ValueError, match="needs one of devices=.*and mesh="):
        compile_pipeline(model, x)

    class NotPipelined:
        mesh_dim_names = ("dp",)

    with pytest.raises(ValueError, match="(?s)dimension named .pp.*How to fix"):
        compile_pipeline(model, x, mesh=NotPipelined())
    with pytest.raises(ValueError, match="not both"):
        compile_pipeline(model, x, ["cpu"], mesh=NotPipelined())
    with pytest.raises(ValueError, match="timeout must be a positive"):
        compile_pipeline(model, x, ["cpu"], timeout=0)




def test_pipeline_times_data_parallel_equals_training_on_the_whole_batch() -> None:
    got = results_of(spawn_ranks(cases.replicated, 4, ["fan_out", "gpt", "unet"], timeout=300))
    for per_rank in zip(*got):
        case = per_rank[0]["case"]
        for report in per_rank:
            assert all(abs(loss - report["expected"]) <= TOL for loss in report["losses"]), (case, report["losses"], report["expected"])
            worst = max(report["grads"].values())
            assert worst <= TOL, f"{case}: gradient differs by {worst}"
        # ranks 0 and 2 are the two stages of replica 0 (the mesh is pp-major), 1 and 3 of replica 1
        for replica in (per_rank[0::2], per_rank[1::2]):
            held = set().union(*(set(r["grads"]) for r in replica))
            assert held == set(per_rank[0]["names"]), f"{case}: no rank of a replica holds {set(per_rank[0]['names']) - held}"


def test_replicas_combine_a_models_own_loss_as_the_whole_batch_does() -> None:
    """A sum over samples (divided by a count given whole): before, each replica took the mean of
    its micro-batches' losses and the replicas a mean weighted by samples, a fraction of the plain
    model's loss and gradients. A mean over the labels not padded: before, the replicas weighed
    each other by samples, not by the labels each counts (2.43730 for 2.43868). With class
    weights, each replica weighs by the weights of the labels it counts."""
    for per_case in results_of(spawn_ranks(cases.replicated_own_losses, 4, timeout=300)):
        for report in per_case:
            assert report["counted"] == (report["case"] in ("counted", "weighted")), report["case"]
            assert all(abs(loss - report["expected"]) <= TOL for loss in report["losses"]), report
            assert report["grads"] and max(report["grads"].values()) <= TOL, report


def test_a_checkpoint_moves_between_stage_counts_and_the_plain_model(tmp_path: Any) -> None:
    """plain model -> 2 stages -> 3 stages (a model built on the meta device) -> 2 stages, and 3
    stages -> plain model, through torch.distributed.checkpoint."""
    import warnings

    import torch.distributed.checkpoint as dcp

    torch.manual_seed(5)
    model, batches, _ = cases.MODELS["gpt"]()
    x = batches[0][0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # saving in one process, which torch.distributed notes
        dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "plain"))
    with torch.no_grad():
        expected = model(x)
    paths = [str(tmp_path / name) for name in ("plain", "two", "three")]
    keys = results_of(spawn_ranks(cases.checkpoint_round, 2, paths[0], paths[1], str(tmp_path / "two.pt"), 11, timeout=200))
    assert set(keys[0]) | set(keys[1]) == set(model.state_dict())
    two = torch.load(tmp_path / "two.pt")
    torch.testing.assert_close(two["loaded"], expected, rtol=0, atol=TOL)
    assert (two["trained"] - two["loaded"]).abs().max() > 1e-3, "the training step changed nothing"
    results_of(spawn_ranks(cases.checkpoint_round, 3, paths[1], paths[2], str(tmp_path / "three.pt"), 12, True, timeout=200))
    three = torch.load(tmp_path / "three.pt")
    torch.testing.assert_close(three["loaded"], two["trained"], rtol=0, atol=TOL)
    back = str(tmp_path / "back")  # and from 3 stages to 2
    results_of(spawn_ranks(cases.checkpoint_round, 2, paths[2], back, str(tmp_path / "back.pt"), 14, timeout=200))
    torch.testing.assert_close(torch.load(tmp_path / "back.pt")["loaded"], three["trained"], rtol=0, atol=TOL)
    torch.manual_seed(13)
    plain, _, _ = cases.MODELS["gpt"]()
    state = plain.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=paths[2])
    plain.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), three["trained"], rtol=0, atol=TOL)


def test_values_cross_between_ranks_as_they_were_sent() -> None:
    """Every dtype, 0-dim and empty tensors, strided ones, tensors and headers too big for a frame,
    taken out of the order they were sent, in two steps."""
    for problems in results_of(spawn_ranks(cases.echo, 2, timeout=120)):
        assert problems == []


def test_balance_by_time_cuts_alike_on_every_rank() -> None:
    got = results_of(spawn_ranks(cases.timed_plans, 2, timeout=120))
    assert got[0][0] == got[1][0], "the ranks cut differently"
    for _, loss, expected in got:
        assert abs(loss - expected) <= TOL


def test_random_graphs_with_every_feature_train_and_evaluate_as_the_plain_model() -> None:
    """The property test's features (BatchNorm, buffers written in forward, in-place writes
    through views, training branches, custom Functions, aliases, dict outputs, ...), a seed
    each (FXPIPE_DISTRIBUTED_SEEDS for more), on three processes under drawn schedules and checkpoint
    modes: losses, outputs, and every parameter, gradient and buffer each rank holds, then an
    eval forward."""
    from dag_models import FEATURES

    matrix = [(feature, seed) for feature in FEATURES for seed in range(1, 1 + SEEDS)]
    reports = results_of(spawn_ranks(cases.dag_features, 3, matrix, timeout=400))
    for per_rank in zip(*reports):
        case = per_rank[0]["case"]
        for rank, report in enumerate(per_rank):
            assert "skipped" not in report or "nodes to place" in report["skipped"], (case, report["skipped"])
            assert not report["problems"], f"{case} rank {rank}: {report['problems'][:5]}"


def test_a_plan_whose_copies_would_go_stale_is_refused() -> None:
    for eval_alone, renormed, renormed_by_op in results_of(spawn_ranks(cases.stale_copies, 2, timeout=120)):
        assert "cannot run across processes" in eval_alone and "'l1.weight' is read on pipeline rank(s) [1] in eval mode" in eval_alone, eval_alone
        assert "How to fix" in eval_alone
        assert "parameter 'emb.weight' is written in place in forward by `emb`, an Embedding with max_norm" in renormed, renormed
        assert "read on pipeline ranks [0, 1]" in renormed and "max_norm=None" in renormed, renormed
        assert "parameter 'emb.weight' is written in place in forward by `embedding` with max_norm, which renormalises" in renormed_by_op, renormed_by_op


def test_tensors_held_elsewhere_are_refused_on_every_rank_and_nothing_is_moved() -> None:
    """Before, torch's swap failed inside compile_pipeline on the ranks whose tensors were held,
    after moving some of them to the meta device; the other ranks returned a pipeline and waited
    out their timeout in the first step."""
    for report in results_of(spawn_ranks(cases.held_elsewhere, 2, timeout=120)):
        assert "could not free the tensors of other ranks' stages (on rank 0: " in report.get("refused", ""), report
        assert "on rank 1: " in report["refused"] and "How to fix: drop such outputs" in report["refused"], report
        assert report["on meta"] == [] and report["loss"] <= TOL and report["grads"] <= TOL, report
        # Before, the rank that does not hold layer 0 kept its adapter, untrained, in its state_dict().
        assert "added to the model since compiling" in report["added"] and ": 0.adapter." in report["added"] and "on every rank" in report["added"], report
        assert "0.lora.weight, 0.lora.bias" in report["module added"], report
        # Before, replaced on every rank, rank 0 kept layer 3's new weight, untrained, in its state_dict().
        assert "since compiling, or replaced: 3.weight." in report.get("replaced", ""), report


def test_a_parameter_read_in_eval_mode_alone_is_held_by_the_rank_that_reads_it() -> None:
    found = results_of(spawn_ranks(cases.eval_only_parameter, 2, timeout=120))
    assert "eval" not in found[0] and "eval" in found[1], found
    assert all(v < 1e-12 for report in found for v in report.values()), found


def test_dropout_draws_the_masks_of_the_one_process_pipeline() -> None:
    cases_ = [(feature, seed) for feature in ("dropout_module", "dropout_functional", "mixed") for seed in range(1, 1 + SEEDS)]
    for report in results_of(spawn_ranks(cases.dropout_draws, 3, cases_, timeout=300)):
        for entry in report:
            assert "skipped" not in entry or "nodes to place" in entry["skipped"], entry
            assert not entry["problems"], (entry["case"], entry["problems"][:5])


def test_the_ranks_generators_stay_alike_when_one_ranks_stage_draws() -> None:
    states = results_of(spawn_ranks(cases.generators_after_a_step, 2, timeout=120))
    assert len(set(states)) == 1, states


def test_generators_seeded_per_rank_are_refused_where_the_model_draws() -> None:
    """Before, each rank drew its stages' dropout masks from its own generator: a mix that no one
    process draws (loss 0.798 where one process gives 0.821 and 0.811 for the two seeds), and the
    generators stayed apart, with no error."""
    reports = results_of(spawn_ranks(cases.generators_seeded_per_rank, 2, timeout=120))
    for report in reports:
        for what in ("apart", "apart, forward"):
            assert "the ranks' random generators differ" in report[what] and "seed every rank" in report[what], report
        assert report["alike, against one process"] <= TOL, report
    assert reports[0]["apart, drawing nothing"] == reports[1]["apart, drawing nothing"], reports


@pytest.mark.parametrize("whole", [False, True], ids=["plain", "beside-a-module-called-whole"])
def test_a_loss_that_draws_draws_what_the_plain_models_does_and_leaves_every_generator_alike(whole: bool) -> None:
    """Before, beside a module called whole, every rank took the step's seed before the loss drew
    (0.02 off the plain model's loss); and only the loss rank's generator moved, so the ranks'
    generators parted."""
    got = results_of(spawn_ranks(cases.a_loss_that_draws, 2, whole, timeout=120))
    for report in got:
        assert report["loss"] < 1e-12 and report["grads"] < 1e-12, report
        assert report["plain's generator"] and report["failed step's generator put back"], report
    assert len({report["hash"] for report in got}) == 1


def test_each_direction_of_a_pair_has_a_group_of_its_own_made_once_per_mesh() -> None:
    # One connection for both directions makes a large send wait for the other way's bytes.
    got = results_of(spawn_ranks(cases.directional, 4, timeout=300))
    for rank, reports in enumerate(got):
        pair = sorted([rank, rank ^ 2])  # the 2 x 2 mesh's pipelines: ranks 0, 2 and 1, 3
        for report in reports:
            assert all(abs(loss - report["expected"]) <= TOL for loss in report["losses"]), report["case"]
            assert max(report["grads"].values()) <= TOL, report["case"]
            assert report["groups"] == {"send": [pair], "receive": [pair]}, "one group each way, for both pipelines"
            assert not report["same_group"], "sends and receives share a group"


def test_no_grad_sum_reduction_autocast_and_eval_across_processes() -> None:
    got = results_of(spawn_ranks(cases.modes_across, 2, timeout=120))
    for rank, found in enumerate(got):
        assert found["no_grad loss"] <= TOL and found["no_grad: gradients made"] == 0, found
        assert found["sum loss"] <= TOL and found["sum gradients"] <= TOL, found
        assert found["bf16 loss"] <= 2e-2 and found["bf16 outputs"] == (-1.0 if rank == 0 else 1.0), found
        assert found["own mean loss"] <= TOL and found["own mean gradients"] <= TOL, found
        assert (found["eval out"] == -1.0) if rank == 0 else (0 <= found["eval out"] <= TOL), found
        assert found["dims loss"] <= TOL and found["dims gradients"] <= TOL, found
        assert (found["dims outputs"] == -1.0) if rank == 0 else (0 <= found["dims outputs"] <= TOL), found
        assert found["cast loss"] <= TOL and found["cast gradients"] <= TOL and found["cast count"] == 0.0, found
        assert found["whole loss"] <= TOL and found["whole gradients"] <= TOL, found
        assert found["layouts loss"] <= TOL and found["layouts gradients"] <= TOL, found


def test_replicas_start_from_replica_0_and_average_through_ddp() -> None:
    for found in results_of(spawn_ranks(cases.replicas_through_ddp, 2, timeout=120)):
        assert found["start"] == 0.0, "DDP copies replica 0's parameters, frozen ones too, to the other at compile time"
        assert found["losses"] <= TOL and found["grads"] <= TOL, found
        assert found["unused"], "a parameter no replica reads keeps no gradient"


def test_clipping_on_one_rank_only_raises_there_within_the_timeout_naming_the_fix() -> None:
    clipping, _ = results_of(spawn_ranks(cases.clipped_on_one_rank, 2, timeout=120))
    assert "clip_grad_norm_ did not get the other ranks' parts of the norm (timeout 3 s)" in clipping["error"], clipping
    assert "Every rank of the pipeline must call pipe.clip_grad_norm_" in clipping["error"] and clipping["took"] < 6, clipping


def test_freezing_through_the_pipeline_on_every_rank_and_a_tied_copy_frozen_on_one() -> None:
    """Before, the tied weight's messages were keyed by the place among the parameters that
    require grad, which each rank counted differently: both ranks waited out the timeout."""
    for found in results_of(spawn_ranks(cases.frozen_through_pipe, 2, timeout=120)):
        assert found["loss"] <= TOL and found["grads"] <= TOL and not found["frozen"], found
        assert "trained on some and frozen on others" in found["error"], found
        assert "'tok_emb.weight' requires grad on rank(s) [0] and not on [1]" in found["error"], found


def test_a_replica_that_fails_makes_the_others_raise_naming_its_rank_and_error() -> None:
    failed, healthy = results_of(spawn_ranks(cases.replica_fails, 2, timeout=120))[::-1]
    assert "marked row reached the check" in failed["error"], failed
    assert healthy["error"].startswith("ReplicaFailed") and "rank 1: StageError" in healthy["error"], healthy
    assert "marked row reached the check" in healthy["error"] and "micro-batch 1" in healthy["error"], healthy
    for found in (failed, healthy):
        assert found["loss"] <= TOL and found["grads"] <= TOL, found
    # Before, replicas reducing their losses differently mixed 'mean' and 'sum' gradients silently.
    for found in (failed, healthy):
        assert "were called differently: reduction='mean' on some and not on others" in found["reductions"], found["reductions"]
        assert "ranks [0, 1]" in found["reductions"], found["reductions"]
        assert "were called differently: training mode on some and not on others" in found["modes"], found["modes"]
    # A hook raising inside DDP's all-reduce on one replica: before, the other waited for as
    # long as the process group's default timeout (30 minutes under torchrun).
    assert failed["hook"] == "ValueError: the hook refuses", failed["hook"]
    assert healthy["hook"].startswith("ReplicaFailed: the replicas' gradient all-reduce failed on rank 0"), healthy["hook"]
    assert "ranks [0, 1]" in healthy["hook"] and healthy["hook took"] < 10, healthy


def test_what_no_stage_reads_stays_on_the_first_rank() -> None:
    first, second = results_of(spawn_ranks(cases.unread_state, 2, timeout=120))
    assert {"spare", "version"} <= set(first["keys"]) and not {"spare", "version"} & set(second["keys"]), (first, second)
    assert sorted(first["keys"] + second["keys"]) == first["plain_keys"], "every key of the model is on one rank"
    assert first["equal"] and second["equal"]
    assert first["meta_keys"] == first["keys"] and second["meta_keys"] == second["keys"], "a model built on meta alike"
    assert first["rnn"] <= TOL and second["rnn"] <= TOL, (first["rnn"], second["rnn"])  # an LSTM's weights freed on a rank


def test_steps_inside_no_sync_accumulate_and_the_next_step_syncs_them() -> None:
    first, second = results_of(spawn_ranks(cases.accumulated_without_sync, 2, timeout=120))
    assert first["unsynced"] != second["unsynced"], "inside no_sync each replica keeps its own gradients"
    assert first["grads"] <= TOL and second["grads"] <= TOL, (first["grads"], second["grads"])
    for found in (first, second):
        assert found["no_grad_loss"] <= TOL and found["grads_kept"], found
        assert found["eval_out"] <= TOL, found


def test_train_steps_across_processes_is_the_plain_loop_and_the_ranks_end_together() -> None:
    for rank, report in enumerate(results_of(spawn_ranks(cases.looped, 2, timeout=240))):
        assert report["losses"] == pytest.approx(report["expected"], rel=0, abs=TOL), report
        assert max(report["params"].values()) <= TOL, report["params"]
        assert "ended after 2 batches" in report["ended"] and "rank(s) [1]" in report["ended"], report["ended"]
        said = "the batches raised before batch 3" if rank == 0 else "failed as they read batch 3"  # its own error, or the others'
        assert said in report["raised"] and "after batch 2's update" in report["raised"], report["raised"]
        assert report["moved"], "the three batches before the failure were trained"


def test_ranks_at_different_exchanges_say_they_are_out_of_step() -> None:
    """Before, rank 0's next loop paired with rank 1's batch 2 and each read the other's values
    as its own kind ('too many values to unpack' in compile_pipeline, 'unhashable type' in the
    loop, or a batch 0 compared with a batch 2 as 'called differently')."""
    for report in results_of(spawn_ranks(cases.out_of_step, 2, timeout=120)):
        assert "the ranks are out of step, each at another exchange (rank 0: train_steps' batch 0; rank 1: train_steps' batch 2)" in report["error"], report
        assert "How to fix: restart every process" in report["error"], report


def test_2bw_across_processes_is_the_delayed_plain_loop_and_a_failure_stops_every_rank_at_one_version() -> None:
    for rank, report in enumerate(results_of(spawn_ranks(cases.looped_2bw, 2, timeout=300))):
        for case in report["exact"]:
            assert case["losses"] == pytest.approx(case["expected"], rel=0, abs=TOL), (rank, case)
            assert case["params"] and max(case["params"].values()) <= TOL and case["clipped"], (rank, case)
            assert 1.0 < case["versions"] <= 2.0, (rank, case)  # this rank's parameters, two versions at most
        for dropout in (report["dropout"], report["autocast"]):
            assert dropout["losses"] == pytest.approx(dropout["expected"], rel=0, abs=1e-12), (rank, dropout)
            assert dropout["params"] and max(dropout["params"].values()) <= 1e-12 and dropout["generator"], (rank, dropout)
        raised, differed, stage, hook, smaller, broke, frozen, evaluating, hooked, replaced = (
            report["failed"][how] for how in ("raises", "differs", "stage", "hook", "smaller", "break", "frozen", "eval", "hooked", "replaced")
        )
        # a loop refused on one rank (eval mode) or whose ranks draw apart (a hook on one rank): every rank at once
        assert evaluating["given"] == 0 and ("cannot run in eval mode" if rank == 1 else "rank(s) [1] failed as they read batch 0") in evaluating["error"], (rank, evaluating)
        # so is one refused as the loop is made (a parameter replaced on one rank): before, the
        # other rank waited out the timeout and raised PeerLost
        assert replaced["given"] == 0 and "replaced: a.bias" in replaced["error"] and replaced["seconds"] < 20, (rank, replaced)
        assert rank == 1 or "rank(s) [1] failed as they read batch 0 (rank 1: RuntimeError: parameters or buffers" in replaced["error"], replaced
        assert hooked["given"] == 0 and "stages of rank(s) [0] may draw random numbers and those of rank(s) [1] may not" in hooked["error"], (rank, hooked)
        assert raised["given"] == differed["given"] == 2, (rank, report["failed"])  # losses of batches 0 and 1
        assert "2 losses were given" in raised["error"], (rank, raised)
        assert ("OSError: the file went away" if rank == 0 else "rank(s) [0] failed as they read batch 3") in raised["error"], (rank, raised)
        assert "the parameters hold the updates of the batches whose losses were given" in raised["error"] or rank == 0, (rank, raised)
        assert "called differently" in differed["error"] and "data of x" in differed["error"], (rank, differed)
        # batch 2 ran on every rank before the last stage failed on batch 3: its update is kept
        assert stage["given"] == 3 and "a value out of range" in stage["error"] and "3 losses were given" in stage["error"], (rank, stage)
        # a hook that fails on one rank: no rank updates on that batch
        assert hook["given"] == 2 and ("the hook failed" if rank == 1 else "in after_backward on rank(s) [1]") in hook["error"], (rank, hook)
        assert smaller["given"] == 2 and "called differently" in smaller["error"] and "micro-batch sizes" in smaller["error"], (rank, smaller)
        assert broke["given"] == 3 and not broke["error"], (rank, broke)
        assert frozen["given"] == 0 and "'a.weight' is read on several ranks" in frozen["error"], (rank, frozen)
        for failed in (raised, differed, stage, hook, smaller, broke, frozen, evaluating, hooked):
            assert failed["params"] and max(failed["params"].values()) <= TOL, (rank, failed)  # W after the losses given
            assert failed is hooked or failed["after"] <= TOL, (rank, failed)  # a step after the failed loop: the plain model's loss
        assert "data-parallel replicas" in report["replicas"], (rank, report["replicas"])


def test_a_2bw_failure_on_three_ranks_stops_every_rank_at_once_with_one_error() -> None:
    """Before, a rank that reads nothing from the failed one (the last of a chain whose first
    stage raised) waited out the timeout and the process group broke; a loss function's error
    reached the other ranks as 'in forward: LossError: '; and the failing rank blamed another
    that heard of its failure a batch late ('batch 0 failed on rank(s) [0]')."""
    reports = results_of(spawn_ranks(cases.failures_of_2bw_on_three_ranks, 3, timeout=300))
    expected = {
        "first": "stage 0 (rank 0) failed on micro-batch 0 in forward: ValueError: a value out of range",
        "middle": "stage 1 (rank 1) failed on micro-batch 0 in forward: ValueError: a value out of range",
        "loss": "stage 2 (rank 2) failed on micro-batch 0 in loss: ValueError: the loss refused its target",
        # an interrupt reaches its own rank as it is, the others as a stage's failure, in the loss (it said
        # "in forward" before)
        "interrupt": "stage 2 (rank 2) failed on micro-batch 0 in loss: KeyboardInterrupt: interrupted in the loss",
    }
    for how, words in expected.items():
        errors = {report[how]["error"] for report in reports[: 2 if how == "interrupt" else 3]}
        assert len(errors) == 1 and words in next(iter(errors)), (how, errors)
        for rank, report in enumerate(reports):
            found = report[how]
            assert found["seconds"] < 5, (how, rank, found)  # the timeout is 30 s
            # batch 0's loss is given where its actions all ran before the failure stopped them
            assert found["given"] in (0, 1) and found["params"] and max(found["params"].values()) <= TOL, (how, rank, found)
            assert found["after"] <= TOL, (how, rank, found)


def test_slices_of_a_sequence_train_and_evaluate_across_processes_as_the_plain_model() -> None:
    got = results_of(spawn_ranks(cases.sequence_slices_across, 2, timeout=180))
    for rank, found in enumerate(got):
        for schedule in ("1f1b", "zb-h1", "gpipe"):
            assert found[f"{schedule} loss"] <= TOL and found[f"{schedule} gradients"] <= TOL, found
            assert found[f"{schedule} held"] > 0, found  # each rank checks the parameters its stages hold
        assert (found["eval out"] == -1.0) if rank == 0 else (0 <= found["eval out"] <= 1e-12), found
        assert found["2bw losses"] <= TOL and found["2bw parameters"] <= TOL, found
        assert found["2bw auto losses"] <= TOL and found["2bw auto parameters"] <= TOL, found
        assert found["2bw auto micro-batches"] == 3 * 2 * 6, found  # each batch's 2 rows in the first batch's 6 slices


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_a_loop_failing_on_one_rank_in_the_callers_code_or_the_optimizer_stops_every_rank_at_once(schedule: str) -> None:
    """Before, under the synchronous schedules an after_backward, optimizer step or after_step
    that raised on one rank went unheard: the others updated, gave the loss and waited out the
    timeout at the next batch, and the ranks held different versions. Under 2bw an optimizer's
    step that raised on a stage's thread was heard by no rank, not even its own."""
    reports = results_of(spawn_ranks(cases.one_rank_failing_in_the_loop, 2, timeout=300))
    for rank, report in enumerate(reports):
        for what, updates in (("after_backward", 1), ("step", 1 if rank == 1 else 2), ("after_step", 2)):
            found = report[f"{schedule} {what}"]
            assert found["seconds"] < 10, (rank, what, found)  # the timeout is 30 s
            assert f"{what} failed here" in found["error"], (rank, what, found)
            assert "rank 1" in found["error"] or rank == 1, (rank, what, found)
            assert found["held"][updates] <= TOL, (rank, what, found)  # the plain loop's parameters after those updates
            given = 1 if what == "after_backward" or schedule == "1f1b" else 2
            assert found["given"] == given, (rank, what, found)


def test_a_weight_tied_across_ranks_loaded_with_assign_is_held_by_the_rank_that_reads_each_copy() -> None:
    """Before, both ranks kept real tensors for both untied copies, each training the one its
    stage reads: every rank's state dict (and a DCP checkpoint of them) held a stale copy. Entries
    that share memory (a tied weight's keys, as torch.load gives them) are refused: the plain
    model makes them two parameters over one memory, which ranks cannot share (before, each rank
    trained its own: 0.16 apart after three Adam steps)."""
    keys, held = set(), []
    for report in results_of(spawn_ranks(cases.assigned_apart, 2, timeout=120)):
        held.append(report["keys"])
        keys.update(report["keys"])
        assert max(report["apart"].values()) <= TOL, report
        assert "entries that share memory, read on different ranks: a.weight and c.weight" in report["refused"], report["refused"]
        assert "How to fix: load without assign=True" in report["refused"] and report["unchanged"], report
    assert {"a.weight", "c.weight"} <= keys and not set(held[0]) & set(held[1]), held  # each key on one rank


def test_data_apart_on_one_rank_of_three_names_that_rank() -> None:
    """Before: 'ranks 0, 1 and 2 differ in x', whichever rank was given other data."""
    from fxpipe.distributed.rank_call import _odd_ranks

    assert _odd_ranks("x", {0: "a", 1: "a", 2: "b"}) == "data of x: rank(s) [2] differ from rank(s) [0, 1]"
    assert _odd_ranks("x", {0: "b", 1: "a", 2: "a"}) == "data of x: rank(s) [0] differ from rank(s) [1, 2]"


def test_a_2bw_loop_one_rank_steps_apart_stops_every_rank_at_once() -> None:
    """Before, a refusal of the caller's code after a loss (the optimizer's state cleared, the
    gradients written in place) raised on its own rank alone: the other waited out the timeout
    and blamed a broken peer, with the ranks a version apart. And the copies of a tied weight
    were compared at the first batch only: a rank that clipped its own gradients, or changed its
    lr alone, trained its copy apart with no error (1.1e-3 and 1.12 apart by the end)."""
    reports = results_of(spawn_ranks(cases.one_rank_stepping_apart_under_2bw, 2, timeout=300))
    said = {
        "state": "the optimizer's state was changed after the loss of batch 1",
        "written": "the gradients of batch 1 were written in place after its loss",
        "clipped": "the copies of a tied parameter differ between the ranks that hold them after batch",
        "lr": "the copies of a tied parameter differ between the ranks that hold them after batch 1's update",
    }
    for rank, report in enumerate(reports):
        for how, words in said.items():
            found = report[how]
            assert found["seconds"] < 10, (rank, how, found)  # the timeout is 30 s
            assert words in found["error"], (rank, how, found)
            if how in ("state", "written"):  # the refusing rank's own error; the other's names it
                assert rank == 1 or "in the code after its loss on rank(s) [1]" in found["error"], (rank, how, found)
                assert found["given"] == 2, (rank, how, found)
            else:  # heard a batch after the update that took the copies apart
                assert "clip with pipe.clip_grad_norm_" in found["error"] and found["given"] in (2, 3), (rank, how, found)
        for how in ("break", "body"):  # before, the other rank waited out the timeout, and the next step failed on both
            found = report[how]
            assert found["seconds"] < 10 and found["given"] == 2 and found["params"] <= TOL and found["after"] <= TOL, (rank, how, found)
            stopped = "the loop was stopped on this rank after the loss of batch 1" in found["error"] and "rank(s) [1]" in found["error"]
            assert stopped if rank == 0 else found["error"] == ("KeyError: 'the loop body failed'" if how == "body" else ""), (rank, how, found)
        assert report["none"]["error"] == "" and report["none"]["given"] == 6 and report["none"]["params"] <= TOL, report["none"]
        assert report["state"]["params"] <= TOL or rank == 1, report["state"]  # rank 0's update is the plain loop's
    assert reports[0]["clipped"]["given"] == reports[1]["clipped"]["given"], reports


def test_a_call_refused_by_one_ranks_own_check_is_refused_on_every_rank_at_once() -> None:
    """Before, the other rank waited out the timeout and raised PeerLost, blaming a lost peer."""
    for rank, report in enumerate(results_of(spawn_ranks(cases.refused_on_one_rank, 2, timeout=120))):
        for what in ("train_step", "pipe(x)"):
            found = report[what]
            assert found["seconds"] < 10 and "inside torch.nn.utils.parametrize.cached()" in found["error"], (rank, what, found)
            assert rank == 1 or "rank 1 failed in preparing the call" in found["error"], (rank, what, found)
        assert report["after"] <= TOL, report  # the ranks go on together
