"""ZeRO-1 and ZeRO-2 at run time, as the cost model prices them (``CostOptions.zero``).

A layer's data-parallel holders are the ranks that hold the same layer (the same tensor-parallel
shard of it) in the virtual workers and the replicas of its stage (:meth:`runtime.layout.Layout.holder_sets`:
one set per group of layers with the same holders). Per set, the holders' parameters are laid
end to end in one flat buffer of ``N`` elements (the order of :class:`runtime.dataparallel.GradientAverager`),
cut in ``n`` equal pieces of ``ceil(N / n)`` (the last padded), and holder ``k`` (its index in the
set) owns piece ``k``: the optimizer state of those elements lives on it alone, in one flat fp32
parameter the optimizer steps. So every holder keeps ``1 / n`` of each set's optimizer state, as the
cost model divides each layer's state by its holders (to the padding: fewer than ``n`` elements).

Before the step (:meth:`ShardedStep.__call__`, the executor's ``sync``), each set's gradients are
reduce-scattered over the holders (summed, divided by the virtual workers: the same average as the
plain run's all-reduce), each holder receiving its piece; :meth:`ShardedStep.step` steps every
piece, and all-gathers the updated pieces into the parameters. A reduce-scatter and an all-gather
move what one all-reduce moves, which is how the cost model prices them. Under ZeRO-2 the full
gradients are freed as soon as they are reduced (before the optimizer step allocates anything);
under ZeRO-1 they stay to the step's end. Both keep full gradients while the iteration's
micro-batches accumulate into them: a pipeline's gradients are summed over its micro-batches before
they are reduced, so the gradient share ZeRO-2 prices is held only from the reduce-scatter on
(``docs/runtime.md``). The layers of a set of one rank are stepped whole, as without ZeRO.

Numbers: the optimizer's update is elementwise (SGD, Adam, AdamW), so stepping a piece of the
flat buffer gives each element the value the plain optimizer gives it; the reduce-scatter sums in
the order gloo's all-reduce does on two holders (more holders may add in another order, a few
units in the last place).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .emulation import LinkDelay
from .layout import Layout
from .recipe import make_optimizer
from .tensor_parallel import local

__all__ = ["ShardedStep"]


class _Piece:
    """One holder set of this rank: its parameters (their local tensors), the flat layout, and
    this rank's piece of it as a parameter the optimizer steps."""

    def __init__(self, group: Any, ranks: tuple[int, ...], rank: int, params: list[nn.Parameter]):
        self.group, self.ranks, self.params = group, ranks, params
        self.numel = sum(local(p).numel() for p in params)
        self.size = math.ceil(self.numel / len(ranks))  # one piece; the flat buffer is padded to n pieces
        self.index = ranks.index(rank)
        lo, hi = self.index * self.size, min((self.index + 1) * self.size, self.numel)
        with torch.no_grad():
            flat = self.flat_params()
            self.shard = nn.Parameter(flat[lo:hi].clone().float())
        self.lo, self.hi = lo, hi

    def padded(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """``parts`` flattened end to end and padded with zeros to ``n`` pieces."""
        flat = torch.cat([t.reshape(-1) for t in parts])
        pad = self.size * len(self.ranks) - self.numel
        return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat

    def flat_params(self) -> torch.Tensor:
        return self.padded([local(p).detach() for p in self.params])

    def flat_grads(self) -> torch.Tensor:
        return self.padded([local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p in self.params])


class ShardedStep:
    """The step of a ZeRO run on one rank: the executor's ``sync`` (:meth:`__call__`, the gradients'
    reduce-scatter) and its optimizer (:meth:`step`, :meth:`zero_grad`; ``param_groups`` and
    ``state`` are the inner optimizer's, for loss scaling and for counting the state).

    ``layers``: this rank's layers by their index in the chain. Must be constructed on every rank
    (it creates a process group per holder set of more than one rank, a collective call)."""

    def __init__(self, layout: Layout, rank: int, layers: Mapping[int, nn.Module], zero: int,
                 optimizer: str, lr: float):
        if zero not in (1, 2):
            raise ValueError(f"zero = {zero!r}: must be 1 or 2")
        self.zero, self.workers = zero, layout.workers
        self.delay: LinkDelay | None = None  # --emulate-links: the reduce-scatter and all-gather take an all-reduce's time
        self.seconds = 0.0  # in the collectives, as GradientAverager counts its all-reduces
        self.pieces: list[_Piece] = []
        whole: list[nn.Parameter] = []
        for ranks, held in layout.holder_sets():
            group = dist.new_group(list(ranks)) if len(ranks) > 1 else None  # every rank, same order
            if rank not in ranks:
                continue
            params = [p for layer in held for p in layers[layer].parameters()]
            if not params:
                continue
            if group is None:
                whole.extend(params)
            else:
                self.pieces.append(_Piece(group, tuple(ranks), rank, params))
        self.whole = whole
        stepped = whole + [piece.shard for piece in self.pieces]
        self.optimizer = make_optimizer(stepped, optimizer, lr) if stepped else None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups if self.optimizer is not None else []

    @property
    def state(self) -> Any:
        return self.optimizer.state if self.optimizer is not None else {}

    def __call__(self) -> None:
        """Reduce-scatter each holder set's gradients: this rank's piece of their average over
        the virtual workers becomes its shard's gradient (ZeRO-2: the full gradients are freed)."""
        for piece in self.pieces:
            flat = piece.flat_grads()
            mine = flat.new_empty(piece.size)
            t0 = time.perf_counter()
            if self.delay is None:
                dist.reduce_scatter_single(mine, flat, group=piece.group)
            else:
                group = piece.group

                def scatter(out: torch.Tensor = mine, flat: torch.Tensor = flat, group: Any = group) -> Any:
                    return dist.reduce_scatter_single(out, flat, group=group, async_op=True)

                self.delay.wait(self.delay.start(flat, group, piece.ranks, op=scatter))
            self.seconds += time.perf_counter() - t0
            mine /= self.workers
            piece.shard.grad = mine[:piece.hi - piece.lo].float()
            if self.zero >= 2:
                for p in piece.params:
                    p.grad = None

    def step(self) -> None:
        """Step this rank's pieces (and its layers held alone), then all-gather every set's pieces
        into its parameters."""
        if self.optimizer is not None:
            self.optimizer.step()
        for piece in self.pieces:
            mine = piece.shard.detach().new_zeros(piece.size)
            mine[:piece.hi - piece.lo] = piece.shard.detach()
            full = mine.new_empty(piece.size * len(piece.ranks))
            t0 = time.perf_counter()
            dist.all_gather_single(full, mine, group=piece.group)
            self.seconds += time.perf_counter() - t0
            offset = 0
            with torch.no_grad():
                for p in piece.params:
                    t = local(p)
                    n = t.numel()
                    t.copy_(full[offset:offset + n].view_as(t))
                    offset += n

    def zero_grad(self, set_to_none: bool = True) -> None:
        for piece in self.pieces:
            piece.shard.grad = None
            for p in piece.params:
                p.grad = None
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=set_to_none)
