"""The chain problem as a mixed-integer program for CBC (through PuLP), with a lower bound.

Same problem and formulation as :mod:`solvers.exact.cpsat.chain` (see :mod:`solvers.exact.intervals`), with a
continuous bottleneck variable. Times are divided by a unit (the largest stage time over
1000) so the coefficients are of order one to a thousand, where CBC's absolute tolerances
(1e-7 primal, 1e-6 integrality) are negligible.

What PuLP gives back from CBC: a status and the variable values, and nothing about the
bound. PuLP reports a run stopped at its time limit with a plan as ``LpStatusOptimal``; only
``sol_status`` (``LpSolutionIntegerFeasible``) tells it apart from a proof. The bound is
read from CBC's own log (``logPath``): ``Objective value`` on a proof of optimality, or
``Lower bound`` on a stopped run. If the log has no bound, the lower bound is NaN and the
status FEASIBLE. The bound is CBC's, in floating point with CBC's tolerances, so it is
reported less a slack of ``1e-6`` of the largest stage time; the plan's objective is
recomputed exactly from the chosen cuts with the cost model. Once optimality is proven, a
second solve breaks ties among the optimal splits as the DP's second pass does (shortest
pipeline, least total stage time).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np

from partitioner.errors import PartitionerError
from solvers.exact.cbc.run import cbc_bound, run_cbc
from solvers.exact.intervals import (
    Arcs,
    ChainProblem,
    finish,
    model_arcs,
)
from solvers.pipeline.dp import ChainSolution
from solvers.result import SolveResult, SolveStatus

__all__ = ["solve_chain"]

log = logging.getLogger(__name__)

SCALE_MAX = 1000.0  # the largest stage time, in model units
TOLERANCE_SLACK = 1e-6  # of the largest stage time, taken off CBC's bound

def solve_chain(problem: ChainProblem, *, time_limit_s: float, threads: int, seed: int, tie_break: bool,
                t0: float, hint: bool, prune: bool, max_arcs: int) -> SolveResult:
    """Minimum-bottleneck split of ``problem``'s devices, in their order, by CBC (the chain model
    of :mod:`solvers.exact.intervals`; the options as :func:`solvers.exact.router.solve`)."""
    import pulp

    start, arcs, details = model_arcs(problem, hint, prune, max_arcs)
    details["mapping"] = "given"
    if not arcs.lengths:  # more devices than layers and no shorter pipeline allowed
        return finish(problem, "milp", SolveStatus.INFEASIBLE, None, math.nan,
                      time.perf_counter() - t0, details)

    largest = float(arcs.time_s.max(initial=0.0))
    unit_s = largest / SCALE_MAX if largest > 0 else 1.0
    coef = (arcs.time_s / unit_s).tolist()
    details["unit_s"] = unit_s
    n_layers = problem.profile.num_layers

    prob = pulp.LpProblem("chain", pulp.LpMinimize)

    # Variables: x[a] = 1 when arc a (stage k of the q-stage pipeline holds [i, j)) is chosen;
    # y[q] = 1 when the pipeline has q stages; B >= 0 = the bottleneck in units of unit_s.
    x = [prob.add_variable(f"x_{a}", cat=pulp.LpBinary) for a in range(len(arcs))]
    y = {q: prob.add_variable(f"y_{q}", cat=pulp.LpBinary) for q in arcs.lengths}
    bottleneck = prob.add_variable("bottleneck", lowBound=0)

    # Objective: minimise B.
    prob += bottleneck

    # One pipeline length: sum_q y[q] = 1.
    prob += pulp.lpSum(y.values()) == 1, "one_length"

    # Flow: sum_j x[q, 0, 0, j] = y[q], and for 0 < k < q at every cut c:
    # sum_i x[q, k-1, i, c] = sum_j x[q, k, c, j].
    ending, starting = arcs.incidence()
    for q in arcs.lengths:
        prob += pulp.lpSum(x[a] for a in starting.get((q, 0, 0), [])) == y[q], f"leave_{q}"
        for k in range(1, q):
            for c in range(1, n_layers):
                ins, outs = ending.get((q, k - 1, c), []), starting.get((q, k, c), [])
                if ins or outs:
                    prob += (pulp.lpSum(x[a] for a in ins) == pulp.lpSum(x[a] for a in outs),
                             f"flow_{q}_{k}_{c}")

    # Bottleneck: B >= sum_{i,j} T[q, k, i, j] * x[q, k, i, j] for every stage (q, k).
    for (q, k), idx in arcs.groups().items():
        prob += bottleneck >= pulp.lpSum(coef[a] * x[a] for a in idx), f"stage_{q}_{k}"

    if start is not None:
        chosen = set(arcs.index_of(start))
        for a, var in enumerate(x):
            var.setInitialValue(1 if a in chosen else 0)
        for q, var in y.items():
            var.setInitialValue(1 if q == len(start.devices) else 0)
        bottleneck.setInitialValue(max(coef[a] for a in chosen))

    # Solve, with CBC's log kept to read its bound.
    cbc_log = run_cbc(prob, time_limit_s, threads, seed, warm_start=start is not None)
    status_text = pulp.LpStatus[prob.status]
    details.update(cbc_status=status_text, cbc_solution=prob.sol_status)

    # Extract: the chosen arcs, priced exactly; CBC's bound converted back, less the slack.
    if prob.status == pulp.LpStatusInfeasible:
        return finish(problem, "milp", SolveStatus.INFEASIBLE, None, math.nan,
                      time.perf_counter() - t0, details)
    raw = cbc_bound(cbc_log)
    bound = max(0.0, raw * unit_s - TOLERANCE_SLACK * largest) if math.isfinite(raw) else math.nan
    details["bound_s"] = bound  # as converted, before capping at the plan's objective
    has_plan = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    if not has_plan:
        if prob.status not in (pulp.LpStatusNotSolved, pulp.LpStatusOptimal):
            raise PartitionerError(f"CBC ended with status {status_text} on the chain model")
        return finish(problem, "milp", SolveStatus.UNKNOWN, None, bound, time.perf_counter() - t0, details,
                      reason=f"no plan found within the time limit of {time_limit_s:g} s "
                             f"({len(arcs)} candidate stages)")
    picked = [a for a, var in enumerate(x) if (var.varValue or 0.0) > 0.5]
    sol = arcs.solution(picked, problem.cost, problem.devices, problem.schedule, problem.micro_batches)
    proven = prob.sol_status == pulp.LpSolutionOptimal and math.isfinite(bound)
    remaining = time_limit_s - (time.perf_counter() - t0)
    if proven and tie_break and remaining > 0:
        sol = _tie_break(prob, x, y, coef, arcs, picked, sol, problem, remaining, threads, seed, details)
    status = SolveStatus.OPTIMAL if proven else SolveStatus.FEASIBLE
    log.debug("milp: %s, %d arcs, objective %.6g s, bound %.6g s", status, len(arcs), sol.bottleneck_s, bound)
    return finish(problem, "milp", status, sol, bound, time.perf_counter() - t0, details)


def _tie_break(prob: Any, x: list[Any], y: dict[int, Any], coef: list[float], arcs: Arcs, picked: list[int],
               sol: ChainSolution, problem: ChainProblem, time_limit_s: float, threads: int, seed: int,
               details: dict[str, object]) -> ChainSolution:
    """The DP's second pass on CBC: stages within the optimum found (exact seconds, as the DP
    compares), the shortest pipeline, then the least total stage time. ``sol`` if CBC finds nothing."""
    import pulp

    for a in np.flatnonzero(arcs.time_s > sol.bottleneck_s).tolist():
        x[a].upBound = 0
    weight = max(arcs.lengths) * (SCALE_MAX + 1.0) + 1.0
    prob.setObjective(weight * pulp.lpSum(q * var for q, var in y.items()) + pulp.lpSum(c * v for c, v in zip(coef, x,
                                                                                                            strict=True)))
    chosen = set(picked)
    for a, var in enumerate(x):
        var.setInitialValue(1 if a in chosen else 0)
    run_cbc(prob, time_limit_s, threads, seed, warm_start=True, keep_log=False)
    details["tie_break"] = pulp.LpStatus[prob.status]
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return sol
    again = [a for a, var in enumerate(x) if (var.varValue or 0.0) > 0.5]
    return arcs.solution(again, problem.cost, problem.devices, problem.schedule, problem.micro_batches)
