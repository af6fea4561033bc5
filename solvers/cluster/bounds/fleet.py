"""Upper bounds on the throughput of any plan of a cluster, from the cost model's own terms.

The old certificate, ``micro_batch_size * sum_d 1 / T_d`` (``T_d``: the whole model's compute
on GPU ``d``, forward and backward, per micro-batch), assumes perfect speed-up: no pipeline
fill, and every GPU a worker of its own whether or not the model fits on it. This module
prices what every plan must pay.

**One virtual worker.** Let worker ``S`` run ``m`` micro-batches under a flushing one-chunk
schedule (1F1B, GPipe) without replication. Stage ``k`` (layers ``w_k`` of the model's work,
on a GPU of whole-model time ``T_k``) computes ``c_k = w_k T_k`` per micro-batch. The closed
form (:meth:`partitioner.cost.CostModel.worker_iteration_s`) is ``fill + (m - 1) pace`` with
``fill >= sum_k c_k`` (the first micro-batch crosses every stage forward and back, transfers
only add) and ``pace >= max_k c_k`` (a stage's steady time includes its compute; GPipe's
``max t_f + max t_b >= max (t_f + t_b)``). For a pace ``P`` every stage has ``w_k <= P / T_k``
and ``sum_k w_k = 1``, so the least fill is the greedy one that gives the fastest GPUs full
shares: a convex, piecewise-linear function of ``P`` whose breakpoints are ``P = 1 / S_q``,
``S_q`` the summed speed ``sum 1 / T`` of the ``q`` fastest GPUs of ``S``, where the fill is
``q P``. Hence

    iteration(S) >= G(S) = min_q (m - 1 + q) / S_q          (q = 1 .. |S|)

(and ``>= (m - 1) l + T_1`` with ``l`` the largest layer on the fastest type, the pace's other
floor). A homogeneous worker of ``p`` GPUs gets ``(m - 1 + p) T / p``: the familiar bubble.
Without a flush (2BW, WSP) the iteration is ``m * pace >= m / S_|S|``; with replication the
fill of a replicated stage is scaled by its share, so only ``m / S_|S|`` is kept as well (and
not the largest layer's floor: replicas of a stage share its micro-batches).
The worker must also hold the model: every stage's memory is its weights plus at least one
micro-batch of activations plus the reserve, and the stages' weights and activations add up
to at least the whole model's (``cost.weight_bytes(0, L) + cost.activation_bytes(0, L)``;
cutting a layer's shared input only duplicates it), so ``sum_{d in S} (mem_d - reserved) >= M``.

**The cluster.** A plan's workers have ``iteration_w >= G(S_w)``; under ``sync`` the plan's
rate is at most ``K m b / max_w iteration_w`` (the all-reduce and the step only add); so it is
under ``wsp``, whose staleness bound holds every worker to the slowest's pace in the long run
(:func:`solvers.cluster.grouping.combine`). Relax each worker to its *core*, the ``q_w``
fastest GPUs at which ``G`` is reached (``S_q >= (m - 1 + q) / B`` when ``G(S) <= B``), and its
memory, and let GPUs be shared fractionally: a linear program over ``K_q`` (workers whose core
has ``q`` GPUs), ``y_qt`` (their core GPUs of type ``t``) and ``z_qt`` (all their GPUs of type
``t``), with ``sum_q z_qt <= N_t``. Every plan is a feasible point, so

for an iteration ``B``, ``K <= K_LP(B)``; the bound is ``max_B floor(K_LP(B)) m b / B``, taken
over intervals ``[B_i, B_i+1]`` as ``floor(K_LP(B_i+1)) m b / B_i`` (``K_LP`` grows with ``B``)
and refined where it could exceed the best point value.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from partitioner.cluster import Device
from partitioner.cost import CostModel
from partitioner.schedule import Schedule

__all__ = ["FleetBound", "effective_whole_s", "fleet_bound", "largest_layer_s", "type_counts", "worker_memory_bytes", "worker_time_bound_s"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FleetBound:
    """An upper bound on the samples/s of any plan, with the parts it is made of."""

    samples_per_s: float
    perfect_speedup: float  # micro_batch_size * sum_d 1 / T_d, the old certificate
    memory_bytes_per_worker: float  # M: what every worker's GPUs must hold between them
    pipeline_fill: bool  # whether the fill term applies (flushing schedule, no replication)
    workers: float  # the K at which the bound is reached

    def __post_init__(self) -> None:
        if not (self.samples_per_s >= 0 and self.perfect_speedup >= 0):
            raise ValueError(f"FleetBound: negative rate {self.samples_per_s}, {self.perfect_speedup}")


def effective_whole_s(cost: CostModel, types: Sequence[str]) -> dict[str, float]:
    """Whole-model seconds per type that the bounds may treat as proportional speeds.

    The bounds spread "the model's work" over GPUs as if every layer ran ``T_t / T_r`` times
    slower on type ``t`` than on ``r``. Profiles do not promise that (a projected profile scales
    compute-bound and memory-bound layers differently), so each type is taken at its best
    per-layer ratio to a reference type ``r``: ``T'_t = W_r min_l c_t(l) / c_r(l)`` (``W_r`` the
    whole model on ``r``). A stage holding reference work ``w`` then computes at least
    ``T'_t w / W_r`` on type ``t``, which is all the bounds use, so they hold for any profile. The
    reference kept is the one that loses least (the largest ``min_t T'_t / T_t``); where the
    ratios are one number, ``T'_t = T_t``."""
    whole = {t: cost.compute_s(t, 0, cost.num_layers) for t in types}
    if len(types) < 2:
        return whole
    per = {t: cost.layer_compute_s(t) for t in types}
    best: dict[str, float] | None = None
    best_keep = -1.0
    for r in types:
        held = per[r] > 0
        if not held.any():
            continue
        w_r = float(per[r].sum())
        eff = {t: min(whole[t], w_r * float(np.min(per[t][held] / per[r][held]))) for t in types}
        keep = min(eff[t] / whole[t] if whole[t] > 0 else 1.0 for t in types)
        if keep > best_keep:
            best, best_keep = eff, keep
    return best if best is not None else {t: 0.0 for t in types}


def _whole_s(cost: CostModel, types: Sequence[str]) -> dict[str, float]:
    return effective_whole_s(cost, types)


def largest_layer_s(cost: CostModel, types: Sequence[str]) -> float:
    """The slowest layer on the fastest of ``types`` for it (a floor on any pace)."""
    per = np.stack([cost.layer_compute_s(t) for t in types])
    return float(per.min(axis=0).max())


def worker_memory_bytes(cost: CostModel, schedule: Schedule) -> float:
    """``M``: the weights (with the schedule's versions) and one micro-batch's activations of the model
    (the least any memory lever the options allow leaves: :meth:`CostModel.least_stage_bytes`)."""

    return cost.least_stage_bytes(0, cost.num_layers, schedule.weight_versions)


def worker_time_bound_s(times_s: Sequence[float], micro_batches: int, fill: bool = True,
                        largest_layer_s: float = 0.0, wave_s: float = 0.0) -> float:
    """``G``: no virtual worker whose GPUs have these whole-model times iterates faster
    (see the module docstring). ``fill`` False: no flush, or replication (``m / S``).

    ``wave_s`` (no flush): WSP's per-micro-batch push and pull of the whole model, ``V``. Every
    stage's time adds its own share ``v_k`` (``sum v_k = V``), so a pace ``P`` lets stage ``k``
    compute ``(P - v_k) / T_k`` of the model and ``P S >= 1 + sum v_k / T_k >= 1 + V / T_max``;
    also ``P >= V / p`` (the largest share)."""
    ts = sorted(t for t in times_s)
    if not ts:
        return math.inf
    m = micro_batches
    if any(t <= 0 for t in ts):
        return (m - 1) * largest_layer_s if fill else m * largest_layer_s
    speeds = np.cumsum([1.0 / t for t in ts])
    low = max(largest_layer_s, 1.0 / float(speeds[-1]))
    if not fill:
        return m * max(low, (1.0 + wave_s / ts[-1]) / float(speeds[-1]), wave_s / len(ts))
    # h(P) = (m - 1) P + fill(P) is convex with breakpoints at P = 1 / S_q (where fill = q P):
    # its least value over P >= low is at low or at a breakpoint above it
    q = np.arange(1, len(ts) + 1)
    above = 1.0 / speeds >= low
    best = float(np.min((m - 1 + q[above]) / speeds[above])) if above.any() else math.inf
    if low > 1.0 / float(speeds[-1]):  # low is not itself a breakpoint
        best = min(best, (m - 1) * low + _fill_at(ts, low))
    return best


def _fill_at(ts: Sequence[float], pace: float) -> float:
    """The least ``sum_k w_k T_k`` with ``sum w = 1`` and ``w_k <= pace / T_k`` (fastest first;
    ``inf`` when even full shares do not cover the model, up to rounding)."""
    left, fill = 1.0, 0.0
    for t in ts:
        share = min(left, pace / t)
        fill += share * t
        left -= share
        if left <= 1e-12:
            return fill
    return fill if left <= 1e-9 else math.inf


def _compositions(n_types: int, total: int) -> list[tuple[int, ...]]:
    """Every vector of ``n_types`` counts >= 0 summing to ``total``."""
    if n_types == 1:
        return [(total,)]
    return [(a, *rest) for a in range(total, -1, -1) for rest in _compositions(n_types - 1, total - a)]


def _perfect(cost: CostModel, counts: Mapping[str, int], whole: Mapping[str, float]) -> float:
    """Perfect speed-up: micro_batch_size x sum over GPUs of 1 / (the whole model's time there)."""
    return cost.profile.micro_batch_size * sum(n / whole[t] if whole[t] > 0 else math.inf for t, n in counts.items())


class _NoLpAnswer(Exception):
    """The LP solver gave no answer (not a proof of infeasibility): the bound falls back."""


def fleet_bound(cost: CostModel, devices: Sequence[Device], schedule: Schedule,
                **options: Any) -> FleetBound:
    """The bound of the module docstring over ``devices``, under ``sync`` and ``wsp`` alike (options: ``replication``,
    ``virtual_workers`` to fix K, ``small_worker_gpus``, ``max_core``, ``rel_tol``). Should a linear
    program get no answer from the solver, the perfect speed-up (still a valid bound) is returned."""
    try:
        return _fleet_bound(cost, devices, schedule, **options)
    except _NoLpAnswer as why:
        counts = type_counts(devices)
        perfect = _perfect(cost, counts, _whole_s(cost, sorted(counts)))
        log.warning("fleet bound: a linear program got no answer (%s); the bound falls back to the perfect "
                    "speed-up", why)
        return FleetBound(perfect, perfect, worker_memory_bytes(cost, schedule),
                          schedule.spec.flushes and not options.get("replication", False), 0)


def _fleet_bound(cost: CostModel, devices: Sequence[Device], schedule: Schedule,
                 *, replication: bool = False, virtual_workers: int | None = None,
                 small_worker_gpus: int = 4, max_core: int = 16, rel_tol: float = 2e-3) -> FleetBound:
    """The bound of the module docstring over ``devices``; ``virtual_workers`` fixes K.

    Workers of at most ``small_worker_gpus`` GPUs are columns of their exact GPU mix (their
    ``G`` and memory exactly); larger ones are relaxed to a fractional core of ``q`` GPUs and
    fractional other GPUs (at least ``small_worker_gpus + 1`` in all); cores of ``max_core``
    GPUs or more share one column priced as ``max_core`` (a relaxation: more GPUs cost more fill).
    """
    counts = type_counts(devices)
    types = sorted(counts)
    whole = _whole_s(cost, types)
    b, m = cost.profile.micro_batch_size, schedule.micro_batches
    perfect = _perfect(cost, counts, whole)
    fill = schedule.spec.flushes and not replication
    need = worker_memory_bytes(cost, schedule)
    reserved = cost.options.reserved_bytes
    # A GPU that holds the whole worker's memory alone counts as holding exactly that much: any real
    # worker still fits, and memory rows a million times larger than the model (a test's "plenty")
    # no longer make the linear program numerically infeasible.
    cap = {t: min(need, (next(d for d in devices if d.kind == t).memory_bytes - reserved)
                  / cost.shard_memory_ratio(t)) if need > 0 else
           (next(d for d in devices if d.kind == t).memory_bytes - reserved) / cost.shard_memory_ratio(t)
           for t in types}
    if any(whole[t] <= 0 for t in types) or not math.isfinite(perfect):
        return FleetBound(math.inf, perfect, need, fill, 0)
    # the pace's floor, the largest layer once per micro-batch, holds where one device runs a layer
    # for every micro-batch; replicas of a stage share its micro-batches, so not with replication
    ell = 0.0 if replication else largest_layer_s(cost, types)
    if len(types) == 1:
        return _one_type_bound(counts[types[0]], whole[types[0]], cap[types[0]], need, b, m, fill, ell,
                               virtual_workers, perfect)
    small = _small_workers(types, counts, whole, cap, need, m, fill, ell, min(small_worker_gpus, len(devices)))
    lp = _worker_lp(types, counts, whole, cap, need, small, len(devices), virtual_workers, small_worker_gpus,
                    max_core, fill)
    k_lp = partial(_most_workers, lp, m, ell, min(whole.values()))
    k_all = _whole_k(k_lp(math.inf))
    if k_all <= 0:
        return FleetBound(0.0, perfect, need, fill, 0)
    # below lo no worker is possible (n GPUs of the fastest type are the fastest worker)
    lo = worker_time_bound_s([min(whole.values())] * len(devices), m, fill, ell)
    value, ks = _best_iteration(k_lp, k_all, lo, m, b, rel_tol)
    k_at = max(ks, key=lambda x: ks[x] / x)
    log.debug("fleet bound: %d LPs, K = %g", len(ks), ks[k_at])
    return FleetBound(min(perfect, value), perfect, need, fill, ks[k_at])


def _small_workers(types: Sequence[str], counts: Mapping[str, int], whole: Mapping[str, float],
                   cap: Mapping[str, float], need: float, m: int, fill: bool, ell: float, largest: int
                   ) -> list[tuple[np.ndarray, float]]:
    """Every worker of at most ``largest`` GPUs that the cluster has and that holds the model, as
    its GPU counts per type and its ``G``."""
    small: list[tuple[np.ndarray, float]] = []
    for p in range(1, largest + 1):
        for comp in _compositions(len(types), p):
            vec = np.array(comp, dtype=float)
            if np.any(vec > [counts[t] for t in types]):
                continue
            if float(vec @ np.array([cap[t] for t in types])) < need:
                continue
            ts = [whole[t] for t, c in zip(types, comp, strict=True) for _ in range(c)]
            small.append((vec, worker_time_bound_s(ts, m, fill, ell)))
    return small


@dataclass(frozen=True)
class _WorkerLp:
    """The linear program of the module docstring over its columns: ``small`` workers (``K`` of
    each exact mix), then per core size ``q`` in ``qs``: ``K_q``, ``y_qt`` (core GPUs of type
    ``t``), ``z_qt`` (all GPUs of type ``t``). The rows that do not depend on the iteration."""

    small: list[tuple[np.ndarray, float]]  # (GPUs per type, G) of every small worker
    qs: list[int]  # core sizes (0: no fill, the whole worker is its core)
    inv: np.ndarray  # 1 / T_t per type
    rows_ub: list[np.ndarray]
    rhs_ub: list[float]
    rows_eq: list[np.ndarray]
    rhs_eq: list[float]

    @property
    def ns(self) -> int:
        return len(self.small)

    @property
    def nt(self) -> int:
        return len(self.inv)

    @property
    def nv(self) -> int:
        return self.ns + len(self.qs) * (1 + 2 * self.nt)

    def ki(self, i: int) -> int:
        """Column of ``K_q`` for ``q = qs[i]``."""
        return self.ns + i

    def yi(self, i: int, j: int) -> int:
        """Column of ``y_qt``."""
        return self.ns + len(self.qs) + i * self.nt + j

    def zi(self, i: int, j: int) -> int:
        """Column of ``z_qt``."""
        return self.ns + len(self.qs) + len(self.qs) * self.nt + i * self.nt + j

    def solve(self, c: np.ndarray, extra: list[np.ndarray], upper: np.ndarray) -> float | None:
        """``max -c.x`` with ``extra`` rows ``<= 0`` and columns in ``[0, upper]``; None when no
        worker fits (infeasible); raises :class:`_NoLpAnswer` when the solver gives none."""
        from solvers.cluster.lp import linprog

        if self.nv == 0:  # no worker size fits at all: nothing to choose
            return None
        rows_eq = self.rows_eq
        res = linprog(c, np.array(self.rows_ub + extra), np.array(self.rhs_ub + [0.0] * len(extra)),
                      np.array(rows_eq) if rows_eq else None, np.array(self.rhs_eq) if rows_eq else None,
                      list(zip(np.zeros(self.nv), upper, strict=True)))
        if res.status in ("failed", "unbounded"):
            raise _NoLpAnswer(res.status)
        return -res.fun if res.ok else None  # infeasible: no worker fits


def _worker_lp(types: Sequence[str], counts: Mapping[str, int], whole: Mapping[str, float],
               cap: Mapping[str, float], need: float, small: list[tuple[np.ndarray, float]], n: int,
               virtual_workers: int | None, small_worker_gpus: int, max_core: int, fill: bool) -> _WorkerLp:
    """The LP's columns and its fixed rows: supply per type, and per core size the core within
    the worker, the core's size, a large worker's size and its memory; ``K`` fixed if asked."""
    big = n > small_worker_gpus
    qs = (list(range(1, min(max_core, n) + 1)) if fill else [0]) if big else []
    lp = _WorkerLp(small, qs, np.array([1.0 / whole[t] for t in types]), [], [], [], [])
    nv = lp.nv
    for j, t in enumerate(types):  # supply: sum_q z_qt + small workers' GPUs <= N_t
        r = np.zeros(nv)
        r[:lp.ns] = [vec[j] for vec, _ in small]
        r[[lp.zi(i, j) for i in range(len(qs))]] = 1.0
        lp.rows_ub.append(r)
        lp.rhs_ub.append(float(counts[t]))
    mem = np.array([max(0.0, cap[t]) for t in types])
    open_top = bool(qs) and fill and n > max_core  # the last core size stands for every larger one
    for i, q in enumerate(qs):
        _core_rows(lp, i, q, open_top and q == qs[-1], mem, need, small_worker_gpus)
    if virtual_workers is not None:  # sum K = K given
        r = np.zeros(nv)
        r[:lp.ns] = 1.0
        r[[lp.ki(i) for i in range(len(qs))]] = 1.0
        lp.rows_eq.append(r)
        lp.rhs_eq.append(float(virtual_workers))
    return lp


def _core_rows(lp: _WorkerLp, i: int, q: int, open_top: bool, mem: np.ndarray, need: float,
               small_worker_gpus: int) -> None:
    """The rows of core size ``q = qs[i]``: y_qt <= z_qt (y = z without a fill), sum_t y_qt = q K_q
    (>= for the open top), sum_t z_qt >= max(q, small_worker_gpus + 1) K_q, and
    sum_t mem_t z_qt >= M K_q."""
    nv = lp.nv
    yj, zj = [lp.yi(i, j) for j in range(lp.nt)], [lp.zi(i, j) for j in range(lp.nt)]
    for j in range(lp.nt):  # core within the worker (the whole worker without a fill)
        r = np.zeros(nv)
        r[yj[j]], r[zj[j]] = 1.0, -1.0
        (lp.rows_ub if q else lp.rows_eq).append(r)
        (lp.rhs_ub if q else lp.rhs_eq).append(0.0)
    if q:  # core size (at least max_core for the open top)
        r = np.zeros(nv)
        r[yj], r[lp.ki(i)] = 1.0, -q
        if open_top:
            lp.rows_ub.append(-r)
            lp.rhs_ub.append(0.0)
        else:
            lp.rows_eq.append(r)
            lp.rhs_eq.append(0.0)
    r = np.zeros(nv)  # a large worker: more than small_worker_gpus GPUs
    r[zj], r[lp.ki(i)] = -1.0, max(q, small_worker_gpus + 1)
    lp.rows_ub.append(r)
    lp.rhs_ub.append(0.0)
    if need > 0:  # memory, in units of the model's (rows of bytes beside rows of GPU counts scale badly)
        r = np.zeros(nv)
        r[zj], r[lp.ki(i)] = -mem / need, 1.0
        lp.rows_ub.append(r)
        lp.rhs_ub.append(0.0)


def _most_workers(lp: _WorkerLp, m: int, ell: float, fastest_whole_s: float, iteration_s: float) -> float:
    """``K_LP(B)``: most workers (fractionally) whose iteration can be <= ``iteration_s``: small
    workers with ``G <= B``, and large ones whose core is fast enough,
    sum_t y_qt / T_t >= (m - 1 + q) / B * K_q."""
    ns, nq = lp.ns, len(lp.qs)
    upper = np.full(lp.nv, np.inf)
    upper[:ns] = [np.inf if g <= iteration_s else 0.0 for _, g in lp.small]
    extra = []
    for i, q in enumerate(lp.qs):  # core speed: sum_t y_qt / T_t >= (m - 1 + q) / B * K_q
        r = np.zeros(lp.nv)
        r[[lp.yi(i, j) for j in range(lp.nt)]] = -lp.inv
        r[lp.ki(i)] = ((m - 1 + q) if q else m) / iteration_s if math.isfinite(iteration_s) else 0.0
        extra.append(r)
    if (m - 1) * ell + fastest_whole_s > iteration_s:
        upper[ns:ns + nq] = 0.0
    c = np.zeros(lp.nv)
    c[:ns] = -1.0
    c[[lp.ki(i) for i in range(nq)]] = -1.0
    val = lp.solve(c, extra, upper)
    return 0.0 if val is None else val


def _whole_k(x: float) -> float:
    """Whole workers in a fractional count (up to the LP's rounding)."""
    return float(math.floor(x + 1e-6))


def _best_iteration(k_lp: Callable[[float], float], k_all: float, lo: float, m: int, b: int, rel_tol: float
                    ) -> tuple[float, dict[float, float]]:
    """``max_B floor(K_LP(B)) m b / B``, bounded over intervals of ``B`` from
    ``lo`` (no worker below it) up to where all ``k_all`` workers fit, the intervals that could
    beat the best point refined; the value and the ``floor(K_LP)`` found at each ``B``."""
    hi = lo
    while _whole_k(k_lp(hi)) < k_all and hi < lo * 1e6:
        hi *= 2
    # value(B) = floor(K(B)) m b / B; on [a, c] it is at most floor(K(c)) m b / a
    ks = {float(x): _whole_k(k_lp(float(x))) for x in np.geomspace(lo, hi, 9)}
    best_point = max(k * m * b / x for x, k in ks.items())

    def intervals() -> list[tuple[float, float, float]]:
        pts = sorted(ks)
        out = [(ks[c2] * m * b / a, a, c2) for a, c2 in itertools.pairwise(pts)]
        return [*out, (k_all * m * b / pts[-1], pts[-1], math.inf)]

    for _ in range(60):
        todo = sorted((iv for iv in intervals() if iv[0] > best_point * (1 + rel_tol)), reverse=True)
        if not todo:
            break
        for _u, a, c2 in todo[:8]:
            mid = math.sqrt(a * c2)
            ks[mid] = _whole_k(k_lp(mid))
            best_point = max(best_point, ks[mid] * m * b / mid)
    return max(max(iv[0] for iv in intervals()), best_point), ks


def _one_type_bound(n: int, whole_s: float, cap_bytes: float, need_bytes: float, b: int, m: int, fill: bool,
                    ell: float, virtual_workers: int | None, perfect: float) -> FleetBound:
    """The bound for ``n`` GPUs of one type, in closed form (no LP). Every worker needs
    ``p_min = ceil(M / mem)`` GPUs; ``G`` falls as a worker grows, so under ``sync`` K workers
    are at best the most even split (the smallest holds ``floor(n / K)``)."""
    p_min = 1 if need_bytes <= 0 else (math.ceil(need_bytes / cap_bytes) if cap_bytes > 0 else n + 1)
    ks = range(1, n // p_min + 1) if virtual_workers is None else (
        [virtual_workers] if virtual_workers * p_min <= n else [])
    best, at = 0.0, 0
    for k in ks:
        val = k * m * b / worker_time_bound_s([whole_s] * (n // k), m, fill, ell)
        if val > best:
            best, at = val, k
    return FleetBound(min(perfect, best), perfect, need_bytes, fill, float(at))


def type_counts(devices: Sequence[Device]) -> Mapping[str, int]:
    out: dict[str, int] = {}
    for d in devices:
        out[d.kind] = out.get(d.kind, 0) + 1
    return out
