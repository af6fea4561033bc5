"""`partitioner replan` (solvers/analysis/replan.py): a new plan after devices are lost or
gained, warm-started from the old one, the global batch kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partitioner.cost import CostModel
from partitioner.plan import Plan
from partitioner_cli import main as cli
from solvers.analysis.replan import replan
from solvers.planning import PlanRequest, plan
from tests.conftest import flat_cluster, make_profile

PROFILE = make_profile({"fast": [1.0, 2.0, 1.0, 3.0, 2.0, 1.0, 2.0, 1.0], "slow": [2.0, 4.0, 2.0, 6.0, 4.0, 2.0, 4.0, 2.0]},
                       param_bytes=[1e6] * 8, saved_bytes=[1e6] * 8, output_bytes=[1e5] * 8)
CLUSTER = flat_cluster(["fast", "slow", "fast", "slow", "fast", "slow"], per_node=2, memory_gb={"fast": 80, "slow": 40})


def old_plan(k: int = 3, m: int = 2) -> Plan:
    result = plan(PROFILE, CLUSTER, PlanRequest(virtual_workers=k, micro_batches=m))
    assert result.ok and result.plan is not None
    return result.plan


def global_batch(p: Plan) -> int:
    return p.micro_batch_size * p.micro_batches * len(p.virtual_workers)


def test_an_unchanged_cluster_gives_the_same_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = old_plan()
    done = replan(old, PROFILE, CLUSTER, old.devices)
    assert done.how == "kept" and done.lost == () and done.gained == ()
    assert done.plan.virtual_workers == old.virtual_workers and done.plan.micro_batches == old.micro_batches
    assert done.plan.schedule == old.schedule and done.plan.micro_batch_size == old.micro_batch_size
    # from the command line: the same, printed
    old.save(tmp_path / "old.json")
    PROFILE.save(tmp_path / "p.json")
    CLUSTER.save(tmp_path / "c.json")
    rc = cli.main(["replan", str(tmp_path / "old.json"), "--profile", str(tmp_path / "p.json"), "--cluster",
                   str(tmp_path / "c.json"), "-o", str(tmp_path / "new.json")])
    out = capsys.readouterr().out
    assert rc == 0 and "lost: none" in out and "the old plan kept" in out
    assert Plan.load(tmp_path / "new.json").virtual_workers == old.virtual_workers


def test_a_lost_device_replans_its_worker_only_and_keeps_the_global_batch() -> None:
    old = old_plan()
    lost = old.virtual_workers[1].devices[0]
    done = replan(old, PROFILE, CLUSTER, [d for d in old.devices if d != lost])
    new = done.plan
    assert done.lost == (lost,) and done.gained == () and done.how == "warm"
    assert lost not in new.devices and set(new.devices) <= set(old.devices)
    assert global_batch(new) == global_batch(old)
    # the workers that lost nothing keep their stages, at their places; the broken one is planned again
    assert new.virtual_workers[0] == old.virtual_workers[0] and new.virtual_workers[2] == old.virtual_workers[2]
    assert set(new.virtual_workers[1].devices) <= set(old.virtual_workers[1].devices) - {lost}
    CostModel(PROFILE, CLUSTER, new.pricing).validate_plan(new)  # fits in memory
    solver = new.solver
    assert solver is not None and solver.lower_bound <= solver.objective  # a certificate: bound <= objective
    assert any(line.startswith("old virtual worker 1 replaced") for line in done.moves)


def test_too_few_devices_drop_the_worker_and_the_others_run_more_micro_batches() -> None:
    old = old_plan(k=3, m=2)
    one = min(old.virtual_workers, key=lambda vw: len(vw.devices))
    broken = old.virtual_workers.index(one)
    done = replan(old, PROFILE, CLUSTER, [d for d in old.devices if d not in one.devices])
    new = done.plan
    # 3 workers x 2 micro-batches lose a whole worker: the 2 left run 3 micro-batches each, stages unchanged
    assert len(new.virtual_workers) == 2 and new.micro_batches == 3 and global_batch(new) == global_batch(old)
    assert [vw for w, vw in enumerate(old.virtual_workers) if w != broken] == list(new.virtual_workers)


def test_gained_devices_join_the_slowest_worker_and_full_replanning_is_no_worse() -> None:
    old = old_plan(k=2, m=2)
    spare = [d.name for d in CLUSTER.devices if d.name not in old.devices]
    if not spare:  # the planner used every device: lose one, then gain it back
        old = replan(old, PROFILE, CLUSTER, old.devices[1:]).plan
        spare = [d.name for d in CLUSTER.devices if d.name not in old.devices]
    everything = [d.name for d in CLUSTER.devices]
    warm = replan(old, PROFILE, CLUSTER, everything)
    assert warm.gained == tuple(spare) and global_batch(warm.plan) == global_batch(old)
    full = replan(old, PROFILE, CLUSTER, everything, full=True)
    assert full.plan.predicted["samples_per_s"] >= warm.plan.predicted["samples_per_s"] * (1 - 1e-12)
    assert global_batch(full.plan) == global_batch(old)


def test_replan_refuses_unknown_devices_and_its_own_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = old_plan()
    old.save(tmp_path / "old.json")
    PROFILE.save(tmp_path / "p.json")
    CLUSTER.save(tmp_path / "c.json")
    base = ["replan", str(tmp_path / "old.json"), "--profile", str(tmp_path / "p.json"), "--cluster",
            str(tmp_path / "c.json")]
    assert cli.main([*base, "--without", "n9:0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--without = 'n9:0': not a device of cluster test" in err
    assert cli.main([*base, "-o", str(tmp_path / "old.json")]) == 2
    capsys.readouterr()
    assert json.loads((tmp_path / "old.json").read_text()) == old.to_dict()  # untouched


def test_the_devices_to_plan_over_follow_the_new_cluster_and_the_flags() -> None:
    from partitioner_cli.replan import new_devices

    old = old_plan()
    # a cluster without the last node: its devices are lost without being named
    smaller = flat_cluster(["fast", "slow", "fast", "slow"], per_node=2, memory_gb={"fast": 80, "slow": 40})
    chosen = new_devices(old, smaller, None, None)
    assert chosen == [d.name for d in smaller.devices if d.name in old.devices]  # in the cluster's order
    assert set(new_devices(old, CLUSTER, ["n0:0"], None)) == set(old.devices) - {"n0:0"}
    assert set(new_devices(old, CLUSTER, None, "all")) == {d.name for d in CLUSTER.devices}
    # a device of another GPU type now counts as lost
    swapped = flat_cluster(["slow", "slow", "fast", "slow", "fast", "slow"], per_node=2,
                           memory_gb={"fast": 80, "slow": 40})
    done = replan(old, PROFILE, swapped, new_devices(old, swapped, None, None))
    assert ("n0:0" in done.lost) == ("n0:0" in old.devices)
    assert all(st.gpu_type == swapped.device(st.device).gpu_type for vw in done.plan.virtual_workers
               for st in vw.stages)


def test_a_tensor_parallel_group_counts_as_its_gpus() -> None:
    from partitioner.errors import FormatError
    from partitioner.plan import Stage, VirtualWorker
    from partitioner_cli.replan import new_devices

    tp = Plan("m", (VirtualWorker((Stage((0, 4), "n0:0-1"), Stage((4, 8), "n1:0"))),), micro_batch_size=2,
              micro_batches=2)
    # one GPU of the group lost: the other is planned over again; the whole group named: both gone
    assert new_devices(tp, CLUSTER, ["n0:1"], None) == ["n0:0", "n1:0"]
    assert new_devices(tp, CLUSTER, ["n0:0-1"], None) == ["n1:0"]
    assert new_devices(tp, CLUSTER, None, None) == ["n0:0", "n0:1", "n1:0"]
    with pytest.raises(FormatError, match="the plan uses none of them"):
        new_devices(tp, CLUSTER, ["n2:0"], None)
    with pytest.raises(FormatError, match="not a device of cluster"):
        new_devices(tp, CLUSTER, ["n0:1-2"], None)
