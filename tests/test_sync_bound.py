"""The sync bound with the all-reduce: never below any plan (every grouping, order and split of tiny
clusters enumerated and priced by the closed form), its all-reduce floor never above a real
all-reduce, and the planner's certificate on the HetPipe cluster."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partitioner.cost import CostModel
from partitioner.errors import FormatError
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner.schedule import Schedule
from solvers.cluster.bounds.sync import (
    allreduce_floor,
    exact_pipeline_floor_s,
    pipeline_floor_s,
    sync_bound,
)
from solvers.cluster.planner import WorkerPlanner, plan_cluster, price_plan
from solvers.cluster.templates import node_classes
from tests._hetero_fixtures import small_cluster

TYPES = ("TITAN-V", "RTX-2060", "RTX-3090")


def uneven_profile(n_layers: int, seed: int, param_mb: float) -> Profile:
    """Per-layer times whose ratios differ between GPU types (no type is uniformly k times another)."""
    rng = np.random.default_rng(seed)
    layers = []
    for i in range(n_layers):
        times = {t: LayerTime(*(rng.uniform(0.002, 0.02) * np.array([1 / 3, 2 / 3]))) for t in TYPES}
        layers.append(LayerProfile(f"l{i}", 1e9, float(rng.uniform(0.1, 1.0) * param_mb * 1e6),
                                   float(rng.uniform(5, 40) * 1e6), float(rng.uniform(1, 40) * 1e6), times))
    return Profile("uneven", 8, tuple(layers))


def set_partitions(items: list) -> list[list[list]]:
    if not items:
        return [[]]
    first, rest = items[0], items[1:]
    out = []
    for part in set_partitions(rest):
        out.append([[first], *part])
        for i in range(len(part)):
            out.append([*part[:i], [first, *part[i]], *part[i + 1:]])
    return out


def worker_options(devs, n_layers: int) -> list[tuple[Stage, ...]]:
    """Every order of ``devs`` and every split of the layers into ``len(devs)`` stages."""
    q = len(devs)
    out = []
    for order in itertools.permutations(devs):
        for cuts in itertools.combinations(range(1, n_layers), q - 1):
            edges = (0, *cuts, n_layers)
            out.append(tuple(Stage((a, b), d.name, d.gpu_type) for (a, b), d in
                             zip(itertools.pairwise(edges), order, strict=True)))
    return out


def best_by_enumeration(cost: CostModel, m: int, k: int | None = None) -> float:
    devs = list(cost.cluster.devices)
    best = -math.inf
    for grouping in set_partitions(devs):
        if k is not None and len(grouping) != k:
            continue
        for workers in itertools.product(*[worker_options(w, cost.num_layers) for w in grouping]):
            plan = Plan("uneven", tuple(VirtualWorker(s) for s in workers), "1f1b", cost.profile.micro_batch_size, m)
            try:
                cost.check_plan_memory(plan)
            except FormatError:
                continue
            best = max(best, price_plan(cost, plan, "sync")["samples_per_s"])
    return best


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=st.sampled_from([[["TITAN-V", "RTX-2060"], ["TITAN-V", "RTX-2060"]],
                             [["RTX-3090"], ["RTX-2060", "RTX-2060"]],
                             [["TITAN-V", "TITAN-V"], ["RTX-3090"]],
                             [["RTX-2060"], ["RTX-2060"], ["TITAN-V"]]]),
       seed=st.integers(0, 40), m=st.integers(1, 4), param_mb=st.sampled_from([50.0, 2000.0]))
def test_the_bound_is_never_below_any_plan(spec, seed, m, param_mb):
    profile = uneven_profile(5, seed, param_mb)
    cluster = small_cluster(spec, inter=2.0)
    cost = CostModel(profile, cluster)
    devs = list(cluster.devices)
    classes = node_classes(devs, WorkerPlanner(cost, Schedule.of("1f1b", m)).node_kind)
    best = best_by_enumeration(cost, m)
    if best == -math.inf:
        return
    for beat in (best * 0.5, best * 0.9, best * 0.999):
        got = sync_bound(cost, devs, classes, Schedule.of("1f1b", m), beat)
        assert got.complete
        assert got.samples_per_s >= best * (1 - 1e-9)
    for k in range(1, len(devs) + 1):  # K fixed
        at_k = best_by_enumeration(cost, m, k)
        if at_k > -math.inf:
            assert sync_bound(cost, devs, classes, Schedule.of("1f1b", m), at_k * 0.5, workers=k).samples_per_s >= at_k * (1 - 1e-9)


@pytest.mark.parametrize("spec", [[["TITAN-V", "RTX-2060", "RTX-2060"], ["TITAN-V", "RTX-3090"], ["RTX-3090"]],
                                  [["RTX-2060"] * 4, ["RTX-2060"] * 4]])
@pytest.mark.parametrize("latency_us", [0.0, 30.0])
def test_allreduce_floor_is_the_least_over_member_sets_and_orders(spec, latency_us):
    cluster = small_cluster(spec, inter=3.0)
    if latency_us:
        from partitioner.bandwidth import Bandwidth
        from partitioner.cluster import Cluster
        cluster = Cluster(cluster.name, cluster.nodes, 3.0, inter_curve=Bandwidth(3.0, latency_us * 1e-6))
    cost = CostModel(uneven_profile(3, 0, 10.0), cluster)
    devs = list(cluster.devices)
    rng = np.random.default_rng(1)
    for members in range(2, len(devs) + 1):
        for nbytes in (1e3, 5e8):
            floor = allreduce_floor(cost, devs, members, nbytes)
            least = math.inf
            for subset in itertools.combinations(devs, members):
                orders = list(itertools.permutations(subset)) if members <= 4 else \
                    [subset, *[tuple(rng.permutation(subset)) for _ in range(20)]]
                least = min(least, *(cost.allreduce_s(nbytes, o) for o in orders))
            assert floor == pytest.approx(least, rel=1e-12)


def test_pipeline_floor_is_below_every_split_of_one_worker():
    profile = uneven_profile(6, 3, 100.0)
    cluster = small_cluster([["TITAN-V", "RTX-2060", "RTX-3090"]], inter=2.0)
    cost = CostModel(profile, cluster)
    devs = list(cluster.devices)
    per = {t: np.array([cost.compute_s(t, i, i + 1) for i in range(6)]) for t in TYPES}
    floor = pipeline_floor_s(per, {t: 1 for t in TYPES}, 4, 0.0)
    times = []
    for stages in worker_options(devs, 6):
        plan = Plan("uneven", (VirtualWorker(stages),), "1f1b", 8, 4)
        times.append(cost.worker_iteration_s(plan))
    assert floor <= min(times) * (1 + 1e-9)
    assert floor >= 0.5 * min(times)  # and not vacuous


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("m", [1, 4])
def test_exact_pipeline_floor_is_the_least_over_orders_and_splits(seed, m):
    profile = uneven_profile(6, seed, 100.0)
    cluster = small_cluster([["TITAN-V", "RTX-2060"], ["RTX-3090"]], inter=2.0)
    cost = CostModel(profile, cluster)
    devs = list(cluster.devices)
    floor = exact_pipeline_floor_s(cost, devs, Schedule.of("1f1b", m))
    times = []
    for stages in worker_options(devs, 6):
        plan = Plan("uneven", (VirtualWorker(stages),), "1f1b", 8, m)
        try:
            cost.check_plan_memory(plan)
        except FormatError:
            continue
        times.append(cost.worker_iteration_s(plan))
    assert floor is not None and floor <= min(times) * (1 + 1e-12)
    # it leaves out only the closed form's Little's-law floor on the pace: exact where that does not bind
    assert floor >= 0.8 * min(times)
    per = {t: np.array([cost.compute_s(t, i, i + 1) for i in range(6)]) for t in TYPES}
    assert floor >= pipeline_floor_s(per, {"TITAN-V": 1, "RTX-2060": 1, "RTX-3090": 1}, m, 0.0) * (1 - 1e-9)
    assert exact_pipeline_floor_s(cost, devs, Schedule.of("gpipe", m)) is None  # GPipe's fill is priced otherwise


def test_hetpipe_vgg19_plan_is_proven_optimal_with_the_allreduce():
    from partitioner.cluster import Cluster

    profile = Profile.load("examples/profiles/vgg19_hetpipe.json")
    cluster = Cluster.load("examples/clusters/hetpipe.yaml")
    res = plan_cluster(profile, cluster, "auto", "opt", micro_batches=8)
    bound = res.details["sync_bound"]
    assert bound["complete"] and bound["allreduce_floor"]
    value = 1.0 / res.objective
    assert value <= bound["samples_per_s"] * (1 + 1e-9)
    assert 1.0 / res.lower_bound <= bound["samples_per_s"] * (1 + 1e-9)  # the certificate uses it
    assert res.details["bound"]["samples_per_s"] > bound["samples_per_s"]  # tighter than the fleet bound
    # every stage's all-reduce and the chain of all-reduces up to the first common cut prove the plan
    assert res.status.value == "optimal" and res.gap == 0.0
    assert bound["samples_per_s"] == pytest.approx(value, rel=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_lower_bound_holds_when_speed_ratios_differ_by_layer(seed):
    """``CostModel.lower_bound_s`` (which lets the mapping search stop early) is below the best
    bottleneck of every order, also when no type is uniformly k times another."""
    from solvers.pipeline.dp import chain_dp

    cost = CostModel(uneven_profile(6, seed, 10.0), small_cluster([list(TYPES)], inter=2.0))
    devs = list(cost.cluster.devices)
    best = min(sol.bottleneck_s for order in itertools.permutations(devs)
               if (sol := chain_dp(cost, list(order), Schedule.of("1f1b", 1))) is not None)
    assert cost.lower_bound_s(devs) <= best * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_fleet_bound_holds_when_speed_ratios_differ_by_layer(seed):
    """The fleet bound and the perfect speed-up take each type at its best per-layer ratio, so
    they stay above every plan when no type is uniformly k times another (enumerated)."""
    from solvers.cluster.bounds.fleet import effective_whole_s, fleet_bound
    from solvers.cluster.planner import throughput_upper_bound

    cost = CostModel(uneven_profile(5, seed, 50.0), small_cluster([["TITAN-V", "RTX-2060"], ["RTX-3090"]], inter=2.0))
    devs = list(cost.cluster.devices)
    eff = effective_whole_s(cost, TYPES)
    assert all(0 < eff[t] <= cost.compute_s(t, 0, 5) for t in TYPES)
    # a type's effective time is its best ratio to the reference times the reference's whole model
    for m in (1, 3):
        best = best_by_enumeration(cost, m)
        assert fleet_bound(cost, devs, Schedule.of("1f1b", m)).samples_per_s >= best * (1 - 1e-9)
        assert throughput_upper_bound(cost, devs) >= best * (1 - 1e-9)


def test_effective_whole_times_equal_the_whole_model_where_ratios_are_one_number():
    from solvers.cluster.bounds.fleet import effective_whole_s
    from tests._hetero_fixtures import synthetic_profile

    cost = CostModel(synthetic_profile(8, seed=2, types=TYPES), small_cluster([list(TYPES)]))
    eff = effective_whole_s(cost, TYPES)
    for t in TYPES:
        assert eff[t] == pytest.approx(cost.compute_s(t, 0, 8), rel=1e-9)
