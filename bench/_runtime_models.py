"""Models the runtime benchmarks name as ``module:function`` (a user's model, :mod:`runtime.model`).

``bench._runtime_models:mlp``: eight fully connected layers of 1,024 units with ReLUs between
them (16 layers in the chain), on 1,024 random features, ten classes.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.model import ModelSpec

__all__ = ["mlp"]

WIDTH = 1024


def mlp() -> ModelSpec:
    layers: list[tuple[str, nn.Module]] = []
    for i in range(8):
        layers.append((f"fc{i}", nn.Linear(WIDTH, WIDTH if i < 7 else 10)))
        if i < 7:
            layers.append((f"relu{i}", nn.ReLU()))

    def make_batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(n, WIDTH, generator=g)
        return x, torch.randint(0, 10, (n,), generator=g)

    return ModelSpec(layers, make_batch)
