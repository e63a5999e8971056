"""A user's model for bench/advise.py's ``--model`` arm: ``dpprof profile --model bench.advise_model:mlp
--input-shape 256`` from the checkout's root."""
from __future__ import annotations

from torch import nn


def mlp() -> nn.Module:
    """An MLP 256-512-512-10: per-sample work in a few large matrix products."""
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
