"""The graph problem (:mod:`solvers.exact.graph`) as a mixed-integer program for CBC (through PuLP).

``y`` binary (the order encoding), ``z`` (crossing) and ``b`` (shared input) continuous in
``[0, 1]``: at an integer ``y`` the least ``z`` and the largest ``b`` the rows allow are the
true indicators, and the objective and memory rows only ever gain from choosing them. Times
are in units of the longest any stage could take / 1000 and memory in GiB, where CBC's
absolute tolerances are negligible; the bound (read from CBC's log) is reported less ``1e-6``
of that longest time. A memory row's capacity has a margin for floating point
(:func:`solvers.exact.graph.memory_margin_bytes`), so a stage that needs exactly its device's
memory is a solution; a stage CBC accepts (that margin, or its tolerance) that the cost model
refuses is excluded and the model solved again (:func:`solvers.exact.graph.overflowing_stages`).
The assignment found is priced exactly on the reordered profile.
A stage's recompute mode (with several allowed) is a binary per mode; its time and memory rows
hold when it is chosen, by the least big-M that leaves them void otherwise (given per row).
"""

from __future__ import annotations

import logging
import math
import time
from functools import partial
from typing import Any

from solvers.exact import graph as dag
from solvers.exact.cbc.run import (
    TOLERANCE_SLACK,
    bound_s,
    cbc_failed_or,
    run_cbc,
    run_first,
    solve_again,
    solve_status,
)
from solvers.exact.graph import DagData, DagPlan, DagVars
from solvers.exact.intervals import no_plan_reason, unsolved
from solvers.result import SolveDetails, SolveResult, SolveStatus

__all__ = ["solve_dag"]

log = logging.getLogger(__name__)

SCALE_MAX = 1000.0  # the longest stage time possible, in model units
GIB = 2.0**30


def solve_dag(data: DagData, *, time_limit_s: float, threads: int, seed: int, prune: bool, tie_break: bool,
              t0: float, details: SolveDetails) -> SolveResult:
    """Minimum-bottleneck convex stages over ``data``'s devices by CBC (see :mod:`solvers.exact.graph`)."""
    import pulp

    n, p = data.num_layers, data.num_stages
    trivial = dag.single_stage(data, "milp", t0, details)
    if trivial is not None:
        return trivial
    largest = data.stage_time_bound_s()
    unit_s = largest / SCALE_MAX if largest > 0 else 1.0
    details.update({"unit_s": unit_s, "layers": n, "stages": p, "edges": len(data.edges)})

    prob = pulp.LpProblem("graph", pulp.LpMinimize)
    var = _variables(prob, data)
    prob += var.bottleneck  # objective: minimise B
    _constraints(prob, data, var, unit_s)
    hint_plan = data.hint_plan()
    if hint_plan is not None and prune:  # B <= the DP's bottleneck, to CBC's tolerance
        prob += var.bottleneck <= hint_plan.solution.bottleneck_s / unit_s * (1 + 1e-6) + 1e-6
    start = data.hint_stages()
    if start is not None:
        _warm(var, start, data.hint_modes())

    cbc_log = run_first(prob, time_limit_s, threads, seed, warm_start=start is not None, details=details)
    details.update({"cbc_status": pulp.LpStatus[prob.status], "cbc_solution": prob.sol_status})
    bound = bound_s(cbc_log, unit_s, largest)
    status = solve_status(prob, bound, None)
    answer = partial(dag.finish_dag, data, "milp")
    reason = cbc_failed_or(details, no_plan_reason(time_limit_s))
    if (done := unsolved(answer, status, bound, t0, details, reason)) is not None:
        return done
    found, status, bound = _settle(prob, data, var, status, bound, unit_s, largest, time_limit_s, threads, seed, t0,
                                   details)
    if found is None:
        return answer(SolveStatus.INFEASIBLE, None, math.nan, time.perf_counter() - t0, details)
    details["bound_s"] = bound
    remaining = time_limit_s - (time.perf_counter() - t0)
    if status is SolveStatus.OPTIMAL and tie_break and remaining > 0:
        found = _tie_break(prob, data, var, found, unit_s, remaining, threads, seed, details)
    log.debug("milp (graph): %s, objective %.6g s, bound %.6g s", status, found.solution.bottleneck_s, bound)
    return answer(status, found, bound, time.perf_counter() - t0, details)


def _settle(prob: Any, data: DagData, var: DagVars, status: SolveStatus, bound: float, unit_s: float,
            largest: float, time_limit_s: float, threads: int, seed: int, t0: float,
            details: SolveDetails) -> tuple[DagPlan | None, SolveStatus, float]:
    """CBC's assignment, once no stage of it overflows its device in the mode the model chose:
    each such (assignment, stage, mode) is excluded and the model solved again (within the time
    left, at most :data:`~solvers.exact.graph.MAX_OVERFLOW_ROUNDS` times). The plan (None:
    nothing else fits), its status (FEASIBLE where the rounds or the time ran out first) and the
    bound, which stays valid: only stages the cost model refuses are excluded."""
    import pulp

    rounds = 0
    while True:
        found, modes = _extract(data, var), _modes(data, var)
        over = dag.overflowing_stages(data, found, modes)
        if not over:
            return found, status, bound
        remaining = time_limit_s - (time.perf_counter() - t0)
        if rounds == dag.MAX_OVERFLOW_ROUNDS or remaining <= 0:
            return found, SolveStatus.FEASIBLE, bound
        rounds += 1
        details["overflow_rounds"] = rounds
        values = [[round(yc.varValue or 0.0) for yc in row] for row in var.y]
        other = pulp.lpSum((1 - yc) if value else yc for row, vals in zip(var.y, values, strict=True)
                           for yc, value in zip(row, vals, strict=True))
        for k in over:  # another assignment, or stage k in another mode
            prob += other + ((1 - var.r[k][modes[k]]) if var.r else 0) >= 1, f"overflow_{rounds}_{k}"
        start = data.hint_stages()
        if start is not None:
            _warm(var, start, data.hint_modes())
        try:
            cbc_log = run_cbc(prob, remaining, threads, seed, warm_start=start is not None)
        except pulp.PulpSolverError as err:
            log.warning("CBC failed solving again without an overflowing stage (%s)", err)
            return found, SolveStatus.FEASIBLE, bound
        details.update({"cbc_status": pulp.LpStatus[prob.status], "cbc_solution": prob.sol_status})
        again_bound = bound_s(cbc_log, unit_s, largest)
        again = solve_status(prob, again_bound, None)
        if again is SolveStatus.INFEASIBLE:
            return None, again, bound
        if again is SolveStatus.UNKNOWN:  # no plan in the time left: the last one, unproven
            return found, SolveStatus.FEASIBLE, bound
        status = again
        bound = max(bound, again_bound) if math.isfinite(again_bound) else bound


def _modes(data: DagData, var: DagVars) -> list[int]:
    """The mode (an index in ``data.modes``) CBC chose for every stage."""
    if not var.r:
        return [0] * data.num_stages
    return [max(range(len(row)), key=lambda j: row[j].varValue or 0.0) for row in var.r]


def _variables(prob: Any, data: DagData) -> DagVars:
    """y binary (and r, with several recompute modes), z in [0, 1], t[k] and B non-negative."""
    import pulp

    n, p = data.num_layers, data.num_stages
    senders = data.senders()
    y = [[prob.add_variable(f"y_{v}_{c}", cat=pulp.LpBinary) for c in range(1, p)] for v in range(n)]
    t = [prob.add_variable(f"t_{k}", lowBound=0) for k in range(p)]
    bottleneck = prob.add_variable("B", lowBound=0)
    z = {(u, c): prob.add_variable(f"z_{u}_{c}", lowBound=0, upBound=1) for u in senders for c in range(1, p)}
    modes = len(data.modes)
    r = [[prob.add_variable(f"r_{k}_{j}", cat=pulp.LpBinary) for j in range(modes)] for k in range(p)] \
        if modes > 1 else []
    return DagVars(y, z, t, bottleneck, senders, r)


def _constraints(prob: Any, data: DagData, var: DagVars, unit_s: float) -> None:
    """Order, precedence, no empty stage, crossings, stage times, memory (the groups of
    :mod:`solvers.exact.graph`)."""
    import pulp

    n, p = data.num_layers, data.num_stages
    y = var.y
    # Stages in order: y[v, c] <= y[v, c+1]. Precedence: y[w, c] <= y[u, c] for every edge u -> w.
    for v in range(n):
        for c in range(1, p - 1):
            prob += y[v][c - 1] <= y[v][c]
    for u, w in data.edges:
        for c in range(1, p):
            prob += y[w][c - 1] <= y[u][c - 1]
    # No empty stage: sum_v x[v, k] >= 1.
    for k in range(p):
        prob += pulp.lpSum(var.x(v, k) for v in range(n)) >= 1
    # Crossing: z[u, c] >= y[u, c] - y[w, c] for every edge u -> w.
    for u in var.senders:
        for w in data.succ[u]:
            for c in range(1, p):
                prob += var.z[u, c] >= y[u][c - 1] - y[w][c - 1]
    # One mode per stage: sum_m r[k, m] = 1.
    for row in var.r:
        prob += pulp.lpSum(row) == 1
    _stage_times(prob, data, var, unit_s)
    _memory(prob, data, var)


def _stage_times(prob: Any, data: DagData, var: DagVars, unit_s: float) -> None:
    """t_k >= C_k + X_k / bw + X_{k+1} / bw (additive; overlapped: t_k >= C_k, t_k >= back + W_k,
    t_k >= out + W_k) and B >= t_k, in units of ``unit_s``; C_k with the least time over the
    modes always, and with mode m's if r[k, m]:  t_k >= C^m_k + ... - D^m_k (1 - r[k, m]), where
    ``D^m_k = sum_v (t^m_k(v) - t^0_k(v)) >= C^m_k - C^0_k`` leaves the row below the first when
    r[k, m] = 0."""
    import pulp

    n, p = data.num_layers, data.num_stages

    def sends(c: int, per_byte: float) -> Any:
        if c in (0, p) or per_byte == 0.0:
            return 0
        return pulp.lpSum(float(data.own_bytes[u]) * per_byte / unit_s * var.z[u, c] for u in var.senders)

    t = var.t
    overlap = data.problem.cost.options.overlap_comm
    least = data.least_time_s
    for k in range(p):
        wave = pulp.lpSum(float(data.wave_s[v]) / unit_s * var.x(v, k) for v in range(n) if data.wave_s[v])
        back, out = sends(k, data.back_s_per_byte[k]), sends(k + 1, data.out_s_per_byte[k])
        rows: list[tuple[Any, float, Any]] = [(least[k], 0.0, None)]  # (per-layer times, D, r)
        for j, rj in enumerate(var.r[k] if var.r else []):
            more = data.time_s[j, k] - least[k]
            if (more > 0).any():
                rows.append((data.time_s[j, k], float(more.sum()) / unit_s, rj))
        for times, slack, chosen in rows:
            comp = pulp.lpSum(float(times[v]) / unit_s * var.x(v, k) for v in range(n))
            if chosen is not None:
                comp = comp - slack * (1 - chosen)
            prob += (t[k] >= comp) if overlap else (t[k] >= comp + back + out)
        if overlap:
            prob += t[k] >= back + wave
            prob += t[k] >= out + wave
        prob += var.bottleneck >= t[k]


def _memory(prob: Any, data: DagData, var: DagVars) -> None:
    """M^m_k <= cap_k (GiB) for every stage and mode whose layers could overflow it; with several
    modes, M^m_k <= cap_k + (U^m_k - cap_k) (1 - r[k, m]), ``U^m_k`` the most the row can reach
    (every layer and crossing, nothing shared), so the row is void unless r[k, m]."""
    import pulp

    n, p = data.num_layers, data.num_stages
    x = var.x
    for k in range(p):
        cap = data.capacity_bytes[k]
        shared: dict[int, Any] = {}  # b[v, k]: v and v - 1 both in stage k (one for every mode)
        for j in range(len(data.modes)):
            most = data.most_memory_bytes(k, j)
            if most <= cap:
                continue
            terms = [float(data.mem_bytes[j, k, v]) / GIB * x(v, k) for v in range(n)]
            terms += [b / GIB * var.z[u, c] for b, u, c in data.boundary_terms(k, j) if b > 0]
            for v in range(1, n):
                sh = float(data.shared_bytes[j, k, v])
                if sh > 0:  # b <= x[v, k], b <= x[v-1, k]: v and v - 1 both in stage k
                    if v not in shared:
                        shared[v] = b = prob.add_variable(f"b_{v}_{k}", lowBound=0, upBound=1)
                        prob += b <= x(v, k)
                        prob += b <= x(v - 1, k)
                    terms.append(-sh / GIB * shared[v])
            margin = dag.memory_margin_bytes(data, k, j)  # for floating point: a stage may fill its device
            slack = (most - cap) / GIB * (1 - var.r[k][j]) if var.r else 0.0
            prob += pulp.lpSum(terms) <= (cap + margin) / GIB + slack


def _warm(var: DagVars, stages: list[int] | tuple[int, ...], modes: list[int] | None = None) -> None:
    """An assignment (and each stage's mode) as CBC's warm start (its order encoding)."""
    for ys, values in zip(var.y, dag.order_values(stages, len(var.t)), strict=True):
        for yc, value in zip(ys, values, strict=True):
            yc.setInitialValue(1 if value else 0)
    if var.r and modes is not None:
        for row, mode in zip(var.r, modes, strict=True):
            for j, rj in enumerate(row):
                rj.setInitialValue(1 if j == mode else 0)


def _extract(data: DagData, var: DagVars) -> DagPlan:
    """CBC's assignment, priced exactly."""
    return dag.price_order(data, [[round(yc.varValue or 0.0) for yc in row] for row in var.y])


def _tie_break(prob: Any, data: DagData, var: DagVars, found: DagPlan, unit_s: float, time_limit_s: float,
               threads: int, seed: int, details: SolveDetails) -> DagPlan:
    """Second solve: among assignments within the optimum found (units, CBC's tolerance), the
    least total stage time; taken within the slack it allows the bottleneck."""
    import pulp

    best = float(var.bottleneck.varValue or 0.0)
    prob += var.bottleneck <= best + TOLERANCE_SLACK * SCALE_MAX  # B <= B* + slack
    prob.setObjective(pulp.lpSum(var.t))  # minimise sum_k t_k
    _warm(var, found.stages, data.mode_indices(found.solution))
    if not solve_again(prob, time_limit_s, threads, seed, details):
        return found
    return dag.tie_break_winner(found, _extract(data, var), 2 * TOLERANCE_SLACK * SCALE_MAX * unit_s)
