"""The boundary tensors the pipeline executor holds besides saved activations, priced in the closed
form and the simulator alike (CostModel.boundary_held_bytes; runtime/executor.py)."""

from __future__ import annotations

from itertools import pairwise

import pytest

from partitioner.cost import CostModel
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.pricing import CostOptions
from partitioner.schedule import Schedule
from partitioner.simulate import simulate_plan

from .conftest import flat_cluster, make_profile

MIB = 2.0**20
OUT = [3 * MIB, 5 * MIB, 7 * MIB, 11 * MIB, 13 * MIB, 17 * MIB]  # each layer's output: every cut distinct


def _model() -> tuple[CostModel, object, object]:
    prof = make_profile({"A": [1.0] * 6}, [MIB] * 6, [19 * MIB] * 6, OUT)
    cluster = flat_cluster(["A"] * 3)
    return CostModel(prof, cluster, CostOptions(reserved_bytes=0.0)), prof, cluster


def test_only_a_stage_with_a_neighbour_holds_boundary_tensors() -> None:
    cost, _, _ = _model()
    assert cost.boundary_held_bytes(0, 6) == (0.0, 0.0)  # one stage: nothing sent, nothing received
    # 1F1B: a sent output is freed at the next compute; the gradient taken and the next one posted ahead
    assert cost.boundary_held_bytes(0, 2) == (0.0, 2 * OUT[1])
    assert cost.boundary_held_bytes(2, 6) == (0.0, OUT[1])  # last: the activation posted ahead
    assert cost.boundary_held_bytes(2, 4) == (0.0, 2 * OUT[3] + OUT[1])
    # a split backward keeps each micro-batch's gradient for its W
    assert cost.boundary_held_bytes(2, 4, schedule="zb-h1") == (OUT[3], 2 * OUT[3] + OUT[1])
    # interleaved (several stages a rank): an output (or then its gradient) per micro-batch, one gradient ahead
    assert cost.boundary_held_bytes(2, 4, schedule="interleaved") == (OUT[3], OUT[3] + OUT[1])
    assert cost.boundary_held_bytes(2, 4, schedule="wsp") == (OUT[3], OUT[3] + OUT[1])
    sched = Schedule.of("1f1b", 4)
    alone = cost.stage_memory_bytes(0, 6, 4, sched)
    assert alone == pytest.approx(cost.weight_bytes(0, 6) + 4 * cost.activation_bytes(0, 6))
    for name in ("1f1b", "zb-h1", "2bw"):
        sched = Schedule.of(name, 4)
        for a, b in ((0, 2), (2, 4), (2, 6)):
            for n in (1, 3):
                out, posted = cost.boundary_held_bytes(a, b, schedule=name)
                expect = cost.weight_bytes(a, b, sched.weight_versions) + n * (cost.activation_bytes(a, b) + out) \
                    + posted
                assert cost.stage_memory_bytes(a, b, n, sched) == pytest.approx(expect, rel=1e-12)
                assert cost.memory_matrix(n, sched)[a, b] == cost.stage_memory_bytes(a, b, n, sched)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("cuts", [(0, 6), (0, 2, 6), (0, 1, 4, 6)])
def test_closed_form_equals_the_simulator(schedule: str, recompute: str, cuts: tuple[int, ...]) -> None:
    cost, prof, cluster = _model()
    stages = tuple(Stage((a, b), f"n{k}:0", recompute=recompute) for k, (a, b) in enumerate(pairwise(cuts)))
    plan = Plan("toy", (VirtualWorker(stages),), schedule, 4, 4, pricing=CostOptions(reserved_bytes=0.0))
    closed = cost.plan_memory_bytes(plan)
    simulated = simulate_plan(plan, prof, cluster, CostOptions(reserved_bytes=0.0)).peak_memory_bytes
    assert set(closed) == set(simulated)
    for dev, want in closed.items():
        assert simulated[dev] == pytest.approx(want, rel=1e-9)
    if recompute != "none":
        return  # (full recomputation keeps the stage's input, a boundary too)
    held = [cost.boundary_held_bytes(a, b, schedule=schedule) for a, b in pairwise(cuts)]
    plain = CostModel(make_profile({"A": [1.0] * 6}, [MIB] * 6, [19 * MIB] * 6), cluster,
                      CostOptions(reserved_bytes=0.0)).plan_memory_bytes(plan)  # no boundary tensors
    sched = plan.pipeline_schedule
    for k, (out, posted) in enumerate(held):
        n = sched.activations_in_flight(len(held) - k)
        assert closed[f"n{k}:0"] - plain[f"n{k}:0"] == pytest.approx(n * out + posted)


def test_max_stop_bounds_the_fitting_stops_when_a_boundary_is_large() -> None:
    # a large tensor at cut 3 makes the stage [0, 3) need more than [0, 4)
    prof = make_profile({"A": [1.0] * 5}, [MIB] * 5, [MIB] * 5, [MIB, MIB, 100 * MIB, MIB, MIB])
    cost = CostModel(prof, flat_cluster(["A"]), CostOptions(reserved_bytes=0.0))
    sched = Schedule.of("1f1b", 1)
    need = [cost.stage_memory_bytes(0, j, 2, sched) for j in range(1, 6)]
    assert need[2] > need[3]
    cap = need[3]
    top = cost.max_stop(2, sched, cap)
    fitting = [j for j in range(1, 6) if need[j - 1] <= cap]
    assert int(top[0]) == max(fitting) and 3 not in fitting
