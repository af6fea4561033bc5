"""The one result type every solver returns."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from partitioner.plan import Plan, SolverInfo, SolveStatus

__all__ = ["SolveResult", "SolveStatus"]


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
        return SolverInfo(self.method, self.status, self.objective, self.lower_bound, self.gap,
                          self.runtime_s)
