"""``train --elastic`` (partitioner_cli/elastic.py): a killed rank re-planned around and the run
resumed on the new plan, to the steps asked for, its losses those of the new plan run from the
same checkpoint without a kill."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from partitioner.plan import Plan
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner_cli import main as cli
from partitioner_cli.elastic import Restart
from runtime.checkpoint import latest_complete, load_state, step_dir
from runtime.launch import FAULT_ENV, TrainConfig, train_local
from tests.test_checkpoint import CPU_CLUSTER, worker

# three stages on three devices: losing one leaves a pipeline of two
PLAN3 = Plan("gpt2-tiny", (worker([0, 1, 3, 4], ["n0:0", "n0:1", "n0:2"]),), micro_batch_size=2, micro_batches=2)


@pytest.fixture
def forked(monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.launch as launch

    real = launch.train_local
    monkeypatch.setattr(launch, "train_local", lambda plan, cfg, **kw: real(plan, cfg, start_method="forkserver", **kw))


def _args(tmp_path: Path, plan: Plan) -> list[str]:
    plan.save(tmp_path / "plan.json")
    layers = tuple(LayerProfile(f"l{i}", 1.0, 4.0, 4.0, 4.0, {"cpu": LayerTime(1e-3, 2e-3)}) for i in range(4))
    Profile("gpt2-tiny", 2, layers).save(tmp_path / "profile.json")
    return ["train", str(tmp_path / "plan.json"), "--profile", str(tmp_path / "profile.json"), "--cluster",
            str(CPU_CLUSTER), "--model", "gpt2-tiny", "--local", "--threads", "1", "--warmup", "0", "--lr", "0.3",
            "--steps", "5", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2"]


def test_a_killed_rank_is_replanned_around_and_the_run_finishes_as_the_new_plan_would(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, forked: None) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "metrics.json"
    monkeypatch.setenv(FAULT_ENV, "1:3")  # rank 1 (n0:1) dies as step 3 begins, after the checkpoint of step 2
    assert cli.main([*_args(tmp_path, PLAN3), "--elastic", "-o", str(out)]) == 0
    said = capsys.readouterr().out.splitlines()
    restarts = [ln for ln in said if ln.startswith("elastic restart")]
    assert len(restarts) == 1, said
    assert restarts[0].startswith("elastic restart 1 of at most 3: rank 1 (device n0:1) was killed by signal "
                                  "SIGKILL; the other processes were stopped; re-planned without n0:1 in ")
    assert restarts[0].endswith("; resuming at step 2")
    metrics = json.loads(out.read_text())
    new_file = tmp_path / "plan-without-n0_1.json"
    new = Plan.load(new_file)
    assert set(new.devices) == {"n0:0", "n0:2"}
    assert new.micro_batch_size * new.micro_batches * len(new.virtual_workers) == 4  # the global batch kept
    (restart,) = [Restart.from_dict(r) for r in metrics["restarts"]]
    assert (restart.attempt, restart.rank, restart.device, restart.resumed_at_step, restart.devices) == (1, 1, "n0:1", 2, 2)
    assert restart.plan_file == str(new_file) and Restart.from_dict(json.loads(json.dumps(restart.to_dict()))) == restart
    # the requested step count: steps 2, 3, 4 on the new plan; its last checkpoint is of step 5
    assert metrics["first_step"] == 2 and len(metrics["loss"]) == 3 and metrics["world_size"] == 2
    assert metrics["config"]["attempt"] == 1
    assert latest_complete(str(ckpt)).plan == new  # type: ignore[union-attr]

    # the reference: the new plan started from the same checkpoint (step 2, which the restart loaded), no kill
    monkeypatch.delenv(FAULT_ENV)
    _assert_the_new_plan_from_step_2_runs_the_same(new, ckpt, metrics["loss"], tmp_path / "reference")


def _assert_the_new_plan_from_step_2_runs_the_same(new: Plan, ckpt: Path, losses: list[float], ref: Path) -> None:
    """``new`` run without a kill from a copy of ``ckpt``'s step-2 checkpoint to step 5: the same
    losses and the same last checkpoint, by name, bit for bit."""
    ref.mkdir()
    shutil.copytree(step_dir(str(ckpt), 2), step_dir(str(ref), 2))
    reference = train_local(new, TrainConfig("gpt2-tiny", steps=5, warmup=0, lr=0.3, threads=1, timeout_s=120,
                                             checkpoint_dir=str(ref), resume=True, checkpoint_every=2),
                            start_method="forkserver")
    assert reference["first_step"] == 2 and losses == reference["loss"]  # to the bit
    ended, expected = load_state(str(ckpt), 5), load_state(str(ref), 5)
    assert set(ended) == set(expected)
    assert all(torch.equal(ended[k], expected[k]) for k in ended)


def test_a_second_loss_is_replanned_around_too(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch, forked: None) -> None:
    out = tmp_path / "metrics.json"
    # rank 1 dies as step 3 begins; on the new plan (2 devices), its rank 0 dies as step 3 begins again
    monkeypatch.setenv(FAULT_ENV, "1:3,0:3@1")
    assert cli.main([*_args(tmp_path, PLAN3), "--elastic", "-o", str(out)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("elastic restart")]
    assert [ln[:33] for ln in lines] == ["elastic restart 1 of at most 3: r", "elastic restart 2 of at most 3: r"]
    metrics = json.loads(out.read_text())
    first, second = (Restart.from_dict(r) for r in metrics["restarts"])
    assert (first.device, first.devices, second.attempt, second.rank, second.devices) == ("n0:1", 2, 2, 0, 1)
    assert second.device in ("n0:0", "n0:2") and second.resumed_at_step == 2
    last = Plan.load(second.plan_file)
    assert second.plan_file == str(tmp_path / f"plan-without-n0_1-without-{second.device.replace(':', '_')}.json")
    assert len(last.devices) == 1 and last.devices[0] not in ("n0:1", second.device)
    assert metrics["first_step"] == 2 and len(metrics["loss"]) == 3 and metrics["config"]["attempt"] == 2
    monkeypatch.delenv(FAULT_ENV)
    _assert_the_new_plan_from_step_2_runs_the_same(last, tmp_path / "ckpt", metrics["loss"], tmp_path / "reference")


def test_a_lost_gpu_of_a_tensor_parallel_group_leaves_its_other_gpu_to_plan_over(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, forked: None) -> None:
    out = tmp_path / "metrics.json"
    tp = Plan("gpt2-tiny", (worker([0, 3, 4], ["n0:0-1", "n0:2"]),), micro_batch_size=2, micro_batches=2)
    monkeypatch.setenv(FAULT_ENV, "1:3")  # rank 1: the second GPU (n0:1) of group n0:0-1
    assert cli.main([*_args(tmp_path, tp), "--elastic", "-o", str(out)]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("elastic restart")]
    assert line.startswith("elastic restart 1 of at most 3: rank 1 (device n0:0-1) was killed by signal SIGKILL")
    assert "re-planned without n0:1 in " in line and line.endswith("; resuming at step 2")
    metrics = json.loads(out.read_text())
    new = Plan.load(tmp_path / "plan-without-n0_1.json")
    assert set(new.devices) == {"n0:0", "n0:2"}  # the group's other GPU planned over again
    assert metrics["first_step"] == 2 and len(metrics["loss"]) == 3
    monkeypatch.delenv(FAULT_ENV)
    # the shards of the tensor-parallel checkpoint, loaded whole: the same run as the new plan from it
    _assert_the_new_plan_from_step_2_runs_the_same(new, tmp_path / "ckpt", metrics["loss"], tmp_path / "reference")


def test_restarts_are_bounded_and_an_elastic_run_needs_local_and_checkpoints(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, forked: None) -> None:
    args = _args(tmp_path, PLAN3)
    monkeypatch.setenv(FAULT_ENV, "2:1")
    assert cli.main([*args, "--elastic", "--max-restarts", "0"]) != 0
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and err.endswith(
        "rank 2 (device n0:2) was killed by signal SIGKILL; the other processes were stopped "
        "(not restarted: --max-restarts 0 reached)"), err
    assert "partitioner replan" in captured.out and "--without n0:2" in captured.out
    assert not (tmp_path / "plan-without-n0_2.json").exists()
    monkeypatch.delenv(FAULT_ENV)
    no_ckpt = [a for a in args if a not in ("--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2")]
    for argv, message in (([*no_ckpt, "--elastic"], "--elastic: needs --checkpoint-dir"),
                          ([a for a in args if a != "--local"] + ["--elastic"], "--elastic: only with --local"),
                          ([*args, "--max-restarts", "2"], "--max-restarts: only with --elastic")):
        assert cli.main(argv) != 0
        assert message in capsys.readouterr().err


# -- under torchrun: a lost process group is one line, with what continues the run ----------------


def test_a_failed_collective_is_told_from_a_bug() -> None:
    import torch.distributed as dist

    from partitioner.errors import PartitionerError
    from runtime.launch import lost_group

    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:46469: "
                        "Connection reset by peer. This is typically caused by a remote worker hanging")
    assert lost_group(gloo) and lost_group(dist.DistBackendError("NCCL communicator was aborted"))
    assert not lost_group(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"))
    assert not lost_group(PartitionerError("gloo: refused in one line"))
    assert not lost_group(ValueError("connection reset"))


def test_a_lost_group_names_the_devices_of_this_nodes_local_ranks() -> None:
    from runtime.launch import _group_lost_line, prepare

    plan = Plan("gpt2-tiny", (worker([0, 2, 4], ["n0:1", "n1:0"]), worker([0, 2, 4], ["n0:0", "n1:1"])),
                micro_batch_size=2, micro_batches=1)
    run = prepare(plan, TrainConfig("gpt2-tiny"))
    line = _group_lost_line(run, 0, RuntimeError("gloo: Connection closed by peer\nmore"))
    assert "\n" not in line
    assert line.startswith("rank 0 (device n0:1) lost its process group (RuntimeError: gloo: Connection closed by "
                           "peer more): another process of this job died or cannot be reached")
    # torchrun seats local rank k on the k-th device (by index) the plan uses on the node (runtime/nodes.py)
    assert line.endswith("; on node n0, torchrun's local_rank 0 is n0:0, 1 is n0:1")
    assert _group_lost_line(run, 1, RuntimeError("x")).endswith("on node n1, torchrun's local_rank 0 is n1:0, 1 is n1:1")


@pytest.mark.slow
def test_under_torchrun_a_killed_rank_ends_the_job_with_one_line_and_the_commands_to_go_on(tmp_path: Path) -> None:
    import os
    import shlex
    import subprocess
    import sys

    from runtime.launch import free_port
    from tests.test_checkpoint import ROOT

    args = [a for a in _args(tmp_path, PLAN3) if a != "--local"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--max-restarts", "0",
           "--master-port", str(free_port()), "-m", "partitioner_cli", *args, "--resume"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, FAULT_ENV: "1:3"})
    assert proc.returncode != 0 and "exitcode: -9" in proc.stderr
    ours = [ln for ln in proc.stderr.splitlines() if ln.startswith("partitioner train:")]
    assert ours and all(" lost its process group (" in ln for ln in ours), proc.stderr[-3000:]
    assert all(ln.endswith("on node n0, torchrun's local_rank 0 is n0:0, 1 is n0:1, 2 is n0:2") for ln in ours)
    said = proc.stdout.splitlines()
    k = next(i for i, ln in enumerate(said) if ln.startswith("a process of this job is lost: torchrun --max-restarts"))
    replan_cmd, train_cmd = shlex.split(said[k + 1]), shlex.split(said[k + 2])
    # the device torchrun's report names (local_rank 1 of node n0 is n0:1) in place of DEVICE, run as printed
    replan_cmd = [a.replace("DEVICE", "n0_1" if "without-" in a else "n0:1") for a in replan_cmd]
    train_cmd = [a.replace("DEVICE", "n0_1") for a in train_cmd]
    assert cli.main(replan_cmd[1:]) == 0
    assert set(Plan.load(tmp_path / "plan-without-n0_1.json").devices) == {"n0:0", "n0:2"}
    assert "--resume" in train_cmd and "--launch-lines" in train_cmd


def test_torchrun_continue_lines_name_the_plan_and_the_checkpoints(tmp_path: Path) -> None:
    import argparse

    from partitioner_cli.train import register, torchrun_continue_lines

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args([a for a in _args(tmp_path, PLAN3) if a != "--local"])
    head, replan_line, train_line = torchrun_continue_lines(args)
    assert f"with --resume, from the last complete checkpoint in {tmp_path / 'ckpt'}" in head
    assert replan_line.split()[:3] == ["partitioner", "replan", str(tmp_path / "plan.json")]
    assert "--without DEVICE -o " + str(tmp_path / "plan-without-DEVICE.json") in replan_line
    assert train_line.split()[:3] == ["partitioner", "train", str(tmp_path / "plan-without-DEVICE.json")]
    assert train_line.split()[-4:] == ["--resume", "--launch-lines", "--rdzv-endpoint", "HOST0:29500"]
