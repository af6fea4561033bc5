"""Selective recomputation at run time: a stage's attention cores recomputed in its backward.

``selective`` (``Stage.recompute``): the attention core of each transformer block of the stage (a
module with a ``recompute_core`` attribute, :class:`partitioner.models` blocks) runs under
``torch.utils.checkpoint``, keeping its inputs ``q, k, v`` and recomputing the scores, mask and
soft-max in the backward; a stage without one runs as it is. The numbers do not change: the
recomputed core runs the same operations on the same inputs.

Under a split backward (``zb-h1``, ``zb-h2``, ``zbv``) the core is recomputed once per micro-batch,
as the cost model prices it (on the input-gradient pass): :func:`core_once` replaces
``torch.utils.checkpoint`` for the selective stages. Its backward recomputes the core from the
kept ``q, k, v`` and returns their gradients; inside an ``I`` (:func:`keeping_core_gradients`, set
by :mod:`runtime.executor`) it keeps those gradients on the graph node and drops ``q, k, v``, and
the ``W`` that walks the node again returns the kept gradients instead of recomputing: what is held
from ``I`` to ``W`` is the gradients of ``q, k, v`` in place of ``q, k, v`` themselves, the same
bytes. (A core the ``I`` does not reach, one whose block's input gradient ``I`` does not need, is
recomputed by its ``W``: once still.) :data:`RECOMPUTED` counts the recomputations. The core has no
random numbers (no dropout), so no generator state is replayed.

``full`` is run by the executors themselves (:mod:`runtime.executor`: the forward under
``no_grad``, recomputed with its graph at the start of the backward, or of ``I``, under the
forward's random-number state), so that a split backward's ``I`` owns the recomputation and 2bw's
and wsp's stashed weights are the ones recomputed with; :func:`recompute_stage` also wraps a whole
module's forward in ``torch.utils.checkpoint`` for ``full``, for a module used outside the
executors. ``runtime.rank.rank_context`` sets the selective stages.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from partitioner.errors import FormatError
from partitioner.pricing import RECOMPUTE_MODES

from .memory import keep_for_backward, kept

__all__ = ["RECOMPUTED", "core_once", "keeping_core_gradients", "recompute_stage"]

RECOMPUTED = [0]  # attention cores recomputed in this process (a count, for tests and figures)
_KEEPING = [False]  # inside an I: keep the cores' input gradients for the W


@contextlib.contextmanager
def keeping_core_gradients() -> Iterator[None]:
    """Inside it (an ``I``), a core's backward keeps its inputs' gradients for the ``W`` that follows."""
    before = _KEEPING[0]
    _KEEPING[0] = True
    try:
        yield
    finally:
        _KEEPING[0] = before


class _CoreOnce(torch.autograd.Function):
    """The core run without keeping its graph; its backward recomputes it once and, inside an ``I``,
    keeps the result for the ``W`` (module docstring)."""

    @staticmethod
    def forward(ctx: Any, core: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        # kept outside save_for_backward (an I drops them for their gradients), counted all the same
        ctx.core, ctx.kept = core, None
        ctx.inputs = tuple(keep_for_backward(t.detach()) for t in (q, k, v))
        with torch.no_grad():
            return core(q, k, v)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if ctx.kept is not None:  # the W after an I: what the I computed
            held, ctx.kept = ctx.kept, None
            return (None, *(kept(g) for g in held))
        if ctx.inputs is None:
            raise RuntimeError("an attention core's backward ran again after its gradients were used")
        inputs = tuple(kept(t).detach().requires_grad_(True) for t in ctx.inputs)
        with torch.enable_grad():
            out = ctx.core(*inputs)
        grads = torch.autograd.grad(out, inputs, grad)
        RECOMPUTED[0] += 1
        # the inputs are dropped once used, as autograd drops saved tensors after a backward (the
        # runtime's backwards through a core are final, but for an I's: retain_graph is for the W)
        ctx.inputs = None
        if _KEEPING[0]:  # the gradients held for the W in place of the inputs (counted the same way)
            ctx.kept = tuple(keep_for_backward(g) for g in grads)
        return (None, *grads)


def core_once(core: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``core(q, k, v)``, recomputed once in the backward (:class:`_CoreOnce`)."""
    out: torch.Tensor = _CoreOnce.apply(core, q, k, v)
    return out


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
                setattr(module, "core_checkpoint", core_once)  # noqa: B010
    return stage
