"""Choosing among candidate plans by simulated throughput rather than by the bottleneck alone.

The bottleneck stage decides steady-state speed, but not fill and drain, transfers on the
critical path, or memory under the schedule. :func:`rank_plans` simulates each candidate
(:mod:`partitioner.simulate`) and orders them: plans that fit in memory first, then by
simulated samples per second (iteration time per sample), then by iteration time.
:func:`solve_ranked` lets a solver try several schedules and micro-batch counts and keep the
best one by that order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from partitioner.cluster import Cluster
from partitioner.cost import CostModel, CostOptions
from partitioner.errors import FormatError
from partitioner.plan import Plan
from partitioner.profile import Profile
from partitioner.simulate import predict, simulate_plan
from partitioner.timeline import Timeline
from solvers.result import SolveDetails, SolveResult, SolveStatus

__all__ = ["AUTO_SCHEDULES", "RankedPlan", "rank_plans", "solve_ranked"]

log = logging.getLogger(__name__)

# The schedules ``schedule="auto"`` plans and simulates: those whose stages the chain DP places
# (one chunk, activations in flight known), and ZB-V, split by the multi-chunk DP
# (solvers.pipeline.chunked); the zero-bubble ones are kept only where their simulated peak fits.
AUTO_SCHEDULES = ("gpipe", "1f1b", "2bw", "zb-h1", "zb-h2", "zbv")


@dataclass(frozen=True)
class RankedPlan:
    """A candidate with its simulated timeline; ``fits`` says whether every device has room."""

    plan: Plan
    timeline: Timeline
    fits: bool

    @property
    def samples_per_s(self) -> float:
        return self.timeline.samples_per_s

    def to_dict(self) -> dict[str, Any]:
        return {"schedule": self.plan.schedule, "micro_batches": self.plan.micro_batches,
                "virtual_workers": len(self.plan.virtual_workers), "stages": self.plan.num_stages,
                "iteration_s": self.timeline.iteration_s, "samples_per_s": self.samples_per_s,
                "fits": self.fits}


def rank_plans(candidates: Iterable[Plan], profile: Profile, cluster: Cluster,
               options: CostOptions | None = None) -> list[RankedPlan]:
    """Candidates sorted best first (fitting, then most samples/s, then shortest iteration),
    each with its ``predicted`` figures replaced by the simulator's."""
    out = []
    cost = CostModel(profile, cluster, options)  # one for every candidate
    for plan in candidates:
        tl = simulate_plan(plan, profile, cluster, options, cost=cost)
        pred = {**plan.predicted, **predict(plan, profile, cluster, options, timeline=tl, cost=cost)}
        fits = all(tl.peak_memory_bytes[d] <= cluster.device(d).memory_bytes for d in tl.devices)
        out.append(RankedPlan(replace(plan, predicted=pred), tl, fits))
    out.sort(key=lambda c: (not c.fits, -c.samples_per_s, c.timeline.iteration_s))
    return out


def solve_ranked(solve_one: Callable[..., SolveResult], profile: Profile, cluster: Cluster,
                 schedules: Sequence[str], micro_batches: Sequence[int], **options: Any) -> SolveResult:
    """Solve for every (schedule, micro-batch count) with ``solve_one`` and keep the best plan
    by simulated throughput. Candidates a schedule rule refuses, or that are infeasible, are
    listed in ``details["refused"]``; all ranked candidates in ``details["ranking"]``."""
    results: list[SolveResult] = []
    refused: list[str] = []
    for sched in schedules:
        for m in micro_batches:
            try:
                res = solve_one(profile, cluster, schedule=sched, micro_batches=m, **options)
            except FormatError as err:
                refused.append(f"{sched} with {m} micro-batches: {err}")
                continue
            if res.ok:
                results.append(res)
            else:
                refused.append(f"{sched} with {m} micro-batches: {res.status}: {res.reason}")
    runtime = sum(r.runtime_s for r in results)
    if not results:
        return SolveResult(SolveStatus.INFEASIBLE, None, runtime_s=runtime, method="ranked",
                           reason="no candidate plan: " + "; ".join(refused))
    cost_options = options.get("options")
    ranked = rank_plans([r.plan for r in results if r.plan is not None], profile, cluster, cost_options)
    best = ranked[0]
    source = next(r for r in results if r.plan is not None and r.plan.schedule == best.plan.schedule
                  and r.plan.micro_batches == best.plan.micro_batches)
    meta = {**best.plan.meta, "selected_by": f"simulated samples/s among {len(ranked)} candidates"}
    details: SolveDetails = {**source.details, "ranking": [c.to_dict() for c in ranked], "refused": refused}
    log.info("chose %s with %d micro-batches: %.4g samples/s", best.plan.schedule, best.plan.micro_batches,
             best.samples_per_s)
    return replace(source, plan=replace(best.plan, meta=meta), details=details)
