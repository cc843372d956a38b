"""Peak memory per CUDA device, as the allocator saw it, under GPipe and 1F1B (needs a GPU)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxpipe import compile_pipeline

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_1f1b_peaks_below_gpipe_on_the_device() -> None:
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    x, y = torch.randn(1024, 1024, device="cuda"), torch.randn(1024, 1024, device="cuda")
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        model = nn.Sequential(*layers).cuda()
        pipe = compile_pipeline(model, x, ["cuda:0", "cuda:0"], chunks=8, checkpoint="never", schedule=schedule)
        pipe.measure_memory = True
        pipe.train_step(x, target=y, loss_fn=F.mse_loss)
        peaks[schedule] = pipe.timeline().device_peak_bytes["cuda:0"]
    assert 0 < peaks["1f1b"] < peaks["gpipe"]
