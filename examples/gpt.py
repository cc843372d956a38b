"""Train a small GPT to continue counting sequences through an fxpipe pipeline."""
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from training import train


class CausalSelfAttention(nn.Module):
    mask: torch.Tensor  # a buffer, registered in __init__

    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.scale = 1.0 / math.sqrt(n_embd // n_head)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        mask = torch.tril(torch.ones(block_size, block_size))
        self.register_buffer("mask", mask.view(1, 1, block_size, block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.size(0), x.size(1)
        qkv = self.qkv(x).view(b, t, 3, self.n_head, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # each (b, head, t, head_dim)
        att = (q @ k.transpose(-2, -1)) * self.scale
        # narrow, not self.mask[:, :, :t, :t]: fx cannot trace a slice of a buffer by a traced length.
        mask = self.mask.narrow(2, 0, t).narrow(3, 0, t)
        att = att.masked_fill(mask == 0, float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, -1)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int = 16, block_size: int = 32, n_layer: int = 4,
                 n_head: int = 4, n_embd: int = 64, dropout: float = 0.0) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*[Block(n_embd, n_head, block_size, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        for module in self.modules():
            # Small initial weights keep the tied logits near uniform at the start.
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        return self.head(self.ln_f(self.blocks(x)))


def make_model(**kw: Any) -> GPT:
    return GPT(**kw)


def make_batch(batch_size: int, seed: int = 0, dtype: torch.dtype = torch.float32,
               seq_len: int = 16, vocab_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences counting from a random start by a random step (1-3) mod vocab; targets are the next tokens.

    Token ids are integers, so `dtype` is accepted only for a uniform interface.
    """
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab_size, (batch_size, 1), generator=g)
    step = torch.randint(1, 4, (batch_size, 1), generator=g)
    seq = (start + step * torch.arange(seq_len + 1)) % vocab_size
    return seq[:, :-1], seq[:, 1:]


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), targets.flatten())


def main(argv: list[str] | None = None) -> None:
    torch.manual_seed(0)
    train(__doc__, make_model(dropout=0.1), make_batch, loss_fn, steps=60, lr=1e-3, svg="gpt.svg", argv=argv)


if __name__ == "__main__":
    main()
