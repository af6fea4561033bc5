"""The tail tables of the sync bound: one worker alone is priced exactly as the closed form
prices its best plan, and a worker among K never above any plan that contains it."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from partitioner.cost import CostModel
from partitioner.errors import FormatError
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner.schedule import Schedule
from solvers.cluster.bounds.sync import allreduce_floor
from solvers.cluster.bounds.tail import (
    TailTable,
    count_splits,
    worker_tail_floor_s,
    worker_tail_table,
)
from tests._hetero_fixtures import small_cluster

TYPES = ("TITAN-V", "RTX-2060", "RTX-3090")


def profile_with_steps(n_layers: int, seed: int, param_mb: float) -> Profile:
    """Uneven per-type times, and an optimizer step per layer (so every stage's step counts)."""
    rng = np.random.default_rng(seed)
    layers = []
    for i in range(n_layers):
        times = {t: LayerTime(*(rng.uniform(0.002, 0.02) * np.array([1 / 3, 2 / 3])), float(rng.uniform(0, 0.004)))
                 for t in TYPES}
        layers.append(LayerProfile(f"l{i}", 1e9, float(rng.uniform(0.1, 1.0) * param_mb * 1e6),
                                   float(rng.uniform(5, 40) * 1e6), float(rng.uniform(1, 40) * 1e6), times))
    return Profile("steps", 8, tuple(layers))


def splits(devs, n_layers: int):
    for order in itertools.permutations(devs):
        for cuts in itertools.combinations(range(1, n_layers), len(devs) - 1):
            edges = (0, *cuts, n_layers)
            yield tuple(Stage((a, b), d.name, d.gpu_type) for (a, b), d in zip(itertools.pairwise(edges), order, strict=True))


def priced(cost: CostModel, workers, schedule: str, m: int) -> float:
    plan = Plan("steps", tuple(VirtualWorker(s) for s in workers), schedule, cost.profile.micro_batch_size, m)
    try:
        cost.check_plan_memory(plan)
    except FormatError:
        return math.inf
    return cost.plan_iteration_s(plan)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(types=st.sampled_from([["TITAN-V", "RTX-2060"], ["RTX-3090", "RTX-2060", "TITAN-V"], ["RTX-2060"]]),
       seed=st.integers(0, 50), m=st.integers(1, 5), schedule=st.sampled_from(["1f1b", "gpipe"]),
       overlap=st.booleans())
def test_one_worker_alone_is_its_best_plan_exactly(types, seed, m, schedule, overlap):
    from partitioner.pricing import CostOptions

    cost = CostModel(profile_with_steps(5, seed, 100.0), small_cluster([types], inter=2.0),
                     CostOptions(overlap_comm=overlap))
    devs = list(cost.cluster.devices)
    best = min(priced(cost, [s], schedule, m) for s in splits(devs, 5))
    got = worker_tail_floor_s(cost, devs, Schedule.of(schedule, m), lambda x: np.zeros_like(x))
    assert got == pytest.approx(best, rel=1e-12) if math.isfinite(best) else got == math.inf


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 50), m=st.integers(1, 4), schedule=st.sampled_from(["1f1b", "gpipe"]),
       param_mb=st.sampled_from([20.0, 300.0]), second=st.sampled_from([["TITAN-V", "RTX-2060"], ["RTX-3090", "RTX-2060"]]))
@example(seed=13, m=4, schedule="gpipe", param_mb=20.0, second=["TITAN-V", "RTX-2060"])  # a slower stage 0:
# GPipe's last stage ends its backward before T_w - B_k
def test_a_worker_among_k_is_below_every_plan_that_holds_it(seed, m, schedule, param_mb, second):
    # two workers of two GPUs on one slow-linked node (so the all-reduce floor is a real all-reduce's
    # time), all-reduces as long as the pipelines or longer
    cost = CostModel(profile_with_steps(5, seed, param_mb), small_cluster([["TITAN-V", "RTX-2060", *second]], intra=0.5))
    devs = list(cost.cluster.devices)
    first, second = devs[:2], devs[2:]
    table = worker_tail_table(cost, first, Schedule.of(schedule, m), lambda x: np.vectorize(
        lambda b: allreduce_floor(cost, devs, 2, float(b)))(x))
    assert table is not None
    n, least = cost.num_layers, math.inf
    for a in splits(first, n):
        for b in splits(second, n):
            it = priced(cost, [a, b], schedule, m)
            if not math.isfinite(it):
                continue
            assert table.own_s <= it * (1 + 1e-12)
            common = sorted({s.start for s in a[1:]} & {s.start for s in b[1:]})
            c = common[0] if common else n  # the first layer where both have a boundary
            assert table.by_common_cut_s[c] <= it * (1 + 1e-12)
            least = min(least, it)
    assert math.isfinite(least)


def test_too_many_splits_or_a_schedule_without_flush_gives_none():
    cost = CostModel(profile_with_steps(6, 0, 10.0), small_cluster([["TITAN-V", "RTX-2060", "RTX-3090"]]))
    devs = list(cost.cluster.devices)
    assert count_splits(6, 3, 6) == 60
    assert worker_tail_table(cost, devs, Schedule.of("1f1b", 2), lambda x: 0 * x, limit=59) is None
    assert worker_tail_table(cost, devs, Schedule.of("2bw", 2), lambda x: 0 * x) is None
    assert worker_tail_table(cost, devs, Schedule.of("1f1b", 2), lambda x: 0 * x, limit=60) is not None
    with pytest.raises(ValueError, match="one value per layer"):
        TailTable(1.0, np.zeros((2, 2)))
