"""The chain problem as a mixed-integer program for CBC (through PuLP), with a lower bound.

Same problem and formulation as :mod:`solvers.cpsat` (see :mod:`solvers.intervals`), with a
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
from collections.abc import Sequence
from typing import Any

import numpy as np

from partitioner.cluster import Cluster
from partitioner.cost import CostOptions
from partitioner.errors import FormatError, PartitionerError
from partitioner.profile import Profile

from .cbc import cbc_bound, run_cbc
from .dp import ChainSolution
from .intervals import (
    DEFAULT_MAX_ARCS,
    Arcs,
    ChainProblem,
    check_limits,
    finish,
    model_arcs,
    prepare,
)
from .joint import HINT_SHARE, mapping_details, needs_mapping
from .result import SolveResult, SolveStatus

__all__ = ["cbc_bound", "solve"]

log = logging.getLogger(__name__)

SCALE_MAX = 1000.0  # the largest stage time, in model units
TOLERANCE_SLACK = 1e-6  # of the largest stage time, taken off CBC's bound

def solve(profile: Profile, cluster: Cluster, devices: Sequence[str] | None = None, *,
          schedule: str = "1f1b", micro_batches: int | None = None, options: CostOptions | None = None,
          allow_fewer: bool = False, time_limit_s: float = 10.0, threads: int = 1, hint: bool = True,
          prune: bool = True, max_arcs: int = DEFAULT_MAX_ARCS, tie_break: bool = True, seed: int = 0,
          dag: bool | None = None, fixed_order: bool = False, relaxation: bool = True, **unused: object) -> SolveResult:
    """Optimal single-pipeline plan over ``devices`` by CBC, with a lower bound where CBC gives one.

    ``hint`` runs the DP first and passes its split to CBC as a warm start; with ``prune`` as
    well, stages slower than that split's bottleneck are left out of the model. ``tie_break``:
    once the bottleneck is proven optimal, a second solve within the time left picks among the
    optimal splits the shortest pipeline, then the least total stage time, as the DP does. Other
    arguments as :func:`solvers.dp.solve` and :func:`solvers.cpsat.solve`; ``seed`` sets CBC's
    random seeds (0: CBC's defaults). ``dag``: plan convex stages of the profile's graph
    (:mod:`solvers.dag`) rather than ranges of its layer order; None (the default) does so when
    the profile has edges. ``fixed_order``: as :func:`solvers.cpsat.solve` (without it, the
    device order of several labels is decided in the model, :mod:`solvers.joint_milp`), and
    ``relaxation``.
    """
    import pulp

    if unused:
        raise FormatError("solver option", sorted(unused), "not understood by the milp solver")
    check_limits(time_limit_s, threads, seed)
    t0 = time.perf_counter()
    problem = prepare(profile, cluster, devices, schedule, micro_batches, options, allow_fewer)
    if dag is not None and not isinstance(dag, bool):
        raise FormatError("dag", dag, "must be true, false or None (None: the graph when the profile has edges)")
    if not isinstance(fixed_order, bool):
        raise FormatError("fixed_order", fixed_order, "must be true or false")
    graph = bool(dag or (dag is None and profile.edges))
    if graph:
        from .dag import dag_data
        from .dag_milp import solve_dag

        return solve_dag(dag_data(problem, hint), time_limit_s=time_limit_s, threads=threads, seed=seed,
                         prune=prune, tie_break=tie_break, t0=t0, details=mapping_details(problem, fixed_order))
    if not fixed_order and needs_mapping(problem):
        from .joint import joint_data
        from .joint_milp import solve_joint

        # the heuristic mapping (the hint) gets at most a quarter of the time limit
        data = joint_data(problem, hint, prune, max_arcs, deadline=t0 + HINT_SHARE * time_limit_s)
        return solve_joint(data, time_limit_s=time_limit_s, threads=threads, bound_dp=relaxation,
                           seed=seed, tie_break=tie_break, t0=t0)
    start, arcs, details = model_arcs(problem, hint, prune, max_arcs)
    details["mapping"] = "given"
    if not arcs.lengths:  # more devices than layers and no shorter pipeline allowed
        return finish(problem, "milp", SolveStatus.INFEASIBLE, None, math.nan,
                      time.perf_counter() - t0, details)

    largest = float(arcs.time_s.max(initial=0.0))
    unit_s = largest / SCALE_MAX if largest > 0 else 1.0
    coef = (arcs.time_s / unit_s).tolist()
    details["unit_s"] = unit_s
    n_layers = profile.num_layers

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
