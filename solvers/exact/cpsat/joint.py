"""Joint device mapping and split of one pipeline as a CP-SAT model (data: :mod:`solvers.exact.joint`).

Positions ``r`` count from the end (``r = 0``: the last stage). Variables:

    x[a]      arc a = (r, t, i, j) chosen: position r runs on GPU type t and holds [i, j)
    u[r, g]   position r runs on label g (a (node, gpu type) group of interchangeable GPUs)
    v[r, c]   the link between positions r + 1 and r is of class c (r + 1 exists)
    s[r]      ticks of the message at the cut where position r starts (its ``back``, and
              the ``out`` of position r + 1); T[r] stage r's ticks; B the bottleneck

Constraints (one line of maths per group):

    sum_{a: i=0} x[a] = 1                                              the pipeline starts at layer 0
    sum_{a in (r+1, *, *, c)} x[a] = sum_{a in (r, *, c, *)} x[a]     r < R-1, 0 < c < L (flow)
    sum_{a in (r, t)} x[a] = sum_{g of type t} u[r, g]                 the arc's type is the label's
    sum_r u[r, g] = n_g   (<= n_g with allow_fewer)                    every GPU used once
    sum_c v[r, c] = sum_g u[r+1, g]                                    one link class per adjacent pair
    v[r, c] >= u[r+1, g] + sum_{h: class(g, h) = c} u[r, h] - 1        the class the labels make
    s[r] >= sum_{a in (r, *, i>0, *)} tick(msg_c[i]) x[a]   if v[r, c]  the message on that link
    s[r] >= sum_{a in (r, *, i>0, *)} tick(min_c msg_c[i]) x[a]         (redundant: the cheapest link)
    T[r] >= sum_{a in r} tick(work[a]) x[a] + s[r] + s[r-1]            additive (overlap: one row each,
                                                                       the transfers plus the wave sync)
    B >= T[r];  first use of node N_k before N_{k+1} for interchangeable nodes
    B >= floor(LB / tick) - rounding        LB: the type-count DP relaxation (solvers/exact/joint_bound.py)
    minimise B;   then  B <= B*, minimise W * stages + sum_r T[r]   (tie-break, as the chain models)

Search: a decision strategy on the labels in pipeline order (first stage first, CP-SAT's
``add_decision_strategy``), which CP-SAT's workers follow where they use fixed strategies.

Every time is rounded **down** to ticks (``tick = largest arc time / resolution``), term by
term, so every real plan costs at least its model value: CP-SAT's bound times the tick (less a
hundredth of a tick) is a valid lower bound over every order and split. The model prices the
realised plan within ``details["rounding_ticks"]`` ticks below the cost model (one per rounded
term of a stage); the plan's objective is always the cost model's, recomputed.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from typing import Any

import numpy as np

from partitioner.errors import PartitionerError
from solvers.exact.cpsat.run import cpsat_solver
from solvers.exact.joint import JointData, JointPlan, finish_joint
from solvers.exact.joint_bound import before_model, relaxed_floor
from solvers.progress import solve_cpsat
from solvers.result import SolveResult, SolveStatus

__all__ = ["solve_joint"]

log = logging.getLogger(__name__)

FLOAT_SAFETY_TICKS = 0.01


def _ticks(values: np.ndarray, tick_s: float) -> list[int]:
    return [int(v) for v in np.floor(np.asarray(values) / tick_s).astype(np.int64)]


def solve_joint(data: JointData, *, time_limit_s: float, threads: int, seed: int, resolution: int,
                tie_break: bool, t0: float, symmetry: bool = True, bound_dp: bool = True) -> SolveResult:
    """Order and split by CP-SAT; OPTIMAL means optimal over every order and split (to a tick)."""
    from ortools.sat.python import cp_model

    n_arcs, positions, n_lab = len(data.r), data.positions, len(data.labels)
    data, relaxed, done = before_model(data, "cpsat", bound_dp, time_limit_s, t0)
    if done is not None:
        return done
    details: dict[str, object] = {}
    largest = float(max(data.work_s.max(), data.class_s.max(initial=0.0)))
    tick_s = largest / resolution if largest > 0 else 1.0
    work = _ticks(data.work_s, tick_s)
    wave = _ticks(data.wave_s, tick_s)
    msg = [_ticks(row, tick_s) for row in data.class_s]
    cheapest = _ticks(data.class_s.min(axis=0), tick_s) if len(data.class_s) else [0] * (data.num_layers + 1)
    rounding_ticks = 2 if data.overlap else 3  # rounded terms in a stage's time
    details.update(tick_s=tick_s, rounding_ticks=rounding_ticks)
    top = max(work) + 2 * max((max(m) for m in msg), default=0) + 1
    L = data.num_layers
    by_r = [data.arcs_of(r).tolist() for r in range(positions)]
    overlap = data.overlap

    model = cp_model.CpModel()
    x = [model.new_bool_var(f"x{a}") for a in range(n_arcs)]
    u = [[model.new_bool_var(f"u{r}_{g}") for g in range(n_lab)] for r in range(positions)]
    n_cls = len(data.class_s)
    v = [[model.new_bool_var(f"v{r}_{c}") for c in range(n_cls)] for r in range(positions - 1)]
    s = [model.new_int_var(0, top, f"s{r}") for r in range(positions - 1)]
    t_stage = [model.new_int_var(0, top, f"T{r}") for r in range(positions)]
    bottleneck = model.new_int_var(0, top, "B")
    lin = cp_model.LinearExpr

    # the pipeline starts at layer 0; flow through the positions
    model.add_exactly_one([x[a] for a in range(n_arcs) if data.i[a] == 0])
    for r in range(positions - 1):
        for c in range(1, L):
            ins = [x[a] for a in by_r[r + 1] if data.j[a] == c]
            outs = [x[a] for a in by_r[r] if data.i[a] == c]
            if ins or outs:
                model.add(lin.sum(ins) == lin.sum(outs))
    # the arc's type is the position's label's; every label used as often as it has GPUs
    for r in range(positions):
        for t in range(len(data.type_names)):
            arcs_t = [x[a] for a in by_r[r] if data.gpu[a] == t]
            labs = [u[r][g] for g in range(n_lab) if data.types[g] == data.type_names[t]]
            model.add(lin.sum(arcs_t) == lin.sum(labs))
    for g in range(n_lab):
        used = lin.sum([u[r][g] for r in range(positions)])
        if data.problem.allow_fewer:
            model.add(used <= data.counts[g])
        else:
            model.add(used == data.counts[g])
    # one link class per adjacent pair, the one its labels make
    for r in range(positions - 1):
        model.add(lin.sum(v[r]) == lin.sum(u[r + 1]))
        for g in range(n_lab):
            for c in range(n_cls):
                hs = [u[r][h] for h in range(n_lab) if data.pair_class[g, h] == c]
                if hs:
                    model.add(v[r][c] >= u[r + 1][g] + lin.sum(hs) - 1)
    # the message at the cut where position r starts, on its link
    for r in range(positions - 1):
        inner = [a for a in by_r[r] if data.i[a] > 0]
        xs = [x[a] for a in inner]
        for c in range(n_cls):
            model.add(s[r] >= lin.weighted_sum(xs, [msg[c][data.i[a]] for a in inner])).only_enforce_if(v[r][c])
        model.add(s[r] >= lin.weighted_sum(xs, [cheapest[data.i[a]] for a in inner]))
    # stage time and bottleneck
    for r in range(positions):
        xs = [x[a] for a in by_r[r]]
        links = ([s[r]] if r < positions - 1 else []) + ([s[r - 1]] if r > 0 else [])
        if overlap:
            model.add(t_stage[r] >= lin.weighted_sum(xs, [work[a] for a in by_r[r]]))
            waves = lin.weighted_sum(xs, [wave[a] for a in by_r[r]])
            for link in links:
                model.add(t_stage[r] >= waves + link)
        else:
            model.add(t_stage[r] >= lin.weighted_sum(xs, [work[a] for a in by_r[r]]) + lin.sum(links))
        model.add(bottleneck >= t_stage[r])
    # redundant, for the relaxation: the stages of type t do at most n_t * B of work, and all
    # stage times (work, and both sides of every message) add up to at most p * B
    for t, name in enumerate(data.type_names):
        n_t = sum(c for g, c in enumerate(data.counts) if data.types[g] == name)
        sel = [a for a in range(n_arcs) if data.gpu[a] == t]
        model.add(lin.weighted_sum([x[a] for a in sel], [work[a] for a in sel]) <= n_t * bottleneck)
    if not overlap:
        model.add(lin.sum(t_stage) <= sum(data.counts) * bottleneck)
    # the relaxation's bound (solvers/exact/joint_bound.py), less the rounding: no plan's model value is below it
    if math.isfinite(relaxed) and relaxed > 0:
        model.add(bottleneck >= max(0, math.floor(relaxed / tick_s) - rounding_ticks - 1))
    # interchangeable nodes are first used in the cluster's order (positions from the end: a
    # later node used at r needs the earlier one used at some r' > r)
    if symmetry:
        for group in data.symmetric_nodes:
            for early, late in itertools.pairwise(group):
                e_labs = [g for g in range(n_lab) if data.node_of(g) == early]
                l_labs = [g for g in range(n_lab) if data.node_of(g) == late]
                for r in range(positions):
                    before = [u[rr][g] for rr in range(r + 1, positions) for g in e_labs]
                    model.add(lin.sum([u[r][g] for g in l_labs]) <= lin.sum(before))
    model.minimize(bottleneck)
    # search the order first, from the first stage on (the split then follows by propagation):
    # on ResNet-152 over the HetPipe cluster this found the optimum, which the default search did not
    model.add_decision_strategy([u[r][g] for r in reversed(range(positions)) for g in range(n_lab)],
                                cp_model.CHOOSE_FIRST, cp_model.SELECT_MAX_VALUE)

    if data.start is not None:
        _hint(model, data, data.start, x, u, v)

    left = max(time_limit_s - (time.perf_counter() - t0), 0.1 * time_limit_s)  # the hint and model took the rest
    solver = cpsat_solver(left, threads, seed)
    code = solve_cpsat(solver, model, "cpsat", tick_s)
    details.update(cpsat_status=solver.status_name(code), cpsat_wall_s=solver.wall_time,
                   branches=solver.num_branches)
    if code == cp_model.MODEL_INVALID:
        raise PartitionerError(f"CP-SAT rejected the joint model: {model.validate()}")
    if code == cp_model.INFEASIBLE:
        return finish_joint(data, "cpsat", SolveStatus.INFEASIBLE, None, math.nan, time.perf_counter() - t0, details)
    # CP-SAT's bound, or the relaxation's where CP-SAT has not reached it yet (both are valid)
    bound = max(0.0, (solver.best_objective_bound - FLOAT_SAFETY_TICKS) * tick_s, relaxed_floor(relaxed))
    details["bound_s"] = bound
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return finish_joint(data, "cpsat", SolveStatus.UNKNOWN, None, bound, time.perf_counter() - t0, details,
                            reason=f"no plan found within the time limit of {time_limit_s:g} s")
    found = _extract(data, solver, x, u)
    details["model_objective_s"] = _model_value(data, found, work, wave, msg) * tick_s
    remaining = time_limit_s - (time.perf_counter() - t0)
    if code == cp_model.OPTIMAL and tie_break and remaining > 0:
        # stages within the optimum's ticks, the shortest pipeline, then the least total stage time
        model.add(bottleneck <= int(solver.objective_value))
        weight = positions * (top + 1) + 1
        model.minimize(weight * lin.sum([u[r][g] for r in range(positions) for g in range(n_lab)])
                       + lin.sum(t_stage))
        model.clear_hints()
        _hint(model, data, found, x, u, v)
        solver.parameters.max_time_in_seconds = float(remaining)
        code2 = solver.solve(model)
        details["tie_break"] = solver.status_name(code2)
        if code2 in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            again = _extract(data, solver, x, u)
            if again.solution.bottleneck_s <= found.solution.bottleneck_s:
                found = again
                details["model_objective_s"] = _model_value(data, found, work, wave, msg) * tick_s
    status = SolveStatus.OPTIMAL if code == cp_model.OPTIMAL else SolveStatus.FEASIBLE
    log.debug("joint cpsat: %s, %d arcs, objective %.6g s, bound %.6g s", status, n_arcs,
              found.solution.bottleneck_s, bound)
    return finish_joint(data, "cpsat", status, found, bound, time.perf_counter() - t0, details)


def _hint(model: Any, data: JointData, plan: JointPlan, x: list[Any], u: list[list[Any]],
          v: list[list[Any]]) -> None:
    """``plan`` as CP-SAT's solution hint (arcs, labels, link classes)."""
    labs = data.label_index(plan)
    q = len(labs)
    chosen = set()
    for k, (a, b) in enumerate(zip(plan.cuts, plan.cuts[1:])):
        t = data.type_names.index(data.types[labs[k]])
        hit = np.flatnonzero((data.r == q - 1 - k) & (data.gpu == t) & (data.i == a) & (data.j == b))
        chosen.update(hit.tolist())
    for a, var in enumerate(x):
        model.add_hint(var, a in chosen)
    at = {q - 1 - k: g for k, g in enumerate(labs)}
    for r, row in enumerate(u):
        for g, var in enumerate(row):
            model.add_hint(var, at.get(r) == g)
    for r, row in enumerate(v):
        cls = data.pair_class[at[r + 1], at[r]] if (r + 1) in at else -1
        for c, var in enumerate(row):
            model.add_hint(var, c == cls)


def _extract(data: JointData, solver: Any, x: list[Any], u: list[list[Any]]) -> JointPlan:
    """The chosen arcs and labels, as a plan priced by the cost model."""
    picked = sorted(((int(data.r[a]), int(data.i[a]), int(data.j[a])) for a in range(len(x))
                     if solver.boolean_value(x[a])), reverse=True)
    q = len(picked)
    cuts = [0] + [j for _, _, j in picked]
    labs = []
    for r, _, _ in picked:
        on = [g for g in range(len(data.labels)) if solver.boolean_value(u[r][g])]
        if len(on) != 1:
            raise PartitionerError(f"the joint model gave position {r} the labels {on}")
        labs.append(on[0])
    if [r for r, _, _ in picked] != list(range(q - 1, -1, -1)) or any(
            picked[k][1] != cuts[k] for k in range(q)):
        raise PartitionerError(f"the joint model returned arcs that do not form a split: {picked}")
    return data.realise(labs, cuts)


def _model_value(data: JointData, plan: JointPlan, work: list[int], wave: list[int], msg: list[list[int]]) -> int:
    """The model's bottleneck (ticks) for ``plan``: the rounded terms, added as the model does."""
    labs = data.label_index(plan)
    q = len(labs)
    worst = 0
    for k, (a, b) in enumerate(zip(plan.cuts, plan.cuts[1:])):
        t = data.type_names.index(data.types[labs[k]])
        arc = int(np.flatnonzero((data.r == q - 1 - k) & (data.gpu == t) & (data.i == a) & (data.j == b))[0])
        back = msg[data.pair_class[labs[k - 1], labs[k]]][a] if k else 0
        out = msg[data.pair_class[labs[k], labs[k + 1]]][b] if k + 1 < q else 0
        stage = max(work[arc], wave[arc] + back, wave[arc] + out) if data.overlap else work[arc] + back + out
        worst = max(worst, stage)
    return worst
