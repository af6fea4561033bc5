"""A user's model (``module:function``) for the tests that need one importable from every process."""

from __future__ import annotations

import torch
from torch import nn

from runtime.model import ModelSpec

__all__ = ["mlp", "mlp_tp"]


def mlp() -> ModelSpec:
    def make_batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(n, 8, generator=g)
        return x, (x[:, 0] + x[:, 1] > 0).long()

    return ModelSpec([nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)], make_batch)


def mlp_tp() -> ModelSpec:
    """Five layers; layer 2 is an MLP that declares Megatron's plan (its first linear split by output
    features, the second by input features), so it runs sharded on a tensor-parallel group."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    def make_batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(2000 + step)
        x = torch.randn(n, 8, generator=g)
        return x, (x[:, 0] - x[:, 2] > 0).long()

    def tensor_parallel(index: int, layer: nn.Module) -> dict[str, object] | None:
        return {"0": ColwiseParallel(), "2": RowwiseParallel()} if index == 2 else None

    layers = [("fc0", nn.Linear(8, 16)), ("act0", nn.Tanh()),
              ("mlp", nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))), ("act1", nn.Tanh()),
              ("out", nn.Linear(16, 2))]
    return ModelSpec(layers, make_batch, tensor_parallel=tensor_parallel)
