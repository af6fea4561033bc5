"""The graph problem (:mod:`solvers.exact.graph`) as a CP-SAT model.

Integers: every time coefficient is rounded **down** to ticks (``tick_s`` = the longest any
stage could take / ``resolution``), so the integer model never overstates a stage and its
bound, converted back, is a valid lower bound on the true optimum (less a hundredth of a tick
for floating point); a stage's modelled time is within one tick per term of its true time.
Memory coefficients are rounded **up** to units of ``mem_unit`` bytes and capacities down, so
the model never accepts a stage the cost model refuses (it may refuse one within a few units
of a device's capacity). The assignment found is priced exactly on the reordered profile.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np

from solvers.exact.graph import DagData, DagPlan, finish_dag, price_assignment, single_stage
from solvers.exact.cpsat.run import cpsat_solver
from solvers.progress import solve_cpsat
from solvers.result import SolveResult, SolveStatus

__all__ = ["solve_dag"]

log = logging.getLogger(__name__)

FLOAT_SAFETY_TICKS = 0.01
MEMORY_UNITS = 1e12  # the largest capacity, in memory units (integers CP-SAT sums without overflow)


def solve_dag(data: DagData, *, time_limit_s: float, threads: int, seed: int, prune: bool, resolution: int,
              tie_break: bool, t0: float, details: dict[str, Any]) -> SolveResult:
    """Minimum-bottleneck convex stages over ``data``'s devices by CP-SAT (see :mod:`solvers.exact.graph`)."""
    from ortools.sat.python import cp_model

    n, p = data.num_layers, data.num_stages
    trivial = single_stage(data, "cpsat", t0, details)
    if trivial is not None:
        return trivial
    tick_s = data.stage_time_bound_s() / resolution or 1.0
    details.update(tick_s=tick_s, layers=n, stages=p, edges=len(data.edges))
    m = cp_model.CpModel()

    # Variables: y[v][c] = 1 iff layer v is in a stage before cut c (c = 1..p-1); z[u][c] = 1 when
    # u's output crosses cut c; t[k] = stage k's time, B = the bottleneck (ticks).
    y = [[m.new_bool_var(f"y_{v}_{c}") for c in range(1, p)] for v in range(n)]

    def before(v: int, c: int) -> Any:  # y[v, c] with y[v, 0] = 0 and y[v, p] = 1
        return 0 if c == 0 else 1 if c == p else y[v][c - 1]

    def x(v: int, k: int) -> Any:  # layer v in stage k
        return before(v, k + 1) - before(v, k)

    # Stages in order: y[v, c] <= y[v, c+1]. Precedence: y[w, c] <= y[u, c] for every edge u -> w.
    for v in range(n):
        for c in range(1, p - 1):
            m.add_implication(y[v][c - 1], y[v][c])
    for u, w in data.edges:
        for c in range(1, p):
            m.add_implication(y[w][c - 1], y[u][c - 1])
    # No empty stage: sum_v x[v, k] >= 1.
    for k in range(p):
        m.add(sum(x(v, k) for v in range(n)) >= 1)
    # Crossing: z[u, c] >= y[u, c] - y[w, c] for every edge u -> w (only outputs with bytes matter).
    senders = [u for u in range(n) if data.succ[u] and data.own_bytes[u] > 0]
    z = {(u, c): m.new_bool_var(f"z_{u}_{c}") for u in senders for c in range(1, p)}
    for u in senders:
        for w in data.succ[u]:
            for c in range(1, p):
                m.add(z[u, c] >= y[u][c - 1] - y[w][c - 1])

    def sends(c: int, per_byte: float) -> Any:  # X_c / bw in ticks, rounded down
        if c in (0, p) or per_byte == 0.0:
            return 0
        coef = np.floor(data.own_bytes[senders] * per_byte / tick_s).astype(np.int64).tolist()
        return cp_model.LinearExpr.weighted_sum([z[u, c] for u in senders], coef) if senders else 0

    comp_ticks = np.floor(data.time_s / tick_s).astype(np.int64)
    wave_ticks = np.floor(data.wave_s / tick_s).astype(np.int64)
    upper = resolution + 1
    t = [m.new_int_var(0, upper, f"t_{k}") for k in range(p)]
    bottleneck = m.new_int_var(0, upper, "B")
    overlap = data.problem.cost.options.overlap_comm
    for k in range(p):
        comp = sum(int(comp_ticks[k, v]) * x(v, k) for v in range(n))
        wave = sum(int(wave_ticks[v]) * x(v, k) for v in range(n) if wave_ticks[v])
        back, out = sends(k, data.back_s_per_byte[k]), sends(k + 1, data.out_s_per_byte[k])
        # Additive: t_k >= C_k + back + out; overlapped: t_k >= C_k, t_k >= back + W_k, t_k >= out + W_k.
        if overlap:
            m.add(t[k] >= comp)
            m.add(t[k] >= back + wave)
            m.add(t[k] >= out + wave)
        else:
            m.add(t[k] >= comp + back + out)
        m.add(bottleneck >= t[k])
    _memory(m, data, x, before)

    start = data.hint_stages()
    hint_plan = price_assignment(data, start) if start is not None else None
    if hint_plan is not None and prune:
        # B <= the DP's bottleneck (its assignment is a solution of this model, whose times are no larger).
        m.add(bottleneck <= math.ceil(hint_plan.solution.bottleneck_s / tick_s) + 1)
    if start is not None:
        for v in range(n):
            for c in range(1, p):
                m.add_hint(y[v][c - 1], start[v] < c)

    # Objective: minimise B.
    m.minimize(bottleneck)
    solver = cpsat_solver(time_limit_s, threads, seed)
    code = solve_cpsat(solver, m, "cpsat (graph)", tick_s)
    details.update(cpsat_status=solver.status_name(code), cpsat_wall_s=solver.wall_time, branches=solver.num_branches)
    if code == cp_model.INFEASIBLE:
        return finish_dag(data, "cpsat", SolveStatus.INFEASIBLE, None, math.nan, time.perf_counter() - t0, details)
    bound = max(0.0, (solver.best_objective_bound - FLOAT_SAFETY_TICKS) * tick_s)
    details["bound_s"] = bound
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return finish_dag(data, "cpsat", SolveStatus.UNKNOWN, None, bound, time.perf_counter() - t0, details,
                          reason=f"no plan found within the time limit of {time_limit_s:g} s")

    def extract() -> DagPlan:
        return price_assignment(data, [p - 1 - sum(solver.boolean_value(y[v][c - 1]) for c in range(1, p))
                                       for v in range(n)])

    found = extract()
    remaining = time_limit_s - (time.perf_counter() - t0)
    if code == cp_model.OPTIMAL and tie_break and remaining > 0:
        # Second solve: among assignments within the optimum, the least total stage time. A stage's
        # ticks round each layer down, so two plans of the same exact bottleneck can differ by up to
        # n ticks: the bound leaves room for n, and the answer is taken below only if its exact
        # bottleneck is within those n ticks of the first answer's.
        m.add(bottleneck <= int(solver.objective_value) + n)
        m.minimize(sum(t))
        m.clear_hints()
        for v in range(n):
            for c in range(1, p):
                m.add_hint(y[v][c - 1], found.stages[v] < c)
        solver.parameters.max_time_in_seconds = float(remaining)
        code2 = solver.solve(m)
        details["tie_break"] = solver.status_name(code2)
        if code2 in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            again = extract()
            # the second model ties bottlenecks in ticks, so the exact bottleneck of its answer may
            # exceed the first by the rounding of a stage's layers (under a tick each): within that,
            # the smaller total wins (an exact comparison would let float noise pick the worse total)
            if again.fits and again.total_s < found.total_s and \
                    again.solution.bottleneck_s <= found.solution.bottleneck_s + n * tick_s:
                found = again
    status = SolveStatus.OPTIMAL if code == cp_model.OPTIMAL else SolveStatus.FEASIBLE
    log.debug("cpsat (graph): %s, objective %.6g s, bound %.6g s", status, found.solution.bottleneck_s, bound)
    return finish_dag(data, "cpsat", status, found, bound, time.perf_counter() - t0, details)


def _memory(m: Any, data: DagData, x: Any, before: Any) -> None:
    """M_k <= cap_k for every stage whose layers could overflow it (bytes rounded up to units)."""
    n, p = data.num_layers, data.num_stages
    largest = max(max(data.capacity_bytes), float(data.mem_bytes.max(initial=0.0)), 1.0)
    unit = max(1.0, largest / MEMORY_UNITS)
    for k in range(p):
        cap = data.capacity_bytes[k]
        if float(data.mem_bytes[k].sum()) <= cap:
            continue  # the whole model fits: no constraint
        if cap < 0:
            m.add(sum(x(v, k) for v in range(n)) <= 0)  # reserved memory alone overflows
            continue
        cap_units = math.floor(cap / unit)
        need = [math.ceil(b / unit) for b in data.mem_bytes[k].tolist()]  # <= 1e12 each: no overflow
        terms = [need[v] * x(v, k) for v in range(n)]
        for v in range(1, n):
            sh = math.floor(float(data.shared_bytes[k, v]) / unit)
            if sh > 0:  # b <= x[v, k], b <= x[v-1, k]: v and v - 1 both in stage k
                b = m.new_bool_var(f"b_{v}_{k}")
                m.add(b <= x(v, k))
                m.add(b <= x(v - 1, k))
                terms.append(-sh * b)
        m.add(sum(terms) <= cap_units)
