"""A bound that knows each GPU must hold what it computes: memory caps a stage's share of the work.

The fleet bound (:mod:`.fleet`) lets a GPU compute as much of the model as its speed allows and
asks only that a worker's GPUs hold the model between them; the layer bound (:mod:`.layers`)
spreads every layer over the cluster at one pace. Where memory binds (a fast GPU of little
memory holds a quarter of the model), both let the fast GPU do work it cannot hold. This bound
caps each stage by its device's memory and its pace, worker by worker.

**One worker.** Let a virtual worker run ``m`` micro-batches of one-chunk stages without
replication, stage ``k`` on a device of kind ``t_k`` computing ``s_k`` (forward + backward of
its layers, one micro-batch; transfers, the all-reduce and the step left out: they only add).

* *Pace.* The device of stage ``k`` computes ``m s_k`` within the iteration ``T``, so with
  ``P = max_k s_k``, ``T >= m P`` (any schedule).
* *Fill* (1F1B and GPipe). Let ``k*`` have ``s_{k*} = P`` and ``b_k`` the backward part of
  ``s_k``. Micro-batch 1's backward reaches stage ``k*`` no earlier than
  ``sum_{j <= k*} f_j + sum_{j > k*} s_j`` (one chain of dependent computations); stage ``k*``
  then runs ``m`` backwards one after another, and the last of them still crosses stages
  ``k* - 1 .. 0`` backward. So ``T >= W + (m - 1) b_{k*} >= W + (m - 1) beta P`` with
  ``W = sum_k s_k`` and ``beta`` the least ``b / (f + b)`` of any layer on any kind (a stage's
  ratio is at least its layers' least). This holds for every order of the micro-batches, so
  for the simulator's 1F1B too, whose warm-up can beat the closed form's ``W + (m - 1) P``
  (a first stage that is the bottleneck hides the others' first round trip; see the tests).
* *Share and memory.* Measure work in a reference kind ``r`` (the effective whole-model times
  of :func:`.fleet.effective_whole_s`: kind ``t`` computes reference share ``w`` in at least
  ``w T'_t``). Stage ``k`` holds share ``w_k <= s_k / T'_{t_k}`` and its layers' memory, which
  is at least the per-layer least bytes of :mod:`.layers` summed; so ``w_k <= c_t``, the most
  reference share any run of consecutive layers whose least bytes on kind ``t`` fit its memory
  carries. The shares cover
  the model: ``sum_k w_k = 1``; and the stages hold the whole model's memory (the fleet
  bound's ``M``).

*Slices.* Where the first micro-batch may run in ``S`` slices, its first round trip is a
slice's: ``T >= W / S + (m - 1/S) beta P`` (:mod:`.layers`), and the fill row below becomes
``sigma <= (S B - (m S - 1) beta P_i) K_i``.

**The cluster.** Group workers by their pace into classes ``[P_i, P_i+1)`` of a geometric grid
(from the largest layer, below which no pace lies, up to the slowest kind's whole model). For
an iteration ``B`` and class ``i`` (``m P_i <= B``), a linear program over ``K_i`` workers,
``z_it`` devices of kind ``t`` in them and ``sigma_it`` their summed stage compute:

    sigma_it <= z_it min(P_i+1, B / m)          (every stage within the pace)
    sigma_it / T'_t <= c_t z_it                 (every stage within its memory)
    sum_t sigma_it / T'_t >= K_i                (the shares cover the model, per worker)
    sum_t sigma_it <= (B - (m - 1) beta P_i) K_i    (the fill; beta = 0 for other schedules)
    sum_t (mem_t - reserved) z_it >= M K_i      (memory, as the fleet bound)
    sum_i z_it <= N_t

Every plan whose iteration is at most ``B`` is a feasible point (its workers summed class by
class), so it has at most ``K_LP(B)`` workers: the rate is at most ``max_B floor(K_LP(B)) m b /
B`` (searched as the fleet bound searches it; ``K_LP`` grows with ``B``). With ``K`` fixed, the
least ``B`` with ``K_LP(B) >= K`` bounds the iteration.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from partitioner.cluster import Device
from partitioner.cost import CostModel
from partitioner.schedule import Schedule

from .fleet import _best_iteration, _whole_k, type_counts, worker_memory_bytes
from .layers import FILL_SCHEDULES, _layer_columns, least_backward_share

__all__ = ["PacedInputs", "paced_bound", "paced_inputs", "universal_fill_s"]

log = logging.getLogger(__name__)
GRID_RATIO = 1.15  # successive paces of the class grid


def universal_fill_s(forward_s: Sequence[float], backward_s: Sequence[float], micro_batches: int) -> float:
    """The least iteration any order of ``micro_batches`` micro-batches over these stages (one
    device each, in pipeline order) can reach: ``max_k (W + (m - 1) b_k)`` and
    ``max_k (m s_k + sum_{j < k} s_j)`` (stage ``k`` cannot start before the forwards of the stages
    before it end, nor finish later than their last backwards must start); see the module
    docstring. Transfers only add."""
    f, b = np.asarray(forward_s, dtype=float), np.asarray(backward_s, dtype=float)
    s = f + b
    m = micro_batches
    whole = float(s.sum())
    before = np.concatenate([[0.0], np.cumsum(s)[:-1]])
    return max(float(np.max(whole + (m - 1) * b)), float(np.max(m * s + before)))


@dataclass(frozen=True)
class PacedInputs:
    """Per device kind (sorted): count, effective whole-model seconds ``T'``, the most reference
    share one device holds ``c``, memory in units of the model's ``M``; and ``beta``, the largest
    layer's least seconds ``ell`` and ``M`` itself."""

    kinds: tuple[str, ...]
    counts: tuple[int, ...]
    whole_s: tuple[float, ...]
    share_cap: tuple[float, ...]
    memory_share: tuple[float, ...]
    beta: float
    ell_s: float
    need_bytes: float

    def __post_init__(self) -> None:
        n = len(self.kinds)
        if not all(len(x) == n for x in (self.counts, self.whole_s, self.share_cap, self.memory_share)):
            raise ValueError("PacedInputs: one value per kind")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"PacedInputs: beta {self.beta} is not in [0, 1]")


def _reference(comp: np.ndarray) -> tuple[int, np.ndarray]:
    """The reference kind and every kind's effective whole-model seconds (as
    :func:`.fleet.effective_whole_s`: each kind at its least per-layer ratio to the reference; the
    reference that loses least)."""
    whole = comp.sum(axis=0)
    best, best_keep, best_eff = 0, -1.0, whole.copy()
    for r in range(comp.shape[1]):
        held = comp[:, r] > 0
        if not held.any():
            continue
        ratio = (comp[held] / comp[held, r][:, None]).min(axis=0)
        eff = np.minimum(whole, float(comp[:, r].sum()) * ratio)
        keep = float(np.min(np.where(whole > 0, eff / np.where(whole > 0, whole, 1.0), 1.0)))
        if keep > best_keep:
            best, best_keep, best_eff = r, keep, eff
    return best, best_eff


def _share_cap(work: np.ndarray, mem: np.ndarray, cap: float) -> float:
    """The most of ``work`` (shares summing to 1) that a run of consecutive layers of ``mem``
    bytes within ``cap`` carries (a stage is such a run); two pointers over the layers."""
    best, got, used, start = 0.0, 0.0, 0.0, 0
    for stop in range(len(work)):
        got += float(work[stop])
        used += float(mem[stop])
        while used > cap and start <= stop:
            got -= float(work[start])
            used -= float(mem[start])
            start += 1
        best = max(best, got)
    return min(1.0, best)


def paced_inputs(cost: CostModel, devices: Sequence[Device], schedule: Schedule) -> PacedInputs:
    """What :func:`paced_bound` needs of ``devices`` (kinds as the cost model prices them)."""
    counts = type_counts(devices)
    kinds = sorted(counts)
    comp, mem = [], []
    for kind in kinds:
        c, _, _, m_j = _layer_columns(cost, kind, schedule.weight_versions)
        comp.append(c)
        mem.append(m_j)
    beta = least_backward_share(cost, kinds)
    comp_a = np.stack(comp, axis=1)
    r, eff = _reference(comp_a)
    work = comp_a[:, r] / max(float(comp_a[:, r].sum()), 1e-300)
    reserved = cost.options.reserved_bytes
    need = worker_memory_bytes(cost, schedule)
    caps, mem_share = [], []
    for j, kind in enumerate(kinds):
        dev = next(d for d in devices if d.kind == kind)
        room = dev.memory_bytes - reserved
        caps.append(_share_cap(work, mem[j], room) if room > 0 else 0.0)
        mem_share.append(max(0.0, room / cost.shard_memory_ratio(kind)) / need if need > 0 else math.inf)
    ell = float(comp_a.min(axis=1).max())
    return PacedInputs(tuple(kinds), tuple(counts[k] for k in kinds), tuple(float(x) for x in eff),
                       tuple(caps), tuple(min(x, 1.0) for x in mem_share), beta, ell, need)


def _grid(inp: PacedInputs) -> np.ndarray:
    """Class edges: from the largest layer's least time (no pace is below it) up to past the
    slowest kind's whole model (no stage computes more), geometric."""
    lo = max(inp.ell_s, 1e-12)
    hi = max(max(inp.whole_s), lo) * GRID_RATIO
    n = max(1, math.ceil(math.log(hi / lo) / math.log(GRID_RATIO)))
    return lo * GRID_RATIO ** np.arange(n + 1)


def _most_workers(inp: PacedInputs, m: int, fill: bool, edges: np.ndarray, iteration_s: float,
                  slices: int = 1) -> float:
    """``K_LP(B)`` of the module docstring: the LP's most workers (``inf`` where the solver gives
    no answer). With the first micro-batch in up to ``slices`` slices the fill row is
    ``sigma <= (S B - (m S - 1) beta P_i) K_i`` (:func:`.layers.fill_capacity`)."""
    from scipy import sparse

    from solvers.cluster.lp import linprog

    beta = inp.beta if fill else 0.0
    s = slices if fill else 1

    def room(pace_s: float) -> float:  # a worker's stage compute within the fill, per worker
        return s * iteration_s - (m * s - 1) * beta * pace_s

    classes = [i for i in range(len(edges) - 1) if m * edges[i] <= iteration_s and room(float(edges[i])) > 0]
    if not classes:
        return 0.0
    nt = len(inp.kinds)
    per = 1 + 2 * nt  # K_i, z_it, sigma_it
    nv = per * len(classes)
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    rhs: list[float] = []

    def row(entries: list[tuple[int, float]], b: float) -> None:
        r = len(rhs)
        for c, v in entries:
            rows.append(r)
            cols.append(c)
            vals.append(v)
        rhs.append(b)

    inv = [1.0 / t if t > 0 else math.inf for t in inp.whole_s]
    for q, i in enumerate(classes):
        k, z, sg = q * per, q * per + 1, q * per + 1 + nt
        pace = min(float(edges[i + 1]), iteration_s / m)
        for j in range(nt):
            row([(sg + j, 1.0), (z + j, -pace)], 0.0)
            row([(sg + j, inv[j]), (z + j, -inp.share_cap[j])], 0.0)
        row([(k, 1.0), *((sg + j, -inv[j]) for j in range(nt))], 0.0)
        row([(k, -room(float(edges[i]))), *((sg + j, 1.0) for j in range(nt))], 0.0)
        row([(k, 1.0), *((z + j, -inp.memory_share[j]) for j in range(nt))], 0.0)
    for j in range(nt):
        row([(q * per + 1 + j, 1.0) for q in range(len(classes))], float(inp.counts[j]))
    a_ub = sparse.csr_matrix((vals, (rows, cols)), shape=(len(rhs), nv))
    c = np.zeros(nv)
    c[[q * per for q in range(len(classes))]] = -1.0
    res = linprog(c, a_ub, np.array(rhs), None, None, (0.0, math.inf))
    if res.status == "infeasible":
        return 0.0
    if not res.ok:
        log.debug("paced bound: LP status %s at iteration %g", res.status, iteration_s)
        return math.inf  # no answer: no bound
    return -res.fun


def paced_bound(cost: CostModel, devices: Sequence[Device], schedule: Schedule, *,
                virtual_workers: int | None = None, replication: bool = False, rel_tol: float = 2e-2,
                slices: int = 1) -> float:
    """An upper bound on the samples/s of any plan over ``devices`` (the module docstring), plans
    whose first micro-batch runs in up to ``slices`` slices included: ``inf``
    where it does not apply (replicated stages, interleaved chunks), where it adds nothing (every
    device holds a stage of the whole model) or the LP solver gives no answer; 0 where no worker
    fits."""
    if replication or schedule.spec.multi_chunk or not devices:
        return math.inf
    inp = paced_inputs(cost, devices, schedule)
    if any(t <= 0 for t in inp.whole_s) or min(inp.share_cap) >= 1.0:
        return math.inf  # where every device holds the model, memory caps no share: the fleet bound's fill is stronger
    m, b = schedule.micro_batches, cost.profile.micro_batch_size
    fill = schedule.name in FILL_SCHEDULES
    edges = _grid(inp)
    lo = m * inp.ell_s
    if virtual_workers is not None:
        return _fixed_k(inp, m, b, fill, edges, lo, virtual_workers, rel_tol, slices)
    # every class open and the fill rows slack: the most workers at any iteration
    k_all = _whole_k(_most_workers(inp, m, fill, edges, 1e6 * m * float(edges[-1]), slices))
    if not math.isfinite(k_all):
        return math.inf
    if k_all <= 0:
        return 0.0

    def k_lp(it: float) -> float:
        return _most_workers(inp, m, fill, edges, it, slices)

    value, _ = _best_iteration(k_lp, k_all, lo, m, b, rel_tol)
    return value


def _fixed_k(inp: PacedInputs, m: int, b: int, fill: bool, edges: np.ndarray, lo: float, k: int,
             rel_tol: float, slices: int = 1) -> float:
    """``K m b / B`` at the least ``B`` whose LP holds ``K`` workers (bisection; the bound is taken
    at the lower end of the last bracket, so it stays valid). The LP holds ``K`` where its most
    workers are at least ``K``: its rows are homogeneous but for the supply, so a point scaled
    down stays feasible."""
    def fits(it: float) -> bool:
        return _most_workers(inp, m, fill, edges, it, slices) >= k * (1 - 1e-9)

    hi = max(lo, 1e-12)
    while not fits(hi):
        hi *= 2
        if hi > lo * 1e9 + 1e6:
            return 0.0
    low = lo
    if fits(low):
        return k * m * b / low
    while hi - low > rel_tol * low:
        mid = 0.5 * (low + hi)
        if fits(mid):
            hi = mid
        else:
            low = mid
    return k * m * b / low
