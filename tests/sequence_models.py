"""Causal language models in the styles slices of a sequence must handle, and models that mix positions otherwise."""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, HEADS, BLOCK = 13, 16, 2, 32


class SdpaBlock(nn.Module):
    """Pre-norm block with `scaled_dot_product_attention(..., is_causal=True)`."""

    def __init__(self, dropout: float = 0.0, causal: bool = True) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH), nn.Dropout(dropout))
        self.causal, self.dropout = causal, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.qkv(self.ln1(x)).split(WIDTH, dim=2)
        q, k, v = (h.view(b, t, HEADS, c // HEADS).transpose(1, 2) for h in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp(self.ln2(x))


class SdpaGPT(nn.Module):
    """Learned positions from `arange(T)`, causal SDPA blocks, a tied head."""

    def __init__(self, layers: int = 2, dropout: float = 0.0, causal: bool = True) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(BLOCK, WIDTH)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*[SdpaBlock(dropout, causal) for _ in range(layers)])
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        return self.head(self.ln(self.blocks(x)))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryBlock(nn.Module):
    """nanoGPT's attention (a `tril` buffer cut to the length, masked_fill, softmax) with rotary
    positions from cos and sin tables cut to the length."""

    bias: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, dropout: float = 0.0, mask: str = "buffer") -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH, bias=False), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.SiLU(), nn.Linear(2 * WIDTH, WIDTH))
        self.attn_drop = nn.Dropout(dropout)
        self.register_buffer("bias", torch.tril(torch.ones(BLOCK, BLOCK)).view(1, 1, BLOCK, BLOCK))
        d = WIDTH // HEADS
        angles = torch.outer(torch.arange(BLOCK, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
        self.register_buffer("cos", torch.cat([angles.cos()] * 2, -1), persistent=False)
        self.register_buffer("sin", torch.cat([angles.sin()] * 2, -1), persistent=False)
        self.mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (h.reshape(b, t, HEADS, c // HEADS).permute(0, 2, 1, 3) for h in (q, k, v))
        cos, sin = self.cos[:t], self.sin.narrow(0, 0, t)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(WIDTH // HEADS))
        if self.mask in ("buffer", "where"):
            keep = self.bias.narrow(2, 0, t).narrow(3, 0, t) == 0
        else:  # a comparison of two aranges: the keys' positions after the queries'
            keep = torch.arange(t, device=x.device)[None, :] > torch.arange(t, device=x.device)[:, None]
        if self.mask == "where":  # the scores where a key may be read, else -inf, written as where(hide, fill, scores)
            att = torch.where(self.bias[:, :, :t, :t] == 0, float("-inf"), att)
        else:
            att = att.masked_fill(keep, float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).permute(0, 2, 1, 3).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class RotaryGPT(nn.Module):
    def __init__(self, layers: int = 2, dropout: float = 0.0, mask: str = "buffer") -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([RotaryBlock(dropout, mask) for _ in range(layers)])
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class Wrapped(nn.Module):
    """A causal GPT with `then(self, h, idx)` applied to its outputs: what may mix positions."""

    then: Callable[["Wrapped", torch.Tensor, torch.Tensor], torch.Tensor]
    table: nn.Parameter
    conv: nn.Conv1d

    def __init__(self, then: Callable[["Wrapped", torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.gpt = SdpaGPT(layers=1)
        self.conv = nn.Conv1d(VOCAB, VOCAB, 3, padding=1)
        self.table = nn.Parameter(torch.randn(12, VOCAB))
        self.then = then

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.then(self, self.gpt(idx), idx)


def tokens(batch: int = 2, length: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


class MaskedSdpaGPT(nn.Module):
    """SDPA given a mask cut from a buffer: boolean (True reads), additive (-inf hides; -1e9 where
    finite), or one that reads every key (not causal)."""

    keep: torch.Tensor
    minus: torch.Tensor

    def __init__(self, mask: str = "boolean") -> None:
        super().__init__()
        self.tok, self.head, self.qkv = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB), nn.Linear(WIDTH, 3 * WIDTH)
        self.register_buffer("keep", torch.ones(BLOCK, BLOCK, dtype=torch.bool).tril() if mask == "boolean" else torch.ones(BLOCK, BLOCK, dtype=torch.bool))
        self.register_buffer("minus", torch.full((BLOCK, BLOCK), float("-inf")).triu(1))
        self.mask = mask

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(WIDTH, dim=-1)
        q, k, v = (h.view(b, t, HEADS, c // HEADS).transpose(1, 2) for h in (q, k, v))
        # additive: -inf hides; finite: -1e9 does (a mask made with torch.finfo(dtype).min, as Hugging Face's)
        mask = self.minus[:t, :t] if self.mask == "additive" else self.minus[:t, :t].clamp(min=-1e9) if self.mask == "finite" else self.keep[:t, :t]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.head(x + y.transpose(1, 2).reshape(b, t, c))
