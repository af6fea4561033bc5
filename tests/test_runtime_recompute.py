"""Recomputation under every schedule the runtime runs (runtime/executor.py: a full stage's
forward recomputed inside its backward, the I of a split one; selective: the attention core),
and on a tensor-parallel group: losses and weights equal the same plan without it, and the
activation meter (runtime/memory.py) sees fewer bytes held."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from partitioner.plan import Plan, Stage, VirtualWorker  # noqa: E402
from runtime.launch import TrainConfig, train_local  # noqa: E402


def _plan(schedule: str, modes: tuple[str, ...]) -> Plan:
    if schedule == "zbv":  # 2 devices, 4 stages in a V
        devices, cuts, chunks = ("n0:0", "n0:1", "n0:1", "n0:0"), (0, 1, 2, 3, 4), 2
    elif schedule == "tp":  # the first stage on a tensor-parallel group of 2
        devices, cuts, chunks = ("n0:0-1", "n0:2"), (0, 2, 4), 1
    else:
        devices, cuts, chunks = ("n0:0", "n0:1"), (0, 2, 4), 1
    stages = tuple(Stage((cuts[k], cuts[k + 1]), d, recompute=modes[k % len(modes)]) for k, d in enumerate(devices))
    return Plan("gpt2-tiny", (VirtualWorker(stages),), "1f1b" if schedule == "tp" else schedule, 2, 3, chunks=chunks)


def _train(plan: Plan, root) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    root.mkdir()
    cfg = TrainConfig("gpt2-tiny", steps=3, warmup=1, lr=0.3, seed=1, threads=1, timeout_s=120,
                      state_dir=str(root), progress=False)
    metrics = train_local(plan, cfg, start_method="forkserver")
    out: dict[str, torch.Tensor] = {}
    for r in range(metrics["world_size"]):
        for state in torch.load(root / f"rank{r}.pt").values():
            out.update({f"{r}.{k}": v for k, v in state.items()})
    return metrics["loss"], out, metrics


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv", "2bw", "wsp", "tp"])
def test_recomputation_trains_what_the_plain_plan_trains(schedule: str, tmp_path) -> None:
    loss, plain, base = _train(_plan(schedule, ("none",)), tmp_path / "plain")
    for modes in (("full", "selective"), ("selective", "full")):
        got_loss, got, metrics = _train(_plan(schedule, modes), tmp_path / "-".join(modes))
        assert got_loss == pytest.approx(loss, rel=1e-6, abs=1e-7), modes
        assert set(got) == set(plain)
        worst = max(float((got[k] - plain[k]).abs().max()) for k in plain)
        assert worst <= 1e-6, (modes, worst)
        # the first stage (several micro-batches in flight) recomputed in full holds fewer activations
        for r, b in zip(metrics["ranks"], base["ranks"], strict=True):
            assert r["activation_peak_bytes"] > 0
            if 0 in r["stages"] and modes[0] == "full":
                assert r["activation_peak_bytes"] < b["activation_peak_bytes"], (schedule, modes, r["stages"])


@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b"])
def test_a_selective_core_is_recomputed_once_per_micro_batch(schedule: str, tmp_path) -> None:
    """Under a split backward the W reuses what the I recomputed: each attention core of a selective stage
    runs again once per micro-batch, as the cost model prices it, not once in I and again in W."""
    plan = _plan(schedule, ("selective",))
    _, _, metrics = _train(plan, tmp_path / "run")
    for r in metrics["ranks"]:  # gpt2-tiny: embedding, block, block, head; each stage one block (one core)
        assert r["core_recomputations"] == 3 * plan.micro_batches, (schedule, r["stages"])  # 3 steps
