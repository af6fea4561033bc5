"""Tensor parallelism chosen with the rest: each GPU type's degree, the number of pipelines and
their micro-batches under a fixed global batch, then the cluster planner on each choice.

A *view* of the cluster gives every GPU type a tensor-parallel degree ``t`` (its GPUs grouped t
to a device on their node, :meth:`partitioner.cluster.Cluster.with_tensor_parallel`); stages of a
worker may sit on devices of different degrees, and so may the replicas of a stage. A
*candidate* is a view and a count ``K`` of virtual workers that divides the global batch:
``K x m x b = global_batch`` for the profile's micro-batch size ``b``, so every candidate trains
the same samples per iteration. Each candidate has a certified upper bound on samples/s (the
per-layer bound of :mod:`solvers.cluster.bounds.layers` at that K, with the pace bound of
:mod:`solvers.cluster.bounds.pace` where it is tighter; a candidate planned in full
also has the cluster planner's own certificate, with the fleet bound of
:mod:`solvers.cluster.bounds.fleet`); candidates are planned best
bound first, and the search stops when the best plan found is at least the next bound (nothing
left can beat it) or time is up. The search ranks by the closed form; the answer is priced by the
simulator, and its certificate is the largest bound of the candidates not planned and of the
planned ones' bounds that hold for any order of the actions (the simulator's included; see
:func:`_result`). The closed form's own certificate, tighter, is kept beside it.

The per-layer bound is a linear program, one per candidate; most candidates never need it. A
view (size and degrees) starts with its perfect speed-up (``micro_batch_size * sum_d 1 / T_d``,
:func:`solvers.cluster.planner.throughput_upper_bound`: no plan on those devices beats it, at
any K), a closed form, in a heap taken best bound first (:class:`_Queue`). A view reaching the
top gets the per-layer LP of one worker at its most micro-batches, which bounds all its K, and
goes back in; reaching the top again, it goes back in as its candidates; a candidate reaching
the top gets, one step each time it is back on top, the pace bound from its view's table (one
per view, for every K and m), its own LP, and the pace bound with each stage's edges at its own
K and m (:func:`solvers.cluster.bounds.pace.edge_s`; no pace bounds where stages may be
replicated), and reaching the top after the last is taken. Each step keeps
the smaller of the old and the new bound, so the candidates come out in the order of the bounds
that :func:`candidates` lists, and anything never reached keeps a valid bound for the
certificate.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np

from partitioner.cluster import Cluster, Device, device_kind
from partitioner.cost import CostModel
from partitioner.errors import FormatError, OptionError
from partitioner.plan import MAX_MICRO_BATCHES
from partitioner.pricing import CostOptions
from partitioner.profile import Profile
from partitioner.schedule import Schedule, first_slice_counts

from ..predictions import with_predictions
from ..progress import status
from ..result import SolveResult, SolveStatus
from .bounds.layers import layer_bound
from .bounds.pace import PaceTable, pace_bound, pace_table
from .bounds.paced import _reference
from .planner import (
    WorkerPlanner,
    WorkerUnfit,
    plan_cluster,
    plan_of,
    price_plan,
)

__all__ = ["Candidate", "candidates", "plan_tensor_parallel", "type_degrees"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    """One choice of the outer search: a micro-batch size, a degree per GPU type, K pipelines of m
    micro-batches, and the bound on its samples/s (per-layer and pace)."""

    micro_batch_size: int
    degrees: tuple[tuple[str, int], ...]
    virtual_workers: int
    micro_batches: int
    bound_samples_per_s: float


UNUSED = 0  # a candidate's degree for a GPU type it leaves idle (a slow type can slow every worker it joins)


def candidate_view(cluster: Cluster, degrees: Sequence[tuple[str, int]]) -> tuple[Cluster, list[Device]]:
    """The cluster viewed at a candidate's degrees, and the devices it uses (those of the GPU types
    it does not leave idle)."""
    view = cluster.with_tensor_parallel({t: d for t, d in degrees if d != UNUSED})
    idle = {t for t, d in degrees if d == UNUSED}
    return view, [d for d in view.devices if d.gpu_type not in idle]


_Costs = dict[tuple[int, tuple[tuple[str, int], ...]], CostModel]


def _view_cost(costs: _Costs, profile: Profile, view: Cluster, size: int, degrees: tuple[tuple[str, int], ...],
               options: CostOptions | None) -> CostModel:
    """One cost model per (micro-batch size, degrees), shared by the bounds and the quick pass (its
    matrices are computed once)."""
    key = (size, degrees)
    if key not in costs:
        costs[key] = CostModel(profile, view, options)
    return costs[key]


def type_degrees(profile: Profile, cluster: Cluster, fixed: int | None = None) -> dict[str, tuple[int, ...]]:
    """Per GPU type of ``cluster``, the degrees it may take: profiled on that type, and dividing
    every run of the type's GPUs in a node (a group never spans nodes or types). ``fixed``: that
    degree for every type (as Megatron's ``--tensor-model-parallel-size``)."""
    runs: dict[str, list[int]] = {}
    for node in cluster.nodes:
        for gpu_type, _, count in cluster._runs(node):
            runs.setdefault(gpu_type, []).append(count)
    out: dict[str, tuple[int, ...]] = {}
    cost = CostModel(profile, cluster)  # which kinds have times (a question of the profile alone)
    for gpu_type, counts in runs.items():
        ok = []
        for t in profile.tensor_parallel_degrees if fixed is None else (fixed,):
            if t not in profile.tensor_parallel_degrees:
                raise OptionError("tensor_parallel", t, f"the profile was measured at tensor-parallel degrees "
                                  f"{', '.join(map(str, profile.tensor_parallel_degrees))}")
            if all(c % t == 0 for c in counts) and cost.has_times(device_kind(gpu_type, t)):
                ok.append(t)
        if not ok:
            raise OptionError("tensor_parallel", fixed, f"no degree fits the {gpu_type} GPUs (nodes of "
                              f"{sorted(set(counts))}) with times in the profile")
        out[gpu_type] = tuple(ok)
    return out


def _choices(profiles: Mapping[int, Profile], cluster: Cluster, global_batch: int, fixed: int | None,
             virtual_workers: int | None, pipeline: int | None
             ) -> Iterator[tuple[int, tuple[tuple[str, int], ...], Cluster, list[Device], list[tuple[int, int]]]]:
    """Every (size, degrees) whose view splits ``global_batch``, with the view, its devices and
    its (K, m) pairs (``K m size = global_batch``, ``m`` within the plan's limit)."""
    for b, profile in profiles.items():
        if global_batch % b:
            continue
        per_type = type_degrees(profile, cluster, fixed)
        types = list(per_type)
        choices = [per_type[t] if len(types) == 1 else (UNUSED, *per_type[t]) for t in types]
        for combo in itertools.product(*choices):
            if all(d == UNUSED for d in combo):
                continue
            degrees = tuple(zip(types, combo, strict=True))
            view, devices = candidate_view(cluster, degrees)
            n = len(devices)
            if pipeline is not None:  # K workers of `pipeline` stages each, one device a stage
                if n % pipeline:
                    continue
                ks = [n // pipeline] if virtual_workers in (None, n // pipeline) else []
            else:
                ks = [virtual_workers] if virtual_workers else list(range(1, n + 1))
            pairs = [(k, global_batch // (b * k)) for k in ks
                     if k <= n and not (global_batch // b) % k and global_batch // (b * k) <= MAX_MICRO_BATCHES]
            if pairs:
                yield b, degrees, view, devices, pairs


_View = tuple[int, tuple[tuple[str, int], ...]]  # (micro-batch size, degrees)


def _perfect_speedup(size: int, layer_s: Sequence[np.ndarray], counts: Sequence[int]) -> float:
    """:func:`solvers.cluster.planner.throughput_upper_bound` from each kind's layer seconds and
    device count: ``size * sum_t n_t / T'_t`` with the effective whole-model times of
    :func:`solvers.cluster.bounds.fleet.effective_whole_s` (the same reference and ratios)."""
    _, eff = _reference(np.stack(list(layer_s), axis=1))
    return size * sum(n / t if t > 0 else math.inf for n, t in zip(counts, eff, strict=True))

# what a heap entry stands for: a view at its perfect speed-up, a view at its one-worker LP (every
# K and m of it), a candidate at its view's LP, at its pace bound, at its own LP, and at its pace
# bound with edges (ready)
_ROUGH, _VIEW, _PENDING, _LP, _EDGES, _READY = range(6)


class _Queue:
    """The candidates best bound first, each bound refined only when it reaches the top (see the
    module docstring). :meth:`ordered` yields the candidates with their own LP bounds, in falling
    order, remembering what it yielded; :meth:`rest` is the largest bound of those not yet
    yielded."""

    def __init__(self, profiles: Mapping[int, Profile], cluster: Cluster, global_batch: int,
                 options: CostOptions | None, schedule: str, fixed: int | None, virtual_workers: int | None,
                 pipeline: int | None, costs: _Costs, replication: bool = False):
        self._heap: list[tuple[float, int, int, Any]] = []
        self.replication = replication  # plans may replicate stages: no pace bounds (they assume one device a stage)
        self._views: dict[_View, tuple[Profile, Cluster, list[Device], list[tuple[int, int]]]] = {}
        self._costs, self._options = costs, options
        self._pace: dict[_View, PaceTable | None] = {}
        self._filled: dict[tuple[_View, int, int, int], PaceTable | None] = {}  # (view, m, slices, K): with edges
        self.schedule = schedule
        self.entries = 0  # candidates
        self.bounded = 0  # LPs solved
        self._seq = itertools.count()  # ties keep the order of enumeration
        self.done: list[Candidate] = []  # yielded, in order
        layer_s: dict[tuple[int, str], np.ndarray] = {}  # (size, kind) -> every layer's seconds
        for b, degrees, view, devices, pairs in _choices(profiles, cluster, global_batch, fixed, virtual_workers,
                                                          pipeline):
            self._views[(b, degrees)] = (profiles[b], view, devices, pairs)
            self.entries += len(pairs)
            counts: dict[str, int] = {}
            for d in devices:
                counts[d.kind] = counts.get(d.kind, 0) + 1
            for kind in counts:
                if (b, kind) not in layer_s:  # a kind's times are its own: any view holding it prices them
                    layer_s[(b, kind)] = self.cost((b, degrees)).layer_compute_s(kind)
            self._push(_perfect_speedup(b, [layer_s[(b, t)] for t in counts], list(counts.values())), _ROUGH,
                       (b, degrees))

    def cost(self, key: _View) -> CostModel:
        """The cost model of a view (made once, shared with the quick pass)."""
        profile, view, _, _ = self._views[key]
        return _view_cost(self._costs, profile, view, key[0], key[1], self._options)

    @staticmethod
    def _key(cand: Candidate) -> _View:
        return cand.micro_batch_size, cand.degrees

    def _refine(self, cand: Candidate, level: int) -> float:
        """A candidate's bound at the step after ``level``: the pace bound from its view's table for
        every K and m (``_PENDING``; milliseconds once the table exists), its per-layer LP
        (``_LP``), the pace bound with each stage's edges at its own K and m (``_EDGES``; a
        table per view, K and m)."""
        key = self._key(cand)
        cost, devices = self.cost(key), self._views[key][2]
        sched = Schedule.of(self.schedule, cand.micro_batches)
        slices = _most_slices(self.schedule, cand)
        if level == _PENDING:
            # whole layers in contiguous stages: the slowest worker's bottleneck device (slices of
            # the first micro-batch do not change it; solvers.cluster.bounds.pace); not where
            # replicas share a stage's micro-batches
            if self.replication:
                self._pace[key] = None
                return math.inf
            if key not in self._pace:  # one table per view, at its fewest micro-batches: for every K and m
                fewest = min(m for _, m in self._views[key][3])
                self._pace[key] = pace_table(cost, devices, Schedule.of(self.schedule, fewest))
            return pace_bound(cost, devices, cand.virtual_workers, sched, self._pace[key])
        if level == _LP:
            # the per-layer bound: the fleet bound's LPs cost 30 times more; a candidate planned in
            # full gets it too (the cluster planner's certificate)
            self.bounded += 1
            return layer_bound(cost, devices, cand.virtual_workers, sched, slices=slices, replication=self.replication)
        edged = (key, cand.micro_batches, slices, cand.virtual_workers)
        if edged not in self._filled:
            self._filled[edged] = pace_table(cost, devices, sched, fill_slices=slices,
                                             virtual_workers=cand.virtual_workers)
        return pace_bound(cost, devices, cand.virtual_workers, sched, self._filled[edged])

    def _push(self, bound: float, level: int, item: Any) -> None:
        heapq.heappush(self._heap, (-bound, next(self._seq), level, item))

    def _next(self) -> Candidate | None:
        while self._heap:
            neg, _, level, item = heapq.heappop(self._heap)
            if level == _READY:
                return cast(Candidate, item)
            if level == _ROUGH:
                # the one-worker LP at the view's most micro-batches bounds every K and m of it: K
                # workers are busy at least K times one worker (solvers.cluster.bounds.layers), and
                # one worker's rate bound grows with m (its step and all-reduce spread over more)
                _, _, devices, pairs = self._views[item]
                most = max(m for _, m in pairs)
                bound = layer_bound(self.cost(item), devices, 1, Schedule.of(self.schedule, most), every_k=True,
                                    replication=self.replication)
                self.bounded += 1
                if bound > 0:  # 0: not even one worker fits
                    self._push(min(bound, -neg), _VIEW, item)
            elif level == _VIEW:
                b, degrees = item
                for k, m in self._views[item][3]:
                    self._push(-neg, _PENDING, Candidate(b, degrees, k, m, -neg))
            else:  # a candidate: its next refinement, each only once it reaches the top
                cand = cast(Candidate, item)
                bound = min(-neg, self._refine(cand, level))
                if bound > 0:  # 0: no plan of k workers fits
                    edges = level == _LP and self._pace[self._key(cand)] is not None  # no table: no edges
                    nxt = _LP if level == _PENDING else _EDGES if edges else _READY
                    self._push(bound, nxt, replace(cand, bound_samples_per_s=bound))
        return None

    def ordered(self) -> Iterator[Candidate]:
        """The candidates yielded so far, then the next ones, best bound first."""
        k = 0
        while True:
            if k == len(self.done):
                cand = self._next()
                if cand is None:
                    return
                self.done.append(cand)
            yield self.done[k]
            k += 1

    def rest(self, start: int) -> float:
        """The largest bound of the candidates from the ``start``-th yielded on (the unyielded too)."""
        return max([c.bound_samples_per_s for c in self.done[start:]] + [-h[0] for h in self._heap[:1]],
                   default=0.0)


def candidates(profiles: Mapping[int, Profile], cluster: Cluster, global_batch: int,
               options: CostOptions | None = None, schedule: str = "1f1b", fixed: int | None = None,
               virtual_workers: int | None = None, pipeline: int | None = None,
               costs: _Costs | None = None) -> list[Candidate]:
    """Every (size, view, K) whose pipelines split ``global_batch`` into whole micro-batches of a
    size of ``profiles`` (size -> the profile at that size), with its bound, best bound first."""
    queue = _Queue(profiles, cluster, global_batch, options, schedule, fixed, virtual_workers, pipeline,
                   {} if costs is None else costs)
    return list(queue.ordered())


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


def _most_slices(schedule: str, cand: Candidate) -> int:
    """The most slices the answer's first micro-batch may take on this candidate
    (:func:`solvers.planning.plan` tries them): its bounds must hold for them."""
    return max(first_slice_counts(schedule, cand.micro_batch_size, cand.micro_batches))


def _quick(profile: Profile, cluster: Cluster, cand: Candidate, options: CostOptions | None,
           schedule: str, costs: _Costs) -> tuple[float, SolveResult] | None:
    """The candidate's uniform grouping (:func:`uniform_grouping`), every worker mapped and split
    exactly, priced as the cluster planner prices plans: a plan in milliseconds that the full
    search only has to beat. None where the grouping does not exist or does not fit."""
    view, devices = candidate_view(cluster, cand.degrees)
    groups = uniform_grouping(devices, cand.virtual_workers)
    if groups is None or len(groups[0]) > QUICK_WORKER_DEVICES:
        return None
    cost = _view_cost(costs, profile, view, cand.micro_batch_size, cand.degrees, options)
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


REL_TOL = 0.01  # the search stops once no candidate left can beat the best plan by more than this
QUICK_SHARE = 0.25  # of the time limit, what the quick pass may take (past it, only until a first plan)
FINISH_SHARE = 0.1  # of the time limit, kept for the answer (its predictions simulate the plan)
MIN_FULL_S = 0.3  # the least time worth a full plan of a candidate (its set-up alone takes about that)


def plan_tensor_parallel(profile: Profile, cluster: Cluster, global_batch: int, *,
                         sizes: Sequence[int] | None = None, options: CostOptions | None = None,
                         schedule: str = "1f1b", tensor_parallel: int | None = None,
                         virtual_workers: int | None = None, pipeline: int | None = None,
                         time_limit_s: float = 60.0, rel_tol: float = REL_TOL, replication: bool = False) -> SolveResult:
    """The best plan over every candidate (see the module docstring), with the certificate of the
    whole space. ``sizes``: micro-batch sizes to consider (the profile at each,
    :meth:`partitioner.profile.Profile.at_size`; default its own); ``tensor_parallel`` /
    ``virtual_workers`` / ``pipeline`` (stages per worker, one device each) fix a dimension;
    ``rel_tol`` stops once no candidate left can beat the best by more than that fraction;
    ``replication``: a stage may run over several GPUs (:mod:`solvers.cluster.replication`; the
    pace bounds, which take one device a stage, are then left out). The plan is of
    ``profile.at_size(plan.micro_batch_size)``."""
    # one status line for the whole search: each candidate's cluster planner says what it does there
    with status(f"3D planner ({cluster.num_gpus:,} GPUs)"):
        return _search(profile, cluster, global_batch, sizes, options, schedule, tensor_parallel, virtual_workers,
                       pipeline, time_limit_s, rel_tol, replication)


def _search(profile: Profile, cluster: Cluster, global_batch: int, sizes: Sequence[int] | None,
            options: CostOptions | None, schedule: str, tensor_parallel: int | None, virtual_workers: int | None,
            pipeline: int | None, time_limit_s: float, rel_tol: float, replication: bool = False) -> SolveResult:
    t0 = time.perf_counter()
    profiles = {b: profile.at_size(b) for b in (sizes or [profile.micro_batch_size])}
    costs: _Costs = {}
    queue = _Queue(profiles, cluster, global_batch, options, schedule, tensor_parallel, virtual_workers, pipeline,
                   costs, replication)
    if next(queue.ordered(), None) is None:
        return SolveResult(SolveStatus.INFEASIBLE, None, runtime_s=time.perf_counter() - t0, method="tensor",
                           reason=f"no micro-batch size of {', '.join(map(str, profiles))} and number of pipelines "
                                  f"splits the global batch {global_batch} in a way that fits this cluster's memory")
    best = _quick_pass(profiles, cluster, queue.ordered(), options, schedule, t0 + QUICK_SHARE * time_limit_s,
                       rel_tol, costs)
    open_bound = 0.0  # the best rate any planned candidate may still reach (its own certificate)
    open_any = 0.0  # the same from the candidates' per-layer bounds alone (they hold for the simulator too)
    tried: list[dict[str, Any]] = []
    stop = None  # the candidates from here on were not planned in full
    overrun = 0.0
    for k, cand in enumerate(queue.ordered()):
        # what is left, less the answer's share and what a full plan has run past its own limit
        left = t0 + (1 - FINISH_SHARE) * time_limit_s - time.perf_counter() - overrun
        if left < MIN_FULL_S or (best is not None and best[0] >= cand.bound_samples_per_s * (1 - rel_tol)):
            stop = k
            break
        given, started = max(left / 4, min(left, 1.0)), time.perf_counter()
        res = _full(profiles[cand.micro_batch_size], cluster, cand, options, schedule, given, tried, replication)
        overrun = max(overrun, time.perf_counter() - started - given)  # pricing and certifying its plan
        if res is None:
            continue
        if pipeline is not None and res.plan is not None and any(
                len(w.stages) != pipeline for w in res.plan.virtual_workers):
            tried[-1]["refused"] = f"workers of other than {pipeline} stages"
            open_bound = max(open_bound, cand.bound_samples_per_s)
            open_any = max(open_any, cand.bound_samples_per_s)
            continue
        rate = 1.0 / res.objective if res.ok and res.objective > 0 else 0.0
        upper = min(1.0 / res.lower_bound if res.lower_bound > 0 else math.inf, cand.bound_samples_per_s)
        open_bound = max(open_bound, upper)
        bound_info = cast(Mapping[str, float], dict(res.details).get("bound", {}))
        any_order = bound_info.get("any_order_samples_per_s", math.inf)
        open_any = max(open_any, min(any_order, cand.bound_samples_per_s))
        tried[-1].update({"samples_per_s": rate, "bound_samples_per_s": upper})
        if res.ok and (best is None or rate > best[0]):
            best = (rate, res, cand)
    rest = queue.rest(len(queue.done) if stop is None else stop)
    if best is None:
        return SolveResult(SolveStatus.UNKNOWN if rest > 0 else SolveStatus.INFEASIBLE, None,
                           runtime_s=time.perf_counter() - t0, method="tensor",
                           reason="no candidate (micro-batch size, degrees per GPU type, pipelines) gave a plan that "
                                  "fits" + ("" if rest == 0 else " within the time limit"))
    return _result(best, profiles, cluster, options, max(best[0], open_bound, rest), max(open_any, rest),
                   {"candidates": queue.entries, "candidates_bounded": queue.bounded,
                    "candidates_planned": len(tried), "tried": tried, "global_batch": global_batch}, t0)


def _quick_pass(profiles: Mapping[int, Profile], cluster: Cluster, cands: Iterator[Candidate],
                options: CostOptions | None, schedule: str, deadline: float, rel_tol: float, costs: _Costs
                ) -> tuple[float, SolveResult, Candidate] | None:
    """The best uniform plan (:func:`_quick`) of the candidates, in bound order, until ``deadline``
    (past it, until a first plan is found: milliseconds each) or until no candidate left can beat it."""
    best: tuple[float, SolveResult, Candidate] | None = None
    for cand in cands:
        if best is not None and (time.perf_counter() > deadline or best[0] >= cand.bound_samples_per_s * (1 - rel_tol)):
            break
        quick = _quick(profiles[cand.micro_batch_size], cluster, cand, options, schedule, costs)
        if quick is not None and (best is None or quick[0] > best[0]):
            best = (quick[0], quick[1], cand)
    return best


def _full(profile: Profile, cluster: Cluster, cand: Candidate, options: CostOptions | None, schedule: str,
          limit_s: float, tried: list[dict[str, Any]], replication: bool = False) -> SolveResult | None:
    """The cluster planner on one candidate within ``limit_s`` (None where it refuses the candidate,
    noted in ``tried``)."""
    view, devices = candidate_view(cluster, cand.degrees)
    tried.append({"micro_batch_size": cand.micro_batch_size, "degrees": dict(cand.degrees),
                  "virtual_workers": cand.virtual_workers, "micro_batches": cand.micro_batches})
    try:
        return plan_cluster(profile, view, cand.virtual_workers, micro_batches=cand.micro_batches, options=options,
                            devices=[d.name for d in devices],
                            schedule=schedule, time_limit_s=limit_s, slices=_most_slices(schedule, cand),
                            replication=replication)
    except FormatError as err:  # a candidate the planner refuses (say, more workers than layers allow)
        tried[-1]["refused"] = str(err)
        return None


def _result(best: tuple[float, SolveResult, Candidate], profiles: Mapping[int, Profile], cluster: Cluster,
            options: CostOptions | None, closed_upper: float, upper: float, extra: dict[str, Any],
            t0: float) -> SolveResult:
    """The answer: the best plan (with predictions), its candidate's choices and the certificate.

    The search ranks candidates by the closed form (:func:`solvers.cluster.planner.price_plan`);
    the answer is priced by the simulator (``plan.predicted``), which also times what the closed
    form leaves out (several workers' transfers queueing on one link between two nodes). Its
    certificate is ``upper``, the largest per-layer bound of the candidates
    (:func:`solvers.cluster.bounds.layers.layer_bound`, :func:`solvers.cluster.bounds.pace.pace_bound`
    and the perfect speed-up): busy-time and
    dependency bounds that hold for any execution of the cost model's actions, the simulator's
    included, so it bounds every candidate's simulated rate. ``closed_upper``, the certificate
    of the closed form (with the cluster planner's own, priced by that closed form), is kept in
    ``details``."""
    closed_rate, res, cand = best
    assert res.plan is not None
    if res.method == "tensor:uniform":  # predictions attached to the one plan returned
        view = candidate_view(cluster, cand.degrees)[0]
        closed = cast(Mapping[str, float], dict(res.details)["closed_form"])
        res = replace(res, plan=with_predictions(res.plan, profiles[cand.micro_batch_size], view, options, closed,
                                                 extra_meta={"policy": "uniform", "objective": "sync"}))
    assert res.plan is not None
    simulated = res.plan.predicted.get("samples_per_s", math.nan) if res.plan.predicted else math.nan
    rate = simulated if simulated > 0 and math.isfinite(simulated) else closed_rate
    if upper < rate * (1 - 1e-9):  # a bound below a plan it was to bound: no certificate
        log.warning("tensor: a bound (%.6g samples/s) is below the plan's simulated %.6g; the plan is returned "
                    "without a certificate", upper, rate)
        upper = math.nan
    status = SolveStatus.OPTIMAL if upper <= rate * (1 + 1e-9) else SolveStatus.FEASIBLE
    details = {k: v for k, v in dict(res.details).items() if k != "closed_form"}
    details.update({"tensor_parallel": dict(cand.degrees), "virtual_workers": cand.virtual_workers,
                    "micro_batch_size": cand.micro_batch_size,
                    "closed_form": {"samples_per_s": closed_rate, "bound_samples_per_s": closed_upper}, **extra})
    log.info("tensor: %d candidates, %d planned, best %.2f samples/s simulated (%.2f closed form), bound %.2f",
             extra["candidates"], extra["candidates_planned"], rate, closed_rate, upper)
    out = SolveResult(status, res.plan, 1.0 / rate, 1.0 / upper if upper > 0 else math.nan,
                      time.perf_counter() - t0, "tensor", details=details)  # type: ignore[arg-type]
    meta = dict(res.plan.meta)
    meta["closed_form"] = {**meta.get("closed_form", {}), "bound_samples_per_s": closed_upper}
    return replace(out, plan=replace(res.plan, solver=out.solver_info(), meta=meta))
