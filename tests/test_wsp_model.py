"""WSP's push and pull as the runtime runs them: an asynchronous all-reduce per holder set that
``PULL(c - D)`` waits for; the simulator against hand counts, the closed form against the simulator."""

from __future__ import annotations

import random

import pytest

from partitioner.cluster import Cluster, Node
from partitioner.cost import CostModel, CostOptions
from partitioner.events import WaveGroups, run_ops
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner.simulate import simulate_plan
from tests.conftest import big_type

OPTS = CostOptions(reserved_bytes=0.0)
TYPES = {"fast": big_type("fast"), "slow": big_type("slow")}


def two_single_device_workers(params: float, inter_gbps: float, m: int, d: int) -> tuple[Plan, Profile, Cluster]:
    prof = Profile("u", 1, (LayerProfile("l0", param_bytes=params, saved_bytes=1e6, output_bytes=0.0,
                                         times={"fast": LayerTime(1.0, 2.0)}),))
    cl = Cluster("c", (Node("n0", ("fast",), 100.0), Node("n1", ("fast",), 100.0)), inter_gbps, TYPES)
    plan = Plan("u", (VirtualWorker((Stage((0, 1), "n0:0"),)), VirtualWorker((Stage((0, 1), "n1:0"),))),
                "wsp", 1, m, d)
    return plan, prof, cl


@pytest.mark.parametrize("params,d,expect", [
    # m = 4 micro-batches of 3 s: 12 s of compute per wave; the all-reduce of 2 holders over
    # 1 GB/s moves the bytes once: 6 s or 30 s
    (6e9, 0, 12.0 + 6.0),  # D = 0: the pull waits for the whole all-reduce every wave
    (6e9, 1, 12.0),  # D = 1: hidden behind the next wave's compute
    # 30 s, longer than a wave: the waits alternate; per D + 1 waves the rank computes D + 1
    # waves and waits for one all-reduce less the D waves it overlapped: (C + A) / (D + 1)
    (30e9, 1, (12.0 + 30.0) / 2),
    (30e9, 2, (12.0 + 30.0) / 3),
    (50e9, 2, (12.0 + 50.0) / 3),
])
def test_simulated_wsp_period_by_hand(params: float, d: int, expect: float) -> None:
    plan, prof, cl = two_single_device_workers(params, 1.0, 4, d)
    cost = CostModel(prof, cl, OPTS)
    assert cost.sync_s(cost.wave_groups(plan)[0]) == pytest.approx(params / 1e9)
    tl = simulate_plan(plan, prof, cl, OPTS, iterations=d + 9)  # a window of 6 waves: whole cycles of D + 1
    assert tl.iteration_s == pytest.approx(expect, rel=1e-9)
    assert cost.plan_iteration_s(plan) == pytest.approx(expect, rel=1e-9)
    # PUSH takes no device time: the rank computes while the all-reduce runs
    pushes = [e for e in tl.events() if e[1] == "PUSH"]
    assert pushes and all(e[5] == e[4] for e in pushes)
    assert tl.max_clock_gap <= d


def test_one_worker_never_waits() -> None:
    prof = Profile("u", 1, tuple(LayerProfile(f"l{i}", param_bytes=8e9, saved_bytes=1e6, output_bytes=0.0,
                                              times={"fast": LayerTime(1.0, 2.0)}) for i in range(2)))
    cl = Cluster("c", (Node("n0", ("fast", "fast"), 100.0),), 1.0, TYPES)
    plan = Plan("u", (VirtualWorker((Stage((0, 1), "n0:0"), Stage((1, 2), "n0:1"))),), "wsp", 1, 4, 0)
    cost = CostModel(prof, cl, OPTS)
    assert cost.wave_groups(plan) == ()
    assert simulate_plan(plan, prof, cl, OPTS).iteration_s == pytest.approx(12.0)
    assert cost.plan_iteration_s(plan) == pytest.approx(12.0)
    # the solvers, which know neither the holders nor D, keep the conservative charge
    assert cost.plan_stage_times_s(plan)[0] == pytest.approx(3.0 + 2 * 8e9 / 1e9 / 4)


def test_engine_completes_an_asynchronous_all_reduce_at_the_last_push_plus_its_time() -> None:
    # two ranks (two workers) in one holder set of 5 s: rank 0 pushes at 1, rank 1 at 4
    push, pull, comp = 4, 5, 0
    ops = [[(comp, 1.0, -1, -1), (push, 0.0, 0, -1), (comp, 1.0, -1, -1), (pull, 0.0, 0, -1)],
           [(comp, 4.0, -1, -1), (push, 0.0, 0, -1), (pull, 0.0, 0, -1), (comp, 1.0, -1, -1)]]
    groups = WaveGroups(((0,), (0,)), (2,), (5.0,))
    starts, ends, pc = run_ops(ops, [0, 1], True, 0, None, groups)
    assert pc == [4, 4]
    assert ends[0] == [1.0, 1.0, 2.0, 9.0]  # computes on after its push; its pull waits to 4 + 5
    assert starts[0][3] == 2.0
    assert ends[1] == [4.0, 4.0, 9.0, 10.0]
    with pytest.raises(ValueError, match="of_rank"):
        WaveGroups(((1,),), (2,), (5.0,))


def random_wsp_case(seed: int, aligned: bool, stalenesses: list[int]) -> tuple[Plan, Profile, Cluster]:
    """2-3 virtual workers of 1-3 stages over fast and slow GPUs (a node each), 2-6 layers with
    random sizes, m >= the stages of every worker; ``aligned``: every worker splits the layers
    the same way (every holder set's members at one pipeline position)."""
    rng = random.Random(seed)
    n = rng.randint(2, 6)
    layers = tuple(LayerProfile(f"l{i}", param_bytes=rng.uniform(1e8, 4e9), saved_bytes=1e6,
                                output_bytes=rng.choice([0.0, 1e8]),
                                times={"fast": LayerTime(f := rng.uniform(0.5, 2.0), 2 * f),
                                       "slow": LayerTime(1.7 * f, 3.4 * f)}) for i in range(n))

    def split() -> list[int]:
        p = rng.randint(1, min(3, n))
        return [0, *sorted(rng.sample(range(1, n), p - 1)), n]

    first = split()
    vws, nodes = [], []
    for w in range(rng.randint(2, 3)):
        b = first if aligned else split()
        nodes.append(Node(f"n{w}", tuple(rng.choice(["fast", "slow"]) for _ in b[1:]), 100.0))
        vws.append(VirtualWorker(tuple(Stage((b[k], b[k + 1]), f"n{w}:{k}") for k in range(len(b) - 1))))
    cl = Cluster("c", tuple(nodes), rng.choice([0.1, 0.3, 1.0, 10.0]), TYPES)
    m = rng.randint(max(len(v.stages) for v in vws), 8)
    return Plan("u", tuple(vws), "wsp", 1, m, rng.choice(stalenesses)), Profile("u", 1, layers), cl


@pytest.mark.parametrize("aligned,stalenesses,rel", [(False, [1, 2], 0.08), (True, [1, 2], 0.08),
                                                     (True, [0], 0.15), (False, [0], 0.15)])
def test_closed_form_matches_the_simulator_on_random_wsp_plans(aligned: bool, stalenesses: list[int],
                                                               rel: float) -> None:
    """The closed form is never above the simulator, equal (within 2 %) on most plans, and within
    ``rel`` on all. What it leaves out: a holder set's members push as their own pipelines drain
    (and with D = 0 every wave waits for the latest), and a long wait empties the pipeline, which
    then fills again. Measured over 100 seeds of this generator: D >= 1 at most 6.6 % below,
    D = 0 at most 12.5 % below, 92-99 % of plans within 2 % (``aligned``: every worker splits the
    layers alike)."""
    hidden_or_not, close = set(), 0
    for seed in range(40):
        plan, prof, cl = random_wsp_case(seed, aligned, stalenesses)
        cost = CostModel(prof, cl, OPTS)
        sim = simulate_plan(plan, prof, cl, OPTS)
        closed = cost.plan_iteration_s(plan)
        assert closed == pytest.approx(sim.iteration_s, rel=rel), seed
        assert closed <= sim.iteration_s * (1 + 1e-9), seed
        close += closed >= sim.iteration_s * 0.98
        assert sim.max_clock_gap <= plan.staleness
        ar = max(cost.wave_allreduce_s(plan).values())
        m, d = plan.micro_batches, plan.staleness
        compute = max(cost.stage_time_s(s.start, s.stop, s.device) for vw in plan.virtual_workers for s in vw.stages)
        hidden_or_not.add(ar <= d * m * compute)
    assert close >= 34  # 85 %
    if stalenesses != [0]:
        assert hidden_or_not == {True, False}  # both regimes of max(C, (C + A) / (D + 1)) are exercised
