"""Multi-chunk plans (interleaved, bfs): the chain DP over the repeated device list, memory by simulation."""

from __future__ import annotations

import pytest

from partitioner.cost import CostModel
from partitioner.errors import FormatError
from partitioner.schedule import Schedule
from partitioner.simulate import simulate_plan
from partitioner_cli.main import main
from solvers import solve
from solvers.pipeline.chunked import solve_chunked
from solvers.pipeline.dp import chain_dp
from solvers.result import SolveStatus

from .conftest import flat_cluster, make_profile

TIMES = {"A": [1.0, 3.0, 2.0, 4.0, 1.5, 2.5, 3.5, 1.0, 2.0, 0.5, 1.5, 2.0],
         "B": [2.0, 5.0, 3.0, 6.0, 2.0, 4.0, 5.0, 2.0, 3.0, 1.0, 2.0, 3.0]}


def _inputs(memory_gb: float = 1e6, saved: float = 1e6):
    n = len(TIMES["A"])
    profile = make_profile(TIMES, param_bytes=[4e6] * n, saved_bytes=[saved] * n, output_bytes=[2e6] * n)
    cluster = flat_cluster(["A", "B", "A"], memory_gb={"A": memory_gb, "B": memory_gb}, per_node=2)
    return profile, cluster


@pytest.mark.parametrize("schedule", ["interleaved", "bfs"])
@pytest.mark.parametrize("chunks", [2, 3])
def test_chunked_plan_is_the_dp_over_the_repeated_devices(schedule, chunks):
    profile, cluster = _inputs()
    result = solve(profile, cluster, schedule=schedule, chunks=chunks, micro_batches=6)
    assert result.status is SolveStatus.OPTIMAL and result.plan is not None
    plan = result.plan
    p = len(cluster.devices)
    assert plan.chunks == chunks and plan.schedule == schedule
    assert len(plan.virtual_workers[0].stages) == p * chunks
    devs = [d.name for d in cluster.devices]
    for s, st in enumerate(plan.virtual_workers[0].stages):
        assert st.device == devs[s % p]  # stage c*p + d on device d
    CostModel(profile, cluster, plan.cost_options()).validate_plan(plan)
    cost = CostModel(profile, cluster, plan.cost_options())
    dp = chain_dp(cost, tuple(cluster.devices) * chunks, Schedule.of("1f1b", 1))
    assert dp is not None
    assert max(cost.plan_stage_times_s(plan)) == pytest.approx(dp.bottleneck_s)
    assert result.objective == pytest.approx(dp.bottleneck_s)
    tl = simulate_plan(plan, profile, cluster, plan.cost_options())  # no deadlock
    assert tl.iteration_s > 0 and plan.predicted["samples_per_s"] == pytest.approx(tl.samples_per_s)
    assert plan.meta["predicted_by"] == "simulator"


def test_auto_keeps_the_fastest_simulated_count():
    profile, cluster = _inputs()
    auto = solve_chunked(profile, cluster, schedule="interleaved", chunks="auto", micro_batches=6)
    assert auto.ok and auto.plan is not None
    for v in (2, 3, 4):
        one = solve_chunked(profile, cluster, schedule="interleaved", chunks=v, micro_batches=6)
        if one.ok and one.plan is not None:
            assert auto.plan.predicted["samples_per_s"] >= one.plan.predicted["samples_per_s"] - 1e-9


def test_a_device_that_overflows_with_its_chunks_together_is_infeasible_with_numbers():
    # each one-layer stage alone fits (0.5 GiB reserved + 1 GiB of activations < 2 GiB), but a
    # device holding two chunks with several micro-batches in flight does not
    profile = make_profile({"A": [1.0] * 4}, saved_bytes=[2**30] * 4)
    cluster = flat_cluster(["A", "A"], memory_gb={"A": 2.0})
    result = solve_chunked(profile, cluster, schedule="interleaved", chunks=2, micro_batches=4)
    assert result.status is SolveStatus.INFEASIBLE
    assert "needs" in result.reason and "GiB" in result.reason


def test_interleaved_needs_micro_batches_a_multiple_of_the_devices():
    profile, cluster = _inputs()
    with pytest.raises(FormatError, match="multiple"):
        solve_chunked(profile, cluster, schedule="interleaved", chunks=2, micro_batches=4)


def test_cli_chunks_with_a_one_chunk_schedule_is_one_line(tmp_path, capsys):
    profile, cluster = _inputs()
    profile.save(str(tmp_path / "p.json"))
    cluster.save(str(tmp_path / "c.json"))
    rc = main(["plan", str(tmp_path / "p.json"), "--cluster", str(tmp_path / "c.json"), "--chunks", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--chunks" in err
    rc = main(["plan", str(tmp_path / "p.json"), "--cluster", str(tmp_path / "c.json"), "--schedule", "bfs",
               "--chunks", "two"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--chunks" in err
    rc = main(["plan", str(tmp_path / "p.json"), "--cluster", str(tmp_path / "c.json"), "--schedule", "bfs",
               "--chunks", "2", "--micro-batches", "4", "-o", str(tmp_path / "plan.json")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "schedule bfs" in out
