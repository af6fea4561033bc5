"""Planning: one request, one answer. ``plan(profile, cluster, request) -> SolveResult``.

A :class:`PlanRequest` says what ``partitioner plan`` was asked (solver, schedule, devices,
chunks, micro-batches, virtual workers, ...); :func:`plan` routes it to the one planning path
that answers it and returns a :class:`~solvers.result.SolveResult`:

* ``micro_batches="auto"``: for ``global_batch`` samples per iteration, the micro-batch size, the
  virtual workers, their micro-batch count and each GPU type's tensor-parallel degree, each size
  planned by :func:`solvers.cluster.tensor.plan_tensor_parallel` (the cluster planner on every
  candidate view, best bound first) and chosen by simulated samples/s
  (:func:`solvers.cluster.microbatch.choose_micro_batches`);
* virtual workers, a grouping policy or replication: the cluster planner (solver ``hetero``);
* otherwise the named solver through :func:`solvers.solve` (``dp`` also covers multi-chunk
  schedules and ``schedule="auto"``, :mod:`solvers.pipeline.router`).

An infeasible request is ``SolveStatus.INFEASIBLE`` with a reason, never ``None``; a request
that contradicts itself is a :class:`~partitioner.errors.FormatError` when it is made. The
request's fields are the options of ``partitioner plan``; its errors name the fields (the
command shows them as its flags, ``micro_batches`` as ``--micro-batches``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from partitioner.cluster import MAX_GPUS, Cluster
from partitioner.cost import CostOptions
from partitioner.errors import OptionError, PartitionerError
from partitioner.plan import MAX_MICRO_BATCHES
from partitioner.profile import MAX_MICRO_BATCH_SIZE, MAX_TENSOR_PARALLEL, Profile
from partitioner.schedule import first_slice_counts, spec
from solvers import solve
from solvers.pipeline.chunked import parse_chunks
from solvers.progress import shown
from solvers.result import SolveResult, SolveStatus

log = logging.getLogger(__name__)

__all__ = ["GRAPH_PLANNERS", "LEVER_PLANNERS", "SEARCHED", "TIME_LIMITED", "PlanRequest", "plan", "shown"]

TIME_LIMITED = ("cpsat", "milp", "hetero")  # solvers that take a time limit
SEARCHED = ("cpsat", "milp")  # solvers with search workers and a random seed
LEVER_PLANNERS = ("dp", "hetero", "cpsat", "milp")  # solvers that choose a recompute mode per stage
GRAPH_PLANNERS = ("dp", "cpsat", "milp")  # solvers that plan convex stages of a graph profile (unless chain_order)


def _count(value: int | str | None, name: str, most: int) -> None:
    ok = value is None or value == "auto" or (
        isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= most)
    if not ok:
        raise OptionError(name, value, f"must be an integer in [1, {most:,}] or 'auto'")


@dataclass(frozen=True)
class PlanRequest:
    """What to plan. ``None`` leaves an option to the solver (its default).

    ``micro_batches``: a count, or ``"auto"`` to choose the micro-batch size, the number of virtual
    workers ``K`` and the count ``m`` for ``global_batch`` samples per iteration (all workers
    together: ``K x m x size = global_batch``). ``tensor_parallel``: a degree for every GPU type, or
    ``"auto"`` (with ``micro_batches="auto"``) to choose one per type; unset, ``"auto"`` where the
    profile holds tensor-parallel shards and 1 elsewhere. ``chunks``: model chunks per device for a multi-chunk schedule
    (an integer as text or ``"auto"``). ``virtual_workers`` (a count or ``"auto"``), ``policy``
    and ``replication`` ask for the cluster planner. ``threads`` and ``seed`` are the search
    workers and random seed of cpsat / milp; ``chain_order`` has dp, cpsat and milp split a graph
    profile's layer order into ranges rather than plan convex stages of its graph
    (:mod:`solvers.pipeline.downsets`, :mod:`solvers.exact.graph`; the other planners split the
    layer order, with a note unless ``chain_order`` is given);
    ``fixed_order`` has them keep the devices' given order rather than decide the mapping in the
    model (:mod:`solvers.exact.joint`).
    """

    solver: str = "dp"
    schedule: str = "1f1b"
    options: CostOptions = field(default_factory=CostOptions)
    devices: tuple[str, ...] | None = None
    allow_fewer: bool = False
    chunks: str | None = None
    micro_batches: int | str | None = None
    global_batch: int | None = None
    virtual_workers: int | str | None = None
    tensor_parallel: int | str | None = None
    pipeline_parallel: int | None = None  # stages per virtual worker (one device each), with micro_batches auto
    policy: str | None = None
    replication: bool = False
    objective: str = "sync"
    simulate_top: int = 4
    time_limit_s: float | None = None
    threads: int | None = None
    seed: int | None = None
    chain_order: bool = False  # ranges of a graph profile's layer order, not convex stages of its graph
    fixed_order: bool = False  # cpsat / milp: split over the devices in the given order (no mapping in the model)

    def __post_init__(self) -> None:
        if self.devices is not None:
            object.__setattr__(self, "devices", tuple(self.devices))
        _count(self.micro_batches, "micro_batches", MAX_MICRO_BATCHES)
        _count(self.virtual_workers, "virtual_workers", MAX_GPUS)
        _count(self.tensor_parallel, "tensor_parallel", MAX_TENSOR_PARALLEL)
        if self.pipeline_parallel is not None:
            _count(self.pipeline_parallel, "pipeline_parallel", MAX_GPUS)
            if self.micro_batches != "auto":
                raise OptionError("pipeline_parallel", self.pipeline_parallel, "fixes the stages of every worker in "
                                  "the global-batch search: give `micro_batches` auto and `global_batch`")
        if self.tensor_parallel == "auto" and self.micro_batches != "auto":
            raise OptionError("tensor_parallel", "auto", "chooses the degrees with the micro-batches under a global "
                              "batch: give `micro_batches` auto and `global_batch`, or a degree")
        if self.multi_chunk:
            parse_chunks(self.chunks or "auto", self.schedule, "chunks")
            if self.solver != "dp" or self.cluster_planner_asked:
                raise OptionError("schedule", self.schedule, "multi-chunk plans are made by the dp solver for one "
                                  "virtual worker; leave `solver`, `virtual_workers`, `policy` and `replication` out")
            if self.micro_batches == "auto" or self.allow_fewer:
                name = "micro_batches" if self.micro_batches == "auto" else "allow_fewer"
                raise OptionError(name, getattr(self, name), f"not supported with the multi-chunk schedule "
                                  f"{self.schedule}; give a count and the devices")
        if self.uses_cluster_planner and self.solver not in ("dp", "hetero"):
            raise OptionError("solver", self.solver, "`virtual_workers`, `policy`, `replication` and `micro_batches` auto "
                              "plan with the hetero planner; leave `solver` out or use hetero")
        if self.uses_cluster_planner and self.allow_fewer:
            raise OptionError("allow_fewer", True, "applies to one pipeline (the dp, cpsat and milp solvers); the "
                              "cluster planner chooses its devices itself (name them with `devices`)")
        if self.time_limit_s is not None:
            if not self.time_limit_s > 0:
                raise OptionError("time_limit_s", self.time_limit_s, "must be > 0 seconds")
            if self.planner not in TIME_LIMITED:
                raise OptionError("time_limit_s", self.time_limit_s, f"applies to the {', '.join(TIME_LIMITED)} "
                                  f"solvers; {self.planner} needs none")
        for flag, value, least in (("threads", self.threads, 1), ("seed", self.seed, 0)):
            if value is None:
                continue
            if self.planner not in SEARCHED:
                raise OptionError(flag, value, f"applies to the {', '.join(SEARCHED)} solvers, not {self.planner}")
            if value < least:
                raise OptionError(flag, value, f"must be an integer >= {least}")
        if self.fixed_order and self.planner not in SEARCHED:
            raise OptionError("fixed_order", True, f"applies to the {', '.join(SEARCHED)} solvers (the "
                              f"{self.planner} solver keeps the given order already or chooses it itself)")
        if self.options.recompute != "none" and not self.levers_planned:
            raise OptionError("recompute", self.options.recompute, f"the {self.planner} solver"
                              f"{' with a multi-chunk schedule' if self.multi_chunk else ''} plans without activation "
                              f"recomputation (the {', '.join(LEVER_PLANNERS)} solvers plan it, with one-chunk "
                              "schedules); give none")
        if self.micro_batches == "auto" and self.global_batch is None:
            raise OptionError("micro_batches", "auto", "needs `global_batch` (samples per iteration, all virtual "
                              "workers together) to choose the micro-batch size, the workers and the count")

    @property
    def multi_chunk(self) -> bool:
        """Model chunks per device: asked for, or implied by the schedule."""
        return self.chunks is not None or (self.schedule != "auto" and spec(self.schedule).multi_chunk)

    @property
    def levers_planned(self) -> bool:
        """Whether the path that answers the request chooses recompute modes per stage (the chain DP,
        one-chunk, alone or in the cluster planner, and the exact models of one pipeline)."""
        return self.planner in LEVER_PLANNERS and not self.multi_chunk

    @property
    def cluster_planner_asked(self) -> bool:
        return (self.virtual_workers is not None or self.policy is not None or self.replication
                or self.tensor_parallel is not None)

    @property
    def uses_cluster_planner(self) -> bool:
        """Virtual workers, a policy, replication or a micro-batch choice: the cluster planner."""
        return self.cluster_planner_asked or self.micro_batches == "auto"

    @property
    def planner(self) -> str:
        """The solver that answers the request (a name in :data:`solvers.SOLVERS`)."""
        return "hetero" if self.uses_cluster_planner else self.solver

    def solver_options(self) -> dict[str, Any]:
        """The keyword options of :func:`solvers.solve` for :attr:`planner` (without the micro-batch
        count when it is to be chosen)."""
        kw: dict[str, Any] = {"schedule": self.schedule, "options": self.options}
        if self.devices is not None:
            kw["devices"] = list(self.devices)
        if self.allow_fewer:
            kw["allow_fewer"] = True
        if self.multi_chunk:
            kw["chunks"] = self.chunks or "auto"
        if self.uses_cluster_planner:
            kw.update(virtual_workers=self.virtual_workers or "auto", policy=self.policy or "opt",
                      replication=self.replication, objective=self.objective)
            if self.simulate_top:
                kw["simulate_top"] = self.simulate_top
        if self.time_limit_s is not None:
            kw["time_limit_s"] = self.time_limit_s
        if self.threads is not None:
            kw["threads"] = self.threads
        if self.seed is not None:
            kw["seed"] = self.seed
        if self.chain_order and self.planner in GRAPH_PLANNERS:
            kw["dag"] = False
        if self.fixed_order:
            kw["fixed_order"] = True
        if isinstance(self.micro_batches, int):
            kw["micro_batches"] = self.micro_batches
        return kw


def plan(profile: Profile, cluster: Cluster, request: PlanRequest) -> SolveResult:
    """The plan ``request`` asks for. With ``micro_batches="auto"`` the plan is of the profile
    at the chosen size (``profile.at_size(plan.micro_batch_size)``) and ``details`` hold the
    choice (``micro_batch_choice``) and the lines that explain it (``messages``). A plan with
    tensor parallelism names its groups ``NODE:FIRST-LAST`` (any cluster view prices them)."""
    if request.micro_batches != "auto":
        if isinstance(request.tensor_parallel, int) and request.tensor_parallel > 1:
            from solvers.cluster.tensor import type_degrees

            degrees = type_degrees(profile, cluster, request.tensor_parallel)
            cluster = cluster.with_tensor_parallel({t: d[0] for t, d in degrees.items()})
        res = solve(profile, cluster, solver=request.planner, **request.solver_options())
        return _with_projected(_chain_note(res, profile, request), profile, cluster, request)
    from solvers.cluster.tensor import plan_tensor_parallel

    assert request.global_batch is not None  # checked by PlanRequest
    g = request.global_batch
    tp = request.tensor_parallel
    res = plan_tensor_parallel(profile, cluster, g, sizes=_sizes(profile, g), options=request.options,
                               schedule=request.schedule, tensor_parallel=tp if isinstance(tp, int) else None,
                               virtual_workers=request.virtual_workers if isinstance(request.virtual_workers, int)
                               else None, pipeline=request.pipeline_parallel,
                               time_limit_s=request.time_limit_s or DEFAULT_SEARCH_S, replication=request.replication)
    if not res.ok or res.plan is None:
        return res
    res, slices, rate = _sliced(res, profile.at_size(res.plan.micro_batch_size), cluster, request.options)
    plan_ = res.plan
    assert plan_ is not None
    b, k, m = plan_.micro_batch_size, len(plan_.virtual_workers), plan_.micro_batches
    tp_chosen: dict[str, int] = dict(res.details.get("tensor_parallel", {}))  # type: ignore[call-overload]
    shown_tp = (", ".join(f"{t} idle" if d == 0 else f"{t} x{d}" for t, d in tp_chosen.items())
                if any(d != 1 for d in tp_chosen.values()) else "1")
    messages = [f"global batch {g}: {k} virtual worker(s) x {m} micro-batches of {b} (first micro-batch in "
                f"{slices} slice(s)), tensor parallel {shown_tp}: {rate:.2f} samples/s"]
    measured: Sequence[int] = profile.measured_sizes
    if b != profile.micro_batch_size and len(measured) == 1:
        messages.append(f"note: size {b} is priced by scaling the profile measured at "
                        f"{profile.micro_batch_size} linearly, which ignores the fixed costs of a small batch "
                        f"(kernel launches, reading the weights) and favours small sizes; profile the model at "
                        f"the sizes you consider to choose among measured numbers")
    elif b not in measured:
        messages.append(f"note: size {b} is priced by interpolating between the measured "
                        f"sizes {', '.join(map(str, measured))}")
    chosen = {"micro_batch_size": b, "micro_batches": m, "first_slices": slices, "virtual_workers": k,
              "tensor_parallel": tp_chosen, "global_batch": g, "samples_per_s": rate}
    return _with_projected(_chain_note(replace(res, details={**res.details, "micro_batch_choice": chosen,
                                                             "messages": messages}), profile, request),
                           profile, cluster, request)


def _with_projected(res: SolveResult, profile: Profile, cluster: Cluster, request: PlanRequest) -> SolveResult:
    """The plan with what of its prediction rests on projected times (``meta.projected_times``,
    :mod:`partitioner.projected`) and the lines saying so, where any of its times are projected."""
    from partitioner.projected import format_projected, projected_times

    if not res.ok or res.plan is None:
        return res
    try:
        p = projected_times(res.plan, profile.at_size(res.plan.micro_batch_size), cluster, request.options)
    except PartitionerError as err:  # a plan the closed form cannot price alone: the simulator's job
        log.info("projected times not summarised: %s", err)
        return res
    if not p.any:
        return res
    plan_ = replace(res.plan, meta={**res.plan.meta, "projected_times": p.to_dict()})
    return replace(res, plan=plan_, details={**res.details,
                                             "messages": [*res.details.get("messages", ()), *format_projected(p)]})


def _chain_note(res: SolveResult, profile: Profile, request: PlanRequest) -> SolveResult:
    """A planner that splits the layer order of a graph profile says so (unless asked to)."""
    if not profile.edges or request.chain_order or request.planner in GRAPH_PLANNERS:
        return res
    note = (f"note: the {request.planner} solver splits the profile's layer order (its chain), not convex stages of "
            f"its graph (one pipeline: the dp, cpsat and milp solvers); `chain_order` silences this note")
    return replace(res, details={**res.details, "messages": [*res.details.get("messages", ()), note]})


def _sliced(res: SolveResult, profile: Profile, cluster: Cluster, options: CostOptions
            ) -> tuple[SolveResult, int, float]:
    """The plan with its first micro-batch sliced in 1, 2 or 4 (AutoPipe), whichever the simulator
    finds fastest (flushing schedules whose size the slices divide), and its samples/s."""
    from solvers.cluster.microbatch import priced

    assert res.plan is not None
    best = (res, 1, priced(res.plan, profile, cluster, options)[1])
    for s in first_slice_counts(res.plan.schedule, res.plan.micro_batch_size, res.plan.micro_batches)[1:]:
        plan_ = replace(res.plan, first_slices=s)
        rate = priced(plan_, profile, cluster, options)[1]
        if rate > best[2]:
            best = (replace(res, plan=plan_), s, rate)
    if best[1] > 1:
        best = (_resliced(best[0], profile, cluster, options), best[1], best[2])
    return best


def _resliced(res: SolveResult, profile: Profile, cluster: Cluster, options: CostOptions) -> SolveResult:
    """A plan whose first micro-batch is now sliced, with its own simulated figures as objective
    and prediction. The search's bound holds for sliced plans (its fill terms take the slices
    :func:`partitioner.schedule.first_slice_counts` allows), so it stays the certificate."""
    from solvers.predictions import with_predictions

    assert res.plan is not None
    plan_ = with_predictions(res.plan, profile, cluster, options, res.plan.meta.get("closed_form", {}))
    rate = plan_.predicted.get("samples_per_s", 0.0) if plan_.predicted else 0.0
    objective = 1.0 / rate if rate > 0 else res.objective
    lower = res.lower_bound
    if lower > objective * (1 + 1e-9):  # a bound above the plan it was to bound: no certificate
        log.warning("the sliced plan (%.6g s per sample) beats its bound (%.6g); returned without a certificate",
                    objective, lower)
        lower = math.nan
    proven = not math.isnan(lower) and objective <= lower * (1 + 1e-9)
    out = replace(res, status=SolveStatus.OPTIMAL if proven else SolveStatus.FEASIBLE, objective=objective,
                  lower_bound=lower)
    return replace(out, plan=replace(plan_, solver=out.solver_info()))


DEFAULT_SEARCH_S = 60.0  # the global-batch search's time limit when none is given (all sizes together)
MAX_SIZES = 8  # micro-batch sizes the global-batch search tries at most


def _sizes(profile: Profile, global_batch: int) -> list[int]:
    """Micro-batch sizes to try for ``global_batch``: divisors of it, within the measured sizes
    when the profile has several (never extrapolated), at most MAX_SIZES of them (the measured ones
    first, then the largest)."""
    divisors = [b for b in range(1, min(global_batch, MAX_MICRO_BATCH_SIZE) + 1) if global_batch % b == 0]
    measured = profile.measured_sizes
    if len(measured) > 1:
        divisors = [b for b in divisors if measured[0] <= b <= measured[-1]]
    if not divisors:
        raise OptionError("global_batch", global_batch, f"no divisor lies within the measured micro-batch sizes "
                          f"{', '.join(map(str, measured))}")
    chosen = [b for b in divisors if b in measured]
    chosen += [b for b in reversed(divisors) if b not in chosen]
    return sorted(chosen[:MAX_SIZES])
