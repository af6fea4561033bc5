"""How a run trains, as its plan was priced: the optimizer and the precision (:class:`Recipe`).

A plan records the options it was priced with (``Plan.pricing``, :class:`partitioner.pricing.CostOptions`;
every solver's plan does, Adam in fp32 by default). The runtime runs the same (a plan made by hand,
without ``pricing``, runs plain SGD in fp32 unless told otherwise, said in a note):

optimizer
    ``optimizer_state_factor`` 2 (two fp32 moments per parameter) is Adam, 0 is plain SGD;
    ``TrainConfig.optimizer`` (``sgd``, ``adam``, ``adamw``) overrides it, and the mismatch with the
    pricing is said in one line (:attr:`Recipe.notes`). A factor of 1 (SGD with momentum) runs as
    plain SGD, said too. One construction: :func:`make_optimizer`.
precision
    ``fp32``; or ``bf16`` / ``fp16`` mixed precision as the cost model prices it, the recipe of
    Megatron-LM and DeepSpeed (:mod:`runtime.master`): each stage module cast to the half type
    once (its parameters and floating buffers, LayerNorm's too, as the profiler casts the layers
    it measures), so the forward, the backward and the gradients are half; an fp32 master copy of
    every parameter (made from the half values) that the optimizer steps, its state fp32, the
    result copied back into the half parameters; the tensors sent between stages half; the loss
    computed in fp32 (:mod:`runtime.data`). Per parameter: 2 bytes of weights, 2 of gradient, 4 of
    master and the optimizer's state (``CostOptions.bytes_per_parameter``); under ZeRO the master
    and the state divided by the holders (:mod:`runtime.zero`). The data-parallel gradients are
    all-reduced in the half type, or in the pricing's ``allreduce_precision`` when it says another
    (:attr:`Recipe.reduce_dtype`, :mod:`runtime.dataparallel`). ``fp16`` scales the loss (:class:`LossScaler`:
    torch.amp.GradScaler's rule and defaults): the overflow check on the half gradients (the fp32
    pieces under ZeRO) agreed by every rank, so that every rank skips the same steps and keeps the
    same scale; the gradients unscaled as they are converted to fp32. ``bf16`` scales nothing.

What a rank holds is what the cost model counts: ``train`` sets each rank's model state
(:func:`model_state_bytes`: weights, gradients, masters, optimizer state) beside the cost model's,
priced as the run trains (:meth:`Recipe.pricing`).

The 2bw and wsp executors keep their own weight versions and update them with plain SGD in fp32:
a plan priced otherwise runs so, said in one line, and its memory is predicted for what runs
(fp32, no optimizer state); asking for Adam or half precision there is refused in one line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partitioner.errors import PartitionerError
from partitioner.plan import Plan
from partitioner.pricing import (
    DEFAULT_LR,
    OPTIMIZER_STATE_FACTOR,
    OPTIMIZERS,
    PRECISIONS,
    CostOptions,
    priced_optimizer,
)
from partitioner.schedule import spec

__all__ = ["DEFAULT_LR", "OPTIMIZERS", "OPTIMIZER_STATE_FACTOR", "LossScaler", "Recipe", "ScaledStep", "boundary_dtype",
           "make_optimizer", "model_state_bytes", "priced_optimizer", "training_recipe"]

_HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Recipe:
    """The optimizer and precision a run trains with, and what differs from the plan's pricing
    (one line each, in ``notes``)."""

    optimizer: str
    precision: str
    notes: tuple[str, ...] = ()
    allreduce_precision: str = ""  # the pricing's (empty: the gradients' own type)

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise PartitionerError(f"`optimizer` {self.optimizer!r}: must be one of {', '.join(OPTIMIZERS)}")
        for name in ("precision", "allreduce_precision"):
            value = getattr(self, name)
            if value not in PRECISIONS and not (name == "allreduce_precision" and value == ""):
                raise PartitionerError(f"`{name}` {value!r}: must be one of {', '.join(PRECISIONS)}")

    @property
    def state_factor(self) -> float:
        """Optimizer state per parameter, in 4-byte words (as ``CostOptions`` counts it)."""
        return OPTIMIZER_STATE_FACTOR[self.optimizer]

    @property
    def half(self) -> torch.dtype | None:
        """The type of the weights, gradients and stage boundaries (``None`` in fp32)."""
        return _HALF.get(self.precision)

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        """The type data parallelism exchanges gradients in when it is not the gradients' own:
        the pricing's ``allreduce_precision`` (``CostOptions.allreduce_element_bytes``), e.g.
        fp32 for a half model's gradients; ``None`` when they go as they are."""
        want = self.allreduce_precision or self.precision
        dtype = _HALF.get(want, torch.float32)
        return None if dtype == (self.half or torch.float32) else dtype

    @property
    def scales_loss(self) -> bool:
        return self.precision == "fp16"

    def pricing(self, options: CostOptions | None) -> CostOptions:
        """``options`` (the plan's; the defaults when ``None``) with this recipe's precision and
        optimizer state: the cost model's prices of what actually runs."""
        from dataclasses import replace

        return replace(options or CostOptions(), precision=self.precision, optimizer_state_factor=self.state_factor)


def training_recipe(plan: Plan, optimizer: str = "", precision: str = "") -> Recipe:
    """The recipe of a run of ``plan``: ``optimizer`` / ``precision`` when given (``""``: as the
    plan was priced). Refuses, in one line, an unknown name, and Adam or half precision asked of
    2bw or wsp."""
    if optimizer and optimizer not in OPTIMIZERS:
        raise PartitionerError(f"`optimizer` {optimizer!r}: must be one of {', '.join(OPTIMIZERS)}")
    if precision and precision not in PRECISIONS:
        raise PartitionerError(f"`precision` {precision!r}: must be one of {', '.join(PRECISIONS)}")
    priced = plan.pricing
    notes: list[str] = []
    if priced is None:  # a plan made by hand, not by a solver: nothing was priced
        want_opt, want_prec = optimizer or "sgd", precision or "fp32"
        source = "the plan records no pricing"
        notes.append(f"{source} (made by hand, not by a solver): {want_opt} in {want_prec}")
    else:
        want_opt, want_prec = optimizer or priced_optimizer(priced), precision or priced.precision
        source = "the plan's pricing"
        factor = priced.optimizer_state_factor
        if optimizer and OPTIMIZER_STATE_FACTOR[optimizer] != factor:
            notes.append(f"optimizer {optimizer} differs from {source} ({priced_optimizer(priced)}: {factor:g} "
                         f"word(s) of optimizer state per parameter); predicted memory is priced for {optimizer}")
        elif not optimizer and factor not in OPTIMIZER_STATE_FACTOR.values():
            notes.append(f"{source} counts {factor:g} word(s) of optimizer state per parameter (SGD with "
                         "momentum?); this runtime runs plain SGD (no state)")
        if precision and precision != priced.precision:
            notes.append(f"precision {precision} differs from {source} ({priced.precision})")
    if spec(plan.schedule).executor != "pipeline":
        for name, value, plain in (("optimizer", optimizer, "sgd"), ("precision", precision, "fp32")):
            if value and value != plain:
                raise PartitionerError(f"`{name}` {value}: the {plan.schedule} executor updates its weight versions "
                                       f"with plain SGD in fp32; use {plain} or a flushing schedule (gpipe, 1f1b, "
                                       "interleaved, bfs)")
        if (want_opt, want_prec) != ("sgd", "fp32"):
            notes.append(f"schedule {plan.schedule}: this runtime updates its weight versions with plain SGD in fp32, "
                         f"not {want_opt} in {want_prec} as {source} says")
        want_opt, want_prec = "sgd", "fp32"
    allreduce = priced.allreduce_precision if priced is not None else ""
    return Recipe(want_opt, want_prec, tuple(notes), allreduce)


def make_optimizer(params: Iterable[nn.Parameter], name: str, lr: float) -> torch.optim.Optimizer:
    """The one construction of a rank's optimizer (torch's defaults but the learning rate)."""
    params = list(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    raise PartitionerError(f"`optimizer` {name!r}: must be one of {', '.join(OPTIMIZERS)}")


def boundary_dtype(dtype: torch.dtype, recipe: Recipe) -> torch.dtype:
    """The type a stage boundary of ``dtype`` is sent in under ``recipe``."""
    half = recipe.half
    return half if half is not None and dtype.is_floating_point else dtype


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by the scaler's current scale."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, scaler: LossScaler) -> torch.Tensor:
        ctx.scale = scaler.scale
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class LossScaler:
    """Dynamic loss scaling with torch.amp.GradScaler's rule and defaults: the loss's gradient is
    multiplied by ``scale`` (initially 2**16); before a step the gradients are divided by it; a
    step whose gradients are not all finite on some rank is skipped on every rank and the scale
    halved; after ``growth_interval`` (2000) good steps in a row it doubles."""

    def __init__(self, scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.scale, self.growth, self.backoff, self.interval = scale, growth_factor, backoff_factor, growth_interval
        self.good_steps = 0
        self.skipped = 0

    def wrap_loss(self, loss_fn: Callable[[torch.Tensor, int], torch.Tensor]
                  ) -> Callable[[torch.Tensor, int], torch.Tensor]:
        """``loss_fn`` whose value is unchanged (the reported loss) and whose gradient is scaled."""

        def scaled(y: torch.Tensor, j: int) -> torch.Tensor:
            return _ScaleGrad.apply(loss_fn(y, j), self)

        return scaled

    def all_finite(self, grads: list[torch.Tensor], device: torch.device) -> bool:
        """Whether every rank's ``grads`` (still scaled) are all finite (a collective over the
        default group: every rank calls it once per step, with or without gradients)."""
        bad = torch.zeros(1, device=device)
        if grads:
            bad += sum((~torch.isfinite(g)).any().float() for g in grads)
        if dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad.item())

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale *= self.backoff
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps == self.interval:
            self.scale *= self.growth
            self.good_steps = 0


class ScaledStep:
    """The optimizer as the executor calls it (``step``, ``zero_grad``) under fp16: the step taken
    only when every rank's gradients are finite, the gradients unscaled as the step converts them
    to fp32 (``inv_scale``), the scale updated. ``optimizer`` is a mixed-precision step
    (:class:`runtime.master.MasterStep`, :class:`runtime.zero.ShardedStep`: ``grads()``,
    ``inv_scale``), or ``None`` on a rank without parameters, which still takes part in the
    agreement."""

    def __init__(self, optimizer: Any, scaler: LossScaler, device: torch.device):
        self.optimizer, self.scaler, self.device = optimizer, scaler, device

    def step(self) -> None:
        grads = self.optimizer.grads() if self.optimizer is not None else []
        finite = self.scaler.all_finite(grads, self.device)
        if finite and self.optimizer is not None:
            self.optimizer.inv_scale = 1.0 / self.scaler.scale
            self.optimizer.step()
        self.scaler.update(finite)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=set_to_none)


def model_state_bytes(modules: Iterable[nn.Module], optimizer: Any) -> float:
    """Bytes of a rank's model state as it stands: its parameters, their gradients (counted at
    the parameters' size whether or not they are held now: they are between a backward and the
    step), the fp32 master copies of mixed precision (``optimizer.masters``: whole, or this rank's
    ZeRO pieces) and the optimizer's state tensors; of a tensor-parallel shard (a DTensor) what
    this rank holds, not the whole tensor."""
    def held(t: torch.Tensor) -> int:
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.numel() * local.element_size()

    params = [p for m in modules for p in m.parameters()]
    total = sum(2 * held(p) for p in params)
    total += sum(held(m) for m in getattr(optimizer, "masters", ()))
    if optimizer is not None:
        for state in optimizer.state.values():
            total += sum(held(t) for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    return float(total)
