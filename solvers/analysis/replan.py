"""Re-planning after GPUs are lost or added: a new plan from the old one, fast, the global batch kept.

:func:`replan` takes the plan a run was trained with and the devices now available (the old
plan's devices less the lost ones, plus any gained), and returns a plan for them with its
certificate and what moved (:class:`Replanned`). The global batch (micro-batch size x
micro-batches x virtual workers) stays that of the old plan, so a run resumed on the new plan
sees the same data (``runtime.checkpoint``).

Warm start: the virtual workers that lost no device keep their stages as they are (their
templates), and only the workers that lost one are planned again, by the cluster planner, over
their surviving devices and the gained ones, as many workers as before with the same
micro-batches; when gained devices break no worker, they join the slowest worker, which is
planned again with them. Where that leaves fewer devices than workers, the broken workers are
dropped and the others run more micro-batches each (the global batch kept, when it divides).
``full=True`` also plans the whole cluster afresh (every count of virtual workers the global
batch allows) and keeps the better plan; the old plan itself is a candidate too, so an
unchanged cluster gives the old plan back. Every candidate is priced by the simulator
(``predicted["samples_per_s"]``); the certificate is the fleet bound over the new devices
(:func:`solvers.cluster.bounds.fleet.fleet_bound`) at the plan's worker count, or the full
planner's own.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from partitioner.cluster import Cluster
from partitioner.cost import CostModel, CostOptions
from partitioner.errors import FormatError, PartitionerError
from partitioner.plan import Plan, VirtualWorker
from partitioner.profile import Profile
from partitioner.schedule import Schedule, spec
from solvers.cluster.planner import price_plan, throughput_upper_bound
from solvers.planning import PlanRequest, plan
from solvers.predictions import with_predictions
from solvers.result import SolveResult, SolveStatus

__all__ = ["Replanned", "changed_devices", "replan"]


@dataclass(frozen=True)
class Replanned:
    """The new plan (``result.plan``, with its certificate), how it was found (``how``: ``kept``,
    ``warm`` or ``full``), the devices lost and gained, and what moved, as lines."""

    result: SolveResult
    how: str
    lost: tuple[str, ...]
    gained: tuple[str, ...]
    moves: tuple[str, ...]
    time_s: float

    @property
    def plan(self) -> Plan:
        assert self.result.plan is not None
        return self.result.plan


def changed_devices(old: Plan, cluster: Cluster, devices: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(lost, gained): the old plan's devices not among ``devices`` (or of another GPU type in
    ``cluster`` now), and ``devices`` the old plan did not use."""
    have = set(devices)
    types = {d.name: d.gpu_type for d in cluster.devices}
    old_types = {d: st.gpu_type for vw in old.virtual_workers for st in vw.stages for d in st.devices}
    lost = tuple(d for d in old.devices if d not in have or (old_types.get(d) and types.get(d) != old_types[d]))
    gained = tuple(d for d in devices if d not in old.devices)
    return lost, gained


def replan(old: Plan, profile: Profile, cluster: Cluster, devices: Sequence[str], *, full: bool = False) -> Replanned:
    """A plan of ``old``'s model, schedule and global batch over ``devices`` (names of
    ``cluster``), warm-started from ``old`` (the module docstring)."""
    t0 = time.perf_counter()
    if old.layer_order is not None:
        raise PartitionerError("replan: the plan orders a graph's layers (`layer_order`); plan it again with "
                               "the solver that made it")
    known = {d.name for d in cluster.devices}
    unknown = [d for d in devices if d not in known]
    if unknown:
        raise PartitionerError(f"replan: {', '.join(unknown)}: not a device of cluster {cluster.name}")
    devices = [d.name for d in cluster.devices if d.name in set(devices)]  # the cluster's order
    lost, gained = changed_devices(old, cluster, devices)
    sized = profile.at_size(old.micro_batch_size)
    options = old.pricing or CostOptions()
    cost = CostModel(sized, cluster, options)
    candidates: list[tuple[str, SolveResult]] = []
    why: list[str] = []
    if not lost:
        candidates.append(("kept", _certified(old, cost, devices, t0, "replan:kept")))
    if lost or gained:
        warm = _warm(old, cost, devices, lost, gained, t0, why)
        if warm is not None:
            candidates.append(("warm", warm))
    if full or not candidates:
        found = _full(old, sized, cluster, options, devices, why)
        if found is not None:
            candidates.append(("full", found))
    if not candidates:
        reason = (f"no plan of {old.micro_batch_size * old.micro_batches * len(old.virtual_workers)} samples per "
                  f"step fits the {len(devices)} devices" + (f" ({why[-1]})" if why else ""))
        return Replanned(SolveResult(SolveStatus.INFEASIBLE, None, reason=reason, method="replan"), "none", lost,
                         gained, (), time.perf_counter() - t0)
    # the most simulated samples/s; ties go to the earlier candidate (kept, then warm)
    how, best = max(candidates, key=lambda c: (_rate(c[1]), -[h for h, _ in candidates].index(c[0])))
    assert best.plan is not None
    return Replanned(best, how, lost, gained, tuple(_moves(old, best.plan, lost, gained)), time.perf_counter() - t0)


def _rate(result: SolveResult) -> float:
    assert result.plan is not None
    return float(result.plan.predicted.get("samples_per_s", 0.0))


def _attempt(profile: Profile, cluster: Cluster, request: PlanRequest, why: list[str]) -> SolveResult:
    """The planner's answer to ``request``; a request it refuses (a schedule's rule) is infeasible,
    its reason added to ``why``."""
    try:
        result = plan(profile, cluster, request)
    except FormatError as err:
        result = SolveResult(SolveStatus.INFEASIBLE, None, reason=str(err))
    if not result.ok and result.reason:
        why.append(result.reason)
    return result


def _warm(old: Plan, cost: CostModel, devices: Sequence[str], lost: Sequence[str], gained: Sequence[str],
          t0: float, why: list[str]) -> SolveResult | None:
    """The old plan's unbroken workers kept, the broken ones (with the gained devices) planned again."""
    workers = old.virtual_workers
    broken = [w for w, vw in enumerate(workers) if set(vw.devices) & set(lost)]
    if not broken and gained:  # gains alone: the slowest worker takes them
        broken = [_slowest(old, cost)]
    kept = [vw for w, vw in enumerate(workers) if w not in broken]
    pool = [d for d in devices if d in gained or any(d in workers[w].devices for w in broken)]
    replicated = any(st.replicas for vw in workers for st in vw.stages)
    if len(pool) >= len(broken):
        if spec(old.schedule).multi_chunk:  # one worker of chunks: the dp solver over the devices left
            request = PlanRequest(schedule=old.schedule, options=cost.options, devices=tuple(pool),
                                  micro_batches=old.micro_batches, chunks=str(old.chunks))
        else:
            request = PlanRequest(schedule=old.schedule, options=cost.options, devices=tuple(pool),
                                  micro_batches=old.micro_batches, virtual_workers=len(broken),
                                  replication=replicated, simulate_top=0)
        result = _attempt(cost.profile, cost.cluster, request, why)
        if not result.ok or result.plan is None:
            return None
        fresh = list(result.plan.virtual_workers)
        # the planned workers take the broken ones' places (the others keep their indices)
        ordered = tuple(fresh.pop(0) if w in broken else vw for w, vw in enumerate(workers))
        new = replace(old, virtual_workers=(*ordered, *fresh), predicted={}, solver=None, meta={},
                      chunks=result.plan.chunks)
    else:  # too few devices for the broken workers: drop them, the others run their micro-batches
        samples = old.micro_batches * len(workers)
        if not kept or samples % len(kept):
            return None
        new = replace(old, virtual_workers=tuple(kept), micro_batches=samples // len(kept), predicted={},
                      solver=None, meta={}, first_slices=1)
    try:
        cost.validate_plan(new)
    except PartitionerError:
        return None
    return _certified(new, cost, devices, t0, "replan:warm")


def _slowest(old: Plan, cost: CostModel) -> int:
    its = [cost.worker_iteration_s(old, w, holders_known=False) for w in range(len(old.virtual_workers))]
    return max(range(len(its)), key=lambda w: its[w])


def _certified(candidate: Plan, cost: CostModel, devices: Sequence[str], t0: float, method: str) -> SolveResult:
    """``candidate`` priced (closed form and simulator) with the fleet bound over ``devices`` as its certificate."""
    from solvers.cluster.bounds.fleet import fleet_bound

    cost.validate_plan(candidate)
    schedule = Schedule.of(candidate.schedule, candidate.micro_batches)
    devs = cost.cluster.subset(devices)
    replicated = any(st.replicas for vw in candidate.virtual_workers for st in vw.stages)
    predicted = price_plan(cost, candidate)
    upper = throughput_upper_bound(cost, devs)
    if not schedule.spec.multi_chunk:
        upper = min(upper, fleet_bound(cost, devs, schedule, replication=replicated,
                                       virtual_workers=len(candidate.virtual_workers)).samples_per_s)
    rate = predicted["samples_per_s"]
    status = SolveStatus.OPTIMAL if rate >= upper * (1 - 1e-9) else SolveStatus.FEASIBLE
    result = SolveResult(status, None, 1.0 / rate if rate > 0 else math.inf, 1.0 / upper if upper > 0 else 0.0,
                         time.perf_counter() - t0, method)
    meta: dict[str, Any] = {**candidate.meta, "objective": "sync"}
    priced = with_predictions(replace(candidate, solver=result.solver_info()), cost.profile, cost.cluster,
                              cost.options, predicted, extra_meta=meta, cost=cost)
    return replace(result, plan=priced)


def _full(old: Plan, profile: Profile, cluster: Cluster, options: CostOptions,
          devices: Sequence[str], why: list[str]) -> SolveResult | None:
    """The cluster planner over every device, for each count of virtual workers the global batch
    allows (the old count first); the most simulated samples/s."""
    samples = old.micro_batches * len(old.virtual_workers)
    replicated = any(st.replicas for vw in old.virtual_workers for st in vw.stages)
    counts = [k for k in range(1, len(devices) + 1) if samples % k == 0]
    counts.sort(key=lambda k: k != len(old.virtual_workers))
    best: SolveResult | None = None
    for k in counts:
        if spec(old.schedule).multi_chunk and k > 1:
            continue
        request = (PlanRequest(schedule=old.schedule, options=options, devices=tuple(devices), micro_batches=samples,
                               chunks=str(old.chunks))
                   if spec(old.schedule).multi_chunk else
                   PlanRequest(schedule=old.schedule, options=options, devices=tuple(devices),
                               micro_batches=samples // k, virtual_workers=k, replication=replicated))
        result = _attempt(profile, cluster, request, why)
        if result.ok and (best is None or _rate(result) > _rate(best)):
            best = result
    return best


def _moves(old: Plan, new: Plan, lost: Sequence[str], gained: Sequence[str]) -> list[str]:
    """What moved, as lines: the devices lost and gained, every worker kept or planned again
    (its stages before and after), and the micro-batches."""
    lines = [f"lost: {', '.join(lost) or 'none'}", f"gained: {', '.join(gained) or 'none'}"]
    old_workers = {vw.stages: w for w, vw in enumerate(old.virtual_workers)}
    for w, vw in enumerate(new.virtual_workers):
        if vw.stages in old_workers:
            was = old_workers[vw.stages]
            lines.append(f"virtual worker {w}: kept (was {was}): {_stages(vw)}")
        else:
            lines.append(f"virtual worker {w}: new: {_stages(vw)}")
    for w, vw in enumerate(old.virtual_workers):
        if vw.stages not in {v.stages for v in new.virtual_workers}:
            lines.append(f"old virtual worker {w} replaced: {_stages(vw)}")
    if new.micro_batches != old.micro_batches:
        lines.append(f"micro-batches per worker: {old.micro_batches} -> {new.micro_batches} (global batch "
                     f"{old.micro_batch_size * old.micro_batches * len(old.virtual_workers)} kept)")
    return lines


def _stages(vw: VirtualWorker) -> str:
    return " | ".join(f"[{st.start}, {st.stop}) {'+'.join(st.devices)}" for st in vw.stages)
