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

import itertools
import logging
import math
import time
from typing import Any

import numpy as np

from partitioner.errors import PartitionerError
from solvers.exact.cbc.run import cbc_bound, run_cbc
from solvers.exact.joint import JointData, JointPlan, finish_joint
from solvers.exact.joint_bound import before_model, relaxed_floor
from solvers.result import SolveResult, SolveStatus

__all__ = ["solve_joint"]

log = logging.getLogger(__name__)

SCALE_MAX = 1000.0
TOLERANCE_SLACK = 1e-6


def solve_joint(data: JointData, *, time_limit_s: float, threads: int, seed: int, tie_break: bool,
                t0: float, symmetry: bool = True, bound_dp: bool = True) -> SolveResult:
    """Order and split by CBC; OPTIMAL when CBC proves it (to its tolerances)."""
    import pulp

    n_arcs, positions, n_lab, n_cls = len(data.r), data.positions, len(data.labels), len(data.class_s)
    data, relaxed, done = before_model(data, "milp", bound_dp, time_limit_s, t0)
    if done is not None:
        return done
    details: dict[str, object] = {}
    largest = float(max(data.work_s.max(), data.class_s.max(initial=0.0)))
    unit_s = largest / SCALE_MAX if largest > 0 else 1.0
    work = (data.work_s / unit_s).tolist()
    wave = (data.wave_s / unit_s).tolist()
    msg = (data.class_s / unit_s).tolist()
    cheapest = (data.class_s.min(axis=0) / unit_s).tolist() if n_cls else [0.0] * (data.num_layers + 1)
    details["unit_s"] = unit_s
    L = data.num_layers
    by_r = [data.arcs_of(r).tolist() for r in range(positions)]
    sum_ = pulp.lpSum

    prob = pulp.LpProblem("joint", pulp.LpMinimize)
    x = [prob.add_variable(f"x_{a}", cat=pulp.LpBinary) for a in range(n_arcs)]
    u = [[prob.add_variable(f"u_{r}_{g}", cat=pulp.LpBinary) for g in range(n_lab)] for r in range(positions)]
    v = [[prob.add_variable(f"v_{r}_{c}", cat=pulp.LpBinary) for c in range(n_cls)] for r in range(positions - 1)]
    s = [prob.add_variable(f"s_{r}", lowBound=0) for r in range(positions - 1)]
    t_stage = [prob.add_variable(f"T_{r}", lowBound=0) for r in range(positions)]
    bottleneck = prob.add_variable("B", lowBound=0)
    prob += bottleneck

    prob += sum_(x[a] for a in range(n_arcs) if data.i[a] == 0) == 1, "start"
    for r in range(positions - 1):
        for c in range(1, L):
            ins = [x[a] for a in by_r[r + 1] if data.j[a] == c]
            outs = [x[a] for a in by_r[r] if data.i[a] == c]
            if ins or outs:
                prob += sum_(ins) == sum_(outs), f"flow_{r}_{c}"
    for r in range(positions):
        for t in range(len(data.type_names)):
            prob += (sum_(x[a] for a in by_r[r] if data.gpu[a] == t)
                     == sum_(u[r][g] for g in range(n_lab) if data.types[g] == data.type_names[t])), f"type_{r}_{t}"
    for g in range(n_lab):
        used = sum_(u[r][g] for r in range(positions))
        prob += (used <= data.counts[g]) if data.problem.allow_fewer else (used == data.counts[g]), f"count_{g}"
    for r in range(positions - 1):
        prob += sum_(v[r]) == sum_(u[r + 1]), f"one_class_{r}"
        for g in range(n_lab):
            for c in range(n_cls):
                hs = [u[r][h] for h in range(n_lab) if data.pair_class[g, h] == c]
                if hs:
                    prob += v[r][c] >= u[r + 1][g] + sum_(hs) - 1, f"class_{r}_{g}_{c}"
    # the message at the cut where position r starts: products of cut and class, linearised
    for r in range(positions - 1):
        starts: dict[int, list[int]] = {}
        for a in by_r[r]:
            if data.i[a] > 0:
                starts.setdefault(int(data.i[a]), []).append(a)
        terms = []
        for c in range(n_cls):
            for i, arcs_i in starts.items():
                w = prob.add_variable(f"w_{r}_{c}_{i}", lowBound=0)
                prob += w >= sum_(x[a] for a in arcs_i) + v[r][c] - 1, f"w_{r}_{c}_{i}"
                terms.append(msg[c][i] * w)
        prob += s[r] >= sum_(terms), f"msg_{r}"
        prob += s[r] >= sum_(cheapest[i] * x[a] for i, arcs_i in starts.items() for a in arcs_i), f"least_{r}"
    for r in range(positions):
        links = ([s[r]] if r < positions - 1 else []) + ([s[r - 1]] if r > 0 else [])
        comp = sum_(work[a] * x[a] for a in by_r[r])
        if data.overlap:
            prob += t_stage[r] >= comp, f"stage_{r}"
            for n, link in enumerate(links):
                prob += t_stage[r] >= sum_(wave[a] * x[a] for a in by_r[r]) + link, f"stage_{r}_{n}"
        else:
            prob += t_stage[r] >= comp + sum_(links), f"stage_{r}"
        prob += bottleneck >= t_stage[r], f"bottleneck_{r}"
    for t, name in enumerate(data.type_names):
        n_t = sum(c for g, c in enumerate(data.counts) if data.types[g] == name)
        prob += sum_(work[a] * x[a] for a in range(n_arcs) if data.gpu[a] == t) <= n_t * bottleneck, f"work_{t}"
    if not data.overlap:
        prob += sum_(t_stage) <= sum(data.counts) * bottleneck, "total"
    if math.isfinite(relaxed) and relaxed > 0:
        prob += bottleneck >= relaxed / unit_s * (1 - 1e-9), "relaxed_bound"
    if symmetry:
        for group in data.symmetric_nodes:
            for early, late in itertools.pairwise(group):
                e_labs = [g for g in range(n_lab) if data.node_of(g) == early]
                l_labs = [g for g in range(n_lab) if data.node_of(g) == late]
                for r in range(positions):
                    prob += (sum_(u[r][g] for g in l_labs)
                             <= sum_(u[rr][g] for rr in range(r + 1, positions) for g in e_labs)), f"sym_{late}_{r}"

    if data.start is not None:
        _warm(data, data.start, x, u, v)
    left = max(time_limit_s - (time.perf_counter() - t0), 0.1 * time_limit_s)  # the hint and model took the rest
    cbc_log = run_cbc(prob, left, threads, seed, warm_start=data.start is not None)
    details.update(cbc_status=pulp.LpStatus[prob.status], cbc_solution=prob.sol_status)
    if prob.status == pulp.LpStatusInfeasible:
        return finish_joint(data, "milp", SolveStatus.INFEASIBLE, None, math.nan, time.perf_counter() - t0, details)
    raw = cbc_bound(cbc_log)
    bound = max(0.0, raw * unit_s - TOLERANCE_SLACK * largest) if math.isfinite(raw) else math.nan
    bound = max(bound, relaxed_floor(relaxed)) if math.isfinite(bound) else relaxed_floor(relaxed) or math.nan
    details["bound_s"] = bound
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        if prob.status not in (pulp.LpStatusNotSolved, pulp.LpStatusOptimal):
            raise PartitionerError(f"CBC ended with status {pulp.LpStatus[prob.status]} on the joint model")
        return finish_joint(data, "milp", SolveStatus.UNKNOWN, None, bound, time.perf_counter() - t0, details,
                            reason=f"no plan found within the time limit of {time_limit_s:g} s")
    found = _extract(data, x, u)
    proven = prob.sol_status == pulp.LpSolutionOptimal and math.isfinite(bound)
    remaining = time_limit_s - (time.perf_counter() - t0)
    if proven and tie_break and remaining > 0:
        # B within CBC's tolerance of the optimum (a bound tighter than its tolerances can make
        # its presolve call the model infeasible); the exact comparison is made after pricing
        bottleneck.upBound = (bottleneck.varValue or 0.0) + TOLERANCE_SLACK * SCALE_MAX
        weight = positions * (3 * SCALE_MAX + 1) + 1
        prob.setObjective(weight * sum_(u[r][g] for r in range(positions) for g in range(n_lab)) + sum_(t_stage))
        _warm(data, found, x, u, v)
        run_cbc(prob, remaining, threads, seed, warm_start=True, keep_log=False)
        details["tie_break"] = pulp.LpStatus[prob.status]
        if prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            try:
                again = _extract(data, x, u)
            except PartitionerError:  # CBC said optimal but gave no plan (its tolerances): keep the first
                details["tie_break"] = "no plan read"
            else:
                if again.solution.bottleneck_s <= found.solution.bottleneck_s:
                    found = again
    status = SolveStatus.OPTIMAL if proven else SolveStatus.FEASIBLE
    log.debug("joint milp: %s, %d arcs, objective %.6g s, bound %.6g s", status, n_arcs,
              found.solution.bottleneck_s, bound)
    return finish_joint(data, "milp", status, found, bound, time.perf_counter() - t0, details)


def _warm(data: JointData, plan: JointPlan, x: list[Any], u: list[list[Any]], v: list[list[Any]]) -> None:
    """``plan`` as CBC's warm start (arcs, labels, link classes)."""
    labs = data.label_index(plan)
    q = len(labs)
    chosen = set()
    for k, (a, b) in enumerate(zip(plan.cuts, plan.cuts[1:])):
        t = data.type_names.index(data.types[labs[k]])
        chosen.update(np.flatnonzero((data.r == q - 1 - k) & (data.gpu == t) & (data.i == a) & (data.j == b)).tolist())
    for a, var in enumerate(x):
        var.setInitialValue(1 if a in chosen else 0)
    at = {q - 1 - k: g for k, g in enumerate(labs)}
    for r, row in enumerate(u):
        for g, var in enumerate(row):
            var.setInitialValue(1 if at.get(r) == g else 0)
    for r, row in enumerate(v):
        cls = data.pair_class[at[r + 1], at[r]] if (r + 1) in at else -1
        for c, var in enumerate(row):
            var.setInitialValue(1 if c == cls else 0)


def _extract(data: JointData, x: list[Any], u: list[list[Any]]) -> JointPlan:
    """The chosen arcs and labels, as a plan priced by the cost model."""
    picked = sorted(((int(data.r[a]), int(data.i[a]), int(data.j[a])) for a, var in enumerate(x)
                     if (var.varValue or 0.0) > 0.5), reverse=True)
    q = len(picked)
    cuts = [0] + [j for _, _, j in picked]
    labs = []
    for r, _, _ in picked:
        on = [g for g in range(len(data.labels)) if (u[r][g].varValue or 0.0) > 0.5]
        if len(on) != 1:
            raise PartitionerError(f"the joint model gave position {r} the labels {on}")
        labs.append(on[0])
    if [r for r, _, _ in picked] != list(range(q - 1, -1, -1)) or any(picked[k][1] != cuts[k] for k in range(q)):
        raise PartitionerError(f"the joint model returned arcs that do not form a split: {picked}")
    return data.realise(labs, cuts)
