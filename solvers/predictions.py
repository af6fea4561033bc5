"""Predicted figures of a plan: from the discrete-event simulator whenever it can price the plan.

Solvers search with fast closed forms (the bottleneck, ``CostModel.plan_iteration_s``); the plan
they return carries the simulator's figures in ``Plan.predicted`` so that every plan is
judged by the same, more detailed model. The closed-form figures stay in
``meta["closed_form"]`` for comparison, and ``meta["predicted_by"]`` says which model
produced ``predicted``. Plans the simulator refuses (replicated stages, whose gradient
all-reduce it does not price) keep the closed form, with the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from partitioner.cluster import Cluster
from partitioner.cost import CostModel, CostOptions
from partitioner.errors import PartitionerError
from partitioner.plan import Plan
from partitioner.profile import Profile

__all__ = ["with_predictions"]

log = logging.getLogger(__name__)


def with_predictions(plan: Plan, profile: Profile, cluster: Cluster, options: CostOptions | None,
                     closed_form: Mapping[str, float], simulate: bool = True,
                     extra_meta: Mapping[str, Any] | None = None, *, cost: CostModel | None = None) -> Plan:
    """``plan`` with ``predicted`` from the simulator (or ``closed_form`` where it cannot apply).
    ``cost``: the caller's :class:`CostModel` of ``profile``, ``cluster`` and ``options``, shared."""
    meta: dict[str, Any] = {**plan.meta, **(extra_meta or {}), "closed_form": dict(closed_form)}
    predicted: dict[str, float] = dict(closed_form)
    meta["predicted_by"] = "closed form"
    if simulate:
        from partitioner.simulate import predict, simulate_plan

        cost = cost or CostModel(plan.profile_view(profile), cluster, options)
        try:
            tl = simulate_plan(plan, profile, cluster, options, cost=cost)
        except PartitionerError as err:
            meta["predicted_by"] = f"closed form ({err})"
            log.info("plan priced by the closed form: %s", err)
        else:
            predicted = predict(plan, profile, cluster, options, timeline=tl, cost=cost)
            if "bottleneck_s" in closed_form:  # the per-stage figure the solver optimised
                predicted["bottleneck_s"] = closed_form["bottleneck_s"]
            meta.update(predicted_by="simulator", bubble_fraction=dict(tl.bubble_fraction),
                        peak_memory_bytes=dict(tl.peak_memory_bytes))
    return replace(plan, predicted=predicted, meta=meta, pricing=options or CostOptions())
