"""Selective recomputation at run time: a stage's attention cores recomputed in its backward.

``selective`` (``Stage.recompute``): the attention core of each transformer block of the stage (a
module with a ``recompute_core`` attribute, :class:`partitioner.models` blocks) runs under
``torch.utils.checkpoint``, keeping its inputs ``q, k, v`` and recomputing the scores, mask and
soft-max in the backward; a stage without one runs as it is. The numbers do not change: the
recomputed core runs the same operations on the same inputs.

``full`` is run by the executors themselves (:mod:`runtime.executor`: the forward under
``no_grad``, recomputed with its graph at the start of the backward, or of ``I``, under the
forward's random-number state), so that a split backward's ``I`` owns the recomputation and 2bw's
and wsp's stashed weights are the ones recomputed with; :func:`recompute_stage` also wraps a whole
module's forward in ``torch.utils.checkpoint`` for ``full``, for a module used outside the
executors. ``runtime.rank.rank_context`` sets the selective stages.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from partitioner.errors import FormatError
from partitioner.pricing import RECOMPUTE_MODES

__all__ = ["recompute_stage"]


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
