"""PyTorch's torch.distributed.pipelining test suite, re-expressed as compile_pipeline tests."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import fxpipe
from helpers import assert_grads_equal
from fxpipe import compile_pipeline
from peer_common import ATOL, CPU2, assert_same, check_step, cpus, fresh, stage_modules, twin64

D = 8  # hidden width
B = 8  # batch


def x64(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def pipe_split() -> None:
    """fxpipe's split marker (issue 10 item 8); an AttributeError where fxpipe lacks it."""
    fxpipe.pipe_split()  # type: ignore[attr-defined]


# -- model_registry.py, in fxpipe's own small versions ------------------------------------------


class MLP(nn.Module):
    """model_registry's MLPModule."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.net1 = nn.Linear(d, d)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


class MultiMLP(nn.Module):
    """model_registry's MultiMLP: MLPs in a ModuleList, cut at `layers.i`."""

    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLP() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class MarkedMLPs(nn.Module):
    """test_pipe.py's MultiMLP: four MLPs with split markers between them, and a second input."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp0, self.mlp1, self.mlp2, self.mlp3 = MLP(), MLP(), MLP(), MLP()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.mlp0(x)
        pipe_split()
        x = self.mlp1(x)
        pipe_split()
        x = self.mlp2(x)
        pipe_split()
        return self.mlp3(x) - y


class MarkedExample(nn.Module):
    """test_pipe.py's ExampleCode: a parameter used in two stages, a skip, three markers."""

    def __init__(self) -> None:
        super().__init__()
        self.mm_param1 = nn.Parameter(torch.randn(D, D) / D**0.5)
        self.mm_param2 = nn.Parameter(torch.randn(D, D) / D**0.5)
        self.lin1 = nn.Linear(D, D)
        self.lin2 = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = torch.mm(x, self.mm_param1)
        skip = x
        x = torch.relu(x + y)
        pipe_split()
        x = self.lin1(torch.mm(x, self.mm_param1))
        pipe_split()
        x = torch.mm(torch.relu(x) + skip, self.mm_param2)
        pipe_split()
        return torch.relu(self.lin2(x))


class ParamAlias(nn.Module):
    """model_registry's ModelWithParamAlias: `mm_param1 is mm_param0`, `lin1 is lin0`."""

    def __init__(self, marked: bool) -> None:
        super().__init__()
        self.marked = marked
        self.mm_param1 = self.mm_param0 = nn.Parameter(torch.randn(D, D) / D**0.5)
        self.lin1 = self.lin0 = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.lin0(torch.mm(x, self.mm_param0) + y))
        if self.marked:
            pipe_split()
        x = torch.mm(x, self.mm_param1)
        return torch.relu(self.lin1(x))


class BufferRead(nn.Module):
    """model_registry's ExampleCode: a buffer `cval` read through `.clone()` into a later stage."""

    def __init__(self) -> None:
        super().__init__()
        self.mm_param0 = nn.Parameter(torch.randn(D, D) / D**0.5)
        self.cval = nn.Buffer(torch.randn(D))
        self.lin0 = nn.Linear(D, D)
        self.lin1 = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(torch.mm(x, self.mm_param0))
        a_constant = self.cval.clone()
        x = self.lin0(x)
        return self.lin1(torch.relu(x) + a_constant)


class KwargsModel(nn.Module):
    """model_registry's ModelWithKwargs: a keyword input with a tensor default."""

    def __init__(self) -> None:
        super().__init__()
        self.mm_param0 = nn.Parameter(torch.randn(D, D) / D**0.5)
        self.lin0 = nn.Linear(D, D)
        self.lin1 = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, y: torch.Tensor = torch.zeros(B, D, dtype=torch.float64)) -> torch.Tensor:
        x = torch.relu(self.lin0(torch.mm(x, self.mm_param0) + y))
        return torch.relu(self.lin1(x))


class LinearDxDw(torch.autograd.Function):
    """model_registry's CustomLinearDxDw: a linear layer with its own backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x.mm(weight.t()) + bias

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, weight = ctx.saved_tensors
        # A backward that autograd of the forward would not give: the weight's gradient halved.
        return grad.mm(weight), 0.5 * grad.t().mm(x), grad.sum(0)


class MLPWithDw(nn.Module):
    """model_registry's MLPModuleWithDw: custom Functions, and `self.hidden` set in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1_weight = nn.Parameter(torch.randn(D, D) / D**0.5)
        self.fc1_bias = nn.Parameter(torch.randn(D) / 10)
        self.fc2_weight = nn.Parameter(torch.randn(D, D) / D**0.5)
        self.fc2_bias = nn.Parameter(torch.randn(D) / 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.hidden = LinearDxDw.apply(x, self.fc1_weight, self.fc1_bias)
        self.hidden = torch.relu(self.hidden)
        return LinearDxDw.apply(self.hidden, self.fc2_weight, self.fc2_bias)


class MultiMLPWithDw(nn.Module):
    """model_registry's MultiMLPWithDw."""

    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLPWithDw() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class TwoInTwoOut(torch.autograd.Function):
    """model_registry's TwoInputOutputOp, with a backward that scales the weight's gradient."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a.view_as(a), w.view_as(w)

    @staticmethod
    def backward(ctx: Any, grad_a: torch.Tensor, grad_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad_a, grad_w * 3


class MultiIntermediate(nn.Module):
    """model_registry's MultiInterMediateModel: a split, a two-output Function, a product."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D // 2, D // 2) / D**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.split(x, [D // 2, D // 2], dim=1)
        a, w = TwoInTwoOut.apply(a, self.w)
        return torch.tanh(torch.matmul(a, w)) * b


# -- test_pipe.py -------------------------------------------------------------------------------


@pytest.mark.parametrize("model_class,stages", [(MarkedExample, 4), (MarkedMLPs, 4)], ids=["ExampleCode", "MultiMLP"])
def test_model_split_by_markers(model_class: type[nn.Module], stages: int) -> None:
    """Mirrors pipelining test_pipe.py::test_model_split (ExampleCode, MultiMLP): pipe_split()
    markers give the stages; outputs and gradients are the plain model's; the stages' state
    names are the model's own."""
    model, reference = twin64(model_class())
    example = (x64(B, D), x64(B, D))
    pipe = compile_pipeline(model, example, cpus(stages), chunks=4)
    assert len(pipe.stages) == stages
    check_step(pipe, reference, example)
    names = set(model.state_dict())
    for stage in pipe.stages:
        assert set(stage.state_dict()) <= names


def test_model_split_param_alias_by_marker() -> None:
    """Mirrors pipelining test_pipe.py::test_model_split (ModelWithParamAlias): two stages from
    one marker, exact, and the stages' state names are the model's own."""
    model, reference = twin64(ParamAlias(marked=True))
    example = (x64(B, D), x64(B, D))
    pipe = compile_pipeline(model, example, CPU2, chunks=4)
    check_step(pipe, reference, example)
    for stage in pipe.stages:
        assert set(stage.state_dict()) <= set(model.state_dict())


def test_param_alias_state_dict_round_trip() -> None:
    """Mirrors pipelining test_pipe.py::test_model_split (ModelWithParamAlias, its qualname
    check, with CHECK_FQN_SET_EQUALITY on) and test_unflatten.py's state-dict check: the
    pipeline's state dict has the model's keys, aliases included, and loads both ways; the
    aliased parameter stays one tensor, updated once."""
    model, reference = twin64(ParamAlias(marked=False))
    example = (x64(B, D), x64(B, D))
    pipe = compile_pipeline(model, example, CPU2, chunks=2, split_points=["lin1"])
    assert list(pipe.state_dict()) == list(model.state_dict())
    for stage in pipe.stages:
        assert {n for n, _ in stage.named_parameters()} <= set(model.state_dict())
    pipe.load_state_dict(reference.state_dict())
    reference.load_state_dict(pipe.state_dict())
    assert model.mm_param0 is model.mm_param1
    check_step(pipe, reference, example)
    opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    opt.step()
    ref_opt.step()
    torch.testing.assert_close(model.mm_param0, reference.mm_param0, rtol=0, atol=ATOL)


# -- model_registry.py ExampleCode / test_stage.py::test_tracer --------------------------------


def test_buffer_read_through_an_op_stays_live() -> None:
    """Mirrors pipelining test_stage.py::test_tracer (ExampleCode, its `cval.clone()` passed
    across the cut) and its qualname check: after load_state_dict with a new `cval`, the
    pipeline computes with it, as the plain model does."""
    model, reference = twin64(BufferRead())
    pipe = compile_pipeline(model, x64(B, D), CPU2, chunks=4, split_points=["lin1"])
    for stage in pipe.stages:
        assert set(stage.state_dict()) <= set(model.state_dict())
    state = reference.state_dict()
    state["cval"] = state["cval"] + 1.5
    reference.load_state_dict(state)
    pipe.load_state_dict(state)
    check_step(pipe, reference, (x64(B, D),))


def test_wrong_dtype_is_a_clear_error() -> None:
    """Mirrors pipelining test_stage.py::test_tracer and ::test_manual (their dtype-mismatch
    checks): an int32 batch fails with an error, and the next call is exact."""
    model, reference = twin64(MultiMLP(2))
    pipe = compile_pipeline(model, x64(B, D), CPU2, chunks=4, split_points=["layers.1"])
    with pytest.raises((fxpipe.StageError, RuntimeError, TypeError, ValueError)):
        pipe(torch.ones(B, D, dtype=torch.int32))
    check_step(pipe, reference, (x64(B, D),))


# -- test_microbatch.py, test_chunkspec.py ------------------------------------------------------


def test_split_and_merge_along_dim0() -> None:
    """Mirrors pipelining test_microbatch.py::test_split_and_merge: three inputs of different
    lengths, each split along dim 0 into the same number of micro-batches (positional or by
    keyword), and the outputs merged back."""
    seen: list[tuple[int, int, int]] = []

    class Three(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.f0, self.f1, self.f2 = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

        def forward(self, x0: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return self.f0(x0), self.f1(x1), self.f2(x2)

    model, reference = twin64(Three())
    model.f2.register_forward_pre_hook(lambda m, a: seen.append((0, 0, a[0].shape[0])))
    example = (x64(4, D), x64(8, D), x64(16, D))
    spec: dict[str, int | None] = {"x0": 0, "x1": 0, "x2": 0}
    pipe = compile_pipeline(model, example, ["cpu"], chunks=2, chunk_spec=spec, checkpoint="never")
    seen.clear()
    check_step(pipe, reference, example)
    assert [s[2] for s in seen] == [8, 8]
    model.zero_grad()
    reference.zero_grad()
    check_step(pipe, reference, (), {"x0": example[0], "x1": example[1], "x2": example[2]})


def test_chunk_spec_for_a_keyword_input() -> None:
    """Mirrors pipelining test_microbatch.py::test_chunk_spec and test_stage.py::test_tracer_kwargs
    (ModelWithKwargs): `y` given by keyword, split along dim 0, over the model's tensor default."""
    model, reference = twin64(KwargsModel())
    pipe = compile_pipeline(model, (x64(B, D), x64(B, D)), CPU2, chunks=4, chunk_spec={"y": 0}, split_points=["lin1"])
    check_step(pipe, reference, (x64(B, D),), {"y": x64(B, D)})
    model.zero_grad()
    reference.zero_grad()
    check_step(pipe, reference, (x64(B, D),))  # y omitted: the model's default


def test_chunk_spec_with_example_kwargs() -> None:
    """Mirrors pipelining test_chunkspec.py::test_chunk_spec: positional specs (0, 0), a keyword
    spec {'z': 0}, an example keyword input, and four stages."""

    class Example(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p0, self.p1 = (nn.Parameter(torch.randn(D, D) / D**0.5) for _ in range(2))
            self.lin1, self.mid, self.lin2 = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

        def forward(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor = torch.zeros(B, D, dtype=torch.float64)) -> torch.Tensor:
            x = torch.relu(torch.mm(x, self.p0) + y) + z
            x = self.lin1(torch.mm(x, self.p1))
            x = self.mid(torch.relu(x))
            return torch.relu(self.lin2(x))

    model, reference = twin64(Example())
    x, y, z = x64(B, D), x64(B, D), x64(B, D)
    pipe = compile_pipeline(  # type: ignore[call-arg]
        model, (x, y), cpus(4), chunks=4, chunk_spec={"x": 0, "y": 0, "z": 0},
        split_points=["lin1", "mid", "lin2"], example_kwargs={"z": z},
    )  # fmt: skip
    assert len(pipe.stages) == 4
    check_step(pipe, reference, (x, y, z))


def test_float_chunks_refused() -> None:
    """Mirrors pipelining test_microbatch.py::test_split_and_merge's chunk count (issue 10 item 9):
    a float number of chunks is refused with a message."""
    model, _ = twin64(MultiMLP(1))
    with pytest.raises(ValueError, match="chunks"):
        compile_pipeline(model, x64(B, D), ["cpu"], chunks=4.0)  # type: ignore[arg-type]


# -- test_unflatten.py --------------------------------------------------------------------------


class Block(nn.Module):
    """test_unflatten.py's Block: conv, linear, a marker inside, an in-place add of a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.lin0 = nn.Linear(4, 4)
        self.relu = nn.ReLU()
        self.lin1 = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, constant: torch.Tensor) -> torch.Tensor:
        x = self.lin0(self.conv(x))
        pipe_split()
        x.add_(constant)
        return self.relu(self.lin1(x))


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block0 = Block()
        self.block1 = Block()

    def forward(self, x: torch.Tensor, constant: torch.Tensor) -> torch.Tensor:
        x = self.block0(x, constant=constant)
        pipe_split()
        return self.block1(x, constant=constant)


def test_unflatten_nested_markers() -> None:
    """Mirrors pipelining test_unflatten.py::test_unflatten: markers inside submodules and
    between them give four stages; the stages' parameter names are the model's; exact, with a
    constant input passed whole to every micro-batch."""
    model, reference = twin64(Nested())
    x, constant = x64(4, 2, 4, 4), torch.ones(1, 2, 4, 4, dtype=torch.float64)
    pipe = compile_pipeline(model, (x, constant), cpus(4), chunks=2, chunk_spec={"constant": None})
    assert len(pipe.stages) == 4
    for stage in pipe.stages:
        assert {n for n, _ in stage.named_parameters()} <= set(model.state_dict())
    check_step(pipe, reference, (x, constant))


# -- test_transformer.py, test_hf_transformers.py -----------------------------------------------


class TransformerLike(nn.Module):
    """test_transformer.py's TransformerLike: eight MLPs in a Sequential."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[MLP() for _ in range(8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def test_transformer_like_split_point() -> None:
    """Mirrors pipelining test_transformer.py::test_ir: a cut at `layers.4`; every layer is in
    exactly one stage; exact outputs and gradients."""
    model, reference = twin64(TransformerLike())
    pipe = compile_pipeline(model, x64(4, D), CPU2, chunks=2, split_points=["layers.4"])
    layers = [{m.split(".")[1] for m in mods} for mods in stage_modules(pipe)]
    assert layers == [{"0", "1", "2", "3"}, {"4", "5", "6", "7"}]
    check_step(pipe, reference, (x64(4, D),))


class CausalBlock(nn.Module):
    """A GPT-2-like block: pre-norm causal self-attention and an MLP."""

    def __init__(self, d: int = D, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = scores.masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class EncoderBlock(nn.Module):
    """A BERT-like block: post-norm bidirectional self-attention and an MLP."""

    def __init__(self, d: int = D, heads: int = 2) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.attn(x, x, x, need_weights=False)[0])
        return self.ln2(x + self.mlp(x))


class Stack(nn.Module):
    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(4))
        self.ln_f = nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("block", [CausalBlock, EncoderBlock], ids=["gpt2-like", "bert-like"])
def test_transformer_blocks_split(block: type[nn.Module], stages: int) -> None:
    """Mirrors pipelining test_hf_transformers.py (both classes: ::test_pipeline_ir_num_stages,
    ::test_pipeline_layer_completeness, ::test_pipeline_output_equivalence,
    ::test_pipeline_four_stages), on fxpipe's own small blocks: cut at block boundaries, every
    block in one stage, exact in eval under no_grad and in training."""
    model, reference = twin64(Stack(block))
    x = x64(4, 6, D)
    cuts = [f"blocks.{i}" for i in range(4 // stages, 4, 4 // stages)]
    pipe = compile_pipeline(model, x, cpus(stages), chunks=2, split_points=cuts)
    assert len(pipe.stages) == stages
    owners = [{m.split(".")[1] for m in mods if m.startswith("blocks.")} for mods in stage_modules(pipe)]
    assert sorted(b for s in owners for b in s) == ["0", "1", "2", "3"]
    assert all(len(s) == 4 // stages for s in owners)
    pipe.eval()
    reference.eval()
    with torch.no_grad():
        assert_same(pipe(x), reference(x))
    pipe.train()
    reference.train()
    check_step(pipe, reference, (x,))


# -- test_schedule_multiproc.py / test_schedule.py (GPipe over the same model) -----------------


def test_gpipe_grads_and_loss_over_two_steps() -> None:
    """Mirrors pipelining test_schedule_multiproc.py::test_grad_with_tracer,
    ::test_grad_with_manual, ::test_kwargs_with_tracer and test_schedule.py's ScheduleTest
    (ScheduleGPipe): MSE(sum) loss, zero_grad between two steps; output, loss and every
    gradient equal the plain model's."""
    model, reference = twin64(MultiMLP(4))
    pipe = compile_pipeline(model, x64(B, D), cpus(4), chunks=4, split_points=["layers.1", "layers.2", "layers.3"])
    x = x64(B, D)
    with torch.no_grad():
        target = reference(x) + x64(B, D)
    loss_fn = nn.MSELoss(reduction="sum")
    for _ in range(2):
        pipe.zero_grad()
        reference.zero_grad()
        out, ref = pipe(fresh(x)), reference(fresh(x))
        loss, ref_loss = loss_fn(out, target), loss_fn(ref, target)
        loss.backward()
        ref_loss.backward()
        assert_same(out, ref)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=ATOL)
        assert_grads_equal(pipe, reference, tol=ATOL)


def test_training_steps_match() -> None:
    """Mirrors pipelining test_schedule_multiproc.py::test_multi_iter and
    ::test_schedule_with_native_zero_bubble (their parameter check after several steps):
    several optimizer steps keep the pipeline's parameters equal to the plain model's."""
    model, reference = twin64(MultiMLP(2))
    pipe = compile_pipeline(model, x64(B, D), CPU2, chunks=4, split_points=["layers.1"])
    opt, ref_opt = torch.optim.Adam(pipe.parameters(), lr=1e-2), torch.optim.Adam(reference.parameters(), lr=1e-2)
    for _ in range(4):
        x, target = x64(B, D), x64(B, D)
        nn.functional.mse_loss(pipe(fresh(x)), target, reduction="sum").backward()
        nn.functional.mse_loss(reference(fresh(x)), target, reduction="sum").backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=ATOL, msg=lambda m: f"{name}: {m}")


def test_forward_only_iterations() -> None:
    """Mirrors pipelining test_schedule_multiproc.py::test_forward_only: twenty forward-only
    passes, each fed the last output, in eval mode under no_grad."""
    model, reference = twin64(MultiMLP(2))
    pipe = compile_pipeline(model, x64(B, D), CPU2, chunks=4, split_points=["layers.1"])
    pipe.eval()
    reference.eval()
    x = ref = x64(B, D) / 4
    with torch.no_grad():
        for _ in range(20):
            x, ref = torch.tanh(pipe(x)), torch.tanh(reference(ref))
    assert_same(x, ref)


def test_custom_backward_and_attribute_set_in_forward() -> None:
    """Mirrors pipelining test_schedule_multiproc.py::test_schedule_with_weight_update_mlp_e2e
    (MultiMLPWithDw without the split dW schedule): each layer's own backward (halving the
    weight's gradient) runs, and `hidden`, set in forward, holds what the plain model run on
    the micro-batches in turn leaves (the last micro-batch's)."""
    model, reference = twin64(MultiMLPWithDw(2))
    x = x64(B, D)
    pipe = compile_pipeline(model, x, CPU2, chunks=2, split_points=["layers.1"])
    plain_last = copy.deepcopy(reference)  # before a forward leaves `hidden`, which deepcopy refuses
    check_step(pipe, reference, (x,))
    plain_last(fresh(x).chunk(2)[1])
    for i in range(2):
        layer, plain_layer = model.layers[i], plain_last.layers[i]
        assert isinstance(layer, MLPWithDw) and isinstance(plain_layer, MLPWithDw)
        torch.testing.assert_close(layer.hidden.detach(), plain_layer.hidden.detach(), rtol=0, atol=ATOL)


# -- test_backward.py, test_stage_backward.py ---------------------------------------------------


def test_custom_matmul_function() -> None:
    """Mirrors pipelining test_backward.py::test_stage_backward_weight_custom_autograd_function
    and ::test_stage_backward_edge_keeps_python_autograd_function_alive: a Function with its
    own backward (here scaling the input's gradient by 3) inside a pipeline."""

    class ScaledMatmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(a, b)
            return a @ b

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            a, b = ctx.saved_tensors
            return 3 * grad @ b.t(), a.t() @ grad

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(D, D) / D**0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return ScaledMatmul.apply(torch.tanh(x), self.weight)

    model, reference = twin64(nn.Sequential(nn.Linear(D, D), Head()))
    pipe = compile_pipeline(model, x64(B, D), CPU2, chunks=2, split_points=["1"])
    check_step(pipe, reference, (x64(B, D),))


def test_multi_output_intermediate() -> None:
    """Mirrors pipelining test_backward.py::test_stage_backward_multi_output_intermediate and
    ::test_stage_backward_weight_grad_validation: a two-output Function between a split and a
    product, with its own backward."""
    model, reference = twin64(nn.Sequential(nn.Linear(D, D), MultiIntermediate()))
    pipe = compile_pipeline(model, x64(B, D), CPU2, chunks=2, split_points=["1"])
    check_step(pipe, reference, (x64(B, D),))


def test_weight_used_in_two_stages() -> None:
    """Mirrors pipelining test_backward.py::test_stage_backward_weight_shared_weights: one
    weight used on both sides of the cut gets the sum of both gradients."""

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(D, D) / D**0.5)
            self.mid = nn.Linear(D, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.relu(torch.matmul(x, self.w))
            return torch.matmul(self.mid(x), self.w)

    model, reference = twin64(Shared())
    pipe = compile_pipeline(model, x64(B, D), CPU2, chunks=2, split_points=["mid"])
    check_step(pipe, reference, (x64(B, D),))


def test_gradients_accumulate_over_iterations() -> None:
    """Mirrors pipelining test_backward.py::test_stage_backward_weight_multiple_iters,
    ::test_stage_backward, ::test_stage_backward_input, ::test_stage_backward_weight and
    test_stage_backward.py::test_stage_backward: input gradients, and parameter gradients
    accumulated over several backward passes without zero_grad."""
    model, reference = twin64(MultiMLP(2))
    pipe = compile_pipeline(model, x64(B, D), CPU2, chunks=4, split_points=["layers.1"])
    loss_fn = nn.MSELoss(reduction="sum")
    target = x64(B, D)
    for _ in range(3):
        x = x64(B, D)
        check_step(pipe, reference, (x,), loss=lambda out: loss_fn(out, target))


def test_outputs_with_and_without_grad() -> None:
    """Mirrors pipelining test_backward.py::test_stage_backward_mixed_edge_and_tensor_outputs:
    two outputs that need grad and a constant one that does not, each given its own gradient."""

    class TwoOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net1, self.net2 = nn.Linear(D, D), nn.Linear(D, D)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return self.net1(x), self.net2(torch.tanh(x)), torch.ones(1, dtype=x.dtype, device=x.device)

    model, reference = twin64(TwoOut())
    pipe = compile_pipeline(model, x64(B, D), CPU2, chunks=1, split_points=["net2"])
    x = x64(B, D)
    px, rx = fresh(x, True), fresh(x, True)
    out, ref = pipe(px), reference(rx)
    assert_same(out, ref)
    assert not out[2].requires_grad
    g1, g2 = x64(B, D), x64(B, D)
    torch.autograd.backward(out[:2], (g1, g2))
    torch.autograd.backward(ref[:2], (g1, g2))
    assert_grads_equal(pipe, reference, tol=ATOL)
    torch.testing.assert_close(px.grad, rx.grad, rtol=0, atol=ATOL)
