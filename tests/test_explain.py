"""partitioner explain: bottleneck, headroom, one-more-GPU figures and bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from partitioner.cost import CostModel, CostOptions
from partitioner.simulate import simulate_plan
from partitioner_cli.main import main
from solvers import solve
from solvers.analysis.explain import add_gpu, explain_plan, format_explanation
from solvers.cluster.planner import plan_cluster

from .conftest import flat_cluster, make_profile

TIMES = {"A": [1.0, 3.0, 2.0, 4.0, 1.5, 2.5], "B": [2.0, 5.0, 3.0, 6.0, 2.0, 4.0]}


def _inputs(memory_gb: float = 1e6):
    profile = make_profile(TIMES, param_bytes=[4e6] * 6, saved_bytes=[1e6] * 6, output_bytes=[2e6] * 6)
    cluster = flat_cluster(["A", "B", "A", "B"], memory_gb={"A": memory_gb, "B": memory_gb}, per_node=2)
    return profile, cluster


def _one_worker_plan(profile, cluster):
    result = solve(profile, cluster, micro_batches=4)
    assert result.ok
    return result.plan


@pytest.mark.parametrize("workers", [1, 2])
def test_bottleneck_is_the_slowest_stage_of_the_cost_model(workers):
    profile, cluster = _inputs()
    plan = _one_worker_plan(profile, cluster) if workers == 1 else \
        plan_cluster(profile, cluster, 2, micro_batches=4, time_limit_s=5).plan
    e = explain_plan(plan, profile, cluster, what_if=False)
    cost = CostModel(profile, cluster, plan.cost_options())
    per_worker = [cost.plan_stage_times_s(plan, w) for w in range(len(plan.virtual_workers))]
    worst = max(max(t) for t in per_worker)
    assert e.bottleneck.time_s == pytest.approx(worst)
    assert per_worker[e.bottleneck.worker][e.bottleneck.stage] == pytest.approx(worst)
    # the split adds up under the additive model; no replica, no synchronisation share
    b = e.bottleneck
    assert b.sync_share_s == 0.0
    assert b.compute_s + b.activation_send_s + b.gradient_send_s == pytest.approx(b.time_s)


def test_replicated_stage_parts_at_the_replicas_pace():
    profile, cluster = _inputs()
    plan = plan_cluster(profile, cluster, 1, replication=True, micro_batches=4, time_limit_s=5).plan
    e = explain_plan(plan, profile, cluster, what_if=False)
    for s in e.stages:
        assert s.compute_s + s.activation_send_s + s.gradient_send_s + s.sync_share_s == pytest.approx(s.time_s)
        if len(s.devices) == 1:
            assert s.sync_share_s == pytest.approx(0.0, abs=1e-15)


def test_headroom_is_capacity_minus_simulated_peak():
    profile, cluster = _inputs(memory_gb=0.75)
    plan = _one_worker_plan(profile, cluster)
    e = explain_plan(plan, profile, cluster, what_if=False)
    tl = simulate_plan(plan, profile, cluster, plan.cost_options())
    assert set(e.headroom_bytes) == set(plan.devices)
    for d, h in e.headroom_bytes.items():
        assert h == pytest.approx(cluster.device(d).memory_bytes - tl.peak_memory_bytes[d])
    assert e.iteration_s == pytest.approx(tl.iteration_s)


def test_one_worker_gap_uses_the_exact_dp_on_the_same_order():
    profile, cluster = _inputs()
    plan = _one_worker_plan(profile, cluster)
    e = explain_plan(plan, profile, cluster, what_if=False)
    assert e.bounds["dp_same_order_s"] <= e.bottleneck.time_s + 1e-12
    assert e.bounds["lower_bound_s"] <= e.bounds["dp_same_order_s"] + 1e-12


def test_one_more_gpu_only_for_timed_types():
    profile = make_profile({"A": TIMES["A"]}, param_bytes=[4e6] * 6, output_bytes=[2e6] * 6)
    cluster = flat_cluster(["A", "A"])
    bigger = flat_cluster(["A", "A", "B"])  # knows type B, which the profile has no times for
    plan = _one_worker_plan(profile, cluster)
    e = explain_plan(plan, profile, bigger, what_if=True)
    by_type = {a.gpu_type: a for a in e.added}
    assert not by_type["B"].timed and math.isnan(by_type["B"].gain_samples_per_s)
    assert not any(a.timed for a in e.added if not CostModel(profile, bigger).has_times(a.gpu_type))
    assert by_type["A"].timed and by_type["A"].samples_per_s > 0
    # a third A on a two-device plan: the re-plan may use it; it never loses to the baseline it re-made
    assert by_type["A"].gain_samples_per_s >= -1e-9
    text = format_explanation(e)
    assert "not timed in the profile" in text and "B" in text.split("not timed in the profile")[1]


def test_add_gpu_joins_a_node_of_its_type_or_a_node_of_its_own():
    cluster = flat_cluster(["A", "A", "B"], per_node=2)
    bigger, name = add_gpu(cluster, "B")
    assert name == "n1:1" and bigger.device(name).gpu_type == "B"
    assert len(bigger.devices) == len(cluster.devices) + 1
    other, name = add_gpu(cluster, "T4")  # no node holds a T4: a new node, not a T4 among the A's
    assert name == "new0:0" and other.device(name).gpu_type == "T4"
    assert [n.gpus for n in other.nodes[:-1]] == [n.gpus for n in cluster.nodes]


def test_cli_prints_and_writes_json(tmp_path, capsys):
    profile, cluster = _inputs()
    plan = _one_worker_plan(profile, cluster)
    paths = {k: str(tmp_path / f"{k}.json") for k in ("plan", "profile", "cluster", "out")}
    plan.save(paths["plan"])
    profile.save(paths["profile"])
    cluster.save(paths["cluster"])
    rc = main(["explain", paths["plan"], "--profile", paths["profile"], "--cluster", paths["cluster"],
               "--json", paths["out"]])
    out = capsys.readouterr().out
    assert rc == 0 and "bottleneck:" in out and "memory" in out
    data = json.loads(Path(paths["out"]).read_text())
    cost = CostModel(profile, cluster, CostOptions())
    assert data["bottleneck"]["time_s"] == pytest.approx(max(cost.plan_stage_times_s(plan)))
    assert {a["gpu_type"] for a in data["add_one_gpu"] if a["timed"]} == {"A", "B"}


def test_cli_bad_input_is_one_line(tmp_path, capsys):
    profile, cluster = _inputs()
    plan = _one_worker_plan(profile, cluster)
    other = make_profile(TIMES, model="other")
    for name, obj in (("plan", plan), ("profile", profile), ("other", other), ("cluster", cluster)):
        obj.save(str(tmp_path / f"{name}.json"))
    cases = [
        (["explain", str(tmp_path / "missing.json"), "--profile", str(tmp_path / "profile.json"),
          "--cluster", str(tmp_path / "cluster.json")], "missing.json"),
        (["explain", str(tmp_path / "plan.json"), "--profile", str(tmp_path / "other.json"),
          "--cluster", str(tmp_path / "cluster.json")], "model"),
        (["explain", str(tmp_path / "plan.json"), "--profile", str(tmp_path / "profile.json"),
          "--cluster", str(tmp_path / "cluster.json"), "--time-limit", "0"], "--time-limit"),
    ]
    for argv, needle in cases:
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 2 and len(err.strip().splitlines()) == 1 and needle in err, err


def test_the_cluster_planners_certificate_is_in_the_units_plan_prints():
    profile, cluster = _inputs()
    result = plan_cluster(profile, cluster, virtual_workers=2, micro_batches=4)
    e = explain_plan(result.plan, profile, cluster, what_if=False)
    line = next(x for x in format_explanation(e).splitlines() if x.startswith("gap: "))
    upper = 1 / result.lower_bound
    assert f"objective {1 / result.objective:.1f} samples/s, upper bound {upper:.1f} samples/s" in line
    assert f"gap {100 * result.gap:.2f}%" in line


def test_a_plan_at_another_micro_batch_size_is_explained_at_its_own_size():
    from dataclasses import replace

    profile, cluster = _inputs()
    plan = replace(_one_worker_plan(profile, cluster), micro_batch_size=3 * profile.micro_batch_size)
    at_size = profile.at_size(plan.micro_batch_size)
    e = explain_plan(plan, profile, cluster, what_if=False)
    tl = simulate_plan(plan, at_size, cluster, CostOptions())
    assert e.iteration_s == pytest.approx(tl.iteration_s)
    assert e.peak_memory_bytes == pytest.approx(dict(tl.peak_memory_bytes))
    assert e.iteration_s != pytest.approx(simulate_plan(plan, profile, cluster, CostOptions()).iteration_s)
