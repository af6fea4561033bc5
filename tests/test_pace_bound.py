"""The pace bound (whole layers in contiguous stages, each worker at its busiest device) against
every plan of tiny instances enumerated whole: every grouping of the GPUs into K workers (idle
GPUs included), every order and every split, simulated."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import numpy as np
import pytest

from partitioner.cluster import Cluster, Node
from partitioner.cost import CostModel
from partitioner.errors import FormatError
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.pricing import CostOptions
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner.schedule import Schedule
from partitioner.simulate import simulate_plan
from solvers.cluster.bounds import pace
from solvers.cluster.bounds.layers import layer_bound
from solvers.cluster.bounds.pace import count_vectors, least_pace_s, pace_bound, pace_table

TYPES = ("A100-40", "V100-16", "RTX-3090")


def _profile(rng: np.random.Generator, n_layers: int, params: tuple[float, float], out_bytes: tuple[float, float],
             size: int = 1) -> Profile:
    """Random forward times per type (each type slower by its own random factor), backward
    ratios and boundary tensors."""
    slow = {t: float(rng.uniform(1.0, 3.0)) for t in TYPES}
    layers = []
    for i in range(n_layers):
        times = {}
        for t in TYPES:
            f = float(rng.uniform(0.5, 3.0)) * 1e-3 * slow[t]
            times[t] = LayerTime(f, f * float(rng.uniform(1.5, 2.5)), update_s=float(rng.uniform(0.0, 2.0)) * f)
        layers.append(LayerProfile(f"l{i}", 0.0, float(rng.uniform(*params)), float(rng.uniform(1e5, 1e6)),
                                   float(rng.uniform(*out_bytes)), times))
    return Profile("rand", size, tuple(layers))


def _cluster(rng: np.random.Generator) -> Cluster:
    """Four GPUs of two or three types on two or three nodes, fast links inside a node and a slow
    one between nodes (so sends weigh)."""
    layouts = [
        (("A100-40", "A100-40"), ("V100-16",), ("V100-16",)),
        (("A100-40", "V100-16"), ("V100-16", "RTX-3090")),
        (("RTX-3090", "RTX-3090"), ("A100-40",), ("V100-16",)),
        (("A100-40",), ("V100-16", "V100-16", "RTX-3090")),
    ]
    layout = layouts[int(rng.integers(len(layouts)))]
    nodes = tuple(Node(f"n{i}", gpus, float(rng.uniform(20.0, 60.0))) for i, gpus in enumerate(layout))
    return Cluster("tiny", nodes, float(rng.uniform(0.5, 3.0)))


def _pipelines(devices: list[str], n_layers: int) -> Iterator[VirtualWorker]:
    for order in itertools.permutations(devices):
        for cuts in itertools.combinations(range(1, n_layers), len(order) - 1):
            edges = (0, *cuts, n_layers)
            yield VirtualWorker(tuple(Stage((edges[i], edges[i + 1]), d) for i, d in enumerate(order)))


def _plans_of_k(cl: Cluster, n_layers: int, k: int) -> Iterator[tuple[VirtualWorker, ...]]:
    """Every plan's workers with ``k`` workers: each GPU in one worker or idle, workers listed
    by their first GPU, every order and split of each."""
    devs = [d.name for d in cl.devices]
    for owner in itertools.product(range(-1, k), repeat=len(devs)):  # -1: idle
        if sorted({o for o in owner if o >= 0}) != list(range(k)):
            continue
        if any(owner.index(w) > owner.index(w + 1) for w in range(k - 1)):
            continue
        groups = [[d for d, o in zip(devs, owner, strict=True) if o == w] for w in range(k)]
        if any(len(g) > n_layers for g in groups):
            continue
        yield from itertools.product(*(list(_pipelines(g, n_layers)) for g in groups))


def _best_simulated(profile: Profile, cl: Cluster, options: CostOptions, k: int, m: int,
                    slices: int = 1, schedule: str = "1f1b") -> float:
    """The best simulated samples/s of every plan of ``k`` workers of ``m`` micro-batches that
    fits memory (0 where none does)."""
    cost = CostModel(profile, cl, options)
    best = 0.0
    for workers in _plans_of_k(cl, profile.num_layers, k):
        plan = Plan(profile.model, workers, schedule, profile.micro_batch_size, m, first_slices=slices)
        try:
            cost.check_plan_memory(plan)
        except FormatError:
            continue
        sim = simulate_plan(plan, profile, cl, options).iteration_s
        best = max(best, k * m * profile.micro_batch_size / sim)
    return best


def _bounds(cost: CostModel, cl: Cluster, k: int, sched: Schedule, slices: int = 1) -> tuple[float, float]:
    """The pace bound at ``k`` from the table for every K and m, and from the table with each
    stage's edges (fill, all-reduce and step) at ``sched``'s m, ``k`` and ``slices``."""
    edged = pace_table(cost, cl.devices, sched, fill_slices=slices, virtual_workers=k)
    return pace_bound(cost, cl.devices, k, sched), pace_bound(cost, cl.devices, k, sched, edged)


@pytest.mark.parametrize("seed", range(8))
def test_the_pace_bound_holds_for_every_plan_of_tiny_instances(seed: int) -> None:
    """Every plan of every K (4 GPUs, 3 layers; memory binds on half the seeds), simulated,
    stays below the pace bound at its K; where no plan of K workers fits, the bound says 0 or
    more (never a wrong 0 where a plan exists)."""
    rng = np.random.default_rng(seed)
    params = (1.5e9, 2.5e9) if seed % 2 else (1e6, 4e6)
    profile = _profile(rng, 3, params, (1e6, 2e7))
    cl = _cluster(rng)
    options = CostOptions(reserved_bytes=0.0)
    cost = CostModel(profile, cl, options)
    planned = 0
    for k in (1, 2, 4):
        m = 8 // k
        best = _best_simulated(profile, cl, options, k, m)
        plain, edged = _bounds(cost, cl, k, Schedule.of("1f1b", m))
        assert plain >= edged >= best * (1 - 1e-9), (k, plain, edged, best)
        planned += best > 0
    assert planned, "no plan fits: the instance tests nothing"


@pytest.mark.parametrize("seed", range(4))
def test_a_view_of_more_gpus_than_layers_gets_a_bound_that_holds(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two layers on four GPUs: no worker holds more than two devices, so the table's program
    covers fewer vectors than the pools' box. With the limit set to that number (below the box,
    where every vector would be over it) the view still gets a finite bound, and every plan of
    every K, simulated, stays below it."""
    rng = np.random.default_rng(300 + seed)
    profile = _profile(rng, 2, (1e6, 4e6), (1e6, 2e7))
    cl = _cluster(rng)
    options = CostOptions(reserved_bytes=0.0)
    cost = CostModel(profile, cl, options)
    supply = [sum(d.kind == k for d in cl.devices) for k in sorted({d.kind for d in cl.devices})]
    covered = count_vectors(supply, profile.num_layers)
    assert covered < math.prod(n + 1 for n in supply)
    monkeypatch.setattr(pace, "MAX_STATES", covered)
    table = pace_table(cost, cl.devices, Schedule.of("1f1b", 4))
    assert table is not None and table.least_s.shape == tuple(n + 1 for n in supply)
    for k in (1, 2):
        m = 4 // k
        best = _best_simulated(profile, cl, options, k, m)
        bound = pace_bound(cost, cl.devices, k, Schedule.of("1f1b", m))
        assert best > 0 and math.isfinite(bound)
        assert bound >= best * (1 - 1e-9), (k, bound, best)
    monkeypatch.setattr(pace, "MAX_STATES", covered - 1)
    assert pace_table(cost, cl.devices, Schedule.of("1f1b", 4)) is None


def test_count_vectors_counts_the_vectors_of_at_most_so_many_devices() -> None:
    """Against enumeration: every vector within the supply whose devices add up to the cap or fewer."""
    for supply, most in (((2, 2), 3), ((1, 2, 1), 2), ((32, 32), 26), ((3,), 5), ((4, 0, 2), 4)):
        boxes = itertools.product(*(range(n + 1) for n in supply))
        assert count_vectors(supply, most) == sum(sum(v) <= most for v in boxes)


@pytest.mark.parametrize("seed", range(3))
def test_the_pace_bound_holds_for_every_gpipe_plan(seed: int) -> None:
    """GPipe holds every micro-batch's activations on every stage: memory binds harder, and every
    plan that fits still stays below the bound taken at that schedule."""
    rng = np.random.default_rng(50 + seed)
    profile = _profile(rng, 3, (1.5e9, 2.5e9), (1e6, 2e7))
    cl = _cluster(rng)
    options = CostOptions(reserved_bytes=0.0)
    cost = CostModel(profile, cl, options)
    for k in (1, 2):
        m = 4 // k
        best = _best_simulated(profile, cl, options, k, m, schedule="gpipe")
        plain, edged = _bounds(cost, cl, k, Schedule.of("gpipe", m))
        assert plain >= edged >= best * (1 - 1e-9), (k, plain, edged, best)


@pytest.mark.parametrize("seed", range(3))
def test_the_pace_bound_holds_for_sliced_first_micro_batches(seed: int) -> None:
    """Micro-batches of 2 whose first runs in two slices: every such plan stays below the bound
    (a slice computes and sends its share, so the busy time of a device is unchanged)."""
    rng = np.random.default_rng(100 + seed)
    profile = _profile(rng, 3, (1e6, 4e6), (1e6, 2e7), size=2)
    cl = _cluster(rng)
    options = CostOptions(reserved_bytes=0.0)
    cost = CostModel(profile, cl, options)
    for k in (1, 2):
        m = 4 // k
        best = _best_simulated(profile, cl, options, k, m, slices=2)
        assert best > 0
        plain, edged = _bounds(cost, cl, k, Schedule.of("1f1b", m), slices=2)
        assert plain >= edged >= best * (1 - 1e-9), (k, plain, edged, best)


def test_the_pace_bound_is_tighter_than_the_per_layer_bound_where_whole_layers_bind() -> None:
    """Over a sweep of tiny instances the pace bound falls clearly below the per-layer LP at the
    same K on some of them (whole layers on unequal GPUs, and sends between nodes, which the LP
    leaves out), and it is never below the best plan (checked above)."""
    tighter = 0
    for seed in range(20):
        rng = np.random.default_rng(200 + seed)
        profile = _profile(rng, 3, (1e6, 4e6), (1e6, 2e7))
        cl = _cluster(rng)
        cost = CostModel(profile, cl, CostOptions(reserved_bytes=0.0))
        for k in (1, 2):
            sched = Schedule.of("1f1b", 8 // k)
            tighter += pace_bound(cost, cl.devices, k, sched) < 0.95 * layer_bound(cost, cl.devices, k, sched)
    assert tighter > 0


def test_one_kind_one_node_is_the_best_split_of_the_layers() -> None:
    """Two equal GPUs on one node, four equal layers, no boundary tensors: the least busiest
    device runs two layers per micro-batch, so the bound is two GPUs' ideal rate."""
    t = LayerTime(1e-3, 2e-3)
    profile = Profile("eq", 1, tuple(LayerProfile(f"l{i}", 0.0, 1e3, 1e3, 0.0, {"A100-40": t}) for i in range(4)))
    cl = Cluster("one", (Node("n0", ("A100-40", "A100-40"), 100.0),), 1.0)
    cost = CostModel(profile, cl, CostOptions(reserved_bytes=0.0))
    sched = Schedule.of("1f1b", 8)
    table = pace_table(cost, cl.devices, sched)
    assert table is not None
    assert least_pace_s(table, 1) == pytest.approx(2 * 3e-3)
    assert least_pace_s(table, 2) == pytest.approx(4 * 3e-3)  # two workers of one GPU each
    assert least_pace_s(table, 3) == math.inf
    assert pace_bound(cost, cl.devices, 1, sched) == pytest.approx(1 / 6e-3)
    assert pace_bound(cost, cl.devices, 3, sched) == 0.0
    assert pace_bound(cost, cl.devices, 1, Schedule.of("interleaved", 8)) == math.inf


def test_the_edges_tighten_the_pace_bound_towards_the_best_plan() -> None:
    """Each stage's fill, all-reduce and step, which the table for every K and m leaves out, bring
    the bound clearly closer to the best simulated plan on some tiny instances (and never past it:
    checked above)."""
    closer = 0
    for seed in range(6):
        rng = np.random.default_rng(400 + seed)
        profile = _profile(rng, 3, (1e6, 4e6), (1e6, 2e7))
        cl = _cluster(rng)
        options = CostOptions(reserved_bytes=0.0)
        cost = CostModel(profile, cl, options)
        for k in (1, 2):
            m = 4 // k
            plain, edged = _bounds(cost, cl, k, Schedule.of("1f1b", m))
            best = _best_simulated(profile, cl, options, k, m)
            closer += best > 0 and edged - best < 0.5 * (plain - best)
    assert closer > 0


@pytest.mark.parametrize("seed", range(3))
def test_the_pace_bound_holds_where_nodes_share_a_nic(seed: int) -> None:
    """Each node's GPUs behind one NIC slower than its links: concurrent sends between nodes share
    it (simulated as flows), so a message is at least its time alone, and every plan, simulated,
    stays below both bounds."""
    from dataclasses import replace

    rng = np.random.default_rng(500 + seed)
    profile = _profile(rng, 3, (1e6, 4e6), (1e7, 4e7))
    base = _cluster(rng)
    cl = replace(base, nodes=tuple(replace(n, nic_gbps=0.5 * base.inter_gbps) for n in base.nodes))
    assert cl.has_nics
    options = CostOptions(reserved_bytes=0.0)
    cost = CostModel(profile, cl, options)
    for k in (1, 2):
        m = 4 // k
        best = _best_simulated(profile, cl, options, k, m)
        plain, edged = _bounds(cost, cl, k, Schedule.of("1f1b", m))
        assert best > 0
        assert plain >= edged >= best * (1 - 1e-9), (k, plain, edged, best)


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2"])
@pytest.mark.parametrize("seed", range(2))
def test_the_pace_bound_holds_for_every_zero_bubble_plan(schedule: str, seed: int) -> None:
    """Split backwards: a weight gradient may wait past the last input gradient, so the edges take
    no tail there (only the head and the hold); every such plan, simulated, stays below both."""
    rng = np.random.default_rng(600 + seed)
    profile = _profile(rng, 3, (1e6, 4e6), (1e6, 2e7))
    cl = _cluster(rng)
    options = CostOptions(reserved_bytes=0.0)
    cost = CostModel(profile, cl, options)
    for k in (1, 2):
        m = 4 // k
        best = _best_simulated(profile, cl, options, k, m, schedule=schedule)
        plain, edged = _bounds(cost, cl, k, Schedule.of(schedule, m))
        assert best > 0
        assert plain >= edged >= best * (1 - 1e-9), (k, plain, edged, best)
