"""Train a 4-level U-Net to segment noisy rectangles through an fxpipe pipeline."""

import torch
import torch.nn.functional as F
from torch import nn

from training import train


def norm(channels: int) -> nn.GroupNorm:
    # GroupNorm, unlike BatchNorm, keeps every sample independent of how the batch is split.
    return nn.GroupNorm(min(4, channels), channels)


class ConvBlock(nn.Sequential):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(
            nn.Conv2d(cin, cout, 3, padding=1), norm(cout), nn.SiLU(),
            nn.Conv2d(cout, cout, 3, padding=1), norm(cout), nn.SiLU(),
        )


class Down(nn.Sequential):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(nn.MaxPool2d(2), ConvBlock(cin, cout))


class Up(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cout, 2, stride=2)
        self.block = ConvBlock(2 * cout, cout)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.block(torch.cat([self.up(x), skip], dim=1))


class UNet(nn.Module):
    def __init__(self, in_channels: int = 1, out_channels: int = 1, base: int = 8) -> None:
        super().__init__()
        w = [base * 2**i for i in range(4)]
        self.enc1 = ConvBlock(in_channels, w[0])
        self.enc2 = Down(w[0], w[1])
        self.enc3 = Down(w[1], w[2])
        self.enc4 = Down(w[2], w[3])
        self.up3 = Up(w[3], w[2])
        self.up2 = Up(w[2], w[1])
        self.up1 = Up(w[1], w[0])
        self.head = nn.Conv2d(w[0], out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(e1)
        e3 = self.enc3(e2)
        e4 = self.enc4(e3)
        d3 = self.up3(e4, e3)
        d2 = self.up2(d3, e2)
        d1 = self.up1(d2, e1)
        return self.head(d1)


def make_model(**kw: int) -> UNet:
    return UNet(**kw)


def make_batch(batch_size: int, seed: int = 0, dtype: torch.dtype = torch.float32,
               size: int = 32, shapes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy images of a few random rectangles; the target is the rectangles' mask."""
    g = torch.Generator().manual_seed(seed)
    lo = torch.randint(0, size - 6, (2, batch_size, shapes, 1, 1), generator=g)
    hi = lo + torch.randint(4, size // 2, (2, batch_size, shapes, 1, 1), generator=g)
    ys = torch.arange(size).view(1, 1, size, 1)
    xs = torch.arange(size).view(1, 1, 1, size)
    inside = (ys >= lo[0]) & (ys < hi[0]) & (xs >= lo[1]) & (xs < hi[1])
    mask = inside.any(dim=1, keepdim=True).to(dtype)
    noise = torch.randn(mask.shape, generator=g, dtype=dtype)
    return mask + 0.6 * noise, mask


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(output, targets)


def main(argv: list[str] | None = None) -> None:
    torch.manual_seed(0)
    train(__doc__, make_model(), make_batch, loss_fn, steps=40, lr=3e-3, svg="unet.svg", argv=argv)


if __name__ == "__main__":
    main()
