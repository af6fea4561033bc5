"""Tensor parallelism chosen with the rest: each GPU type's degree, the number of pipelines and
their micro-batches under a fixed global batch, then the cluster planner on each choice.

A *view* of the cluster gives every GPU type a tensor-parallel degree ``t`` (its GPUs grouped t
to a device on their node, :meth:`partitioner.cluster.Cluster.with_tensor_parallel`); stages of a
worker may sit on devices of different degrees, and so may the replicas of a stage. A
*candidate* is a view and a count ``K`` of virtual workers that divides the global batch:
``K x m x b = global_batch`` for the profile's micro-batch size ``b``, so every candidate trains
the same samples per iteration. Each candidate has a certified upper bound on samples/s (the
smaller of the fleet bound of :mod:`solvers.cluster.bounds.fleet` and the per-layer bound of
:mod:`solvers.cluster.bounds.layers` at that K); candidates are planned best
bound first, and the search stops when the best plan found is at least the next bound (nothing
left can beat it) or time is up. The certificate of the whole space is the largest bound of the
candidates not planned and of the planned ones' own certificates.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from partitioner.cluster import Cluster, Device, device_kind
from partitioner.cost import CostModel
from partitioner.errors import FormatError, OptionError
from partitioner.pricing import CostOptions
from partitioner.profile import Profile
from partitioner.schedule import Schedule

from ..predictions import with_predictions
from ..result import SolveResult, SolveStatus
from .bounds.fleet import fleet_bound
from .bounds.layers import layer_bound
from .planner import WorkerPlanner, WorkerUnfit, plan_cluster, plan_of, price_plan

__all__ = ["Candidate", "candidates", "plan_tensor_parallel", "type_degrees"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    """One choice of the outer search: a degree per GPU type, K pipelines of m micro-batches, and
    the fleet bound on its samples/s."""

    degrees: tuple[tuple[str, int], ...]
    virtual_workers: int
    micro_batches: int
    bound_samples_per_s: float


def type_degrees(profile: Profile, cluster: Cluster, fixed: int | None = None) -> dict[str, tuple[int, ...]]:
    """Per GPU type of ``cluster``, the degrees it may take: profiled on that type, and dividing
    every run of the type's GPUs in a node (a group never spans nodes or types). ``fixed``: that
    degree for every type (as Megatron's ``--tensor-model-parallel-size``)."""
    runs: dict[str, list[int]] = {}
    for node in cluster.nodes:
        for gpu_type, _, count in cluster._runs(node):
            runs.setdefault(gpu_type, []).append(count)
    out: dict[str, tuple[int, ...]] = {}
    for gpu_type, counts in runs.items():
        ok = []
        for t in profile.tensor_parallel_degrees if fixed is None else (fixed,):
            if t not in profile.tensor_parallel_degrees:
                raise OptionError("tensor_parallel", t, f"the profile was measured at tensor-parallel degrees "
                                  f"{', '.join(map(str, profile.tensor_parallel_degrees))}")
            if all(c % t == 0 for c in counts) and CostModel(profile, cluster).has_times(device_kind(gpu_type, t)):
                ok.append(t)
        if not ok:
            raise OptionError("tensor_parallel", fixed, f"no degree fits the {gpu_type} GPUs (nodes of "
                              f"{sorted(set(counts))}) with times in the profile")
        out[gpu_type] = tuple(ok)
    return out


def candidates(profile: Profile, cluster: Cluster, global_batch: int, options: CostOptions | None = None,
               schedule: str = "1f1b", fixed: int | None = None,
               virtual_workers: int | None = None) -> list[Candidate]:
    """Every (view, K) whose pipelines split ``global_batch`` into whole micro-batches, with its
    bound, best bound first."""
    b = profile.micro_batch_size
    if global_batch % b:
        raise OptionError("global_batch", global_batch, f"must be a multiple of the micro-batch size {b}")
    per_type = type_degrees(profile, cluster, fixed)
    types = list(per_type)
    out = []
    for combo in itertools.product(*(per_type[t] for t in types)):
        view = cluster.with_tensor_parallel(dict(zip(types, combo, strict=True)))
        cost = CostModel(profile, view, options)
        n = len(view.devices)
        for k in [virtual_workers] if virtual_workers else range(1, n + 1):
            if k > n or (global_batch // b) % k:
                continue
            m = global_batch // (b * k)
            sched = Schedule.of(schedule, m)
            bound = min(fleet_bound(cost, view.devices, sched, virtual_workers=k).samples_per_s,
                        layer_bound(cost, view.devices, k, sched))
            if bound > 0:  # 0: no plan of k workers fits
                out.append(Candidate(tuple(zip(types, combo, strict=True)), k, m, bound))
    out.sort(key=lambda c: -c.bound_samples_per_s)
    return out


QUICK_WORKER_DEVICES = 8  # the quick pass plans uniform workers of at most this many devices


def uniform_grouping(devices: Sequence[Device], k: int) -> list[list[Device]] | None:
    """``k`` workers of the same mix of device kinds (each kind's count divided by ``k``), each
    worker's devices of a kind taken consecutively in node order (so a worker keeps to as few
    nodes as it can); None where ``k`` does not divide every kind's count."""
    by_kind: dict[str, list[Device]] = {}
    for d in devices:
        by_kind.setdefault(d.kind, []).append(d)
    if any(len(v) % k for v in by_kind.values()):
        return None
    return [[d for v in by_kind.values() for d in v[w * (len(v) // k):(w + 1) * (len(v) // k)]] for w in range(k)]


def _quick(profile: Profile, cluster: Cluster, cand: Candidate, options: CostOptions | None,
           schedule: str) -> tuple[float, SolveResult] | None:
    """The candidate's uniform grouping (:func:`uniform_grouping`), every worker mapped and split
    exactly, priced as the cluster planner prices plans: a plan in milliseconds that the full
    search only has to beat. None where the grouping does not exist or does not fit."""
    view = cluster.with_tensor_parallel(dict(cand.degrees))
    groups = uniform_grouping(view.devices, cand.virtual_workers)
    if groups is None or len(groups[0]) > QUICK_WORKER_DEVICES:
        return None
    cost = CostModel(profile, view, options)
    sched = Schedule.of(schedule, cand.micro_batches)
    planner = WorkerPlanner(cost, sched)
    try:
        plan = plan_of(groups, planner, profile, sched)[0]
    except WorkerUnfit:
        return None
    priced = price_plan(cost, plan, "sync")
    rate = priced["samples_per_s"]
    if not rate > 0:
        return None
    return rate, SolveResult(SolveStatus.FEASIBLE, plan, 1.0 / rate, math.nan, 0.0, "tensor:uniform",
                             details={"virtual_workers": cand.virtual_workers, "grouping": "uniform",
                                      "closed_form": priced})  # type: ignore[typeddict-unknown-key]


def plan_tensor_parallel(profile: Profile, cluster: Cluster, global_batch: int, *,
                         options: CostOptions | None = None, schedule: str = "1f1b",
                         tensor_parallel: int | None = None, virtual_workers: int | None = None,
                         time_limit_s: float = 60.0, rel_tol: float = 0.0) -> SolveResult:
    """The best plan over every candidate (see the module docstring), with the certificate of the
    whole space. ``tensor_parallel`` / ``virtual_workers`` fix a dimension; ``rel_tol`` stops
    once no candidate left can beat the best by more than that fraction."""
    t0 = time.perf_counter()
    cands = candidates(profile, cluster, global_batch, options, schedule, tensor_parallel, virtual_workers)
    if not cands:
        return SolveResult(SolveStatus.INFEASIBLE, None, runtime_s=time.perf_counter() - t0, method="tensor",
                           reason=f"no number of pipelines splits the global batch {global_batch} into micro-batches "
                                  f"of {profile.micro_batch_size} over this cluster")
    best: tuple[float, SolveResult, Candidate] | None = None
    for cand in cands:  # a uniform plan of every candidate first: cheap, and often the best there is
        if time.perf_counter() > t0 + time_limit_s / 4:
            break
        quick = _quick(profile, cluster, cand, options, schedule)
        if quick is not None and (best is None or quick[0] > best[0]):
            best = (quick[0], quick[1], cand)
    open_bound = 0.0  # the best rate any planned candidate may still reach (its own certificate)
    tried = []
    stop = len(cands)  # the candidates from here on were not planned
    for k, cand in enumerate(cands):
        left = t0 + time_limit_s - time.perf_counter()
        if left <= 0 or (best is not None and best[0] >= cand.bound_samples_per_s * (1 - rel_tol)):
            stop = k
            break
        view = cluster.with_tensor_parallel(dict(cand.degrees))
        try:
            res = plan_cluster(profile, view, cand.virtual_workers, micro_batches=cand.micro_batches,
                               options=options, schedule=schedule, time_limit_s=max(left / 4, min(left, 1.0)))
        except FormatError as err:  # a candidate the planner refuses (say, more workers than layers allow)
            tried.append({"degrees": dict(cand.degrees), "virtual_workers": cand.virtual_workers, "refused": str(err)})
            continue
        rate = 1.0 / res.objective if res.ok and res.objective > 0 else 0.0
        upper = 1.0 / res.lower_bound if res.lower_bound > 0 else cand.bound_samples_per_s
        open_bound = max(open_bound, min(upper, cand.bound_samples_per_s))
        tried.append({"degrees": dict(cand.degrees), "virtual_workers": cand.virtual_workers,
                      "micro_batches": cand.micro_batches, "samples_per_s": rate,
                      "bound_samples_per_s": min(upper, cand.bound_samples_per_s)})
        if res.ok and (best is None or rate > best[0]):
            best = (rate, res, cand)
    rest = max((c.bound_samples_per_s for c in cands[stop:]), default=0.0)
    if best is None:
        return SolveResult(SolveStatus.UNKNOWN if rest > 0 else SolveStatus.INFEASIBLE, None,
                           runtime_s=time.perf_counter() - t0, method="tensor",
                           reason="no candidate (degrees per GPU type, pipelines) gave a plan that fits")
    rate, res, cand = best
    if res.method == "tensor:uniform":  # predictions attached to the one plan returned
        assert res.plan is not None
        view = cluster.with_tensor_parallel(dict(cand.degrees))
        res = replace(res, plan=with_predictions(res.plan, profile, view, options,
                                                 res.details.pop("closed_form")))  # type: ignore[typeddict-item]
    upper = max(rate, open_bound, rest)
    status = SolveStatus.OPTIMAL if upper <= rate * (1 + 1e-9) else SolveStatus.FEASIBLE
    details = dict(res.details)
    details.update({"tensor_parallel": dict(cand.degrees), "virtual_workers": cand.virtual_workers,
                    "candidates": len(cands), "candidates_planned": len(tried), "tried": tried,
                    "global_batch": global_batch})
    log.info("tensor: %d candidates, %d planned, best %.2f samples/s, bound %.2f", len(cands), len(tried),
             rate, upper)
    out = SolveResult(status, res.plan, 1.0 / rate, 1.0 / upper if upper > 0 else math.nan,
                      time.perf_counter() - t0, "tensor", details=details)  # type: ignore[arg-type]
    assert res.plan is not None
    return replace(out, plan=replace(res.plan, solver=out.solver_info()))
