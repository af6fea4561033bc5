"""Fitting the collective model's constants on measured all-reduces of some GPU types.

A :class:`CollectivePoint` is one measured all-reduce: the GPU type, the link its group rang
over (:func:`partitioner.collectives.group_link`, facts only), the group size, the message and
the seconds. :func:`fit_link_constants` finds, per link class, the
:class:`~partitioner.collectives.LinkConstants` that minimise a robust loss of
``log(predicted / measured)``: Cauchy's ``log(1 + (r / scale)^2)``, each group size measured on
each GPU type weighing the same (a type measured at more group sizes says more about how the
cost grows with the group), so that one type whose collectives behave unlike the others'
cannot drag the constants the others agree on. The search is a grid over the three constants
(deterministic, no local minimum); a ring step's latency is searched up to 100 us (NCCL's
own tuning charges microseconds per hop: a larger value would stand for something else). The points come from Sailor's profiles (``partitioner.projection.evaluation``:
:func:`~partitioner.projection.evaluation.collective_points`); a fit used to judge a GPU type
never sees that type's points.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..collectives import LINK_CLASSES, CollectiveModel, GroupLink, LinkConstants
from ..errors import check

__all__ = ["LOSS_SCALE", "CollectivePoint", "fit_collectives", "fit_link_constants"]

LOSS_SCALE = 0.15  # of the log-ratio: a point off by more than about 15 % weighs less and less
_FIXED_S = np.concatenate([[0.0], np.geomspace(5e-6, 5e-3, 91)])
_STEP_S = np.concatenate([[0.0], np.geomspace(1e-6, 1e-4, 21)])
_FRACTION = np.geomspace(0.02, 1.0, 121)


@dataclass(frozen=True)
class CollectivePoint:
    """One measured all-reduce of ``nbytes`` over ``group`` GPUs of ``gpu_type`` on ``link``."""

    gpu_type: str
    link: GroupLink
    group: int
    nbytes: float
    seconds: float

    def __post_init__(self) -> None:
        check(self.group >= 2, "group", self.group, "an all-reduce needs at least 2 GPUs")
        check(math.isfinite(self.nbytes) and self.nbytes > 0, "nbytes", self.nbytes, "must be > 0")
        check(math.isfinite(self.seconds) and self.seconds > 0, "seconds", self.seconds, "must be > 0")


def _loss(points: Sequence[CollectivePoint], scale: float) -> np.ndarray:
    """The loss of every grid point (fixed, step, fraction) over ``points``."""
    groups = sorted({(p.gpu_type, p.group) for p in points})
    total = np.zeros((len(_FIXED_S), len(_STEP_S), len(_FRACTION)))
    f = _FIXED_S[:, None, None, None]
    s = _STEP_S[None, :, None, None]
    c = _FRACTION[None, None, :, None]
    for key in groups:
        mine = [p for p in points if (p.gpu_type, p.group) == key]
        steps = np.array([2.0 * (p.group - 1) for p in mine])
        wire = np.array([2.0 * (p.group - 1) / p.group * p.nbytes / p.link.peak_bytes_per_s for p in mine])
        meas = np.array([p.seconds for p in mine])
        pred = f + steps * s + wire / c
        r = np.log(pred / meas)
        total += np.mean(np.log1p((r / scale) ** 2), axis=-1)
    return total / len(groups)


def fit_link_constants(points: Sequence[CollectivePoint], *, scale: float = LOSS_SCALE) -> dict[str, LinkConstants]:
    """Per link class present in ``points``, the constants of least robust loss (module docstring)."""
    check(len(points) > 0, "points", 0, "need at least one measured all-reduce")
    out = {}
    for cls in LINK_CLASSES:
        mine = [p for p in points if p.link.link_class == cls]
        if not mine:
            continue
        loss = _loss(mine, scale)
        i, j, k = np.unravel_index(int(np.argmin(loss)), loss.shape)
        out[cls] = LinkConstants(float(_FIXED_S[i]), float(_STEP_S[j]), float(_FRACTION[k]))
    return out


def fit_collectives(points: Sequence[CollectivePoint], fitted_on: str = "", *,
                    scale: float = LOSS_SCALE) -> CollectiveModel:
    """A :class:`~partitioner.collectives.CollectiveModel` fitted on ``points``."""
    return CollectiveModel(fit_link_constants(points, scale=scale), fitted_on)

