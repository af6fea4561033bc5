"""Traces, PNGs and the `simulate` command."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from partitioner import trace
from partitioner.cluster import Cluster
from partitioner.errors import PartitionerError
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner.schedule import ActionKind
from partitioner.simulate import simulate_plan
from partitioner.trace import TRACKS, chrome_trace, render_png, summary_text
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


def _two_workers(tmp_path: Path, schedule: str) -> tuple[Path, Path, Path]:
    """Two virtual workers of two stages each (four V100s on two nodes), optimizer steps timed."""
    cluster = Cluster.homogeneous("V100-SXM2-16GB", 2, 2, 16, 7)
    gpu = cluster.devices[0].gpu_type
    prof = Profile("toy", 8, tuple(LayerProfile(f"l{i}", param_bytes=1e8, saved_bytes=1e7, output_bytes=1e7,
                                                times={gpu: LayerTime(0.01, 0.02, update_s=0.005)}) for i in range(4)))
    workers = tuple(VirtualWorker((Stage((0, 2), f"n{w}:0", gpu), Stage((2, 4), f"n{w}:1", gpu))) for w in range(2))
    plan = Plan("toy", workers, schedule, 8, 4, staleness=1 if schedule == "wsp" else 0)
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
    assert sends and all(e["tid"] % len(TRACKS) == TRACKS.index("comm") for e in sends)
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


@pytest.mark.parametrize("schedule", ["1f1b", "wsp"])
def test_a_multi_worker_plan_traces_every_kind_on_its_track(tmp_path: Path, schedule: str) -> None:
    tl = simulate_plan(*(load(p) for load, p in zip((Plan.load, Profile.load, Cluster.load),
                                                    _two_workers(tmp_path, schedule), strict=True)))
    held = {ActionKind.from_code(c) for c in tl.event_kind.tolist()}
    sync = {ActionKind.ALLREDUCE, ActionKind.STEP} if schedule == "1f1b" else {ActionKind.PUSH, ActionKind.PULL}
    assert sync <= held
    for waits in (True, False):
        events = [e for e in chrome_trace(tl, include_waits=waits)["traceEvents"] if e["ph"] != "M"]
        traced = {ActionKind(e["args"]["kind"]) for e in events}
        assert traced == (held if waits else {k for k in held if k.category != "wait"})
        for e in events:  # every event on its kind's track, in its kind's category
            kind = ActionKind(e["args"]["kind"])
            want = {"forward": "compute", "backward": "compute", "send": "comm", "wait": "comm",
                    "allreduce": "collective", "wsp": "collective", "step": "optimizer"}[kind.category]
            assert (e["cat"], TRACKS[e["tid"] % len(TRACKS)]) == (kind.category, want)
    doc = chrome_trace(tl)
    tracks = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    assert {"n0:0", "n0:0 comm", "n1:1", "n1:1 comm"} <= tracks
    if schedule == "1f1b":
        assert {"n0:0 all-reduce", "n0:0 optimizer", "n1:1 all-reduce", "n1:1 optimizer"} <= tracks
        ar = [e for e in doc["traceEvents"] if e.get("cat") == "allreduce"]
        assert len(ar) == 4 and all(e["ph"] == "X" and e["dur"] > 0 for e in ar)
    else:
        assert {"n0:0 all-reduce", "n1:1 all-reduce"} <= tracks


@pytest.mark.parametrize("schedule", ["1f1b", "wsp"])
def test_a_multi_worker_plan_renders_its_all_reduces_and_steps(tmp_path: Path, schedule: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    tl = simulate_plan(*(load(p) for load, p in zip((Plan.load, Profile.load, Cluster.load),
                                                    _two_workers(tmp_path, schedule), strict=True)))
    drawn: list[tuple[str, int]] = []
    draw = trace._draw_band

    def spy(ax, tl_, sel, y, h, colour, visible):  # type: ignore[no-untyped-def]
        drawn.append((colour, int(sel.sum())))
        draw(ax, tl_, sel, y, h, colour, visible)

    monkeypatch.setattr(trace, "_draw_band", spy)
    out = tmp_path / "t.png"
    render_png(tl, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    per_colour = {c: sum(n for c2, n in drawn if c2 == c) for c, _ in drawn}
    ar = ActionKind.ALLREDUCE if schedule == "1f1b" else ActionKind.PUSH
    n_ar = int((tl.event_kind == ar.code).sum()) + (int((tl.event_kind == ActionKind.PULL.code).sum())
                                                    if schedule == "wsp" else 0)
    assert per_colour["black"] == n_ar  # every all-reduce (WSP: push and pull) drawn
    if schedule == "1f1b":
        assert per_colour["red"] == int((tl.event_kind == ActionKind.STEP.code).sum())  # every optimizer step


@pytest.mark.parametrize("schedule", ["1f1b", "wsp"])
def test_simulate_command_traces_a_multi_worker_plan(tmp_path: Path, schedule: str) -> None:
    plan_p, prof_p, cl_p = _two_workers(tmp_path, schedule)
    out_json, out_png = tmp_path / "t.json", tmp_path / "t.png"
    rc = _cli([str(plan_p), "--profile", str(prof_p), "--cluster", str(cl_p), "--trace", str(out_json),
               "--png", str(out_png)])
    assert rc == 0
    cats = {e.get("cat") for e in json.loads(out_json.read_text())["traceEvents"]}
    assert ({"allreduce", "step"} if schedule == "1f1b" else {"wsp"}) <= cats
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
