"""Exports carry the plan's training (precision, optimizer, ZeRO stage 0) and a launch order that
keeps its stage -> GPU mapping; `partitioner export --check` refuses a launch order that breaks it."""

from __future__ import annotations

import dataclasses
import itertools
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from partitioner.errors import PartitionerError
from partitioner.export import ExportError, check_export_launch, export_plan
from partitioner.launch import check_launch, contiguity_problem, node_launches, seat
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.pricing import CostOptions
from partitioner_cli import main as cli

ROOT = Path(__file__).resolve().parent.parent


def worker(cuts: list[int], devices: list[str]) -> VirtualWorker:
    return VirtualWorker(tuple(Stage((a, b), devices[k % len(devices)])
                               for k, (a, b) in enumerate(itertools.pairwise(cuts))))


def plan_of(precision: str = "fp16", factor: float = 2.0, **kw: object) -> Plan:
    # 2 x A100 + 4 x T4 as in the issue: stage 0 on the T4s (node t0), stage 1 on the A100s (node a0),
    # two virtual workers; the T4 node holds ranks 0-1 of every target, so it starts first
    return Plan("gpt2-small", (worker([0, 4, 14], ["t0:2", "a0:0"]), worker([0, 4, 14], ["t0:0", "a0:1"])),
                micro_batch_size=2, micro_batches=4,
                pricing=CostOptions(precision=precision, optimizer_state_factor=factor), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_every_export_of_a_half_precision_plan_carries_the_precision(precision: str) -> None:
    plan = plan_of(precision)
    torch_e, ds, meg = (export_plan(plan, t) for t in ("torch-pipelining", "deepspeed", "megatron"))
    for e in (torch_e, ds, meg):
        assert e["training"]["precision"] == precision and e["training"]["optimizer"] == "adam"
        assert e["training"]["lr"] == 0.001 and e["training"]["zero_stage"] == 0
    other = "bf16" if precision == "fp16" else "fp16"
    assert ds["config"][precision]["enabled"] is True and other not in ds["config"]
    if precision == "fp16":  # dynamic loss scaling as torch.amp.GradScaler's
        assert ds["config"]["fp16"]["initial_scale_power"] == 16 and ds["config"]["fp16"]["loss_scale"] == 0
    else:  # bf16 gradients (2 bytes, as priced and as the runtime holds them), not DeepSpeed's and Megatron's fp32
        assert ds["config"]["data_types"] == {"grad_accum_dtype": "bf16"}
        assert all("--grad-reduce-in-bf16" in args for args in (meg["args"], meg["layout_args"], meg["uneven_args"]))
        fp32_grads = dataclasses.replace(plan, pricing=CostOptions(precision="bf16", allreduce_precision="fp32"))
        assert "data_types" not in export_plan(fp32_grads, "deepspeed")["config"]
        assert "--grad-reduce-in-bf16" not in export_plan(fp32_grads, "megatron")["args"]
    assert ds["config"]["optimizer"] == {"type": "Adam", "params": {
        "lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "torch_adam": True,
        "adam_w_mode": False}}
    assert ds["config"]["zero_optimization"] == {"stage": 0}
    for args in (meg["args"], meg["layout_args"], meg["uneven_args"]):
        assert f"--{precision}" in args and f"--{other}" not in args
        assert args[args.index("--optimizer") + 1] == "adam" and args[args.index("--weight-decay") + 1] == "0"
        assert args[args.index("--lr") + 1] == "0.001"
    assert f"--{precision}" in meg["snippet"] and f"'{precision}'" not in ds["snippet"].split("config=")[0]
    assert f"precision {precision}" in torch_e["snippet"]


def test_the_optimizer_follows_the_pricing_and_lr_is_written() -> None:
    sgd = plan_of("fp32", factor=0.0)
    ds, meg = export_plan(sgd, "deepspeed", lr=0.05), export_plan(sgd, "megatron", lr=0.05)
    assert ds["config"]["optimizer"] == {"type": "SGD", "params": {"lr": 0.05}} and "fp16" not in ds["config"]
    assert meg["args"][meg["args"].index("--optimizer"):] == ["--optimizer", "sgd", "--sgd-momentum", "0",
                                                                "--weight-decay", "0", "--lr", "0.05"]
    by_hand = Plan(sgd.model, sgd.virtual_workers, micro_batch_size=2, micro_batches=4)
    t = export_plan(by_hand, "torch-pipelining")["training"]
    assert (t["precision"], t["optimizer"], t["lr"]) == ("fp32", "sgd", 0.01) and "no pricing" in t["note"]


def test_launch_order_keeps_the_stage_to_gpu_mapping() -> None:
    plan = plan_of()
    for target in ("torch-pipelining", "deepspeed", "megatron"):
        e = export_plan(plan, target)
        launch = e["launch"]
        assert [n["node"] for n in launch["nodes"]] == ["t0", "a0"] and launch["master_node"] == "t0"
        devices = {r["rank"]: r["device"] for r in e["ranks"]}
        for k, (n, line) in enumerate(zip(launch["nodes"], launch["torchrun"], strict=True)):
            assert f"--node-rank {k} " in line and "--master-addr t0" in line
            assert line.startswith(f"CUDA_VISIBLE_DEVICES={n['cuda_visible_devices']} torchrun ")
            # local rank i runs on the i-th visible GPU: the plan's GPU of the node's i-th rank
            assert [int(g) for g in n["cuda_visible_devices"].split(",")] == [
                int(devices[r].split(":")[1]) for r in n["ranks"]]
        if target != "torch-pipelining":  # the framework's ranks: node after node
            assert [n["ranks"] for n in launch["nodes"]] == [[0, 1], [2, 3]]
    ds = export_plan(plan, "deepspeed")
    # pipe-major: rank = stage * 2 + worker; t0 holds stage 0 of worker 0 on GPU 2, of worker 1 on GPU 0:
    # DeepSpeed's launcher starts a host's slots in ascending order, so the torchrun lines start it
    assert ds["rank_order"] == "pipe-major" and ds["launch"]["nodes"][0]["cuda_visible_devices"] == "2,0"
    assert ds["launch"]["deepspeed"] is None and "ascending" in ds["launch"]["deepspeed_unavailable"]
    assert ds["launch"]["hostfile"] == "t0 slots=2\na0 slots=2\n"
    meg = export_plan(plan, "megatron")
    assert "--use-tp-pp-dp-mapping" not in meg["args"]


def test_a_worker_per_node_gets_data_major_ranks() -> None:
    # HetPipe's layout: each virtual worker inside one node. Pipe-major ranks would alternate between the
    # nodes; DeepSpeed gets a data-major ProcessTopology, Megatron-LM --use-tp-pp-dp-mapping
    plan = Plan("gpt2-small", (worker([0, 7, 14], ["n0:0", "n0:1"]), worker([0, 7, 14], ["n1:0", "n1:1"])),
                micro_batch_size=2, micro_batches=2, pricing=CostOptions())
    ds, meg = export_plan(plan, "deepspeed"), export_plan(plan, "megatron")
    assert ds["rank_order"] == meg["rank_order"] == "data-major"
    assert ds["topology"] == {"axes": ["data", "pipe"], "dims": [2, 2]}
    assert "topology=ProcessTopology(axes=['data', 'pipe'], dims=[2, 2])" in ds["snippet"]
    assert "--use-tp-pp-dp-mapping" in meg["args"]
    assert [r["device"] for r in ds["ranks"]] == ["n0:0", "n0:1", "n1:0", "n1:1"]
    assert ds["launch"]["deepspeed"] == ("deepspeed --hostfile hostfile --master_addr n0 TRAIN.py "
                                         "--deepspeed_config ds_config.json")


def test_a_plan_no_launcher_can_start_is_refused_in_one_line() -> None:
    # node n0 holds stages 0 and 2 of one pipeline: its ranks are never consecutive
    plan = Plan("gpt2-small", (worker([0, 4, 9, 14], ["n0:0", "n1:0", "n0:1"]),), micro_batch_size=2,
                micro_batches=3, pricing=CostOptions())
    for target in ("deepspeed", "megatron"):
        with pytest.raises(ExportError) as err:
            export_plan(plan, target)
        assert "no launch order holds the plan's stage -> GPU mapping" in str(err.value)
        assert "node n0 holds ranks [0, 2]" in str(err.value) and "\n" not in str(err.value)
    # torch's script seats itself from its node and local rank: any rank order starts
    e = export_plan(plan, "torch-pipelining")
    assert [n["ranks"] for n in e["launch"]["nodes"]] == [[0, 2], [1]]
    nodes = node_launches([r["device"] for r in e["ranks"]])
    assert contiguity_problem(nodes) is not None
    assert seat(nodes, {"GROUP_RANK": "0", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == (2, 1)
    assert seat(nodes, {"GROUP_RANK": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}) == (1, 0)


@pytest.mark.parametrize(("given", "ok"), [
    ("t0 slots=2\na0 slots=2\n", "nodes started in the order t0, a0"),
    ("t0,a0", "nodes started in the order t0, a0"),
    ("t0:2,t0:0,a0:0,a0:1", "the 4 ranks run on the plan's devices"),
])
def test_check_accepts_the_plans_launch_order(given: str, ok: str) -> None:
    assert ok in check_export_launch(export_plan(plan_of(), "megatron"), given)


@pytest.mark.parametrize(("given", "refusal"), [
    ("a0 slots=2\nt0 slots=2\n", "launch order starts a0 as node 0, where the plan runs rank 0 on t0:2; start the "
                                 "nodes in the order t0, a0"),
    ("a0,t0", "launch order starts a0 as node 0"),
    ("t0 slots=4\na0 slots=2\n", "launch order gives t0 4 slot(s); the plan runs 2 rank(s) there (t0:2, t0:0)"),
    ("t0:0,t0:2,a0:0,a0:1", "launch order puts rank 0 on t0:0; the plan runs it on t0:2"),
    ("t0,t1", "launch order names t1, which the plan does not use"),
    ("t0", "launch order leaves out node a0"),
])
def test_check_refuses_a_launch_order_that_breaks_the_mapping(given: str, refusal: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    e = export_plan(plan_of(), "deepspeed")
    with pytest.raises(PartitionerError, match=refusal.replace("(", r"\(").replace(")", r"\)")):
        check_export_launch(e, given)
    # the command: the hostfile or list as given, one line, exit 2
    plan_of().save(tmp_path / "plan.json")
    arg = given
    if "slots" in given:
        (tmp_path / "hostfile").write_text(given)
        arg = str(tmp_path / "hostfile")
    assert cli.main(["export", str(tmp_path / "plan.json"), "--to", "deepspeed", "--check", arg]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and refusal.split(";")[0] in err


def test_cli_prints_the_launch_and_writes_the_hostfile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_of().save(tmp_path / "plan.json")
    out, hosts = tmp_path / "ds.json", tmp_path / "hostfile"
    assert cli.main(["export", str(tmp_path / "plan.json"), "--to", "deepspeed", "-o", str(out),
                     "--hostfile", str(hosts)]) == 0
    text = capsys.readouterr().out
    assert "training: fp16, adam (lr 0.001), ZeRO stage 0  (as the plan was priced)" in text
    assert "launch, ranks pipe-major: start the nodes in the order t0, a0" in text
    assert "CUDA_VISIBLE_DEVICES=2,0 torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --master-addr t0" in text
    assert hosts.read_text() == "t0 slots=2\na0 slots=2\n"
    assert cli.main(["export", str(tmp_path / "plan.json"), "--to", "deepspeed", "--check", str(hosts)]) == 0
    assert capsys.readouterr().out.startswith("ok: nodes started in the order t0, a0")
    assert json.loads(out.read_text())["config"]["fp16"]["enabled"] is True


def test_launch_lines_of_the_runtime_and_the_exports_are_one_logic() -> None:
    # the runtime's seats (by GPU index on each node) and the exports' (by rank) group the same nodes
    devices = ["n1:0", "n0:1", "n0:0"]
    by_index, by_rank = node_launches(devices, "index"), node_launches(devices, "rank")
    assert [(n.node, n.ranks, n.gpus) for n in by_index] == [("n1", (0,), (0,)), ("n0", (2, 1), (0, 1))]
    assert [(n.node, n.ranks, n.gpus) for n in by_rank] == [("n1", (0,), (0,)), ("n0", (1, 2), (1, 0))]
    assert "ok" in check_launch(by_rank, devices, "n1,n0")


@pytest.mark.slow  # torchrun, four ranks; the launch order itself is checked above without processes
def test_the_torch_export_trains_under_its_own_launch_lines(tmp_path: Path) -> None:
    # two "nodes" on loopback started with the export's own torchrun lines (static rendezvous,
    # --node-rank), a plan whose ranks alternate between the nodes: each process seats itself
    plan = Plan("gpt2-tiny", (worker([0, 2, 4], ["n1:0", "n0:0"]), worker([0, 2, 4], ["n0:1", "n1:1"])),
                micro_batch_size=2, micro_batches=2, pricing=CostOptions(precision="bf16"))
    e = export_plan(plan, "torch-pipelining")
    (tmp_path / "e.json").write_text(json.dumps(e))
    from runtime.launch import free_port

    port = str(free_port())
    procs = []
    for line in e["launch"]["torchrun"]:
        words = shlex.split(line)[1:]  # without CUDA_VISIBLE_DEVICES (gloo on the CPU)
        words[words.index("--master-addr") + 1] = "127.0.0.1"
        words[words.index("--master-port") + 1] = port
        words = [str(tmp_path / "e.json") if w == "EXPORT.json" else w for w in words]
        words[words.index("examples/torch_pipelining_train.py")] = str(ROOT / "examples" / "torch_pipelining_train.py")
        env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
        procs.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *words[1:], "--steps", "3"],
                                      cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        outs.append(out)
    text = "".join(outs)
    assert "gpt2-tiny: adam (lr 0.001) in bf16, data text" in text
    # the last stages (ranks 1 and 3) print the cross-entropy of the text task, falling
    losses = [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if "step 2: loss" in ln]
    assert len(losses) == 2 and all(4.0 < x < 6.3 for x in losses)
