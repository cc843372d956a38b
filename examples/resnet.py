"""Train a small GroupNorm ResNet to classify noisy shapes through an fxpipe pipeline."""

import torch
import torch.nn.functional as F
from torch import nn

from training import train


def norm(channels: int) -> nn.GroupNorm:
    # GroupNorm, unlike BatchNorm, keeps every sample independent of how the batch is split.
    return nn.GroupNorm(min(8, channels), channels)


class ResidualBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.f = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), norm(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False), norm(cout),
        )
        if stride == 1 and cin == cout:
            self.shortcut: nn.Module = nn.Identity()
        else:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), norm(cout))
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.f(x) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, in_channels: int = 1, num_classes: int = 4, base: int = 16,
                 blocks_per_stage: int = 2, stages: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, base, 3, padding=1, bias=False), norm(base), nn.ReLU())
        blocks, width = [], base
        for s in range(stages):
            out = base * 2**s
            for b in range(blocks_per_stage):
                blocks.append(ResidualBlock(width, out, stride=2 if s > 0 and b == 0 else 1))
                width = out
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def make_model(**kw: int) -> ResNet:
    return ResNet(**kw)


SHAPES = torch.zeros(4, 9, 9)
SHAPES[0, 3:6, :] = 1  # horizontal bar
SHAPES[1, :, 3:6] = 1  # vertical bar
SHAPES[2, 3:6, :] = SHAPES[2, :, 3:6] = 1  # plus
SHAPES[3, 1:8, 1:8] = 1  # square


def make_batch(batch_size: int, seed: int = 0, dtype: torch.dtype = torch.float32,
               size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy images holding one of four shapes at a random place; the label is the shape."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, len(SHAPES), (batch_size,), generator=g)
    corners = torch.randint(0, size - 9, (batch_size, 2), generator=g).tolist()
    images = 0.3 * torch.randn(batch_size, 1, size, size, generator=g, dtype=dtype)
    for image, label, (y, x) in zip(images, labels, corners):
        image[0, y:y + 9, x:x + 9] += SHAPES[label].to(dtype)
    return images, labels


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)


def main(argv: list[str] | None = None) -> None:
    torch.manual_seed(0)
    train(__doc__, make_model(), make_batch, loss_fn, steps=60, lr=1e-3, svg="resnet.svg", argv=argv)


if __name__ == "__main__":
    main()
