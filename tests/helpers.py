"""Helpers the tests share: example models, a fan-out model, and comparisons with the plain model."""
from __future__ import annotations

import copy
import importlib
import itertools
from typing import Any, Optional, Sequence, TypeVar

import torch
import torch.nn.functional as F
from torch import nn


def example_module(name: str) -> Any:
    return importlib.import_module(name)


def covering(names: Sequence[Any], axes: Sequence[Sequence[Any]], turning: Sequence[Any]) -> list[tuple[Any, ...]]:
    """Test cases `(name, *point, value)`: each name at every point of the grid `axes` once, with
    one value of `turning` that turns with the point and the name. Where each axis is as long as
    `turning`, each name meets every value along each axis; where the names are as many as the
    values, together they run every (point, value): the full product in a fraction of its cases."""
    indices = list(itertools.product(*(range(len(axis)) for axis in axes)))
    return [
        (name, *(axis[i] for axis, i in zip(axes, index)), turning[(k + sum(index)) % len(turning)])
        for k, name in enumerate(names)
        for index in indices
    ]


class Counts(nn.Module):
    """Writes a buffer in forward and reads it: the model's own buffer must be the one written."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 8)
        self.count: torch.Tensor
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        return self.lin(x) * (self.count * 0.5 + 1)


class BufferCounter(nn.Module):
    """Counts its calls in a float64 buffer, and scales its input by the count."""

    n: torch.Tensor  # a buffer, registered in __init__

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("n", torch.zeros(1, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n.add_(1)
        return x * self.n.clone()


class CountingBlock(nn.Module):
    """A Linear of `width`, then a BufferCounter: kept whole, it writes its child's buffer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin, self.cnt = nn.Linear(width, width), BufferCounter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cnt(torch.tanh(self.lin(x)))


class WithPositions(nn.Module):
    """`pos` holds one row per position, the same for every sample."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.a(x + pos)))


class SeqFirst(nn.Module):
    """Takes (time, batch, features) to (time, batch, classes): its batch along dim 1."""

    def __init__(self, width: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class FanOut(nn.Module):
    """`a` feeds three later layers: cut in 4 stages, it is a skip to each of stages 2 and 3."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.tanh(self.layers[0](x))
        b = torch.tanh(self.layers[1](a))
        c = torch.tanh(self.layers[2](b))
        d = torch.tanh(self.layers[3](c)) + a
        e = torch.tanh(self.layers[4](d))
        f = torch.tanh(self.layers[5](e)) * a
        g = torch.tanh(self.layers[6](f)) + b
        return self.layers[7](g) + a


class TiedEnds(nn.Module):
    """Its first and last layers share one weight: cut after `a`, each stage holds a copy."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.c.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class WindowBlock(nn.Module):
    """MaxViT's block in small: a BatchNorm, a window partition (reshape and permute) and a
    residual MLP on the windows. `grid` (a stage of its own with `split_points=["grid"]`) puts the
    windows back as a feature map: its permute's backward hands the block a gradient in a permuted
    layout. On a 2x2 map the window partition is a view, whose backward gives one-sample
    micro-batches the layouts that torch 2.13's CPU batch_norm backward gets wrong, unless they
    are the plain model's own."""

    def __init__(self, channels: int = 8, grid: bool = True) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 3, 1)
        self.conv = nn.Conv2d(3, channels, 1)
        self.norm = nn.BatchNorm2d(channels)
        self.mlp = nn.Sequential(nn.LayerNorm(channels), nn.Linear(channels, channels))
        self.grid = WindowGrid() if grid else None
        self.head = nn.Linear(channels, 3) if grid else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.conv(self.stem(x)))
        b, c, h, w = y.shape
        windows = y.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 3, 5, 1)
        z = self.mlp(windows) + windows
        return z if self.grid is None or self.head is None else self.head(self.grid(z))


class WindowGrid(nn.Module):
    """Windows back to a feature map, averaged over it."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        b, rows, cols, h, w, c = z.shape
        return z.permute(0, 5, 1, 3, 2, 4).reshape(b, c, rows * h, cols * w).mean((2, 3))


def real_tensors_only(t: torch.Tensor, heads: int) -> torch.Tensor:
    """A library function with a type check (einops' backends have one): a trace's value fails it."""
    if type(t) is not torch.Tensor and not isinstance(t, nn.Parameter):
        raise RuntimeError(f"Tensor type unknown to the library {type(t)}")
    return t.reshape(t.shape[0], heads, -1).flip(-1).reshape(t.shape[0], -1)


def assert_grads_equal(pipe: nn.Module, reference: nn.Module, tol: float = 1e-10) -> None:
    """Every parameter's gradient in the pipeline equals the reference's, by name."""
    ref = dict(reference.named_parameters())
    names = [name for name, _ in pipe.named_parameters()]
    assert names == list(ref), "parameter names differ from the plain model's"
    for name, param in pipe.named_parameters():
        expected = ref[name].grad
        if expected is None and not ref[name].requires_grad:  # frozen: none in either
            assert param.grad is None, f"{name}: a gradient, for a parameter the reference froze"
            continue
        assert param.grad is not None, f"{name}: no gradient"
        assert expected is not None, f"{name}: the reference has no gradient"
        torch.testing.assert_close(param.grad.cpu(), expected.cpu(), rtol=0, atol=tol, msg=lambda m: f"{name}: {m}")


def assert_call_and_grads_equal(pipe: nn.Module, reference: nn.Module, *args: Any, tol: float = 1e-12, **kwargs: Any) -> None:
    """`pipe(*args, **kwargs)` equals the reference's output, and `torch.autograd.grad` of its sum
    gives each parameter the reference's gradient (and nothing to `.grad`)."""
    out, expected = pipe(*args, **kwargs), reference(*args, **kwargs)
    torch.testing.assert_close(out, expected, rtol=0, atol=tol)
    before = [(p.grad, None if p.grad is None else p.grad.clone()) for p in pipe.parameters()]
    got = torch.autograd.grad(out.sum(), list(pipe.parameters()))
    for p, (grad, values) in zip(pipe.parameters(), before):
        assert p.grad is grad and (grad is None or values is None or torch.equal(grad, values)), "autograd.grad wrote into .grad"
    for grad, want in zip(got, torch.autograd.grad(expected.sum(), list(reference.parameters()))):
        torch.testing.assert_close(grad, want, rtol=0, atol=tol)


M = TypeVar("M", bound=nn.Module)


def grad_of(param: torch.Tensor) -> torch.Tensor:
    """`param.grad`, which a backward through it has set."""
    assert param.grad is not None
    return param.grad


def twin(model: M) -> tuple[M, M]:
    """The model in float64, and an independent copy for reference."""
    model = model.double()
    return model, copy.deepcopy(model)


class RenormTied(nn.Module):
    """An Embedding with max_norm (it renormalises the rows it looks up, in place) tied to the
    head: called whole, or as F.embedding, which torch.fx traces into `embedding_renorm_`."""

    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.functional = functional
        self.emb = nn.Embedding(10, 6, max_norm=1.0)
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.embedding(x, self.emb.weight, max_norm=1.0) if self.functional else self.emb(x)
        return self.head(torch.tanh(self.b(torch.tanh(self.a(h)))))


X = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))  # fixed whatever was imported first


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = Block(), Block(), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


class Positions(nn.Module):
    """Adds a position table it makes at construction and leaves out of its state dict."""

    table: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(6, dtype=torch.float64) / 6, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table


class PaddedLM(nn.Module):
    """A language model computing its own loss as Hugging Face's do: the labels shifted by one,
    padding labelled -100, a cross-entropy averaged over the positions that count."""

    def __init__(self, how: str = "function", vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        self.embed, self.mix, self.head = nn.Embedding(vocab, width), nn.Linear(width, width), nn.Linear(width, vocab)
        self.how, self.vocab = how, vocab
        self.loss = nn.CrossEntropyLoss(label_smoothing=0.1)
        if how == "weighted":  # class weights: the mean is over the weights of the positions that count
            self.register_buffer("class_weights", torch.linspace(0.5, 2.0, vocab))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(torch.tanh(self.mix(self.embed(ids))))
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        if self.how == "module":
            loss = self.loss(logits.view(-1, self.vocab), shifted.view(-1))
        elif self.how == "weighted":
            loss = F.cross_entropy(logits.view(-1, self.vocab), shifted.view(-1), weight=self.get_buffer("class_weights"))
        else:
            loss = F.cross_entropy(logits.view(-1, self.vocab), shifted.view(-1), ignore_index=-100)
        return {"loss": loss, "logits": logits}


def padded_labels(seed: int, pads: tuple[int, ...] = (7, 2, 0, 5, 6, 1, 3, 8)) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and their labels, the last `pads[i]` positions of sample i labelled -100."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 11, (len(pads), 10), generator=generator)
    labels = ids.clone()
    for row, pad in enumerate(pads):  # each sample counts another number of positions
        labels[row, 10 - pad :] = -100
    return ids, labels


class TiedUnderReentrant(nn.Module):
    """An embedding tied to a head that runs under the model's own reentrant checkpoint, in
    another stage."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mid = nn.Embedding(16, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(torch.tanh(self.emb(idx))))
        return torch.utils.checkpoint.checkpoint(self.head, h, use_reentrant=True)


class Attends(nn.Module):
    """Returns attention weights where the call asks for them, None otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor, need_weights: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        h = self.a(x)
        out, weights = self.attention(h, h, h, need_weights=need_weights)
        return self.b(out), weights


class ReturnsItsSize(nn.Module):
    """Returns a torch.Size beside its output."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Size]:
        h = self.b(self.a(x).relu())
        return h, h.shape[1:]


class OwnLoss(nn.Module):
    """Returns its own loss, reduced as the call says."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        return F.cross_entropy(self.c(torch.tanh(self.b(torch.relu(self.a(x))))), labels, reduction=reduction)


def prepared_for_qat() -> nn.Module:
    """A small model prepared for quantisation-aware training: fused observers that write their
    statistics in forward, and fake quantisation (6 features in, 3 out)."""
    import torch.ao.quantization as tq

    class Quantised(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant, self.dequant = tq.QuantStub(), tq.DeQuantStub()
            self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dequant(self.b(torch.relu(self.a(self.quant(x)))))

    model = Quantised()
    model.qconfig = tq.get_default_qat_qconfig("x86")
    tq.prepare_qat(model.train(), inplace=True)
    return model


class LowRank(nn.Module):
    """A low-rank adapter of a square layer, from a fixed generator."""

    def __init__(self, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(1)
        self.a = nn.Parameter(torch.randn(2, width, generator=generator, dtype=dtype) * 0.3)
        self.b = nn.Parameter(torch.randn(width, 2, generator=generator, dtype=dtype) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.a.T @ self.b.T


def add_low_rank_adapter(linear: nn.Linear, as_module: bool = False) -> None:
    """A low-rank adapter added to a layer called whole (after compiling, say), as parameters of
    the layer (`lora_a`, `lora_b`) or as a module of its own (`lora`), that a forward hook reads."""
    adapter = LowRank(linear.in_features, linear.weight.dtype)
    if as_module:
        linear.lora = adapter
        linear.register_forward_hook(lambda module, args, out: out + module.lora(args[0]))
    else:
        linear.lora_a, linear.lora_b = adapter.a, adapter.b
        linear.register_forward_hook(lambda module, args, out: out + args[0] @ module.lora_a.T @ module.lora_b.T)
