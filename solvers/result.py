"""The one result type every solver returns."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from partitioner.plan import Plan, SolverInfo

__all__ = ["SolveResult", "SolveStatus"]


class SolveStatus(str, enum.Enum):
    """How a solve ended. ``INFEASIBLE`` carries a reason; it is an answer, not a crash."""

    OPTIMAL = "optimal"  # proven optimal for the problem as modelled (gap 0)
    FEASIBLE = "feasible"  # a valid plan with a lower bound; the gap says how far it may be
    INFEASIBLE = "infeasible"  # proven: no plan satisfies the constraints (see ``reason``)
    UNKNOWN = "unknown"  # stopped (time limit) before finding a plan or proving infeasibility

    def __str__(self) -> str:
        return self.value


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
    details: dict[str, Any] = field(default_factory=dict)

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
        return SolverInfo(self.method, self.status.value, self.objective, self.lower_bound, self.gap,
                          self.runtime_s)
