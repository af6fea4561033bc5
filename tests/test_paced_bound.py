"""The fill every one-chunk schedule pays, and the bounds built on it (memory caps each stage's
share; the per-layer bound's fixed-K terms): below the simulator for every plan, and above every
plan of tiny instances enumerated whole."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.cluster import Cluster, Node
from partitioner.cost import CostModel
from partitioner.errors import FormatError
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.pricing import CostOptions
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner.schedule import Schedule
from partitioner.simulate import simulate_plan
from solvers.cluster.bounds.layers import fill_capacity, layer_bound
from solvers.cluster.bounds.paced import paced_bound, universal_fill_s
from solvers.cluster.planner import plan_cluster, price_plan

TYPES = ("A100-40", "V100-16")


def _profile(rng: np.random.Generator, n_layers: int, params: tuple[float, float] = (1e6, 4e6),
             bwd: tuple[float, float] = (1.5, 2.5), size: int = 1) -> Profile:
    """Layers of random forward times per type and a random backward / forward ratio."""
    layers = []
    for i in range(n_layers):
        times = {}
        for t, slow in zip(TYPES, (1.0, float(rng.uniform(1.2, 3.0))), strict=True):
            f = float(rng.uniform(0.5, 3.0)) * 1e-3 * slow
            times[t] = LayerTime(f, f * float(rng.uniform(*bwd)))
        layers.append(LayerProfile(f"l{i}", 0.0, float(rng.uniform(*params)), float(rng.uniform(1e5, 1e6)),
                                   float(rng.uniform(1e5, 4e6)), times))
    return Profile("rand", size, tuple(layers))


def _cluster() -> Cluster:
    return Cluster("two", (Node("n0", ("A100-40",) * 2, 50.0), Node("n1", ("V100-16",) * 2, 50.0)), 5.0)


def _stage_parts(cost: CostModel, plan: Plan, w: int) -> tuple[list[float], list[float]]:
    f, b = [], []
    for st_ in plan.virtual_workers[w].stages:
        x, y = cost.fwd_bwd_s(cost.cluster.device(st_.device).kind, st_.start, st_.stop)
        f.append(x)
        b.append(y)
    return f, b


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), m=st.integers(1, 12), schedule=st.sampled_from(("1f1b", "gpipe")),
       n_stages=st.integers(1, 4))
def test_the_universal_fill_is_below_the_simulator_and_the_closed_form(seed: int, m: int, schedule: str,
                                                                     n_stages: int) -> None:
    rng = np.random.default_rng(seed)
    profile = _profile(rng, 6)
    cl = _cluster()
    devices = [d.name for d in cl.devices]
    order = [devices[i] for i in rng.permutation(4)[:n_stages]]
    cuts = sorted(rng.choice(np.arange(1, 6), n_stages - 1, replace=False).tolist())
    edges = [0, *cuts, 6]
    plan = Plan("rand", (VirtualWorker(tuple(Stage((edges[i], edges[i + 1]), d) for i, d in enumerate(order))),),
                schedule, 1, m)
    options = CostOptions(sync=False, reserved_bytes=0.0)
    cost = CostModel(profile, cl, options)
    f, b = _stage_parts(cost, plan, 0)
    floor = universal_fill_s(f, b, m)
    sim = simulate_plan(plan, profile, cl, options).iteration_s
    assert floor <= sim * (1 + 1e-9)
    assert floor <= cost.worker_iteration_s(plan) * (1 + 1e-9)
    # the per-worker capacity of the layer bound: m W <= h(p) T for T the universal floor
    beta = min(y / (x + y) for x, y in zip(f, b, strict=True) if x + y > 0)
    assert m * (sum(f) + sum(b)) <= fill_capacity(m, n_stages, beta) * floor * (1 + 1e-9)


def test_the_sliced_fill_capacity_holds_for_plans_whose_first_micro_batch_is_sliced() -> None:
    """A first micro-batch in slices shortens the fill: the capacity at that many slices (and at
    more) bounds the work the simulator fits in the iteration of random sliced plans, while the
    capacity of whole micro-batches is beaten by some of them (so the slices term is needed)."""
    beaten = 0
    for seed in range(400):
        rng = np.random.default_rng(seed)
        m, n_stages, slices = 2, 4, int(rng.choice([2, 4]))  # few micro-batches: the fill matters most
        profile = _profile(rng, 6, size=4)
        cl = _cluster()
        devices = [d.name for d in cl.devices]
        order = [devices[i] for i in rng.permutation(4)[:n_stages]]
        cuts = sorted(rng.choice(np.arange(1, 6), n_stages - 1, replace=False).tolist())
        edges = [0, *cuts, 6]
        plan = Plan("rand", (VirtualWorker(tuple(Stage((edges[i], edges[i + 1]), d)
                                                 for i, d in enumerate(order))),), "1f1b", 4, m, first_slices=slices)
        options = CostOptions(sync=False, reserved_bytes=0.0)
        cost = CostModel(profile, cl, options)
        f, b = _stage_parts(cost, plan, 0)
        sim = simulate_plan(plan, profile, cl, options).iteration_s
        beta = min(y / (x + y) for x, y in zip(f, b, strict=True) if x + y > 0)
        work = m * (sum(f) + sum(b))
        assert work <= fill_capacity(m, n_stages, beta, slices) * sim * (1 + 1e-9)
        assert work <= fill_capacity(m, n_stages, beta, 4) * sim * (1 + 1e-9)
        beaten += work > fill_capacity(m, n_stages, beta) * sim * (1 + 1e-9)
    assert beaten > 0, "no sliced plan beats the whole micro-batches' capacity: the instances test nothing"


def test_the_closed_form_fill_is_not_a_floor_but_the_universal_one_is() -> None:
    """A first stage that is the bottleneck: 1F1B's warm-up hides the second stage's first round
    trip, so the simulator beats ``W + (m - 1) max s`` (the closed form's fill), never the
    universal floor."""
    slow = LayerTime(3e-3, 7e-3)
    fast = LayerTime(2e-3, 6e-3)
    layers = (LayerProfile("a", 0.0, 1e6, 1e5, 1e3, {"A100-40": slow, "V100-16": slow}),
              LayerProfile("b", 0.0, 1e6, 1e5, 1e3, {"A100-40": fast, "V100-16": fast}))
    profile = Profile("two", 1, layers)
    cl = _cluster()
    plan = Plan("two", (VirtualWorker((Stage((0, 1), "n0:0"), Stage((1, 2), "n0:1"))),), "1f1b", 1, 8)
    options = CostOptions(sync=False, reserved_bytes=0.0)
    sim = simulate_plan(plan, profile, cl, options).iteration_s
    closed_fill = (8 - 1) * 10e-3 + 10e-3 + 8e-3
    assert sim < closed_fill
    assert universal_fill_s([3e-3, 2e-3], [7e-3, 6e-3], 8) <= sim * (1 + 1e-9)


# -- the bounds against every plan of tiny instances ----------------------------------------------


def _pipelines(devices: list[str], n_layers: int) -> list[VirtualWorker]:
    out = []
    for order in itertools.permutations(devices):
        for cuts in itertools.combinations(range(1, n_layers), len(order) - 1):
            edges = (0, *cuts, n_layers)
            out.append(VirtualWorker(tuple(Stage((edges[i], edges[i + 1]), d) for i, d in enumerate(order))))
    return out


def _every_plan(profile: Profile, cl: Cluster, global_batch: int, schedule: str):  # type: ignore[no-untyped-def]
    """Every plan of K workers (each GPU in one worker or idle), every order and split, holding
    ``global_batch`` samples: (K, plan)."""
    devs = [d.name for d in cl.devices]
    n_layers = profile.num_layers
    for owner in itertools.product(range(-1, len(devs)), repeat=len(devs)):  # -1: idle
        used = sorted({o for o in owner if o >= 0})
        if used != list(range(len(used))) or not used:
            continue
        k = len(used)
        if global_batch % k or any(owner.index(w) > owner.index(w + 1) for w in range(k - 1)):
            continue
        groups = [[d for d, o in zip(devs, owner, strict=True) if o == w] for w in range(k)]
        if any(len(g) > n_layers for g in groups):
            continue
        for workers in itertools.product(*(_pipelines(g, n_layers) for g in groups)):
            yield k, Plan(profile.model, tuple(workers), schedule, 1, global_batch // k)


@pytest.mark.parametrize("seed", range(6))
def test_the_bounds_hold_for_every_plan_of_tiny_instances(seed: int) -> None:
    """Three layers whose weights make memory bind (no GPU holds the model), four GPUs: every plan
    priced by the closed form and simulated stays below the paced bound (over every K and at its
    own K) and the per-layer bound at its own K."""
    rng = np.random.default_rng(seed)
    profile = _profile(rng, 3, params=(1.5e9, 2.5e9))
    cl = _cluster()
    options = CostOptions(reserved_bytes=0.0)
    cost = CostModel(profile, cl, options)
    best: dict[int, float] = {}
    best_sim: dict[int, float] = {}
    for k, plan in _every_plan(profile, cl, 8, "1f1b"):
        try:
            cost.check_plan_memory(plan)
        except FormatError:
            continue
        rate = price_plan(cost, plan)["samples_per_s"]
        if rate > best.get(k, 0.0):
            best[k] = rate
            sim = simulate_plan(plan, profile, cl, options).iteration_s
            best_sim[k] = max(best_sim.get(k, 0.0), 8 / sim)
    assert best, "no plan fits: the instance tests nothing"
    every = paced_bound(cost, cl.devices, Schedule.of("1f1b", 8 // min(best)))
    for k, rate in best.items():
        sched = Schedule.of("1f1b", 8 // k)
        for bound in (paced_bound(cost, cl.devices, sched, virtual_workers=k), layer_bound(cost, cl.devices, k, sched)):
            assert bound >= max(rate, best_sim[k]) * (1 - 1e-9)
    if len(best) == 1:  # one K only: the every-K search is at that K's schedule
        assert every >= max(best.values()) * (1 - 1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_the_sliced_bounds_hold_for_every_sliced_plan_of_tiny_instances(seed: int) -> None:
    """As above, with every plan's first micro-batch in two slices (micro-batches of 2): the
    simulated rates stay below the paced and per-layer bounds taken at two slices."""
    rng = np.random.default_rng(seed)
    profile = _profile(rng, 3, params=(1.5e9, 2.5e9), size=2)
    cl = _cluster()
    options = CostOptions(reserved_bytes=0.0)
    cost = CostModel(profile, cl, options)
    best_sim: dict[int, float] = {}
    for k, plan in _every_plan(profile, cl, 4, "1f1b"):  # 4 micro-batches of 2 in all
        if plan.micro_batches < 2:  # one micro-batch in slices is a smaller size, not a sliced plan
            continue
        plan = replace(plan, micro_batch_size=2)
        try:
            cost.check_plan_memory(plan)
        except FormatError:
            continue
        rate = 8 / simulate_plan(replace(plan, first_slices=2), profile, cl, options).iteration_s
        best_sim[k] = max(best_sim.get(k, 0.0), rate)
    assert best_sim, "no plan fits: the instance tests nothing"
    for k, rate in best_sim.items():
        sched = Schedule.of("1f1b", 4 // k)
        for bound in (paced_bound(cost, cl.devices, sched, virtual_workers=k, slices=2),
                      layer_bound(cost, cl.devices, k, sched, slices=2)):
            assert bound >= rate * (1 - 1e-9)


def test_memory_caps_the_share_a_fast_small_gpu_computes() -> None:
    """A fast GPU of little memory beside two slow large ones (the model's 48 GB of state: the fast
    one holds a third, the slow ones five sixths each): the fleet bound lets the fast GPU compute
    what it cannot hold; the paced bound does not, and stays above the planner's plan."""
    from solvers.cluster.bounds.fleet import fleet_bound

    times = {"A100-40": LayerTime(4e-3, 8e-3), "V100-16": LayerTime(1e-3, 2e-3)}
    profile = Profile("mem", 1, tuple(LayerProfile(f"l{i}", 0.0, 6e8, 1e6, 1e6, times) for i in range(20)))
    cl = Cluster("mix", (Node("n0", ("V100-16",), 50.0), Node("n1", ("A100-40",) * 2, 50.0)), 10.0)
    options = CostOptions(reserved_bytes=0.0)
    cost = CostModel(profile, cl, options)
    sched = Schedule.of("1f1b", 8)
    res = plan_cluster(profile, cl, "auto", "opt", micro_batches=8, options=options, time_limit_s=30)
    assert res.ok and res.plan is not None
    rate = 1.0 / res.objective
    paced = paced_bound(cost, cl.devices, sched)
    assert paced >= rate * (1 - 1e-9)
    assert paced < 0.7 * fleet_bound(cost, cl.devices, sched).samples_per_s
    assert paced >= paced_bound(cost, cl.devices, sched, virtual_workers=1) * (1 - 1e-9)
    assert 1.0 / res.lower_bound <= paced * (1 + 1e-9)  # the certificate takes it
    assert math.isfinite(res.gap)
