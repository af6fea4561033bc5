"""One pipeline of convex stages of a DAG profile, exactly: a DP over the graph's down-sets.

A profile with ``edges`` is a DAG listed in one topological order. A pipeline of ``p`` stages
is a chain of down-sets ``{} = D_0 < D_1 < ... < D_p = all layers`` (a down-set holds every
layer that feeds one of its layers); stage ``k`` runs ``D_{k+1} - D_k`` on ``devices[k]``, and
sorting the layers by ``(stage, index)`` gives a topological order in which every stage is a
range (:meth:`partitioner.profile.Profile.reordered`). These are exactly the convex stages the
graph models of :mod:`solvers.exact.graph` choose among; PipeDream's optimizer walks the same
states (its antichains).

Everything a stage costs is a function of its two down-sets: its compute and memory are sums
over ``D' - D`` (weights, the activations in flight at its position, less what a layer shares
with its predecessor when both are in the stage, and the boundary tensors crossing ``D`` and
``D'`` the executor holds; each stage in the first recompute mode the options allow that fits,
as the chain DP has it), its gradient send back carries every tensor
crossing ``D`` and its activation send forward every tensor crossing ``D'``, each one message
priced on its link as the cost model prices a boundary (:meth:`CostModel.messages_s`: flat,
latency, measured curves and shared NICs alike), and WSP's wave sync is a sum over the stage.
So the chain DP's recurrence holds with down-sets for cut points,

    f_k(D') = min over down-sets D < D' of max(f_{k-1}(D), T_k(D, D')),

and a second pass, every stage held to the optimal bottleneck, picks the least total stage
time among the optima, as the chain DP does. Transitions run over the comparable pairs of
down-sets whose stage could be in a plan at least as good as the chain DP's (compute on the
fastest device no more than its bottleneck, memory within the largest device), in numpy, one
pass per stage. The DP's memory check allows a trillionth past a device's memory, since its
sums round otherwise than the cost model's prefix sums over the reordered profile (a stage that
needs exactly its device's memory fits); where the cost model refuses a stage of the plan found
in the DP's mode, that candidate stage in that mode is left out and the DP run again (at most
:data:`MAX_REFUSAL_ROUNDS` times). The plan found is priced again by the cost model on the
reordered profile and compared with the chain DP's split of the profile's own order (always one
of these plans), so the answer is never worse than the chain's.

A graph with more than :data:`MAX_DOWN_SETS` down-sets (wide parallel branches) is planned on
its chain order, with a note saying so.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from partitioner.boundary import boundary_held
from partitioner.cluster import Device
from partitioner.cost import CostModel
from partitioner.profile import Profile
from partitioner.recompute import selective_bytes
from partitioner.schedule import Schedule
from solvers.pipeline import dp
from solvers.pipeline.dp import ChainSolution
from solvers.pipeline.levers import stage_mode
from solvers.result import SolveResult, SolveStatus

__all__ = ["MAX_DOWN_SETS", "MAX_PAIRS", "MAX_REFUSAL_ROUNDS", "GraphPlan", "down_sets", "graph_dp", "price_stages", "solve_graph"]

MAX_DOWN_SETS = 20_000  # down-sets of the graph the DP enumerates at most
MAX_PAIRS = 30_000_000  # comparable pairs of down-sets kept as candidate stages at most
MAX_REFUSAL_ROUNDS = 20  # DP passes again after leaving out a stage the cost model refuses, at most
MEMORY_MARGIN = 1e-12  # of a stage's memory: what the DP's check allows past the device's (floating point)
_BLOCK = 256  # down-sets per block when the comparable pairs are enumerated


def down_sets(num_layers: int, edges: Sequence[tuple[int, int]], limit: int = MAX_DOWN_SETS) -> list[int] | None:
    """Every down-set of the graph as a bit mask (bit ``v``: layer ``v``), sorted by size then
    mask (so a down-set comes after each of its subsets); None when there are more than ``limit``."""
    pred = [0] * num_layers
    for a, b in edges:
        pred[b] |= 1 << a
    seen = {0}
    frontier = [0]
    while frontier:
        nxt = []
        for d in frontier:
            for v in range(num_layers):
                if not d >> v & 1 and pred[v] & ~d == 0:
                    e = d | 1 << v
                    if e not in seen:
                        seen.add(e)
                        nxt.append(e)
                        if len(seen) > limit:
                            return None
        frontier = nxt
    return sorted(seen, key=lambda d: (d.bit_count(), d))


@dataclass(frozen=True)
class GraphPlan:
    """An assignment of layers to stages, priced exactly on the reordered profile."""

    stages: tuple[int, ...]
    profile: Profile  # the profile reordered by (stage, layer)
    cost: CostModel
    solution: ChainSolution
    total_s: float
    fits: bool


def price_stages(cost: CostModel, devices: Sequence[Device], schedule: Schedule, stages: Sequence[int]) -> GraphPlan:
    """Price an assignment of layers to ``len(devices)`` convex stages with the cost model of
    the profile reordered by ``(stage, layer)`` (the pricing every command applies to the plan)."""
    n, p = cost.num_layers, len(devices)
    order = sorted(range(n), key=lambda v: (stages[v], v))
    profile = cost.profile.reordered(order)
    model = CostModel(profile, cost.cluster, cost.options)
    sizes = np.bincount(np.asarray(stages, dtype=np.int64), minlength=p)
    cuts = tuple(int(c) for c in np.concatenate([[0], np.cumsum(sizes)]))
    times, modes, fits = [], [], True
    for k in range(p):
        a, b = cuts[k], cuts[k + 1]
        prev = devices[k - 1] if k > 0 else None
        nxt = devices[k + 1] if k + 1 < p else None
        in_flight = schedule.activations_in_flight(p - k)
        # the first recompute mode the options allow that fits (the options' last where none does)
        modes.append(stage_mode(model, devices[k], schedule, in_flight, a, b))
        cm = model.recomputing(modes[-1])
        times.append(cm.pipeline_stage_time_s(a, b, devices[k], prev, nxt, schedule))
        need = cm.stage_memory_bytes(a, b, in_flight, schedule, devices[k].tensor_parallel)
        fits = fits and need <= devices[k].memory_bytes
    recompute = () if set(modes) == {"none"} else tuple(modes)
    return GraphPlan(tuple(int(s) for s in stages), profile, model,
                     ChainSolution(max(times), cuts, tuple(devices), recompute), math.fsum(times), fits)


class _Lattice:
    """The down-sets as a membership matrix, with the per-down-set sums a stage is priced from."""

    def __init__(self, cost: CostModel, ideals: list[int]):
        n = cost.num_layers
        self.ideals = ideals
        self.member = np.array([[d >> v & 1 for v in range(n)] for d in ideals], dtype=bool)
        succ = [0] * n
        for a, b in cost.profile.graph_edges:
            succ[a] |= 1 << b
        own = [layer.own_bytes for layer in cost.profile.layers]
        # the tensors crossing the cut after each down-set: each once (math.fsum, as Profile.reordered)
        self.crossing_bytes = np.array([math.fsum(own[u] for u in range(n) if d >> u & 1 and succ[u] & ~d)
                                        for d in ideals])
        self.words = np.array([[(d >> (64 * w)) & (2**64 - 1) for w in range((n + 63) // 64)] for d in ideals],
                              dtype=np.uint64)

    def sums(self, per_layer: np.ndarray) -> np.ndarray:
        """``sum_{v in D} per_layer[v]`` for every down-set ``D``."""
        return self.member.astype(np.float64) @ np.asarray(per_layer, dtype=np.float64)


def _pairs(lat: _Lattice, least_s: np.ndarray, least_mem: np.ndarray, limit_s: float,
           limit_mem: float) -> tuple[np.ndarray, np.ndarray] | None:
    """The comparable pairs ``(sub, sup)`` of distinct down-sets whose stage ``sup - sub`` takes at
    most ``limit_s`` on the fastest device and needs at most ``limit_mem`` at the least memory
    rule (``least_*``: those figures per down-set, linear in the set), sorted by ``sup``; None past
    :data:`MAX_PAIRS`."""
    subs, sups, kept = [], [], 0
    m = len(lat.ideals)
    idx = np.arange(m)
    for lo in range(0, m, _BLOCK):
        rows = slice(lo, min(m, lo + _BLOCK))
        inside = np.ones((rows.stop - lo, m), dtype=bool)
        for w in range(lat.words.shape[1]):  # sub's bits all in sup's
            inside &= (lat.words[None, :, w] & ~lat.words[rows, w, None]) == 0
        inside &= idx[None, :] < idx[rows, None]
        inside &= (least_s[rows, None] - least_s[None, :]) <= limit_s
        inside &= (least_mem[rows, None] - least_mem[None, :]) <= limit_mem
        r, c = np.nonzero(inside)
        kept += len(r)
        if kept > MAX_PAIRS:
            return None
        sups.append(r + lo)
        subs.append(c)
    return np.concatenate(subs), np.concatenate(sups)


def _shared_in_stage(lat: _Lattice, shared: np.ndarray, sub: np.ndarray, sup: np.ndarray) -> np.ndarray:
    """Per pair: the bytes a layer ``v`` shares with ``v - 1`` where both are in the stage
    ``sup - sub`` (the stage keeps that tensor once), by byte-wise lookup tables of the masks."""
    n = len(shared)
    out = np.zeros(len(sub))
    if not shared[1:].any():
        return out
    for w in range(lat.words.shape[1]):
        a, b = lat.words[sub, w], lat.words[sup, w]
        lower = np.left_shift(b, np.uint64(1))  # v - 1 in sup, seen at bit v
        if w > 0:  # bit 63 of the word below
            lower |= np.right_shift(lat.words[sup, w - 1], np.uint64(63))
        lower_a = np.left_shift(a, np.uint64(1))
        if w > 0:
            lower_a |= np.right_shift(lat.words[sub, w - 1], np.uint64(63))
        both = b & ~a & lower & ~lower_a
        for byte in range(8):
            base = 64 * w + 8 * byte
            if base >= n:
                break
            table = np.array([sum(shared[base + i] for i in range(8) if x >> i & 1 and base + i < n)
                              for x in range(256)])
            out += table[(np.right_shift(both, np.uint64(8 * byte)) & np.uint64(255)).astype(np.int64)]
    return out


def _group_best(values: np.ndarray, sup: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Per down-set ``j``: the least of ``values`` over the pairs with ``sup == j`` (``sup`` is
    sorted; inf where none) and the index of the first pair that reaches it (-1 where none)."""
    best = np.full(m, np.inf)
    arg = np.full(m, -1, dtype=np.int64)
    if not len(sup):
        return best, arg
    starts = np.flatnonzero(np.r_[True, sup[1:] != sup[:-1]])
    best[sup[starts]] = np.minimum.reduceat(values, starts)
    hit = np.flatnonzero((values == best[sup]) & np.isfinite(values))
    first = hit[np.r_[True, sup[hit][1:] != sup[hit][:-1]]] if len(hit) else hit
    arg[sup[first]] = first
    return best, arg


class _TooMany(Exception):
    """The graph has too many down-sets or candidate stages for the DP."""


class _Stages:
    """The candidate stages (comparable pairs of down-sets) and their price at each position."""

    def __init__(self, cost: CostModel, devices: Sequence[Device], schedule: Schedule, lat: _Lattice,
                 upper_s: float):
        self.cost, self.devices, self.schedule, self.lat = cost, tuple(devices), schedule, lat
        kinds = sorted({d.kind for d in devices})
        self.modes = cost.options.recompute_modes
        # per (mode, kind): every down-set's compute, the recomputed forward included
        self.work = {(mode, kind): lat.sums(cost.recomputing(mode).layer_compute_s(kind))
                     for mode in self.modes for kind in kinds}
        degrees = sorted({d.tensor_parallel for d in devices})
        self.params = {t: lat.sums(np.diff(cost.at_degree(t).param_count_prefix)) for t in degrees}
        self.wf = cost.weight_factor(schedule)
        # per layer, the least over the devices (a stage's least is at least the sum of these)
        least_s = lat.sums(np.min([cost.layer_compute_s(k) for k in kinds], axis=0))
        least_mem = lat.sums(np.min([self.wf * np.diff(cost.at_degree(t).param_count_prefix) for t in degrees],
                                    axis=0))  # activations are >= 0
        room = max(d.memory_bytes for d in devices) - cost.options.reserved_bytes
        self.pairs = _pairs(lat, least_s, least_mem, upper_s * (1 + 1e-9), room * (1 + 1e-9))
        if self.pairs is None:
            return
        sub, sup = self.pairs
        self.weights = {t: self.wf * (self.params[t][sup] - self.params[t][sub]) for t in degrees}
        self.act, self.dropped = {}, {}
        for t in degrees:
            shard = cost.at_degree(t).profile
            saved = lat.sums(shard.array("saved_bytes"))
            shared = shard.array("shared_saved_bytes")
            self.act[t] = (saved[sup] - saved[sub]) - _shared_in_stage(lat, shared, sub, sup)
            if "selective" in self.modes:  # what selective recomputation does not keep
                dropped = lat.sums(selective_bytes(shard))
                self.dropped[t] = dropped[sup] - dropped[sub]
        self.wave = np.zeros(len(sub))
        if schedule.wave_sync:
            pbytes = lat.sums(np.diff(cost.param_prefix))
            nbytes = pbytes[sup] - pbytes[sub]
            inter = cost.cluster.inter_curve
            secs = (np.array([inter.seconds(float(x)) if x > 0 else 0.0 for x in nbytes]) if inter is not None
                    else nbytes / (cost.cluster.inter_gbps * 1e9))
            self.wave = 2.0 * secs / schedule.micro_batches

    def at(self, k: int, refused: dict[tuple[int, int], list[int]] | None = None
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Stage ``k``'s time of every candidate, whether it fits ``devices[k]``, and its mode (an
        index in the options' modes): the first recompute mode the options allow (cheapest first)
        whose memory fits, as the chain DP (a recompute only adds time, so the fastest that fits).
        The check is relaxed by :data:`MEMORY_MARGIN` of the figures (the cost model's sums round
        differently: a stage that needs exactly its device's memory fits), less the candidates
        ``refused[k, mode]`` the cost model refused in that mode (:func:`graph_dp`).

        Memory as the cost model has it: weights, the activations of ``f`` micro-batches in
        flight (selective: less the attention cores'; full: one micro-batch's, and its input
        ``f`` times), the boundary tensors the executor holds (:func:`partitioner.boundary.
        boundary_held`: outputs crossing the stage's end, per micro-batch in flight and fixed, and
        inputs crossing its start), the reserved bytes."""
        assert self.pairs is not None
        sub, sup = self.pairs
        devs, cost, p = self.devices, self.cost, len(self.devices)
        dev = devs[k]
        crossing = self.lat.crossing_bytes
        back = cost.messages_s(crossing, dev.name, devs[k - 1].name)[sub] if k > 0 else 0.0
        out = cost.messages_s(crossing, dev.name, devs[k + 1].name)[sup] if k + 1 < p else 0.0
        t = dev.tensor_parallel
        flight = self.schedule.activations_in_flight(p - k)
        bh = boundary_held(self.schedule.name)
        held = ((bh.per_flight * flight + bh.fixed_outputs) * crossing[sup] + bh.fixed_inputs * crossing[sub]
                + cost.options.reserved_bytes)
        times = np.full(len(sub), np.inf)
        placed = np.zeros(len(sub), dtype=bool)
        chosen = np.full(len(sub), -1, dtype=np.int64)
        for index, mode in enumerate(self.modes):
            if mode == "full":
                mem = self.weights[t] + self.act[t] + (flight - 1) * crossing[sub] + held
            else:
                kept = self.act[t] - self.dropped[t] if mode == "selective" else self.act[t]
                mem = self.weights[t] + flight * kept + held
            fit = (mem <= dev.memory_bytes + MEMORY_MARGIN * np.maximum(np.abs(mem), abs(dev.memory_bytes))) & ~placed
            if refused and (k, index) in refused:
                fit[refused[k, index]] = False
            if not fit.any():
                continue
            work = self.work[(mode, dev.kind)]
            comp = work[sup] - work[sub]
            stage_s = np.maximum(np.maximum(comp, back), out) if cost.options.overlap_comm else (comp + back) + out
            times[fit] = (stage_s + self.wave)[fit]
            chosen[fit] = index
            placed |= fit
        return times, placed, chosen


def graph_dp(cost: CostModel, devices: Sequence[Device], schedule: Schedule, ideals: list[int],
             upper_s: float = math.inf, lattice: _Lattice | None = None) -> list[int] | None:
    """The stage of every layer in a least-bottleneck pipeline of convex stages over exactly
    ``devices`` (then the least total stage time among those), or None when none fits or the
    candidate stages are too many; stages slower than ``upper_s`` on the fastest device are left
    out (a plan of bottleneck ``upper_s`` is known)."""
    p, m = len(devices), len(ideals)
    if p > cost.num_layers:
        return None
    lat = lattice or _Lattice(cost, ideals)
    cand = _Stages(cost, devices, schedule, lat, upper_s)
    if cand.pairs is None:
        raise _TooMany(f"more than {MAX_PAIRS:,} candidate stages")
    refused: dict[tuple[int, int], list[int]] = {}
    for _ in range(MAX_REFUSAL_ROUNDS + 1):
        found = _best_stages(cand, p, m, refused)
        if found is None:
            return None
        stages, picks = found
        # the DP's mode of a stage the cost model refuses (its sums round otherwise): that
        # candidate stage in that mode is left out and the DP run again
        over = _refused_stages(cost, devices, schedule, stages, [cand.modes[mode] for _, mode in picks])
        if not over:
            break
        for k in over:
            refused.setdefault((k, picks[k][1]), []).append(picks[k][0])
    return stages


def _refused_stages(cost: CostModel, devices: Sequence[Device], schedule: Schedule, stages: Sequence[int],
                    modes: Sequence[str]) -> list[int]:
    """The stages of an assignment that overflow their device in ``modes[k]`` by the cost model's
    check on the reordered profile (:func:`price_stages`' pricing)."""
    n, p = cost.num_layers, len(devices)
    model = CostModel(cost.profile.reordered(sorted(range(n), key=lambda v: (stages[v], v))), cost.cluster,
                      cost.options)
    cuts = np.concatenate([[0], np.cumsum(np.bincount(np.asarray(stages, dtype=np.int64), minlength=p))])
    return [k for k in range(p)
            if model.recomputing(modes[k]).stage_memory_bytes(int(cuts[k]), int(cuts[k + 1]),
                                                              schedule.activations_in_flight(p - k), schedule,
                                                              devices[k].tensor_parallel) > devices[k].memory_bytes]


def _best_stages(cand: _Stages, p: int, m: int, refused: dict[tuple[int, int], list[int]]
                 ) -> tuple[list[int], list[tuple[int, int]]] | None:
    """One pass of the DP and its second pass: the stage of every layer and, per stage, the
    candidate (an index in ``cand.pairs``) and its mode (None when none fits)."""
    assert cand.pairs is not None
    sub, sup = cand.pairs
    f = np.full(m, np.inf)
    f[0] = 0.0
    for k in range(p):
        times, fits, _ = cand.at(k, refused)
        f, _ = _group_best(np.where(fits, np.maximum(f[sub], times), np.inf), sup, m)
    best = f[m - 1]
    if not np.isfinite(best):
        return None
    cap = best * (1 + 1e-12)  # every stage held to the optimal bottleneck: the least total among the optima
    g = np.full(m, np.inf)
    g[0] = 0.0
    back, modes = [], []
    for k in range(p):
        times, fits, chosen = cand.at(k, refused)
        g, arg = _group_best(np.where(fits & (times <= cap), g[sub] + times, np.inf), sup, m)
        back.append(arg)
        modes.append(chosen)
    stages = [0] * cand.cost.num_layers
    picks: list[tuple[int, int]] = [(0, 0)] * p
    j = m - 1
    for k in range(p - 1, -1, -1):
        pair = int(back[k][j])
        picks[k] = (pair, int(modes[k][pair]))
        i = int(sub[pair])
        for v in np.flatnonzero(cand.lat.member[j] & ~cand.lat.member[i]):
            stages[int(v)] = k
        j = i
    return stages, picks


def solve_graph(profile: Profile, cost: CostModel, devices: Sequence[Device], schedule: Schedule,
                allow_fewer: bool, chain: SolveResult, t0: float) -> SolveResult:
    """The convex-stage plan of a DAG profile over ``devices`` (their first ``q`` for every ``q``
    with ``allow_fewer``), or the chain DP's answer ``chain`` where it is as good; the result
    says which (``details["order"]``) and how many down-sets the graph has."""
    missing = [a for a, _ in profile.edges if profile.layers[a].own_output_bytes is None]
    if missing:  # an older import: the tensors crossing another order's cuts cannot be priced
        return _chain_noted(chain, f"no own_output_bytes for layer {missing[0]} (import the graph again to plan "
                                   f"convex stages of it)", profile)
    ideals = down_sets(profile.num_layers, profile.graph_edges)
    if ideals is None:
        return _chain_noted(chain, f"more than {MAX_DOWN_SETS:,} down-sets", profile)
    upper = chain.objective if chain.ok else math.inf
    lattice = _Lattice(cost, ideals)
    best: GraphPlan | None = None
    for q in (range(1, len(devices) + 1) if allow_fewer else (len(devices),)):
        limit = min(upper, best.solution.bottleneck_s) if best is not None else upper
        try:
            stages = graph_dp(cost, devices[:q], schedule, ideals, limit, lattice)
        except _TooMany as why:
            return _chain_noted(chain, str(why), profile)
        if stages is None:
            continue
        found = price_stages(cost, devices[:q], schedule, stages)
        if found.fits and (best is None or found.solution.bottleneck_s < best.solution.bottleneck_s * (1 - 1e-12)):
            best = found
    details = chain.details.copy()
    details["order"] = "graph"
    details["down_sets"] = len(ideals)
    if best is None or (chain.ok and not _graph_wins(best, chain, cost, schedule)):
        if not chain.ok or chain.plan is None:
            return replace(chain, runtime_s=time.perf_counter() - t0)
        details["reordered"] = False
        kept = replace(chain, runtime_s=time.perf_counter() - t0, details=details)
        return replace(kept, plan=replace(chain.plan, solver=kept.solver_info()))
    plan = dp.plan_from_cuts(best.profile, best.cost, best.solution, schedule, solver_name="dp")
    details["reordered"] = best.profile.layer_order is not None
    objective = best.solution.bottleneck_s
    result = SolveResult(SolveStatus.OPTIMAL, None, objective, objective, time.perf_counter() - t0, "dp",
                         details=details)
    return replace(result, plan=replace(plan, solver=result.solver_info()))


def _chain_noted(chain: SolveResult, why: str, profile: Profile) -> SolveResult:
    """The chain's answer, with a note that the graph was too large for the DP."""
    note = (f"note: the graph of {profile.model} has {why}; planned on its layer order (the cpsat and milp "
            f"solvers plan convex stages of the graph)")
    noted = chain.details.copy()
    noted["order"] = "chain"
    noted["messages"] = [*chain.details.get("messages", ()), note]
    return replace(chain, details=noted)


def _graph_wins(best: GraphPlan, chain: SolveResult, cost: CostModel, schedule: Schedule) -> bool:
    """The graph's plan beats the chain's: a smaller bottleneck, or the same one (up to the
    rounding of sums taken in another order) and a smaller total stage time."""
    b, c = best.solution.bottleneck_s, chain.objective
    if abs(b - c) > 1e-9 * max(b, c):
        return b < c
    return best.total_s < _total(chain, cost, schedule)


def _total(chain: SolveResult, cost: CostModel, schedule: Schedule) -> float:
    """The chain plan's total stage time (the tie-break between it and the graph's plan)."""
    assert chain.plan is not None
    stages = chain.plan.virtual_workers[0].stages
    devs = [cost.cluster.device(s.device) for s in stages]
    return math.fsum(cost.recomputing(s.recompute).pipeline_stage_time_s(
        s.layers[0], s.layers[1], devs[k], devs[k - 1] if k else None, devs[k + 1] if k + 1 < len(devs) else None,
        schedule) for k, s in enumerate(stages))
