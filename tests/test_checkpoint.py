"""Checkpoints and resume (runtime/checkpoint.py), and a dead rank under --local."""

from __future__ import annotations

import itertools
import json
import os
import shlex
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from partitioner.errors import PartitionerError
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner_cli import main as cli
from runtime.checkpoint import latest_complete, load_state, plan_sha256, step_dir
from runtime.launch import FAULT_ENV, TrainConfig, train_local
from runtime.layout import plan_layout

ROOT = Path(__file__).resolve().parent.parent
CPU_CLUSTER = ROOT / "examples" / "clusters" / "cpu4.yaml"


def worker(cuts: list[int], devices: list[str]) -> VirtualWorker:
    return VirtualWorker(tuple(Stage((a, b), devices[k % len(devices)])
                               for k, (a, b) in enumerate(itertools.pairwise(cuts))))


PLAN = Plan("gpt2-tiny", (worker([0, 2, 4], ["n0:0", "n0:1"]),), micro_batch_size=2, micro_batches=2)


def _weights(state_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r in (0, 1):
        for state in torch.load(state_dir / f"rank{r}.pt", weights_only=True).values():
            out.update(state)
    return out


def _cli_args(tmp_path: Path) -> list[str]:
    PLAN.save(tmp_path / "plan.json")
    layers = tuple(LayerProfile(f"l{i}", 1.0, 4.0, 4.0, 4.0, {"cpu": LayerTime(1e-3, 2e-3)}) for i in range(4))
    Profile("gpt2-tiny", 2, layers).save(tmp_path / "profile.json")
    return ["train", str(tmp_path / "plan.json"), "--profile", str(tmp_path / "profile.json"), "--cluster",
            str(CPU_CLUSTER), "--model", "gpt2-tiny", "--local", "--threads", "1", "--warmup", "0"]


@pytest.mark.slow  # test_elastic.py kills a rank and resumes by default; this one through --local and --resume
def test_killed_rank_is_one_line_and_resume_equals_an_uninterrupted_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.launch as launch

    real = launch.train_local
    monkeypatch.setattr(launch, "train_local", lambda plan, cfg, **kw: real(plan, cfg, start_method="forkserver", **kw))
    ckpt = tmp_path / "ckpt"
    # 5 steps, a checkpoint every 2; rank 1 dies as step 3 begins (after the checkpoint of step 2)
    monkeypatch.setenv(FAULT_ENV, "1:3")
    rc = cli.main([*_cli_args(tmp_path), "--steps", "5", "--lr", "0.3", "--checkpoint-dir", str(ckpt),
                   "--checkpoint-every", "2"])
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert rc != 0
    assert len(err.splitlines()) == 1, err
    assert "rank 1 (device n0:1) was killed by signal SIGKILL" in err
    manifest = latest_complete(str(ckpt))
    assert manifest is not None and manifest.step == 2 and plan_sha256(manifest.plan) == plan_sha256(PLAN)
    monkeypatch.delenv(FAULT_ENV)
    # the commands that continue without the lost device, printed on stdout, do: re-plan, then resume at step 2
    said = captured.out.splitlines()
    assert said[-3].startswith("device n0:1 is lost; to continue without it, re-plan and resume from the last")
    replan_cmd, train_cmd = shlex.split(said[-2]), shlex.split(said[-1])
    assert replan_cmd[:3] == ["partitioner", "replan", str(tmp_path / "plan.json")] and "--without" in replan_cmd
    assert cli.main(replan_cmd[1:]) == 0
    new_plan = Plan.load(replan_cmd[replan_cmd.index("-o") + 1])
    assert new_plan.devices == ("n0:0",) and new_plan.micro_batches * new_plan.micro_batch_size == 4
    capsys.readouterr()
    assert "--resume" in train_cmd and cli.main(train_cmd[1:]) == 0
    assert "resumed at step 2" in capsys.readouterr().out
    assert latest_complete(str(ckpt)).plan == new_plan  # type: ignore[union-attr]
    for step in (4, 5):  # what follows resumes the first plan from step 2 again
        shutil.rmtree(step_dir(str(ckpt), step))

    # a checkpoint begun and not completed (its ranks' files, no manifest, not renamed) is not resumed from
    partial = ckpt / ".partial-step-00000004"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"x")
    assert latest_complete(str(ckpt)).step == 2  # type: ignore[union-attr]

    resumed_dir, straight_dir = tmp_path / "resumed", tmp_path / "straight"
    resumed_dir.mkdir()
    straight_dir.mkdir()
    cfg = dict(steps=5, warmup=0, lr=0.3, threads=1, timeout_s=120)
    resumed = train_local(PLAN, TrainConfig("gpt2-tiny", **cfg, checkpoint_dir=str(ckpt), resume=True,  # type: ignore[arg-type]
                                            state_dir=str(resumed_dir)), start_method="forkserver")
    straight = train_local(PLAN, TrainConfig("gpt2-tiny", **cfg, state_dir=str(straight_dir)),  # type: ignore[arg-type]
                           start_method="forkserver")
    assert resumed["first_step"] == 2 and len(resumed["loss"]) == 3 and len(straight["loss"]) == 5
    assert resumed["loss"] == pytest.approx(straight["loss"][2:], rel=1e-5)
    a, b = _weights(resumed_dir), _weights(straight_dir)
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7, msg=k)
    # the end of the resumed run is a complete checkpoint too, every layer in it by name
    assert latest_complete(str(ckpt)).step == 5  # type: ignore[union-attr]
    assert {k.split(".")[2] for k in load_state(str(ckpt), 5) if k.startswith("model.")} == {"0", "1", "2", "3"}

    # a plan of another global batch is refused before any process starts (the data order would change)
    other = Plan("gpt2-tiny", PLAN.virtual_workers, micro_batch_size=2, micro_batches=4)
    with pytest.raises(PartitionerError, match=r"manifest.json: global_batch = 4 .*: this plan's is 8"):
        train_local(other, TrainConfig("gpt2-tiny", **{**cfg, "steps": 8}, checkpoint_dir=str(ckpt),  # type: ignore[arg-type]
                                       resume=True), start_method="forkserver")
    # and one that already reached --steps
    with pytest.raises(PartitionerError, match="the last complete checkpoint is of step 5, not before `steps` 5"):
        train_local(PLAN, TrainConfig("gpt2-tiny", **cfg, checkpoint_dir=str(ckpt), resume=True),  # type: ignore[arg-type]
                    start_method="forkserver")


# plans of the same global batch (4 samples) that split gpt2-tiny otherwise
OTHER_CUTS = Plan("gpt2-tiny", (worker([0, 1, 4], ["n0:1", "n0:0"]),), micro_batch_size=2, micro_batches=2)
THREE_STAGES = Plan("gpt2-tiny", (worker([0, 1, 3, 4], ["n0:0", "n0:1", "n0:2"]),), micro_batch_size=2,
                    micro_batches=2)
TWO_WORKERS = Plan("gpt2-tiny", (worker([0, 2, 4], ["n0:0", "n0:1"]), worker([0, 3, 4], ["n0:2", "n0:3"])),
                   micro_batch_size=2, micro_batches=1)
# another tensor-parallel degree: every stage sharded over a group of 2 ranks (a checkpoint of whole
# tensors loads as shards; bit for bit by name across degrees: tests/test_runtime_tensor_parallel.py)
TENSOR_PARALLEL = Plan("gpt2-tiny", (worker([0, 3, 4], ["n0:0-1", "n0:2-3"]),), micro_batch_size=2, micro_batches=2)


@pytest.mark.parametrize("new_plan", [OTHER_CUTS, THREE_STAGES, TWO_WORKERS, TENSOR_PARALLEL],
                         ids=["other-cuts", "three-stages", "two-workers", "tensor-parallel"])
def test_resume_on_another_plan_continues_the_run(new_plan: Plan, tmp_path: Path) -> None:
    cfg = dict(warmup=0, lr=0.3, threads=1, timeout_s=120, progress=False)
    ckpt = str(tmp_path / "ckpt")
    train_local(PLAN, TrainConfig("gpt2-tiny", steps=2, checkpoint_dir=ckpt, **cfg),  # type: ignore[arg-type]
                start_method="forkserver")
    saved = load_state(ckpt, 2)
    resumed = train_local(new_plan, TrainConfig("gpt2-tiny", steps=4, checkpoint_dir=ckpt, resume=True,  # type: ignore[arg-type]
                                                checkpoint_every=3, **cfg), start_method="forkserver")
    straight = train_local(PLAN, TrainConfig("gpt2-tiny", steps=4, **cfg), start_method="forkserver")  # type: ignore[arg-type]
    assert resumed["first_step"] == 2 and len(resumed["loss"]) == 2
    # the same data, the same weights: the losses go on as the run on the first plan did (up to the order of sums)
    assert resumed["loss"] == pytest.approx(straight["loss"][2:], rel=1e-5)
    assert resumed["world_size"] == plan_layout(new_plan, 4).world_size  # a tensor-parallel device: its group's ranks
    # the new plan's checkpoint holds every layer once, by the same names
    again = load_state(ckpt, 3)
    assert {k for k in again if k.startswith("model.")} == {k for k in saved if k.startswith("model.")}
    assert latest_complete(ckpt).plan == new_plan  # type: ignore[union-attr]


def test_checkpoint_hash_is_of_the_canonical_plan() -> None:
    # the plan hash is that of the canonical JSON: key order and spacing do not matter
    h = plan_sha256(PLAN)
    assert plan_sha256(Plan.from_dict(json.loads(json.dumps(PLAN.to_dict(), indent=3)))) == h


def test_checkpoint_options_are_checked() -> None:
    with pytest.raises(PartitionerError, match="need a checkpoint directory"):
        TrainConfig("gpt2-tiny", resume=True)
    with pytest.raises(PartitionerError, match="checkpoint_every = -1"):
        TrainConfig("gpt2-tiny", checkpoint_dir="d", checkpoint_every=-1)
    wsp = Plan("gpt2-tiny", PLAN.virtual_workers, schedule="wsp", micro_batch_size=2, micro_batches=2)
    with pytest.raises(PartitionerError, match="checkpoints need a flushing schedule"):
        train_local(wsp, TrainConfig("gpt2-tiny", checkpoint_dir="d"))


def _fails_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        raise PartitionerError("stage 1 cannot be built\nsecond line")
    # rank 0 stays up, off the network, until it is stopped: exiting at once would close its
    # connections while rank 1 may still be completing the group's mesh (rank 1 would then fail on
    # that instead of its own error), and a collective would fail on rank 1's exit first
    import time

    time.sleep(120)


def _exits_on_rank_0(rank: int, world: int) -> None:
    if rank == 0:
        os._exit(3)


def test_a_failing_or_exiting_rank_is_one_line() -> None:
    from runtime.launch import spawn_local

    with pytest.raises(PartitionerError) as err:
        spawn_local(_fails_on_rank_1, 2, timeout_s=60, start_method="forkserver", rank_names=["device a", "device b"])
    assert str(err.value) == "rank 1 (device b) failed: stage 1 cannot be built"
    with pytest.raises(PartitionerError, match=r"^rank 0 exited with code 3; the other processes were stopped$"):
        spawn_local(_exits_on_rank_0, 2, timeout_s=60, start_method="forkserver")


def test_each_torchrun_attempt_rendezvous_under_its_own_keys() -> None:
    import datetime

    import torch.distributed as dist

    from runtime.launch import _loopback_store, attempt_store

    timeout = datetime.timedelta(seconds=10)
    server = _loopback_store(10.0)  # stands for the torchrun agent's store, shared by every attempt
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port), "RANK": "1",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    first = attempt_store({**env, "TORCHELASTIC_RESTART_COUNT": "0"}, timeout)
    second = attempt_store({**env, "TORCHELASTIC_RESTART_COUNT": "1"}, timeout)
    first.set("rank_0", "address of the dead attempt")
    second.set("other", "x")
    assert second.check(["other"]) and not second.check(["rank_0"])  # the restart never reads the old address
    assert first.get("rank_0") == b"address of the dead attempt"
    assert isinstance(first, dist.PrefixStore)


@pytest.mark.slow
@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_torchrun_restarts_a_killed_rank_from_the_last_checkpoint(tmp_path: Path, rendezvous: str) -> None:
    import subprocess
    import sys

    from runtime.launch import free_port

    ckpt, out = tmp_path / "ckpt", tmp_path / "metrics.json"
    port = str(free_port())
    where = (["--master-port", port] if rendezvous == "static" else
             ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "restart-test"])
    # the same command line for the first attempt and the restart: --resume starts fresh without a checkpoint
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           *where, "-m", "partitioner_cli", *(a for a in _cli_args(tmp_path) if a != "--local"),
           "--steps", "5", "--lr", "0.3", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
           "--resume", "-o", str(out)]
    assert "--local" not in cmd
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, FAULT_ENV: "1:3"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "exitcode: -9" in proc.stderr  # rank 1 was killed once, then the group was restarted
    m = json.loads(out.read_text())
    assert m["first_step"] == 2 and len(m["loss"]) == 3  # lost the steps after the last checkpoint only
    assert m["torchrun_restarts"] == 1  # the attempt that finished is torchrun's first restart
    straight = train_local(PLAN, TrainConfig("gpt2-tiny", steps=5, warmup=0, lr=0.3, threads=1, timeout_s=120),
                           start_method="forkserver")
    assert m["loss"] == pytest.approx(straight["loss"][2:], rel=1e-5)
    assert latest_complete(str(ckpt)).step == 5  # type: ignore[union-attr]


# -- an unusable checkpoint directory, damaged checkpoints --------------------------------------


def test_unusable_checkpoint_dir_is_refused_before_any_step(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.launch import check_checkpoints

    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    with pytest.raises(PartitionerError, match=r"^`checkpoint_dir` .*notes\.txt: is a file, not a directory"):
        check_checkpoints(PLAN, TrainConfig("gpt2-tiny", checkpoint_dir=str(a_file)), 2)
    if os.path.isdir("/proc/self"):  # no directory can be made there, whoever asks
        with pytest.raises(PartitionerError, match=r"^`checkpoint_dir` /proc/partitioner-ckpt: checkpoints cannot "
                                                   r"be written there \(No such file or directory\)"):
            check_checkpoints(PLAN, TrainConfig("gpt2-tiny", checkpoint_dir="/proc/partitioner-ckpt"), 2)
    # from the command line: the plan file itself, refused in one line before any process starts
    import runtime.launch as launch

    monkeypatch.setattr(launch, "spawn_local", lambda *a, **k: pytest.fail("a process was started"))
    args = _cli_args(tmp_path)
    rc = cli.main([*args, "--checkpoint-dir", args[1]])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"--checkpoint-dir {args[1]}: is a file, not a directory" in err
    assert json.loads(Path(args[1]).read_text())["model"] == "gpt2-tiny"  # the plan is untouched


def _checkpoint(root: Path) -> None:
    """A complete checkpoint of PLAN at step 2."""
    train_local(PLAN, TrainConfig("gpt2-tiny", steps=2, warmup=0, threads=1, timeout_s=120, progress=False,
                                  checkpoint_dir=str(root)), start_method="forkserver")


@pytest.mark.parametrize(("damage", "expect"), [
    (lambda m: m.pop("files"), r"manifest\.json: files is missing: the checkpoint is damaged"),
    (lambda m: m.update(files="rank0.pt"), r"manifest\.json: files = 'rank0\.pt': must be of type dict"),
    (lambda m: m.update(files={}), r"manifest\.json: files = \{\}: must list the checkpoint's files"),
    (lambda m: m.update(step="two"), r"manifest\.json: step = 'two': must be of type int"),
    (lambda m: m.pop("step"), r"manifest\.json: step is missing"),
    (lambda m: m.update(step=7), r"manifest\.json: step = 7: must be 2, the step of its directory"),
])
def test_a_damaged_manifest_is_one_line_naming_it(damage: Any, expect: str, tmp_path: Path) -> None:
    from runtime.launch import check_checkpoints

    _checkpoint(tmp_path)
    path = step_dir(str(tmp_path), 2) + "/manifest.json"
    manifest = json.loads(Path(path).read_text())
    damage(manifest)
    Path(path).write_text(json.dumps(manifest))
    with pytest.raises(PartitionerError, match=expect) as err:  # the check before any process starts
        check_checkpoints(PLAN, TrainConfig("gpt2-tiny", steps=5, checkpoint_dir=str(tmp_path), resume=True), 2)
    assert str(err.value).startswith(path) and len(str(err.value).splitlines()) == 1
    assert "the checkpoint is damaged" in str(err.value)


def test_a_checkpoint_of_the_former_per_rank_format_is_refused(tmp_path: Path) -> None:
    from runtime.launch import check_checkpoints

    d = Path(step_dir(str(tmp_path), 2))
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({"format": "partitioner.checkpoint/1", "step": 2,
                                                 "files": ["rank0.pt", "rank1.pt"]}))
    with pytest.raises(PartitionerError, match=r"manifest\.json: format = 'partitioner\.checkpoint/1': must be "
                                               r"partitioner\.checkpoint/2 \(a checkpoint of an earlier version"):
        check_checkpoints(PLAN, TrainConfig("gpt2-tiny", steps=5, checkpoint_dir=str(tmp_path), resume=True), 2)


def test_a_damaged_shard_is_refused_before_any_process_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.launch as launch

    _checkpoint(tmp_path)
    shard = Path(step_dir(str(tmp_path), 2)) / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    monkeypatch.setattr(launch, "spawn_local", lambda *a, **k: pytest.fail("a process was started"))
    with pytest.raises(PartitionerError, match=r"__1_0\.distcp: 100 bytes, the manifest says \d+ \(a truncated"):
        train_local(PLAN, TrainConfig("gpt2-tiny", steps=5, checkpoint_dir=str(tmp_path), resume=True))
