"""Property test: for random DAG models, the pipeline computes what the plain model computes.

One case per (model feature, use). In each, hypothesis draws a random DAG of tanh(Linear) ops
with the feature mixed in (tests/dag_models.py generates its source), 1-4 stages (the default
balance, or node counts forced at random cuts), 1-4 chunks and a checkpoint mode, and runs the
use on the pipeline and on the plain model run on the same micro-batches one after another
(`torch.tensor_split`), outputs concatenated:

- train_step: output, `loss.backward()`, every parameter's `.grad` and every buffer, then an SGD
  step and a second step on another batch;
- eval: a training forward, then `pipe.eval()` (forward + backward), then `pipe.train()` again;
- no_grad: a forward under `torch.no_grad()` (in train mode);
- autocast_bf16: forward and loss under `torch.autocast("cpu", torch.bfloat16)` (float32 model),
  output dtypes equal and values to bfloat16 tolerance, then backward;
- two_forwards: two forwards, one backward of the sum;
- grad_inputs: `torch.autograd.grad(loss, x)` equals the plain model's and leaves every
  parameter's `.grad` None.

And, apart, a loop of four batches through `train_steps` under schedule='2bw' against the plain
model's loop with PipeDream-2BW's delayed updates (batch t on W(t - 1), the step applied to W(t)).
Parameters, gradients and buffers are compared both through the pipeline and on the model
object itself. Float64 to 1e-10. The same cases again under stage_graph='dag' (the default
balance), where the branches of the random graph run in stages side by side. Under autocast the pipeline is also compared with itself across
'always', 'except_last' and 'never' on the same cut, bit for bit (the bfloat16 tolerance against
the plain model would hide a recompute that ran in float32). A model whose dropout draws in train mode (p > 0) is compared with the plain
model at p = 0 (and at p > 0 in eval mode), and with itself across 'always', 'except_last' and
'never' under the same `torch.manual_seed`, bit for bit where the modes cut alike (cut
elsewhere, a gradient summed over stages in another order may round otherwise: to 1e-12 in
float64, 1e-5 in float32). A forced cut that compile_pipeline
refuses with a clear error (PartitionError, InplaceError) is allowed: it counts as a hypothesis
event (`--hypothesis-show-statistics`). A failure notes the case and a script that reruns it.
"""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, note, reject, settings
from hypothesis import strategies as st

from dag_models import FEATURE_OPS, FEATURES, MODES, SCHEDULES, USES, Case, NotACase, Op, Refused, Spec, check, reproducer

# 19 features x 7 uses, four examples each; the file takes about 3 minutes of one core.
# FXPIPE_PROPERTY_EXAMPLES=50 searches harder (outside CI).
EXAMPLES = int(os.environ.get("FXPIPE_PROPERTY_EXAMPLES", "4"))
# Through torch.export, each with checkpoint='always' (what recomputes the exported graph's ops
# in backward): 18 features x 2; about 30 s.
EXPORTED = max(1, round(EXAMPLES / 2.5))


@st.composite
def specs(draw: Any, feature: str, front_end: str = "torch.fx") -> Spec:
    kinds = FEATURE_OPS[feature]
    if front_end == "torch.export":  # which refuses an autograd Function, naming it
        kinds = tuple(k for k in kinds if k != "function")
    least = 4 if feature == "fanout" else 2
    n = draw(st.integers(least, 8 if feature == "mixed" else 5))
    width = draw(st.sampled_from([4, 6, 8]))
    ops = []
    for i in range(n):
        kind = draw(st.sampled_from(("linear", *kinds)))
        first = draw(st.integers(0, i))
        second = draw(st.one_of(st.none(), st.integers(0, i)))
        picks = (first,) if second is None or second == first else (first, second)
        ops.append(Op(kind, picks, draw(st.integers(0, 5))))
    if kinds and not any(op.kind in kinds for op in ops):
        ops[-1].kind = draw(st.sampled_from(kinds))
    if feature in ("tied_weights", "module_twice"):  # two uses of the shared weight
        ops[0].kind = ops[-1].kind = kinds[0]
    if feature == "fanout":  # v1 read by every later op (and so by three or more)
        for op in ops[1:]:
            if 1 not in op.picks:
                op.picks = (op.picks[0], 1)
    returns: tuple[int, ...] = draw(st.one_of(st.just(()), st.tuples(st.integers(1, n))))
    p = draw(st.sampled_from([0.5, 0.25]))
    return Spec(width, ops, returns, p, front_end=front_end)


@st.composite
def cases(draw: Any, feature: str, use: str, front_end: str = "torch.fx") -> Case:
    spec = draw(specs(feature, front_end))
    chunks = draw(st.integers(1, 4))
    least = 2 * chunks if spec.has("batchnorm") else 1  # BatchNorm needs two rows per micro-batch
    return Case(
        spec=spec,
        use=use,
        stages=draw(st.integers(1, 4)),
        chunks=chunks,
        mode=draw(st.sampled_from(MODES)) if front_end == "torch.fx" else "always",
        cuts_seed=draw(st.one_of(st.none(), st.integers(0, 999))),
        batch=draw(st.integers(max(6, least), 9)),
        seed=draw(st.integers(0, 2**16)),
        batch2=draw(st.one_of(st.just(0), st.integers(max(6, least), 9))),
        schedule=draw(st.sampled_from(SCHEDULES)) if use == "scheduled" else "gpipe",
    )


def _run(case: Case) -> None:
    note("case: " + case.describe())
    note("rerun (from the repository root):\n" + reproducer(case))
    try:
        check(case)
    except Refused as refusal:
        event(f"forced cut refused: {str(refusal).split(':')[0]}")
        return
    except NotACase as e:
        event(str(e).splitlines()[0][:80])
        reject()
    except ValueError as e:
        if "nodes to place" in str(e):  # more stages than nodes: not a case
            reject()
        raise


def _searched(examples: int) -> Any:
    """The same cases on every run (derandomized, no database), `examples` per test."""
    return settings(
        max_examples=examples, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


@pytest.mark.parametrize("use", USES)
@pytest.mark.parametrize("feature", FEATURES)
@_searched(EXAMPLES)
@given(data=st.data())
def test_pipeline_equals_plain_model(feature: str, use: str, data: st.DataObject) -> None:
    _run(data.draw(cases(feature, use), label="case"))


@pytest.mark.parametrize("feature", FEATURES)
@_searched(EXPORTED)
@given(data=st.data())
def test_2bw_loops_of_random_graphs_equal_the_delayed_plain_loop(feature: str, data: st.DataObject) -> None:
    """train_steps under schedule='2bw', four batches of SGD with momentum, against the plain
    model's loop that evaluates batch t on W(t - 1) and updates W(t) (dag_models.delayed_loop)."""
    case = data.draw(cases(feature, "loop_2bw"), label="case")
    case.schedule, case.chunks = "2bw", max(case.chunks, case.stages)  # chunks >= the depth
    least = 2 * case.chunks if case.spec.has("batchnorm") else case.chunks
    case.batch, case.batch2 = max(case.batch, least), max(case.batch2 or case.batch, least)
    _run(case)


@pytest.mark.parametrize("feature", FEATURES)
@_searched(max(1, EXAMPLES // 2))
@given(data=st.data())
def test_stage_dags_of_random_graphs_equal_the_plain_model(feature: str, data: st.DataObject) -> None:
    """The graph search's cut (stage_graph='dag'): random graphs have branches that read the same
    values and join later, which it puts side by side; every use, every schedule."""
    use = data.draw(st.sampled_from(USES), label="use")
    case = data.draw(cases(feature, use), label="case")
    case.cuts_seed, case.stage_graph = None, "dag"
    if use != "scheduled":
        case.schedule = data.draw(st.sampled_from(SCHEDULES), label="schedule")
    _run(case)


@pytest.mark.parametrize("feature", [f for f in FEATURES if f != "function"])  # export refuses an autograd Function
@pytest.mark.filterwarnings("ignore:torch.fx could not trace Model")
@_searched(EXPORTED)
@given(data=st.data())
def test_graphs_captured_by_torch_export_equal_the_plain_model_under_always(feature: str, data: st.DataObject) -> None:
    use = data.draw(st.sampled_from(USES), label="use")
    _run(data.draw(cases(feature, use, "torch.export"), label="case"))


def test_generated_models_run_eagerly() -> None:
    """The generator itself: every op kind makes a model the plain model can train and evaluate."""
    from dag_models import OP_KINDS, make_model, micro_batched, loss_of

    for width in (4, 6, 8):
        ops = [Op(kind, (i,), v) for i, kind in enumerate(OP_KINDS) for v in range(6)]
        ops = [Op(op.kind, (i,) if i == 0 else (i, i - 1), op.variant) for i, op in enumerate(ops)]
        spec = Spec(width, ops, (3,), 0.25)
        for dtype in (torch.float64, torch.float32):
            model = make_model(spec, None, 0, dtype)
            x = torch.randn(7, width, dtype=dtype)
            loss_of(micro_batched(model, 3)(x)).backward()
            model.eval()
            micro_batched(model, 2)(x)
