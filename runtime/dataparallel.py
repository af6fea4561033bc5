"""Exact synchronous data parallelism between virtual workers that may cut the chain differently.

Layer ``l`` lives on one rank of every virtual worker, or on every replica of its stage when
the stage is replicated (its holder set, see :meth:`runtime.layout.Layout.holder_sets`). Before
each optimizer step, the gradients of the layers with the same holder set are flattened into
one buffer, summed with one all-reduce over a process group of exactly those ranks, and divided
by the number of virtual workers. A replica's gradient is the sum over the micro-batches it ran
of their losses divided by the worker's micro-batch count, so the replicas of a stage add up to
their worker's mean gradient: summing over all holders and dividing by the workers gives the
gradient of the global batch's mean loss, as one process computes it. Every rank visits the
holder sets in the same (first-layer) order, so the collectives cannot wait on each other in a
cycle. When every holder set is one rank (one virtual worker, nothing replicated) nothing is
exchanged. A tensor-parallel shard (a ``DTensor`` parameter) is averaged as its local tensor over
the holders of the same shard (:mod:`runtime.tensor_parallel`). Under ``--emulate-links`` each
all-reduce takes the emulated links' time (:class:`runtime.emulation.LinkDelay`).

The gradients are all-reduced in their own type: half under mixed precision (2 bytes per
parameter), fp32 in fp32; or in the plan's pricing's ``allreduce_precision`` when it names another
(``reduce_dtype``: e.g. a half model's gradients summed and divided in fp32, the result rounded
back into the half gradients): the bytes ``CostOptions.allreduce_element_bytes`` prices.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .emulation import LinkDelay
from .layout import Layout
from .tensor_parallel import local

__all__ = ["GradientAverager"]


class GradientAverager:
    """Callable run before ``STEP``: average the rank's gradients over the virtual workers (summed
    over a replicated stage's replicas).

    Must be constructed on every rank (it creates process groups, a collective call)."""

    def __init__(self, layout: Layout, rank: int, layers: Mapping[int, nn.Module],
                 reduce_dtype: torch.dtype | None = None):
        self.workers = layout.workers
        self.reduce_dtype = reduce_dtype  # the gradients' type on the wire (None: their own)
        self.groups: list[tuple[Any, list[nn.Parameter], tuple[int, ...]]] = []
        self.delay: LinkDelay | None = None  # --emulate-links
        self.seconds = 0.0  # in the all-reduces (waiting for the other holders included), as the simulator counts
        sets = layout.holder_sets()
        if all(len(ranks) == 1 for ranks, _ in sets):
            return
        for ranks, held in sets:
            if len(ranks) == 1:  # (every rank skips the same sets: new_group is collective)
                continue
            group = dist.new_group(list(ranks))
            if rank in ranks:
                params = [p for layer in held for p in layers[layer].parameters()]
                if params:
                    self.groups.append((group, params, tuple(ranks)))

    def __call__(self) -> None:
        for group, params, ranks in self.groups:
            grads = []
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(local(p.grad))  # (a shard's own part)
            flat = torch.cat([g.reshape(-1) for g in grads])
            if self.reduce_dtype is not None and flat.dtype != self.reduce_dtype:
                flat = flat.to(self.reduce_dtype)
            t0 = time.perf_counter()
            if self.delay is None:
                dist.all_reduce(flat, group=group)
            else:
                self.delay.wait(self.delay.start(flat, group, ranks))
            self.seconds += time.perf_counter() - t0
            flat /= self.workers
            offset = 0
            for g in grads:
                n = g.numel()
                g.copy_(flat[offset:offset + n].view_as(g))
                offset += n
