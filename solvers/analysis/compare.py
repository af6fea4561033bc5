"""Every solver, grouping policy and baseline on the same profile, cluster and batching.

One pipeline (no virtual workers): the exact chain solvers ``dp``, ``cpsat`` and ``milp`` and
the baselines ``uniform``, ``parameters``, ``blockpartition`` and ``pipedream`` over the same
devices in the same order. With virtual workers (``K`` or ``"auto"``): the cluster planner under
each grouping policy (``np``, ``ed``, ``hd``, ``opt``), and the baselines on ``K`` virtual
workers grouped by HetPipe's ``np`` policy (``auto``: one per node), each split by its own rule.

Each entry keeps the solver's own certificate (objective and bound in its units: bottleneck
seconds for the chain solvers, seconds per sample for the cluster planner and the baselines)
and two throughputs every plan has: the closed form the solvers optimise
(``meta["closed_form"]``) and the discrete-event simulator's (``predicted``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from partitioner.cluster import Cluster
from partitioner.cost import CostOptions
from partitioner.errors import PartitionerError
from partitioner.plan import Plan, group_size
from partitioner.profile import Profile
from partitioner.schedule import DEFAULT_MICRO_BATCHES, spec
from solvers import solve

__all__ = ["BASELINE_NAMES", "CHAIN_SOLVERS", "POLICIES", "Comparison", "compare", "shared_certificate"]

CHAIN_SOLVERS = ("dp", "cpsat", "milp")
POLICIES = ("np", "ed", "hd", "opt")
BASELINE_NAMES = ("uniform", "parameters", "blockpartition", "pipedream")


@dataclass(frozen=True)
class Comparison:
    """One solver's answer on the shared inputs."""

    name: str
    kind: str  # "solver", "policy" or "baseline"
    status: str
    virtual_workers: int = 0
    objective: float = math.nan
    lower_bound: float = math.nan
    gap: float = math.nan
    unit: str = ""  # "s (bottleneck)" or "s/sample"
    model_samples_per_s: float = math.nan
    simulated_samples_per_s: float = math.nan
    solve_s: float = 0.0
    reason: str = ""
    plan: Plan | None = field(default=None, repr=False, compare=False)  # not in to_dict
    tensor_parallel: str = "1"  # the plan's tensor-parallel degrees ("1", "2", "1/4": groups of several)

    def __post_init__(self) -> None:
        if self.kind not in ("solver", "policy", "baseline"):
            raise ValueError(f"kind = {self.kind!r}: must be solver, policy or baseline")

    @property
    def ok(self) -> bool:
        return self.status in ("optimal", "feasible")

    def to_dict(self) -> dict[str, Any]:
        def num(x: float) -> float | None:
            return None if isinstance(x, float) and math.isnan(x) else x

        return {"name": self.name, "kind": self.kind, "status": self.status, "virtual_workers": self.virtual_workers,
                "objective": num(self.objective), "lower_bound": num(self.lower_bound), "gap": num(self.gap),
                "unit": self.unit, "model_samples_per_s": num(self.model_samples_per_s),
                "simulated_samples_per_s": num(self.simulated_samples_per_s), "solve_s": self.solve_s,
                "reason": self.reason, "tensor_parallel": self.tensor_parallel}


def _entry(name: str, kind: str, run: Any) -> Comparison:
    try:
        r = run()
    except (PartitionerError, ValueError) as err:  # a policy that does not apply to this cluster
        return Comparison(name, kind, "n/a", reason=str(err).splitlines()[0])
    except Exception as err:
        if type(err).__name__ != "PulpSolverError":
            raise
        # CBC, an outside program, ended abnormally (it can crash when a time limit stops a
        # warm-started search): this row has no result; the others stand
        return Comparison(name, kind, "error", reason=f"the MILP solver CBC failed ({' '.join(str(err).split())[:160]})")
    if not r.ok:
        return Comparison(name, kind, str(r.status), solve_s=r.runtime_s, reason=r.reason)
    plan = r.plan
    unit = "s/sample" if plan.meta.get("objective") in ("sync", "wsp") else "s (bottleneck)"
    degrees = "/".join(map(str, sorted({group_size(d) for d in plan.devices})))
    return Comparison(name, kind, str(r.status), len(plan.virtual_workers), r.objective, r.lower_bound, r.gap, unit,
                      float(plan.meta.get("closed_form", {}).get("samples_per_s", math.nan)),
                      float(plan.predicted.get("samples_per_s", math.nan)), r.runtime_s, plan=plan,
                      tensor_parallel=degrees)


def compare(profile: Profile, cluster: Cluster, *, virtual_workers: int | str | None = None,
            schedule: str = "1f1b", micro_batches: int = DEFAULT_MICRO_BATCHES, options: CostOptions | None = None,
            devices: Sequence[str] | None = None, time_limit_s: float = 10.0,
            solvers: Sequence[str] | None = None) -> list[Comparison]:
    """Run every applicable solver (or those named in ``solvers``) on the same inputs."""
    common: dict[str, Any] = {"schedule": schedule, "micro_batches": micro_batches, "options": options}
    if devices is not None:
        common["devices"] = list(devices)
    wanted = set(solvers) if solvers is not None else None
    out: list[Comparison] = []

    def want(name: str) -> bool:
        return wanted is None or name in wanted

    if virtual_workers is None:
        for name in CHAIN_SOLVERS:
            if want(name):
                # the given order for every solver, as the baselines split it (the same problem)
                limit = {} if name == "dp" else {"time_limit_s": time_limit_s, "fixed_order": True}
                out.append(_entry(name, "solver", lambda n=name, lim=limit: solve(profile, cluster, n, **common,
                                                                                    **lim)))
        for name in BASELINE_NAMES:
            if want(name):
                out.append(_entry(name, "baseline", lambda n=name: solve(profile, cluster, n, **common)))
        shape = spec(schedule)
        if not shape.flushes or shape.multi_chunk or shape.split_backward:  # gpipe, 1f1b
            return out
        # their closed form's iteration, sum of the stages + (m - 1) x the slowest, is at least
        # m x the slowest: a chain solver's proven bottleneck bound over the same devices and
        # order, per sample (over the micro-batch's b samples), bounds every row's seconds per sample
        bottleneck = [r.lower_bound for r in out if r.kind == "solver" and r.ok and r.unit.startswith("s (")
                      and math.isfinite(r.lower_bound) and r.lower_bound > 0]
        return shared_certificate(out, [max(bottleneck) / profile.micro_batch_size] if bottleneck else [])
    for policy in POLICIES:
        if want(policy):
            out.append(_entry(policy, "policy", lambda p=policy: solve(
                profile, cluster, "hetero", virtual_workers=virtual_workers, policy=p, time_limit_s=time_limit_s,
                **common)))
    k = len(cluster.nodes) if virtual_workers == "auto" else int(virtual_workers)
    for name in BASELINE_NAMES:
        if want(name):
            out.append(_entry(name, "baseline", lambda n=name: solve(profile, cluster, n, virtual_workers=k,
                                                                      policy="np", **common)))
    return shared_certificate(out)


def shared_certificate(rows: list[Comparison], extra_bounds: Sequence[float] = ()) -> list[Comparison]:
    """``rows`` judged by one certificate: the best bound any of them proved (or ``extra_bounds``
    gives, in seconds per sample).

    Every row plans the same problem (the cluster's GPUs in ``K`` virtual workers, or any ``K``,
    priced by the same closed form), and every row's bound holds for every plan of it: the fleet
    bound and the bound with the all-reduce for any grouping (of ``K`` workers where ``K`` is
    given), the baselines' perfect speed-up for any plan at all. So the largest of the bounds (in
    seconds per sample) bounds every row; each gap is measured against it, and a row is
    ``optimal`` only when it reaches it."""
    bounds = [r.lower_bound for r in rows if r.ok and r.unit == "s/sample" and math.isfinite(r.lower_bound)]
    bounds += [b for b in extra_bounds if math.isfinite(b) and b > 0]
    if not bounds:
        return rows
    best = max(bounds)
    out = []
    for r in rows:
        if not (r.ok and r.unit == "s/sample" and math.isfinite(r.objective) and r.objective > 0):
            out.append(r)
            continue
        gap = max(0.0, (r.objective - best) / r.objective)
        status = "optimal" if r.objective <= best * (1 + 1e-9) else "feasible"
        out.append(replace(r, lower_bound=best, gap=0.0 if status == "optimal" else gap, status=status))
    return out
