"""A causal model runs in slices of its sequence, each slice reading the keys and values the ones before it carry,
and computes what the whole sequence does; a model that mixes positions otherwise is refused, naming the op
(passes/causal.py, passes/sequence_slices.py)."""
from __future__ import annotations

import sys
import pathlib
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sequence_models import BLOCK, MaskedSdpaGPT, RotaryGPT, SdpaGPT, Wrapped, tokens
from fxpipe.passes.causal import prove_causal
from fxpipe.passes.position_tags import K, Q, CausalityError, Positions
from fxpipe.schedules.slices import slice_lengths
from fxpipe.passes.sequence_slices import check_slices, run_in_slices, slice_graph
from fxpipe.tracing.trace import trace

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
from gpt import make_model  # noqa: E402

CAUSAL: dict[str, Callable[[], nn.Module]] = {
    "gpt with a tril buffer and learned positions": lambda: make_model(n_layer=2, n_embd=16, n_head=2),
    "gpt with causal sdpa and learned positions": lambda: SdpaGPT(),
    "rotary gpt with a tril buffer (nanoGPT's attention)": lambda: RotaryGPT(),
    "rotary gpt masked by a comparison of two aranges": lambda: RotaryGPT(mask="aranges"),
    "sdpa given a boolean tril mask": lambda: MaskedSdpaGPT("boolean"),
    "sdpa given an additive mask": lambda: MaskedSdpaGPT("additive"),
    "sdpa given an additive mask of a finite fill": lambda: MaskedSdpaGPT("finite"),
    "rotary gpt masked by where(hide, -inf, scores)": lambda: RotaryGPT(mask="where"),
}
LENGTHS = [[12], [6, 6], [5, 3, 4], [1] * 12, [2, 7, 3]]


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    found = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert len(found) == len(list(model.parameters()))
    return found


def _sliced(model: nn.Module, x: torch.Tensor) -> tuple[Any, Any]:
    gm = trace(model)
    proof = prove_causal(gm, (x,))
    return slice_graph(gm, proof), proof


@pytest.mark.parametrize("name", list(CAUSAL))
def test_slices_compute_the_whole_sequence_forward_and_backward(name: str) -> None:
    torch.manual_seed(0)
    model = CAUSAL[name]().double()
    x = tokens()
    sliced, proof = _sliced(model, x)
    whole = model(x)
    (whole * whole.detach()).sum().backward()
    expected = _grads(model)
    for lengths in LENGTHS:
        model.zero_grad()
        out = run_in_slices(sliced, proof, (x,), lengths)
        torch.testing.assert_close(out, whole, rtol=0, atol=1e-12, msg=lambda m: f"{lengths}: {m}")
        (out * whole.detach()).sum().backward()
        for n, grad in _grads(model).items():
            torch.testing.assert_close(grad, expected[n], rtol=1e-10, atol=1e-12, msg=lambda m: f"{lengths}, {n}: {m}")


def test_the_proof_names_the_keys_and_values_to_carry_and_the_tables_of_each_role() -> None:
    model = make_model(n_layer=2, n_embd=16, n_head=2)
    proof = prove_causal(trace(model), (tokens(),))
    # Per block, the keys (transposed: positions on dim 3) and the values (dim 2) are carried.
    assert sorted(dim for _, dim in proof.carries) == [2, 2, 3, 3]
    roles = sorted(proof.role_of(variable) for cuts in proof.tables.values() for variable, _ in cuts)
    assert roles == sorted([Q] + [Q, K] * 2)  # arange(T); each mask's rows and columns
    assert proof.inputs == {"idx": 1} and proof.outputs == [1]


def test_rotary_tables_cut_by_slicing_and_by_narrow_take_the_slice_s_positions() -> None:
    gm = trace(RotaryGPT(layers=1))
    proof = prove_causal(gm, (tokens(),))
    kinds = {node.target if node.op == "call_method" else getattr(node.target, "__name__", "") for node in gm.graph.nodes if node.name in proof.tables}
    assert kinds == {"getitem", "narrow"}
    roles = {name: [proof.role_of(v) for v, _ in cuts] for name, cuts in proof.tables.items()}
    assert sorted(map(tuple, roles.values())) == [(K,), (Q,), (Q,), (Q,)]  # cos[:T], sin.narrow, the mask's rows, its columns


def test_scores_tagged_with_a_query_and_a_key_dim() -> None:
    model = make_model(n_layer=1, n_embd=16, n_head=2)
    gm = trace(model)
    proof = prove_causal(gm, (tokens(),))
    softmax = next(n for n in gm.graph.nodes if "softmax" in n.name)
    tag = proof.tags[softmax.name]
    assert isinstance(tag, Positions) and tag.dims == ((2, Q), (3, K)) and tag.masked == "0"


def test_dropout_in_training_mode_slices_draw_per_slice_and_gradients_are_those_of_the_forward_run() -> None:
    # The slices draw masks of their own shapes: what is exact is the gradient of what they computed,
    # checked against finite differences of the same draws (the seed set before each run).
    torch.manual_seed(0)
    model = SdpaGPT(layers=1, dropout=0.3).double().train()
    x = tokens(1, 6)
    sliced, proof = _sliced(model, x)
    name = "blocks.0.qkv.bias"
    weight = dict(model.named_parameters())[name].detach()

    class Slices(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sliced = sliced

        def forward(self) -> torch.Tensor:
            return run_in_slices(self.sliced, proof, (x,), [2, 4]).pow(2).sum()

    def run(bias: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(1)
        return torch.func.functional_call(Slices(), {f"sliced.{name}": bias}, ())

    assert torch.autograd.gradcheck(run, (weight.clone().requires_grad_(),), eps=1e-6, atol=1e-6)
    torch.manual_seed(1)
    drawn = run_in_slices(sliced, proof, (x,), [2, 4])
    model.eval()
    assert not torch.equal(drawn, run_in_slices(sliced, proof, (x,), [2, 4]))  # masks were drawn


@pytest.mark.parametrize("name", list(CAUSAL))
def test_the_check_on_the_example_passes_in_training_mode_with_dropout(name: str) -> None:
    model = CAUSAL[name]()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.5
    x = tokens()
    gm = trace(model)
    proof = prove_causal(gm, (x,))
    before = torch.random.get_rng_state()
    check_slices(gm, slice_graph(gm, proof), proof, (x,), [5, 7])
    assert torch.equal(torch.random.get_rng_state(), before)


def test_the_check_on_the_example_catches_slices_that_read_other_positions() -> None:
    model = SdpaGPT().double()
    x = tokens()
    gm = trace(model)
    proof = prove_causal(gm, (x,))
    proof.tables.clear()  # every slice's arange counts from 0: positions are wrong after the first
    with pytest.raises(CausalityError, match=r"slices of \[6, 6\] differ from the whole sequence"):
        check_slices(gm, slice_graph(gm, proof), proof, (x,), [6, 6])
    check_slices(gm, slice_graph(gm, proof), proof, (x,), [12])  # one slice reads the whole: nothing to catch


REFUSED: dict[str, tuple[Callable[[Wrapped, torch.Tensor, torch.Tensor], torch.Tensor], str]] = {
    "bidirectional sdpa": (lambda m, h, idx: h, "bidirectional"),
    "a mean over the sequence": (lambda m, h, idx: h.mean(1, keepdim=True) + h, "reduces over the sequence"),
    "a convolution along the sequence": (lambda m, h, idx: m.conv(h.transpose(1, 2)).transpose(1, 2), "Conv1d is called whole"),
    "the last position alone": (lambda m, h, idx: h[:, -1], "reads one position"),
    "a cumulative sum": (lambda m, h, idx: torch.cumsum(h, 1), "reduces over the sequence"),
    "a table of the example's length": (lambda m, h, idx: h + m.table, "does not follow the sequence"),
    "a mask built in forward": (lambda m, h, idx: h + torch.ones((idx.size(1), idx.size(1))).tril().sum(0)[:, None], "builds a tensor of the sequence's length"),
    "unmasked scores": (lambda m, h, idx: F.softmax(h @ h.transpose(1, 2), -1) @ h, "bidirectional"),
    "the length as a number": (lambda m, h, idx: h / idx.size(1), "the sequence's length as a number"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_model_that_reads_later_positions_is_refused_naming_the_op(name: str) -> None:
    then, words = REFUSED[name]
    model = Wrapped(then)
    if name == "bidirectional sdpa":
        model.gpt = SdpaGPT(layers=1, causal=False)
    with pytest.raises(CausalityError, match="cannot run in slices") as caught:
        prove_causal(trace(model, record_lines=True), (tokens(),))
    assert any(words in problem for problem in caught.value.problems), caught.value.problems
    assert "How to fix" in str(caught.value)
    if name != "bidirectional sdpa":  # the model's line is named (here, this file's lambda)
        assert any("test_causal.py" in problem for problem in caught.value.problems), caught.value.problems


class _OwnLoss(nn.Module):
    """A causal LM that returns its own loss: one number for the whole sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = SdpaGPT(layers=1)

    def forward(self, idx: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.gpt(idx)
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


def test_a_loss_computed_in_forward_is_refused_saying_to_give_it_as_loss_fn() -> None:
    """Before, the advice was causal attention, which the model had."""
    with pytest.raises(CausalityError, match=r"How to fix: the ops above compute only what the model returns as one number for the whole sequence \(cross_entropy.*loss_fn="):
        prove_causal(trace(_OwnLoss()), (tokens(), tokens(seed=1)))
    with pytest.raises(CausalityError, match="How to fix: causal attention"):  # the same advice where other outputs read them too
        prove_causal(trace(Wrapped(lambda m, h, idx: h + h.flatten(0, 1).sum())), (tokens(),))


class _LinearAttention(nn.Module):
    """Attention with no softmax: scores times a tril buffer narrowed to the length, summed over
    keys (or, `turned`, times its transpose, which keeps the later keys)."""

    def __init__(self, turned: bool = False) -> None:
        super().__init__()
        self.gpt, self.turned = SdpaGPT(layers=1), turned
        self.tril: torch.Tensor
        self.register_buffer("tril", torch.ones(BLOCK, BLOCK).tril())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.gpt(idx)
        t = idx.size(1)
        mask = self.tril[:t, :t]
        return (h @ h.transpose(1, 2) * (mask.T if self.turned else mask)) @ h + h


def test_scores_times_a_mask_of_zeros_after_the_query_are_causal_and_times_its_transpose_are_refused() -> None:
    """Before, linear attention masked by a multiplication was refused as 'not masked causally'."""
    torch.manual_seed(0)
    model, x = _LinearAttention().double(), tokens()
    sliced, proof = _sliced(model, x)
    torch.testing.assert_close(run_in_slices(sliced, proof, (x,), [5, 3, 4]), model(x), rtol=0, atol=1e-10)
    with pytest.raises(CausalityError, match="not masked causally"):
        prove_causal(trace(_LinearAttention(turned=True)), (x,))


def test_attention_given_a_mask_that_reads_later_keys_is_refused() -> None:
    with pytest.raises(CausalityError, match="lets a query read keys after it"):
        prove_causal(trace(MaskedSdpaGPT("everything")), (tokens(),))


def test_one_arange_for_both_roles_is_refused_saying_to_make_two() -> None:
    class SelfCompared(RotaryGPT):
        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            i = torch.arange(idx.size(1))
            h = self.tok(idx)
            att = (h @ h.transpose(1, 2)).masked_fill(i[None, :] > i[:, None], float("-inf"))
            return self.head(F.softmax(att, -1) @ h)

    with pytest.raises(CausalityError, match="make one for each"):
        prove_causal(trace(SelfCompared()), (tokens(),))


def test_a_key_padding_mask_applied_with_masked_fill_is_refused_naming_it() -> None:
    """Before, the refusal spoke of an arange compared with itself alone, which the model has not."""

    class Padded(RotaryGPT):
        def forward(self, idx: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            h = self.tok(idx)
            att = (h @ h.transpose(1, 2)).masked_fill(pad[:, None, :] == 0, float("-inf"))
            return self.head(F.softmax(att, -1) @ h)

    idx = tokens()
    with pytest.raises(CausalityError, match="a key-padding mask, applied along the keys"):
        prove_causal(trace(Padded()), (idx, torch.ones_like(idx)))


def test_slice_lengths_are_even_and_cover_the_sequence() -> None:
    assert slice_lengths(12, 5) == [3, 3, 2, 2, 2]
    assert slice_lengths(BLOCK, 1) == [BLOCK]
    with pytest.raises(ValueError, match="give 1 to 4"):
        slice_lengths(4, 5)
