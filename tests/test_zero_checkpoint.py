"""Checkpoints of ZeRO runs (runtime/zero_state.py): the pieces gathered into whole tensors by
name, so a ZeRO checkpoint resumes on the same plan, on a plan without ZeRO, on a ZeRO plan of
another holder count, and a plain checkpoint resumes on a ZeRO plan, as the run would have gone on."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from partitioner.errors import PartitionerError  # noqa: E402
from partitioner.plan import Plan, Stage, VirtualWorker  # noqa: E402
from partitioner.pricing import CostOptions  # noqa: E402
from runtime.checkpoint import load_state, step_dir  # noqa: E402
from runtime.launch import TrainConfig, train_local  # noqa: E402


def _plan(zero: int, precision: str, workers: int = 2) -> Plan:
    """``workers`` virtual workers (2 stages each; 1 stage each for 4 workers; 4 micro-batches for 1 worker) of the same global batch (8)."""
    pricing = CostOptions(zero=zero, precision=precision)
    if workers == 4:
        return Plan("gpt2-tiny", tuple(VirtualWorker((Stage((0, 4), f"n0:{w}"),)) for w in range(4)), "1f1b", 2, 1,
                    pricing=pricing)
    if workers == 1:  # one holder per layer: every layer stepped whole (its own fp32 masters under bf16)
        return Plan("gpt2-tiny", (VirtualWorker((Stage((0, 2), "n0:0"), Stage((2, 4), "n0:1"))),), "1f1b", 2, 4,
                    pricing=pricing)
    vws = tuple(VirtualWorker((Stage((0, 2), f"n0:{2 * w}"), Stage((2, 4), f"n0:{2 * w + 1}"))) for w in range(2))
    return Plan("gpt2-tiny", vws, "1f1b", 2, 2, pricing=pricing)


def _run(plan: Plan, ckpt: Path, steps: int, resume: bool) -> list[float]:
    cfg = TrainConfig("gpt2-tiny", steps=steps, warmup=0, lr=0.01, seed=1, threads=1, timeout_s=180, progress=False,
                      optimizer="adam", checkpoint_dir=str(ckpt), checkpoint_every=1, resume=resume)
    metrics = train_local(plan, cfg, start_method="forkserver")
    assert metrics["first_step"] == (2 if resume else 0)
    return list(metrics["loss"])


def _from_step_2(straight: Path, root: Path) -> Path:
    """A checkpoint directory holding a copy of the uninterrupted run's step 2 alone."""
    root.mkdir()
    shutil.copytree(step_dir(str(straight), 2), step_dir(str(root), 2))
    return root


def _equal_by_name(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    a = {k: v for k, v in a.items() if not k.startswith("rng.")}
    b = {k: v for k, v in b.items() if not k.startswith("rng.")}
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("zero,precision", [pytest.param(1, "fp32", marks=pytest.mark.slow), (2, "bf16"),
                                            pytest.param(2, "fp32", marks=pytest.mark.slow),
                                            pytest.param(1, "bf16", marks=pytest.mark.slow)])
def test_a_zero_checkpoint_resumes_on_any_plan_as_the_run_goes_on(zero: int, precision: str, tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    losses = _run(_plan(zero, precision), straight, 4, resume=False)  # a checkpoint after every step
    saved = load_state(str(straight), 2)
    # the checkpoint holds the whole optimizer state by name (Adam's moments of every parameter, fp32)
    moments = [k for k in saved if k.startswith("optim.") and k.endswith(".exp_avg")]
    assert moments and all(saved[k].dtype == torch.float32 for k in moments)
    assert all(saved[k.replace("optim.", "model.").removesuffix(".exp_avg")].shape == saved[k].shape for k in moments)

    # atomic and checked as any checkpoint: a truncated shard of it is refused before any process starts
    damaged = _from_step_2(straight, tmp_path / "damaged")
    shard = sorted(Path(step_dir(str(damaged), 2)).glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(PartitionerError, match=r"__\d_0.distcp: 100 bytes, the manifest says \d+ \(a truncated"):
        _run(_plan(zero, precision), damaged, 4, resume=True)

    # (a) the same plan
    same = _from_step_2(straight, tmp_path / "same")
    assert _run(_plan(zero, precision), same, 4, resume=True) == losses[2:]
    _equal_by_name(load_state(str(same), 4), load_state(str(straight), 4))

    # (b) a plan without ZeRO for one step, then its plain checkpoint into the ZeRO plan again
    plain = _from_step_2(straight, tmp_path / "plain")
    assert _run(_plan(0, precision), plain, 3, resume=True) == losses[2:3]
    _equal_by_name(load_state(str(plain), 3), load_state(str(straight), 3))
    shutil.rmtree(step_dir(str(plain), 2))
    again = train_local(_plan(zero, precision), TrainConfig(
        "gpt2-tiny", steps=4, warmup=0, lr=0.01, seed=1, threads=1, timeout_s=180, progress=False, optimizer="adam",
        checkpoint_dir=str(plain), resume=True), start_method="forkserver")
    assert again["first_step"] == 3 and again["loss"] == losses[3:]
    _equal_by_name(load_state(str(plain), 4), load_state(str(straight), 4))

    # (c) a ZeRO plan of 4 holders per layer (4 virtual workers of one stage) instead of 2
    wider = _from_step_2(straight, tmp_path / "wider")
    # (its first loss is of the loaded weights alone: bit for bit; its step sums the gradients of 4 workers of one
    # micro-batch, not of 2 of two, in another order: the state after it agrees to rounding)
    wide = _run(_plan(zero, precision, workers=4), wider, 4, resume=True)
    rtol = 1e-5 if precision == "fp32" else 1e-3  # bf16 gradients summed in another order round otherwise
    assert wide[0] == losses[2] and wide == pytest.approx(losses[2:], rel=rtol)
    a, b = load_state(str(wider), 3), load_state(str(straight), 3)
    assert {k for k in a if not k.startswith("rng.")} == {k for k in b if not k.startswith("rng.")}
    if precision == "fp32":  # (bf16's rounding of other sums, through Adam's division, is not small: the loss above)
        for k in b:
            if k.startswith("model."):
                torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=k)

    # (d) a ZeRO plan of one holder per layer (one virtual worker of 4 micro-batches): the same, stepped whole
    alone = _from_step_2(straight, tmp_path / "alone")
    one = _run(_plan(zero, precision, workers=1), alone, 4, resume=True)
    # (its loss averages 4 micro-batches in one worker, not 2 in each of 2: equal to rounding from the first)
    assert one[0] == pytest.approx(losses[2], rel=1e-6) and one == pytest.approx(losses[2:], rel=rtol)


def test_a_zero_checkpoint_keeps_each_holder_piece_of_the_state_it_loads(tmp_path: Path) -> None:
    """Loaded into a ZeRO plan, each holder keeps its piece only: the model state reported per rank is the
    sharded one, as before any checkpoint."""
    ckpt = tmp_path / "ckpt"
    plan = _plan(1, "fp32")
    _run(plan, ckpt, 2, resume=False)
    shutil.rmtree(step_dir(str(ckpt), 2))
    cfg = TrainConfig("gpt2-tiny", steps=2, warmup=0, lr=0.01, seed=1, threads=1, timeout_s=180, progress=False,
                      optimizer="adam", checkpoint_dir=str(ckpt), resume=True)
    fresh = train_local(plan, TrainConfig("gpt2-tiny", steps=1, warmup=0, lr=0.01, seed=1, threads=1, timeout_s=180,
                                          progress=False, optimizer="adam"), start_method="forkserver")
    resumed = train_local(plan, cfg, start_method="forkserver")
    assert resumed["first_step"] == 1
    for a, b in zip(fresh["ranks"], resumed["ranks"], strict=True):
        assert b["model_state_bytes"] == a["model_state_bytes"]


def test_a_zero_checkpoint_of_tensor_parallel_shards_resumes_bit_for_bit(tmp_path: Path) -> None:
    """The first stage on a tensor-parallel group of 2 (its parameters and their pieces are shards): the
    step-2 checkpoint of a ZeRO-1 run resumed under ZeRO-2 and without ZeRO gives step 3 bit for bit."""
    def plan(zero: int) -> Plan:
        return Plan("gpt2-tiny", tuple(VirtualWorker((Stage((0, 2), f"n{w}:0-1"), Stage((2, 4), f"n{w}:2")))
                                       for w in range(2)), "1f1b", 2, 2, pricing=CostOptions(zero=zero))

    straight = tmp_path / "straight"
    losses = _run(plan(1), straight, 3, resume=False)
    for zero in (2, 0):
        again = _from_step_2(straight, tmp_path / f"zero{zero}")
        assert _run(plan(zero), again, 3, resume=True) == losses[2:]
        _equal_by_name(load_state(str(again), 3), load_state(str(straight), 3))
