"""Baseline partitioners, priced by the same cost model as every other plan.

Each splits every virtual worker's layers over its GPUs *in the cluster's listed order*
(no device mapping) by its own rule, then the plan is priced by
:mod:`partitioner.cost` and checked against memory:

* ``uniform``: equal layer counts (the first stages take the remainder).
* ``parameters``: DeepSpeed's ``partition_method="parameters"``: the contiguous split that
  minimises the largest stage's parameter count (solved exactly here).
* ``blockpartition``: torchgpipe's ``balance_by_time``, a heuristic that balances per-layer
  times measured on one GPU type: start from equal counts and shift one boundary layer out
  of the heaviest block while that lowers the larger of the two blocks it touches.
* ``pipedream``: PipeDream's optimiser, which assumes identical GPUs: the exact
  minimum-bottleneck DP run as if every GPU were of the first GPU's type (memory included),
  then priced on the real GPUs.

The ``parameters``, ``blockpartition`` and ``pipedream`` rules see one GPU type (the worker's
first GPU), as those tools do. Grouping: ``virtual_workers`` (default 1) and ``policy``
(np, ed, hd) as in :func:`solvers.cluster.planner.plan_cluster`. A split that does not fit in memory
is returned as INFEASIBLE with the device and the numbers, never as a plan.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import replace
from functools import partial

import numpy as np

from partitioner.cluster import Cluster, Device
from partitioner.cost import CostModel, CostOptions
from partitioner.errors import FormatError
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.profile import Profile
from partitioner.schedule import DEFAULT_MICRO_BATCHES, Schedule
from solvers.cluster.grouping import group
from solvers.cluster.planner import price_plan, throughput_upper_bound
from solvers.pipeline.dp import chain_dp
from solvers.predictions import with_predictions
from solvers.result import SolveResult, SolveStatus

__all__ = ["BASELINES", "blockpartition_cuts", "minmax_cuts", "solve", "solve_blockpartition",
           "solve_parameters", "solve_pipedream", "solve_uniform", "uniform_cuts"]

BASELINES = ("uniform", "parameters", "blockpartition", "pipedream")


def uniform_cuts(n_layers: int, parts: int) -> list[int]:
    """Cut points of ``parts`` blocks whose sizes differ by at most one layer."""
    q, r = divmod(n_layers, parts)
    cuts = [0]
    for k in range(parts):
        cuts.append(cuts[-1] + q + (1 if k < r else 0))
    return cuts


def minmax_cuts(weights: Sequence[float], parts: int) -> list[int]:
    """Cut points of ``parts`` non-empty contiguous blocks minimising the largest block sum."""
    w = np.asarray(weights, dtype=np.float64)
    n = len(w)
    pre = np.concatenate([[0.0], np.cumsum(w)])
    block = pre[None, :] - pre[:, None]
    cols = np.arange(n + 1)
    f = np.full(n + 1, np.inf)
    f[n] = 0.0
    back = []
    for _ in range(parts):
        cand = np.where(cols[None, :] > cols[:, None], np.maximum(block, f[None, :]), np.inf)
        arg = cand.argmin(axis=1)
        f = cand[cols, arg]
        back.append(arg)
    back.reverse()
    cuts = [0]
    for k in range(parts):
        cuts.append(int(back[k][cuts[-1]]))
    return cuts


def blockpartition_cuts(times: Sequence[float], parts: int) -> list[int]:
    """Heuristic balance of ``times`` into ``parts`` blocks by shifting boundary layers."""
    t = list(map(float, times))
    cuts = uniform_cuts(len(t), parts)
    pre = np.concatenate([[0.0], np.cumsum(t)])

    def load(k: int) -> float:
        return float(pre[cuts[k + 1]] - pre[cuts[k]])

    for _ in range(len(t) * parts):
        loads = [load(k) for k in range(parts)]
        k = int(np.argmax(loads))
        moved = False
        for nb, edge in ((k - 1, k), (k + 1, k + 1)):  # neighbour block, cut index between them
            if not 0 <= nb < parts or cuts[k + 1] - cuts[k] < 2:
                continue
            trial = list(cuts)
            trial[edge] += 1 if nb < k else -1
            old = cuts
            cuts = trial
            if max(load(k), load(nb)) < loads[k]:
                moved = True
                break
            cuts = old
        if not moved:
            break
    return cuts


def _cuts(rule: str, cost: CostModel, devices: Sequence[Device], schedule: Schedule) -> list[int] | None:
    n, p = cost.num_layers, len(devices)
    ref = devices[0].gpu_type
    if rule == "uniform":
        return uniform_cuts(n, p)
    if rule == "parameters":
        return minmax_cuts(cost.profile.array("param_bytes").tolist(), p)
    if rule == "blockpartition":
        return blockpartition_cuts([cost.compute_s(ref, i, i + 1) for i in range(n)], p)
    if rule == "pipedream":
        same = [Device(d.name, d.node, d.index, devices[0].type) for d in devices]
        sol = chain_dp(cost, same, schedule)
        return None if sol is None else list(sol.cuts)
    raise FormatError("solver", rule, f"baselines are {', '.join(BASELINES)}")


def solve(profile: Profile, cluster: Cluster, *, rule: str, virtual_workers: int = 1, policy: str | None = None,
          schedule: str = "1f1b", micro_batches: int = DEFAULT_MICRO_BATCHES, options: CostOptions | None = None,
          objective: str = "sync", devices: Sequence[str] | None = None) -> SolveResult:
    """Plan with the baseline ``rule`` (see the module docstring)."""
    t0 = time.perf_counter()
    sched = Schedule.of(schedule, micro_batches)
    sched.activations_in_flight(1)
    cost = CostModel(profile, cluster, options)
    devs = list(cluster.subset(devices) if devices is not None else cluster.devices)
    whole = {t: cost.compute_s(t, 0, cost.num_layers) for t in {d.kind for d in devs}}
    if virtual_workers == 1 and policy is None:
        groups = [devs]
    else:
        groups = group(policy or "np", devs, virtual_workers, whole.__getitem__)
    workers = []
    for w in groups:
        cuts = None if len(w) > cost.num_layers else _cuts(rule, cost, w, sched)
        if cuts is None:
            return SolveResult(SolveStatus.INFEASIBLE, None, runtime_s=time.perf_counter() - t0, method=rule,
                               reason=f"{rule}: no split of {cost.num_layers} layers over {len(w)} GPUs "
                                      f"({', '.join(d.name for d in w)}) fits its own model of the devices")
        workers.append(VirtualWorker(tuple(Stage((a, b), d.name, d.gpu_type)
                                           for a, b, d in zip(cuts[:-1], cuts[1:], w, strict=True))))
    plan = Plan(profile.model, tuple(workers), schedule, profile.micro_batch_size, micro_batches)
    try:
        cost.check_plan_memory(plan)
    except FormatError as err:
        return SolveResult(SolveStatus.INFEASIBLE, None, runtime_s=time.perf_counter() - t0, method=rule,
                           reason=f"the {rule} split does not fit in memory: {err}")
    predicted = price_plan(cost, plan, objective)
    bound = throughput_upper_bound(cost, devs)
    result = SolveResult(SolveStatus.FEASIBLE, None, 1.0 / predicted["samples_per_s"], 1.0 / bound,
                         time.perf_counter() - t0, rule, details={"virtual_workers": len(groups)})
    plan = with_predictions(replace(plan, solver=result.solver_info()), profile, cluster, options, predicted,
                            extra_meta={"baseline": rule, "objective": objective})
    plan.validate(profile, cluster)  # memory: checked above
    if not math.isfinite(predicted["samples_per_s"]):
        raise FormatError("profile", profile.model, "has zero time on every layer; nothing to balance")
    return replace(result, plan=plan)


solve_uniform = partial(solve, rule="uniform")
solve_parameters = partial(solve, rule="parameters")
solve_blockpartition = partial(solve, rule="blockpartition")
solve_pipedream = partial(solve, rule="pipedream")
