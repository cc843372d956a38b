"""Random causal models, built from the kinds of layers language models use, run in slices of their sequence as the
plain model does, through compile_pipeline; the same models with one op that mixes positions are refused."""
from __future__ import annotations

import os
from contextlib import closing
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from torch import nn

from helpers import assert_grads_equal, twin
from fxpipe import compile_pipeline
from fxpipe.passes.position_tags import CausalityError

MAX_LENGTH, VOCAB = 16, 11
EXAMPLES = int(os.environ.get("FXPIPE_PROPERTY_EXAMPLES", "6"))  # per test, twice this (raise it for a longer search)
CAUSAL_KINDS = ("linear", "norm", "sdpa", "tril", "aranges", "additive", "rotary", "positions", "dropout", "sdpa_tril", "sdpa_minus")
MIXING_KINDS = ("mean", "cumsum", "bidirectional", "last", "flip", "sdpa_full")


class Layer(nn.Module):
    """One layer of a random model, (B, T, C) -> (B, T, C), a residual around the attention kinds."""

    tril: torch.Tensor
    minus: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, kind: str, width: int, heads: int) -> None:
        super().__init__()
        self.kind, self.heads = kind, heads
        if kind == "linear":
            self.lin = nn.Linear(width, width)
        elif kind == "norm":
            self.norm = nn.LayerNorm(width)
        elif kind == "positions":
            self.pos = nn.Embedding(MAX_LENGTH, width)
        elif kind == "dropout":
            self.drop = nn.Dropout(0.2)
        elif kind not in ("mean", "cumsum", "last", "flip"):
            self.qkv = nn.Linear(width, 3 * width)
        self.register_buffer("tril", torch.tril(torch.ones(MAX_LENGTH, MAX_LENGTH)))
        self.register_buffer("minus", torch.full((MAX_LENGTH, MAX_LENGTH), float("-inf")).triu(1))
        d = width // heads
        angles = torch.outer(torch.arange(MAX_LENGTH, dtype=torch.float32), torch.linspace(0.1, 1.0, d // 2))
        self.register_buffer("cos", torch.cat([angles.cos()] * 2, -1))
        self.register_buffer("sin", torch.cat([angles.sin()] * 2, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = self.kind
        if kind == "linear":
            return torch.tanh(self.lin(x))
        if kind == "norm":
            return self.norm(x)
        if kind == "positions":
            return x + self.pos(torch.arange(x.size(1), device=x.device))
        if kind == "dropout":
            return self.drop(x)
        if kind in ("mean", "cumsum", "last", "flip"):
            mixed = {"mean": lambda: x.mean(1, keepdim=True), "cumsum": lambda: x.cumsum(1), "last": lambda: x[:, -1:], "flip": lambda: x.flip(1)}[kind]()
            return x + mixed
        return x + self._attention(x)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        kind = self.kind
        if kind == "rotary":
            cos, sin = self.cos[:t], self.sin.narrow(0, 0, t)
            q, k = q * cos + _half(q) * sin, k * cos + _half(k) * sin
        if kind in ("sdpa", "rotary", "bidirectional"):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=kind != "bidirectional")
        elif kind.startswith("sdpa_"):  # a mask given: boolean (True reads), or added
            mask = {"sdpa_tril": self.tril != 0, "sdpa_full": self.tril >= 0, "sdpa_minus": self.minus}[kind]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.narrow(0, 0, t).narrow(1, 0, t))
        else:
            att = q @ k.transpose(-2, -1) * 0.5
            if kind == "tril":
                att = att.masked_fill(self.tril.narrow(0, 0, t).narrow(1, 0, t) == 0, float("-inf"))
            elif kind == "aranges":
                att = torch.where(torch.arange(t)[:, None] >= torch.arange(t)[None, :], att, float("-inf"))
            else:  # an additive mask
                att = att + self.minus[:t, :t]
            y = F.softmax(att, dim=-1) @ v
        return y.transpose(1, 2).reshape(b, t, c)


def _half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Random(nn.Module):
    def __init__(self, kinds: list[str], width: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, width)
        self.layers = nn.Sequential(*[Layer(kind, width, heads) for kind in kinds])
        self.head = nn.Linear(width, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.tok(idx)))


@st.composite
def models(draw: st.DrawFn, mixing: bool = False) -> dict[str, Any]:
    kinds = draw(st.lists(st.sampled_from(CAUSAL_KINDS), min_size=2, max_size=6))
    if mixing:
        kinds.insert(draw(st.integers(0, len(kinds))), draw(st.sampled_from(MIXING_KINDS)))
    length = draw(st.integers(4, MAX_LENGTH))
    slices = draw(st.one_of(st.integers(2, length), st.lists(st.integers(1, 4), min_size=2, max_size=6).filter(lambda ls: sum(ls) <= length)))
    if isinstance(slices, list):
        slices = [*slices, length - sum(slices)] if sum(slices) < length else slices
    return dict(
        kinds=kinds, width=draw(st.sampled_from([8, 12])), heads=draw(st.sampled_from([1, 2])), length=length,
        slices=slices, batch=draw(st.integers(1, 3)), chunks=draw(st.integers(1, 2)), stages=draw(st.integers(1, 3)),
        checkpoint=draw(st.sampled_from(["never", "except_last", "always"])), seed=draw(st.integers(0, 2**16)),
    )


SEARCH = settings(max_examples=2 * EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@SEARCH
@given(case=models())
def test_random_causal_models_in_slices_equal_the_plain_model(case: dict[str, Any]) -> None:
    note(repr(case))
    torch.manual_seed(case["seed"])
    model, plain = twin(Random(case["kinds"], case["width"], case["heads"]))
    model.eval()  # dropout draws per slice: what is compared here is the rest
    plain.eval()
    chunks = min(case["chunks"], case["batch"])
    x = torch.randint(0, VOCAB, (case["batch"], case["length"]), generator=torch.Generator().manual_seed(case["seed"]))
    pipe = compile_pipeline(
        model, x, ["cpu"] * case["stages"], chunks=chunks, sequence_chunks=case["slices"], checkpoint=case["checkpoint"], balance=None,
    )  # fmt: skip
    with closing(pipe):
        out, expected = pipe(x), plain(x)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-11)
        weights = torch.randn_like(expected)
        (out * weights).sum().backward()
        (expected * weights).sum().backward()
        assert_grads_equal(pipe, plain, tol=1e-10)


@SEARCH
@given(case=models(mixing=True))
def test_random_models_with_an_op_that_mixes_positions_are_refused(case: dict[str, Any]) -> None:
    note(repr(case))
    model = Random(case["kinds"], case["width"], case["heads"])
    x = torch.randint(0, VOCAB, (case["batch"], case["length"]))
    with pytest.raises(CausalityError, match="cannot run in slices"):
        compile_pipeline(model, x, ["cpu"] * 2, sequence_chunks=case["slices"])
