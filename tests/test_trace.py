"""Traces, PNGs and the `simulate` command."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from partitioner.cluster import Cluster
from partitioner.errors import PartitionerError
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner.simulate import simulate_plan
from partitioner.trace import chrome_trace, summary_text
from partitioner_cli import simulate as simulate_command


def _setup(tmp_path: Path, schedule: str = "1f1b", m: int = 4) -> tuple[Path, Path, Path]:
    cluster = Cluster.homogeneous("V100-SXM2-16GB", 2, 2, 16, 7)
    gpu = cluster.devices[0].gpu_type
    prof = Profile("toy", 8, tuple(LayerProfile(f"l{i}", param_bytes=1e6, saved_bytes=1e7, output_bytes=1e7,
                                                times={gpu: LayerTime(0.01, 0.02)}) for i in range(4)))
    plan = Plan("toy", (VirtualWorker(tuple(Stage((k, k + 1), d.name, gpu) for k, d in enumerate(cluster.devices))),),
                schedule, 8, m)
    paths = tmp_path / "plan.json", tmp_path / "profile.json", tmp_path / "cluster.json"
    plan.save(paths[0])
    prof.save(paths[1])
    cluster.save(paths[2])
    return paths


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    simulate_command.register(parser.add_subparsers())
    args = parser.parse_args(["simulate", *argv])
    return int(args.func(args))


def test_chrome_trace_has_a_track_per_device_and_every_compute(tmp_path: Path) -> None:
    plan_p, prof_p, cl_p = _setup(tmp_path)
    tl = simulate_plan(Plan.load(plan_p), Profile.load(prof_p), Cluster.load(cl_p))
    doc = chrome_trace(tl)
    names = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    assert {"n0:0", "n0:1", "n1:0", "n1:1"} <= names
    comp = [e for e in doc["traceEvents"] if e.get("cat") in ("forward", "backward")]
    assert len(comp) == 2 * 4 * 4
    assert {e["name"][0] for e in comp} == {"F", "B"}
    assert len({e["cname"] for e in comp}) == 4  # one colour per micro-batch
    fwd0 = next(e for e in comp if e["name"] == "F0" and e["tid"] == 0)
    assert fwd0["dur"] == pytest.approx(0.01 * 1e6)
    sends = [e for e in doc["traceEvents"] if e.get("cat") == "send"]
    assert sends and all(e["tid"] % 2 == 1 for e in sends)
    assert "samples/s" in summary_text(tl)


def test_simulate_command_writes_trace_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_p, prof_p, cl_p = _setup(tmp_path)
    out_json, out_png = tmp_path / "t.json", tmp_path / "t.png"
    rc = _cli([str(plan_p), "--profile", str(prof_p), "--cluster", str(cl_p), "--trace", str(out_json),
               "--png", str(out_png)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "iteration" in printed and "n1:1" in printed
    assert json.loads(out_json.read_text())["traceEvents"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_command_refuses_to_overwrite_an_input(tmp_path: Path) -> None:
    plan_p, prof_p, cl_p = _setup(tmp_path)
    before = plan_p.read_text()
    with pytest.raises(PartitionerError, match="input files"):
        _cli([str(plan_p), "--profile", str(prof_p), "--cluster", str(cl_p), "--trace", str(plan_p)])
    assert plan_p.read_text() == before


def test_simulate_command_reports_an_impossible_schedule(tmp_path: Path) -> None:
    plan_p, prof_p, cl_p = _setup(tmp_path, "interleaved", m=6)
    with pytest.raises(PartitionerError, match="multiple of the 4 devices; nearest valid: 4 or 8"):
        _cli([str(plan_p), "--profile", str(prof_p), "--cluster", str(cl_p)])
