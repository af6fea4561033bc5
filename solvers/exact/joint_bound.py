"""A lower bound for the joint mapping + split problem: an exact DP over GPU-type counts and
node runs, a relaxation of :mod:`solvers.exact.joint`.

Relax which GPU of a type runs a position, keeping only the *runs*: maximal stretches of
positions on one node. A run may use at most what some node has of each type; two positions
in one run are joined by the cheapest link inside a node, two runs by the cheapest link between
nodes (per cut: ``msg_in[c]``, ``msg_out[c]``). What the relaxation forgets is how many runs a
node can host in total (its GPUs over all its runs). A stage's time then depends on its type,
layers, position (memory) and the two links at its ends, and the best pipeline is a DP from the
end of the chain over (first layer of the suffix, GPUs used of each type, the run of the
suffix's first stage, the link at its first cut; that link is chosen with the state, so the
message is added to both stages it joins):

    f(L, 0, -, -) = 0
    f(i, n, R, b) = min over t, j, and what follows (the same run with link b' = in, if R + e_t
                    fits a node; or a new run, b' = out) of max(T_t(i, j, b, b'), f(j, n - e_t, R', b'))
    T_t(i, j, b, b') = work_t(i, j) + msg_b[i] + msg_b'[j]      (overlapped: max(...) + wave)

where the stage ``[i, j)`` sits at position ``r = |n| - 1`` from the end (its activations in
flight, hence its memory test, as the models have it) and messages are 0 at both ends of the
chain. The answer is the least ``f(0, n, ., .)`` over the count vectors ``n`` the devices allow
(all of them, or any with ``allow_fewer``). Every real plan is a path of this DP whose stage
times are at least those the DP charges, so the value is a valid lower bound on the joint
optimum; the models take it as ``B >= bound`` (less their rounding). With activation
recomputation allowed it stays valid: a real plan's stage on type ``t`` recomputes some mode that
fits, and the arc ``(r, t, i, j)`` is priced in the first mode that fits, whose added forward is
the least of those (a recompute only adds time), so the DP still charges no more than the plan's
stage takes, and an arc exists wherever some mode fits. When the runs make the DP
too large (:data:`MAX_STEPS`), every message is charged at the cheapest link of all (one run).
``relaxed_plan`` follows the DP's best path back and gives its runs nodes; when that works, the
bound is a real plan's bottleneck (up to links cheaper than charged), and the models' start.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np

from solvers.exact.joint import PROVEN_REL, JointData, JointPlan, canonical, finish_joint
from solvers.result import SolveResult, SolveStatus

__all__ = ["MAX_STEPS", "before_model", "relaxed_floor", "relaxed_plan", "type_count_bound_s", "with_relaxation"]

MAX_STEPS = 250_000  # DP steps (each a few numpy operations) with node runs; beyond, every link the cheapest


class _Relaxation:
    """The DP's tables (see the module docstring); ``value`` is the bound."""

    def __init__(self, data: JointData):
        self.data = data
        L = self.L = data.num_layers
        n_types = self.n_types = len(data.type_names)
        avail = self.avail = [sum(c for g, c in enumerate(data.counts) if data.types[g] == name)
                              for name in data.type_names]
        self.vectors = sorted(itertools.product(*(range(a + 1) for a in avail)), key=sum)
        # a run: the GPUs of each type that a stretch of positions on one node uses (at most a node's)
        caps: dict[str, list[int]] = {}
        for g, lab in enumerate(data.labels):
            caps.setdefault(lab[0], [0] * n_types)[data.type_names.index(data.types[g])] += data.counts[g]
        self.node_caps = caps
        self.runs = sorted({run for cap in caps.values() for run in itertools.product(*(range(c + 1) for c in cap))
                            if sum(run) > 0}, key=sum)
        steps = len(self.vectors) * n_types * len(self.runs) * 4
        # too many runs: every message on the cheapest link, inside or between nodes (one "run")
        self.flat = steps > MAX_STEPS
        if self.flat:
            self.runs = [(0,) * n_types]
        self.fits = set() if self.flat else set(self.runs)
        self.too_big = (self.flat and len(self.vectors) * n_types * 2 > MAX_STEPS) or len(data.r) == 0
        same = np.array([[a[0] == b[0] for b in data.labels] for a in data.labels])
        self.msg = []  # the cheapest message per cut inside a node (0) and between nodes (1)
        for want in (True, False):
            classes = sorted({int(c) for c in data.pair_class[(same == want) & (data.pair_class >= 0)]})
            row = data.class_s[classes].min(axis=0) if classes else np.full(L + 1, np.inf)
            row[[0, L]] = 0.0
            self.msg.append(row)
        if self.flat:
            self.msg[1] = np.minimum(self.msg[0], self.msg[1])
        self.by_rt = {}
        for r in range(data.positions):
            for t in range(n_types):
                sel = np.flatnonzero((data.r == r) & (data.gpu == t))
                self.by_rt[(r, t)] = (data.i[sel], data.j[sel], data.work_s[sel], data.wave_s[sel])
        # f[(vec, run, link)][i]: the best suffix from layer i using vec GPUs, whose first stage
        # ends a run using `run` and sends its message back on `link` (0 inside a node, 1 between)
        self.f: dict[tuple[tuple[int, ...], tuple[int, ...], int], np.ndarray] = {}
        self.value = math.inf
        self.terminal: tuple[tuple[int, ...], tuple[int, ...], int] | None = None
        if not self.too_big:
            self._run()

    def moves(self, vec: tuple[int, ...], t: int):
        """Every way to put a stage of type ``t`` in front of a suffix using ``vec`` less one
        ``t``: (its state key, its arcs' starts, their values, their ends, the follow state)."""
        data, L = self.data, self.L
        r = sum(vec) - 1
        if (r, t) not in self.by_rt:  # more stages than positions
            return
        ii, jj, work, wave = self.by_rt[(r, t)]
        if len(ii) == 0:
            return
        rest = tuple(v - (k == t) for k, v in enumerate(vec))
        unit = tuple(int(k == t) for k in range(self.n_types))
        follow: list[tuple[tuple[int, ...], np.ndarray, int, object]] = []
        if sum(rest) == 0:
            follow.append((self.runs[0] if self.flat else unit, np.where(np.arange(L + 1) == L, 0.0, np.inf), 0, None))
        else:
            for run in self.runs:
                for link in (0, 1):
                    nxt = self.f.get((rest, run, link))
                    if nxt is None:
                        continue
                    if link == 0:
                        grown = tuple(a + b for a, b in zip(run, unit, strict=True))
                        if grown in self.fits:
                            follow.append((grown, nxt, 0, (rest, run, link)))
                    elif self.flat:
                        follow.append((run, nxt, 1, (rest, run, link)))
                    else:
                        follow.append((unit, nxt, 1, (rest, run, link)))
        for run, nxt, out_link, key_next in follow:
            out = np.where(jj < L, self.msg[out_link][jj], 0.0)
            for back_link in (1,) if self.flat else (0, 1):
                back = np.where(ii > 0, self.msg[back_link][ii], 0.0)
                t_arc = np.maximum(work, wave + np.maximum(back, out)) if data.overlap else work + back + out
                yield (vec, run, back_link), ii, np.maximum(t_arc, nxt[jj]), jj, key_next

    def _run(self) -> None:
        data = self.data
        for vec in self.vectors:
            used = sum(vec)
            if used == 0:
                continue
            for t in range(self.n_types):
                if vec[t] == 0:
                    continue
                for key, ii, vals, _jj, _nxt in self.moves(vec, t):
                    row = self.f.get(key)
                    if row is None:
                        row = self.f[key] = np.full(self.L + 1, np.inf)
                    np.minimum.at(row, ii, vals)
            if used in data.lengths and (data.problem.allow_fewer or used == sum(self.avail)):
                for key, row in self.f.items():
                    if key[0] == vec and row[0] < self.value:
                        self.value, self.terminal = float(row[0]), key

    def path(self) -> list[tuple[int, int, int, int]] | None:
        """The bound's pipeline: (type, first layer, stop, link to the next stage) per stage."""
        if self.terminal is None:
            return None
        out = []
        key: tuple | None = self.terminal
        i = 0
        while key is not None:
            vec = key[0]
            target = self.f[key][i]
            step = None
            for t in range(self.n_types):
                if vec[t] == 0:
                    continue
                for k2, ii, vals, jj, nxt in self.moves(vec, t):
                    if k2 != key:
                        continue
                    hit = np.flatnonzero((ii == i) & (vals <= target))
                    if len(hit):
                        step = (t, int(jj[hit[0]]), nxt)
                        break
                if step is not None:
                    break
            if step is None:
                return None
            t, j, nxt = step
            out.append((t, i, j, -1 if nxt is None else nxt[2]))
            key, i = nxt, j
        return out


def type_count_bound_s(data: JointData) -> float:
    """The DP's value (seconds); 0.0 when the DP is too large (see :data:`MAX_STEPS`), and
    inf when no pipeline of the relaxation fits (the models are then infeasible too)."""
    relax = _Relaxation(data)
    return 0.0 if relax.too_big else relax.value


def relaxed_plan(data: JointData) -> tuple[float, JointPlan | None]:
    """The bound, and its pipeline made real when its runs can be given nodes (each run on a
    node with those GPUs left, neighbouring runs on different nodes), priced by the cost model."""
    relax = _Relaxation(data)
    if relax.too_big:
        return 0.0, None
    steps = relax.path()
    if not steps:
        return relax.value, None
    runs: list[list[tuple[int, int, int]]] = [[]]
    for t, i, j, link in steps:
        runs[-1].append((t, i, j))
        if link == 1:
            runs.append([])
    runs = [run for run in runs if run]
    left = {g: c for g, c in enumerate(data.counts)}
    nodes = list(dict.fromkeys(lab[0] for lab in data.labels))

    def assign(k: int, prev: str | None) -> list[list[int]] | None:
        if k == len(runs):
            return []
        for node in nodes:
            if node == prev:
                continue
            picked: list[int] = []
            for t, _i, _j in runs[k]:
                g = next((g for g, lab in enumerate(data.labels) if lab[0] == node and left[g] > 0
                          and data.types[g] == data.type_names[t]), None)
                if g is None:
                    break
                left[g] -= 1
                picked.append(g)
            if len(picked) == len(runs[k]):
                rest = assign(k + 1, node)
                if rest is not None:
                    return [picked, *rest]
            for g in picked:
                left[g] += 1
        return None

    labels = assign(0, None)
    if labels is None:
        return relax.value, None
    flat = [g for run in labels for g in run]
    cuts = [0] + [j for _t, _i, j, _l in steps]
    return relax.value, data.realise(flat, cuts)


def with_relaxation(data: JointData) -> tuple[JointData, float]:
    """``data`` with the relaxation's pipeline as the start when it is real and better than the
    heuristic mapping's (the bound is then reached: the models only confirm it), and the bound."""
    value, plan = relaxed_plan(data)
    data.details["relaxed_bound_s"] = value
    if plan is None or (data.start is not None and plan.solution.bottleneck_s >= data.start.solution.bottleneck_s):
        return data, value
    plan = canonical(data, plan)
    data.details.update({"hint_s": plan.solution.bottleneck_s, "hint_from": "relaxation"})
    return replace(data, start=plan), value


def relaxed_floor(value_s: float) -> float:
    """The relaxation's value as a bound to report: less a relative 1e-12 for floating point
    (0.0 when there is none)."""
    return value_s * (1 - 1e-12) if math.isfinite(value_s) and value_s > 0 else 0.0


def before_model(data: JointData, method: str, bound_dp: bool, time_limit_s: float, t0: float
                 ) -> tuple[JointData, float, SolveResult | None]:
    """What both joint models do before building one: the relaxation (``bound_dp``) and its start,
    and the answer when no model is needed: nothing fits, the start meets the relaxation's bound
    (optimal), or the hint and the relaxation spent the time limit. Returns the data with the
    relaxation's start, the relaxation's value (0 without it) and that answer or ``None``."""
    import time

    if len(data.r) == 0 or not data.lengths:
        return data, 0.0, finish_joint(data, method, SolveStatus.INFEASIBLE, None, math.nan,
                                       time.perf_counter() - t0, {})
    data, relaxed = with_relaxation(data) if bound_dp else (data, 0.0)
    if math.isinf(relaxed):  # not even the relaxation has a pipeline that fits
        return data, relaxed, finish_joint(data, method, SolveStatus.INFEASIBLE, None, math.nan,
                                           time.perf_counter() - t0, {})
    floor = relaxed_floor(relaxed)
    if data.start is not None and data.start.solution.bottleneck_s <= floor * (1 + PROVEN_REL):
        return data, relaxed, finish_joint(data, method, SolveStatus.FEASIBLE, data.start, floor,
                                           time.perf_counter() - t0,
                                           {"bound_s": floor,
                                            "tie_break": "skipped: the start meets the relaxation's bound"})
    if time.perf_counter() - t0 >= 0.9 * time_limit_s:  # the hint and the relaxation took the time: no model
        return data, relaxed, finish_joint(data, method, SolveStatus.UNKNOWN, None, floor, time.perf_counter() - t0,
                                           {"bound_s": floor, "model": "skipped: the time limit was spent before it"},
                                           reason=f"no model solved within the time limit of {time_limit_s:g} s")
    return data, relaxed, None
