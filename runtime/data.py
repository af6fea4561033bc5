"""Synthetic training data: seeded batches drawn from the zoo model's own input maker.

A pool of ``pool_batches`` global batches is made once with the model's ``make_input``
(deterministic); step ``t`` draws a global batch from it with a permutation seeded by
``(seed, t)``. Virtual worker ``w`` trains on rows ``[(w * m + j) * b, (w * m + j + 1) * b)``
of the global batch as its micro-batch ``j`` (``m`` micro-batches of ``b`` samples). Every
process computes the same batches, and a single process can train on the whole global batch
for comparison (:meth:`SyntheticData.global_batch`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .stage import layer_seed

__all__ = ["SyntheticData"]


class SyntheticData:
    def __init__(self, make_input: Callable[[int, str], torch.Tensor], micro_batch_size: int, micro_batches: int,
                 workers: int, seed: int = 0, pool_batches: int = 4):
        self.b, self.m, self.workers, self.seed = micro_batch_size, micro_batches, workers, seed
        self.global_size = micro_batch_size * micro_batches * workers
        self.pool = make_input(self.global_size * pool_batches, "cpu")

    def global_batch(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(layer_seed(self.seed, 10_000 + step))
        idx = torch.randperm(self.pool.shape[0], generator=g)[: self.global_size]
        return self.pool[idx]

    def micro_batch(self, step: int, worker: int, j: int) -> torch.Tensor:
        start = (worker * self.m + j) * self.b
        return self.global_batch(step)[start:start + self.b]
