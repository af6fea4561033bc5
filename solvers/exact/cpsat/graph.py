"""The graph problem (:mod:`solvers.exact.graph`) as a CP-SAT model.

Integers: every time coefficient is rounded **down** to ticks (``tick_s`` = the longest any
stage could take / ``resolution``), so the integer model never overstates a stage and its
bound, converted back, is a valid lower bound on the true optimum (less a hundredth of a tick
for floating point); a stage's modelled time is within one tick per term of its true time.
Memory is counted in whole units (a byte, or more where the largest figure passes
:data:`MEMORY_UNITS`, 10^9): what a stage holds is rounded **down** and what it shares up, and the
capacity with its margin (:func:`solvers.exact.graph.memory_margin_bytes`) down, so every stage the cost
model accepts is accepted (one that needs exactly its device's memory included), and the bound
stays valid. A stage accepted within those few units that the cost model refuses is excluded
and the model solved again (:func:`solvers.exact.graph.overflowing_stages`). The assignment
found is priced exactly on the reordered profile.
A stage's recompute mode (with several allowed) is a boolean per mode; a mode's time and memory
rows are CP-SAT's enforced constraints (``only_enforce_if``), in force when it is chosen.
"""

from __future__ import annotations

import logging
import math
import time
from functools import partial
from typing import Any

import numpy as np

from solvers.exact import graph as dag
from solvers.exact.cpsat.run import bound_s, run_model, solve_again, solve_status
from solvers.exact.graph import DagData, DagPlan, DagVars
from solvers.exact.intervals import no_plan_reason, unsolved
from solvers.result import SolveDetails, SolveResult, SolveStatus

__all__ = ["solve_dag"]

log = logging.getLogger(__name__)

# the largest memory figure, in memory units: a byte up to a GB, coarser beyond. With coefficients of
# 4e9 CP-SAT's presolve proved a wrong optimum (right with presolve off, or coefficients of 1e9): kept
# so that the product of two coefficients fits in 64 bits
MEMORY_UNITS = 1e9


def solve_dag(data: DagData, *, time_limit_s: float, threads: int, seed: int, prune: bool, resolution: int,
              tie_break: bool, t0: float, details: SolveDetails) -> SolveResult:
    """Minimum-bottleneck convex stages over ``data``'s devices by CP-SAT (see :mod:`solvers.exact.graph`)."""
    from ortools.sat.python import cp_model

    n, p = data.num_layers, data.num_stages
    trivial = dag.single_stage(data, "cpsat", t0, details)
    if trivial is not None:
        return trivial
    tick_s = data.stage_time_bound_s() / resolution or 1.0
    details.update({"tick_s": tick_s, "layers": n, "stages": p, "edges": len(data.edges)})

    m = cp_model.CpModel()
    var = _variables(m, data, resolution + 1)
    _constraints(m, data, var, tick_s)
    hint_plan = data.hint_plan()
    if hint_plan is not None and prune:
        # B <= the DP's bottleneck (its assignment is a solution of this model, whose times are no larger).
        m.add(var.bottleneck <= math.ceil(hint_plan.solution.bottleneck_s / tick_s) + 1)
    start = data.hint_stages()
    if start is not None:
        _hint(m, var, start, data.hint_modes())
    m.minimize(var.bottleneck)  # objective: minimise B

    solver, code = run_model(m, "cpsat (graph)", tick_s, time_limit_s, threads, seed, details)
    status = solve_status(code, m, None)
    bound = bound_s(solver, tick_s)
    answer = partial(dag.finish_dag, data, "cpsat")
    if (done := unsolved(answer, status, bound, t0, details, no_plan_reason(time_limit_s))) is not None:
        return done
    found, status, bound = _settle(m, solver, data, var, status, bound, tick_s, time_limit_s, t0, details)
    if found is None:
        return answer(SolveStatus.INFEASIBLE, None, math.nan, time.perf_counter() - t0, details)
    details["bound_s"] = bound
    remaining = time_limit_s - (time.perf_counter() - t0)
    if status is SolveStatus.OPTIMAL and tie_break and remaining > 0:
        found = _tie_break(m, solver, data, var, found, tick_s, remaining, details)
    log.debug("cpsat (graph): %s, objective %.6g s, bound %.6g s", status, found.solution.bottleneck_s, bound)
    return answer(status, found, bound, time.perf_counter() - t0, details)


def _settle(m: Any, solver: Any, data: DagData, var: DagVars, status: SolveStatus, bound: float, tick_s: float,
            time_limit_s: float, t0: float, details: SolveDetails) -> tuple[DagPlan | None, SolveStatus, float]:
    """The solver's assignment, once no stage of it overflows its device in the mode the model
    chose: each such (assignment, stage, mode) is excluded and the model solved again (within the
    time left, at most :data:`~solvers.exact.graph.MAX_OVERFLOW_ROUNDS` times). The plan (None:
    nothing else fits), its status (FEASIBLE where the rounds or the time ran out first) and the
    bound, which stays valid: only stages the cost model refuses are excluded."""
    rounds = 0
    while True:
        found, modes = _extract(data, solver, var), _modes(data, solver, var)
        over = dag.overflowing_stages(data, found, modes)
        if not over:
            return found, status, bound
        remaining = time_limit_s - (time.perf_counter() - t0)
        if rounds == dag.MAX_OVERFLOW_ROUNDS or remaining <= 0:
            return found, SolveStatus.FEASIBLE, bound
        rounds += 1
        details["overflow_rounds"] = rounds
        other = [yc.Not() if solver.boolean_value(yc) else yc for row in var.y for yc in row]
        for k in over:  # another assignment, or stage k in another mode
            m.add_bool_or(other + ([var.r[k][modes[k]].Not()] if var.r else []))
        solver.parameters.max_time_in_seconds = float(remaining)
        code = solver.solve(m)
        details["cpsat_status"] = solver.status_name(code)
        again = solve_status(code, m, None)
        if again is SolveStatus.INFEASIBLE:
            return None, again, bound
        if again is SolveStatus.UNKNOWN:  # no plan in the time left: the last one, unproven
            return found, SolveStatus.FEASIBLE, bound
        status, bound = again, max(bound, bound_s(solver, tick_s))


def _modes(data: DagData, solver: Any, var: DagVars) -> list[int]:
    """The mode (an index in ``data.modes``) the solver chose for every stage."""
    if not var.r:
        return [0] * data.num_stages
    return [next(j for j, rj in enumerate(row) if solver.boolean_value(rj)) for row in var.r]


def _variables(m: Any, data: DagData, upper: int) -> DagVars:
    """y, z and (with several recompute modes) r booleans, t[k] and B integers in [0, ``upper``] ticks."""
    n, p = data.num_layers, data.num_stages
    senders = data.senders()
    y = [[m.new_bool_var(f"y_{v}_{c}") for c in range(1, p)] for v in range(n)]
    z = {(u, c): m.new_bool_var(f"z_{u}_{c}") for u in senders for c in range(1, p)}
    t = [m.new_int_var(0, upper, f"t_{k}") for k in range(p)]
    modes = len(data.modes)
    r = [[m.new_bool_var(f"r_{k}_{j}") for j in range(modes)] for k in range(p)] if modes > 1 else []
    return DagVars(y, z, t, m.new_int_var(0, upper, "B"), senders, r)


def _constraints(m: Any, data: DagData, var: DagVars, tick_s: float) -> None:
    """Order, precedence, no empty stage, crossings, stage times, memory (the groups of
    :mod:`solvers.exact.graph`)."""
    n, p = data.num_layers, data.num_stages
    y = var.y
    # Stages in order: y[v, c] <= y[v, c+1]. Precedence: y[w, c] <= y[u, c] for every edge u -> w.
    for v in range(n):
        for c in range(1, p - 1):
            m.add_implication(y[v][c - 1], y[v][c])
    for u, w in data.edges:
        for c in range(1, p):
            m.add_implication(y[w][c - 1], y[u][c - 1])
    # No empty stage: sum_v x[v, k] >= 1.
    for k in range(p):
        m.add(sum(var.x(v, k) for v in range(n)) >= 1)
    # Crossing: z[u, c] >= y[u, c] - y[w, c] for every edge u -> w (only outputs with bytes matter).
    for u in var.senders:
        for w in data.succ[u]:
            for c in range(1, p):
                m.add(var.z[u, c] >= y[u][c - 1] - y[w][c - 1])
    # One mode per stage: sum_m r[k, m] = 1.
    for row in var.r:
        m.add_exactly_one(row)
    _stage_times(m, data, var, tick_s)
    _memory(m, data, var)


def _stage_times(m: Any, data: DagData, var: DagVars, tick_s: float) -> None:
    """t_k >= C_k + X_k / bw + X_{k+1} / bw (additive; overlapped: t_k >= C_k, t_k >= back + W_k,
    t_k >= out + W_k) and B >= t_k, every term in ticks rounded down; C_k with the least time
    over the modes always, and with mode m's if r[k, m]."""
    from ortools.sat.python import cp_model

    n, p = data.num_layers, data.num_stages
    senders = var.senders

    def sends(c: int, per_byte: float) -> Any:  # X_c / bw in ticks, rounded down
        if c in (0, p) or per_byte == 0.0:
            return 0
        coef = np.floor(data.own_bytes[senders] * per_byte / tick_s).astype(np.int64).tolist()
        return cp_model.LinearExpr.weighted_sum([var.z[u, c] for u in senders], coef) if senders else 0

    least_ticks = np.floor(data.least_time_s / tick_s).astype(np.int64)
    mode_ticks = np.floor(data.time_s / tick_s).astype(np.int64)
    wave_ticks = np.floor(data.wave_s / tick_s).astype(np.int64)
    t = var.t
    overlap = data.problem.cost.options.overlap_comm
    for k in range(p):
        back, out = sends(k, data.back_s_per_byte[k]), sends(k + 1, data.out_s_per_byte[k])
        wave = sum(int(wave_ticks[v]) * var.x(v, k) for v in range(n) if wave_ticks[v])
        # the least time over the modes, always; a mode's own where it is chosen (and takes longer)
        rows = [(least_ticks[k], None)]
        rows += [(mode_ticks[j, k], var.r[k][j]) for j in range(len(var.r[k]) if var.r else 0)
                 if (mode_ticks[j, k] > least_ticks[k]).any()]
        for ticks, chosen in rows:
            comp = sum(int(ticks[v]) * var.x(v, k) for v in range(n))
            row = m.add(t[k] >= comp) if overlap else m.add(t[k] >= comp + back + out)
            if chosen is not None:
                row.only_enforce_if(chosen)
        if overlap:
            m.add(t[k] >= back + wave)
            m.add(t[k] >= out + wave)
        m.add(var.bottleneck >= t[k])


def _memory(m: Any, data: DagData, var: DagVars) -> None:
    """M^m_k <= cap_k for every stage and mode whose layers could overflow it, if r[k, m] (in
    units, rounded towards acceptance: held bytes down, shared bytes up, the capacity with its
    margin down)."""
    n, p = data.num_layers, data.num_stages
    x = var.x
    n_modes = len(data.modes)
    largest = max(max(data.capacity_bytes), float(data.mem_bytes.max(initial=0.0)), 1.0,
                  *(b for k in range(p) for j in range(n_modes) for b, _, _ in data.boundary_terms(k, j)))
    unit = max(1.0, largest / MEMORY_UNITS)
    for k in range(p):
        cap = data.capacity_bytes[k]
        shared: dict[int, Any] = {}  # b[v, k]: v and v - 1 both in stage k (one for every mode)
        for j in range(n_modes):
            if data.most_memory_bytes(k, j) <= cap:
                continue  # the whole model fits in this mode: no constraint
            if cap < 0:
                row = m.add(sum(x(v, k) for v in range(n)) <= 0)  # reserved memory alone overflows
            else:
                need = [math.floor(b / unit) for b in data.mem_bytes[j, k].tolist()]  # <= 1e9 each
                terms = [need[v] * x(v, k) for v in range(n)]
                terms += [math.floor(b / unit) * var.z[u, c] for b, u, c in data.boundary_terms(k, j) if b > 0]
                for v in range(1, n):
                    sh = math.ceil(float(data.shared_bytes[j, k, v]) / unit)
                    if sh > 0:  # b <= x[v, k], b <= x[v-1, k]
                        if v not in shared:
                            shared[v] = b = m.new_bool_var(f"b_{v}_{k}")
                            m.add(b <= x(v, k))
                            m.add(b <= x(v - 1, k))
                        terms.append(-sh * shared[v])
                row = m.add(sum(terms) <= math.floor((cap + dag.memory_margin_bytes(data, k, j)) / unit))
            if var.r:
                row.only_enforce_if(var.r[k][j])


def _hint(m: Any, var: DagVars, stages: list[int] | tuple[int, ...], modes: list[int] | None = None) -> None:
    """An assignment (and each stage's mode) as CP-SAT's solution hint (its order encoding)."""
    for ys, values in zip(var.y, dag.order_values(stages, len(var.t)), strict=True):
        for yc, value in zip(ys, values, strict=True):
            m.add_hint(yc, value)
    if var.r and modes is not None:
        for row, mode in zip(var.r, modes, strict=True):
            for j, rj in enumerate(row):
                m.add_hint(rj, j == mode)


def _extract(data: DagData, solver: Any, var: DagVars) -> DagPlan:
    """The solver's assignment, priced exactly."""
    return dag.price_order(data, [[int(solver.boolean_value(yc)) for yc in row] for row in var.y])


def _tie_break(m: Any, solver: Any, data: DagData, var: DagVars, found: DagPlan, tick_s: float,
               time_limit_s: float, details: SolveDetails) -> DagPlan:
    """Second solve: among assignments within the optimum, the least total stage time. A stage's
    ticks round each layer down, so two plans of the same exact bottleneck can differ by up to
    n ticks: the bound leaves room for n, and the answer is taken only if its exact bottleneck is
    within those n ticks of the first answer's."""
    n = data.num_layers
    m.add(var.bottleneck <= int(solver.objective_value) + n)  # B <= B* + n
    m.minimize(sum(var.t))  # minimise sum_k t_k
    m.clear_hints()
    _hint(m, var, found.stages, data.mode_indices(found.solution))
    if not solve_again(solver, m, time_limit_s, details):
        return found
    return dag.tie_break_winner(found, _extract(data, solver, var), n * tick_s)
