"""Mixed precision as the cost model prices it: half weights and gradients, an fp32 master copy.

Under ``bf16`` / ``fp16`` (:class:`runtime.recipe.Recipe`) every stage module is cast to the half
type once, before training (:func:`half_stages`: ``module.to(half)``, its parameters and floating
buffers, LayerNorm's included, as the profiler casts the layers it measures), so its forward
computes, and its backward produces gradients, in the half type. :class:`MasterStep` is the
optimizer as the executor calls it: it keeps an fp32 copy of every half parameter (made from the
half values, so the master and the weights agree at the start), and at each step converts each
half gradient to fp32 (unscaling it under fp16: ``inv_scale``), steps the masters with the
run's optimizer (its state is fp32, of the masters' shape) and copies the masters back into the
half parameters (rounded to the half type).

Per parameter that holds 2 bytes of half weights, 2 of half gradient, 4 of fp32 master and the
optimizer's state, what ``CostOptions.bytes_per_parameter`` counts. The fp32 gradients the step
makes are converted and freed a chunk at a time (at most ``CHUNK_ELEMENTS`` elements, or one
tensor when it is larger), so at most that much fp32 gradient is held on top; the optimizers
(SGD, Adam, AdamW) update each element alone, so stepping chunk by chunk gives the values of one
step. A tensor-parallel shard (a ``DTensor`` parameter) has a ``DTensor`` master of the same
placements: the checkpoint writes it at its offset in the whole tensor (:mod:`runtime.named_state`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from partitioner.profiler import half_input

from .recipe import make_optimizer
from .tensor_parallel import local

__all__ = ["CHUNK_ELEMENTS", "MasterStep", "half_stages"]

CHUNK_ELEMENTS = 2**24  # fp32 gradient elements converted at once in a step (64 MiB)


def half_stages(modules: Iterable[nn.Module], half: torch.dtype) -> None:
    """Cast every stage module to ``half`` in place (parameters and floating buffers), and have
    each cast a floating input it is given to ``half`` too (the first stage's images; token ids
    stored as floats that ``half`` cannot hold exactly stay as they are, as the profiler leaves
    them)."""

    def cast_input(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(a if not isinstance(a, torch.Tensor) or a.dtype == half else half_input(a, half) for a in args)

    for module in modules:
        module.to(half)
        module.register_forward_pre_hook(cast_input)


def _master(p: nn.Parameter) -> nn.Parameter:
    """An fp32 copy of ``p`` (a ``DTensor`` of the same placements for a shard)."""
    with torch.no_grad():
        return nn.Parameter(p.detach().to(torch.float32, copy=True))


class MasterStep:
    """The optimizer of a mixed-precision rank: ``params`` (the half parameters of its stages)
    are trained through fp32 masters the inner optimizer steps (``optimizer``, ``lr``: the run's,
    :func:`runtime.recipe.make_optimizer`). ``inv_scale`` multiplies the gradients as they are
    converted (fp16's unscaling, set by :class:`runtime.recipe.ScaledStep` before a step)."""

    def __init__(self, params: Iterable[nn.Parameter], optimizer: str, lr: float):
        self.params = list(params)
        self.masters = [_master(p) for p in self.params]
        self.optimizer = make_optimizer(self.masters, optimizer, lr) if self.masters else None
        self.inv_scale = 1.0

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups if self.optimizer is not None else []

    @property
    def state(self) -> Any:
        return self.optimizer.state if self.optimizer is not None else {}

    def master_of(self) -> Mapping[int, nn.Parameter]:
        """``id(half parameter) -> its master``."""
        return {id(p): m for p, m in zip(self.params, self.masters, strict=True)}

    def grads(self) -> list[torch.Tensor]:
        """The half gradients the next step takes (a shard's local part), for fp16's overflow check."""
        return [local(p.grad) for p in self.params if p.grad is not None]

    def _chunks(self) -> Iterator[list[tuple[nn.Parameter, nn.Parameter]]]:
        chunk: list[tuple[nn.Parameter, nn.Parameter]] = []
        size = 0
        for p, m in zip(self.params, self.masters, strict=True):
            if p.grad is None:
                continue
            n = local(p).numel()
            if chunk and size + n > CHUNK_ELEMENTS:
                yield chunk
                chunk, size = [], 0
            chunk.append((p, m))
            size += n
        if chunk:
            yield chunk

    def step(self) -> None:
        """Step the masters on the fp32 gradients (unscaled) and copy them into the half weights."""
        if self.optimizer is None:
            return
        for chunk in self._chunks():
            for p, m in chunk:
                assert p.grad is not None
                g = p.grad.to(torch.float32)
                if self.inv_scale != 1.0:
                    g.mul_(self.inv_scale)
                m.grad = g
            self.optimizer.step()
            with torch.no_grad():
                for p, m in chunk:
                    m.grad = None
                    local(p).copy_(local(m))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        for m in self.masters:
            m.grad = None
