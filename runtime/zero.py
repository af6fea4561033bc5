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

Mixed precision (``bf16`` / ``fp16``, :mod:`runtime.master`): the parameters are half, and a
holder's piece is the fp32 master copy of its elements -- the only fp32 copy of them anywhere --
so each holder keeps its half weights whole and ``1 / n`` of the master copy and of the optimizer
state, as ``CostOptions.sharded_bytes_per_parameter`` counts them. The half gradients are
reduce-scattered in the half type (or the pricing's ``allreduce_precision``), the piece's average
converted to fp32 (and unscaled under fp16) for the step, and the stepped masters all-gathered
in the half type into the half parameters: the bytes the cost model prices for the exchange
(``CostOptions.allreduce_element_bytes``). The layers a rank holds alone train through their own
fp32 masters (:class:`runtime.master.MasterStep`).

Checkpoints hold whole tensors by name, as a plain run's: :mod:`runtime.zero_state` gathers the
pieces before saving and keeps each holder's slice on loading.

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
from .master import MasterStep
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


def _like(p: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """``part`` (this rank's part of ``p``) as ``p`` is: a ``DTensor`` of its placements for a shard."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return part
    return DTensor.from_local(part, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


class ShardedStep:
    """The step of a ZeRO run on one rank: the executor's ``sync`` (:meth:`__call__`, the gradients'
    reduce-scatter) and its optimizer (:meth:`step`, :meth:`zero_grad`; ``param_groups`` and
    ``state`` are the inner optimizer's, for loss scaling and for counting the state).

    ``layers``: this rank's layers by their index in the chain. Must be constructed on every rank
    (it creates a process group per holder set of more than one rank, a collective call)."""

    def __init__(self, layout: Layout, rank: int, layers: Mapping[int, nn.Module], zero: int,
                 optimizer: str, lr: float, reduce_dtype: torch.dtype | None = None):
        if zero not in (1, 2):
            raise ValueError(f"zero = {zero!r}: must be 1 or 2")
        self.zero, self.workers = zero, layout.workers
        self.reduce_dtype = reduce_dtype  # the gradients' type on the wire (None: the parameters')
        self.delay: LinkDelay | None = None  # --emulate-links: the reduce-scatter and all-gather take an all-reduce's time
        self.seconds = 0.0  # in the collectives, as GradientAverager counts its all-reduces
        self.inv_scale = 1.0  # fp16: the gradients' unscaling (runtime.recipe.ScaledStep)
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
        self.mixed = any(local(p).dtype != torch.float32 for p in whole + [p for c in self.pieces for p in c.params])
        # mixed precision: the layers held alone train through their own fp32 masters (runtime.master);
        # a piece's shard is the fp32 master of its elements
        self.whole = MasterStep(whole, optimizer, lr) if self.mixed else None
        self.whole_fp32 = [] if self.mixed else whole
        stepped = self.whole_fp32 + [piece.shard for piece in self.pieces]
        self.optimizer = make_optimizer(stepped, optimizer, lr) if stepped else None

    @property
    def masters(self) -> list[nn.Parameter]:
        """The fp32 master copies this rank holds (mixed precision; none in fp32)."""
        if not self.mixed:
            return []
        return [piece.shard for piece in self.pieces] + (self.whole.masters if self.whole is not None else [])

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        groups = self.optimizer.param_groups if self.optimizer is not None else []
        return groups + (self.whole.param_groups if self.whole is not None else [])

    @property
    def state(self) -> Any:
        own = dict(self.optimizer.state) if self.optimizer is not None else {}
        return {**own, **(self.whole.state if self.whole is not None else {})}

    def grads(self) -> list[torch.Tensor]:
        """The gradients the next step takes (after :meth:`__call__`): the pieces' and, in mixed
        precision, the half gradients of the layers held alone (fp16's overflow check)."""
        out = [piece.shard.grad for piece in self.pieces if piece.shard.grad is not None]
        out += [local(p.grad) for p in self.whole_fp32 if p.grad is not None]
        return out + (self.whole.grads() if self.whole is not None else [])

    def __call__(self) -> None:
        """Reduce-scatter each holder set's gradients: this rank's piece of their average over
        the virtual workers becomes its shard's gradient, in fp32 (ZeRO-2: the full gradients are
        freed)."""
        for piece in self.pieces:
            flat = piece.flat_grads()
            if self.reduce_dtype is not None and flat.dtype != self.reduce_dtype:
                flat = flat.to(self.reduce_dtype)
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
            del flat
            mine /= self.workers
            piece.shard.grad = mine[:piece.hi - piece.lo].float()
            if self.zero >= 2:
                for p in piece.params:
                    p.grad = None

    def step(self) -> None:
        """Step this rank's pieces (and its layers held alone), then all-gather every set's pieces
        into its parameters (in the parameters' type: half under mixed precision)."""
        if self.optimizer is not None:
            if self.inv_scale != 1.0:
                for piece in self.pieces:
                    if piece.shard.grad is not None:
                        piece.shard.grad.mul_(self.inv_scale)
            self.optimizer.step()
        if self.whole is not None:
            self.whole.inv_scale = self.inv_scale
            self.whole.step()
        for piece in self.pieces:
            mine = piece.shard.detach().new_zeros(piece.size, dtype=local(piece.params[0]).dtype)
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

    def gathered_masters(self) -> dict[int, torch.Tensor]:
        """``id(parameter) -> its fp32 master, whole`` (mixed precision; collective over every
        holder set, in the order of :meth:`step`): for saving the run's weights (``state_dir``)."""
        out: dict[int, torch.Tensor] = {}
        if not self.mixed:
            return out
        if self.whole is not None:
            out.update(self.whole.master_of())
        for piece in self.pieces:
            mine = piece.shard.detach().new_zeros(piece.size)
            mine[:piece.hi - piece.lo] = piece.shard.detach()
            full = mine.new_empty(piece.size * len(piece.ranks))
            dist.all_gather_single(full, mine, group=piece.group)
            offset = 0
            for p in piece.params:
                n = local(p).numel()
                part = full[offset:offset + n].view_as(local(p)).clone()
                out[id(p)] = _like(p, part)
                offset += n
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        for piece in self.pieces:
            piece.shard.grad = None
            for p in piece.params:
                p.grad = None
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        if self.whole is not None:
            self.whole.zero_grad(set_to_none)
