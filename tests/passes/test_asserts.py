"""Assertions whose message names a traced value: the pipeline's failure reads as the plain model's."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fxpipe import compile_pipeline


class _Stem(nn.Module):
    """torchvision's ViT checks its image size so; the braces check the message is kept as written."""

    def __init__(self) -> None:
        super().__init__()
        self.size = 8
        self.proj, self.head = nn.Conv2d(3, 4, 4, 4), nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        torch._assert(h == self.size, f"Wrong {{height}}! Expected {self.size} but got {h}, width {w}!")
        return self.head(self.proj(x).flatten(2).mean(2))


def test_a_failed_assertion_names_the_call_s_values_as_the_plain_model_does() -> None:
    """Before, it read "got Proxy(getitem_2)": the message was formatted while tracing."""
    model = _Stem().double()
    pipe = compile_pipeline(model, torch.randn(4, 3, 8, 8, dtype=torch.float64), ["cpu", "cpu"], chunks=2)
    x = torch.randn(4, 3, 12, 12, dtype=torch.float64)
    with pytest.raises(AssertionError, match=r"Wrong \{height\}! Expected 8 but got 12, width 12!"):
        model(x)
    with pytest.raises(Exception, match=r"AssertionError: Wrong \{height\}! Expected 8 but got 12, width 12!$"):
        pipe(x)
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(pipe(x), model(x), rtol=0, atol=1e-12)
