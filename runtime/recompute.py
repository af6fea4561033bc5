"""The memory levers of a plan at run time: a stage's activation recomputation
(``Stage.recompute``) with ``torch.utils.checkpoint``, and ZeRO-1 (``CostOptions.zero``) with
``torch.distributed.optim.ZeroRedundancyOptimizer``. Both leave the numbers as they are: the
recomputed forward runs the same operations on the same inputs, and the sharded optimizer steps
each parameter once, on one rank, and broadcasts it.

* ``full``: the stage's forward keeps only its input; its backward runs the forward again
  (:func:`recompute_stage` replaces the module's ``forward`` on the instance, so its parameters and
  state-dict names do not change).
* ``selective``: the attention core of each transformer block of the stage (a module with a
  ``recompute_core`` attribute, :class:`partitioner.models` blocks) is recomputed; a stage without
  one runs as it is.

``runtime.rank.rank_context`` sets every stage to its plan's mode (schedules gpipe, 1f1b,
interleaved and bfs, stages of one GPU: ``partitioner.placement.supports`` refuses the rest in one
line); ZeRO is not run yet (refused the same way).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from partitioner.errors import FormatError
from partitioner.pricing import RECOMPUTE_MODES

__all__ = ["recompute_stage", "zero_optimizer"]


def _checkpointed(forward: Callable[..., Any], *args: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args)
    from torch.utils.checkpoint import checkpoint

    return checkpoint(forward, *args, use_reentrant=False)


def recompute_stage(stage: nn.Module, mode: str) -> nn.Module:
    """``stage`` set to recompute ``mode`` in its backward (in place; returned for chaining)."""
    if mode not in RECOMPUTE_MODES:
        raise FormatError("recompute", mode, f"must be one of {', '.join(RECOMPUTE_MODES)}")
    if mode == "full":
        stage.forward = functools.partial(_checkpointed, stage.forward)
    elif mode == "selective":
        for module in stage.modules():
            if hasattr(module, "recompute_core"):
                setattr(module, "recompute_core", True)  # noqa: B010 - any module with the switch
    return stage


def zero_optimizer(params: Iterable[torch.nn.Parameter], optimizer_class: type[torch.optim.Optimizer],
                   process_group: Any = None, **defaults: Any) -> torch.optim.Optimizer:
    """ZeRO-1: ``optimizer_class`` over ``params`` with its state sharded over ``process_group``
    (the ranks holding the same parameters: torch's ``ZeroRedundancyOptimizer``). Gradients must be
    averaged over the group first, as for the plain optimizer."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(list(params), optimizer_class=optimizer_class, process_group=process_group,
                                   **defaults)
