"""Plan-independent checkpoints (runtime/checkpoint.py, runtime/named_state.py): a checkpoint
written by one plan loads, by layer name, into plans of other cuts, stage counts and worker
counts, weights, buffers and optimizer state bit for bit; a damaged shard is refused."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from torch import nn

from partitioner.errors import PartitionerError
from partitioner.plan import Plan, Stage, VirtualWorker
from runtime.checkpoint import (
    Manifest,
    latest_complete,
    load_state,
    restore,
    resume_step,
    save_checkpoint,
    verify,
)
from runtime.launch import spawn_local
from runtime.layout import plan_layout
from runtime.named_state import OPTIM, RNG, rank_state
from runtime.stage import build_stage


def chain() -> list[tuple[str, nn.Module]]:
    """Five layers, with a buffer-holding batch norm (float running stats, an int64 counter)."""
    return [("fc0", nn.Linear(4, 8)), ("act", nn.Tanh()), ("fc1", nn.Linear(8, 8)), ("bn", nn.BatchNorm1d(8)),
            ("fc2", nn.Linear(8, 3))]


def worker(cuts: list[int], devices: list[str]) -> VirtualWorker:
    return VirtualWorker(tuple(Stage((a, b), devices[k]) for k, (a, b) in enumerate(itertools.pairwise(cuts))))


A = Plan("toy", (worker([0, 2, 5], ["n0:0", "n0:1"]),), micro_batch_size=2, micro_batches=2)
B = Plan("toy", (worker([0, 4, 5], ["n0:0", "n0:1"]),), micro_batch_size=2, micro_batches=2)  # other cuts
C = Plan("toy", (worker([0, 1, 3, 5], ["n0:0", "n0:1", "n0:2"]),), micro_batch_size=2, micro_batches=2)  # 3 stages
D = Plan("toy", (worker([0, 2, 5], ["n0:0", "n0:1"]), worker([0, 3, 5], ["n0:2", "n0:3"])),  # 2 workers
         micro_batch_size=2, micro_batches=1)
E = Plan("toy", (worker([0, 5], ["n0:3"]),), micro_batch_size=2, micro_batches=2)  # one device


def rank_modules(plan: Plan, rank: int, seed: int) -> tuple[dict[int, nn.Module], torch.optim.Optimizer]:
    """Rank ``rank``'s layers of ``plan`` (by global index) and an Adam over their parameters."""
    layout = plan_layout(plan, 5, model="toy")
    me = layout.ranks[rank]
    by_layer: dict[int, nn.Module] = {}
    for s in me.stages:
        start, stop = layout.stage_layers[me.worker][s]
        by_layer.update({start + k: m for k, m in enumerate(build_stage(chain(), start, stop, seed=seed))})
    params = [p for m in by_layer.values() for p in m.parameters()]
    return by_layer, torch.optim.Adam(params, lr=0.01)


def _trained(plan: Plan, rank: int) -> tuple[dict[int, nn.Module], torch.optim.Optimizer]:
    """Rank ``rank``'s layers after two Adam steps on gradients that depend on the layer alone (so
    every rank holding a layer holds the same values), batch-norm statistics updated."""
    by_layer, opt = rank_modules(plan, rank, seed=1)
    for t in range(2):
        for layer, mod in by_layer.items():
            for p in mod.parameters():
                p.grad = torch.sin(p.detach() * (layer + 1) + t)
            if isinstance(mod, nn.BatchNorm1d):
                mod(torch.arange(16.0).reshape(2, 8) * (t + 1))
        opt.step()
    return by_layer, opt


def _save(rank: int, world: int, plan: Plan, root: str, step: int) -> None:
    by_layer, opt = _trained(plan, rank)
    devices = tuple(r.device for r in plan_layout(plan, 5, model="toy").ranks)
    save_checkpoint(root, Manifest(step, plan, "toy", 0, "auto", devices), rank, by_layer, opt)


def save(plan: Plan, root: Path, step: int = 3) -> None:
    spawn_local(_save, plan_layout(plan, 5).world_size, (plan, str(root), step), timeout_s=60, start_method="forkserver")


@pytest.mark.parametrize("writer", [A, D], ids=["saved-by-A", "saved-by-D"])
def test_a_checkpoint_loads_into_other_cuts_stage_counts_and_worker_counts_bit_for_bit(
        writer: Plan, tmp_path: Path) -> None:
    save(writer, tmp_path)
    saved = load_state(str(tmp_path), 3)
    assert not any(p.name.startswith(".partial") for p in tmp_path.iterdir())
    assert {k for k in saved if k.startswith(RNG)} == {f"{RNG}{r}" for r in range(plan_layout(writer, 5).world_size)}
    assert any(k.startswith(OPTIM) and k.endswith(".exp_avg_sq") for k in saved)
    assert saved["model.layers.3.num_batches_tracked"].dtype == torch.int64
    for plan in (A, B, C, D, E):
        seen: set[str] = set()
        for rank in range(plan_layout(plan, 5).world_size):
            by_layer, opt = rank_modules(plan, rank, seed=7)  # other initial weights, no optimizer state
            restore(str(tmp_path), 3, rank, by_layer, opt)
            mine = {k: v for k, v in rank_state(by_layer, opt).items()}
            for key, value in mine.items():
                assert value.dtype == saved[key].dtype and torch.equal(value, saved[key]), (plan, rank, key)
            seen |= set(mine)
            # the restored optimizer steps on as the writer's would have
            assert all(float(s["step"]) == 2.0 for s in opt.state.values())
        assert seen == {k for k in saved if not k.startswith(RNG)}, plan  # every layer's state found somewhere


def test_the_same_ranks_get_their_generator_back(tmp_path: Path) -> None:
    save(A, tmp_path)
    saved = load_state(str(tmp_path), 3)
    by_layer, opt = rank_modules(A, 1, seed=7)
    torch.manual_seed(12345)
    restore(str(tmp_path), 3, 1, by_layer, opt, same_ranks=True)
    assert torch.equal(torch.get_rng_state(), saved[f"{RNG}1"])


def test_a_missing_truncated_or_altered_shard_is_refused_in_one_line(tmp_path: Path) -> None:
    save(A, tmp_path)
    manifest = latest_complete(str(tmp_path))
    assert manifest is not None and manifest.step == 3 and set(manifest.files) == {".metadata", "__0_0.distcp",
                                                                                    "__1_0.distcp"}
    assert resume_step(str(tmp_path), B, "toy", 0, "auto") == 3  # whole: resumable on another plan
    shard = tmp_path / "step-00000003" / "__1_0.distcp"
    data = shard.read_bytes()

    def refused(expect: str) -> None:
        with pytest.raises(PartitionerError, match=expect) as err:
            resume_step(str(tmp_path), B, "toy", 0, "auto")
        assert len(str(err.value).splitlines()) == 1 and str(err.value).startswith(str(shard))
        assert "the checkpoint is damaged" in str(err.value)

    shard.write_bytes(data[: len(data) // 2])
    refused(rf"{len(data) // 2} bytes, the manifest says {len(data)} \(a truncated or damaged shard\)")
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    refused("its SHA-256 is not the manifest's")
    shard.unlink()
    refused("missing")
    # loading itself, without the check, refuses a shard it cannot read (one line), never a fresh start
    by_layer, opt = rank_modules(A, 1, seed=7)
    with pytest.raises(PartitionerError, match=r"step-00000003: cannot be read") as err:
        restore(str(tmp_path), 3, 1, by_layer, opt)
    assert len(str(err.value).splitlines()) == 1


def test_a_checkpoint_of_another_model_or_data_order_is_refused(tmp_path: Path) -> None:
    save(A, tmp_path)
    other_batch = Plan("toy", A.virtual_workers, micro_batch_size=2, micro_batches=4)
    with pytest.raises(PartitionerError, match=r"manifest.json: global_batch = 4 \(1 virtual worker\(s\) x 2 "
                                               r"micro-batches x 2\): this plan's is 8"):
        resume_step(str(tmp_path), other_batch, "toy", 0, "auto")
    with pytest.raises(PartitionerError, match=r"model = 'toy' \(5 layers\): this run trains 'gpt2-tiny'"):
        resume_step(str(tmp_path), A, "gpt2-tiny", 0, "auto")
    with pytest.raises(PartitionerError, match="data = auto, seed 0: this run's are auto, seed 1"):
        resume_step(str(tmp_path), A, "toy", 1, "auto")
    # a rank whose layer the checkpoint has not got in that shape
    wide = {0: nn.Linear(4, 9)}
    with pytest.raises(PartitionerError, match=r"model.layers.0.weight has shape \[8, 4\], layer 0's weight here "
                                               r"\[9, 4\]"):
        restore(str(tmp_path), 3, 0, wide, None)
    with pytest.raises(PartitionerError, match=r"holds no model.layers.7.weight"):
        restore(str(tmp_path), 3, 0, {7: nn.Linear(4, 8)}, None)
    verify(str(tmp_path), latest_complete(str(tmp_path)))  # type: ignore[arg-type]  # untouched by all this
