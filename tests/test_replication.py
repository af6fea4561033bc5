"""Stage replication: all-reduce pricing, and the DP against pure pipelines and brute force."""

from __future__ import annotations

import itertools

import pytest

from partitioner.cost import CostModel, ring_allreduce_s
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.schedule import Schedule
from solvers.cluster.planner import plan_cluster
from solvers.cluster.replication import replicate_chain
from solvers.pipeline.dp import chain_dp
from tests._hetero_fixtures import small_cluster, synthetic_profile


def test_ring_allreduce_formula():
    cl = small_cluster([["TITAN-V", "TITAN-V"], ["TITAN-V"]], intra=10.0, inter=2.0)
    cost = CostModel(synthetic_profile(4), cl)
    devs = ["n0:0", "n0:1", "n1:0"]
    ring = 2 * 2 / 3 * 6e9 / 2e9  # 4.0 s: every byte of the ring crosses the 2 GB/s hop
    # hierarchical: reduce-scatter in n0 (1/2 pass at 10 GB/s), ring of 2 nodes (1 pass at 2 GB/s), all-gather
    hierarchical = 0.5 * 6e9 / 10e9 + 2 * 1 / 2 * 6e9 / 2e9 + 0.5 * 6e9 / 10e9
    assert cost.allreduce_s(6e9, devs) == pytest.approx(min(ring, hierarchical)) == pytest.approx(3.6)
    assert cost.allreduce_s(6e9, devs[:2]) == pytest.approx(2 * 1 / 2 * 6e9 / 10e9)
    assert ring_allreduce_s(1e9, [5.0]) == 0.0
    assert cost.replicated_stage_time_s(0, 2, devs[:1], None, None, 4) == cost.stage_time_s(0, 2, devs[0])


def brute(cost, devs, m, same_kind=False):
    """Every cut of the order into runs (of one type each with ``same_kind``) and every layer split."""
    best = float("inf")
    p, n = len(devs), cost.num_layers
    for bounds in itertools.product([0, 1], repeat=p - 1):
        groups, cur = [], [devs[0]]
        for d, new in zip(devs[1:], bounds, strict=True):
            if new:
                groups.append(cur)
                cur = [d]
            else:
                cur.append(d)
        groups.append(cur)
        if (same_kind and any(len({d.gpu_type for d in g}) > 1 for g in groups)) or len(groups) > n:
            continue
        for inner in itertools.combinations(range(1, n), len(groups) - 1):
            cuts = [0, *inner, n]
            stages = tuple(Stage((a, b), g[0].name, g[0].gpu_type, tuple(d.name for d in g[1:]))
                           for (a, b), g in zip(itertools.pairwise(cuts), groups, strict=True))
            plan = Plan("synthetic", (VirtualWorker(stages),), "1f1b", 8, m)
            try:
                cost.check_plan_memory(plan)
            except Exception:
                continue
            best = min(best, max(cost.plan_stage_times_s(plan)))
    return best


@pytest.mark.parametrize("same_kind", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replication_dp_equals_brute_force_and_beats_pure(seed, same_kind):
    prof = synthetic_profile(7, seed=seed, act_mb=200, param_mb=10)
    cl = small_cluster([["TITAN-V", "TITAN-V", "RTX-2060", "RTX-2060"]], intra=4.0)
    cost = CostModel(prof, cl)
    sol = replicate_chain(cost, cl.devices, Schedule.of("1f1b", 4), same_kind=same_kind)
    assert sol.bottleneck_s == pytest.approx(brute(cost, list(cl.devices), 4, same_kind), rel=1e-9)
    assert sol.bottleneck_s <= chain_dp(cost, cl.devices, Schedule.of("1f1b", 4)).bottleneck_s * (1 + 1e-12)


def test_a_stage_replicated_over_two_types_and_degrees_is_priced_as_the_cost_model_prices_it():
    """Sailor's shape: a stage over GPUs of two types (and tensor-parallel degrees). Runs of mixed
    kinds widen the space (never worse than runs of one kind, strictly better on 4 RTX 2080 Ti + 2
    TITAN RTX), the DP's bottleneck is the cost model's own stage time for the stages it returns,
    and the plan holds (memory, each replica at its own degree)."""
    from pathlib import Path

    from partitioner.cluster import Cluster, Node
    from partitioner.importers.sailor import import_sailor_degrees

    sailor = Path(__file__).resolve().parents[2] / "shared" / "data" / "sailor_opt350"
    if not sailor.is_dir():
        pytest.skip("shared Sailor profiles not present")
    # OPT-350M as Sailor measured it at every degree
    prof = import_sailor_degrees(sailor, micro_batch_size=1, gpu_types=("RTX-2080", "Titan-RTX"))
    base = Cluster("mix", (Node("n0", ("RTX-2080-Ti",) * 4, 20.0), Node("n1", ("TITAN-RTX",) * 2, 20.0)), 5.0)
    sched = Schedule.of("1f1b", 16)
    for cl in (base, base.with_tensor_parallel({"RTX-2080-Ti": 2})):
        cost = CostModel(prof, cl)
        mixed = replicate_chain(cost, cl.devices, sched)
        alone = replicate_chain(cost, cl.devices, sched, same_kind=True)
        assert mixed.bottleneck_s <= alone.bottleneck_s * (1 + 1e-12)
        stages = tuple(Stage(r, g[0].name, g[0].gpu_type, tuple(d.name for d in g[1:])) for r, g in mixed.stages)
        plan = Plan("synthetic", (VirtualWorker(stages),), "1f1b", 1, 16)
        cost.check_plan_memory(plan)
        assert max(cost.plan_stage_times_s(plan)) == pytest.approx(mixed.bottleneck_s, rel=1e-9)
        if cl is base:
            assert any(len({d.kind for d in g}) > 1 for _, g in mixed.stages)
            assert mixed.bottleneck_s < alone.bottleneck_s * (1 - 1e-4)


def test_planner_with_replication_validates_and_is_no_worse():
    prof = synthetic_profile(10, seed=3, act_mb=300, param_mb=5)
    cl = small_cluster([["TITAN-V", "TITAN-V"], ["RTX-2060", "RTX-2060"]], inter=0.5)
    pure = plan_cluster(prof, cl, 1, "opt", schedule="wsp", micro_batches=8)
    rep = plan_cluster(prof, cl, 1, "opt", schedule="wsp", micro_batches=8, replication=True)
    CostModel(prof, cl).validate_plan(rep.plan)
    assert rep.plan.meta["closed_form"]["samples_per_s"] >= pure.plan.meta["closed_form"]["samples_per_s"] * (1 - 1e-12)


def test_the_fleet_bound_holds_for_a_replicated_stage_with_the_largest_layer() -> None:
    """Replicas of a stage share its micro-batches, so a layer larger than every other one does
    not set a floor of one run per micro-batch: the bound stays above the replicated plan's rate
    (it once took that floor and fell below the plan, leaving it without a certificate)."""
    import math

    from partitioner.profile import LayerProfile, LayerTime, Profile
    from solvers.cluster.bounds.fleet import fleet_bound

    big, small = LayerTime(4e-3, 8e-3), LayerTime(1e-4, 2e-4)
    layers = (LayerProfile("s", 0.0, 1e6, 1e5, 1e5, {"TITAN-V": small}),
              LayerProfile("big", 0.0, 1e6, 1e5, 1e5, {"TITAN-V": big}))
    profile = Profile("one-big-layer", 1, layers)
    cluster = small_cluster([["TITAN-V", "TITAN-V", "TITAN-V", "TITAN-V"]], intra=100.0)
    res = plan_cluster(profile, cluster, 1, "opt", replication=True, micro_batches=8)
    assert res.ok and res.plan is not None
    assert any(st.replicas for st in res.plan.virtual_workers[0].stages)
    rate = 1.0 / res.objective
    bound = fleet_bound(CostModel(profile, cluster), cluster.devices, Schedule.of("1f1b", 8), replication=True,
                        virtual_workers=1)
    assert bound.samples_per_s >= rate * (1 - 1e-9)
    assert math.isfinite(res.lower_bound) and res.lower_bound <= res.objective * (1 + 1e-9)


def test_replicated_stages_on_measured_curves_are_priced_at_their_own_sizes():
    """Sailor's NCCL fits are polynomials in the message size, valid over the sizes measured: a
    replicated stage's all-reduce is priced at the stage's own gradient bytes (a fit at one byte
    is negative), and the DP's bottleneck is the cost model's figure for the stages it returns."""
    import json
    from pathlib import Path

    from partitioner.importers.sailor import import_sailor_degrees
    from partitioner.importers.sailor_runs import sailor_cluster

    shared = Path(__file__).resolve().parents[2] / "shared" / "data"
    if not (shared / "sailor_opt350").is_dir():
        pytest.skip("shared Sailor profiles not present")
    per_node = {k: v["gpus_per_node"] for k, v in
                json.loads((shared / "sailor_opt350" / "basic_cluster_config.json").read_text()).items()
                if isinstance(v, dict)}
    cl = sailor_cluster(shared / "sailor_validation" / "network" / "network_coeffs_all_homo.json",
                        {"RTX-2080": 4, "Titan-RTX": 2}, per_node, profile_dir=shared / "sailor_opt350")
    prof = import_sailor_degrees(shared / "sailor_opt350", micro_batch_size=1, gpu_types=("RTX-2080", "Titan-RTX"))
    cost = CostModel(prof, cl)
    sol = replicate_chain(cost, cl.devices, Schedule.of("1f1b", 16))
    assert sol is not None and any(len(g) > 1 for _, g in sol.stages)
    stages = tuple(Stage(r, g[0].name, g[0].gpu_type, tuple(d.name for d in g[1:])) for r, g in sol.stages)
    plan = Plan(prof.model, (VirtualWorker(stages),), "1f1b", 1, 16)
    assert max(cost.plan_stage_times_s(plan)) == pytest.approx(sol.bottleneck_s, rel=1e-3)
