"""When no plan fits memory, the reason says which single change would make one fit, with numbers
that are checked: each lever it names, applied, gives a plan (and one step further does not)."""

from __future__ import annotations

import random
import re
from dataclasses import replace

import pytest

from partitioner.cost import CostOptions
from partitioner_cli.main import main
from solvers.pipeline.dp import solve
from solvers.result import SolveStatus
from tests.conftest import GIB, flat_cluster, make_profile


def _fits(profile, cluster, **kw) -> bool:  # type: ignore[no-untyped-def]
    return solve(profile, cluster, **kw).status is SolveStatus.OPTIMAL


def test_mixed_precision_is_named_with_the_memory_it_needs() -> None:
    # 2BW keeps two weight copies: 12 bytes per parameter in fp32 without optimizer state, 10 in fp16
    prof = make_profile({"A": [1.0, 1.0]}, param_bytes=[GIB, 0])
    cluster = flat_cluster(["A"], memory_gb={"A": 2.75})
    opts = CostOptions(reserved_bytes=0, optimizer_state_factor=0)
    result = solve(prof, cluster, schedule="2bw", options=opts)
    assert result.status is SolveStatus.INFEASIBLE
    assert result.reason.startswith("layer 0 (l0) alone needs 3.00 GiB")
    assert "it would fit with `precision` fp16 or bf16 (mixed precision) (layer 0 needs 2.50 GiB then)" \
        in result.reason
    assert _fits(prof, cluster, schedule="2bw", options=replace(opts, precision="bf16"))


def test_nothing_is_offered_when_no_single_change_fits() -> None:
    prof = make_profile({"A": [1.0, 1.0]}, param_bytes=[5 * GIB, 0])
    result = solve(prof, flat_cluster(["A", "A"], memory_gb={"A": 16}), options=CostOptions(reserved_bytes=0))
    assert result.reason.startswith("layer 0 (l0) alone needs 20.00 GiB")
    assert result.reason.endswith("no single change among mixed precision, a smaller micro-batch, fewer "
                                  "micro-batches, more pipeline stages, activation recomputation makes it fit")


@pytest.mark.parametrize("seed", range(24))
def test_every_lever_named_makes_it_fit_and_is_the_least_change(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(4, 12)
    b = rng.choice([4, 8, 32])
    prof = make_profile({"A": [1.0] * n}, param_bytes=[rng.uniform(0, 0.1) * GIB for _ in range(n)],
                        saved_bytes=[rng.uniform(0.02, 0.3) * GIB for _ in range(n)], micro_batch_size=b)
    p = rng.randint(1, 3)
    cluster = flat_cluster(["A"] * p, memory_gb={"A": rng.uniform(0.8, 3.0)})
    schedule = rng.choice(["gpipe", "1f1b"])
    m = rng.randint(2, 8)
    opts = CostOptions(reserved_bytes=0.25 * GIB)
    result = solve(prof, cluster, schedule=schedule, micro_batches=m, options=opts)
    if result.status is not SolveStatus.INFEASIBLE:
        return
    reason = result.reason
    if re.search(r"`schedule` 1f1b instead of gpipe", reason) is not None:
        assert _fits(prof, cluster, schedule="1f1b", micro_batches=m, options=opts), reason
    if (x := re.search(r"micro-batches of at most (\d+) samples instead of (\d+)", reason)) is not None:
        size = int(x.group(1))
        assert _fits(prof.rescaled(size), cluster, schedule=schedule, micro_batches=m, options=opts), reason
        assert not _fits(prof.rescaled(size + 1), cluster, schedule=schedule, micro_batches=m, options=opts)
    if (x := re.search(r"`micro_batches` (\d+) or fewer instead of", reason)) is not None:
        k = int(x.group(1))
        assert _fits(prof, cluster, schedule=schedule, micro_batches=k, options=opts), reason
        assert not _fits(prof, cluster, schedule=schedule, micro_batches=k + 1, options=opts), reason
    if "`recompute` auto" in reason:
        assert _fits(prof, cluster, schedule=schedule, micro_batches=m, options=replace(opts, recompute="auto"))
    if (x := re.search(r"more pipeline stages: (\d+) devices", reason)) is not None:
        k = int(x.group(1))
        more = flat_cluster(["A"] * k, memory_gb={"A": cluster.devices[0].memory_bytes / GIB})
        assert _fits(prof, more, schedule=schedule, micro_batches=m, options=opts), reason
        fewer = flat_cluster(["A"] * (k - 1), memory_gb={"A": cluster.devices[0].memory_bytes / GIB})
        assert k - 1 == p or not _fits(prof, fewer, schedule=schedule, micro_batches=m, options=opts), reason
    assert "it would fit with" in reason or "no single change" in reason


def test_the_command_names_the_levers_by_their_flags(capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "c.yaml").write_text("inter_node_GBps: 10\nnodes:\n  - {name: a, intra_node_GBps: 16, "
                                     "gpus: {V100-SXM2-16GB: 2}}\n")
    assert main(["plan", "examples/profiles/vgg16_v100.json", "--cluster", str(tmp_path / "c.yaml"),
                 "--schedule", "gpipe", "--micro-batches", "8", "--no-recompute"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "it would fit with --schedule 1f1b instead of gpipe" in err and "--micro-batches 2 or fewer" in err
    assert "--recompute auto (activation recomputation where memory binds: full on a:0, full on a:1)" in err
    assert "`" not in err
    # by default the planner recomputes where memory binds: the same request fits
    assert main(["plan", "examples/profiles/vgg16_v100.json", "--cluster", str(tmp_path / "c.yaml"),
                 "--schedule", "gpipe", "--micro-batches", "8", "-o", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "recompute" in out.splitlines()[4] and out.count(" full") >= 2
    from partitioner.plan import Plan

    saved = Plan.load(tmp_path / "p.json")
    assert [st.recompute for st in saved.virtual_workers[0].stages] == ["full", "full"]
    assert saved.pricing is not None and saved.pricing.recompute == "auto"
