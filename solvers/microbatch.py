"""Micro-batching: micro-batch size and count for a global minibatch, with AutoPipe-style
slicing of the first micro-batch.

For a global minibatch of ``B`` samples per virtual worker, every micro-batch size ``b``
that divides ``B`` is tried with ``m = B / b`` micro-batches: the planner is run on the
profile at size ``b`` (a measured profile from ``profiles`` when given, else
:meth:`partitioner.profile.Profile.rescaled`, which scales linearly: an approximation that
ignores the lower efficiency of small batches, so measured profiles at several sizes are
preferred), and the closed-form iteration time of the schedule decides. For flushing
schedules, slicing the first micro-batch into ``s`` in ``slices`` (when ``s`` divides ``b``)
shortens the fill: priced by :func:`partitioner.cost.pipeline_iteration_s` with
``first_slices=s``. The discrete-event simulator will replace the closed form when it lands.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from partitioner.cluster import Cluster
from partitioner.cost import CostModel, pipeline_iteration_s
from partitioner.errors import FormatError
from partitioner.profile import Profile

from .result import SolveResult

__all__ = ["MicroBatchChoice", "choose_micro_batches"]


@dataclass(frozen=True)
class MicroBatchChoice:
    micro_batch_size: int
    micro_batches: int
    first_slices: int
    iteration_s: float
    samples_per_s: float
    result: SolveResult
    tried: tuple[tuple[int, int, float], ...]  # (size, slices, samples/s) of every candidate


def choose_micro_batches(profile: Profile, cluster: Cluster, global_batch: int,
                         planner: Callable[..., SolveResult], *, profiles: Mapping[int, Profile] | None = None,
                         sizes: Sequence[int] | None = None, slices: Sequence[int] = (1, 2, 4),
                         schedule: str = "1f1b", **planner_options: Any) -> MicroBatchChoice | None:
    """Best (size, count, first slices) for ``global_batch`` samples per virtual worker.

    ``planner(profile, cluster, schedule=..., micro_batches=m, **planner_options)`` returns a
    :class:`SolveResult` (e.g. :func:`solvers.hetero.plan_cluster`). None: nothing fits.
    """
    if not (isinstance(global_batch, int) and global_batch >= 1):
        raise FormatError("global_batch", global_batch, "must be an integer >= 1")
    cands = sorted(sizes) if sizes else [b for b in range(1, global_batch + 1) if global_batch % b == 0]
    bad = [b for b in cands if global_batch % b]
    if bad:
        raise FormatError("micro_batch_size", bad, f"must divide the global batch {global_batch}")
    best: MicroBatchChoice | None = None
    tried = []
    for b in cands:
        prof = (profiles or {}).get(b) or profile.rescaled(b)
        m = global_batch // b
        res = planner(prof, cluster, schedule=schedule, micro_batches=m, **planner_options)
        if not res.ok or res.plan is None:
            continue
        cost = CostModel(prof, cluster, planner_options.get("options"))
        for s in slices:
            if b % s or (s > 1 and schedule in ("2bw", "wsp")):
                continue
            total = 0.0
            worst = 0.0
            for w in range(len(res.plan.virtual_workers)):
                it = pipeline_iteration_s(cost.plan_stage_times_s(res.plan, w), m, schedule, first_slices=s)
                total += global_batch / it if it > 0 else math.inf
                worst = max(worst, it)
            tried.append((b, s, total))
            if best is None or total > best.samples_per_s:
                best = MicroBatchChoice(b, m, s, worst, total, res, ())
    if best is None:
        return None
    return MicroBatchChoice(best.micro_batch_size, best.micro_batches, best.first_slices, best.iteration_s,
                            best.samples_per_s, best.result, tuple(tried))
