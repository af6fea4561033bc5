"""A user's model (``module:function``) for the tests that need one importable from every process."""

from __future__ import annotations

import torch
from torch import nn

from runtime.model import ModelSpec

__all__ = ["mlp"]


def mlp() -> ModelSpec:
    def make_batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(n, 8, generator=g)
        return x, (x[:, 0] + x[:, 1] > 0).long()

    return ModelSpec([nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)], make_batch)
