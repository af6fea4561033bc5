"""The closed form the cluster planners optimise against the simulator, on plans of several
virtual workers with the gradient all-reduce between them; and the tensor search's answer,
priced by the simulator where the two differ (workers' transfers sharing a link)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from partitioner.cost import CostModel, CostOptions
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner.simulate import simulate_plan
from solvers.cluster.planner import price_plan
from solvers.cluster.tensor import plan_tensor_parallel
from solvers.planning import PlanRequest, plan
from tests._hetero_fixtures import small_cluster, synthetic_profile

TYPES = ("TITAN-V", "RTX-2060", "Quadro-P4000", "RTX-3090")


def apart_plan(profile: Profile, kinds: list[str], cuts: list[int], workers: int, schedule: str,
               micro_batches: int) -> tuple[Plan, object]:
    """``workers`` pipelines with the same stages, every device on a node of its own, so no two
    transfers share a link (each pair of nodes is one link) and only the all-reduce joins them."""
    p = len(kinds)
    cluster = small_cluster([[kinds[k]] for _ in range(workers) for k in range(p)], intra=16.0, inter=2.0)
    bounds = [0, *cuts, profile.num_layers]
    vws = tuple(VirtualWorker(tuple(Stage((bounds[k], bounds[k + 1]), f"n{w * p + k}:0", kinds[k])
                                    for k in range(p))) for w in range(workers))
    return Plan(profile.model, vws, schedule, profile.micro_batch_size, micro_batches), cluster


def closed_and_simulated(plan: Plan, profile: Profile, cluster) -> tuple[float, float, CostModel]:
    cost = CostModel(profile, cluster, CostOptions())
    closed = price_plan(cost, plan, "sync")["iteration_s"]
    return closed, simulate_plan(plan, profile, cluster, CostOptions(), cost=cost).iteration_s, cost


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_stage_all_reduces_after_its_last_gradient_send(schedule: str) -> None:
    # 2 workers x 3 stages, the slowest GPU last (1F1B's closed form is exact there); the middle
    # stage holds the heavy parameters, so its all-reduce ends the iteration: it starts once its
    # last gradient send back (which holds it, transfers not overlapped) is done
    layers = tuple(LayerProfile(f"l{i}", 1e9, 4e8 if i in (2, 3) else 1e6, 1e6, 3e7,
                                {t: LayerTime(0.02, 0.04) if t == "Quadro-P4000" else LayerTime(0.002, 0.004)
                                 for t in TYPES}) for i in range(6))
    profile = Profile("chain", 4, layers)
    plan, cluster = apart_plan(profile, ["TITAN-V", "TITAN-V", "Quadro-P4000"], [2, 4], 2, schedule, 4)
    closed, simulated, cost = closed_and_simulated(plan, profile, cluster)
    send = cost.boundary_s(2, "n1:0", "n0:0")
    assert send > 1e-3  # the term at stake is not lost in rounding
    assert closed == pytest.approx(simulated, rel=1e-9)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
# GPipe whose backward bottleneck is nearer stage 0 than a stage with all-reduce work: that stage
# ends its backwards earlier than the whole backward's chain says (the flow shop's prefix pace)
@example(seed=3, p=4, k=2, m=2, schedule="gpipe", kinds=["TITAN-V", "TITAN-V", "RTX-3090", "TITAN-V"], extra=2)
@given(seed=st.integers(0, 10_000), p=st.integers(2, 4), k=st.integers(2, 3), m=st.integers(1, 6),
       schedule=st.sampled_from(["gpipe", "1f1b"]), kinds=st.lists(st.sampled_from(TYPES), min_size=4, max_size=4),
       extra=st.integers(0, 3))
def test_closed_form_equals_the_simulator_for_k_workers(seed: int, p: int, k: int, m: int, schedule: str,
                                                        kinds: list[str], extra: int) -> None:
    # Plain plans (one chunk, no replication, transfers not overlapped, no link shared between
    # workers): GPipe is exact; 1F1B is exact where its last stage is the bottleneck (elsewhere its
    # closed form charges every stage the first micro-batch's whole round trip, which the
    # simulator's warm-up forwards hide: docs/fidelity.md)
    profile = synthetic_profile(p + extra, seed=seed, types=TYPES)
    cuts = list(range(1, p))
    plan, cluster = apart_plan(profile, kinds[:p], [c + (extra if c == p - 1 else 0) for c in cuts], k, schedule, m)
    closed, simulated, cost = closed_and_simulated(plan, profile, cluster)
    if schedule == "1f1b":
        times = cost.plan_stage_times_s(plan, 0)
        assume(times[-1] >= max(times))
    assert closed == pytest.approx(simulated, rel=1e-9)


def test_the_tensor_search_reports_the_simulated_rate_and_a_bound_on_it() -> None:
    # 2 workers x 2 stages over two nodes under GPipe (whose closed form is exact on links of their
    # own): both workers' activations cross the one link between the nodes, where the simulator
    # queues them and the closed form does not
    profile = synthetic_profile(6, seed=3, types=("TITAN-V", "RTX-2060"), act_mb=200.0)
    cluster = small_cluster([["TITAN-V"] * 2, ["RTX-2060"] * 2], intra=16.0, inter=1.0)
    res = plan_tensor_parallel(profile, cluster, 64, virtual_workers=2, pipeline=2, schedule="gpipe",
                               time_limit_s=20.0)
    plan = res.plan
    assert plan is not None and plan.predicted is not None
    closed = plan.meta["closed_form"]
    assert all(len({d.split(":")[0] for d in vw.devices}) == 2 for vw in plan.virtual_workers)
    assert closed["samples_per_s"] > plan.predicted["samples_per_s"] * 1.001  # the two differ here
    assert res.objective == pytest.approx(1 / plan.predicted["samples_per_s"], rel=1e-12)
    assert plan.solver is not None and plan.solver.objective == res.objective
    assert math.isfinite(res.lower_bound) and 0 < res.lower_bound <= res.objective
    assert closed["bound_samples_per_s"] >= closed["samples_per_s"] * (1 - 1e-9)


def test_a_sliced_answer_carries_its_own_simulated_figures_and_a_certificate_that_holds_for_it() -> None:
    # measured at sizes 2 and 4; 4 stages of 2 micro-batches of 4: slicing the first pays here
    profile = synthetic_profile(8, micro_batch_size=4, types=("TITAN-V",), act_mb=1.0)
    layers = tuple(replace(lay, times_at={2: {"TITAN-V": LayerTime(lay.times["TITAN-V"].fwd_s * 0.9,
                                                                   lay.times["TITAN-V"].bwd_s * 0.9)}})
                   for lay in profile.layers)
    profile = replace(profile, layers=layers)
    cluster = small_cluster([["TITAN-V"] * 4])
    got = plan(profile, cluster, PlanRequest(micro_batches="auto", global_batch=8, virtual_workers=1,
                                             pipeline_parallel=4))
    assert got.ok and got.plan is not None and got.plan.first_slices > 1
    simulated = simulate_plan(got.plan, profile.at_size(got.plan.micro_batch_size), cluster).samples_per_s
    assert got.plan.predicted["samples_per_s"] == pytest.approx(simulated, rel=1e-12)
    assert got.objective == pytest.approx(1 / simulated, rel=1e-12)
    assert got.plan.solver is not None and got.plan.solver.objective == got.objective
    # the bounds take the slices the search may choose, so the certificate stands for the sliced plan
    assert math.isfinite(got.lower_bound) and got.lower_bound <= got.objective * (1 + 1e-9)
    assert math.isfinite(got.plan.solver.gap) and 0.0 <= got.plan.solver.gap < 1.0
