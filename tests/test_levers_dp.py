"""The chain DP with memory levers equals exhaustive enumeration over (split x per-stage recompute
mode) on tiny instances; a plan that fits only with recomputation is found, and refused with the
reason when recomputation is off."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from partitioner.cost import CostModel, CostOptions
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner.schedule import Schedule
from solvers import SolveStatus, solve
from solvers.pipeline.dp import best_prefix_dp

from .conftest import GIB, flat_cluster

MODES = ("none", "selective", "full")


def transformer(n_blocks: int, times: list[float], saved: list[float], params: list[float],
                outputs: list[float]) -> Profile:
    """A chain embed, block0.., head whose blocks selective recomputation applies to (its shape in meta)."""
    names = ["embed", *(f"block{i}" for i in range(n_blocks)), "head"]
    layers = tuple(LayerProfile(nm, 0.0, params[i], saved[i], outputs[i], {"A": LayerTime(times[i] / 3, 2 * times[i] / 3)})
                   for i, nm in enumerate(names))
    return Profile("toy-gpt", 1, layers, meta={"config": {"hidden": 64, "heads": 4, "seq_len": 128, "vocab": 100}})


@st.composite
def instances(draw):  # type: ignore[no-untyped-def]
    n_blocks = draw(st.integers(1, 4))
    n = n_blocks + 2
    floats = st.floats(0.05, 1.0)
    times = [draw(floats) for _ in range(n)]
    saved = [draw(floats) * GIB for _ in range(n)]
    params = [draw(st.floats(0.0, 0.05)) * GIB for _ in range(n)]
    outputs = [draw(st.floats(0.0, 0.3)) * GIB for _ in range(n)]
    prof = transformer(n_blocks, times, saved, params, outputs)
    p = draw(st.integers(1, min(3, n)))
    mem = [draw(st.floats(1.0, 8.0)) for _ in range(p)]
    cluster = flat_cluster([f"T{k}" for k in range(p)], memory_gb={f"T{k}": mem[k] for k in range(p)})
    schedule = draw(st.sampled_from(["1f1b", "gpipe"]))
    m = draw(st.integers(1, 4))
    policy = draw(st.sampled_from(["auto", "auto", "none", "selective", "full"]))
    opts = CostOptions(reserved_bytes=0.0, optimizer_state_factor=2.0, recompute=policy)
    return prof, cluster, opts, schedule, m


def _typed(prof: Profile, cluster):  # type: ignore[no-untyped-def]
    """Every device type timed as the profile's one type A."""
    layers = tuple(LayerProfile(x.name, x.flops, x.param_bytes, x.saved_bytes, x.output_bytes,
                                {t: x.times["A"] for t in cluster.device_types}) for x in prof.layers)
    return Profile(prof.model, prof.micro_batch_size, layers, meta=prof.meta)


def brute_force(cost: CostModel, devices, schedule: Schedule) -> float:  # type: ignore[no-untyped-def]
    """The least bottleneck over every split and every recompute mode of every stage the options allow."""
    n, p = cost.num_layers, len(devices)
    best = math.inf
    for inner in itertools.combinations(range(1, n), p - 1):
        cuts = (0, *inner, n)
        for modes in itertools.product(cost.options.recompute_modes, repeat=p):
            worst = 0.0
            for k in range(p):
                cm = cost.recomputing(modes[k])
                a, b = cuts[k], cuts[k + 1]
                in_flight = schedule.activations_in_flight(p - k)
                if cm.stage_memory_bytes(a, b, in_flight, schedule) > devices[k].memory_bytes:
                    worst = math.inf
                    break
                prev = devices[k - 1] if k else None
                nxt = devices[k + 1] if k + 1 < p else None
                worst = max(worst, cm.stage_time_s(a, b, devices[k], prev, nxt))
            best = min(best, worst)
    return best


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_dp_with_levers_equals_exhaustive_enumeration(inst) -> None:  # type: ignore[no-untyped-def]
    prof, cluster, opts, schedule, m = inst
    prof = _typed(prof, cluster)
    cost = CostModel(prof, cluster, opts)
    sched = Schedule.of(schedule, m)
    expected = brute_force(cost, cluster.devices, sched)
    result = solve(prof, cluster, schedule=schedule, micro_batches=m, options=opts)
    event("infeasible" if math.isinf(expected) else
          f"feasible, {opts.recompute}, recomputes: {any(s.recompute != 'none' for s in result.plan.virtual_workers[0].stages)}"
          if result.plan is not None else "no plan")
    if math.isinf(expected):
        assert result.status is SolveStatus.INFEASIBLE and result.reason
        return
    assert result.status is SolveStatus.OPTIMAL
    assert result.objective == pytest.approx(expected, rel=1e-12)
    plan = result.plan
    assert plan is not None
    cost.validate_plan(plan)  # every stage fits in its own mode
    assert max(cost.plan_stage_times_s(plan)) == pytest.approx(result.objective, rel=1e-12)
    for stage in plan.virtual_workers[0].stages:
        assert stage.recompute in opts.recompute_modes
    # allow_fewer: the best over every prefix of the devices, with levers too
    best_prefix = best_prefix_dp(cost, cluster.devices, sched)
    over_prefixes = min(brute_force(cost, cluster.devices[:q], sched) for q in range(1, len(cluster.devices) + 1))
    assert best_prefix is not None and best_prefix.bottleneck_s == pytest.approx(over_prefixes, rel=1e-12)


def _tight() -> tuple[Profile, object]:
    # four equal blocks of 1 GiB saved each, 8 micro-batches under 1f1b: the first of two stages keeps
    # two in flight; 3 GiB devices hold no split without recomputation
    prof = transformer(4, [1.0] * 6, [0.01 * GIB, GIB, GIB, GIB, GIB, 0.01 * GIB], [0.01 * GIB] * 6,
                       [0.1 * GIB] * 6)
    cluster = flat_cluster(["A", "A"], memory_gb={"A": 3.0})
    return prof, cluster


def test_a_plan_that_fits_only_with_recomputation_is_found_and_refused_without() -> None:
    prof, cluster = _tight()
    off = solve(prof, cluster, schedule="1f1b", micro_batches=8, options=CostOptions(reserved_bytes=0))
    assert off.status is SolveStatus.INFEASIBLE
    assert "it would fit with" in off.reason and "`recompute` auto (activation recomputation where memory binds" \
        in off.reason
    on = solve(prof, cluster, schedule="1f1b", micro_batches=8, options=CostOptions(reserved_bytes=0, recompute="auto"))
    assert on.status is SolveStatus.OPTIMAL and on.plan is not None
    modes = [s.recompute for s in on.plan.virtual_workers[0].stages]
    assert modes[0] != "none"  # the first stage keeps two micro-batches: it must recompute
    # no more than memory forces: the last stage (one in flight) keeps everything
    assert modes[-1] == "none"
    # uniform full recomputation fits as well, and is no faster than the per-stage choice
    full = solve(prof, cluster, schedule="1f1b", micro_batches=8, options=CostOptions(reserved_bytes=0, recompute="full"))
    assert full.status is SolveStatus.OPTIMAL
    assert on.objective <= full.objective
    assert on.plan.predicted["iteration_s"] < full.plan.predicted["iteration_s"]


def test_levers_change_nothing_where_memory_does_not_bind() -> None:
    prof = transformer(4, [1.0, 2.0, 1.0, 3.0, 1.0, 0.5], [0.1 * GIB] * 6, [0.01 * GIB] * 6, [0.01 * GIB] * 6)
    cluster = flat_cluster(["A", "A", "A"], memory_gb={"A": 80.0})
    plain = solve(prof, cluster, micro_batches=4, options=CostOptions())
    auto = solve(prof, cluster, micro_batches=4, options=CostOptions(recompute="auto"))
    assert plain.plan is not None and auto.plan is not None
    assert auto.objective == plain.objective
    assert auto.plan.virtual_workers == plain.plan.virtual_workers  # no stage recomputes


def test_explain_says_which_lever_each_stage_uses_and_what_it_costs() -> None:
    from solvers.analysis.explain import explain_plan, format_explanation

    prof, cluster = _tight()
    opts = CostOptions(reserved_bytes=0, recompute="auto")
    res = solve(prof, cluster, schedule="1f1b", micro_batches=8, options=opts)
    assert res.plan is not None
    e = explain_plan(res.plan, prof, cluster, what_if=False)
    stages = res.plan.virtual_workers[0].stages
    levered = [k for k, s in enumerate(stages) if s.recompute != "none"]
    assert [lv.stage for lv in e.levers] == levered
    cost = CostModel(prof, cluster, opts)
    for lv in e.levers:
        st = stages[lv.stage]
        f, _ = cost.fwd_bwd_s("A", st.start, st.stop)
        if lv.mode == "full":
            assert lv.extra_s == pytest.approx(f)
        assert 0 < lv.extra_s <= f * (1 + 1e-12) and lv.saved_bytes > 0
    text = format_explanation(e)
    assert "memory levers:" in text and f"recompute {e.levers[0].mode}" in text
    assert e.to_dict()["levers"]["recompute"][0]["recompute"] == e.levers[0].mode
