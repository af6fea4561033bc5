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
from partitioner.cost import CostModel, activations_in_flight
from partitioner.schedule import spec
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


@dataclass(frozen=True)
class SyncBound:
    """An upper bound on the ``sync`` samples/s of any plan without replicated stages."""

    samples_per_s: float
    workers: int  # the K at which the bound is reached (0: no K beats the plan it was asked about)
    templates: int  # worker templates considered
    refined: int  # templates whose pipeline bound came from an exhaustive mapping search
    allreduce_floor: bool  # whether the all-reduce term applies (links affine, no overrides)
    complete: bool  # False: stopped by the time limit; samples_per_s is then the fallback given
    details: dict[str, Any] = field(default_factory=dict)

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


def exact_pipeline_floor_s(cost: CostModel, devices: Sequence[Device], schedule: str, micro_batches: int,
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
    sp = spec(schedule)
    if not sp.flushes or sp.all_forwards_first:
        return None
    devices = list(devices)
    labels = device_labels(cost, devices)
    if not devices or num_label_orders(labels) > exact_limit:
        return None
    pools: dict[tuple[str, str], list[Device]] = {}
    for lab, d in zip(labels, devices, strict=True):
        pools.setdefault(lab, []).append(d)
    m, n_layers = micro_batches, cost.num_layers
    upper = np.triu(np.ones((n_layers + 1, n_layers + 1), bool), 1)
    best = math.inf
    for order in label_orders(labels):
        devs = realise_order(order, pools)
        q = len(devs)
        times, fills = [], []
        for k, d in enumerate(devs):
            prev = devs[k - 1] if k else None
            nxt = devs[k + 1] if k + 1 < q else None
            ok = upper & (cost.memory_matrix(activations_in_flight(schedule, q - k, m), schedule) <= d.memory_bytes)
            t = cost.pipeline_stage_time_matrix(d, prev, nxt, schedule, m)
            f = (cost.compute_matrix(d.gpu_type) + cost.boundary_vector_s(d, prev)[:, None]
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


def sync_bound(cost: CostModel, devices: Sequence[Device], classes: Sequence[NodeClass], schedule: str,
               micro_batches: int, beat_samples_per_s: float, *, exact_limit: int = 720,
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
    if not spec(schedule).flushes or spec(schedule).sync != "allreduce":
        raise ValueError(f"sync_bound: schedule {schedule} is not a flushing all-reduce schedule")
    m, b = micro_batches, cost.profile.micro_batch_size
    samples = m * b
    n_layers = cost.num_layers
    n = len(devices)
    types = sorted({d.gpu_type for d in devices})
    whole = {t: cost.compute_s(t, 0, n_layers) for t in types}
    per_layer = {t: cost.layer_compute_s(t) for t in types}
    reserved = cost.options.reserved_bytes
    cap = {t: next(d for d in devices if d.gpu_type == t).memory_bytes - reserved for t in types}
    need = worker_memory_bytes(cost, schedule)
    affine = cost.options.sync and _affine_links(cost, devices)  # no all-reduce priced: no floor
    biggest = min(n, n_layers, max_worker_gpus or n)
    listed = complete_templates(classes, biggest)
    if listed is None:  # too many templates to list: no bound from here
        return SyncBound(fallback_samples_per_s, 0, 0, 0, affine, False, {"reason": "too many worker templates"})
    pools: dict[str, dict[str, list[Device]]] = {}
    for d in devices:
        pools.setdefault(d.node, {}).setdefault(d.gpu_type, []).append(d)
    keys = sorted({(ci, t) for ci, cls in enumerate(classes) for t, _ in cls.gpus})
    supply = [sum(c * len(cls.nodes) for ci2, cls in enumerate(classes) for t2, c in cls.gpus
                  if (ci2, t2) == key) for key in keys]

    mixes: dict[Template, tuple[tuple[str, int], ...]] = {}

    def mix(tp: Template) -> tuple[tuple[str, int], ...]:
        if tp not in mixes:
            out: dict[str, int] = {}
            for _, vec in tp:
                for t, c in vec:
                    out[t] = out.get(t, 0) + c
            mixes[tp] = tuple(sorted(out.items()))
        return mixes[tp]

    eff = effective_whole_s(cost, types)

    def cheap_floor(mx: tuple[tuple[str, int], ...]) -> float:
        """Step 0: memory, then every layer once on its fastest type of the mix, the pace at
        least the slowest such layer and the average stage (no LP)."""
        if sum(cap[t] * c for t, c in mx) < need:
            return math.inf
        if len(mx) == 1 and mx[0][1] == 1:
            return m * whole[mx[0][0]]  # one GPU: exactly its whole model m times
        fastest = np.min([per_layer[t] for t, _ in mx], axis=0)
        work = float(fastest.sum())
        spread = (m - 1) * max(float(fastest.max()), work / sum(c for _, c in mx)) + work
        # the fleet bound's G over the types' effective whole-model times (valid for any profile)
        g = worker_time_bound_s([eff[t] for t, c in mx for _ in range(c)], m, True, float(fastest.max()))
        return max(spread, g)

    by_mix: dict[tuple[tuple[str, int], ...], float] = {}

    def largest_layer_s(mx: tuple[tuple[str, int], ...]) -> float:
        """The slowest layer on its fastest type of the mix: a floor on any pace."""
        return float(np.max(np.min([per_layer[t] for t, _ in mx], axis=0)))

    def mix_floor(mx: tuple[tuple[str, int], ...]) -> float:
        """Step 1: the LP of :func:`pipeline_floor_s` for the mix (computed once per mix)."""
        if mx not in by_mix:
            counts = dict(mx)
            low = largest_layer_s(mx)
            by_mix[mx] = pipeline_floor_s(per_layer, counts, m, low)
        return by_mix[mx]

    cheap = {mx: cheap_floor(mx) for mx in {mix(tp) for tp in listed}}
    templates = [tp for tp in listed if math.isfinite(cheap[mix(tp)])]
    usage = {tp: [template_usage(tp).get(key, 0) for key in keys] for tp in templates}
    pipeline = {tp: cheap[mix(tp)] for tp in templates}  # P(S), raised as templates are refined
    step = {tp: 2 if sum(c for _, c in mix(tp)) == 1 else 0 for tp in templates}  # 2: nothing more to learn
    floor_cache: dict[tuple[int, float], float] = {}

    def floor_s(members: int, nbytes: float) -> float:
        key = (members, nbytes)
        if key not in floor_cache:
            floor_cache[key] = allreduce_floor(cost, devices, members, nbytes) if affine else 0.0
        return floor_cache[key]

    curves: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def floor_curve_s(members: int, nbytes: np.ndarray) -> np.ndarray:
        """``F_K`` for an array of byte counts, interpolated below a grid of exact values (a
        chord lies below a concave function: still a floor)."""
        if members not in curves:
            top = cost.param_bytes(0, n_layers)
            sizes = np.diff(cost.param_prefix)
            low = max(float(sizes[sizes > 0].min()) if (sizes > 0).any() else top, top * 1e-9)
            grid = np.unique(np.concatenate([[0.0], np.geomspace(low, top, CURVE_POINTS)]))
            curves[members] = grid, np.array([floor_s(members, float(x)) if x > 0 else 0.0 for x in grid])
        grid, vals = curves[members]
        return np.interp(np.minimum(nbytes, grid[-1]), grid, vals)

    tables: dict[tuple[Template, int], TailTable | None] = {}

    def table(tp: Template, k: int) -> TailTable | None:
        """The template's :class:`~solvers.cluster.bounds.tail.TailTable` among ``k`` workers (None: too many
        orders and splits, or no floor to charge)."""
        if (tp, k) not in tables:
            tables[tp, k] = (worker_tail_table(cost, realise(tp, classes, pools), schedule, m,
                                               lambda x: floor_curve_s(k, x), TABLE_LIMIT) if affine else None)
        return tables[tp, k]

    def tail_s(tp: Template, k: int) -> float:
        """What stage 0's device pays after the pipeline: its all-reduces and its step."""
        mx = mix(tp)
        if len(mx) == 1 and mx[0][1] == 1:
            return floor_s(k, cost.param_bytes(0, n_layers)) + cost.update_s(mx[0][0], 0, n_layers)
        return floor_s(k, cost.param_bytes(0, 1)) + min(cost.update_s(t, 0, 1) for t, _ in mx)

    def refine(tp: Template) -> None:
        """One step further: the mix's LP, then the template's exhaustive mapping search."""
        if step[tp] == 0:
            step[tp] = 1
            pipeline[tp] = max(pipeline[tp], mix_floor(mix(tp)))
            return
        step[tp] = 2
        devs = realise(tp, classes, pools)
        exact = exact_pipeline_floor_s(cost, devs, schedule, m, exact_limit)
        if exact is not None:
            pipeline[tp] = max(pipeline[tp], exact)
            return
        if num_label_orders(device_labels(cost, devs)) > exact_limit:
            return  # no exhaustive search for so many orders: the mix's floor stands
        res = map_worker(cost, devs, schedule, m, exact_limit=exact_limit, deadline=deadline)
        if not res.exact:
            return
        if res.solution is None:
            pipeline[tp] = math.inf  # nothing fits these GPUs
            return
        counts = dict(mix(tp))
        low = max(res.solution.bottleneck_s, largest_layer_s(mix(tp)))
        pipeline[tp] = max(pipeline[tp], pipeline_floor_s(per_layer, counts, m, low))

    def common_cut_floor_s(k: int, target: float, rated: Sequence[Template],
                           base: dict[Template, float]) -> tuple[float, dict[Template, int] | None] | None:
        """The least iteration ``k`` workers of ``rated`` could have: for each layer ``c`` where
        the plan's workers all have a stage boundary first (``L``: none has), every worker is at
        least its :attr:`TailTable.by_common_cut_s` there; the least over ``c`` of the slowest of
        the first ``k`` that fit, and those ``k``. Tables are built for the templates of those
        ``k`` only. ``None`` past the deadline."""
        rated = list(rated)
        base_s = np.array([base[tp] for tp in rated])
        least, where = math.inf, None
        failed: list[np.ndarray] = []

        def tabled() -> tuple[np.ndarray, np.ndarray]:
            """The rated templates with a table (their indices) and their tables' values by cut."""
            have = [(i, tab) for i, tp in enumerate(rated) if (tab := tables.get((tp, k))) is not None]
            return (np.array([i for i, _ in have], dtype=np.int64),
                    np.array([tab.by_common_cut_s for _, tab in have]).reshape(len(have), n_layers + 1))

        idx, by_cut = tabled()
        for c in range(n_layers, 0, -1):
            if deadline is not None and time.perf_counter() > deadline:
                return None
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
                fit = _first_fit([rated[i] for i in order], usage, supply, k)
                if fit is None:
                    failed.append(can)
                todo = [tp for tp in fit or () if (tp, k) not in tables]
                if not todo:
                    break
                for tp in todo:
                    if deadline is not None and time.perf_counter() > deadline:
                        return None
                    table(tp, k)
                idx, by_cut = tabled()
            if fit is not None:
                least, where = max(float(vals[i]) for i in order if rated[i] in fit), fit
        return least, where

    best_value, best_grouping = beat_samples_per_s, None
    result_k, bound = 0, 0.0
    priced: set[tuple[tuple[Template, int], ...]] = set()

    def gave_up() -> SyncBound:
        """Past the deadline: the fallback, with a better grouping found so far."""
        return SyncBound(fallback_samples_per_s, 0, len(templates), sum(v == 2 for v in step.values()), affine, False,
                         {"grouping": best_grouping, "samples_per_s": best_value} if best_grouping else {})

    def better(k: int, chosen: dict[Template, int]) -> bool:
        """Price ``chosen`` as a plan (once); whether it beats the plan to beat (it then becomes it)."""
        nonlocal best_value, best_grouping
        key = tuple(sorted(chosen.items()))
        if price is None or key in priced:
            return False
        priced.add(key)
        grouping = _pack(chosen, classes, pools)
        if grouping is None:
            return False
        value = price(grouping)
        log.debug("K = %d: priced %s at %.6g", k, chosen, value)
        if value <= best_value * (1 + 1e-9):
            return False
        log.debug("K = %d: a better grouping, %.6g samples/s", k, value)
        best_value, best_grouping = value, grouping
        return True

    for k in range(1, n + 1) if workers is None else [workers]:
        tails = {tp: tail_s(tp, k) for tp in templates}
        while True:
            if deadline is not None and time.perf_counter() > deadline:
                return gave_up()
            target = k * samples / best_value * (1 - 1e-9)  # the iteration K workers must beat
            rated = sorted((tp for tp in templates if pipeline[tp] + tails[tp] < target),
                           key=lambda tp: pipeline[tp] + tails[tp])
            chosen = _first_fit(rated, usage, supply, k)
            if chosen is None:
                break  # K workers cannot beat the plan
            # refine lazily: the mixes' LPs for every template as fast as the ones chosen, then
            # the exhaustive mapping search of the chosen ones
            slowest_chosen = max(pipeline[tp] + tails[tp] for tp in chosen)
            coarse = [tp for tp in rated if step[tp] == 0 and pipeline[tp] + tails[tp] <= slowest_chosen]
            loose = [tp for tp in chosen if step[tp] < 2]
            for tp in coarse or loose:
                refine(tp)
            if coarse or loose:
                continue
            # K workers of settled bounds fit: price them if we can, else this K bounds the gap
            if better(k, chosen):
                continue
            # every stage's all-reduce, and the chain of all-reduces up to the first common cut
            by_cut = common_cut_floor_s(k, target, rated, {tp: pipeline[tp] + tails[tp] for tp in rated})
            if by_cut is None:
                return gave_up()
            least_s, fit = by_cut
            if fit is None:
                log.debug("K = %d: no common cut lets %d workers beat %.6g samples/s", k, k, best_value)
                break
            if better(k, fit):  # the workers that could come closest: priced as a plan too
                continue
            value = k * samples / least_s
            log.debug("K = %d: workers fit at %.6g s, %.6g samples/s against %.6g", k, least_s, value, best_value)
            if value > bound:
                bound, result_k = value, k
            break
    refined = sum(v == 2 for v in step.values())
    details: dict[str, Any] = {}
    if best_grouping is not None:
        details.update(grouping=best_grouping, samples_per_s=best_value)
    return SyncBound(max(bound, best_value), result_k, len(templates), refined, affine, True, details)


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
