"""Heterogeneity emulation: the rule, the stretch hook, the emulated prediction, runs and bad input."""

from __future__ import annotations

import itertools
import json
import statistics
import time
from pathlib import Path

import pytest
import torch

from partitioner.cluster import Cluster, Node
from partitioner.emulation import (
    emulated_cluster,
    emulated_profile,
    emulation_for,
    predict_emulated,
)
from partitioner.errors import FormatError
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner.simulate import simulate_plan
from partitioner_cli import main as cli
from runtime.emulation import Stretch
from runtime.launch import TrainConfig, train_local

# two GPU types from the catalog on one node whose links are this machine's
CLUSTER = Cluster("emu", (Node("n0", ("A100-SXM4-40GB", "T4", "T4"), 2.0),), 2.0)


def _profile(n: int = 4, types: tuple[str, ...] = ("cpu", "A100", "T4"), mb: int = 2) -> Profile:
    """cpu: 1 ms fwd, 2 ms bwd per layer; A100 a 100th of that; T4 3x A100 forward, 2x backward
    (the T4 layer 1 forward 5x, so ratios differ per layer)."""
    times = {"cpu": lambda i: LayerTime(1e-3, 2e-3),
             "A100": lambda i: LayerTime(1e-5, 2e-5),
             "T4": lambda i: LayerTime((5e-5 if i == 1 else 3e-5), 4e-5)}
    layers = tuple(LayerProfile(f"l{i}", 1.0, 4.0, 4.0, 4.0, {t: times[t](i) for t in types}) for i in range(n))
    return Profile("gpt2-tiny", mb, layers)


def _worker(cuts: list[int], devices: list[str]) -> VirtualWorker:
    return VirtualWorker(tuple(Stage((a, b), devices[k % len(devices)])
                               for k, (a, b) in enumerate(itertools.pairwise(cuts))))


PLAN = Plan("gpt2-tiny", (_worker([0, 1, 4], ["n0:0", "n0:1"]),), micro_batch_size=2, micro_batches=2)


# -- the rule ---------------------------------------------------------------------------------


def test_emulated_times_are_local_times_scaled_by_the_type_over_the_reference() -> None:
    emu = emulated_profile(_profile(), CLUSTER)
    assert emu.meta["emulated"]["reference"] == "A100-SXM4-40GB"  # the fastest on every layer
    f, b = emu.times_for("A100-SXM4-40GB")
    assert f.tolist() == pytest.approx([1e-3] * 4) and b.tolist() == pytest.approx([2e-3] * 4)
    f, b = emu.times_for("T4")
    assert f.tolist() == pytest.approx([3e-3, 5e-3, 3e-3, 3e-3]) and b.tolist() == pytest.approx([4e-3] * 4)
    # only the local key and the cluster's names remain (the alias 'A100' would be priced in their place)
    assert set(emu.gpu_types) == {"cpu", "A100-SXM4-40GB", "T4"}


def test_stage_factors_and_targets() -> None:
    e = emulation_for(PLAN, _profile(), CLUSTER)
    assert e.factors("n0:0") == {0: (1.0, 1.0)}
    fwd, bwd = e.factors("n0:1")[1]
    assert fwd == pytest.approx((5 + 3 + 3) / 3) and bwd == pytest.approx(2.0)  # layers 1..3 on T4
    assert e.targets_s("n0:1")[1] == pytest.approx((11e-3, 12e-3))
    # the emulation of an emulated profile is the same (the ratios between types are kept)
    again = emulation_for(PLAN, emulated_profile(_profile(), CLUSTER), CLUSTER)
    for s, t in zip(e.stages, again.stages, strict=True):
        assert (s.fwd_factor, s.bwd_factor) == pytest.approx((t.fwd_factor, t.bwd_factor))


def test_a_named_reference_slower_than_a_plan_type_is_refused() -> None:
    with pytest.raises(FormatError, match=r"emulate_reference = 'T4': device n0:0 \(A100-SXM4-40GB\) would run "
                                          r"stage 0 of virtual worker 0 \(forward\) in 0.333x this machine.s time"):
        emulation_for(PLAN, _profile(), CLUSTER, reference="T4")
    # a reference faster than every type: every factor grows by the same per-layer ratio
    fast = _profile()
    fast = fast.with_times("H100", [LayerTime(5e-6, 1e-5)] * 4)
    e = emulation_for(PLAN, fast, CLUSTER, reference="H100")
    assert e.factors("n0:0") == {0: pytest.approx((2.0, 2.0))}


@pytest.mark.parametrize(("profile", "reference", "expect"), [
    (_profile(types=("A100", "T4")), None, "emulate_local = 'cpu': profile 'gpt2-tiny' has no times for this "
                                           "machine's device 'cpu'"),
    (_profile(types=("cpu", "A100")), None, "emulate = 'T4': the plan's GPU type T4 has no times in profile"),
    (_profile(), "V100", "emulate_reference = 'V100': profile 'gpt2-tiny' has no times for this GPU type "
                         "(it has: cpu, A100, T4)"),
])
def test_missing_times_are_refused(profile: Profile, reference: str | None, expect: str) -> None:
    with pytest.raises(FormatError) as err:
        emulation_for(PLAN, profile, CLUSTER, reference=reference)
    assert expect in str(err.value)


def test_prediction_uses_the_emulated_times_and_local_links() -> None:
    one = Plan("gpt2-tiny", (_worker([0, 4], ["n0:1"]),), micro_batch_size=2, micro_batches=1)
    tl = predict_emulated(one, _profile(), CLUSTER)
    assert tl.iteration_s == pytest.approx(14e-3 + 16e-3)  # one T4 micro-batch: emulated forward + backward
    links = emulated_cluster(Cluster("far", (Node("a", ("A100-SXM4-40GB",), 300.0), Node("b", ("T4", "T4"), 16.0)),
                                     1.0), 2.0)
    assert {links.bandwidth_gbps(x, y) for x, y in [("a:0", "b:0"), ("b:0", "b:1")]} == {2.0}
    emu = emulated_profile(_profile(), CLUSTER)
    assert predict_emulated(PLAN, _profile(), CLUSTER).iteration_s == pytest.approx(
        simulate_plan(PLAN, emu, emulated_cluster(CLUSTER)).iteration_s)


# -- the stretch hook -------------------------------------------------------------------------


@pytest.mark.parametrize(("rule", "compute_s", "expect_s"), [("scaled", 0.02, 0.05), ("profiled", 0.01, 0.04)])
def test_stretch_makes_an_action_last_its_target(rule: str, compute_s: float, expect_s: float) -> None:
    """On a clock the test controls: the hold sleeps exactly up to the action's target (the scaled
    rule: the compute x 2.5; the profiled rule: the profiled 0.04 s), never ends early, and says
    what it slept."""
    now = [0.0]
    slept_calls: list[float] = []

    def sleep(x: float) -> None:
        slept_calls.append(x)
        now[0] += x

    stretch = Stretch({3: (2.5, 1.0)}, {3: (0.04, 0.0)}, rule, clock=lambda: now[0], sleep=sleep)
    for k in range(5):
        t0 = now[0]
        now[0] += compute_s  # the action's compute, of a known length
        compute, slept = stretch.hold(3, False, t0)
        assert compute == pytest.approx(compute_s)
        assert now[0] - t0 == pytest.approx(expect_s)  # the hold ends at its target, not before
        assert slept == pytest.approx(expect_s - compute_s) and sum(slept_calls) == pytest.approx((k + 1) * slept)
    assert stretch.overruns == 0 and stretch.actions == 5


@pytest.mark.slow
@pytest.mark.parametrize(("rule", "compute_s", "expect_s"), [("scaled", 0.02, 0.05), ("profiled", 0.01, 0.04)])
def test_stretch_on_the_real_clock(rule: str, compute_s: float, expect_s: float) -> None:
    """With time.sleep: never early; the median of five within 10 % (a loaded machine may oversleep)."""
    stretch = Stretch({3: (2.5, 1.0)}, {3: (0.04, 0.0)}, rule)
    ratios, walls = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        time.sleep(compute_s)  # the action's compute, of a known length
        compute, slept = stretch.hold(3, False, t0)
        wall = time.perf_counter() - t0
        assert compute >= compute_s
        target = compute * 2.5 if rule == "scaled" else 0.04
        assert wall >= target - 1e-3, (wall, target)  # the hold never ends before its target
        assert slept == pytest.approx(wall - compute, abs=2e-3)
        ratios.append(wall / target)
        walls.append(wall)
    assert abs(statistics.median(ratios) - 1.0) <= 0.1, ratios
    assert abs(statistics.median(walls) - expect_s) <= 0.15 * expect_s, walls
    assert stretch.overruns == 0 and stretch.actions == 5


def test_profiled_rule_counts_overruns_and_never_shortens() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    stretch = Stretch({0: (3.0, 3.0)}, {0: (0.5, 0.9)}, "profiled", clock=lambda: now[0], sleep=sleep)
    now[0] = 0.7  # forward computed for 0.7 s, longer than its 0.5 s: no sleep, one overrun
    assert stretch.hold(0, False, 0.0) == (0.7, 0.0)
    now[0] = 10.2  # backward from 10.0: computed 0.2 s, sleeps to 0.9 s
    compute, rest = stretch.hold(0, True, 10.0)
    assert compute == pytest.approx(0.2) and rest == pytest.approx(0.7) and now[0] == pytest.approx(10.9)
    assert (stretch.overruns, stretch.actions) == (1, 2)
    now[0] = 20.1  # a slice of half a micro-batch (first_slices 2): its target is half the stage's
    compute, rest = stretch.hold(0, True, 20.0, share=0.5)
    assert compute == pytest.approx(0.1) and rest == pytest.approx(0.35) and now[0] == pytest.approx(20.45)
    assert (stretch.overruns, stretch.actions) == (1, 3)
    with pytest.raises(ValueError, match="must be two numbers >= 1"):
        Stretch({0: (0.5, 1.0)}, rule="scaled")


# -- runs -------------------------------------------------------------------------------------


def _weights(plan: Plan, tmp: Path, emulation: object | None, **kw: object) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    tmp.mkdir()
    cfg = TrainConfig(plan.model, steps=3, warmup=1, lr=0.3, seed=1, threads=1, timeout_s=60, state_dir=str(tmp),
                      progress=False, emulation=emulation, **kw)  # type: ignore[arg-type]
    metrics = train_local(plan, cfg, start_method="forkserver")
    out: dict[str, torch.Tensor] = {}
    for r in range(metrics["world_size"]):
        for state in torch.load(tmp / f"rank{r}.pt").values():
            out.update({f"{r}.{k}": v for k, v in state.items()})
    return metrics, out


@pytest.mark.parametrize("schedule", ["1f1b", "wsp", "2bw"])
def test_an_emulated_run_computes_what_an_unemulated_one_does(schedule: str, tmp_path: Path) -> None:
    workers = (_worker([0, 1, 4], ["n0:0", "n0:1"]),)
    if schedule == "wsp":
        workers = (_worker([0, 4], ["n0:0"]), _worker([0, 4], ["n0:1"]))
    plan = Plan("gpt2-tiny", workers, schedule=schedule, micro_batch_size=2, micro_batches=2,
                staleness=1 if schedule == "wsp" else 0)
    emulation = emulation_for(plan, _profile(), CLUSTER)
    plain, w_plain = _weights(plan, tmp_path / "plain", None)
    emu, w_emu = _weights(plan, tmp_path / "emu", emulation)
    assert plain["loss"] == emu["loss"]
    assert set(w_plain) == set(w_emu)
    for k, v in w_plain.items():
        assert torch.equal(v, w_emu[k]), k
    # the T4 rank (n0:1) slept and the A100 rank ran at the profile's local times
    ranks = {r["device"]: r for r in emu["emulated"]["ranks"]}
    # (it slept, or on a loaded machine computed past its targets: overruns; either way it was held)
    assert ranks["n0:1"]["gpu_type"] == "T4"
    assert ranks["n0:1"]["slept_s_per_step"] > 0 or ranks["n0:1"]["overruns"] > 0
    assert emu["emulated"]["reference"] == "A100-SXM4-40GB" and emu["emulated"]["rule"] == "profiled"
    assert "emulated" not in plain and "emulation" not in plain["ranks"][0]["seconds_per_step"]


def _write(tmp_path: Path, plan: Plan, profile: Profile) -> list[str]:
    plan.save(tmp_path / "plan.json")
    profile.save(tmp_path / "profile.json")
    CLUSTER.save(tmp_path / "cluster.json")
    return [str(tmp_path / "plan.json"), "--profile", str(tmp_path / "profile.json"),
            "--cluster", str(tmp_path / "cluster.json"), "--model", "gpt2-tiny", "--local"]


def test_cli_says_it_is_an_emulation(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.launch as launch

    real = launch.train_local
    monkeypatch.setattr(launch, "train_local", lambda plan, cfg, **kw: real(plan, cfg, start_method="forkserver", **kw))
    out = tmp_path / "m.json"
    rc = cli.main(["train", *_write(tmp_path, PLAN, _profile()), "--emulate", "--steps", "3", "--warmup", "1",
                   "--threads", "1", "-o", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "EMULATION: every rank plays its device's GPU type" in text
    assert "n0:1 plays T4: stage 1: forward x3.67, backward x2" in text
    assert "measured iteration" in text and "(emulated)" in text and "emulated times of cpu" in text
    m = json.loads(out.read_text())
    assert m["emulated"]["reference"] == "A100-SXM4-40GB"
    assert [r["factors"] for r in m["emulated"]["ranks"]] == [{"0": [1.0, 1.0]}, {"1": [pytest.approx(11 / 3), 2.0]}]
    # predicted: 2 micro-batches through A100 (3 ms per micro-batch) and T4 (11 + 12 ms) stages
    assert m["predicted_iteration_s"] == pytest.approx(predict_emulated(PLAN, _profile(), CLUSTER).iteration_s)


@pytest.mark.parametrize(("profile", "extra", "expect"), [
    (_profile(types=("A100", "T4")), [], "--emulate-local = 'cpu': profile 'gpt2-tiny' has no times for this "
                                         "machine's device 'cpu'"),
    (_profile(types=("cpu", "A100")), [], "--emulate = 'T4': the plan's GPU type T4 has no times in profile"),
    (_profile(), ["--emulate-reference", "V100"], "--emulate-reference = 'V100': profile 'gpt2-tiny' has no times"),
    (_profile(), ["--emulate-reference", "T4"], "emulation can only slow down"),
])
def test_cli_refuses_bad_emulation_before_any_process(profile: Profile, extra: list[str], expect: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.launch as launch

    monkeypatch.setattr(launch, "train_local", lambda *a, **k: pytest.fail("a process was started"))
    rc = cli.main(["train", *_write(tmp_path, PLAN, profile), "--emulate", *extra])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expect in err, err
    assert "profile.json" in err


def test_cli_refuses_emulation_options_without_emulate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["train", *_write(tmp_path, PLAN, _profile()), "--emulate-reference", "A100"])
    assert rc == 2
    assert "--emulate-reference: only with --emulate" in capsys.readouterr().err


def test_profile_emulate_writes_the_emulated_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _profile().save(tmp_path / "p.json")
    CLUSTER.save(tmp_path / "c.json")
    out = tmp_path / "e.json"
    assert cli.main(["profile", "emulate", str(tmp_path / "p.json"), "--cluster", str(tmp_path / "c.json"),
                     "-o", str(out)]) == 0
    written = Profile.load(out)
    assert written.times_for("T4")[0].tolist() == pytest.approx(emulated_profile(_profile(), CLUSTER).times_for("T4")[0])
    assert cli.main(["profile", "emulate", str(tmp_path / "p.json"), "--cluster", str(tmp_path / "c.json"),
                     "--reference", "V100", "-o", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--reference = 'V100': profile 'gpt2-tiny' has no times" in err
