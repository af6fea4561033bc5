"""Device mapping: exact on small clusters, symmetric under relabelling interchangeable GPUs."""

from __future__ import annotations

import itertools

import pytest

from partitioner.cost import CostModel
from partitioner.schedule import Schedule
from solvers.pipeline.dp import chain_dp
from solvers.pipeline.mapping import device_labels, label_orders, map_worker, num_label_orders
from tests._hetero_fixtures import small_cluster, synthetic_profile

CLUSTERS = [
    [["TITAN-V", "RTX-2060"], ["Quadro-P4000", "TITAN-V"]],
    [["TITAN-V", "TITAN-V", "RTX-2060"], ["RTX-2060", "Quadro-P4000"]],
    [["TITAN-RTX", "RTX-2060", "RTX-2060"], ["Quadro-P4000", "TITAN-RTX", "RTX-2060"]],
]


def brute_force(cost, devices, schedule, m):
    best = None
    for perm in itertools.permutations(devices):
        sol = chain_dp(cost, perm, Schedule.of(schedule, m))
        if sol is not None and (best is None or sol.bottleneck_s < best):
            best = sol.bottleneck_s
    return best


@pytest.mark.parametrize("spec", CLUSTERS)
@pytest.mark.parametrize("seed", [0, 1])
def test_mapping_equals_exhaustive_search(spec, seed):
    prof = synthetic_profile(10, seed=seed)
    cl = small_cluster(spec, intra=12.0, inter=0.5)
    cost = CostModel(prof, cl)
    res = map_worker(cost, cl.devices, Schedule.of("1f1b", 4))
    want = brute_force(cost, cl.devices, "1f1b", 4)
    assert res.exact
    assert res.solution is not None and want is not None
    assert res.solution.bottleneck_s == pytest.approx(want, rel=1e-12)
    assert res.solution.bottleneck_s >= res.lower_bound_s * (1 - 1e-12)


def test_label_orders_are_distinct_and_complete():
    labels = [("n0", "a"), ("n0", "a"), ("n1", "b"), ("n0", "c")]
    orders = list(label_orders(labels))
    assert len(orders) == len(set(orders)) == num_label_orders(labels) == 12
    assert set(orders) == set(itertools.permutations(labels))


def test_relabelling_interchangeable_gpus_keeps_objective():
    prof = synthetic_profile(12, seed=3)
    cl = small_cluster([["TITAN-V", "RTX-2060", "TITAN-V"], ["RTX-2060", "RTX-2060"]], inter=0.7)
    cost = CostModel(prof, cl)
    devs = list(cl.devices)
    base = map_worker(cost, devs, Schedule.of("1f1b", 4)).solution.bottleneck_s
    # swap the two TITAN-Vs of n0 and permute the listing: same multiset of labels
    swapped = [devs[2], devs[1], devs[0], devs[4], devs[3]]
    assert device_labels(cost, swapped)[0] == device_labels(cost, devs)[0]
    assert map_worker(cost, swapped, Schedule.of("1f1b", 4)).solution.bottleneck_s == pytest.approx(base, rel=1e-12)


def test_memory_is_respected_and_tight_memory_is_infeasible():
    prof = synthetic_profile(8, seed=2, param_mb=600)  # ~2.4 GB of weights+state per layer on average
    cl = small_cluster([["RTX-2060", "Quadro-P4000"], ["TITAN-V"]])
    cost = CostModel(prof, cl)
    res = map_worker(cost, cl.devices, Schedule.of("1f1b", 3))
    if res.solution is not None:
        p = len(res.solution.devices)
        for k, ((a, b), d) in enumerate(zip(res.solution.ranges, res.solution.devices, strict=True)):
            assert cost.stage_memory_bytes(a, b, min(p - k, 3), Schedule.of("1f1b", 1)) <= d.memory_bytes
    huge = synthetic_profile(8, seed=2, param_mb=5000)
    assert map_worker(CostModel(huge, cl), cl.devices, Schedule.of("1f1b", 3)).solution is None


def test_heuristic_beyond_limit_is_marked_and_valid():
    prof = synthetic_profile(20, seed=4, param_mb=5, act_mb=5)
    cl = small_cluster([["TITAN-V", "RTX-2060", "Quadro-P4000", "TITAN-RTX"]] * 2)
    cost = CostModel(prof, cl)
    res = map_worker(cost, cl.devices, Schedule.of("1f1b", 8), exact_limit=10, max_evaluations=30)
    assert not res.exact and res.orders_evaluated <= 30
    listed = chain_dp(cost, cl.devices, Schedule.of("1f1b", 8))
    assert res.solution.bottleneck_s <= listed.bottleneck_s  # the listed order is a start
