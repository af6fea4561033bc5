"""The plan report: one figure per quantity, and where two models give two figures, it says which is which."""

from __future__ import annotations

from dataclasses import replace

from partitioner.cost import CostModel
from partitioner.report import format_plan
from solvers.cluster.planner import plan_cluster
from tests._hetero_fixtures import small_cluster, synthetic_profile


def _planned():  # type: ignore[no-untyped-def]
    profile = synthetic_profile(8, seed=2, types=("TITAN-V", "RTX-2060"))
    cluster = small_cluster([["TITAN-V", "RTX-2060"], ["TITAN-V", "RTX-2060"]], inter=1.0)
    res = plan_cluster(profile, cluster, 2, "opt", micro_batches=4)
    assert res.ok and res.plan is not None
    return res.plan, CostModel(profile, cluster)


def test_a_cluster_plan_names_the_closed_form_where_the_simulator_differs() -> None:
    plan, cost = _planned()
    simulated = plan.predicted["samples_per_s"]
    closed = {**plan.meta["closed_form"], "samples_per_s": simulated * 1.1}
    text = format_plan(replace(plan, meta={**plan.meta, "closed_form": closed}), cost)
    (line,) = [x for x in text.splitlines() if x.startswith("predicted: ")]
    assert f"{simulated:.1f} samples/s (simulated; the closed form the planner ranks by gives " \
           f"{simulated * 1.1:.1f} samples/s" in line


def test_one_figure_where_both_models_agree_or_the_plan_is_not_a_cluster_planners() -> None:
    plan, cost = _planned()
    simulated = plan.predicted["samples_per_s"]
    same = {**plan.meta["closed_form"], "samples_per_s": simulated}
    for meta in ({**plan.meta, "closed_form": same},
                 {k: v for k, v in {**plan.meta, "closed_form": {"samples_per_s": simulated * 1.1}}.items()
                  if k != "objective"}):
        text = format_plan(replace(plan, meta=meta), cost)
        (line,) = [x for x in text.splitlines() if x.startswith("predicted: ")]
        assert "closed form" not in line and line.endswith(f"{simulated:.1f} samples/s")
