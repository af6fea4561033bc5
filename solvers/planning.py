"""Planning: one request, one answer. ``plan(profile, cluster, request) -> SolveResult``.

A :class:`PlanRequest` says what ``partitioner plan`` was asked (solver, schedule, devices,
chunks, micro-batches, virtual workers, ...); :func:`plan` routes it to the one planning path
that answers it and returns a :class:`~solvers.result.SolveResult`:

* ``micro_batches="auto"``: the micro-batch size and count for ``global_batch``, each candidate
  planned by the cluster planner (:func:`solvers.cluster.microbatch.choose_micro_batches` over
  :func:`solvers.cluster.planner.plan_cluster`);
* virtual workers, a grouping policy or replication: the cluster planner (solver ``hetero``);
* otherwise the named solver through :func:`solvers.solve` (``dp`` also covers multi-chunk
  schedules and ``schedule="auto"``, :mod:`solvers.pipeline.router`).

An infeasible request is ``SolveStatus.INFEASIBLE`` with a reason, never ``None``; a request
that contradicts itself is a :class:`~partitioner.errors.FormatError` when it is made. The
request's fields are the options of ``partitioner plan``; its errors name the fields (the
command shows them as its flags, ``micro_batches`` as ``--micro-batches``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from partitioner.cluster import MAX_GPUS, Cluster
from partitioner.cost import CostOptions
from partitioner.errors import OptionError
from partitioner.plan import MAX_MICRO_BATCHES
from partitioner.profile import Profile
from partitioner.schedule import spec
from solvers import solve
from solvers.pipeline.chunked import parse_chunks
from solvers.progress import shown
from solvers.result import SolveResult

__all__ = ["SEARCHED", "TIME_LIMITED", "PlanRequest", "plan", "shown"]

TIME_LIMITED = ("cpsat", "milp", "hetero")  # solvers that take a time limit
SEARCHED = ("cpsat", "milp")  # solvers with search workers and a random seed


def _count(value: int | str | None, name: str, most: int) -> None:
    ok = value is None or value == "auto" or (
        isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= most)
    if not ok:
        raise OptionError(name, value, f"must be an integer in [1, {most:,}] or 'auto'")


@dataclass(frozen=True)
class PlanRequest:
    """What to plan. ``None`` leaves an option to the solver (its default).

    ``micro_batches``: a count, or ``"auto"`` to choose the size and count for ``global_batch``
    samples per virtual worker. ``chunks``: model chunks per device for a multi-chunk schedule
    (an integer as text or ``"auto"``). ``virtual_workers`` (a count or ``"auto"``), ``policy``
    and ``replication`` ask for the cluster planner. ``threads`` and ``seed`` are the search
    workers and random seed of cpsat / milp; ``chain_order`` has them split the profile's layer
    order into ranges rather than plan convex stages of its graph (:mod:`solvers.exact.graph`);
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
    policy: str | None = None
    replication: bool = False
    objective: str = "sync"
    simulate_top: int = 4
    time_limit_s: float | None = None
    threads: int | None = None
    seed: int | None = None
    chain_order: bool = False  # cpsat / milp: ranges of the profile's order, not convex stages of its graph
    fixed_order: bool = False  # cpsat / milp: split over the devices in the given order (no mapping in the model)

    def __post_init__(self) -> None:
        if self.devices is not None:
            object.__setattr__(self, "devices", tuple(self.devices))
        _count(self.micro_batches, "micro_batches", MAX_MICRO_BATCHES)
        _count(self.virtual_workers, "virtual_workers", MAX_GPUS)
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
        if self.chain_order and self.planner not in SEARCHED:
            raise OptionError("chain_order", True, f"applies to the {', '.join(SEARCHED)} solvers (the "
                              f"{self.planner} solver plans the chain order already)")
        if self.fixed_order and self.planner not in SEARCHED:
            raise OptionError("fixed_order", True, f"applies to the {', '.join(SEARCHED)} solvers (the "
                              f"{self.planner} solver keeps the given order already or chooses it itself)")
        if self.micro_batches == "auto" and self.global_batch is None:
            raise OptionError("micro_batches", "auto", "needs `global_batch` (samples per virtual worker "
                              "per iteration) to choose the micro-batch size and count")

    @property
    def multi_chunk(self) -> bool:
        """Model chunks per device: asked for, or implied by the schedule."""
        return self.chunks is not None or (self.schedule != "auto" and spec(self.schedule).multi_chunk)

    @property
    def cluster_planner_asked(self) -> bool:
        return self.virtual_workers is not None or self.policy is not None or self.replication

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
        if self.chain_order:
            kw["dag"] = False
        if self.fixed_order:
            kw["fixed_order"] = True
        if isinstance(self.micro_batches, int):
            kw["micro_batches"] = self.micro_batches
        return kw


def plan(profile: Profile, cluster: Cluster, request: PlanRequest) -> SolveResult:
    """The plan ``request`` asks for. With ``micro_batches="auto"`` the plan is of the profile
    at the chosen size (``profile.at_size(plan.micro_batch_size)``) and ``details`` hold the
    choice (``micro_batch_choice``) and the lines that explain it (``messages``)."""
    if request.micro_batches != "auto":
        return solve(profile, cluster, solver=request.planner, **request.solver_options())
    from solvers.cluster.microbatch import choose_micro_batches
    from solvers.cluster.planner import plan_cluster

    assert request.global_batch is not None  # checked by PlanRequest
    choice = choose_micro_batches(profile, cluster, request.global_batch, plan_cluster,
                                  **request.solver_options())
    if not choice.result.ok:
        return choice.result
    b = choice.micro_batch_size
    messages = [f"micro-batch size {b} x {choice.micro_batches} micro-batches "
                f"(first micro-batch in {choice.first_slices} slice(s)): {choice.samples_per_s:.2f} samples/s"]
    measured: Sequence[int] = profile.measured_sizes
    if b != profile.micro_batch_size and len(measured) == 1:
        messages.append(f"note: size {b} is priced by scaling the profile measured at "
                        f"{profile.micro_batch_size} linearly, which ignores the fixed costs of a small batch "
                        f"(kernel launches, reading the weights) and favours small sizes; profile the model at "
                        f"the sizes you consider to choose among measured numbers")
    elif b not in measured:
        messages.append(f"note: size {b} is priced by interpolating between the measured "
                        f"sizes {', '.join(map(str, measured))}")
    chosen = {"micro_batch_size": b, "micro_batches": choice.micro_batches, "first_slices": choice.first_slices,
              "samples_per_s": choice.samples_per_s, "tried": [list(t) for t in choice.tried]}
    return replace(choice.result, details={**choice.result.details, "micro_batch_choice": chosen,
                                           "messages": messages})
