"""ZeRO-1/2 at run time (runtime/zero.py): each layer's optimizer state sharded over its
data-parallel holders trains the weights the plain run trains."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from partitioner.placement import supports  # noqa: E402
from partitioner.plan import Plan, Stage, VirtualWorker  # noqa: E402
from partitioner.pricing import CostOptions  # noqa: E402
from runtime.launch import TrainConfig, train_local  # noqa: E402


def _plan(zero: int, cuts: tuple[int, int] = (2, 2), schedule: str = "1f1b") -> Plan:
    """Two virtual workers of two stages each (the second cuts gpt2-tiny elsewhere when asked)."""
    workers = tuple(VirtualWorker((Stage((0, c), f"n0:{2 * w}"), Stage((c, 4), f"n0:{2 * w + 1}")))
                    for w, c in enumerate(cuts))
    return Plan("gpt2-tiny", workers, schedule, 2, 2, pricing=CostOptions(zero=zero))


def _train(plan: Plan, root, optimizer: str = "adam") -> tuple[list[float], dict[str, torch.Tensor], dict]:
    root.mkdir()
    cfg = TrainConfig("gpt2-tiny", steps=3, warmup=1, lr=0.01, seed=1, threads=1, timeout_s=120,
                      state_dir=str(root), progress=False, optimizer=optimizer)
    metrics = train_local(plan, cfg, start_method="forkserver")
    out: dict[str, torch.Tensor] = {}
    for r in range(metrics["world_size"]):
        for state in torch.load(root / f"rank{r}.pt").values():
            out.update({f"{r}.{k}": v for k, v in state.items()})
    return metrics["loss"], out, metrics


@pytest.mark.parametrize("cuts", [(2, 2), (1, 3)])
def test_zero_trains_the_weights_of_the_plain_run(tmp_path, cuts) -> None:
    """Adam, 2 virtual workers x 2 stages on gloo: ZeRO-1 and ZeRO-2 end with the plain run's
    weights (the workers cut the chain alike, or differently: holder sets of other shapes)."""
    loss, plain, first = _train(_plan(0, cuts), tmp_path / "plain")
    assert first["zero"] == 0
    for zero in (1, 2):
        got_loss, got, metrics = _train(_plan(zero, cuts), tmp_path / f"zero{zero}")
        assert got_loss == pytest.approx(loss, rel=1e-6, abs=1e-7)
        assert set(got) == set(plain)
        worst = max(float((got[k] - plain[k]).abs().max()) for k in plain)
        assert worst < 1e-6, (zero, worst)
        assert metrics["zero"] == zero


def test_zero_shares_the_optimizer_state_between_the_holders(tmp_path) -> None:
    """Each rank holds about half its layers' Adam state under ZeRO (two holders per layer)."""
    _, _, plain = _train(_plan(0), tmp_path / "plain")
    _, _, sharded = _train(_plan(1), tmp_path / "zero")
    for a, b in zip(plain["ranks"], sharded["ranks"], strict=True):
        params = a["model_state_bytes"] / 4  # 2 x params + 2 x params of Adam state
        assert b["model_state_bytes"] == pytest.approx(3 * params, rel=1e-3)


def test_what_zero_does_not_run_is_refused_in_one_line() -> None:
    assert supports(_plan(1), "runtime") is None
    assert supports(_plan(2, schedule="zb-h1"), "runtime") is None
    why = supports(dataclasses.replace(_plan(1), schedule="2bw"), "runtime") or ""
    assert "zero = 1 with schedule '2bw'" in why and "\n" not in why


def test_train_reports_the_sharded_model_state_the_cost_model_prices(tmp_path, monkeypatch, capsys) -> None:
    """`train` on a ZeRO-1 plan: each rank's model state (its half of the Adam state) equals the
    cost model's for its layers with their optimizer state divided by their two holders."""
    import json
    from pathlib import Path

    import runtime.launch as launch
    from partitioner.profile import LayerProfile, LayerTime, Profile
    from partitioner_cli.main import main
    from runtime.stage import build_stage, zoo_chain

    real = launch.train_local
    monkeypatch.setattr(launch, "train_local", lambda plan, cfg, **kw: real(plan, cfg, start_method="forkserver", **kw))
    chain = zoo_chain("gpt2-tiny", 2)
    layers = tuple(LayerProfile(name, 1.0, float(sum(p.numel() * 4 for p in build_stage(chain, i, i + 1).parameters())),
                                4096.0, 4096.0, {"cpu": LayerTime(1e-3, 2e-3)})
                   for i, (name, _) in enumerate(chain.layers))
    Profile("gpt2-tiny", 2, layers).save(tmp_path / "profile.json")
    _plan(1).save(tmp_path / "plan.json")
    cluster = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "cpu4.yaml"
    out = tmp_path / "m.json"
    assert main(["train", str(tmp_path / "plan.json"), "--profile", str(tmp_path / "profile.json"), "--cluster",
                 str(cluster), "--model", "gpt2-tiny", "--local", "--steps", "2", "--warmup", "0", "--threads", "1",
                 "-o", str(out)]) == 0
    m = json.loads(out.read_text())
    assert m["zero"] == 1 and m["memory"]["priced_as"]["zero"] == 1
    for r in m["memory"]["ranks"]:
        assert r["model_state_bytes"] == pytest.approx(r["predicted_model_state_bytes"], rel=1e-3)


@pytest.mark.slow
def test_zero_on_tensor_parallel_groups_trains_the_plain_weights(tmp_path) -> None:
    """Two virtual workers whose first stage is a tensor-parallel group of 2 (6 ranks): each shard's
    state is divided between the two holders of that shard; the weights equal the plain run's."""

    def plan(zero: int) -> Plan:
        return Plan("gpt2-tiny", tuple(VirtualWorker((Stage((0, 2), f"n{w}:0-1"), Stage((2, 4), f"n{w}:2")))
                                       for w in range(2)), "1f1b", 2, 2, pricing=CostOptions(zero=zero))

    loss, plain, base = _train(plan(0), tmp_path / "plain")
    for zero in (1, 2):
        got_loss, got, metrics = _train(plan(zero), tmp_path / f"zero{zero}")
        assert got_loss == pytest.approx(loss, rel=1e-6, abs=1e-7)
        assert max(float((got[k] - plain[k]).abs().max()) for k in plain) < 1e-6
        for a, b in zip(base["ranks"], metrics["ranks"], strict=True):  # Adam's 8 of 16 bytes halved
            assert b["model_state_bytes"] == pytest.approx(0.75 * a["model_state_bytes"], rel=1e-3)


def test_zero_under_fp16_loss_scaling_trains_the_plain_weights(tmp_path) -> None:
    """fp16 (autocast, the loss scaled, a step skipped on every rank alike): the sharded step
    unscales and checks its shards' gradients and gives the plain run's weights."""
    def plan(zero: int) -> Plan:
        return dataclasses.replace(_plan(zero), pricing=CostOptions(zero=zero, precision="fp16"))

    loss, plain, _ = _train(plan(0), tmp_path / "plain")
    got_loss, got, _ = _train(plan(2), tmp_path / "zero2")
    assert got_loss == pytest.approx(loss, rel=1e-6, abs=1e-7)
    assert max(float((got[k] - plain[k]).abs().max()) for k in plain) < 1e-6
