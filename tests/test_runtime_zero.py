"""ZeRO-1/2 at run time (runtime/zero.py): each layer's optimizer state sharded over its
data-parallel holders trains the weights the plain run trains."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from partitioner.errors import PartitionerError  # noqa: E402
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
    metrics = train_local(plan, cfg, start_method="fork")
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
    from runtime.run import check_checkpoints

    cfg = TrainConfig("gpt2-tiny", steps=2, checkpoint_dir="/tmp/nowhere-ckpt")
    with pytest.raises(PartitionerError, match="checkpoints with zero = 2"):
        check_checkpoints(_plan(2), cfg, 4)
