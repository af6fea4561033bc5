"""The chain DP against an independent brute force over every cut placement."""

import dataclasses
import itertools
import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from partitioner.cost import CostModel, CostOptions
from partitioner.schedule import Schedule
from solvers import SolveStatus, solve
from solvers.pipeline.dp import best_prefix_dp, chain_dp

from .conftest import GIB, flat_cluster, make_profile

TYPES = ("A", "B", "C")


def brute_force(cost, devices, schedule, m):
    """min over all cut placements of the bottleneck, pricing stages with the scalar methods."""
    return brute_force_pair(cost, devices, schedule, m)[0]


def brute_force_pair(cost, devices, schedule, m):
    """(best bottleneck, least total stage time among the splits that reach it)."""
    n, p = cost.num_layers, len(devices)
    best, best_total = math.inf, math.inf
    for inner in itertools.combinations(range(1, n), p - 1):
        cuts = (0, *inner, n)
        worst, total = 0.0, 0.0
        for k in range(p):
            a, b = cuts[k], cuts[k + 1]
            in_flight = Schedule.of(schedule, m).activations_in_flight(p - k)
            if cost.stage_memory_bytes(a, b, in_flight, Schedule.of(schedule, 1)) > devices[k].memory_bytes:
                worst = math.inf
                break
            prev = devices[k - 1] if k else None
            nxt = devices[k + 1] if k + 1 < p else None
            t = cost.pipeline_stage_time_s(a, b, devices[k], prev, nxt, Schedule.of(schedule, m))
            worst, total = max(worst, t), total + t
        if worst < best:
            best, best_total = worst, total
        elif worst == best:
            best_total = min(best_total, total)
    return best, best_total


@st.composite
def instances(draw):
    n = draw(st.integers(1, 8))
    p = draw(st.integers(1, 4))
    types = draw(st.lists(st.sampled_from(TYPES), min_size=p, max_size=p))
    t = st.floats(0.0, 1.0, allow_nan=False)
    times = {g: draw(st.lists(t, min_size=n, max_size=n)) for g in TYPES}
    size = st.floats(0.0, 2.0 * GIB, allow_nan=False)
    params = draw(st.lists(size, min_size=n, max_size=n))
    saved = draw(st.lists(size, min_size=n, max_size=n))
    out = draw(st.lists(size, min_size=n, max_size=n))
    memory = {g: draw(st.floats(0.5, 30.0)) for g in TYPES}
    per_node = draw(st.integers(1, 2))
    overlap = draw(st.booleans())
    schedule = draw(st.sampled_from(["1f1b", "gpipe", "2bw", "wsp"]))
    m = draw(st.integers(1, 6))
    shared = [draw(st.floats(0.0, 1.0)) * s for s in saved]
    prof = make_profile(times, params, saved, out)
    prof = dataclasses.replace(prof, layers=tuple(dataclasses.replace(x, shared_saved_bytes=h)
                                                  for x, h in zip(prof.layers, shared)))
    cluster = flat_cluster(types, memory_gb=memory, intra_gbps=draw(st.floats(1, 50)),
                           inter_gbps=draw(st.floats(0.1, 10)), per_node=per_node)
    return prof, cluster, CostOptions(overlap_comm=overlap, reserved_bytes=0.1 * GIB), schedule, m


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_dp_equals_brute_force(inst):
    _check_dp_equals_brute_force(inst)


@pytest.mark.slow
@settings(max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_dp_equals_brute_force_long(inst):
    _check_dp_equals_brute_force(inst)


def _check_dp_equals_brute_force(inst):
    prof, cluster, options, schedule, m = inst
    cost = CostModel(prof, cluster, options)
    devs = cluster.devices
    expected, least_total = brute_force_pair(cost, devs, schedule, m)
    result = solve(prof, cluster, schedule=schedule, micro_batches=m, options=options)
    event(f"{'infeasible' if math.isinf(expected) else 'feasible'}, {len(devs)} device(s)")
    if math.isinf(expected):
        assert result.status is SolveStatus.INFEASIBLE
        assert result.plan is None and result.reason
        return
    assert result.status is SolveStatus.OPTIMAL
    assert result.objective == expected  # same prices, same max: exactly equal
    assert result.lower_bound == result.objective and result.gap == 0.0
    plan = result.plan
    CostModel(prof, cluster, options).validate_plan(plan)  # covers the layers, fits memory
    times = cost.plan_stage_times_s(plan)
    assert max(times) == result.objective
    # among the splits that reach the optimum, the one with the least total stage time
    assert sum(times) == pytest.approx(least_total, rel=1e-12, abs=1e-15)


@settings(max_examples=80, deadline=None)
@given(instances())
def test_allow_fewer_is_best_prefix(inst):
    prof, cluster, options, schedule, m = inst
    cost = CostModel(prof, cluster, options)
    devs = cluster.devices
    per_q = [brute_force(cost, devs[:q], schedule, m) for q in range(1, len(devs) + 1)]
    result = solve(prof, cluster, schedule=schedule, micro_batches=m, options=options, allow_fewer=True)
    if math.isinf(min(per_q)):
        assert result.status is SolveStatus.INFEASIBLE
        return
    assert result.objective == min(per_q)
    used = len(result.plan.virtual_workers[0].stages)
    assert used == per_q.index(min(per_q)) + 1  # the shortest optimal pipeline


def test_more_devices_than_layers_is_infeasible_with_reason():
    prof = make_profile({"A": [1.0, 1.0]})
    cluster = flat_cluster(["A"] * 3)
    result = solve(prof, cluster)
    assert result.status is SolveStatus.INFEASIBLE
    assert "3 devices but only 2 layers" in result.reason
    assert solve(prof, cluster, allow_fewer=True).status is SolveStatus.OPTIMAL


def test_layer_too_big_names_the_layer_and_the_numbers():
    prof = make_profile({"A": [1.0, 1.0, 1.0]}, param_bytes=[0, 5 * GIB, 0])
    cluster = flat_cluster(["A", "A"], memory_gb={"A": 16})
    result = solve(prof, cluster, options=CostOptions(reserved_bytes=0))
    assert result.status is SolveStatus.INFEASIBLE
    # 5 GiB x (weights + gradients + 2 Adam states) = 20 GiB
    assert result.reason.startswith("layer 1 (l1) alone needs 20.00 GiB")
    assert "largest device (n0:0, A) has 16.00 GiB" in result.reason


def test_total_memory_reason():
    prof = make_profile({"A": [1.0] * 4}, param_bytes=[3 * GIB] * 4)
    cluster = flat_cluster(["A", "A"], memory_gb={"A": 13})
    result = solve(prof, cluster, options=CostOptions(reserved_bytes=0))
    assert result.status is SolveStatus.INFEASIBLE
    assert "needs at least 48.00 GiB" in result.reason and "26.00 GiB in total" in result.reason


def test_fast_device_gets_more_layers():
    prof = make_profile({"fast": [1.0] * 12, "slow": [3.0] * 12})
    cluster = flat_cluster(["slow", "fast"])
    plan = solve(prof, cluster).plan
    first, second = plan.virtual_workers[0].stages
    assert (first.stop - first.start, second.stop - second.start) == (3, 9)


def test_chain_dp_returns_none_when_nothing_fits():
    prof = make_profile({"A": [1.0]}, param_bytes=[100 * GIB])
    cluster = flat_cluster(["A"], memory_gb={"A": 1})
    assert chain_dp(CostModel(prof, cluster), cluster.devices, Schedule.of("1f1b", 1)) is None


def test_unknown_solver_and_schedule():
    prof = make_profile({"A": [1.0]})
    cluster = flat_cluster(["A"])
    with pytest.raises(ValueError, match="solver = 'magic': must be one of"):
        solve(prof, cluster, solver="magic")
    with pytest.raises(ValueError, match="schedule = 'magic'"):
        solve(prof, cluster, schedule="magic")
    # multi-chunk schedules go to the chunked DP: one layer cannot make two chunks on a device
    res = solve(prof, cluster, schedule="interleaved")
    assert res.status is SolveStatus.INFEASIBLE and "more than the 1 layers" in res.reason


@st.composite
def longer_instances(draw):
    """Up to 10 devices: enough prefixes for the bounds of best_prefix_dp to prune (or not)."""
    n = draw(st.integers(1, 14))
    p = draw(st.integers(1, 10))
    used = TYPES[:draw(st.integers(1, len(TYPES)))]  # often one type: the second bound is exact there
    types = draw(st.lists(st.sampled_from(used), min_size=p, max_size=p))
    t = st.floats(0.0, 1.0, allow_nan=False)
    times = {g: draw(st.lists(t, min_size=n, max_size=n)) for g in TYPES}
    size = st.floats(0.0, 1.0 * GIB, allow_nan=False)
    prof = make_profile(times, draw(st.lists(size, min_size=n, max_size=n)),
                        draw(st.lists(size, min_size=n, max_size=n)), draw(st.lists(size, min_size=n, max_size=n)))
    memory = {g: draw(st.floats(0.5, 12.0)) for g in TYPES}  # activations in flight often decide
    cluster = flat_cluster(types, memory_gb=memory, intra_gbps=draw(st.floats(1, 50)),
                           inter_gbps=draw(st.floats(0.1, 10)), per_node=draw(st.integers(1, 4)))
    options = CostOptions(overlap_comm=draw(st.booleans()), reserved_bytes=0.1 * GIB)
    return prof, cluster, options, draw(st.sampled_from(["1f1b", "gpipe", "2bw", "wsp"])), draw(st.integers(1, 12))


@settings(max_examples=100, deadline=None)
@given(longer_instances())
def test_best_prefix_dp_equals_every_prefix_solved(inst):
    """The bounded search over prefixes returns what solving every prefix returns: same value, same
    (shortest) pipeline, same refined split."""
    prof, cluster, options, schedule, m = inst
    cost = CostModel(prof, cluster, options)
    devs = cluster.devices
    every = [chain_dp(cost, devs[:q], Schedule.of(schedule, m)) for q in range(1, min(len(devs), prof.num_layers) + 1)]
    feasible = [s for s in every if s is not None]
    got = best_prefix_dp(cost, devs, Schedule.of(schedule, m))
    event("infeasible" if not feasible else f"best of {len(every)} prefix(es)")
    if not feasible:
        assert got is None
        return
    want = min(feasible, key=lambda s: (s.bottleneck_s, len(s.devices)))
    assert got is not None
    assert (got.bottleneck_s, got.cuts, got.devices) == (want.bottleneck_s, want.cuts, want.devices)
