"""The chain problem as an OR-Tools CP-SAT model, with a certified lower bound.

Same problem as :mod:`solvers.pipeline.dp` (one pipeline over ordered devices, minimum bottleneck,
memory per device), in the interval formulation of :mod:`solvers.exact.intervals`. CP-SAT works
on integers, so every stage time is rounded **down** to a whole number of ticks
(``tick_s = largest stage time / resolution``). Rounding down makes the integer model a
relaxation in time: its bound, converted back to seconds, is a valid lower bound on the true
optimum (less a hundredth of a tick for floating-point safety). The plan's objective is not
taken from the integer model: it is recomputed exactly from the chosen cuts with the cost
model. When CP-SAT proves the integer model optimal, the plan is optimal to within one tick
(``details["tick_s"]``); the status is then ``OPTIMAL``, and a second solve breaks ties among
the optimal splits as the DP's second pass does (shortest pipeline, least total stage time).
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from partitioner.errors import PartitionerError
from solvers.exact.intervals import (
    ChainProblem,
    cpsat_solver,
    finish,
    model_arcs,
)
from solvers.progress import solve_cpsat
from solvers.result import SolveResult, SolveStatus

__all__ = ["solve_chain"]

log = logging.getLogger(__name__)

FLOAT_SAFETY_TICKS = 0.01


def solve_chain(problem: ChainProblem, *, time_limit_s: float, threads: int, seed: int, resolution: int,
                tie_break: bool, t0: float, hint: bool, prune: bool, max_arcs: int) -> SolveResult:
    """Minimum-bottleneck split of ``problem``'s devices, in their order, by CP-SAT (the chain
    model of :mod:`solvers.exact.intervals`; the options as :func:`solvers.exact.router.solve`)."""
    from ortools.sat.python import cp_model

    start, arcs, details = model_arcs(problem, hint, prune, max_arcs)
    details["mapping"] = "given"
    if not arcs.lengths:  # more devices than layers and no shorter pipeline allowed
        return finish(problem, "cpsat", SolveStatus.INFEASIBLE, None, math.nan,
                      time.perf_counter() - t0, details)

    largest = float(arcs.time_s.max(initial=0.0))
    tick_s = largest / resolution if largest > 0 else 1.0
    ticks = np.floor(arcs.time_s / tick_s).astype(np.int64).tolist()
    details["tick_s"] = tick_s
    n_layers = problem.profile.num_layers

    model = cp_model.CpModel()

    # Variables: x[a] = 1 when arc a (stage k of the q-stage pipeline holds [i, j)) is chosen;
    # y[q] = 1 when the pipeline has q stages; B = the bottleneck in ticks.
    x = [model.new_bool_var(f"x_{a}") for a in range(len(arcs))]
    y = {q: model.new_bool_var(f"y_{q}") for q in arcs.lengths}
    bottleneck = model.new_int_var(0, max(ticks, default=0), "bottleneck")

    # One pipeline length: sum_q y[q] = 1.
    model.add_exactly_one(y.values())

    # Flow: sum_j x[q, 0, 0, j] = y[q], and for 0 < k < q at every cut c:
    # sum_i x[q, k-1, i, c] = sum_j x[q, k, c, j] (stage k starts where stage k-1 ended).
    ending, starting = arcs.incidence()
    for q in arcs.lengths:
        model.add(cp_model.LinearExpr.sum([x[a] for a in starting.get((q, 0, 0), [])]) == y[q])
        for k in range(1, q):
            for c in range(1, n_layers):
                ins, outs = ending.get((q, k - 1, c), []), starting.get((q, k, c), [])
                if ins or outs:
                    model.add(cp_model.LinearExpr.sum([x[a] for a in ins])
                              == cp_model.LinearExpr.sum([x[a] for a in outs]))

    # Bottleneck: B >= sum_{i,j} ticks[q, k, i, j] * x[q, k, i, j] for every stage (q, k)
    # (at most one arc of a stage is chosen, so the sum is that stage's time).
    for idx in arcs.groups().values():
        model.add(bottleneck >= cp_model.LinearExpr.weighted_sum([x[a] for a in idx],
                                                                 [ticks[a] for a in idx]))

    # Objective: minimise B.
    model.minimize(bottleneck)

    if start is not None:
        chosen = set(arcs.index_of(start))
        for a in range(len(arcs)):
            model.add_hint(x[a], a in chosen)
        for q in arcs.lengths:
            model.add_hint(y[q], q == len(start.devices))
        model.add_hint(bottleneck, max(ticks[a] for a in chosen))

    # Solve.
    solver = cpsat_solver(time_limit_s, threads, seed)
    code = solve_cpsat(solver, model, "cpsat", tick_s)
    details.update(cpsat_status=solver.status_name(code), cpsat_wall_s=solver.wall_time,
                   branches=solver.num_branches)

    # Extract: the chosen arcs, priced exactly; the bound converted back to seconds.
    if code == cp_model.MODEL_INVALID:
        raise PartitionerError(f"CP-SAT rejected the model: {model.validate()}")
    if code == cp_model.INFEASIBLE:
        return finish(problem, "cpsat", SolveStatus.INFEASIBLE, None, math.nan,
                      time.perf_counter() - t0, details)
    bound = max(0.0, (solver.best_objective_bound - FLOAT_SAFETY_TICKS) * tick_s)
    details["bound_s"] = bound  # as converted, before capping at the plan's objective
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return finish(problem, "cpsat", SolveStatus.UNKNOWN, None, bound, time.perf_counter() - t0, details,
                      reason=f"no plan found within the time limit of {time_limit_s:g} s "
                             f"({len(arcs)} candidate stages)")
    picked = [a for a in range(len(arcs)) if solver.boolean_value(x[a])]
    sol = arcs.solution(picked, problem.cost, problem.devices, problem.schedule, problem.micro_batches)
    remaining = time_limit_s - (time.perf_counter() - t0)
    if code == cp_model.OPTIMAL and tie_break and remaining > 0:
        # Second solve, as the DP's second pass: only stages within the optimum found (exact
        # seconds, as the DP compares), the shortest pipeline, then the least total stage time
        # (in ticks: within q ticks of the exact least total).
        for a in np.flatnonzero(arcs.time_s > sol.bottleneck_s).tolist():
            model.add(x[a] == 0)
        weight = max(arcs.lengths) * (max(ticks, default=0) + 1) + 1
        model.minimize(weight * cp_model.LinearExpr.weighted_sum(list(y.values()), list(y))
                       + cp_model.LinearExpr.weighted_sum(x, ticks))
        model.clear_hints()
        for a in range(len(arcs)):
            model.add_hint(x[a], a in set(picked))
        solver.parameters.max_time_in_seconds = float(remaining)
        code2 = solver.solve(model)
        details["tie_break"] = solver.status_name(code2)
        if code2 in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            picked = [a for a in range(len(arcs)) if solver.boolean_value(x[a])]
            sol = arcs.solution(picked, problem.cost, problem.devices, problem.schedule, problem.micro_batches)
    status = SolveStatus.OPTIMAL if code == cp_model.OPTIMAL else SolveStatus.FEASIBLE
    log.debug("cpsat: %s, %d arcs, objective %.6g s, bound %.6g s", status, len(arcs), sol.bottleneck_s, bound)
    return finish(problem, "cpsat", status, sol, bound, time.perf_counter() - t0, details)
