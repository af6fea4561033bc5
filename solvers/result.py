"""The one result type every solver returns."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, TypedDict

from partitioner.plan import Plan, SolverInfo, SolveStatus

__all__ = ["SolveDetails", "SolveResult", "SolveStatus"]


class SolveDetails(TypedDict, total=False):
    """What a solver reports beside its certificate, key by key (each solver fills its own keys;
    every key is optional). Figures in seconds end in ``_s``."""

    # every solver
    messages: list[str]  # lines the command prints above the plan
    lower_bound_simple_s: float  # the largest layer / total work over total speed (for comparison)
    refused: list[Any]  # candidates left out, each with its reason
    ranking: list[dict[str, Any]]  # candidates ranked by simulated throughput (schedule="auto", counts)
    chunks: int  # model chunks per device (interleaved, bfs)
    micro_batch_choice: dict[str, Any]  # micro_batches="auto": the size and count chosen, and those tried
    # the integer models (solvers.exact)
    mapping: str  # "model": the device order decided in the model; "given": kept
    bound_s: float  # the backend's bound, converted to seconds, before capping at the objective
    tick_s: float  # CP-SAT: seconds per tick (times rounded down to ticks)
    unit_s: float  # CBC: seconds per model unit
    rounding_ticks: int  # CP-SAT joint model: ticks the realised plan may lie below the model
    model_objective_s: float  # CP-SAT joint model: the model's own objective, in seconds
    relaxed_bound_s: float  # the joint model's relaxation bound (solvers.exact.joint_bound)
    hint: bool  # a starting plan (the DP's split, the heuristic mapping) was given
    hint_s: float  # its bottleneck
    hint_from: str  # where it came from
    from_hint: bool  # the plan returned is the hint (the model found nothing better)
    pruned: bool  # stages slower than the hint's bottleneck were left out of the model
    arcs: int  # candidate stages in the model
    labels: int  # (node, GPU type) labels of the joint model
    link_classes: int  # link classes of the joint model
    symmetric_nodes: list[list[str]]  # interchangeable nodes (symmetry broken in the model)
    layers: int  # graph model: layers
    stages: int  # graph model: stages
    edges: int  # graph model: edges
    order: str | list[str]  # "graph" (convex stages), or the device order the joint model chose
    reordered: bool  # graph model: the plan's ranges count a reordered profile
    overflow_rounds: int  # graph model: solves again after excluding a stage the cost model refuses
    down_sets: int  # the dp solver on a graph profile: down-sets of the graph (solvers.pipeline.downsets)
    proof: str  # how optimality was shown ("bound": the relaxation met the plan)
    model: str  # why no model was solved ("skipped: ...")
    tie_break: str  # the second solve's status (least total stage time among the optima)
    cpsat_status: str
    cpsat_wall_s: float
    branches: int
    cbc_status: str
    cbc_failed: str  # PuLP's message where CBC exited with an error on a model's first solve (no plan)
    cbc_solution: int
    # the cluster planner (solvers.cluster)
    virtual_workers: int
    objective: str  # "sync" or "wsp"
    worker_evaluations: int  # workers mapped and split by the search
    exact_search: bool  # every grouping and mapping the closed form could prefer was searched
    grouping: str  # how the grouping was found
    bound: dict[str, Any]  # the fleet bound's figures (solvers.cluster.bounds.fleet)
    sync_bound: dict[str, Any]  # the bound with the all-reduce (solvers.cluster.bounds.sync)
    template_set: str  # "complete" or "chains": which worker templates were planned
    templates: int
    templates_planned: int
    rounds: int
    workers_per_template: dict[str, int]
    idle_gpus: int  # GPUs the counts plan leaves out
    samples_per_s: float  # the bound search's best grouping


@dataclass(frozen=True)
class SolveResult:
    """A solver's answer: the plan (if any) and its certificate."""

    status: SolveStatus
    plan: Plan | None
    objective: float = math.nan  # the modelled objective of ``plan`` (bottleneck seconds, ...)
    lower_bound: float = math.nan  # no plan can do better than this
    runtime_s: float = 0.0
    method: str = ""
    reason: str = ""  # why INFEASIBLE / UNKNOWN, in words with numbers
    details: SolveDetails = field(default_factory=lambda: SolveDetails())

    @property
    def gap(self) -> float:
        """Relative gap ``(objective - lower_bound) / objective``; 0 when proven optimal."""
        if self.status is SolveStatus.OPTIMAL:
            return 0.0
        if math.isnan(self.objective) or math.isnan(self.lower_bound) or self.objective <= 0:
            return math.nan
        return max(0.0, (self.objective - self.lower_bound) / self.objective)

    @property
    def ok(self) -> bool:
        return self.status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE) and self.plan is not None

    def solver_info(self) -> SolverInfo:
        return SolverInfo(self.method, self.status, self.objective, self.lower_bound, self.gap,
                          self.runtime_s)
