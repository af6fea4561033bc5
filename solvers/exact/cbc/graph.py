"""The graph problem (:mod:`solvers.exact.graph`) as a mixed-integer program for CBC (through PuLP).

``y`` binary (the order encoding), ``z`` (crossing) and ``b`` (shared input) continuous in
``[0, 1]``: at an integer ``y`` the least ``z`` and the largest ``b`` the rows allow are the
true indicators, and the objective and memory rows only ever gain from choosing them. Times
are in units of the longest any stage could take / 1000 and memory in GiB, where CBC's
absolute tolerances are negligible; the bound (read from CBC's log) is reported less ``1e-6``
of that longest time. The assignment found is priced exactly on the reordered profile, and a
plan the cost model's memory check refuses (CBC's tolerance) is dropped for the DP's.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from solvers.exact.cbc.run import cbc_bound, run_cbc
from solvers.exact.graph import DagData, DagPlan, finish_dag, price_assignment, single_stage
from solvers.result import SolveResult, SolveStatus

__all__ = ["solve_dag"]

log = logging.getLogger(__name__)

SCALE_MAX = 1000.0  # the longest stage time possible, in model units
TOLERANCE_SLACK = 1e-6  # of that time, taken off CBC's bound
GIB = 2.0**30


def solve_dag(data: DagData, *, time_limit_s: float, threads: int, seed: int, prune: bool, tie_break: bool,
              t0: float, details: dict[str, Any]) -> SolveResult:
    """Minimum-bottleneck convex stages over ``data``'s devices by CBC (see :mod:`solvers.exact.graph`)."""
    import pulp

    n, p = data.num_layers, data.num_stages
    trivial = single_stage(data, "milp", t0, details)
    if trivial is not None:
        return trivial
    largest = data.stage_time_bound_s()
    unit_s = largest / SCALE_MAX if largest > 0 else 1.0
    details.update(unit_s=unit_s, layers=n, stages=p, edges=len(data.edges))
    prob = pulp.LpProblem("graph", pulp.LpMinimize)

    # Variables: y[v][c] = 1 iff layer v is before cut c (c = 1..p-1); z[u, c] = u's output crosses
    # cut c; t[k] = stage k's time and B the bottleneck (units of unit_s).
    y = [[prob.add_variable(f"y_{v}_{c}", cat=pulp.LpBinary) for c in range(1, p)] for v in range(n)]

    def before(v: int, c: int) -> Any:
        return 0 if c == 0 else 1 if c == p else y[v][c - 1]

    def x(v: int, k: int) -> Any:
        return before(v, k + 1) - before(v, k)

    t = [prob.add_variable(f"t_{k}", lowBound=0) for k in range(p)]
    bottleneck = prob.add_variable("B", lowBound=0)
    prob += bottleneck  # objective: minimise B

    # Stages in order: y[v, c] <= y[v, c+1]. Precedence: y[w, c] <= y[u, c] for every edge u -> w.
    for v in range(n):
        for c in range(1, p - 1):
            prob += y[v][c - 1] <= y[v][c]
    for u, w in data.edges:
        for c in range(1, p):
            prob += y[w][c - 1] <= y[u][c - 1]
    # No empty stage: sum_v x[v, k] >= 1.
    for k in range(p):
        prob += pulp.lpSum(x(v, k) for v in range(n)) >= 1
    # Crossing: z[u, c] >= y[u, c] - y[w, c] for every edge u -> w.
    senders = [u for u in range(n) if data.succ[u] and data.own_bytes[u] > 0]
    z = {(u, c): prob.add_variable(f"z_{u}_{c}", lowBound=0, upBound=1) for u in senders for c in range(1, p)}
    for u in senders:
        for w in data.succ[u]:
            for c in range(1, p):
                prob += z[u, c] >= y[u][c - 1] - y[w][c - 1]

    def sends(c: int, per_byte: float) -> Any:
        if c in (0, p) or per_byte == 0.0:
            return 0
        return pulp.lpSum(float(data.own_bytes[u]) * per_byte / unit_s * z[u, c] for u in senders)

    overlap = data.problem.cost.options.overlap_comm
    for k in range(p):
        comp = pulp.lpSum(float(data.time_s[k, v]) / unit_s * x(v, k) for v in range(n))
        wave = pulp.lpSum(float(data.wave_s[v]) / unit_s * x(v, k) for v in range(n) if data.wave_s[v])
        back, out = sends(k, data.back_s_per_byte[k]), sends(k + 1, data.out_s_per_byte[k])
        # Additive: t_k >= C_k + back + out; overlapped: t_k >= C_k, t_k >= back + W_k, t_k >= out + W_k.
        if overlap:
            prob += t[k] >= comp
            prob += t[k] >= back + wave
            prob += t[k] >= out + wave
        else:
            prob += t[k] >= comp + back + out
        prob += bottleneck >= t[k]
    _memory(prob, data, x)

    start = data.hint_stages()
    hint_plan = price_assignment(data, start) if start is not None else None
    if hint_plan is not None and prune:
        prob += bottleneck <= hint_plan.solution.bottleneck_s / unit_s * (1 + 1e-6) + 1e-6
    if start is not None:
        for v in range(n):
            for c in range(1, p):
                y[v][c - 1].setInitialValue(1 if start[v] < c else 0)

    cbc_log = run_cbc(prob, time_limit_s, threads, seed, warm_start=start is not None)
    details.update(cbc_status=pulp.LpStatus[prob.status], cbc_solution=prob.sol_status)
    if prob.status == pulp.LpStatusInfeasible:
        return finish_dag(data, "milp", SolveStatus.INFEASIBLE, None, math.nan, time.perf_counter() - t0, details)
    raw = cbc_bound(cbc_log)
    bound = max(0.0, raw * unit_s - TOLERANCE_SLACK * largest) if math.isfinite(raw) else math.nan
    details["bound_s"] = bound
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return finish_dag(data, "milp", SolveStatus.UNKNOWN, None, bound, time.perf_counter() - t0, details,
                          reason=f"no plan found within the time limit of {time_limit_s:g} s")

    def extract() -> DagPlan:
        return price_assignment(data, [p - 1 - sum(round(y[v][c - 1].varValue or 0.0) for c in range(1, p))
                                       for v in range(n)])

    found = extract()
    proven = prob.sol_status == pulp.LpSolutionOptimal and math.isfinite(bound)
    remaining = time_limit_s - (time.perf_counter() - t0)
    if proven and tie_break and remaining > 0:
        # Second solve: among assignments within the optimum found (units, CBC's tolerance), the
        # least total stage time.
        best = float(bottleneck.varValue or 0.0)
        prob += bottleneck <= best + TOLERANCE_SLACK * SCALE_MAX
        prob.setObjective(pulp.lpSum(t))
        for v in range(n):
            for c in range(1, p):
                y[v][c - 1].setInitialValue(1 if found.stages[v] < c else 0)
        run_cbc(prob, remaining, threads, seed, warm_start=True, keep_log=False)
        details["tie_break"] = pulp.LpStatus[prob.status]
        if prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            again = extract()
            # within the slack the second model allows the bottleneck, the smaller total wins
            if again.fits and again.total_s < found.total_s and \
                    again.solution.bottleneck_s <= found.solution.bottleneck_s + 2 * TOLERANCE_SLACK * SCALE_MAX * unit_s:
                found = again
    status = SolveStatus.OPTIMAL if proven else SolveStatus.FEASIBLE
    log.debug("milp (graph): %s, objective %.6g s, bound %.6g s", status, found.solution.bottleneck_s, bound)
    return finish_dag(data, "milp", status, found, bound, time.perf_counter() - t0, details)


def _memory(prob: Any, data: DagData, x: Any) -> None:
    """M_k <= cap_k (GiB) for every stage whose layers could overflow it."""
    import pulp

    n, p = data.num_layers, data.num_stages
    for k in range(p):
        cap = data.capacity_bytes[k]
        if float(data.mem_bytes[k].sum()) <= cap:
            continue
        terms = [float(data.mem_bytes[k, v]) / GIB * x(v, k) for v in range(n)]
        for v in range(1, n):
            sh = float(data.shared_bytes[k, v])
            if sh > 0:  # b <= x[v, k], b <= x[v-1, k]: v and v - 1 both in stage k
                b = prob.add_variable(f"b_{v}_{k}", lowBound=0, upBound=1)
                prob += b <= x(v, k)
                prob += b <= x(v - 1, k)
                terms.append(-sh / GIB * b)
        prob += pulp.lpSum(terms) <= cap / GIB
