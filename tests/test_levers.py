"""Memory levers in the cost model and the simulator: activation recomputation per stage
(none / selective / full) and ZeRO-1/2 sharding of optimizer state over a layer's holders."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from partitioner.cluster import Cluster, Node
from partitioner.cost import CostModel
from partitioner.errors import FormatError
from partitioner.importers.sailor import import_sailor_degrees
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.pricing import CostOptions
from partitioner.profile import Profile
from partitioner.recompute import selective_saved_fraction, selective_time_fraction
from partitioner.schedule import Schedule
from partitioner.simulate import simulate_plan

SAILOR = Path(__file__).resolve().parents[2] / "shared" / "data" / "sailor_opt350"
FP16 = CostOptions(precision="fp16")


@pytest.fixture(scope="module")
def opt350() -> Profile:
    if not SAILOR.is_dir():
        pytest.skip("shared Sailor profiles not present")
    return import_sailor_degrees(SAILOR, micro_batch_size=1)


def _cluster() -> Cluster:
    return Cluster("c", tuple(Node(f"n{i}", ("V100-16",) * 4, 100.0) for i in range(2)), 10.0)


def test_options_and_stages_round_trip_and_refuse_bad_values() -> None:
    opts = CostOptions(precision="bf16", zero=2, recompute="auto")
    assert CostOptions.from_dict(opts.to_dict()) == opts
    assert "zero" not in CostOptions().to_dict() and "recompute" not in CostOptions().to_dict()
    with pytest.raises(FormatError, match="zero"):
        CostOptions(zero=3)
    with pytest.raises(FormatError, match=r"pricing\.recompute"):
        CostOptions.from_dict({"recompute": "some"})
    st = Stage((0, 4), "n0:0", recompute="selective")
    assert Stage.from_dict(st.to_dict()) == st
    assert "recompute" not in Stage((0, 4), "n0:0").to_dict()
    with pytest.raises(FormatError, match=r"stages\[0\]\.recompute = 'half': must be one of none, selective, full"):
        Stage.from_dict({"layers": [0, 4], "device": "n0:0", "recompute": "half"}, "stages[0].")


def test_selective_drops_the_attention_core_term(opt350: Profile) -> None:
    # OPT-350M: h = 1024, a = 16, s = 2048: a block saves s b h (34 + 5 a s / h) bytes (Korthikanti
    # et al.), 388 MiB at b = 1, of which 5 a s / h = 160 parts are the attention core
    assert opt350.layers[1].saved_bytes == 2048 * 1024 * (34 + 160)
    assert selective_saved_fraction(opt350) == pytest.approx(160 / 194)
    assert selective_time_fraction(opt350) == pytest.approx(2048 / (6 * 1024 + 2048))
    cost = CostModel(opt350, _cluster(), FP16)
    sel = cost.recomputing("selective")
    assert sel.activation_bytes(1, 5) == pytest.approx(4 * 2048 * 1024 * 34)
    assert sel.activation_bytes(0, 1) == cost.activation_bytes(0, 1)  # the embedding: nothing to drop
    assert sel.activation_bytes(25, 26) == cost.activation_bytes(25, 26)  # the head
    f, b = cost.fwd_bwd_s("V100-SXM2-16GB", 1, 5)
    fs, bs = sel.fwd_bwd_s("V100-SXM2-16GB", 1, 5)
    assert fs == f and bs == pytest.approx(b + f * 2048 / (6 * 1024 + 2048))
    for t in (2, 4):  # a shard keeps the same fraction (heads and hidden both divide by t)
        whole, kept = cost.activation_bytes(1, 5, t), sel.activation_bytes(1, 5, t)
        assert kept == pytest.approx(whole * 34 / 194)


@pytest.mark.parametrize("t", [1, 2])
def test_full_keeps_the_stage_input_per_micro_batch(opt350: Profile, t: int) -> None:
    cost = CostModel(opt350, _cluster(), FP16)
    full = cost.recomputing("full")
    sched = Schedule.of("1f1b", 8)
    for n in (1, 3, 8):
        a, b = 3, 11
        weights = cost.weight_bytes(a, b, 1, t)
        out, posted = cost.boundary_held_bytes(a, b, t)
        expect = weights + cost.activation_bytes(a, b, t) + (n - 1) * cost.at_degree(t).boundary_bytes(a) \
            + n * out + posted + FP16.reserved_bytes
        assert full.stage_memory_bytes(a, b, n, sched, t) == pytest.approx(expect, rel=1e-12)
        assert full.stage_memory_bytes(a, b, n, sched, t) <= cost.stage_memory_bytes(a, b, n, sched, t)
        assert full.recomputing("selective").stage_memory_bytes(a, b, n, sched, t) <= \
            cost.stage_memory_bytes(a, b, n, sched, t)
    f, bwd = cost.fwd_bwd_s("V100-SXM2-16GB", 3, 11)
    assert full.fwd_bwd_s("V100-SXM2-16GB", 3, 11) == pytest.approx((f, bwd + f))
    # the matrix forms agree with the scalar ones to the bit in every mode
    for mode in ("none", "selective", "full"):
        m = cost.recomputing(mode)
        mat = m.memory_matrix(5, sched, tensor_parallel=t)
        assert mat[2, 9] == m.stage_memory_bytes(2, 9, 5, sched, t)
        top = m.max_stop(5, sched, 6 * 2**30, tensor_parallel=t)
        for i in range(opt350.num_layers):
            j = int(top[i])
            assert j == i or m.stage_memory_bytes(i, j, 5, sched, t) <= 6 * 2**30
            assert j == opt350.num_layers or m.stage_memory_bytes(i, j + 1, 5, sched, t) > 6 * 2**30


def test_zero_divides_optimizer_state_and_gradients_by_the_holders() -> None:
    opts = CostOptions(precision="fp16", optimizer_state_factor=2)
    assert opts.bytes_per_parameter() == 2 + 2 + 4 + 8
    one = CostOptions(precision="fp16", zero=1)
    two = CostOptions(precision="fp16", zero=2)
    assert one.sharded_bytes_per_parameter(1, 4) == 2 + 2 + 12 / 4
    assert two.sharded_bytes_per_parameter(1, 4) == 2 + 2 / 4 + 12 / 4
    assert two.sharded_bytes_per_parameter(1, 1) == opts.bytes_per_parameter()
    assert opts.sharded_bytes_per_parameter(1, 4) == opts.bytes_per_parameter()  # zero 0: no sharding


def _two_workers(profile: Profile, modes: tuple[str, ...], second: str, first_devices: tuple[str, ...]) -> Plan:
    cuts = [(0, 9), (9, 17), (17, 26)]
    a = VirtualWorker(tuple(Stage(r, d, recompute=m) for r, d, m in zip(cuts, first_devices, modes, strict=True)))
    b = VirtualWorker((Stage((0, 13), "n0:3", recompute=second), Stage((13, 26), "n1:3", recompute=second)))
    return Plan(profile.model, (a, b), "1f1b", 1, 8)


@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.parametrize("modes", [("none", "none", "none"), ("selective", "full", "none"),
                                   ("none", "selective", "full"), ("full", "full", "full")])
@pytest.mark.parametrize("devices", [("n0:0", "n0:1", "n1:0"), ("n0:0", "n0:1-2", "n1:0-1")])
def test_closed_form_and_simulator_agree_with_levers(opt350: Profile, zero: int, modes: tuple[str, ...],
                                                      devices: tuple[str, ...]) -> None:
    cl = _cluster()
    opts = CostOptions(precision="fp16", zero=zero)
    plan = _two_workers(opt350, modes, modes[1], devices)
    plan.validate(opt350, cl)
    cost = CostModel(opt350, cl, opts)
    tl = simulate_plan(plan, opt350, cl, opts)
    assert cost.plan_iteration_s(plan) == pytest.approx(tl.iteration_s, rel=0.02)
    assert cost.plan_memory_bytes(plan) == pytest.approx(dict(tl.peak_memory_bytes), rel=1e-9)
    base = CostModel(opt350, cl, FP16)
    if zero:  # every layer has two holders: each keeps half the master copy and moments, steps half
        assert cost.plan_memory_bytes(plan)["n0:0"] < base.plan_memory_bytes(plan)["n0:0"]
        assert cost.plan_iteration_s(plan) < base.plan_iteration_s(plan)


def test_recompute_costs_the_forward_inside_the_backward_in_the_simulator(opt350: Profile) -> None:
    cl = _cluster()
    stages = [((0, 9), "n0:0"), ((9, 17), "n0:1"), ((17, 26), "n1:0")]
    plain = Plan(opt350.model, (VirtualWorker(tuple(Stage(r, d) for r, d in stages)),), "1f1b", 1, 8)
    full = Plan(opt350.model, (VirtualWorker(tuple(Stage(r, d, recompute="full") for r, d in stages)),),
                "1f1b", 1, 8)
    a, b = simulate_plan(plain, opt350, cl, FP16), simulate_plan(full, opt350, cl, FP16)
    cost = CostModel(opt350, cl, FP16)
    assert b.iteration_s > a.iteration_s
    fwd = max(cost.fwd_bwd_s("V100-SXM2-16GB", x, y)[0] for (x, y), _ in stages)
    assert b.iteration_s - a.iteration_s <= 8 * fwd * 1.02 + sum(cost.fwd_bwd_s("V100-SXM2-16GB", 0, 26))
    for d in ("n0:0", "n0:1"):
        assert b.peak_memory_bytes[d] < a.peak_memory_bytes[d]
    # the last stage keeps one micro-batch in flight: full recomputation saves nothing there
    assert b.peak_memory_bytes["n1:0"] == a.peak_memory_bytes["n1:0"]
    # check_plan_memory names the stage's mode when a stage does not fit
    small = Cluster("c", (Node("n0", ("T4",) * 2, 100.0), Node("n1", ("T4",) * 2, 100.0)), 10.0)
    with pytest.raises(FormatError, match="recompute full"):
        CostModel(opt350, small, CostOptions(precision="fp16")).check_plan_memory(
            Plan(opt350.model, (VirtualWorker((Stage((0, 26), "n0:0", recompute="full"),)),), "1f1b", 1, 64))


def test_layer_holders_count_every_worker_and_replica(opt350: Profile) -> None:
    plan = _two_workers(opt350, ("none",) * 3, "none", ("n0:0", "n0:1", "n1:0"))
    holders = CostModel(opt350, _cluster(), FP16).layer_holders(plan)
    assert np.all(holders == 2)
