"""Exact dynamic programming for one pipeline over an ordered list of (heterogeneous) devices.

Stage ``k`` of ``p`` runs on ``devices[k]`` and holds a contiguous layer range. The DP
minimises the bottleneck ``max_k stage_time_s(k)`` (from :mod:`partitioner.cost`) subject to
each device's memory, where a stage's activations in flight depend on its distance from the
end of the pipeline (1F1B: ``min(p - k, m)``). Working backwards from the last stage,

    f_k(i) = min_{j > i, mem_k(i, j) <= M_k}  max(T_k(i, j), f_{k+1}(j)),   f_p(L) = 0,

and ``f_0(0)`` is the optimum ``B*``. A second pass, ``g_k(i) = min_{j: T_k(i, j) <= B*}
T_k(i, j) + g_{k+1}(j)``, picks among the splits that reach ``B*`` one with the least total
stage time (a 1F1B iteration is about that total plus ``(m - 1) B*``). Each step is one
vectorised (rows x L) numpy reduction, so the whole solve is ``O(p L^2)`` arithmetic in
``2 p`` numpy steps of a handful of passes.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from partitioner.cluster import Cluster, Device
from partitioner.cost import CostModel, CostOptions
from partitioner.errors import FormatError
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.profile import Profile
from partitioner.schedule import Schedule
from solvers.pipeline.levers import fitting_stops, stage_candidates, stage_mode
from solvers.predictions import with_predictions
from solvers.result import SolveResult, SolveStatus

__all__ = ["ChainSolution", "best_prefix_dp", "chain_arguments", "chain_dp", "diagnose_infeasible", "solve"]

log = logging.getLogger(__name__)
GIB = 2**30


@dataclass(frozen=True)
class ChainSolution:
    """An optimal split: ``cuts[k]:cuts[k+1]`` is stage ``k``'s layer range."""

    bottleneck_s: float
    cuts: tuple[int, ...]
    devices: tuple[Device, ...]
    recompute: tuple[str, ...] = ()  # each stage's recompute mode (empty: none anywhere)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self.cuts[:-1], self.cuts[1:]))

    def stages(self) -> tuple[Stage, ...]:
        """The plan's stages of this split: each range on its device, in its recompute mode."""
        modes = self.recompute or ("none",) * len(self.devices)
        return tuple(Stage(r, d.name, d.gpu_type, recompute=mode)
                     for r, d, mode in zip(self.ranges, self.devices, modes, strict=True))


def chain_dp(cost: CostModel, devices: Sequence[Device], schedule: Schedule, refine: bool = True,
             holders: int = 1) -> ChainSolution | None:
    """The minimum-bottleneck split of the chain over exactly ``devices`` in order, or None.

    With ``refine`` (the default), a second pass picks, among the splits that reach the optimal
    bottleneck ``B*``, one with the least total stage time ``sum_k T_k``: a 1F1B or GPipe
    iteration takes about ``sum_k T_k + (m - 1) B*``, so this is the best of the tied optima
    (a fast device gets the layers a slow one need not hold).

    Each stage takes the first recompute mode ``cost.options`` allows that fits its device
    (:mod:`solvers.pipeline.levers`), its optimizer state shared by ``holders`` holders of every
    layer under ZeRO (the virtual workers of a cluster plan: each holds every layer once).
    """
    p, n_layers = len(devices), cost.num_layers
    if p == 0 or p > n_layers:
        return None
    best, back = _sweep(cost, devices, schedule, holders=holders)
    return _solution(cost, devices, schedule, best, back, refine, holders)


def _solution(cost: CostModel, devices: Sequence[Device], schedule: Schedule, best: float,
              back: list[np.ndarray], refine: bool, holders: int = 1) -> ChainSolution | None:
    """The split a first pass found (``best``, ``back``), refined to the least total stage time,
    with each stage's recompute mode."""
    if not math.isfinite(best):
        return None
    if refine:
        total, refined = _sweep(cost, devices, schedule, limit_s=best, holders=holders)
        if math.isfinite(total):  # always: the first pass's split is a candidate
            back = refined
    cuts = [0]
    for k in range(len(devices)):
        cuts.append(int(back[k][cuts[-1]]))
    p = len(devices)
    modes = tuple(stage_mode(cost, devices[k], schedule, schedule.activations_in_flight(p - k), cuts[k], cuts[k + 1],
                             holders) for k in range(p))
    return ChainSolution(best, tuple(cuts), tuple(devices), () if set(modes) == {"none"} else modes)


def best_prefix_dp(cost: CostModel, devices: Sequence[Device], schedule: Schedule, refine: bool = True,
                   holders: int = 1) -> ChainSolution | None:
    """The best split over the first ``q`` devices, over every ``q``: the least bottleneck, the
    shortest pipeline among equals (refined as in :func:`chain_dp`), or None when no prefix fits.

    Exact, and usually about one :func:`chain_dp` more, not ``len(devices) / 2`` of them: one
    forward pass over the devices gives a lower bound on every prefix's optimum (see
    :func:`_prefix_lower_bounds`); the prefixes are then solved exactly in the order of their
    bounds, and the search stops at the first bound that cannot beat the best found.
    """
    q_max = min(len(devices), cost.num_layers)
    if q_max == 0:
        return None
    devices = devices[:q_max]
    bounds = _prefix_lower_bounds(cost, devices, schedule, holders)
    best, best_q, best_back = math.inf, 0, None
    solved, tightened = 0, False
    while True:
        # The most promising prefix that can still win: its bound is below the best found, or
        # equal to it with a shorter pipeline (the shortest wins ties).
        open_q = [q for q in range(1, q_max + 1) if bounds[q - 1] < best or (bounds[q - 1] == best and q < best_q)]
        if not open_q:
            break
        if solved and not tightened:
            # More than one prefix is needed: a second bound, exact in memory, usually settles it.
            bounds = np.maximum(bounds, _distance_lower_bounds(cost, devices, schedule, holders))
            tightened = True
            continue
        q = min(open_q, key=lambda x: (bounds[x - 1], x))
        value, back = _sweep(cost, devices[:q], schedule, holders=holders)
        solved += 1
        bounds[q - 1] = value  # solved: its bound is its optimum
        if value < best or (value == best and q < best_q):
            best, best_q, best_back = value, q, back
        elif not math.isfinite(value):
            bounds[q - 1] = math.inf
        if q != best_q:
            bounds[q - 1] = math.inf  # done with it
    log.debug("allow_fewer: %d of %d prefixes solved exactly (second bound: %s)", solved, q_max, tightened)
    if best_back is None:
        return None
    return _solution(cost, devices[:best_q], schedule, best, best_back, refine, holders)


def _prefix_lower_bounds(cost: CostModel, devices: Sequence[Device], schedule: Schedule, holders: int = 1) -> np.ndarray:
    """``bounds[q - 1] <= `` the optimal bottleneck over ``devices[:q]``, for every ``q``, in one pass.

    A forward pass, ``h_{k+1}(j) = min_{i < j} max(h_k(i), T_k(i, j))`` with ``h_0(0) = 0``, and
    ``bounds[q - 1] = h_q(L)``. Stage times do not depend on the pipeline's length: stage ``k``
    sends to ``devices[k + 1]`` whatever ``q`` is, and the last stage's cut at ``L`` carries no
    tensor (checked; otherwise that column is priced without a next device). Memory does depend
    on it (1F1B keeps ``min(q - k, m)`` micro-batches in flight on stage ``k``), so the pass
    relaxes it to the fewest micro-batches any stage keeps, and to a capacity a hair larger
    (rounding can never make the relaxation stricter than the exact test). A relaxation can
    only lower the optimum, so every bound is valid; where memory does not bind, it is exact.
    With memory levers a stage fits where any allowed mode fits it and is priced in the cheapest.
    """
    p, n_layers = len(devices), cost.num_layers
    cols = np.arange(n_layers + 1)
    fewest = min(schedule.activations_in_flight(d) for d in range(1, p + 1))
    h = np.full(n_layers + 1, np.inf)
    h[0] = 0.0
    bounds = np.full(p, np.inf)
    for k in range(p):
        lo, hi = (0, 0) if k == 0 else (k, n_layers - 1)
        rows = slice(lo, hi + 1)
        dev = devices[k]
        prev = devices[k - 1] if k > 0 else None
        nxt = devices[k + 1] if k + 1 < p else None
        top = np.max(fitting_stops(cost, fewest, schedule, dev.memory_bytes * (1 + 1e-9), rows, dev.tensor_parallel,
                                   holders), axis=0)
        invalid = (cols[None, :] <= cols[rows, None]) | (cols[None, :] > top[:, None])
        cheapest = cost.recomputing(cost.options.recompute_modes[0])
        cand = cheapest.pipeline_stage_time_matrix(dev, prev, nxt, schedule, rows)
        if nxt is not None and cost.boundary_vector_s(dev, nxt)[n_layers] != 0.0:
            last = cheapest.pipeline_stage_time_matrix(dev, prev, None, schedule, rows)
            cand[:, n_layers] = last[:, n_layers]
        np.maximum(cand, h[rows, None], out=cand)
        cand[invalid] = np.inf
        h = cand.min(axis=0)
        bounds[k] = h[n_layers]
    return bounds


def _distance_lower_bounds(cost: CostModel, devices: Sequence[Device], schedule: Schedule, holders: int = 1
                           ) -> np.ndarray:
    """``bounds[q - 1] <= `` the optimal bottleneck over ``devices[:q]``, for every ``q``, in one pass
    indexed by the distance from the pipeline's end, where memory is exact.

    In a pipeline of ``q`` stages the stage ``d`` places from the end (the last has ``d = 1``)
    keeps ``min(d, m)`` micro-batches in flight (1F1B) and runs on ``devices[q - d]``, one of
    ``devices[:len(devices) - d + 1]`` whatever ``q`` is, sending to the device after it. Relaxing
    that pair to the best of them (at every ``(i, j)`` the least time over the kinds of pair: GPU
    type, link, same node or not; no transfer in; the largest memory) makes one
    backward pass, ``g_d(i) = min_j max(T*_d(i, j), g_{d-1}(j))`` with ``g_0(L) = 0``, bound
    every prefix at once: ``bounds[q - 1] = g_q(0)``. Exact for identical devices on one link
    speed; it catches the prefixes that memory rules out, which the forward bound cannot.
    """
    q_max, n_layers = len(devices), cost.num_layers
    cols = np.arange(n_layers + 1)
    g = np.full(n_layers + 1, np.inf)
    g[n_layers] = 0.0
    bounds = np.full(q_max, np.inf)
    fastest: np.ndarray | None = None
    pool_kinds: tuple[tuple[str, float, bool], ...] = ()
    for d in range(1, q_max + 1):
        # Positions devices[k] (k <= q_max - d) can take; a stage before the end sends to devices[k + 1].
        pairs = [(devices[k], devices[k + 1] if d > 1 else None) for k in range(q_max - d + 1)]
        kinds = {_pair_kind(cost, a, b): (a, b) for a, b in reversed(pairs)}
        if tuple(kinds) != pool_kinds:  # the pool shrinks as d grows: its kinds change a few times
            pool_kinds = tuple(kinds)
            cheapest = cost.recomputing(cost.options.recompute_modes[0])
            mats = [cheapest.pipeline_stage_time_matrix(a, None, b, schedule) for a, b in kinds.values()]
            fastest = mats[0] if len(mats) == 1 else np.minimum.reduce(mats)
        assert fastest is not None
        pool = devices[: q_max - d + 1]
        rows = slice(0, n_layers - d + 1)  # d - 1 stages after this one need >= d - 1 layers
        top = np.max([stop for mem, t in {(dev.memory_bytes, dev.tensor_parallel) for dev in pool}
                      for stop in fitting_stops(cost, schedule.activations_in_flight(d), schedule, mem * (1 + 1e-9),
                                                rows, t, holders)], axis=0)
        invalid = (cols[None, :] <= cols[rows, None]) | (cols[None, :] > top[:, None])
        cand = np.maximum(fastest[rows], g[None, :])
        cand[invalid] = np.inf
        g = np.full(n_layers + 1, np.inf)
        g[rows] = cand.min(axis=1)
        bounds[d - 1] = g[0]
    return bounds


def _pair_kind(cost: CostModel, a: Device, b: Device | None) -> tuple[str, float, bool]:
    """What a stage's time on ``a`` sending to ``b`` depends on: GPU type, link, same node."""
    if b is None:
        return a.kind, math.inf, True
    return a.kind, cost.cluster.bandwidth_gbps(a.name, b.name), a.node == b.node


def _sweep(cost: CostModel, devices: Sequence[Device], schedule: Schedule,
           limit_s: float | None = None, holders: int = 1) -> tuple[float, list[np.ndarray]]:
    """One backward pass over the stages: the optimum from layer 0 and the back-pointers.

    Without ``limit_s``: ``f_k(i) = min_j max(T_k(i, j), f_{k+1}(j))`` (the bottleneck).
    With it: ``f_k(i) = min_{j: T_k(i, j) <= limit_s} T_k(i, j) + f_{k+1}(j)`` (the total time
    of splits whose every stage is within the limit). Both over memory-feasible ``j > i``.
    """
    p, n_layers = len(devices), cost.num_layers
    cols = np.arange(n_layers + 1)
    f = np.full(n_layers + 1, np.inf)
    f[n_layers] = 0.0
    back: list[np.ndarray] = [np.empty(0, dtype=np.intp)] * p
    for k in range(p - 1, -1, -1):
        # Stage k starts at i in [lo, hi]: k stages before it need >= k layers, p - k after >= p - k.
        lo, hi = (0, 0) if k == 0 else (k, n_layers - (p - k))
        rows = slice(lo, hi + 1)
        dev = devices[k]
        prev = devices[k - 1] if k > 0 else None
        nxt = devices[k + 1] if k + 1 < p else None
        in_flight = schedule.activations_in_flight(p - k)
        # Feasible (i, j): i < j <= the largest stop whose stage fits in the device's memory (in
        # some recompute mode the options allow; T_k(i, j) is the first that fits, a fresh array).
        top, cand = stage_candidates(cost, dev, prev, nxt, schedule, in_flight, rows, holders)
        invalid = (cols[None, :] <= cols[rows, None]) | (cols[None, :] > top[:, None])
        if limit_s is None:
            np.maximum(cand, f[None, :], out=cand)
        else:
            invalid |= cand > limit_s
            cand += f[None, :]
        cand[invalid] = np.inf
        arg = cand.argmin(axis=1)
        f = np.full(n_layers + 1, np.inf)
        f[rows] = cand[np.arange(hi + 1 - lo), arg]
        back[k] = np.full(n_layers + 1, -1, dtype=np.intp)
        back[k][rows] = arg
    return float(f[0]), back


def diagnose_infeasible(cost: CostModel, devices: Sequence[Device], schedule: Schedule) -> str:
    """Why no split of the chain fits ``devices``, in words with the numbers that matter, and the
    changes that would make it fit (:func:`_memory_levers`), each checked on the cost model."""
    n_layers, p = cost.num_layers, len(devices)
    if p > n_layers:
        return (f"{p} devices but only {n_layers} layers: every stage needs at least one layer; "
                f"give at most {n_layers} devices or allow fewer devices")
    largest = max(devices, key=lambda d: d.memory_bytes)
    fewest = schedule.activations_in_flight(1)
    names = [layer.name for layer in cost.profile.layers]
    # with recomputation allowed, each figure in the mode that needs least
    modes = [cost.recomputing(mode) for mode in cost.options.recompute_modes]
    alone = np.array([min(c.stage_memory_bytes(i, i + 1, fewest, schedule) for c in modes) for i in range(n_layers)])
    worst = int(alone.argmax())
    reserved = cost.options.reserved_bytes
    if alone[worst] > largest.memory_bytes:
        reason = (f"layer {worst} ({names[worst]}) alone needs {alone[worst] / GIB:.2f} GiB "
                  f"({fewest} micro-batch(es) of activations in flight under {schedule}, "
                  f"{reserved / GIB:.2f} GiB reserved); the largest device "
                  f"({largest.name}, {largest.gpu_type}) has {largest.memory_bytes / GIB:.2f} GiB")

        def figure(m: _Memory) -> str:
            return f"layer {worst} needs {m.stage(worst, worst + 1, 1) / GIB:.2f} GiB"

        return reason + _memory_levers(cost, devices, schedule, figure)
    need = min(c.stage_memory_bytes(0, n_layers, fewest, schedule) for c in modes) + (p - 1) * reserved
    have = sum(d.memory_bytes for d in devices)
    if need > have:
        reason = (f"the model needs at least {need / GIB:.2f} GiB across {p} stages even with "
                  f"{fewest} micro-batch(es) in flight; the devices have {have / GIB:.2f} GiB in total")

        def figure(m: _Memory) -> str:
            return f"the model needs {(m.stage(0, n_layers, 1) + (p - 1) * reserved) / GIB:.2f} GiB"

        return reason + _memory_levers(cost, devices, schedule, figure)
    first = schedule.activations_in_flight(p)
    return (f"no contiguous split of {n_layers} layers over these {p} devices in this order fits every "
            f"device's memory under {schedule} with {schedule.micro_batches} micro-batches (the first stage keeps "
            f"{first} in flight)" + _memory_levers(cost, devices, schedule, None))


@dataclass(frozen=True)
class _Memory:
    """Stage memory under a changed setting (:meth:`CostModel.stage_memory_bytes` with the weight
    bytes per parameter and the activations scaled): ``weight_scale`` for another precision,
    ``act_scale`` for another micro-batch size, and the schedule and micro-batches in flight."""

    cost: CostModel
    schedule: Schedule
    weight_scale: float = 1.0
    act_scale: float = 1.0

    def stage(self, start: int, stop: int, stages_from_end: int) -> float:
        c = self.cost
        in_flight = self.schedule.activations_in_flight(stages_from_end) * self.act_scale
        params = float(c.param_count_prefix[stop] - c.param_count_prefix[start])
        saved = float(c.saved_stop[stop] - c.saved_start[start])
        return params * c.weight_factor(self.schedule) * self.weight_scale + saved * in_flight + \
            c.options.reserved_bytes

    def fits(self, devices: Sequence[Device]) -> bool:
        """Whether some contiguous split over ``devices`` in this order fits every device's memory:
        each stage as long as its device holds (stage memory only grows with its end, and a later
        start leaves the next stage more room), leaving a layer for each stage after it."""
        c, n_layers, p = self.cost, self.cost.num_layers, len(devices)
        if p > n_layers:
            return False
        w = c.param_count_prefix * (c.weight_factor(self.schedule) * self.weight_scale)
        tops: dict[float, np.ndarray] = {}
        start = 0
        for k, dev in enumerate(devices):
            f = self.schedule.activations_in_flight(p - k) * self.act_scale
            if f not in tops:
                tops[f] = w + c.saved_stop * f
            base = w[start] + c.saved_start[start] * f
            stop = int(np.searchsorted(tops[f], dev.memory_bytes - c.options.reserved_bytes + base, side="right")) - 1
            stop = min(stop, n_layers - (p - k - 1))
            if stop <= start:
                return False
            start = stop
        return start == n_layers


# Work of one memory check (distinct micro-batch counts in flight x layers) above which the
# levers that need a search are left out of a diagnosis: it stays well within a second.
_LEVER_WORK = 4_000_000


def _memory_levers(cost: CostModel, devices: Sequence[Device], schedule: Schedule,
                   figure: Callable[[_Memory], str] | None) -> str:
    """``"; it would fit with: ..."``: each change that makes the split fit, computed: mixed
    precision, a smaller micro-batch, fewer micro-batches in flight (1F1B, fewer micro-batches),
    more pipeline stages; with ``figure`` the memory it then needs. ``""`` if none is checked."""
    from dataclasses import replace as _replace

    p, n_layers = len(devices), cost.num_layers
    micro_batches = schedule.micro_batches
    base = _Memory(cost, schedule)
    searches = min(p, micro_batches) * n_layers <= _LEVER_WORK
    out: list[str] = []

    def say(lever: str, m: _Memory, note: str = "") -> None:
        said = [f"{figure(m)} then"] if figure is not None else []
        out.append(f"{lever} ({'; '.join([*said, *([note] if note else [])])})" if said or note else lever)

    if cost.options.precision == "fp32":
        versions = schedule.weight_versions
        half = _replace(cost.options, precision="fp16").bytes_per_parameter(versions)
        scale = half / cost.options.bytes_per_parameter(versions)
        if scale < 1 and _replace(base, weight_scale=scale).fits(devices):
            say("`precision` fp16 or bf16 (mixed precision)", _replace(base, weight_scale=scale))
    one_f_one_b = Schedule.of("1f1b", micro_batches)
    first, first_1f1b = schedule.activations_in_flight(p), one_f_one_b.activations_in_flight(p)
    if schedule.spec.flushes and first > first_1f1b:  # GPipe keeps every micro-batch in flight
        one = _replace(base, schedule=one_f_one_b)
        if one.fits(devices):
            say(f"`schedule` 1f1b instead of {schedule}", one,
                f"at most {first_1f1b} micro-batches in flight, not {first}")
    if searches:
        b = cost.profile.micro_batch_size
        if b > 1 and _replace(base, act_scale=1 / b).fits(devices):
            lo, hi = 1, b - 1  # the largest size that fits, in [lo, hi]
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if _replace(base, act_scale=mid / b).fits(devices) else (lo, mid - 1)
            say(f"micro-batches of at most {lo} samples instead of {b}", _replace(base, act_scale=lo / b),
                "profile at that size")
        in_flight = [schedule.activations_in_flight(p - k) for k in range(p)]
        one_mb = schedule.with_micro_batches(1)
        if micro_batches > 1 and in_flight != [one_mb.activations_in_flight(p - k) for k in range(p)] \
                and _replace(base, schedule=one_mb).fits(devices):
            lo, hi = 1, micro_batches - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if _replace(base, schedule=schedule.with_micro_batches(mid)).fits(devices) \
                    else (lo, mid - 1)
            say(f"`micro_batches` {lo} or fewer instead of {micro_batches}",
                _replace(base, schedule=schedule.with_micro_batches(lo)))
        largest = max(devices, key=lambda d: d.memory_bytes)
        k = next((q for q in _stage_counts(p, n_layers) if base.fits([largest] * q)), None)
        if k is not None:
            lo = p + 1  # the fewest stages that fit, in [lo, k]
            while lo < k:
                mid = (lo + k) // 2
                lo, k = (lo, mid) if base.fits([largest] * mid) else (mid + 1, k)
            out.append(f"more pipeline stages: {k} devices of {largest.memory_bytes / GIB:.2f} GiB like "
                       f"{largest.name} instead of {p} (fewer virtual workers leave each pipeline more devices)")
    recompute_checked = cost.options.recompute != "auto" and searches and p * n_layers * n_layers <= _LEVER_WORK
    if recompute_checked:
        levered = CostModel(cost.profile, cost.cluster, _replace(cost.options, recompute="auto"))
        sol = chain_dp(levered, devices, schedule, refine=False)
        if sol is not None and sol.recompute:  # (a split that fits without it is not this lever's)
            used = ", ".join(f"{m} on {d.name}" for m, d in zip(sol.recompute, sol.devices, strict=True) if m != "none")
            out.append(f"`recompute` auto (activation recomputation where memory binds: {used})")
    if not out:
        checked = "mixed precision, 1f1b" if not searches else \
            "mixed precision, a smaller micro-batch, fewer micro-batches, more pipeline stages" + \
            (", activation recomputation" if recompute_checked else "")
        return f"; no single change among {checked} makes it fit"
    return "; it would fit with " + ", or ".join(out)


def _stage_counts(p: int, n_layers: int) -> list[int]:
    """Pipeline lengths to try above ``p``: doubling, then all ``n_layers`` (at most one stage per layer)."""
    out, q = [], p
    while q < n_layers:
        q = min(2 * q, n_layers)
        out.append(q)
    return out


def chain_arguments(profile: Profile, cluster: Cluster, devices: Sequence[str] | None, schedule: str,
                    micro_batches: int | None, options: CostOptions | None
                    ) -> tuple[CostModel, tuple[Device, ...], Schedule]:
    """Check the arguments every chain solver takes: (cost model, ordered devices, the schedule
    with its micro-batch count, by default the number of devices).

    Refuses a device listed twice, a profile without times for a device's GPU type, a
    micro-batch count below 1, and a schedule without a per-stage memory rule.
    """
    cost = CostModel(profile, cluster, options)
    devs = tuple(cluster.subset(devices) if devices is not None else cluster.devices)
    if len({d.name for d in devs}) != len(devs):
        raise FormatError("devices", [d.name for d in devs], "lists a device twice")
    cost.require_times(devs)
    m = micro_batches if micro_batches is not None else len(devs)
    if not (isinstance(m, int) and not isinstance(m, bool) and m >= 1):
        raise FormatError("micro_batches", m, "must be an integer >= 1")
    sched = Schedule.of(schedule, m)
    sched.activations_in_flight(1)  # refuses schedules the chain solvers cannot price
    return cost, devs, sched


def solve(profile: Profile, cluster: Cluster, devices: Sequence[str] | None = None, *,
          schedule: str = "1f1b", micro_batches: int | None = None, options: CostOptions | None = None,
          allow_fewer: bool = False) -> SolveResult:
    """Optimal single-pipeline plan over ``devices`` (default: every device of the cluster, in order).

    ``micro_batches`` defaults to the number of devices. With ``allow_fewer``, the first ``q``
    devices for every ``q <= len(devices)`` are tried and the best pipeline wins (the shortest
    one on ties). One one-chunk schedule and one micro-batch count; the solver named ``dp``
    (:func:`solvers.pipeline.router.solve`) adds ``schedule="auto"``, lists of counts and multi-chunk
    schedules around this one.
    """
    t0 = time.perf_counter()
    cost, devs, sched = chain_arguments(profile, cluster, devices, schedule, micro_batches, options)
    best = best_prefix_dp(cost, devs, sched) if allow_fewer else chain_dp(cost, devs, sched)
    elapsed = time.perf_counter() - t0
    if best is None:
        tried = devs[: profile.num_layers] if allow_fewer else devs
        reason = diagnose_infeasible(cost, tried, sched)
        return SolveResult(SolveStatus.INFEASIBLE, None, runtime_s=elapsed, method="dp", reason=reason)
    plan = plan_from_cuts(profile, cost, best, sched, solver_name="dp")
    result = SolveResult(SolveStatus.OPTIMAL, None, best.bottleneck_s, best.bottleneck_s, elapsed, "dp",
                         details={"lower_bound_simple_s": cost.lower_bound_s(best.devices)})
    return _with_plan(result, plan)


def plan_from_cuts(profile: Profile, cost: CostModel, sol: ChainSolution, schedule: Schedule, solver_name: str,
                   simulate: bool = True) -> Plan:
    """A one-virtual-worker plan from a split, with its predicted figures.

    The figures come from the discrete-event simulator (:func:`partitioner.simulate.predict`):
    iteration time, samples/s, mean bubble and largest peak memory, with per-device figures in
    ``meta``. With ``simulate=False`` they come from the closed form
    :meth:`partitioner.cost.CostModel.plan_iteration_s` (fill and drain around the bottleneck,
    then the optimizer step); ``meta["predicted_by"]`` says which.
    """
    stages = sol.stages()
    plan = Plan(profile.model, (VirtualWorker(stages),), schedule.name, profile.micro_batch_size, schedule.micro_batches,
                layer_order=profile.layer_order)
    times = cost.plan_stage_times_s(plan)
    iteration = cost.plan_iteration_s(plan)
    closed = {
        "bottleneck_s": max(times),
        "iteration_s": iteration,
        "samples_per_s": schedule.micro_batches * profile.micro_batch_size / iteration if iteration > 0 else math.inf,
    }
    return with_predictions(plan, profile, cost.cluster, cost.options, closed, simulate,
                            extra_meta={"stage_times_s": times}, cost=cost)


def _with_plan(result: SolveResult, plan: Plan) -> SolveResult:
    from dataclasses import replace

    plan = replace(plan, solver=result.solver_info())
    return replace(result, plan=plan)
