"""The chain problem as an OR-Tools CP-SAT model, with a certified lower bound.

Same problem as :mod:`solvers.dp` (one pipeline over ordered devices, minimum bottleneck,
memory per device), in the interval formulation of :mod:`solvers.intervals`. CP-SAT works
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
from collections.abc import Sequence

import numpy as np

from partitioner.cluster import Cluster
from partitioner.cost import CostOptions
from partitioner.errors import FormatError, PartitionerError
from partitioner.profile import Profile

from .intervals import DEFAULT_MAX_ARCS, check_limits, cpsat_solver, finish, model_arcs, prepare
from .joint import HINT_SHARE, mapping_details, needs_mapping
from .progress import solve_cpsat
from .result import SolveResult, SolveStatus

__all__ = ["DEFAULT_RESOLUTION", "solve"]

log = logging.getLogger(__name__)

DEFAULT_RESOLUTION = 10**7  # ticks in the largest stage time of the model
FLOAT_SAFETY_TICKS = 0.01


def solve(profile: Profile, cluster: Cluster, devices: Sequence[str] | None = None, *,
          schedule: str = "1f1b", micro_batches: int | None = None, options: CostOptions | None = None,
          allow_fewer: bool = False, time_limit_s: float = 10.0, threads: int = 1, hint: bool = True,
          prune: bool = True, resolution: int = DEFAULT_RESOLUTION, max_arcs: int = DEFAULT_MAX_ARCS,
          tie_break: bool = True, seed: int = 0, dag: bool | None = None, fixed_order: bool = False,
          relaxation: bool = True, **unused: object) -> SolveResult:
    """Optimal single-pipeline plan over ``devices`` by CP-SAT, with a lower bound.

    ``hint`` runs the DP first and gives its split to CP-SAT as a solution hint; with
    ``prune`` as well, stages slower than that split's bottleneck are left out of the model
    (they cannot be in an optimal split). ``threads`` is CP-SAT's number of workers and
    ``seed`` its random seed: a fixed pair gives the same plan (several workers are interleaved
    deterministically), unless the time limit cuts the search.
    ``tie_break``: once the bottleneck is proven optimal, a second solve within the time left
    picks among the optimal splits the shortest pipeline, then the least total stage time, as
    the DP does (``details["tie_break"]`` is its CP-SAT status).
    ``dag``: plan convex stages of the profile's graph (:mod:`solvers.dag`) rather than ranges
    of its layer order; None (the default) does so when the profile has edges.
    ``fixed_order``: split over ``devices`` in the given order. Without it (the default), on
    devices of more than one label (:func:`solvers.mapping.device_labels`) the order is decided
    in the model too (:mod:`solvers.joint_cpsat`; ``details["mapping"] == "model"``), except on
    a graph profile, whose convex stages keep the given order (``details["mapping"] == "given"``).
    ``relaxation``: the joint model's bound from :mod:`solvers.joint_bound` (off: the model alone,
    for an independent check).
    Other arguments as :func:`solvers.dp.solve`.
    """
    from ortools.sat.python import cp_model

    if unused:
        raise FormatError("solver option", sorted(unused), "not understood by the cpsat solver")
    check_limits(time_limit_s, threads, seed)
    if not (isinstance(resolution, int) and 10 <= resolution <= 10**12):
        raise FormatError("resolution", resolution, "must be an integer tick count in [10, 1e12]")
    t0 = time.perf_counter()
    problem = prepare(profile, cluster, devices, schedule, micro_batches, options, allow_fewer)
    if dag is not None and not isinstance(dag, bool):
        raise FormatError("dag", dag, "must be true, false or None (None: the graph when the profile has edges)")
    if not isinstance(fixed_order, bool):
        raise FormatError("fixed_order", fixed_order, "must be true or false")
    graph = bool(dag or (dag is None and profile.edges))
    mapping = "model" if not (fixed_order or graph) and needs_mapping(problem) else "given"
    if graph:
        from .dag import dag_data
        from .dag_cpsat import solve_dag

        return solve_dag(dag_data(problem, hint), time_limit_s=time_limit_s, threads=threads, seed=seed,
                         prune=prune, resolution=resolution, tie_break=tie_break, t0=t0,
                         details=mapping_details(problem, fixed_order))
    if mapping == "model":
        from .joint import joint_data
        from .joint_cpsat import solve_joint

        # the heuristic mapping (the hint) gets at most a quarter of the time limit
        data = joint_data(problem, hint, prune, max_arcs, deadline=t0 + HINT_SHARE * time_limit_s)
        return solve_joint(data, time_limit_s=time_limit_s, threads=threads, bound_dp=relaxation,
                           seed=seed, resolution=resolution, tie_break=tie_break, t0=t0)
    start, arcs, details = model_arcs(problem, hint, prune, max_arcs)
    details["mapping"] = "given"
    if not arcs.lengths:  # more devices than layers and no shorter pipeline allowed
        return finish(problem, "cpsat", SolveStatus.INFEASIBLE, None, math.nan,
                      time.perf_counter() - t0, details)

    largest = float(arcs.time_s.max(initial=0.0))
    tick_s = largest / resolution if largest > 0 else 1.0
    ticks = np.floor(arcs.time_s / tick_s).astype(np.int64).tolist()
    details["tick_s"] = tick_s
    n_layers = profile.num_layers

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
