import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.cost import CostModel, CostOptions
from partitioner.schedule import Schedule

from .conftest import GIB, flat_cluster, make_profile


@pytest.fixture
def model():
    rng = np.random.default_rng(1)
    n = 7
    prof = make_profile({"A": list(rng.uniform(0.1, 1, n)), "B": list(rng.uniform(0.1, 1, n))},
                        list(rng.uniform(0, 1e9, n)), list(rng.uniform(0, 1e9, n)), list(rng.uniform(0, 1e9, n)))
    cluster = flat_cluster(["A", "B", "A", "B"], per_node=2, intra_gbps=20, inter_gbps=2)
    return prof, cluster


@pytest.mark.parametrize("overlap", [False, True])
def test_matrix_forms_equal_scalar_forms_bit_for_bit(model, overlap):
    prof, cluster = model
    cost = CostModel(prof, cluster, CostOptions(overlap_comm=overlap))
    devs = cluster.devices
    times = cost.stage_time_matrix(devs[1], devs[0], devs[2])
    mem = cost.memory_matrix(3, Schedule.of("1f1b", 1))
    for i in range(prof.num_layers):
        for j in range(i + 1, prof.num_layers + 1):
            assert times[i, j] == cost.stage_time_s(i, j, devs[1], devs[0], devs[2])
            assert mem[i, j] == cost.stage_memory_bytes(i, j, 3, Schedule.of("1f1b", 1))


def test_stage_time_definitions(model):
    prof, cluster = model
    add = CostModel(prof, cluster)
    ovl = CostModel(prof, cluster, CostOptions(overlap_comm=True))
    fwd, bwd = prof.times_for("B")  # n0:1 is the node's second GPU, a B
    compute = float(fwd[2:5].sum() + bwd[2:5].sum())
    out_bytes = prof.layers[4].output_bytes
    in_bytes = prof.layers[1].output_bytes
    out_s = out_bytes / (2e9)  # the activation n0:1 -> n1:0 crosses nodes: 2 GB/s
    back_s = in_bytes / (20e9)  # the input's gradient n0:1 -> n0:0 inside the node: 20 GB/s
    assert add.stage_time_s(2, 5, "n0:1", "n0:0", "n1:0") == pytest.approx(compute + back_s + out_s)
    assert ovl.stage_time_s(2, 5, "n0:1", "n0:0", "n1:0") == pytest.approx(max(compute, back_s, out_s))
    assert add.stage_time_s(0, 7, "n0:1") == pytest.approx(float(fwd.sum() + bwd.sum()))


def test_wsp_adds_the_wave_sync_spread_over_the_wave(model):
    prof, cluster = model
    cost = CostModel(prof, cluster)
    devs = cluster.devices
    params = sum(layer.param_bytes for layer in prof.layers[2:5])
    sync = 2 * params / (cluster.inter_gbps * 1e9)  # push + pull over the inter-node network
    base = cost.stage_time_s(2, 5, devs[1], devs[0], devs[2])
    assert cost.pipeline_stage_time_s(2, 5, devs[1], devs[0], devs[2], Schedule.of("wsp", 4)) == pytest.approx(base + sync / 4)
    assert cost.pipeline_stage_time_s(2, 5, devs[1], devs[0], devs[2], Schedule.of("1f1b", 4)) == base
    matrix = cost.pipeline_stage_time_matrix(devs[1], devs[0], devs[2], Schedule.of("wsp", 4))
    assert matrix[2, 5] == cost.pipeline_stage_time_s(2, 5, devs[1], devs[0], devs[2], Schedule.of("wsp", 4))


def test_memory_formula(model):
    prof, cluster = model
    cost = CostModel(prof, cluster, CostOptions(optimizer_state_factor=2.0, reserved_bytes=GIB))
    params = sum(layer.param_bytes for layer in prof.layers[1:4])
    saved = sum(layer.saved_bytes for layer in prof.layers[1:4])
    # the executor's boundary tensors under 1F1B: the gradient a backward takes and the next one posted
    # ahead (a sent output is freed at the next compute), one input posted ahead
    held = 2 * prof.layers[3].output_bytes + prof.layers[0].output_bytes
    assert cost.stage_memory_bytes(1, 4, 3, Schedule.of("1f1b", 1)) == pytest.approx(params * 4 + saved * 3 + held + GIB)
    # 2bw (no flush): an output kept until its gradient arrives (or then that gradient) per micro-batch, one ahead
    held_2bw = (3 + 1) * prof.layers[3].output_bytes + prof.layers[0].output_bytes
    assert cost.stage_memory_bytes(1, 4, 3, Schedule.of("2bw", 1)) == pytest.approx(params * 5 + saved * 3 + held_2bw
                                                                                   + GIB)


def test_shared_saved_bytes_count_once_inside_a_stage():
    prof = make_profile({"A": [1.0] * 4}, saved_bytes=[10.0, 20.0, 30.0, 40.0])
    layers = tuple(dataclasses.replace(x, shared_saved_bytes=s) for x, s in zip(prof.layers, [0.0, 5.0, 7.0, 11.0]))
    prof = dataclasses.replace(prof, layers=layers)
    cost = CostModel(prof, flat_cluster(["A"]), CostOptions(reserved_bytes=0))
    for i in range(4):
        for j in range(i + 1, 5):
            inside = sum(layers[k].shared_saved_bytes for k in range(i + 1, j))  # both layers in the stage
            expect = sum(layers[k].saved_bytes for k in range(i, j)) - inside
            assert cost.activation_bytes(i, j) == pytest.approx(expect)
            assert cost.stage_memory_bytes(i, j, 3, Schedule.of("1f1b", 1)) == pytest.approx(3 * expect)
            assert cost.memory_matrix(3, Schedule.of("1f1b", 1))[i, j] == cost.stage_memory_bytes(i, j, 3, Schedule.of("1f1b", 1))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10), st.integers(1, 5), st.integers(0, 2**32 - 1), st.booleans())
def test_max_stop_agrees_with_the_scalar_memory_formula(n, in_flight, seed, exact_capacity):
    rng = np.random.default_rng(seed)
    prof = make_profile({"A": [1.0] * n}, list(rng.uniform(0, 2 * GIB, n)), list(rng.uniform(0, 2 * GIB, n)))
    prof = dataclasses.replace(prof, layers=tuple(dataclasses.replace(x, shared_saved_bytes=float(rng.uniform()) * x.saved_bytes)
                                                  for x in prof.layers))
    cost = CostModel(prof, flat_cluster(["A"]), CostOptions(reserved_bytes=float(rng.uniform(0, GIB))))
    if exact_capacity:  # a capacity equal to some stage's memory: the boundary case
        i = int(rng.integers(0, n))
        cap = cost.stage_memory_bytes(i, int(rng.integers(i + 1, n + 1)), in_flight, Schedule.of("1f1b", 1))
    else:
        cap = float(rng.uniform(0.5, 30)) * GIB
    top = cost.max_stop(in_flight, Schedule.of("1f1b", 1), cap)
    for i in range(n + 1):
        fitting = [j for j in range(i + 1, n + 1) if cost.stage_memory_bytes(i, j, in_flight, Schedule.of("1f1b", 1)) <= cap]
        assert fitting == list(range(i + 1, int(top[i]) + 1))  # a prefix, ending where max_stop says


def test_in_flight_and_closed_forms():
    assert [Schedule.of("1f1b", 3).activations_in_flight(j) for j in (1, 2, 3, 4, 5)] == [1, 2, 3, 3, 3]
    assert Schedule.of("gpipe", 8).activations_in_flight(1) == 8
    with pytest.raises(ValueError, match="interleaved"):
        Schedule.of("interleaved", 8).activations_in_flight(1)
    # uniform stages: GPipe/1F1B take (m + p - 1) t; no-flush schedules m t
    assert Schedule.of("1f1b", 8).iteration_s([2.0] * 4) == pytest.approx(2.0 * (8 + 4 - 1))
    assert Schedule.of("2bw", 8).iteration_s([2.0] * 4) == pytest.approx(16.0)


def test_lower_bound_is_below_any_split(model):
    prof, cluster = model
    cost = CostModel(prof, cluster)
    lb = cost.lower_bound_s(cluster.devices)
    fa = np.diff(cost._total_prefix("A"))
    fb = np.diff(cost._total_prefix("B"))
    assert lb >= np.minimum(fa, fb).max() - 1e-12
    assert lb <= cost.compute_s("A", 0, prof.num_layers)
