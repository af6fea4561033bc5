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
import time
from functools import partial
from typing import Any

from solvers.exact import graph as dag
from solvers.exact.cbc.run import (
    TOLERANCE_SLACK,
    bound_s,
    run_cbc,
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
        _warm(var, start)

    cbc_log = run_cbc(prob, time_limit_s, threads, seed, warm_start=start is not None)
    details.update({"cbc_status": pulp.LpStatus[prob.status], "cbc_solution": prob.sol_status})
    bound = bound_s(cbc_log, unit_s, largest)
    status = solve_status(prob, bound, None)
    answer = partial(dag.finish_dag, data, "milp")
    if (done := unsolved(answer, status, bound, t0, details, no_plan_reason(time_limit_s))) is not None:
        return done
    found = _extract(data, var)
    remaining = time_limit_s - (time.perf_counter() - t0)
    if status is SolveStatus.OPTIMAL and tie_break and remaining > 0:
        found = _tie_break(prob, data, var, found, unit_s, remaining, threads, seed, details)
    log.debug("milp (graph): %s, objective %.6g s, bound %.6g s", status, found.solution.bottleneck_s, bound)
    return answer(status, found, bound, time.perf_counter() - t0, details)


def _variables(prob: Any, data: DagData) -> DagVars:
    """y binary, z in [0, 1], t[k] and B non-negative."""
    import pulp

    n, p = data.num_layers, data.num_stages
    senders = data.senders()
    y = [[prob.add_variable(f"y_{v}_{c}", cat=pulp.LpBinary) for c in range(1, p)] for v in range(n)]
    t = [prob.add_variable(f"t_{k}", lowBound=0) for k in range(p)]
    bottleneck = prob.add_variable("B", lowBound=0)
    z = {(u, c): prob.add_variable(f"z_{u}_{c}", lowBound=0, upBound=1) for u in senders for c in range(1, p)}
    return DagVars(y, z, t, bottleneck, senders)


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
    _stage_times(prob, data, var, unit_s)
    _memory(prob, data, var)


def _stage_times(prob: Any, data: DagData, var: DagVars, unit_s: float) -> None:
    """t_k >= C_k + X_k / bw + X_{k+1} / bw (additive; overlapped: t_k >= C_k, t_k >= back + W_k,
    t_k >= out + W_k) and B >= t_k, in units of ``unit_s``."""
    import pulp

    n, p = data.num_layers, data.num_stages

    def sends(c: int, per_byte: float) -> Any:
        if c in (0, p) or per_byte == 0.0:
            return 0
        return pulp.lpSum(float(data.own_bytes[u]) * per_byte / unit_s * var.z[u, c] for u in var.senders)

    t = var.t
    overlap = data.problem.cost.options.overlap_comm
    for k in range(p):
        comp = pulp.lpSum(float(data.time_s[k, v]) / unit_s * var.x(v, k) for v in range(n))
        wave = pulp.lpSum(float(data.wave_s[v]) / unit_s * var.x(v, k) for v in range(n) if data.wave_s[v])
        back, out = sends(k, data.back_s_per_byte[k]), sends(k + 1, data.out_s_per_byte[k])
        if overlap:
            prob += t[k] >= comp
            prob += t[k] >= back + wave
            prob += t[k] >= out + wave
        else:
            prob += t[k] >= comp + back + out
        prob += var.bottleneck >= t[k]


def _memory(prob: Any, data: DagData, var: DagVars) -> None:
    """M_k <= cap_k (GiB) for every stage whose layers could overflow it."""
    import pulp

    n, p = data.num_layers, data.num_stages
    x = var.x
    for k in range(p):
        cap = data.capacity_bytes[k]
        if float(data.mem_bytes[k].sum()) + data.most_boundary_bytes(k) <= cap:
            continue
        terms = [float(data.mem_bytes[k, v]) / GIB * x(v, k) for v in range(n)]
        terms += [b / GIB * var.z[u, c] for b, u, c in data.boundary_terms(k) if b > 0]
        for v in range(1, n):
            sh = float(data.shared_bytes[k, v])
            if sh > 0:  # b <= x[v, k], b <= x[v-1, k]: v and v - 1 both in stage k
                b = prob.add_variable(f"b_{v}_{k}", lowBound=0, upBound=1)
                prob += b <= x(v, k)
                prob += b <= x(v - 1, k)
                terms.append(-sh / GIB * b)
        prob += pulp.lpSum(terms) <= cap / GIB


def _warm(var: DagVars, stages: list[int] | tuple[int, ...]) -> None:
    """An assignment as CBC's warm start (its order encoding)."""
    for row, values in zip(var.y, dag.order_values(stages, len(var.t)), strict=True):
        for yc, value in zip(row, values, strict=True):
            yc.setInitialValue(1 if value else 0)


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
    _warm(var, found.stages)
    if not solve_again(prob, time_limit_s, threads, seed, details):
        return found
    return dag.tie_break_winner(found, _extract(data, var), 2 * TOLERANCE_SLACK * SCALE_MAX * unit_s)
