"""Overlapping iterations (``CostOptions.overlap_iterations``): the simulator's steady-state period
against the closed forms on equal stages, the lists' dependencies across iteration boundaries,
the option's validation, and the runtime's overlapped run against its flushing run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.channels import channel_order
from partitioner.cost import CostModel, CostOptions
from partitioner.errors import FormatError, PartitionerError
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.profile import LayerProfile, Profile
from partitioner.schedule import STEP, F, I, Schedule, W, build_schedule
from partitioner.simulate import simulate_plan
from partitioner.timeline import Timeline
from tests.test_runtime import worker
from tests.test_zero_bubble import _plan, _profile

OVERLAP = CostOptions(reserved_bytes=0.0, sync=False, overlap_iterations=True)
# the micro-batches from which each schedule's overlapped closed form holds
REACH = {"zb-h1": lambda p: p, "zb-h2": lambda p: 2 * p - 1, "zbv": lambda p: 2 * p - 1,
         "1f1b": lambda p: 1, "gpipe": lambda p: 1, "interleaved": lambda p: p}


def _uniform(schedule: str, p: int, m: int, f: float, b: float, w: float) -> tuple[Plan, Profile, int]:
    v = 2 if schedule in ("zbv", "interleaved") else 1
    plan, cluster = _plan("zbv" if schedule == "zbv" else "1f1b", p, m)
    if schedule not in ("zbv", "1f1b"):
        stages = tuple(Stage((s, s + 1), cluster.devices[s % p].name) for s in range(p * v))
        plan = Plan("toy", (VirtualWorker(stages),), schedule, 4, m, chunks=v)
    return plan, _profile([(f / v, b / v, w / v)] * (p * v)), v


@settings(max_examples=80, deadline=None)
@given(schedule=st.sampled_from(sorted(REACH)), p=st.integers(1, 6), extra=st.integers(0, 8),
       fbw=st.tuples(st.floats(0.05, 4.0), st.floats(0.0, 4.0), st.floats(0.0, 4.0)).filter(lambda t: t[1] + t[2] > 0))
def test_overlapped_period_equals_the_closed_form(schedule: str, p: int, extra: int,
                                                  fbw: tuple[float, float, float]) -> None:
    """Equal stages (per device forward F, input gradient B, weight gradient W), no transfers: the
    simulator's steady-state period is ``m (F + B + W)`` plus the closed form's idle time, every
    device idles that long per period, and the one-chunk cost model prices ZB-H1 and ZB-H2 alike.
    Overlap never makes an iteration longer than the flushing one."""
    f, b, w = fbw
    m = REACH[schedule](p) + extra
    if schedule == "interleaved":
        m = p * (1 + extra // 3)
    plan, prof, v = _uniform(schedule, p, m, f, b, w)
    sched = Schedule.of(schedule, m, overlap=True)
    want = sched.uniform_bubble_s(p, f, b, w, v)
    assert want is not None and want >= 0
    cluster = _plan("1f1b", p, m)[1]
    tl = simulate_plan(plan, prof, cluster, OVERLAP)
    busy = m * (f + b + w)
    assert tl.iteration_s == pytest.approx(busy + want, rel=1e-9, abs=1e-9)
    for bubble in tl.bubble_fraction.values():
        assert bubble * tl.iteration_s == pytest.approx(want, rel=1e-9, abs=1e-9)
    assert tl.first_iteration_s >= tl.iteration_s - 1e-9
    flushed = simulate_plan(plan, prof, cluster, dataclasses.replace(OVERLAP, overlap_iterations=False))
    assert tl.iteration_s <= flushed.iteration_s + 1e-9
    if schedule in ("zb-h1", "zb-h2"):
        priced = dataclasses.replace(plan, pricing=OVERLAP)
        assert CostModel(prof, cluster, OVERLAP).worker_iteration_s(priced) == pytest.approx(busy + want, rel=1e-9)


@pytest.mark.parametrize(("schedule", "p", "zero_at"), [("zb-h2", 4, 7), ("zbv", 4, 7)])
def test_zb_h2_and_zbv_reach_zero_bubble_at_equal_parts(schedule: str, p: int, zero_at: int) -> None:
    """Qi et al.: ZB-H2 and ZB-V have no bubble at F = B = W once iterations overlap; flushed,
    each keeps a fill. Below 2p - 1 micro-batches the closed form declines (the simulator decides)."""
    plan, prof, v = _uniform(schedule, p, zero_at, 1.0, 1.0, 1.0)
    cluster = _plan("1f1b", p, zero_at)[1]
    tl = simulate_plan(plan, prof, cluster, OVERLAP)
    assert tl.iteration_s == pytest.approx(zero_at * 3.0)
    assert max(tl.bubble_fraction.values()) == pytest.approx(0.0, abs=1e-12)
    assert tl.first_iteration_s > tl.iteration_s  # the first iteration still fills the pipeline
    flushed = simulate_plan(plan, prof, cluster, dataclasses.replace(OVERLAP, overlap_iterations=False))
    assert flushed.iteration_s > tl.iteration_s
    assert Schedule.of(schedule, zero_at - 1, overlap=True).uniform_bubble_s(p, 1.0, 1.0, 1.0, v) is None


@settings(max_examples=40, deadline=None)
@given(schedule=st.sampled_from(["1f1b", "zb-h1", "zb-h2", "zbv"]), p=st.integers(1, 5), m=st.integers(1, 9),
       it=st.integers(2, 3), data=st.data())
def test_overlapped_lists_are_dependency_safe_across_iterations(schedule: str, p: int, m: int, it: int,
                                                                data: st.DataObject) -> None:
    """Several iterations back to back with random times per stage and part: no deadlock, every
    F, I and W after what it depends on, and each rank's next-iteration work after its own step
    (and only that: some rank starts iteration i + 1 before another has stepped i when p > 1 and
    the schedule gains from it). The channel order over the whole run exists (the runtime's)."""
    v = 2 if schedule == "zbv" else 1
    times = data.draw(st.lists(st.tuples(st.floats(0.01, 5.0), st.floats(0.0, 5.0), st.floats(0.0, 5.0)),
                               min_size=p * v, max_size=p * v))
    plan, cluster = _plan(schedule, p, m)
    tl = simulate_plan(plan, _profile(times), cluster, OVERLAP, iterations=it)
    ends: dict[tuple[object, int, int], float] = {}
    starts: dict[tuple[object, int, int], tuple[int, float]] = {}
    steps: dict[int, list[float]] = {}
    for r, kind, j, s, t0, t1 in tl.events():
        if kind in (F, I, W):
            starts[(kind, j, s)], ends[(kind, j, s)] = (r, t0), t1
        elif kind == STEP:
            steps.setdefault(r, []).append(t1)
    eps = 1e-9
    for (kind, j, s), (r, t0) in starts.items():
        if kind == F and s > 0:
            assert t0 >= ends[(F, j, s - 1)] - eps
        if kind == I:
            assert t0 >= ends[(F, j, s)] - eps
            if s < p * v - 1:
                assert t0 >= ends[(I, j, s + 1)] - eps
        if kind == W:
            assert t0 >= ends[(I, j, s)] - eps
        if j >= m:  # a later iteration: after this rank's own step of the one before
            assert t0 >= steps[r][j // m - 1] - eps
    channel_order(build_schedule(schedule, p, m, v, iterations=it))  # raises if no common order exists


def test_overlap_option_is_validated_and_round_trips(tmp_path: Path) -> None:
    opts = CostOptions(overlap_iterations=True, precision="bf16")
    assert CostOptions.from_dict(json.loads(json.dumps(opts.to_dict()))) == opts
    assert "overlap_iterations" not in CostOptions().to_dict()
    with pytest.raises(FormatError, match=r"overlap_iterations.*fp16 training agrees on its loss scale"):
        CostOptions(overlap_iterations=True, precision="fp16")
    with pytest.raises(FormatError, match=r"pricing\.overlap_iterations"):
        CostOptions.from_dict({"overlap_iterations": "yes"})
    plan, _ = _plan("zb-h2", 4, 8)
    saved = dataclasses.replace(plan, pricing=opts)
    saved.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded.overlaps_iterations and loaded.pipeline_schedule.overlap
    assert not dataclasses.replace(plan, schedule="2bw", pricing=opts).overlaps_iterations  # never flushes anyway
    layers = (LayerProfile("l0", 1.0, 1.0, times={"V100-SXM2-16GB": _profile([(1.0, 1.0, 1.0)]).layers[0].times[
        "V100-SXM2-16GB"]}),)
    tl = simulate_plan(dataclasses.replace(_plan("1f1b", 1, 2)[0], pricing=opts), Profile("toy", 4, layers),
                       _plan("1f1b", 1, 2)[1], opts)
    again = Timeline.from_dict(json.loads(json.dumps(tl.to_dict())))
    assert again.first_iteration_s == tl.first_iteration_s > 0


def test_runtime_refuses_what_overlap_cannot_do() -> None:
    from runtime.launch import TrainConfig, prepare

    plan = Plan("gpt2-tiny", (worker([0, 2, 4], ["n0:0", "n0:1"]),), schedule="zb-h1", micro_batch_size=2,
                micro_batches=2, pricing=CostOptions(overlap_iterations=True, optimizer_state_factor=0))
    for extra, what in (({"max_seconds": 5.0}, "max_seconds"), ({"eval_global": True}, "eval_global"),
                        ({"precision": "fp16"}, "precision` fp16")):
        with pytest.raises(PartitionerError, match=what):
            prepare(plan, TrainConfig("gpt2-tiny", steps=2, **extra))  # type: ignore[arg-type]


def _trained(plan: Plan, tmp: Path) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    from runtime.launch import TrainConfig, train_local

    cfg = TrainConfig(plan.model, steps=3, warmup=0, lr=0.05, seed=1, threads=1, timeout_s=60, state_dir=str(tmp),
                      progress=False)
    metrics = train_local(plan, cfg, start_method="forkserver")
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(tmp.glob("rank*.pt")):
        for state in torch.load(f).values():
            weights.update({f"{f.stem}.{k}": v for k, v in state.items()})
    return metrics, weights


@pytest.mark.parametrize("case", [pytest.param("zb-h2", marks=pytest.mark.slow), "zbv", "1f1b-two-workers"])
def test_overlapped_run_equals_the_flushing_run(case: str, tmp_path: Path) -> None:
    """Each stage steps on its own gradients either way: the overlapped run's losses and weights
    are bit-equal to the flushing run's (the data-parallel all-reduce of two virtual workers included)."""
    if case == "zbv":
        vws: tuple[VirtualWorker, ...] = (VirtualWorker((Stage((0, 1), "n0:0"), Stage((1, 2), "n0:1"),
                                                         Stage((2, 3), "n0:1"), Stage((3, 4), "n0:0"))),)
        schedule, m, chunks = "zbv", 3, 2
    elif case == "zb-h2":
        vws, schedule, m, chunks = (worker([0, 1, 3, 4], ["n0:0", "n0:1", "n0:2"]),), "zb-h2", 5, 1
    else:
        vws = (worker([0, 2, 4], ["n0:0", "n0:1"]), worker([0, 1, 4], ["n0:2", "n0:3"]))
        schedule, m, chunks = "1f1b", 3, 1
    flushing = Plan("gpt2-tiny", vws, schedule=schedule, micro_batch_size=2, micro_batches=m, chunks=chunks,
                    pricing=CostOptions(optimizer_state_factor=0))
    overlapped = dataclasses.replace(flushing, pricing=CostOptions(optimizer_state_factor=0, overlap_iterations=True))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    m1, w1 = _trained(flushing, tmp_path / "a")
    m2, w2 = _trained(overlapped, tmp_path / "b")
    assert m1["loss"] == m2["loss"] and len(m1["loss"]) == 3  # type: ignore[arg-type]
    assert set(w1) == set(w2) and all(torch.equal(w1[k], w2[k]) for k in w1)
    assert len(m2["step_s"]) == 3 and all(s > 0 for s in m2["step_s"])  # type: ignore[union-attr]


def test_cli_plans_and_simulates_overlapping_iterations(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``plan --overlap-iterations`` records it in the plan's pricing; ``simulate`` then reports the
    period and the first iteration apart, faster than the same plan flushed (zb-h2, HetPipe node)."""
    from partitioner_cli.main import main

    out = tmp_path / "plan.json"
    args = ["examples/profiles/vgg19_hetpipe.json", "--cluster", "examples/clusters/hetpipe.yaml", "--devices",
            "n0:0,n0:1,n0:2,n0:3", "--micro-batches", "8", "--schedule", "zb-h2", "--no-recompute"]
    assert main(["plan", *args, "--overlap-iterations", "-o", str(out)]) == 0
    plan = Plan.load(out)
    assert plan.pricing is not None and plan.pricing.overlap_iterations and plan.overlaps_iterations
    capsys.readouterr()
    sim = ["simulate", str(out), "--profile", "examples/profiles/vgg19_hetpipe.json", "--cluster",
           "examples/clusters/hetpipe.yaml"]
    assert main(sim) == 0
    text = capsys.readouterr().out
    assert "iterations overlap: steady-state period" in text
    flushed = dataclasses.replace(plan, pricing=dataclasses.replace(plan.pricing, overlap_iterations=False))
    flushed.save(tmp_path / "flushed.json")
    assert main([*sim[:1], str(tmp_path / "flushed.json"), *sim[2:]]) == 0
    period = float(text.split("\niteration ")[1].split(" s")[0])
    flushed_s = float(capsys.readouterr().out.split("\niteration ")[1].split(" s")[0])
    assert period < flushed_s


def test_export_refuses_overlapping_iterations() -> None:
    from partitioner.export import TARGETS, ExportError, export_plan

    plan = Plan("gpt2-tiny", (worker([0, 2, 4], ["n0:0", "n0:1"]),), schedule="zb-h1", micro_batch_size=2,
                micro_batches=4, pricing=CostOptions(overlap_iterations=True))
    for target in TARGETS:
        with pytest.raises(ExportError, match=r"pricing\.overlap_iterations: .* ends every step with a flush"):
            export_plan(plan, target)
