"""The dp solver's predicted figures come from the simulator; candidates ranked by simulation."""

from __future__ import annotations

import pytest

from partitioner.cluster import Cluster
from partitioner.cost import CostModel, CostOptions
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner.schedule import Schedule
from solvers import solve
from solvers.pipeline.ranking import AUTO_SCHEDULES, rank_plans

GIB = 2**30


def profile(n: int = 8, saved: float = 1e6, out: float = 0.0) -> Profile:
    return Profile("toy", 2, tuple(
        LayerProfile(f"l{i}", param_bytes=1e6, saved_bytes=saved, output_bytes=out,
                     times={"V100": LayerTime(0.01 * (1 + i % 3), 0.02 * (1 + i % 3))}) for i in range(n)))


def test_dp_predictions_come_from_the_simulator_and_agree_with_closed_form() -> None:
    prof, cluster = profile(), Cluster.homogeneous("V100-SXM2-16GB", 1, 4, 16, 7)
    res = solve(prof, cluster, "dp", schedule="1f1b", micro_batches=6)
    plan = res.plan
    assert res.ok and plan is not None and plan.meta["predicted_by"] == "simulator"
    times = CostModel(prof, cluster).plan_stage_times_s(plan)
    # with no transfers the simulator's makespan is bounded by the closed form (fill + drain
    # around the bottleneck), and equals it when the bottleneck is the first stage's
    closed = Schedule.of("1f1b", 6).iteration_s(times)
    assert plan.predicted["iteration_s"] <= closed + 1e-12
    assert plan.predicted["iteration_s"] >= 6 * max(times) - 1e-12
    assert plan.predicted["bottleneck_s"] == pytest.approx(max(times))
    assert set(plan.meta["peak_memory_bytes"]) == {d.name for d in cluster.devices}


def test_auto_schedule_prefers_no_flush_and_respects_memory() -> None:
    prof, cluster = profile(), Cluster.homogeneous("V100-SXM2-16GB", 1, 4, 16, 7)
    res = solve(prof, cluster, "dp", schedule="auto", micro_batches=[4, 8])
    assert res.ok and res.plan is not None
    ranking = res.details["ranking"]
    assert len(ranking) == 2 * len(AUTO_SCHEDULES)  # every schedule auto plans, at both counts
    rates = [r["samples_per_s"] for r in ranking]
    assert rates == sorted(rates, reverse=True)
    assert res.plan.schedule == "2bw" and res.plan.micro_batches == 8  # no flush, smallest bubble
    assert res.plan.predicted["samples_per_s"] == pytest.approx(rates[0])


def test_auto_refuses_what_does_not_fit_and_says_why() -> None:
    # activations so large that gpipe (all m in flight on every stage) cannot fit
    prof = profile(saved=3 * GIB)
    cluster = Cluster.homogeneous("V100-SXM2-16GB", 1, 4, 16, 7)
    res = solve(prof, cluster, "dp", schedule="auto", micro_batches=[8], options=CostOptions())
    assert res.ok and res.plan is not None and res.plan.schedule != "gpipe"
    assert any(r.startswith("gpipe") for r in res.details["refused"])


def test_rank_plans_orders_by_simulated_throughput() -> None:
    prof, cluster = profile(), Cluster.homogeneous("V100-SXM2-16GB", 1, 4, 16, 7)
    plans = [solve(prof, cluster, "dp", schedule=s, micro_batches=m).plan for s in ("gpipe", "1f1b")
             for m in (2, 8)]
    ranked = rank_plans([p for p in plans if p is not None], prof, cluster)
    assert [r.plan.micro_batches for r in ranked][:2] == [8, 8]
    assert ranked[0].samples_per_s >= ranked[-1].samples_per_s


def test_cluster_planner_ranks_groupings_of_several_k_by_simulation():
    from solvers.cluster.planner import plan_cluster
    from tests._hetero_fixtures import small_cluster, synthetic_profile

    prof = synthetic_profile(12, seed=3)
    cl = small_cluster([["TITAN-V", "RTX-2060"], ["TITAN-RTX", "Quadro-P4000"]], inter=2.0)
    res = plan_cluster(prof, cl, "auto", "opt", micro_batches=4, simulate_top=4)
    ranking = res.details["ranking"]
    assert len(ranking) >= 2 and len({r["virtual_workers"] for r in ranking}) >= 2
    rates = [r["samples_per_s"] for r in ranking]
    assert rates == sorted(rates, reverse=True)
    assert res.plan.predicted["samples_per_s"] == pytest.approx(rates[0])  # the simulated best wins
    CostModel(prof, cl).validate_plan(res.plan)
