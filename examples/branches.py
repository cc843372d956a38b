"""Models of parallel branches, cut into stage DAGs: a multi-modal transformer, a DLRM and a CANDLE-Uno.

Each takes several inputs, runs a tower per input, and joins the towers late: the shape where
stages side by side beat a chain. `python examples/branches.py` prints each model's plan as a
chain and as a DAG, and trains the multi-modal one for a few steps.
"""
import argparse
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    """Self-attention with SDPA and dropout."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Encoder(nn.Module):
    """One modality: an input projection, transformer blocks, a mean over the tokens."""

    def __init__(self, embed: nn.Module, width: int, blocks: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.embed = embed
        self.blocks = nn.Sequential(*[Block(width, heads, dropout) for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.embed(x)).mean(1)


class MultiModal(nn.Module):
    """Text, image patches and audio frames, each through its own encoder; the pooled encodings
    concatenated and fused by a head. The text encoder's embedding is tied to its output layer
    (a second head that predicts a token), and the image encoding also skips to the output."""

    def __init__(self, width: int = 32, blocks: int = 2, heads: int = 4, vocab: int = 64, dropout: float = 0.1) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.text = Encoder(self.tokens, width, blocks, heads, dropout)
        self.image = Encoder(nn.Linear(48, width), width, blocks, heads, dropout)
        self.audio = Encoder(nn.Linear(20, width), width, blocks, heads, dropout)
        self.fuse = nn.Sequential(nn.Linear(3 * width, width), nn.GELU(), nn.Dropout(dropout), nn.Linear(width, width))
        self.token_head = nn.Linear(width, vocab, bias=False)
        self.token_head.weight = self.tokens.weight

    def forward(self, text: torch.Tensor, image: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        t, i, a = self.text(text), self.image(image), self.audio(audio)
        fused = self.fuse(torch.cat([t, i, a], dim=-1)) + i
        return self.token_head(fused)

    @staticmethod
    def example(batch: int = 8, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
        return (torch.randint(0, 64, (batch, 12)), torch.randn(batch, 9, 48, dtype=dtype), torch.randn(batch, 16, 20, dtype=dtype))


def mlp(*widths: int, dropout: float = 0.0) -> nn.Sequential:
    """Linear layers with ReLU between (and dropout after each ReLU where given)."""
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()] + ([nn.Dropout(dropout)] if dropout else [])
    return nn.Sequential(*layers[:-2] if dropout else layers[:-1])


class DLRM(nn.Module):
    """Dense features through a bottom MLP; each sparse feature a bag of ids summed by its own
    EmbeddingBag; the pairwise dot products of all those vectors (the interaction) and the dense
    vector through a top MLP to one logit."""

    pairs: torch.Tensor  # a buffer: the index pairs below the diagonal

    def __init__(self, dense: int = 13, tables: int = 8, rows: int = 100, width: int = 16) -> None:
        super().__init__()
        self.bottom = mlp(dense, 64, 32, width)
        self.bags = nn.ModuleList(nn.EmbeddingBag(rows, width, mode="sum") for _ in range(tables))
        self.register_buffer("pairs", torch.tril_indices(tables + 1, tables + 1, offset=-1))
        self.top = mlp(width + (tables + 1) * tables // 2, 64, 32, 1)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        vectors = torch.stack([x] + [bag(sparse[:, k]) for k, bag in enumerate(self.bags)], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([x, dots], dim=1))

    @staticmethod
    def example(batch: int = 8, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
        return torch.randn(batch, 13, dtype=dtype), torch.randint(0, 100, (batch, 8, 3))


class CandleUno(nn.Module):
    """Drug response from a cell line's gene expression and a drug's descriptors and
    fingerprints: a feature tower each, concatenated with the dose, then residual dense blocks."""

    def __init__(self, genes: int = 96, descriptors: int = 128, fingerprints: int = 64, width: int = 64, dropout: float = 0.1) -> None:
        super().__init__()
        self.gene_tower = mlp(genes, 128, 128, width, dropout=dropout)
        self.descriptor_tower = mlp(descriptors, 128, 128, width, dropout=dropout)
        self.fingerprint_tower = mlp(fingerprints, 128, width, dropout=dropout)
        self.merge = nn.Linear(3 * width + 1, width)
        self.residual = nn.ModuleList(mlp(width, width, width, dropout=dropout) for _ in range(2))
        self.out = nn.Linear(width, 1)

    def forward(self, dose: torch.Tensor, genes: torch.Tensor, descriptors: torch.Tensor, fingerprints: torch.Tensor) -> torch.Tensor:
        towers = [self.gene_tower(genes), self.descriptor_tower(descriptors), self.fingerprint_tower(fingerprints)]
        h = F.relu(self.merge(torch.cat([dose, *towers], dim=1)))
        for block in self.residual:
            h = F.relu(h + block(h))
        return self.out(h)

    @staticmethod
    def example(batch: int = 8, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
        return (torch.rand(batch, 1, dtype=dtype), torch.randn(batch, 96, dtype=dtype), torch.randn(batch, 128, dtype=dtype),
                torch.randn(batch, 64, dtype=dtype))  # fmt: skip


MODELS: dict[str, Any] = {"multimodal": MultiModal, "dlrm": DLRM, "candle-uno": CandleUno}


def main(argv: Optional[Sequence[str]] = None) -> None:
    from fxpipe import compile_pipeline

    parser = argparse.ArgumentParser(description="Multi-branch models cut as a chain and as a stage graph, then a few training steps.")
    parser.add_argument("--steps", type=int, default=3, help="training steps of the multi-modal model")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=4)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    for name, kind in MODELS.items():
        model, example = kind(), kind.example(args.batch)
        for stage_graph in ("chain", "dag"):
            pipe = compile_pipeline(model, example, ["cpu"] * 4, chunks=args.chunks, stage_graph=stage_graph, balance="flops")
            print(f"{name}, stage_graph={stage_graph!r}: {pipe.plan.summary().splitlines()[-1 - len(pipe.plan.notes)]}")
            pipe.close()
    model = MultiModal()
    pipe = compile_pipeline(model, MultiModal.example(args.batch), ["cpu"] * 4, chunks=args.chunks, balance="flops")
    optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    for step in range(args.steps):
        text, image, audio = MultiModal.example(args.batch)
        target = torch.randint(0, 64, (args.batch,))
        loss = F.cross_entropy(pipe(text, image, audio), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.3f}")
    pipe.close()


if __name__ == "__main__":
    main()
