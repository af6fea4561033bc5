"""The closed form the cluster planners optimise against the simulator, on plans of several
virtual workers with the gradient all-reduce between them."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from partitioner.cost import CostModel, CostOptions
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner.simulate import simulate_plan
from solvers.cluster.planner import price_plan
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
