"""A bound on the ``sync`` objective of a small cluster that includes the gradient all-reduce.

:mod:`solvers.cluster.bounds.fleet` bounds every plan by its pipelines alone: the all-reduce between
virtual workers and the optimizer step only add to an iteration, so they are left out. On a
small cluster that leaves a gap of a few per cent exactly where data parallelism is priced:
the best plans there are often single-GPU workers that pay the whole model's all-reduce.
This module bounds the same closed form the planner reports
(:meth:`partitioner.cost.CostModel.plan_iteration_s`) with the all-reduce in it, over every
grouping of the cluster into workers.

**One worker among K.** Let a plan have ``K`` virtual workers without replicated stages, and
let worker ``S`` (its GPU set) have a pipeline of ``q = |S|`` stages. Under a flushing schedule
its stage 0 finishes its last backward when the worker's pipeline ends, at
``worker_iteration_s``; its device then all-reduces every group of layers it holds, one after
another, and steps. So the plan's iteration is at least

    L(S, K) = P(S) + F_K(w_0) + U(w_0)

with ``w_0`` stage 0's parameters, ``U`` the optimizer step, ``F_K(n)`` the least time of an
all-reduce of ``n`` bytes over ``K`` of the cluster's GPUs and ``P(S)`` a lower bound on the
worker's pipeline:

* ``P(S) >= (m - 1) max(l, W / |S|) + W`` (always; no solver), with ``W`` the model's work with
  every layer on its fastest type of ``S`` and ``l`` the largest such layer: the fill crosses
  every layer once and the pace is at least every stage's compute; and ``P(S) >= G(S)``, the
  fleet bound's ``min_q (m - 1 + q) / S_q`` over the types' effective whole-model times
  (:func:`solvers.cluster.bounds.fleet.effective_whole_s`);
* the LP of :func:`pipeline_floor_s` over ``S``'s mix of GPU types (layers assigned
  fractionally, no GPU computing more than the pace);
* where the orders of ``S`` are few enough to enumerate, the least ``fill + (m - 1) x
  bottleneck`` over every order and split (:func:`exact_pipeline_floor_s`; under GPipe, the LP
  with the least bottleneck of :func:`solvers.pipeline.mapping.map_worker` as the least pace).

A single-GPU worker holds the whole model (``w_0`` everything), so for it ``L`` is exact but for
``F``; a pipelined worker's stage 0 holds at least the first layer.

``F_K``: every layer is held by one device of each worker, so each all-reduce group has ``K``
members. The groups a device runs add up; where every link's time is affine in the bytes
(a flat bandwidth and a latency: no measured curve) the all-reduce time of each member set is
affine with a non-negative intercept, the least over member sets is concave, hence
subadditive: the groups together take at least ``F_K`` of their summed bytes. ``F_K`` is the
least :meth:`~partitioner.cost.CostModel.allreduce_s` over every way of placing ``K`` members on
the nodes (members of a node kept together in the ring, which is the best order when links
inside a node are at least as fast as between nodes, and no link override names a device or a
node pair). Where these conditions fail, ``F`` is taken as 0 (the bound stays valid, only looser).

**Every stage, and the chain to the first common cut** (:mod:`solvers.cluster.bounds.tail`, for
templates whose orders and splits can be enumerated). Stage ``k`` of a worker finishes
``B_k`` (the backward of the stages before it) ahead of the worker's pipeline and then
all-reduces what it holds, so every stage, not only stage 0, bounds the iteration. And the
groups run in the order of their first layer on every device: the group of layer 0 holds every
worker's stage 0, so it starts after the last pipeline ends, and each next group shares a
device with the one before it, up to the first layer ``c`` at which every worker has a stage
boundary (``L`` where there is none; a single-GPU worker has none). So a plan whose first
common boundary is ``c`` takes at least ``T_w + F_K(w[0, c))`` beyond each worker's pipeline
``T_w``. For each ``c`` the bound asks which ``K`` workers could fit with these values
(a worker must have a boundary at ``c``); the least over ``c`` bounds the plans of ``K``
workers. When two kinds of worker want different cuts, this is what they pay: VGG-19's fully
connected layers, on the last stage, are all-reduced after the other kind's stage 0 finishes.

**The cluster.** The plan's rate is ``K m b / iteration <= K m b / max_w L(S_w, K)``. For each
``K``, a worker set can beat a plan of ``V`` samples/s only if every worker has
``L(S, K) < K m b / V``; whether ``K`` disjoint such workers fit the cluster is a
reachability DP over counts of worker templates (:mod:`solvers.cluster.templates`: interchangeable
GPUs make a worker a template). The bound for ``K`` is ``K`` times the least template rate at
which ``K`` workers first fit, trying templates in falling rate order; the bound is the largest
over ``K``, or ``V`` itself when no ``K`` fits: then the plan is proven optimal.
GPUs may stay idle in the bound (a plan need not use them all).
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from partitioner.cluster import Device
from partitioner.cost import CostModel
from partitioner.schedule import Schedule
from solvers.cluster.bounds.fleet import effective_whole_s, worker_memory_bytes, worker_time_bound_s
from solvers.cluster.bounds.tail import TailTable, worker_tail_table
from solvers.cluster.templates import (
    NodeClass,
    Template,
    _pack,
    add_template,
    complete_templates,
    realise,
    template_usage,
)
from solvers.pipeline.mapping import (
    device_labels,
    label_orders,
    map_worker,
    num_label_orders,
    realise_order,
)

__all__ = ["SyncBound", "allreduce_floor", "exact_pipeline_floor_s", "pipeline_floor_s", "sync_bound"]

log = logging.getLogger(__name__)

GRID = 48  # paces priced per order by exact_pipeline_floor_s where the window holds more
CURVE_POINTS = 64  # byte counts at which the all-reduce floor is computed exactly for the tail tables
TABLE_LIMIT = 100_000  # order-and-split pairs a template's tail table may enumerate

Mix = tuple[tuple[str, int], ...]  # (gpu type, count) pairs, sorted: a template's GPUs by type


@dataclass(frozen=True)
class SyncBound:
    """An upper bound on the ``sync`` samples/s of any plan without replicated stages."""

    samples_per_s: float
    workers: int  # the K at which the bound is reached (0: no K beats the plan it was asked about)
    templates: int  # worker templates considered
    refined: int  # templates whose pipeline bound came from an exhaustive mapping search
    allreduce_floor: bool  # whether the all-reduce term applies (links affine, no overrides)
    complete: bool  # False: stopped by the time limit; samples_per_s is then the fallback given
    details: dict[str, Any] = field(default_factory=dict)  # grouping: a better grouping found; reason

    def __post_init__(self) -> None:
        if not self.samples_per_s >= 0:
            raise ValueError(f"SyncBound: rate {self.samples_per_s} is not >= 0")


def _affine_links(cost: CostModel, devices: Sequence[Device]) -> bool:
    """Whether every link among ``devices`` is flat (a bandwidth and a latency, no curve), no
    override names a device or node pair, and no node's links are slower than between nodes."""
    cl = cost.cluster
    if cl.links:
        return False
    by_node: dict[str, list[Device]] = {}
    for d in devices:
        by_node.setdefault(d.node, []).append(d)
    heads = [v[0] for v in by_node.values()]
    pairs = [(v[0], v[1]) for v in by_node.values() if len(v) > 1]
    inter = [cl.link(heads[0].name, heads[1].name)] if len(heads) > 1 else []
    links = [cl.link(a.name, b.name) for a, b in pairs] + inter
    if any(bw.points or bw.log2_mb_poly for bw in links):
        return False
    if inter:
        speed = inter[0].gbps
        return all(cl.link(a.name, b.name).gbps >= speed and cl.link(a.name, b.name).latency_s <= inter[0].latency_s
                   for a, b in pairs)
    return True


def _placements(kinds: Sequence[tuple[int, int]], members: int) -> list[list[tuple[int, ...]]]:
    """Members per node for nodes in kinds of ``(nodes, GPUs per node)``: for each kind a falling
    vector of counts (nodes of a kind are interchangeable), all counts summing to ``members``."""
    def falling(r: int, g: int, total: int) -> list[tuple[int, ...]]:
        if r == 0:
            return [()] if total == 0 else []
        return [(c, *rest) for c in range(min(g, total), -1, -1)
                for rest in falling(r - 1, c, total - c)]

    out: list[list[tuple[int, ...]]] = []

    def rec(i: int, left: int, acc: list[tuple[int, ...]]) -> None:
        if i == len(kinds):
            if left == 0:
                out.append(list(acc))
            return
        r, g = kinds[i]
        room = sum(rr * gg for rr, gg in kinds[i + 1:])
        for here in range(min(left, r * g), max(0, left - room) - 1, -1):
            for vec in falling(r, g, here):
                rec(i + 1, left - here, [*acc, vec])

    rec(0, members, [])
    return out


def allreduce_floor(cost: CostModel, devices: Sequence[Device], members: int, nbytes: float) -> float:
    """``F``: the least all-reduce of ``nbytes`` over any ``members`` of ``devices`` (see the module
    docstring); 0 where the conditions for a floor do not hold."""
    if members <= 1 or nbytes <= 0 or not _affine_links(cost, devices):
        return 0.0
    by_node: dict[str, list[Device]] = {}
    for d in devices:
        by_node.setdefault(d.node, []).append(d)
    # nodes of one size and one intra-node link are interchangeable for an all-reduce
    kinds: dict[tuple[int, float, float], list[list[Device]]] = {}
    for devs in by_node.values():
        bw = cost.cluster.link(devs[0].name, devs[1].name) if len(devs) > 1 else None
        kinds.setdefault((len(devs), bw.gbps if bw else 0.0, bw.latency_s if bw else 0.0), []).append(devs)
    groups = list(kinds.values())
    best = math.inf
    for vecs in _placements([(len(g), len(g[0])) for g in groups], members):
        chosen = [d for g, vec in zip(groups, vecs, strict=True) for devs, c in zip(g, vec, strict=True)
                  for d in devs[:c]]
        best = min(best, cost.allreduce_s(nbytes, chosen))
    return 0.0 if best == math.inf else best


def pipeline_floor_s(per_layer_s: dict[str, np.ndarray], counts: dict[str, int], micro_batches: int,
                     least_pace_s: float) -> float:
    """``P``: no worker with ``counts[t]`` GPUs of each type ``t`` runs an iteration of a flushing
    schedule faster, given that its pace is at least ``least_pace_s``.

    The linear program, layers assigned fractionally (``x[l, t]``: the share of layer ``l`` on
    type ``t``; ``c_t(l)``: its forward and backward there)::

        min (m - 1) P + sum_{l,t} c_t(l) x[l, t]
        s.t. sum_t x[l, t] = 1                        every layer somewhere
             sum_l c_t(l) x[l, t] <= counts[t] P      no GPU computes more than the pace
             P >= least_pace_s,  x >= 0

    Any plan of the worker is a feasible point at its own pace (each stage's compute is at most its
    stage time, at most the pace; the fill crosses every stage's compute once), so the optimum is
    a lower bound on ``fill + (m - 1) pace``. ``inf`` when the LP has no answer."""
    types = sorted(t for t, c in counts.items() if c > 0)
    if len(types) == 1:  # one type: the LP's optimum in closed form, P = max(work / GPUs, least pace)
        work = float(np.sum(per_layer_s[types[0]]))
        return (micro_batches - 1) * max(work / counts[types[0]], least_pace_s) + work
    from solvers.cluster.lp import linprog

    n_layers = len(per_layer_s[types[0]])
    nt = len(types)
    nv = 1 + n_layers * nt  # P, then x[l, t] at 1 + l * nt + j
    c = np.zeros(nv)
    c[0] = micro_batches - 1
    a_eq = np.zeros((n_layers, nv))
    a_ub = np.zeros((nt, nv))
    for j, t in enumerate(types):
        cols = 1 + np.arange(n_layers) * nt + j
        c[cols] = per_layer_s[t]
        a_eq[np.arange(n_layers), cols] = 1.0
        a_ub[j, cols] = per_layer_s[t]
        a_ub[j, 0] = -counts[t]
    bounds = [(least_pace_s, math.inf)] + [(0.0, math.inf)] * (nv - 1)
    res = linprog(c, a_ub, np.zeros(nt), a_eq, np.ones(n_layers), bounds=bounds)
    if res.ok:
        return res.fun
    # no answer: the weakest floor that needs no solver (every layer on its fastest type once)
    return (micro_batches - 1) * least_pace_s + float(np.sum(np.min([per_layer_s[t] for t in types], axis=0)))


def exact_pipeline_floor_s(cost: CostModel, devices: Sequence[Device], schedule: Schedule,
                           exact_limit: int = 720) -> float | None:
    """The least ``fill + (m - 1) max_k t_k`` over every order and split of ``devices`` (one stage
    each, memory respected) under a 1F1B-like schedule: the closed form's iteration less its
    Little's-law floor on the pace, so a lower bound on it that is exact where that floor does
    not bind. ``None`` where the orders are too many to enumerate or the schedule is not a
    flushing one-flow schedule (GPipe's fill is priced differently).

    For a pace ``P`` the least fill is a DP over the stages, ``best_k(j) = min_i best_{k-1}(i) +
    f_k(i, j)`` over stages with ``t_k(i, j) <= P`` (``f``: compute plus the activation sent on
    and the gradient sent back); paces are tried upwards from the least bottleneck until
    ``(m - 1) P`` plus the unconstrained least fill can no longer win."""
    sp = schedule.spec
    if not sp.flushes or sp.all_forwards_first:
        return None
    devices = list(devices)
    labels = device_labels(cost, devices)
    if not devices or num_label_orders(labels) > exact_limit:
        return None
    pools: dict[tuple[str, str], list[Device]] = {}
    for lab, d in zip(labels, devices, strict=True):
        pools.setdefault(lab, []).append(d)
    m, n_layers = schedule.micro_batches, cost.num_layers
    upper = np.triu(np.ones((n_layers + 1, n_layers + 1), bool), 1)
    best = math.inf
    for order in label_orders(labels):
        devs = realise_order(order, pools)
        q = len(devs)
        times, fills = [], []
        for k, d in enumerate(devs):
            prev = devs[k - 1] if k else None
            nxt = devs[k + 1] if k + 1 < q else None
            # the least memory any lever allows: a bound over the planner's larger space
            ok = upper & (cost.least_memory_matrix(schedule.activations_in_flight(q - k), schedule,
                                                   tensor_parallel=d.tensor_parallel) <= d.memory_bytes)
            t = cost.pipeline_stage_time_matrix(d, prev, nxt, schedule)
            f = (cost.compute_matrix(d.kind) + cost.boundary_vector_s(d, prev)[:, None]
                 + cost.boundary_vector_s(d, nxt)[None, :])
            times.append(np.where(ok, t, math.inf))
            fills.append(np.where(ok, f, math.inf))
        free = _least_fill(times, fills, math.inf)
        if not math.isfinite(free):
            continue  # nothing fits in this order
        if m == 1:
            best = min(best, free)  # one micro-batch: the fill alone, at any pace
            continue
        paces = np.unique(np.concatenate([t[np.isfinite(t)] for t in times])).tolist()
        lo, hi = 0, len(paces) - 1  # the least pace with a split (feasibility grows with the pace)
        while lo < hi:
            mid = (lo + hi) // 2
            if math.isfinite(_least_fill(times, fills, paces[mid])):
                hi = mid
            else:
                lo = mid + 1
        if (m - 1) * paces[lo] + free >= best:
            continue  # this order cannot beat the best order found
        first = (m - 1) * paces[lo] + _least_fill(times, fills, paces[lo])
        # beyond this pace even the least fill cannot beat the first candidate
        last = bisect.bisect_right(paces, (min(first, best) - free) / (m - 1), lo)
        window = paces[lo:max(last, lo + 1)]
        if len(window) > GRID:  # a grid of paces: between two, the fill is at least the next one's
            picks = sorted({round(i * (len(window) - 1) / (GRID - 1)) for i in range(GRID)})
            grid = [window[i] for i in picks]
            fill = [_least_fill(times, fills, pace) for pace in grid]
            low = min(min((m - 1) * p + f for p, f in zip(grid, fill, strict=True)),
                      min((m - 1) * grid[i] + fill[i + 1] for i in range(len(grid) - 1)))
        else:
            low = min((m - 1) * pace + _least_fill(times, fills, pace) for pace in window)
        best = min(best, low, first)
    return best


def _least_fill(times: Sequence[np.ndarray], fills: Sequence[np.ndarray], pace: float) -> float:
    """The least summed fill over the stages in order, every stage's time within ``pace``."""
    cur = np.full(times[0].shape[0], math.inf)
    cur[0] = 0.0
    for t, f in zip(times, fills, strict=True):
        cur = np.min(np.where(t <= pace, cur[:, None] + f, math.inf), axis=0)
    return float(cur[-1])


def sync_bound(cost: CostModel, devices: Sequence[Device], classes: Sequence[NodeClass], schedule: Schedule, beat_samples_per_s: float, *, exact_limit: int = 720,
               max_worker_gpus: int | None = None, deadline: float | None = None,
               fallback_samples_per_s: float = math.inf,
               price: Callable[[list[list[Device]]], float] | None = None,
               workers: int | None = None) -> SyncBound:
    """The bound of the module docstring over ``devices`` (interchangeable within ``classes``),
    asked whether any plan beats ``beat_samples_per_s``. Past ``deadline`` (a
    ``time.perf_counter()`` value) it gives up with ``fallback_samples_per_s``.

    ``price`` (a grouping -> its plan's samples/s): where ``K`` workers of settled bounds could
    beat the plan, that grouping is priced; a better one becomes the plan to beat (returned in
    ``details["grouping"]``), so the bound also searches, branch-and-bound style.
    ``workers``: only plans of this many virtual workers (``None``: any number).

    Templates are bounded in steps, each only where the one before leaves them able to beat
    the plan: memory; the LP of :func:`pipeline_floor_s` (per mix of GPU types, with the
    slowest layer on its fastest type as the least pace); the same LP with the least
    bottleneck of an exhaustive mapping search as the least pace (per template, where the
    search is exhaustive: at most ``exact_limit`` orders); then, for the templates of the
    workers that still fit, their :class:`~solvers.cluster.bounds.tail.TailTable` among ``K``."""
    if not schedule.spec.flushes or schedule.spec.sync != "allreduce":
        raise ValueError(f"sync_bound: schedule {schedule} is not a flushing all-reduce schedule")
    floors = _MixFloors(cost, devices, schedule)
    affine = cost.options.sync and _affine_links(cost, devices)  # no all-reduce priced: no floor
    n = len(devices)
    listed = complete_templates(classes, min(n, cost.num_layers, max_worker_gpus or n))
    if listed is None:  # too many templates to list: no bound from here
        return SyncBound(fallback_samples_per_s, 0, 0, 0, affine, False, {"reason": "too many worker templates"})
    search = _Search(floors, _Tails(cost, devices, classes, schedule, affine, floors.mix),
                     classes, listed, exact_limit, deadline, price, beat_samples_per_s)
    try:
        for k in range(1, n + 1) if workers is None else [workers]:
            search.bound_k(k)
    except _PastDeadline:
        return search.gave_up(fallback_samples_per_s)
    return search.result()


class _PastDeadline(Exception):
    """The deadline passed: the bound gives up with its fallback."""


def _check_deadline(deadline: float | None) -> None:
    """Raise :class:`_PastDeadline` once ``deadline`` (a ``time.perf_counter()`` value) has passed."""
    if deadline is not None and time.perf_counter() > deadline:
        raise _PastDeadline


class _MixFloors:
    """Step 0 and step 1 of bounding a worker's pipeline ``P``, per mix of GPU types: memory and the
    closed-form floors, then the LP of :func:`pipeline_floor_s`."""

    def __init__(self, cost: CostModel, devices: Sequence[Device], schedule: Schedule):
        self.m = schedule.micro_batches
        n_layers = cost.num_layers
        types = sorted({d.kind for d in devices})
        self.whole = {t: cost.compute_s(t, 0, n_layers) for t in types}
        self.per_layer = {t: cost.layer_compute_s(t) for t in types}
        reserved = cost.options.reserved_bytes
        self.cap = {t: (next(d for d in devices if d.kind == t).memory_bytes - reserved) / cost.shard_memory_ratio(t)
                    for t in types}
        self.need = worker_memory_bytes(cost, schedule)
        self.eff = effective_whole_s(cost, types)
        self._mixes: dict[Template, Mix] = {}
        self._lp: dict[Mix, float] = {}

    def mix(self, tp: Template) -> Mix:
        """The template's GPUs by type."""
        if tp not in self._mixes:
            out: dict[str, int] = {}
            for _, vec in tp:
                for t, c in vec:
                    out[t] = out.get(t, 0) + c
            self._mixes[tp] = tuple(sorted(out.items()))
        return self._mixes[tp]

    def cheap_floor(self, mx: Mix) -> float:
        """Step 0: memory, then every layer once on its fastest type of the mix, the pace at
        least the slowest such layer and the average stage (no LP)."""
        m = self.m
        if sum(self.cap[t] * c for t, c in mx) < self.need:
            return math.inf
        if len(mx) == 1 and mx[0][1] == 1:
            return m * self.whole[mx[0][0]]  # one GPU: exactly its whole model m times
        fastest = np.min([self.per_layer[t] for t, _ in mx], axis=0)
        work = float(fastest.sum())
        spread = (m - 1) * max(float(fastest.max()), work / sum(c for _, c in mx)) + work
        # the fleet bound's G over the types' effective whole-model times (valid for any profile)
        g = worker_time_bound_s([self.eff[t] for t, c in mx for _ in range(c)], m, True, float(fastest.max()))
        return max(spread, g)

    def largest_layer_s(self, mx: Mix) -> float:
        """The slowest layer on its fastest type of the mix: a floor on any pace."""
        return float(np.max(np.min([self.per_layer[t] for t, _ in mx], axis=0)))

    def lp_floor(self, mx: Mix) -> float:
        """Step 1: the LP of :func:`pipeline_floor_s` for the mix, its least pace the slowest layer
        (computed once per mix)."""
        if mx not in self._lp:
            self._lp[mx] = self.lp_floor_at(mx, self.largest_layer_s(mx))
        return self._lp[mx]

    def lp_floor_at(self, mx: Mix, least_pace_s: float) -> float:
        """The LP of :func:`pipeline_floor_s` for the mix with the least pace given."""
        return pipeline_floor_s(self.per_layer, dict(mx), self.m, least_pace_s)


class _Tails:
    """What a worker pays after its pipeline, among ``K`` workers: the all-reduce floor ``F_K``
    (exactly, and as a curve over byte counts), stage 0's tail, and each template's
    :class:`~solvers.cluster.bounds.tail.TailTable` (built on demand, kept)."""

    def __init__(self, cost: CostModel, devices: Sequence[Device], classes: Sequence[NodeClass], schedule: Schedule,
                 affine: bool, mix: Callable[[Template], Mix]):
        self.cost, self.devices, self.classes = cost, devices, classes
        self.schedule, self.affine, self.mix = schedule, affine, mix
        self.pools: dict[str, dict[str, list[Device]]] = {}
        for d in devices:
            self.pools.setdefault(d.node, {}).setdefault(d.kind, []).append(d)
        self._floors: dict[tuple[int, float], float] = {}
        self._curves: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.tables: dict[tuple[Template, int], TailTable | None] = {}

    def devices_of(self, tp: Template) -> list[Device]:
        """One worker of template ``tp``, on the first nodes of each class."""
        return realise(tp, self.classes, self.pools)

    def floor_s(self, members: int, nbytes: float) -> float:
        """``F_K`` of ``nbytes`` (0 without an affine all-reduce)."""
        key = (members, nbytes)
        if key not in self._floors:
            self._floors[key] = allreduce_floor(self.cost, self.devices, members, nbytes) if self.affine else 0.0
        return self._floors[key]

    def floor_curve_s(self, members: int, nbytes: np.ndarray) -> np.ndarray:
        """``F_K`` for an array of byte counts, interpolated below a grid of exact values (a
        chord lies below a concave function: still a floor)."""
        cost = self.cost
        if members not in self._curves:
            top = cost.param_bytes(0, cost.num_layers)
            sizes = np.diff(cost.param_prefix)
            low = max(float(sizes[sizes > 0].min()) if (sizes > 0).any() else top, top * 1e-9)
            grid = np.unique(np.concatenate([[0.0], np.geomspace(low, top, CURVE_POINTS)]))
            self._curves[members] = grid, np.array([self.floor_s(members, float(x)) if x > 0 else 0.0 for x in grid])
        grid, vals = self._curves[members]
        return np.interp(np.minimum(nbytes, grid[-1]), grid, vals)

    def table(self, tp: Template, k: int) -> TailTable | None:
        """The template's :class:`~solvers.cluster.bounds.tail.TailTable` among ``k`` workers (None:
        too many orders and splits, or no floor to charge)."""
        if (tp, k) not in self.tables:
            self.tables[tp, k] = (worker_tail_table(self.cost, self.devices_of(tp), self.schedule,
                                                    lambda x: self.floor_curve_s(k, x), TABLE_LIMIT)
                                  if self.affine else None)
        return self.tables[tp, k]

    def stage0_s(self, tp: Template, k: int) -> float:
        """What stage 0's device pays after the pipeline: its all-reduces and its step."""
        cost, mx = self.cost, self.mix(tp)
        if len(mx) == 1 and mx[0][1] == 1:
            return self.floor_s(k, cost.param_bytes(0, cost.num_layers)) + cost.update_s(mx[0][0], 0, cost.num_layers)
        return self.floor_s(k, cost.param_bytes(0, 1)) + min(cost.update_s(t, 0, 1) for t, _ in mx)


class _Search:
    """The search over ``K`` (see the module docstring): templates refined lazily, groupings that
    could beat the plan priced, the common-cut floor where ``K`` workers of settled bounds fit."""

    def __init__(self, floors: _MixFloors, tails: _Tails, classes: Sequence[NodeClass], listed: list[Template],
                 exact_limit: int, deadline: float | None, price: Callable[[list[list[Device]]], float] | None,
                 beat_samples_per_s: float):
        self.floors, self.tails, self.classes = floors, tails, classes
        self.exact_limit, self.deadline, self.price = exact_limit, deadline, price
        cost = tails.cost
        self.samples = floors.m * cost.profile.micro_batch_size
        keys = sorted({(ci, t) for ci, cls in enumerate(classes) for t, _ in cls.gpus})
        self.supply = [sum(c * len(cls.nodes) for ci2, cls in enumerate(classes) for t2, c in cls.gpus
                           if (ci2, t2) == key) for key in keys]
        mix = floors.mix
        cheap = {mx: floors.cheap_floor(mx) for mx in {mix(tp) for tp in listed}}
        self.templates = [tp for tp in listed if math.isfinite(cheap[mix(tp)])]
        self.usage = {tp: [template_usage(tp).get(key, 0) for key in keys] for tp in self.templates}
        self.pipeline = {tp: cheap[mix(tp)] for tp in self.templates}  # P(S), raised as templates are refined
        # refinement steps done (2: nothing more to learn)
        self.step = {tp: 2 if sum(c for _, c in mix(tp)) == 1 else 0 for tp in self.templates}
        self.best_value = beat_samples_per_s
        self.best_grouping: list[list[Device]] | None = None
        self.result_k, self.bound = 0, 0.0
        self.priced: set[tuple[tuple[Template, int], ...]] = set()

    def bound_k(self, k: int) -> None:
        """The plans of ``k`` workers: refine the templates that could beat the plan, price what
        fits, and where ``k`` workers of settled bounds still fit, the common-cut floor bounds them."""
        tails = {tp: self.tails.stage0_s(tp, k) for tp in self.templates}
        pipeline = self.pipeline
        while True:
            _check_deadline(self.deadline)
            target = k * self.samples / self.best_value * (1 - 1e-9)  # the iteration K workers must beat
            rated = sorted((tp for tp in self.templates if pipeline[tp] + tails[tp] < target),
                           key=lambda tp: pipeline[tp] + tails[tp])
            chosen = _first_fit(rated, self.usage, self.supply, k)
            if chosen is None:
                return  # K workers cannot beat the plan
            # refine lazily: the mixes' LPs for every template as fast as the ones chosen, then
            # the exhaustive mapping search of the chosen ones
            slowest_chosen = max(pipeline[tp] + tails[tp] for tp in chosen)
            coarse = [tp for tp in rated if self.step[tp] == 0 and pipeline[tp] + tails[tp] <= slowest_chosen]
            loose = [tp for tp in chosen if self.step[tp] < 2]
            for tp in coarse or loose:
                self.refine(tp)
            if coarse or loose:
                continue
            # K workers of settled bounds fit: price them if we can, else this K bounds the gap
            if self.better(k, chosen):
                continue
            # every stage's all-reduce, and the chain of all-reduces up to the first common cut
            least_s, fit = self.common_cut_floor_s(k, target, rated, {tp: pipeline[tp] + tails[tp] for tp in rated})
            if fit is None:
                log.debug("K = %d: no common cut lets %d workers beat %.6g samples/s", k, k, self.best_value)
                return
            if self.better(k, fit):  # the workers that could come closest: priced as a plan too
                continue
            value = k * self.samples / least_s
            log.debug("K = %d: workers fit at %.6g s, %.6g samples/s against %.6g", k, least_s, value, self.best_value)
            if value > self.bound:
                self.bound, self.result_k = value, k
            return

    def refine(self, tp: Template) -> None:
        """One step further: the mix's LP, then the template's exhaustive mapping search."""
        floors, tails, mx = self.floors, self.tails, self.floors.mix(tp)
        if self.step[tp] == 0:
            self.step[tp] = 1
            self.pipeline[tp] = max(self.pipeline[tp], floors.lp_floor(mx))
            return
        self.step[tp] = 2
        devs = tails.devices_of(tp)
        exact = exact_pipeline_floor_s(tails.cost, devs, tails.schedule, self.exact_limit)
        if exact is not None:
            self.pipeline[tp] = max(self.pipeline[tp], exact)
            return
        if num_label_orders(device_labels(tails.cost, devs)) > self.exact_limit:
            return  # no exhaustive search for so many orders: the mix's floor stands
        res = map_worker(tails.cost, devs, tails.schedule, exact_limit=self.exact_limit,
                         deadline=self.deadline)
        if not res.exact:
            return
        if res.solution is None:
            self.pipeline[tp] = math.inf  # nothing fits these GPUs
            return
        low = max(res.solution.bottleneck_s, floors.largest_layer_s(mx))
        self.pipeline[tp] = max(self.pipeline[tp], floors.lp_floor_at(mx, low))

    def common_cut_floor_s(self, k: int, target: float, rated: Sequence[Template],
                           base: dict[Template, float]) -> tuple[float, dict[Template, int] | None]:
        """The least iteration ``k`` workers of ``rated`` could have: for each layer ``c`` where
        the plan's workers all have a stage boundary first (``L``: none has), every worker is at
        least its :attr:`TailTable.by_common_cut_s` there; the least over ``c`` of the slowest of
        the first ``k`` that fit, and those ``k``. Tables are built for the templates of those
        ``k`` only. Raises :class:`_PastDeadline` past the deadline."""
        rated = list(rated)
        base_s = np.array([base[tp] for tp in rated])
        least, where = math.inf, None
        failed: list[np.ndarray] = []
        n_layers = self.tails.cost.num_layers
        idx, by_cut = self._tabled(rated, k)
        for c in range(n_layers, 0, -1):
            _check_deadline(self.deadline)
            while True:
                vals = base_s.copy()
                vals[idx] = np.maximum(vals[idx], by_cut[:, c])
                # only workers faster than the least found so far can lower it; whether k of them fit
                # depends on the set alone, so a subset of a set that did not fit is skipped
                can = vals < min(target, least)
                if any(not (can & ~f).any() for f in failed):
                    fit = None
                    break
                order = [i for i in np.argsort(vals, kind="stable") if can[i]]
                fit = _first_fit([rated[i] for i in order], self.usage, self.supply, k)
                if fit is None:
                    failed.append(can)
                todo = [tp for tp in fit or () if (tp, k) not in self.tails.tables]
                if not todo:
                    break
                for tp in todo:
                    _check_deadline(self.deadline)
                    self.tails.table(tp, k)
                idx, by_cut = self._tabled(rated, k)
            if fit is not None:
                least, where = max(float(vals[i]) for i in order if rated[i] in fit), fit
        return least, where

    def _tabled(self, rated: list[Template], k: int) -> tuple[np.ndarray, np.ndarray]:
        """The rated templates with a table among ``k`` (their indices) and their tables' values by cut."""
        n_layers = self.tails.cost.num_layers
        have = [(i, tab) for i, tp in enumerate(rated) if (tab := self.tails.tables.get((tp, k))) is not None]
        return (np.array([i for i, _ in have], dtype=np.int64),
                np.array([tab.by_common_cut_s for _, tab in have]).reshape(len(have), n_layers + 1))

    def better(self, k: int, chosen: dict[Template, int]) -> bool:
        """Price ``chosen`` as a plan (once); whether it beats the plan to beat (it then becomes it)."""
        key = tuple(sorted(chosen.items()))
        if self.price is None or key in self.priced:
            return False
        self.priced.add(key)
        grouping = _pack(chosen, self.classes, self.tails.pools)
        if grouping is None:
            return False
        value = self.price(grouping)
        log.debug("K = %d: priced %s at %.6g", k, chosen, value)
        if value <= self.best_value * (1 + 1e-9):
            return False
        log.debug("K = %d: a better grouping, %.6g samples/s", k, value)
        self.best_value, self.best_grouping = value, grouping
        return True

    def _refined(self) -> int:
        return sum(v == 2 for v in self.step.values())

    def gave_up(self, fallback_samples_per_s: float) -> SyncBound:
        """Past the deadline: the fallback, with a better grouping found so far."""
        found: dict[str, Any] = {"grouping": self.best_grouping, "samples_per_s": self.best_value} if self.best_grouping else {}
        return SyncBound(fallback_samples_per_s, 0, len(self.templates), self._refined(), self.tails.affine, False,
                         found)

    def result(self) -> SyncBound:
        """The bound: the largest over ``K``, or the best plan's value where no ``K`` beats it."""
        details: dict[str, Any] = {}
        if self.best_grouping is not None:
            details.update({"grouping": self.best_grouping, "samples_per_s": self.best_value})
        return SyncBound(max(self.bound, self.best_value), self.result_k, len(self.templates), self._refined(),
                         self.tails.affine, True, details)


def _first_fit(rated: Sequence[Template], usage: dict[Template, list[int]], supply: Sequence[int],
               k: int) -> dict[Template, int] | None:
    """``k`` workers of the first templates of ``rated`` (in this order, repeats allowed, GPUs may
    stay idle) that fit the supply, taken as soon as the last one's arrival lets them fit;
    ``None`` if they never do. Workers come from the templates at or before that one only."""
    if not rated:
        return None
    # a template using the same GPUs as one before it adds no reachable state: left out
    seen: set[tuple[int, ...]] = set()
    rated = [tp for tp in rated if not (tuple(usage[tp]) in seen or seen.add(tuple(usage[tp])))]  # type: ignore[func-returns-value]
    tables = [np.zeros((*[s + 1 for s in supply], k + 1), bool)]
    tables[0][(0,) * tables[0].ndim] = True
    last = None
    for i, tp in enumerate(rated):
        tables.append(add_template(tables[-1], usage[tp]))
        if tables[-1][..., k].any():
            last = i
            break
    if last is None:
        return None
    # walk back: template i is used at (state, workers) unless that cell was reachable without it
    state = tuple(int(x) for x in np.argwhere(tables[-1][..., k])[0])
    workers, i = k, last
    out: dict[Template, int] = {}
    while workers > 0:
        if tables[i][tuple([*state, workers])]:
            i -= 1  # reachable before template i: it is not needed here
            continue
        tp = rated[i]
        out[tp] = out.get(tp, 0) + 1
        state = tuple(a - u for a, u in zip(state, usage[tp], strict=True))
        workers -= 1
    return out
