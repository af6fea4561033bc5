"""Across machines: two torchrun agents as two nodes on loopback train what `--local` trains."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from partitioner.errors import PartitionerError
from partitioner.plan import Plan
from partitioner_cli import main as cli
from runtime.launch import TrainConfig, free_port, train_local
from runtime.layout import plan_layout
from runtime.nodes import plan_nodes, seat

from .test_runtime import _cpu_profile, worker

ROOT = Path(__file__).resolve().parent.parent
TWO_NODES = "name: two-nodes\ninter_node_GBps: 1\nnodes:\n  - {name: n0, intra_node_GBps: 2, gpus: {cpu: 2}}\n" \
            "  - {name: n1, intra_node_GBps: 2, gpus: {cpu: 1}}\ndevice_types:\n" \
            "  cpu: {memory_GB: 8, fp32_tflops: 0.1, mem_GBps: 10}\n"
# stage 0 on the second node, stages 1-2 on the first: torchrun's RANK order (node after node)
# is not the plan's device order, so each process must find its own device
PLAN = Plan("gpt2-tiny", (worker([0, 1, 3, 4], ["n1:0", "n0:1", "n0:0"]),), micro_batch_size=2, micro_batches=3)


def test_each_torchrun_process_finds_its_plan_device() -> None:
    layout = plan_layout(PLAN, 4)
    assert plan_nodes(layout) == {"n1": [0], "n0": [2, 1]}  # by device index on each node
    assert seat(layout, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, "n0").device == "n0:0"
    s = seat(layout, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"})
    assert (s.rank, s.device, s.gpu_index) == (1, "n0:1", 1)
    with pytest.raises(PartitionerError, match="--nproc-per-node 2"):
        seat(layout, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3"}, "n0")
    with pytest.raises(PartitionerError, match="its nodes are n1, n0"):
        seat(layout, {}, "n7")


def test_two_torchrun_nodes_train_what_local_trains(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    PLAN.save(tmp_path / "plan.json")
    _cpu_profile("gpt2-tiny", 4).save(tmp_path / "profile.json")
    (tmp_path / "two.yaml").write_text(TWO_NODES)
    out = tmp_path / "metrics.json"
    args = [str(tmp_path / "plan.json"), "--profile", str(tmp_path / "profile.json"), "--cluster",
            str(tmp_path / "two.yaml"), "--model", "gpt2-tiny", "--steps", "3", "--warmup", "1", "--threads", "1",
            "--timeout", "120", "-o", str(out)]
    endpoint = f"127.0.0.1:{free_port()}"
    # the lines are printed in this process (a Python fewer to start); the agents run them
    assert cli.main(["train", *args, "--launch-lines", "--rdzv-endpoint", endpoint]) == 0
    printed = capsys.readouterr()
    lines = [ln for ln in printed.out.splitlines() if ln.startswith("torchrun ")]
    assert len(lines) == 2 and all("--nnodes 2" in ln for ln in lines)
    assert "--nproc-per-node 1" in lines[0] and "--plan-node n1" in lines[0]
    assert "--nproc-per-node 2" in lines[1] and "--plan-node n0" in lines[1]
    # what a user runs on each machine, with torchrun as this Python's module
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *shlex.split(ln)[1:]], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for ln in lines]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
    across = json.loads(out.read_text())
    local = train_local(PLAN, TrainConfig("gpt2-tiny", steps=3, warmup=1, threads=1), start_method="forkserver")
    assert across["world_size"] == 3
    assert [r["device"] for r in across["ranks"]] == ["n1:0", "n0:1", "n0:0"]
    assert across["loss"] == pytest.approx(local["loss"], rel=1e-6)
