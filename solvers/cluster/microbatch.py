"""Micro-batching: micro-batch size and count for a global minibatch, with AutoPipe-style
slicing of the first micro-batch.

For a global minibatch of ``B`` samples per virtual worker, every micro-batch size ``b``
that divides ``B`` is tried with ``m = B / b`` micro-batches: the planner is run on the
profile at size ``b`` (a measured profile from ``profiles`` when given, else
:meth:`partitioner.profile.Profile.at_size`: measured times at that size, or interpolated
between two measured sizes, and only linear scaling when the profile was measured at one size,
an approximation that ignores the fixed costs of small batches; with several measured sizes
only sizes between them are tried), and the simulated throughput decides. For flushing schedules, slicing the
first micro-batch into ``s`` in ``slices`` (when ``s`` divides ``b``) shortens the fill: the
plan carries ``first_slices = s`` and the simulator runs its first micro-batch as ``s``
slices of ``1/s`` the work. A plan the simulator refuses falls back to the closed form
(:meth:`partitioner.cost.CostModel.plan_iteration_s`), without slicing: only the simulator
prices it (the effect is small under 1F1B and nil under GPipe).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from partitioner.cluster import Cluster
from partitioner.cost import CostModel, CostOptions
from partitioner.errors import FormatError, PartitionerError
from partitioner.plan import Plan
from partitioner.profile import Profile
from partitioner.schedule import spec
from solvers.result import SolveResult, SolveStatus

__all__ = ["MicroBatchChoice", "choose_micro_batches", "priced"]


def priced(plan: Plan, profile: Profile, cluster: Cluster, options: CostOptions | None) -> tuple[float, float]:
    """(iteration seconds, samples/s) of ``plan``: simulated, or by the closed form where the
    simulator refuses the plan."""
    from partitioner.simulate import simulate_plan

    try:
        tl = simulate_plan(plan, profile, cluster, options)
    except PartitionerError:
        if plan.first_slices > 1:
            return math.inf, 0.0  # only the simulator prices slicing: never chosen unpriced
        cost = CostModel(profile, cluster, options)
        it = cost.plan_iteration_s(plan)
        samples = len(plan.virtual_workers) * plan.micro_batches * plan.micro_batch_size
        return it, samples / it if it > 0 else math.inf
    return tl.iteration_s, tl.samples_per_s


@dataclass(frozen=True)
class MicroBatchChoice:
    """The best candidate (``result``, with its plan at the chosen size, count and first-slice
    count) and every candidate tried as ``(size, slices, samples/s)``. When no size fits,
    ``result`` is ``INFEASIBLE`` with the reason and ``details["refused"]`` says why per size."""

    result: SolveResult
    iteration_s: float = math.inf
    samples_per_s: float = 0.0
    tried: tuple[tuple[int, int, float], ...] = ()
    # the least of every size's certified lower bound (seconds per sample for a planner whose
    # objective is that, as the cluster planner's): the bound over every size tried; nan if one has none
    lower_bound: float = math.nan

    @property
    def ok(self) -> bool:
        return self.result.ok

    def _plan(self) -> Plan:
        if self.result.plan is None:
            raise PartitionerError(f"no micro-batch choice: {self.result.reason}")
        return self.result.plan

    @property
    def micro_batch_size(self) -> int:
        return self._plan().micro_batch_size

    @property
    def micro_batches(self) -> int:
        return self._plan().micro_batches

    @property
    def first_slices(self) -> int:
        return self._plan().first_slices


def choose_micro_batches(profile: Profile, cluster: Cluster, global_batch: int,
                         planner: Callable[..., SolveResult], *, profiles: Mapping[int, Profile] | None = None,
                         sizes: Sequence[int] | None = None, slices: Sequence[int] = (1, 2, 4),
                         schedule: str = "1f1b", **planner_options: Any) -> MicroBatchChoice:
    """Best (size, count, first slices) for ``global_batch`` samples, by simulated samples/s.

    ``planner(profile, cluster, schedule=..., micro_batches=m, **planner_options)`` returns a
    :class:`SolveResult` for the profile at each size ``b`` with ``m = global_batch / b``: a planner
    of one worker's micro-batches (:func:`solvers.cluster.planner.plan_cluster`, then ``global_batch``
    counts per virtual worker) or one that splits the whole batch itself and ignores ``m``
    (:func:`solvers.cluster.tensor.plan_tensor_parallel`, as :func:`solvers.planning.plan` uses it).
    When no size fits, the choice's ``result`` is ``INFEASIBLE`` with the reason.
    """
    if not (isinstance(global_batch, int) and global_batch >= 1):
        raise FormatError("global_batch", global_batch, "must be an integer >= 1")
    cands = sorted(sizes) if sizes else [b for b in range(1, global_batch + 1) if global_batch % b == 0]
    bad = [b for b in cands if global_batch % b]
    if bad:
        raise FormatError("micro_batch_size", bad, f"must divide the global batch {global_batch}")
    measured = profile.measured_sizes
    if len(measured) > 1 and not sizes:  # measured at several sizes: only sizes between them
        cands = [b for b in cands if measured[0] <= b <= measured[-1]]
        if not cands:
            raise FormatError("global_batch", global_batch, f"no divisor lies within the measured micro-batch "
                              f"sizes {', '.join(map(str, measured))}")
    best: MicroBatchChoice | None = None
    tried = []
    refused = []
    runtime_s = 0.0
    bounds: list[float] = []
    for b in cands:
        prof = (profiles or {}).get(b) or profile.at_size(b)
        m = global_batch // b
        res = planner(prof, cluster, schedule=schedule, micro_batches=m, **planner_options)
        runtime_s += res.runtime_s
        bounds.append(math.inf if res.status is SolveStatus.INFEASIBLE else res.lower_bound)
        if not res.ok or res.plan is None:
            refused.append(f"size {b} ({m} micro-batches): {res.status}: {res.reason}")
            continue
        options = planner_options.get("options")
        for s in slices:
            if b % s or (s > 1 and not spec(schedule).sliceable):
                continue
            plan = replace(res.plan, first_slices=s)
            worst, total = priced(plan, prof, cluster, options)
            tried.append((b, s, total))
            if best is None or total > best.samples_per_s:
                best = MicroBatchChoice(replace(res, plan=plan), worst, total)
    if best is None:
        return MicroBatchChoice(SolveResult(SolveStatus.INFEASIBLE, None, runtime_s=runtime_s, method="microbatch",
                                            reason=f"no micro-batch size dividing {global_batch} fits",
                                            details={"refused": refused}))
    least = min(bounds) if bounds and not any(math.isnan(x) for x in bounds) else math.nan
    return replace(best, tried=tuple(tried), lower_bound=least)
