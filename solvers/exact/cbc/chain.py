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
import time
from functools import partial
from typing import Any

from solvers.exact import intervals
from solvers.exact.cbc.run import bound_s, cbc_failed_or, run_first, solve_again, solve_status
from solvers.exact.intervals import Arcs, ChainHint, ChainProblem, ChainVars
from solvers.pipeline.dp import ChainSolution
from solvers.result import SolveDetails, SolveResult, SolveStatus

__all__ = ["SCALE_MAX", "solve_chain"]

log = logging.getLogger(__name__)

SCALE_MAX = 1000.0  # the largest stage time, in model units


def solve_chain(problem: ChainProblem, *, time_limit_s: float, threads: int, seed: int, tie_break: bool,
                t0: float, hint: bool, prune: bool, max_arcs: int) -> SolveResult:
    """Minimum-bottleneck split of ``problem``'s devices, in their order, by CBC (the chain model
    of :mod:`solvers.exact.intervals`; the options as :func:`solvers.exact.router.solve`)."""
    import pulp

    start, arcs, details, done = intervals.setup_model(problem, "milp", hint, prune, max_arcs, t0)
    if done is not None:
        return done
    largest = float(arcs.time_s.max(initial=0.0))
    unit_s = largest / SCALE_MAX if largest > 0 else 1.0
    coef = (arcs.time_s / unit_s).tolist()
    details["unit_s"] = unit_s

    prob = pulp.LpProblem("chain", pulp.LpMinimize)
    var = _variables(prob, arcs)
    prob += var.bottleneck  # objective: minimise B
    _constraints(prob, arcs, var, coef, problem.profile.num_layers)
    if start is not None:
        _warm(var, arcs.hint(start), coef)

    # solve, with CBC's log kept to read its bound
    cbc_log = run_first(prob, time_limit_s, threads, seed, warm_start=start is not None, details=details)
    details.update({"cbc_status": pulp.LpStatus[prob.status], "cbc_solution": prob.sol_status})
    # extract: the chosen arcs, priced exactly; CBC's bound converted back, less the slack
    bound = bound_s(cbc_log, unit_s, largest)
    status = solve_status(prob, bound, "the chain model")
    answer = partial(intervals.finish, problem, "milp")
    no_plan = cbc_failed_or(details, intervals.no_plan_reason(time_limit_s, len(arcs)))
    if (done := intervals.unsolved(answer, status, bound, t0, details, no_plan)) is not None:
        return done
    picked = _picked(var)
    sol = intervals.price_arcs(problem, arcs, picked)
    remaining = time_limit_s - (time.perf_counter() - t0)
    if status is SolveStatus.OPTIMAL and tie_break and remaining > 0:
        sol = _tie_break(prob, var, coef, arcs, picked, sol, problem, remaining, threads, seed, details)
    log.debug("milp: %s, %d arcs, objective %.6g s, bound %.6g s", status, len(arcs), sol.bottleneck_s, bound)
    return answer(status, sol, bound, time.perf_counter() - t0, details)


def _variables(prob: Any, arcs: Arcs) -> ChainVars:
    """x[a] and y[q] binary, B continuous and non-negative."""
    import pulp

    x = [prob.add_variable(f"x_{a}", cat=pulp.LpBinary) for a in range(len(arcs))]
    y = {q: prob.add_variable(f"y_{q}", cat=pulp.LpBinary) for q in arcs.lengths}
    return ChainVars(x, y, prob.add_variable("bottleneck", lowBound=0))


def _constraints(prob: Any, arcs: Arcs, var: ChainVars, coef: list[float], n_layers: int) -> None:
    """One pipeline length, unit flow through the stages, and B above every stage's time."""
    import pulp

    x, y = var.x, var.y
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
        prob += var.bottleneck >= pulp.lpSum(coef[a] * x[a] for a in idx), f"stage_{q}_{k}"


def _warm(var: ChainVars, start: ChainHint, coef: list[float]) -> None:
    """The DP's split as CBC's warm start."""
    _warm_arcs(var, start.arcs)
    for q, yq in var.y.items():
        yq.setInitialValue(1 if q == start.length else 0)
    var.bottleneck.setInitialValue(max(coef[a] for a in start.arcs))


def _warm_arcs(var: ChainVars, chosen: set[int] | frozenset[int]) -> None:
    """The arcs of a plan as CBC's warm start."""
    for a, xa in enumerate(var.x):
        xa.setInitialValue(1 if a in chosen else 0)


def _picked(var: ChainVars) -> list[int]:
    """The arcs of CBC's plan."""
    return [a for a, xa in enumerate(var.x) if (xa.varValue or 0.0) > 0.5]


def _tie_break(prob: Any, var: ChainVars, coef: list[float], arcs: Arcs, picked: list[int], sol: ChainSolution,
               problem: ChainProblem, time_limit_s: float, threads: int, seed: int,
               details: SolveDetails) -> ChainSolution:
    """The DP's second pass on CBC: stages within the optimum found (exact seconds, as the DP
    compares), the shortest pipeline, then the least total stage time. ``sol`` if CBC finds nothing."""
    import pulp

    for a in arcs.slower_than(sol.bottleneck_s):
        var.x[a].upBound = 0
    weight = max(arcs.lengths) * (SCALE_MAX + 1.0) + 1.0
    # minimise W * q + sum_a T[a] x[a]
    prob.setObjective(weight * pulp.lpSum(q * yq for q, yq in var.y.items())
                      + pulp.lpSum(c * xa for c, xa in zip(coef, var.x, strict=True)))
    _warm_arcs(var, set(picked))
    if not solve_again(prob, time_limit_s, threads, seed, details):
        return sol
    return intervals.price_arcs(problem, arcs, _picked(var))
