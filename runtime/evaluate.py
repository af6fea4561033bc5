"""The global model's loss on held-out batches, the same way for every schedule.

A run that records its global weights (``TrainConfig.eval_global``: after every step of a
flushing schedule, after every WSP pull) is evaluated once it is over, outside the timed
window: every recorded version runs the whole model (this rank's stages, which must be every
layer) on the same held-out batches, the ``EVAL_BATCHES`` global batches of steps
``EVAL_STEP``, ``EVAL_STEP + 1``, ... (never trained on: a run is far shorter), in micro-batches
of the plan's size, and its loss is the mean over them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.func import functional_call

from .data import DataSource

__all__ = ["EVAL_BATCHES", "EVAL_STEP", "evaluate_versions"]

EVAL_STEP = 1_000_000  # the first held-out global batch
EVAL_BATCHES = 4


@torch.no_grad()
def evaluate_versions(modules: Mapping[int, nn.Module], versions: Sequence[Mapping[int, Mapping[str, torch.Tensor]]],
                      data: DataSource, micro_batch_size: int, device: torch.device,
                      batches: int = EVAL_BATCHES) -> list[float]:
    """The held-out loss of every weight version (stage -> parameter name -> tensor) of the
    stages in ``modules`` (every layer of the model, in stage order)."""
    parts: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    for k in range(batches):
        x, y = data.global_batch(EVAL_STEP + k)
        for start in range(0, x.shape[0], micro_batch_size):
            parts.append((x[start:start + micro_batch_size].to(device),
                          y[start:start + micro_batch_size].to(device) if y is not None else None))
    out = []
    for weights in versions:
        total = 0.0
        for x, y in parts:
            h = x
            for s in sorted(modules):
                h = functional_call(modules[s], dict(weights[s]), (h,))
            total += float(data.loss(h, y))
        out.append(total / len(parts))
    return out
