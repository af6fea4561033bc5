"""Joint device mapping and split of one pipeline for CBC (PuLP): the CP-SAT model of
:mod:`solvers.exact.cpsat.joint`, linearised (data: :mod:`solvers.exact.joint`).

Same binaries ``x[a]``, ``u[r, g]``, ``v[r, c]``; continuous ``s[r]``, ``T[r]``, ``B`` in units of
the largest arc time / 1000. The conditional message of CP-SAT (enforced by ``v[r, c]``) is the
product of the class and the cut, linearised:

    w[r, c, i] >= sum_{a in (r, *, i, *)} x[a] + v[r, c] - 1,  w >= 0   (cut i and class c)
    s[r] >= sum_{c, i} msg_c[i] w[r, c, i]

and the rest is as CP-SAT has it (flow, type of the label, label counts, link class, stage
times, the redundant work rows, the node symmetry, the bound of :mod:`solvers.exact.joint_bound`). The bound is CBC's, read from its log, less
``1e-6`` of the largest time (its tolerances); the plan is priced by the cost model.
"""

from __future__ import annotations

import logging
import math
import time
from functools import partial
from typing import Any, NamedTuple

from partitioner.errors import PartitionerError
from solvers.exact import joint
from solvers.exact.cbc.run import (
    TOLERANCE_SLACK,
    bound_s,
    cbc_failed_or,
    run_first,
    solve_again,
    solve_status,
)
from solvers.exact.intervals import no_plan_reason, unsolved
from solvers.exact.joint import JointData, JointPlan, JointVars
from solvers.exact.joint_bound import before_model, relaxed_floor
from solvers.result import SolveDetails, SolveResult, SolveStatus

__all__ = ["solve_joint"]

log = logging.getLogger(__name__)

SCALE_MAX = 1000.0


class _Units(NamedTuple):
    """The data's times in model units of ``unit_s`` seconds."""

    unit_s: float
    largest_s: float  # the largest time, SCALE_MAX units
    work: list[float]  # per arc: compute + wave sync
    wave: list[float]  # per arc: the wave sync
    msg: list[list[float]]  # per link class and cut
    cheapest: list[float]  # per cut: the cheapest class's message


def solve_joint(data: JointData, *, time_limit_s: float, threads: int, seed: int, tie_break: bool,
                t0: float, symmetry: bool = True, bound_dp: bool = True) -> SolveResult:
    """Order and split by CBC; OPTIMAL when CBC proves it (to its tolerances)."""
    import pulp

    data, relaxed, done = before_model(data, "milp", bound_dp, time_limit_s, t0)
    if done is not None:
        return done
    units = _in_units(data)
    details: SolveDetails = {"unit_s": units.unit_s}

    prob = pulp.LpProblem("joint", pulp.LpMinimize)
    var = _variables(prob, data)
    prob += var.bottleneck  # objective: minimise B
    _constraints(prob, data, var, units)
    _cuts(prob, data, var, units, relaxed, symmetry)
    if data.start is not None:
        _warm(data, data.start, var)

    cbc_log = run_first(prob, joint.model_time_s(time_limit_s, t0), threads, seed,
                        warm_start=data.start is not None, details=details)
    details.update({"cbc_status": pulp.LpStatus[prob.status], "cbc_solution": prob.sol_status})
    bound = bound_s(cbc_log, units.unit_s, units.largest_s)
    bound = max(bound, relaxed_floor(relaxed)) if math.isfinite(bound) else relaxed_floor(relaxed) or math.nan
    status = solve_status(prob, bound, "the joint model")
    answer = partial(joint.finish_joint, data, "milp")
    reason = cbc_failed_or(details, no_plan_reason(time_limit_s))
    if (done := unsolved(answer, status, bound, t0, details, reason)) is not None:
        return done
    found = joint.read_plan(data, var, _on)
    remaining = time_limit_s - (time.perf_counter() - t0)
    if status is SolveStatus.OPTIMAL and tie_break and remaining > 0:
        found = _tie_break(prob, data, var, found, remaining, threads, seed, details)
    log.debug("joint milp: %s, %d arcs, objective %.6g s, bound %.6g s", status, len(data.r),
              found.solution.bottleneck_s, bound)
    return answer(status, found, bound, time.perf_counter() - t0, details)


def _in_units(data: JointData) -> _Units:
    """The unit (the largest time over :data:`SCALE_MAX`) and the data's times in it."""
    largest = data.largest_time_s()
    unit_s = largest / SCALE_MAX if largest > 0 else 1.0
    return _Units(unit_s, largest, (data.work_s / unit_s).tolist(), (data.wave_s / unit_s).tolist(),
                  (data.class_s / unit_s).tolist(), (data.cheapest_s() / unit_s).tolist())


def _on(var: Any) -> bool:
    """Whether a binary is 1 in CBC's answer."""
    return (var.varValue or 0.0) > 0.5


def _variables(prob: Any, data: JointData) -> JointVars:
    """x, u, v binary; s, T and B continuous and non-negative."""
    import pulp

    positions, n_lab, n_cls = data.positions, len(data.labels), len(data.class_s)
    x = [prob.add_variable(f"x_{a}", cat=pulp.LpBinary) for a in range(len(data.r))]
    u = [[prob.add_variable(f"u_{r}_{g}", cat=pulp.LpBinary) for g in range(n_lab)] for r in range(positions)]
    v = [[prob.add_variable(f"v_{r}_{c}", cat=pulp.LpBinary) for c in range(n_cls)] for r in range(positions - 1)]
    s = [prob.add_variable(f"s_{r}", lowBound=0) for r in range(positions - 1)]
    t_stage = [prob.add_variable(f"T_{r}", lowBound=0) for r in range(positions)]
    return JointVars(x, u, v, s, t_stage, prob.add_variable("B", lowBound=0))


def _constraints(prob: Any, data: JointData, var: JointVars, units: _Units) -> None:
    """Flow, labels, link classes, messages and stage times (as the CP-SAT model's rows)."""
    by_r = data.by_position()
    _flow(prob, data, var, by_r)
    _labels(prob, data, var, by_r)
    _link_classes(prob, data, var)
    _messages(prob, data, var, units, by_r)
    _stage_times(prob, data, var, units, by_r)


def _flow(prob: Any, data: JointData, var: JointVars, by_r: list[list[int]]) -> None:
    """sum_{a: i=0} x[a] = 1; sum_{a in (r+1, *, *, c)} x[a] = sum_{a in (r, *, c, *)} x[a]."""
    import pulp

    sum_, x = pulp.lpSum, var.x
    prob += sum_(x[a] for a in range(len(x)) if data.i[a] == 0) == 1, "start"
    for r in range(data.positions - 1):
        for c in range(1, data.num_layers):
            ins = [x[a] for a in by_r[r + 1] if data.j[a] == c]
            outs = [x[a] for a in by_r[r] if data.i[a] == c]
            if ins or outs:
                prob += sum_(ins) == sum_(outs), f"flow_{r}_{c}"


def _labels(prob: Any, data: JointData, var: JointVars, by_r: list[list[int]]) -> None:
    """sum_{a in (r, t)} x[a] = sum_{g of type t} u[r, g]; sum_r u[r, g] = n_g (<= n_g with allow_fewer)."""
    import pulp

    sum_, x, u, n_lab = pulp.lpSum, var.x, var.u, len(data.labels)
    for r in range(data.positions):
        for t in range(len(data.type_names)):
            prob += (sum_(x[a] for a in by_r[r] if data.gpu[a] == t)
                     == sum_(u[r][g] for g in range(n_lab) if data.types[g] == data.type_names[t])), f"type_{r}_{t}"
    for g in range(n_lab):
        used = sum_(u[r][g] for r in range(data.positions))
        prob += (used <= data.counts[g]) if data.problem.allow_fewer else (used == data.counts[g]), f"count_{g}"


def _link_classes(prob: Any, data: JointData, var: JointVars) -> None:
    """sum_c v[r, c] = sum_g u[r+1, g]; v[r, c] >= u[r+1, g] + sum_{h: class(g, h) = c} u[r, h] - 1."""
    import pulp

    sum_, u, v, n_lab = pulp.lpSum, var.u, var.v, len(data.labels)
    for r in range(data.positions - 1):
        prob += sum_(v[r]) == sum_(u[r + 1]), f"one_class_{r}"
        for g in range(n_lab):
            for c in range(len(data.class_s)):
                hs = [u[r][h] for h in range(n_lab) if data.pair_class[g, h] == c]
                if hs:
                    prob += v[r][c] >= u[r + 1][g] + sum_(hs) - 1, f"class_{r}_{g}_{c}"


def _messages(prob: Any, data: JointData, var: JointVars, units: _Units, by_r: list[list[int]]) -> None:
    """The message at the cut where position r starts, the product of cut and class linearised:
    w[r, c, i] >= sum_{a in (r, *, i, *)} x[a] + v[r, c] - 1, w >= 0; s[r] >= sum_{c, i} msg_c[i] w[r, c, i];
    and s[r] >= sum_{a in (r, *, i>0, *)} min_c msg_c[i] x[a] (redundant: the cheapest link)."""
    import pulp

    sum_, x = pulp.lpSum, var.x
    for r in range(data.positions - 1):
        starts: dict[int, list[int]] = {}
        for a in by_r[r]:
            if data.i[a] > 0:
                starts.setdefault(int(data.i[a]), []).append(a)
        terms = []
        for c in range(len(data.class_s)):
            for i, arcs_i in starts.items():
                w = prob.add_variable(f"w_{r}_{c}_{i}", lowBound=0)
                prob += w >= sum_(x[a] for a in arcs_i) + var.v[r][c] - 1, f"w_{r}_{c}_{i}"
                terms.append(units.msg[c][i] * w)
        prob += var.s[r] >= sum_(terms), f"msg_{r}"
        prob += var.s[r] >= sum_(units.cheapest[i] * x[a] for i, arcs_i in starts.items() for a in arcs_i), f"least_{r}"


def _stage_times(prob: Any, data: JointData, var: JointVars, units: _Units, by_r: list[list[int]]) -> None:
    """T[r] >= sum_{a in r} work[a] x[a] + s[r] + s[r-1] (overlapped: one row each, the transfers
    plus the wave sync); B >= T[r]."""
    import pulp

    sum_, x, s, t_stage, positions = pulp.lpSum, var.x, var.s, var.t_stage, data.positions
    for r in range(positions):
        links = ([s[r]] if r < positions - 1 else []) + ([s[r - 1]] if r > 0 else [])
        comp = sum_(units.work[a] * x[a] for a in by_r[r])
        if data.overlap:
            prob += t_stage[r] >= comp, f"stage_{r}"
            for n, link in enumerate(links):
                prob += t_stage[r] >= sum_(units.wave[a] * x[a] for a in by_r[r]) + link, f"stage_{r}_{n}"
        else:
            prob += t_stage[r] >= comp + sum_(links), f"stage_{r}"
        prob += var.bottleneck >= t_stage[r], f"bottleneck_{r}"


def _cuts(prob: Any, data: JointData, var: JointVars, units: _Units, relaxed: float, symmetry: bool) -> None:
    """Rows no plan violates: the work of type t at most n_t * B, the stage times at most p * B
    (additive), B at least the relaxation's bound, interchangeable nodes first used in order."""
    import pulp

    sum_, x, u, bottleneck = pulp.lpSum, var.x, var.u, var.bottleneck
    for t, name in enumerate(data.type_names):
        n_t = data.gpus_of_type(name)
        prob += sum_(units.work[a] * x[a] for a in range(len(x)) if data.gpu[a] == t) <= n_t * bottleneck, f"work_{t}"
    if not data.overlap:
        prob += sum_(var.t_stage) <= sum(data.counts) * bottleneck, "total"
    if math.isfinite(relaxed) and relaxed > 0:
        prob += bottleneck >= relaxed / units.unit_s * (1 - 1e-9), "relaxed_bound"
    if symmetry:
        for late, e_labs, l_labs in joint.symmetric_pairs(data):
            for r in range(data.positions):
                prob += (sum_(u[r][g] for g in l_labs)
                         <= sum_(u[rr][g] for rr in range(r + 1, data.positions) for g in e_labs)), f"sym_{late}_{r}"


def _warm(data: JointData, plan: JointPlan, var: JointVars) -> None:
    """``plan`` as CBC's warm start (arcs, labels, link classes)."""
    for v, value in joint.start_values(data, plan, var):
        v.setInitialValue(1 if value else 0)


def _tie_break(prob: Any, data: JointData, var: JointVars, found: JointPlan, time_limit_s: float, threads: int,
               seed: int, details: SolveDetails) -> JointPlan:
    """Second solve: B within CBC's tolerance of the optimum (a bound tighter than its tolerances
    can make its presolve call the model infeasible), the shortest pipeline, then the least total
    stage time; the exact comparison is made after pricing."""
    import pulp

    var.bottleneck.upBound = (var.bottleneck.varValue or 0.0) + TOLERANCE_SLACK * SCALE_MAX
    weight = data.positions * (3 * SCALE_MAX + 1) + 1
    prob.setObjective(weight * pulp.lpSum(var.u[r][g] for r in range(data.positions) for g in range(len(data.labels)))
                      + pulp.lpSum(var.t_stage))
    _warm(data, found, var)
    if not solve_again(prob, time_limit_s, threads, seed, details):
        return found
    try:
        again = joint.read_plan(data, var, _on)
    except PartitionerError:  # CBC said optimal but gave no plan (its tolerances): keep the first
        details["tie_break"] = "no plan read"
        return found
    return again if again.solution.bottleneck_s <= found.solution.bottleneck_s else found
