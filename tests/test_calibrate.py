"""Calibration recovers known link and overhead parameters from synthetic runs; leave-one-out
predicts each run without it; the command writes a calibrated cluster and never over its input."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from partitioner.bandwidth import Bandwidth
from partitioner.calibrate import LinkParams, apply_params, fit, leave_one_out, predict
from partitioner.cluster import GIB, Cluster, Node
from partitioner.errors import OptionError
from partitioner.measured import MeasuredRun, load_run
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.pricing import CostOptions
from partitioner.profile import LayerProfile, LayerTime, Profile
from tests.conftest import big_type

TRUE = LinkParams(send_overhead_s=0.004, inter_scale=0.5, reserved_bytes=1.5 * GIB)


def _profile() -> Profile:
    return Profile("m", 1, tuple(LayerProfile(f"l{i}", param_bytes=5e7, saved_bytes=1e8, output_bytes=5e7,
                                              times={"G": LayerTime(0.004, 0.008, update_s=0.001)})
                                 for i in range(8)))


def _cluster() -> Cluster:
    return Cluster("c", tuple(Node(f"n{k}", ("G",) * 2, 100.0) for k in range(4)), 10.0, {"G": big_type("G")},
                   inter_curve=Bandwidth(10.0, latency_s=1e-5))


def _plans() -> list[Plan]:
    """Pipelines of 2 and 4 stages over nodes, data parallelism across nodes, several micro-batch counts."""
    out = []
    for m in (4, 16):
        out.append(Plan("m", (VirtualWorker(tuple(Stage((2 * k, 2 * k + 2), f"n{k}:0", "G") for k in range(4))),),
                        "1f1b", 1, m))
        out.append(Plan("m", (VirtualWorker((Stage((0, 4), "n0:0", "G"), Stage((4, 8), "n1:0", "G"))),),
                        "1f1b", 1, m))
        out.append(Plan("m", tuple(VirtualWorker((Stage((0, 8), f"n{k}:0", "G"),)) for k in range(4)), "1f1b", 1, m))
    return out


def _synthetic(params: LinkParams) -> list[MeasuredRun]:
    prof, cl, opts = _profile(), _cluster(), CostOptions(reserved_bytes=0.25 * GIB)
    runs = []
    for i, plan in enumerate(_plans()):
        run = MeasuredRun(f"r{i}", plan, prof, cl, opts, 1.0, 1.0)
        it, peak = predict(run, params)
        runs.append(replace(run, measured_iteration_s=it, measured_peak_bytes=peak))
    return runs


def test_fit_recovers_known_parameters_from_synthetic_runs():
    runs = _synthetic(TRUE)
    got = fit(runs, ("send_overhead", "inter_bandwidth", "reserved"), rounds=3)
    assert got.params.send_overhead_s == pytest.approx(TRUE.send_overhead_s, rel=0.05)
    assert got.params.inter_scale == pytest.approx(TRUE.inter_scale, rel=0.05)
    assert got.params.reserved_bytes == pytest.approx(TRUE.reserved_bytes, rel=1e-6)
    assert max(abs(e) for e in got.time_errors) < 0.01 and max(abs(e) for e in got.memory_errors) < 1e-6


def test_leave_one_out_predicts_each_run_from_the_others():
    runs = _synthetic(replace(TRUE, inter_scale=1.0))
    loo, folds = leave_one_out(runs, ("send_overhead", "reserved"))
    assert len(folds) == len(runs) and loo.runs == tuple(r.name for r in runs)
    assert max(abs(e) for e in loo.time_errors) < 0.01  # one parameter, exact synthetic data


def test_leave_one_out_on_three_runs_and_refusals():
    runs = _synthetic(LinkParams(send_overhead_s=0.003))[:3]
    loo, folds = leave_one_out(runs, ("send_overhead",))
    assert all(f.send_overhead_s == pytest.approx(0.003, rel=0.05) for f in folds)
    assert max(abs(e) for e in loo.time_errors) < 0.01
    with pytest.raises(OptionError, match="fit"):
        fit(runs, ("latency",))
    with pytest.raises(OptionError, match="runs"):
        leave_one_out(runs[:1])


def test_apply_params_sets_overheads_and_scales_only_the_inter_node_links():
    cl = apply_params(_cluster(), TRUE)
    assert cl.inter_curve is not None and cl.inter_curve.gbps == 5.0 and cl.inter_curve.latency_s == 1e-5
    assert cl.inter_curve.send_overhead_s == 0.004
    assert cl.nodes[0].intra_gbps == 100.0 and cl.nodes[0].intra_curve.send_overhead_s == 0.004
    back = Cluster.from_dict(cl.to_dict())
    assert back.transfer_s(1e9, "n0:0", "n1:0") == pytest.approx(1e-5 + 0.004 + 1e9 / 5e9)
    # collectives pay the latency of each step, not the per-send overhead
    assert back.link("n0:0", "n1:0").seconds(1e9) == pytest.approx(1e-5 + 1e9 / 5e9)


def _run_folder(tmp_path, run: MeasuredRun, name: str, metrics: bool = False):
    d = tmp_path / name
    d.mkdir()
    plan = run.plan if metrics else replace(
        run.plan, meta={"measured": {"iteration_s": run.measured_iteration_s,
                                     "peak_memory_bytes": run.measured_peak_bytes}})
    (d / "plan.json").write_text(json.dumps(replace(plan, pricing=run.options).to_dict()))
    (d / "profile.json").write_text(json.dumps(run.profile.to_dict()))
    (d / "cluster.json").write_text(json.dumps(run.cluster.to_dict()))
    if metrics:
        (d / "metrics.json").write_text(json.dumps({"measured_iteration_s": run.measured_iteration_s,
                                                    "ranks": [{"peak_memory_bytes": run.measured_peak_bytes}]}))
    return d


def test_calibrate_command_writes_a_calibrated_cluster(tmp_path, capsys):
    from partitioner_cli.main import main

    runs = _synthetic(LinkParams(send_overhead_s=0.002))[:3]
    folders = [str(_run_folder(tmp_path, r, r.name, metrics=i == 2)) for i, r in enumerate(runs)]
    assert load_run(folders[2]).measured_iteration_s == runs[2].measured_iteration_s
    out = tmp_path / "calibrated.json"
    rc = main(["calibrate", *folders, "--fit", "send_overhead", "-o", str(out), "--report", str(tmp_path / "r.json")])
    text = capsys.readouterr().out
    assert rc == 0 and "leave-one-run-out" in text
    cl = Cluster.load(out)
    assert cl.inter_curve is not None and cl.inter_curve.send_overhead_s == pytest.approx(0.002, rel=0.05)
    report = json.loads((tmp_path / "r.json").read_text())
    assert len(report["runs"]) == 3 and "leave_one_out_s" in report["runs"][0]
    # never over its input
    rc = main(["calibrate", *folders, "--fit", "send_overhead", "-o", str(tmp_path / runs[0].name / "cluster.json")])
    assert rc == 2 and "input" in capsys.readouterr().err


def test_p2p_scale_slows_pipeline_sends_not_collectives_and_is_recovered():
    from partitioner.bandwidth import parse_bandwidth

    bw = Bandwidth(10.0, latency_s=2**-16, p2p_scale=0.25)
    assert bw.send_seconds(1e9) == pytest.approx(2**-16 + 1e9 / 2.5e9) and bw.seconds(1e9) == pytest.approx(2**-16 + 0.1)
    assert parse_bandwidth({"x": bw.to_value()}, "x") == replace(bw, name="x")
    runs = _synthetic(LinkParams(p2p_scale=0.3, reserved_bytes=GIB))
    got = fit(runs, ("p2p_bandwidth", "reserved"))
    assert got.params.p2p_scale == pytest.approx(0.3, rel=0.03) and got.params.reserved_bytes == pytest.approx(GIB)
    # data parallelism alone (no pipeline sends) is priced the same with any p2p scale
    dp = next(r for r in runs if len(r.plan.virtual_workers) == 4)
    assert predict(dp, LinkParams(p2p_scale=0.1))[0] == pytest.approx(predict(dp, LinkParams())[0], rel=1e-12)


def test_leaving_a_group_out_predicts_each_run_from_the_other_groups_only():
    """Runs grouped (say by cluster): each is predicted by a fit on the other groups' runs alone;
    groups of one run each are leave-one-out; one group only, or a key per run missing, is refused."""
    runs = _synthetic(replace(TRUE, inter_scale=1.0))
    groups = [i % 3 for i in range(len(runs))]
    lgo, folds = leave_one_out(runs, ("send_overhead", "reserved"), groups=groups)
    assert len(folds) == len(runs) and folds[0] == folds[3]  # one fit per group left out
    assert folds[0] == fit([r for r, g in zip(runs, groups, strict=True) if g != groups[0]],
                           ("send_overhead", "reserved")).params
    assert max(abs(e) for e in lgo.time_errors) < 0.01  # the other groups still determine the parameters
    with pytest.raises(OptionError, match="groups"):
        leave_one_out(runs, ("send_overhead",), groups=[0] * len(runs))
    with pytest.raises(OptionError, match="groups"):
        leave_one_out(runs, ("send_overhead",), groups=[0, 1])


def test_a_fitted_send_scale_multiplies_the_one_the_link_has():
    """An import may give a link's sends a rate of their own (``p2p_scale``: one GPU's rate of a
    group's curve); calibration scales that rate, it does not replace it."""
    from tests.conftest import big_type

    link = Bandwidth(40.0, points=((1e6, 10.0), (1e8, 40.0)), p2p_scale=0.25)
    cl = Cluster("c", (Node("n0", ("G",) * 2, 100.0), Node("n1", ("G",) * 2, 100.0)), 40.0, {"G": big_type("G")},
                 inter_curve=link)
    out = apply_params(cl, LinkParams(p2p_scale=0.4))
    assert out.inter_curve.p2p_scale == pytest.approx(0.1)
    assert out.inter_curve.gbps_at(1e8) == link.gbps_at(1e8)  # collectives keep the link's rate
    assert apply_params(cl, LinkParams()).inter_curve.p2p_scale == 0.25
