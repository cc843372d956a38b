"""The CUDA path against the plain model, one test per behaviour (needs a GPU; skipped without)."""
from __future__ import annotations

import copy
import time
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import FanOut, assert_grads_equal
from fxpipe import StageError, compile_pipeline

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _mlp(width: int = 256, layers: int = 4) -> nn.Sequential:
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*blocks)


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_skips_on_one_gpu_give_the_plain_models_gradients(checkpoint: str) -> None:
    """FanOut cut in four stages on one GPU: its first value is a skip to every later stage."""
    model = FanOut().double().cuda()
    reference = copy.deepcopy(model)
    x = torch.randn(16, 6, dtype=torch.float64, device="cuda")
    pipe = compile_pipeline(model, x, ["cuda:0"] * 4, chunks=4, checkpoint=checkpoint)
    assert any(e.kind == "skip" for e in pipe.plan.edges)
    out, expected = pipe(x), reference(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    out.square().mean().backward()
    expected.square().mean().backward()
    assert_grads_equal(pipe, reference, tol=1e-12)


def test_a_skip_from_the_cpu_over_the_gpu_to_the_cpu() -> None:
    model = FanOut().double()
    reference = copy.deepcopy(model)
    x = torch.randn(16, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cuda:0", "cpu"], chunks=4)
    skips = [e for e in pipe.plan.edges if e.src == 0 and e.dst == 2]
    assert skips, pipe.plan.summary()
    out, expected = pipe(x), reference(x)
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    out.square().mean().backward()
    expected.square().mean().backward()
    assert_grads_equal(pipe, reference, tol=1e-12)


def test_the_callers_side_stream_in_forward_and_backward() -> None:
    """Inputs made on a side stream, and the loss and backward queued there: the stages run
    after the one and before the other, with no synchronisation by the caller."""
    model = _mlp(1024, 8).cuda()
    reference = copy.deepcopy(model)
    pipe = compile_pipeline(model, torch.randn(64, 1024, device="cuda"), ["cuda:0"] * 2, chunks=4)
    base = torch.randn(512, 1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x = base * 2  # queued on the side stream
        for _ in range(64):  # keep the side stream busy, so a stage that did not wait would read too early
            x = x + 0
        out = pipe(x)
        loss = out.square().mean()
        loss.backward()
        grads = [p.grad.clone() for p in pipe.parameters()]  # type: ignore[union-attr]
    torch.cuda.synchronize()
    expected = reference(base * 2).square().mean()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for got, p in zip(grads, reference.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-6)


def test_dropout_is_replayed_by_the_recompute_on_the_gpu() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5), nn.Linear(64, 64), nn.Dropout(0.3)).double().cuda()
    with torch.no_grad():
        for layer in (model[0], model[2]):
            assert isinstance(layer, nn.Linear)
            layer.weight.copy_(torch.eye(64))
            layer.bias.zero_()
    x = torch.rand(16, 64, dtype=torch.float64, device="cuda") + 0.5
    pipe = compile_pipeline(model, x, ["cuda:0", "cuda:0"], chunks=4, checkpoint="always", split_points=["2"])
    leaf = x.clone().requires_grad_()
    torch.manual_seed(3)
    out = pipe(leaf)
    out.sum().backward()
    assert leaf.grad is not None
    assert torch.equal(out != 0, leaf.grad != 0), "the recompute drew other masks than the forward"
    torch.manual_seed(3)
    assert torch.equal(pipe(x), out.detach()), "the same seed draws the same masks"


def test_out_of_memory_then_the_next_call_works() -> None:
    model = nn.Sequential(nn.Linear(256, 1 << 16), nn.ReLU(), nn.Linear(1 << 16, 8)).cuda()
    reference = copy.deepcopy(model)
    pipe = compile_pipeline(model, torch.randn(8, 256, device="cuda"), ["cuda:0", "cuda:0"], chunks=2, split_points=["2"])
    huge = torch.randn(1 << 22, 256, device="cuda")  # 4M rows of 64k floats: a terabyte in the first stage
    with pytest.raises(StageError, match="OutOfMemoryError|out of memory"):
        pipe(huge)
    del huge
    x = torch.randn(32, 256, device="cuda")
    torch.testing.assert_close(pipe(x), reference(x), rtol=1e-5, atol=1e-5)


def test_autocast_gives_the_plain_models_dtype_and_values() -> None:
    model = _mlp().cuda()
    reference = copy.deepcopy(model)
    x = torch.randn(64, 256, device="cuda")
    pipe = compile_pipeline(model, x, ["cuda:0", "cuda:0"], chunks=4)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, expected = pipe(x), reference(x)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=0, atol=0)  # rows are independent: the same kernels per row
    out.float().square().mean().backward()
    expected.float().square().mean().backward()
    assert_grads_equal(pipe, reference, tol=2e-3)


def test_a_grad_scaler_under_float16_autocast() -> None:
    """torch.amp.GradScaler over the pipeline, as over the plain model: the same scaled backward,
    the same unscaled gradients, the same step."""
    model = _mlp().cuda()
    reference = copy.deepcopy(model)
    x, y = torch.randn(64, 256, device="cuda"), torch.randn(64, 256, device="cuda")
    pipe = compile_pipeline(model, x, ["cuda:0", "cuda:0"], chunks=4)
    for net in (pipe, reference):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.mse_loss(net(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
    assert_grads_equal(pipe, reference, tol=1e-3)


def test_cuda_and_cuda_0_are_one_device() -> None:
    model = _mlp().double().cuda()
    reference = copy.deepcopy(model)
    x = torch.randn(16, 256, dtype=torch.float64, device="cuda")
    pipe = compile_pipeline(model, x, ["cuda", "cuda:0"], chunks=2)
    assert [s.device for s in pipe.plan.stages] == ["cuda:0", "cuda:0"]
    torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("options", [{}, {"mode": "reduce-overhead"}], ids=["inductor", "cuda-graphs"])
def test_compiled_stages_on_the_gpu(options: dict[str, Any]) -> None:
    """Three training steps with an optimizer, compiled against eager, on every checkpoint mode."""
    torch.manual_seed(0)
    model = _mlp(256, 4).cuda()
    reference = copy.deepcopy(model)
    x, y = torch.randn(64, 256, device="cuda"), torch.randn(64, 256, device="cuda")
    pipe = compile_pipeline(model, x, ["cuda:0", "cuda:0"], chunks=4, compile_stages=options)
    opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        for o in (opt, ref_opt):
            o.zero_grad()
        loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
        expected = F.mse_loss(reference(x), y)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-4, atol=1e-5)
        assert_grads_equal(pipe, reference, tol=1e-4)
        opt.step()
        ref_opt.step()
    stats = pipe.compile_stats()
    assert len(stats) == 2 and all(s.graphs >= 1 and not s.recompiles for s in stats), stats


def test_zb_h1_and_1f1b_peak_below_gpipe() -> None:
    """The allocator's peak over a step, after a first step: a new pipeline's worker threads
    allocate their cuBLAS workspaces and the parameters their `.grad` in the first one."""
    x, y = torch.randn(1024, 1024, device="cuda"), torch.randn(1024, 1024, device="cuda")
    peaks = {}
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        torch.manual_seed(0)
        pipe = compile_pipeline(_mlp(1024, 8).cuda(), x, ["cuda:0", "cuda:0"], chunks=8, checkpoint="never", schedule=schedule)
        pipe.train_step(x, target=y, loss_fn=F.mse_loss)
        pipe.measure_memory = True
        pipe.train_step(x, target=y, loss_fn=F.mse_loss)
        peaks[schedule] = pipe.timeline().device_peak_bytes["cuda:0"]
    assert 0 < peaks["1f1b"] < peaks["gpipe"] and 0 < peaks["zb-h1"] < peaks["gpipe"], peaks


def test_balance_by_time_predicts_the_step_it_runs() -> None:
    """balance='time' times nodes with CUDA events after a warm-up: the plan's prediction is
    within a factor of the measured step (one stage: the GPU runs all of it in turn), where
    timing with the host clock once predicted a ninth of it."""
    # Kernels that take longer than their launch: the step is the GPU's, which events time.
    model = nn.Sequential(*[_mlp(4096, 1) for _ in range(8)]).to("cuda", torch.bfloat16)
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    pipe = compile_pipeline(model, x, ["cuda:0"], chunks=4, balance="time", checkpoint="never")
    for _ in range(3):
        pipe(x).square().mean().backward()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        pipe(x).square().mean().backward()
    torch.cuda.synchronize()
    measured = (time.perf_counter() - start) / 5
    predicted = pipe.plan.predicted_time()
    assert 0.5 < predicted / measured < 2.0, (predicted, measured)


def test_copy_streams_overlap_compute() -> None:
    """A GPU stage before a CPU stage: the copy of one micro-batch's output to the host runs on
    the copy stream while the GPU computes the next micro-batch (a copy on the compute stream
    could not overlap a kernel)."""
    model = nn.Sequential(_mlp(2048, 8), nn.Identity()).cuda()
    x = torch.randn(8 * 4096, 2048, device="cuda")
    pipe = compile_pipeline(model, x, ["cuda:0", "cpu"], chunks=8, split_points=["1"])
    with torch.no_grad():
        pipe(x)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            pipe(x)
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = [e.time_range for e in events if "memcpy" in e.name.lower()]
    kernels = [e.time_range for e in events if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    assert copies and kernels, [e.name for e in events][:20]
    overlapping = [c for c in copies if any(k.start < c.end and c.start < k.end for k in kernels)]
    assert overlapping, "no copy to the host ran while a kernel ran"


def test_a_language_model_that_returns_its_cache_on_the_gpu() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64, use_cache=True,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).cuda().eval()
    ids = torch.randint(0, 64, (4, 12), device="cuda")
    with pytest.raises(Exception, match="use_cache = False"):
        compile_pipeline(model, ids, ["cuda:0"] * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipeline(model, ids, ["cuda:0"] * 2, chunks=2, example_kwargs={"use_cache": False})
    torch.testing.assert_close(pipe(ids, use_cache=False)["logits"], model(ids, use_cache=False)["logits"], rtol=1e-5, atol=1e-5)
