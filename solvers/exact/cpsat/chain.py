"""The chain problem as an OR-Tools CP-SAT model, with a certified lower bound.

Same problem as :mod:`solvers.pipeline.dp` (one pipeline over ordered devices, minimum bottleneck,
memory per device, a recompute mode per stage), in the interval formulation of
:mod:`solvers.exact.intervals`. CP-SAT works
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
import time
from functools import partial
from typing import Any

import numpy as np

from solvers.exact import intervals
from solvers.exact.cpsat.run import bound_s, run_model, solve_again, solve_status
from solvers.exact.intervals import Arcs, ChainHint, ChainProblem, ChainVars
from solvers.pipeline.dp import ChainSolution
from solvers.result import SolveDetails, SolveResult, SolveStatus

__all__ = ["solve_chain"]

log = logging.getLogger(__name__)


def solve_chain(problem: ChainProblem, *, time_limit_s: float, threads: int, seed: int, resolution: int,
                tie_break: bool, t0: float, hint: bool, prune: bool, max_arcs: int) -> SolveResult:
    """Minimum-bottleneck split of ``problem``'s devices, in their order, by CP-SAT (the chain
    model of :mod:`solvers.exact.intervals`; the options as :func:`solvers.exact.router.solve`)."""
    from ortools.sat.python import cp_model

    start, arcs, details, done = intervals.setup_model(problem, "cpsat", hint, prune, max_arcs, t0)
    if done is not None:
        return done
    tick_s, ticks = _ticks(arcs, resolution)
    details["tick_s"] = tick_s

    model = cp_model.CpModel()
    var = _variables(model, arcs, ticks)
    _constraints(model, arcs, var, ticks, problem.profile.num_layers)
    model.minimize(var.bottleneck)  # objective: minimise B
    if start is not None:
        _hint(model, var, arcs.hint(start), ticks)

    solver, code = run_model(model, "cpsat", tick_s, time_limit_s, threads, seed, details)
    status = solve_status(code, model, "the model")
    # extract: the chosen arcs, priced exactly; the bound converted back to seconds
    bound = bound_s(solver, tick_s)
    answer = partial(intervals.finish, problem, "cpsat")
    no_plan = intervals.no_plan_reason(time_limit_s, len(arcs))
    if (done := intervals.unsolved(answer, status, bound, t0, details, no_plan)) is not None:
        return done
    picked = _picked(solver, var)
    sol = intervals.price_arcs(problem, arcs, picked)
    remaining = time_limit_s - (time.perf_counter() - t0)
    if status is SolveStatus.OPTIMAL and tie_break and remaining > 0:
        sol = _tie_break(model, solver, var, arcs, ticks, picked, sol, problem, remaining, details)
    log.debug("cpsat: %s, %d arcs, objective %.6g s, bound %.6g s", status, len(arcs), sol.bottleneck_s, bound)
    return answer(status, sol, bound, time.perf_counter() - t0, details)


def _ticks(arcs: Arcs, resolution: int) -> tuple[float, list[int]]:
    """The tick (the largest stage time over ``resolution``) and every arc's time in ticks,
    rounded down."""
    largest = float(arcs.time_s.max(initial=0.0))
    tick_s = largest / resolution if largest > 0 else 1.0
    return tick_s, np.floor(arcs.time_s / tick_s).astype(np.int64).tolist()


def _variables(model: Any, arcs: Arcs, ticks: list[int]) -> ChainVars:
    """x[a] for every arc, y[q] for every pipeline length, B in [0, the largest arc's ticks]."""
    x = [model.new_bool_var(f"x_{a}") for a in range(len(arcs))]
    y = {q: model.new_bool_var(f"y_{q}") for q in arcs.lengths}
    return ChainVars(x, y, model.new_int_var(0, max(ticks, default=0), "bottleneck"))


def _constraints(model: Any, arcs: Arcs, var: ChainVars, ticks: list[int], n_layers: int) -> None:
    """One pipeline length, unit flow through the stages, and B above every stage's time."""
    from ortools.sat.python import cp_model

    lin = cp_model.LinearExpr
    x, y = var.x, var.y
    # One pipeline length: sum_q y[q] = 1.
    model.add_exactly_one(y.values())

    # Flow: sum_j x[q, 0, 0, j] = y[q], and for 0 < k < q at every cut c:
    # sum_i x[q, k-1, i, c] = sum_j x[q, k, c, j] (stage k starts where stage k-1 ended).
    ending, starting = arcs.incidence()
    for q in arcs.lengths:
        model.add(lin.sum([x[a] for a in starting.get((q, 0, 0), [])]) == y[q])
        for k in range(1, q):
            for c in range(1, n_layers):
                ins, outs = ending.get((q, k - 1, c), []), starting.get((q, k, c), [])
                if ins or outs:
                    model.add(lin.sum([x[a] for a in ins]) == lin.sum([x[a] for a in outs]))

    # Bottleneck: B >= sum_{i,j} ticks[q, k, i, j] * x[q, k, i, j] for every stage (q, k)
    # (at most one arc of a stage is chosen, so the sum is that stage's time).
    for idx in arcs.groups().values():
        model.add(var.bottleneck >= lin.weighted_sum([x[a] for a in idx], [ticks[a] for a in idx]))


def _hint(model: Any, var: ChainVars, start: ChainHint, ticks: list[int]) -> None:
    """The DP's split as CP-SAT's solution hint."""
    _hint_arcs(model, var, start.arcs)
    for q, yq in var.y.items():
        model.add_hint(yq, q == start.length)
    model.add_hint(var.bottleneck, max(ticks[a] for a in start.arcs))


def _picked(solver: Any, var: ChainVars) -> list[int]:
    """The arcs of the solver's plan."""
    return [a for a, xa in enumerate(var.x) if solver.boolean_value(xa)]


def _tie_break(model: Any, solver: Any, var: ChainVars, arcs: Arcs, ticks: list[int], picked: list[int],
               sol: ChainSolution, problem: ChainProblem, time_limit_s: float,
               details: SolveDetails) -> ChainSolution:
    """Second solve, as the DP's second pass: only stages within the optimum found (exact seconds,
    as the DP compares), the shortest pipeline, then the least total stage time (in ticks:
    within q ticks of the exact least total). ``sol`` if CP-SAT finds nothing."""
    from ortools.sat.python import cp_model

    lin = cp_model.LinearExpr
    for a in arcs.slower_than(sol.bottleneck_s):
        model.add(var.x[a] == 0)
    weight = max(arcs.lengths) * (max(ticks, default=0) + 1) + 1
    # minimise W * q + sum_a ticks[a] x[a]
    model.minimize(weight * lin.weighted_sum(list(var.y.values()), list(var.y)) + lin.weighted_sum(var.x, ticks))
    model.clear_hints()
    _hint_arcs(model, var, set(picked))
    if not solve_again(solver, model, time_limit_s, details):
        return sol
    return intervals.price_arcs(problem, arcs, _picked(solver, var))


def _hint_arcs(model: Any, var: ChainVars, chosen: set[int] | frozenset[int]) -> None:
    """The arcs of a plan as CP-SAT's solution hint (the tie-break's start)."""
    for a, xa in enumerate(var.x):
        model.add_hint(xa, a in chosen)
