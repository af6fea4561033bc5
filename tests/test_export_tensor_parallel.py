"""Tensor parallelism in the exports: torch.distributed.pipelining runs a plan's tensor-parallel
groups as the project's runtime does (DTensor sub-meshes, the runtime's sharding, one pipeline
group per tensor-parallel index; numerics equal one process on gloo ranks); Megatron-LM gets
``--tensor-model-parallel-size`` and its rank order with the index fastest; DeepSpeed and mixed
degrees are refused in one line; a launch order that moves a group's rank is refused."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from partitioner.errors import PartitionerError
from partitioner.export import ExportError, check_export_launch, export_plan
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.pricing import CostOptions
from runtime.layout import plan_layout
from tests.test_runtime import reference_weights


def pipeline(*stages: tuple[int, int, str]) -> VirtualWorker:
    return VirtualWorker(tuple(Stage((a, b), d) for a, b, d in stages))


TP2_PP2 = Plan("gpt2-tiny", (pipeline((0, 2, "n0:0-1"), (2, 4, "n0:2-3")),), "1f1b", 2, 3)
# two virtual workers cut differently, each a pipeline of two groups of two
TP2_PP2_DP2 = Plan("gpt2-tiny", (pipeline((0, 2, "n0:0-1"), (2, 4, "n0:2-3")),
                                 pipeline((0, 1, "n1:0-1"), (1, 4, "n1:2-3"))), "gpipe", 2, 2)
MIXED = Plan("gpt2-tiny", (pipeline((0, 2, "n0:0-1"), (2, 4, "n0:2")),), "1f1b", 2, 2)


# -- the export's ranks and groups (no processes) ------------------------------------------------


def test_the_torch_export_numbers_ranks_as_the_runtime_and_groups_them_per_index() -> None:
    e = export_plan(TP2_PP2_DP2, "torch-pipelining")
    layout = plan_layout(TP2_PP2_DP2, 4)
    assert e["tensor_parallel"] == 2 and e["world_size"] == layout.world_size == 8
    assert [(r["rank"], r["gpu"], r["device"], r["virtual_worker"], r["pipe_rank"], r["tp_rank"], r["tp_size"])
            for r in e["ranks"]] == [(r.rank, r.gpu, r.device, r.worker, r.pipe_rank, r.tp_rank, r.tp_size)
                                     for r in layout.ranks]
    assert [p["pipe_groups"] for p in e["pipelines"]] == [[[0, 2], [1, 3]], [[4, 6], [5, 7]]]
    assert [p["tp_groups"] for p in e["pipelines"]] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert [s["ranks"] for s in e["pipelines"][1]["stages"]] == [[4, 5], [6, 7]]
    # a shard's gradients are averaged over the holders of the same shard, as the runtime averages them
    assert [(tuple(h["ranks"]), tuple(h["layers"])) for h in e["grad_sync"]] == layout.holder_sets()
    # the launch puts every rank on its own GPU of its group, a node's ranks in order
    assert [(n["node"], n["ranks"], n["cuda_visible_devices"]) for n in e["launch"]["nodes"]] == [
        ("n0", [0, 1, 2, 3], "0,1,2,3"), ("n1", [4, 5, 6, 7], "0,1,2,3")]
    assert "parallelize_module" in e["snippet"]


def test_a_launch_order_that_moves_a_groups_rank_is_refused() -> None:
    plan = Plan("gpt2-tiny", (pipeline((0, 2, "t0:2-3"), (2, 4, "a0:0-1")),), "1f1b", 2, 2, pricing=CostOptions())
    for target in ("torch-pipelining", "megatron"):
        e = export_plan(plan, target)
        assert [r["gpu"] for r in sorted(e["ranks"], key=lambda r: r["rank"])] == ["t0:2", "t0:3", "a0:0", "a0:1"]
        assert [n["cuda_visible_devices"] for n in e["launch"]["nodes"]] == ["2,3", "0,1"]
        assert check_export_launch(e, "t0:2,t0:3,a0:0,a0:1").startswith("ok: the 4 ranks run on the plan's devices")
        assert check_export_launch(e, "t0,a0").startswith("ok: nodes started in the order t0, a0")
        with pytest.raises(PartitionerError) as err:
            check_export_launch(e, "t0:3,t0:2,a0:0,a0:1")
        assert str(err.value) == ("launch order puts rank 0 (tensor-parallel index 0 of t0:2-3) on t0:3; the plan "
                                  "runs it on t0:2")
        with pytest.raises(PartitionerError, match="launch order starts a0 as node 0, where the plan runs rank 0 on "
                                                   "t0:2; start the nodes in the order t0, a0"):
            check_export_launch(e, "a0,t0")


def test_the_cli_exports_a_tensor_parallel_plan_and_checks_its_launch_order(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from partitioner_cli import main as cli

    path, out = tmp_path / "plan.json", tmp_path / "torch.json"
    TP2_PP2.save(path)
    assert cli.main(["export", str(path), "--to", "torch-pipelining", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "4 ranks, Schedule1F1B, n_microbatches 3, 1 stage(s) per rank, tensor parallel 2" in text
    assert "stage 0 layers [0, 2) on ranks 0-1 (n0:0-1), stage 1 layers [2, 4) on ranks 2-3 (n0:2-3)" in text
    assert json.loads(out.read_text())["pipelines"][0]["pipe_groups"] == [[0, 2], [1, 3]]
    assert cli.main(["export", str(path), "--to", "megatron", "--check", "n0:1,n0:0,n0:2,n0:3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.endswith(
        "launch order puts rank 0 (tensor-parallel index 0 of n0:0-1) on n0:1; the plan runs it on n0:0")
    assert cli.main(["export", str(path), "--to", "deepspeed", "-o", str(tmp_path / "ds.json")]) == 2
    assert "deepspeed cannot run this plan: its stages run on tensor-parallel groups" in capsys.readouterr().err
    assert not (tmp_path / "ds.json").exists()


# -- refused, in one line -------------------------------------------------------------------------


def test_mixed_degrees_are_refused_naming_the_stages() -> None:
    with pytest.raises(ExportError) as err:
        export_plan(MIXED, "megatron")
    assert str(err.value) == (
        "megatron cannot run this plan: its stages have tensor-parallel degrees 2 (virtual_workers[0].stages[0] on "
        "n0:0-1) and 1 (virtual_workers[0].stages[1] on n0:2); Megatron-LM has one --tensor-model-parallel-size for "
        "the whole job; re-plan with one degree (`partitioner plan --tensor-parallel T`)")
    with pytest.raises(ExportError, match=r"^torch-pipelining cannot run this plan: its stages have tensor-parallel "
                                          r"degrees 2 \(virtual_workers\[0\].stages\[0\] on n0:0-1\) and 1 .*torch's "
                                          r"PipelineStage sends a stage's output to one rank of its pipeline group"):
        export_plan(MIXED, "torch-pipelining")
    across = Plan("gpt2-tiny", (pipeline((0, 2, "n0:0-1"), (2, 4, "n0:2-3")), pipeline((0, 2, "n1:0"), (2, 4, "n1:1"))),
                  "1f1b", 2, 2)
    with pytest.raises(ExportError, match=r"degrees 2 \(virtual_workers\[0\].stages\[0\] on n0:0-1\) and 1 "
                                          r"\(virtual_workers\[1\].stages\[0\] on n1:0\)"):
        export_plan(across, "megatron")


def test_deepspeed_refuses_a_tensor_parallel_plan() -> None:
    with pytest.raises(ExportError) as err:
        export_plan(TP2_PP2, "deepspeed")
    assert str(err.value) == (
        "deepspeed cannot run this plan: its stages run on tensor-parallel groups (n0:0-1: degree 2); DeepSpeed's "
        "pipeline engine has no tensor parallelism of its own (its topology's model axis takes layers the model "
        "shards itself, as Megatron-DeepSpeed's); export to torch-pipelining or megatron, or re-plan without "
        "--tensor-parallel")
    assert "\n" not in str(err.value)


# -- Megatron-LM ----------------------------------------------------------------------------------


def test_megatron_gets_the_degree_and_its_rank_order_with_the_index_fastest() -> None:
    e = export_plan(TP2_PP2_DP2.__class__("gpt2-tiny", (pipeline((0, 2, "n0:0-1"), (2, 4, "n0:2-3")),
                                                        pipeline((0, 2, "n0:4-5"), (2, 4, "n0:6-7"))), "1f1b", 2, 2),
                    "megatron")
    assert e["tensor_parallel"] == 2 and e["world_size"] == 8 and e["rank_order"] == "pipe-major"
    i = e["args"].index("--tensor-model-parallel-size")
    assert e["args"][i + 1] == "2" and "--tensor-model-parallel-size" in e["layout_args"]
    # tp-cp-ep-dp-pp: rank = (pipeline rank * dp + data-parallel rank) * tp + index
    assert [(r["pipeline_rank"], r["data_parallel_rank"], r["tp_rank"], r["gpu"]) for r in e["ranks"]] == [
        (0, 0, 0, "n0:0"), (0, 0, 1, "n0:1"), (0, 1, 0, "n0:4"), (0, 1, 1, "n0:5"),
        (1, 0, 0, "n0:2"), (1, 0, 1, "n0:3"), (1, 1, 0, "n0:6"), (1, 1, 1, "n0:7")]
    assert e["launch"]["nodes"][0]["cuda_visible_devices"] == "0,1,4,5,2,3,6,7"
    # a virtual worker per node: data-major (tp-cp-ep-pp-dp), each node's ranks consecutive
    per_node = Plan("gpt2-tiny", (pipeline((0, 2, "n0:0-1"), (2, 4, "n0:2-3")),
                                  pipeline((0, 2, "n1:0-1"), (2, 4, "n1:2-3"))), "1f1b", 2, 2)
    e = export_plan(per_node, "megatron")
    assert e["rank_order"] == "data-major" and "--use-tp-pp-dp-mapping" in e["args"]
    assert [r["gpu"] for r in e["ranks"]] == [f"n{k}:{g}" for k in range(2) for g in range(4)]
    # no groups: no flag (Megatron-LM's default 1), the ranks as before
    flat = export_plan(Plan("gpt2-tiny", (pipeline((0, 2, "n0:0"), (2, 4, "n0:1")),), "1f1b", 2, 2), "megatron")
    assert "--tensor-model-parallel-size" not in flat["args"] and flat["world_size"] == 2


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_tensor_parallel_half_precision_plan_carries_its_precision(precision: str) -> None:
    plan = Plan("gpt2-tiny", TP2_PP2.virtual_workers, "1f1b", 2, 2, pricing=CostOptions(precision=precision))
    torch_e, meg = export_plan(plan, "torch-pipelining"), export_plan(plan, "megatron")
    assert torch_e["training"]["precision"] == meg["training"]["precision"] == precision
    for args in (meg["args"], meg["layout_args"], meg["uneven_args"]):
        assert f"--{precision}" in args and "--tensor-model-parallel-size" in args


# -- torch's pipelining with the shards: numerics ------------------------------------------------


def _tp_rank(rank: int, world: int, export: dict[str, Any], steps: int, lr: float, seed: int, out: str) -> None:
    from runtime.data import make_data
    from runtime.stage import zoo_chain
    from runtime.tensor_parallel import full_state, local
    from runtime.torch_pipelining import build_rank

    chain = zoo_chain(export["model"], export["micro_batch_size"])
    data = make_data(chain, "auto", export["micro_batch_size"], export["n_microbatches"], len(export["pipelines"]),
                     seed)
    me = build_rank(export, rank, seed=seed, loss_fn=data.loss)
    opt = torch.optim.SGD(list(me.parameters()), lr=lr)
    losses = []
    for step in range(steps):
        x, y = data.global_batch(step)
        got = me.step(x, y)
        me.sync_gradients()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if got is not None:
            losses.append(sum(got) / len(got))
    state = {k: v for mod in me.modules.values() for k, v in full_state(mod).items()}  # (collective per group)
    # what this rank holds of each parameter: (its local elements, the whole tensor's)
    held = {k: (local(p).numel(), p.numel()) for mod in me.modules.values() for k, p in mod.named_parameters()}
    torch.save({"worker": me.worker, "tp_rank": me.tp_rank, "losses": losses, "state": state, "held": held},
               os.path.join(out, f"torch{rank}.pt"))
    dist.barrier()


@pytest.mark.parametrize("plan", [
    pytest.param(TP2_PP2, marks=pytest.mark.slow), TP2_PP2_DP2,  # tp2-pp2: the dp2 case holds it
    # two stages per group (torch's ScheduleInterleaved1F1B over each index's pipeline group)
    Plan("gpt2-tiny", (pipeline((0, 1, "n0:0-1"), (1, 2, "n0:2-3"), (2, 3, "n0:0-1"), (3, 4, "n0:2-3")),),
         "interleaved", 2, 2, chunks=2),
    # the backward split into input and weight gradients (torch's ZB1P) through the shards
    Plan("gpt2-tiny", (pipeline((0, 2, "n0:0-1"), (2, 4, "n0:2-3")),), "zb-h1", 2, 3),
], ids=["tp2-pp2", "tp2-pp2-dp2", "interleaved", "zb-h1"])
def test_the_tensor_parallel_torch_export_trains_like_one_process(plan: Plan, tmp_path: Path) -> None:
    from runtime.launch import spawn_local

    steps, lr, seed = 3, 0.05, 1
    export = export_plan(plan, "torch-pipelining")
    spawn_local(_tp_rank, export["world_size"], (export, steps, lr, seed, str(tmp_path)), threads=1, timeout_s=120,
                start_method="forkserver")
    ref = reference_weights(plan, steps, lr, seed)
    per_worker: list[dict[str, torch.Tensor]] = [{} for _ in plan.virtual_workers]
    last_losses = []
    for r in range(export["world_size"]):
        got = torch.load(tmp_path / f"torch{r}.pt", weights_only=False)
        for k, v in got["state"].items():  # every rank of a group holds the same whole tensors
            if k in per_worker[got["worker"]]:
                assert torch.equal(per_worker[got["worker"]][k], v), k
            per_worker[got["worker"]][k] = v
        # the blocks' linear layers are sharded (half of each on a rank), the rest whole
        for k, (mine, whole) in got["held"].items():
            sharded = any(f".{name}." in k for name in ("attn.qkv", "attn.proj", "fc1", "fc2")) and not (
                k.endswith("proj.bias") or k.endswith("fc2.bias"))
            assert mine == (whole // 2 if sharded else whole), (k, mine, whole)
        if got["losses"]:
            last_losses.append(got["losses"])
    for w in per_worker:
        assert set(w) == set(ref)
        for k, v in ref.items():
            torch.testing.assert_close(w[k], v, rtol=1e-4, atol=1e-6, msg=k)
    # the last stage's group: both ranks report the loss of every step, the same values
    assert len(last_losses) == 2 * len(plan.virtual_workers) and all(len(x) == steps for x in last_losses)


def _fp16_rank(rank: int, world: int, export: dict[str, Any], steps: int, out: str) -> None:
    from runtime.data import make_data
    from runtime.stage import zoo_chain
    from runtime.torch_pipelining import build_rank

    chain = zoo_chain(export["model"], export["micro_batch_size"])
    data = make_data(chain, "auto", export["micro_batch_size"], export["n_microbatches"], 1, 0)
    me = build_rank(export, rank, seed=0, loss_fn=data.loss)
    opt = me.make_optimizer("adam", 0.001)
    losses = []
    for step in range(steps):
        x, y = data.global_batch(step)
        got = me.step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if got is not None:
            losses.append(sum(got) / len(got))
    assert me.scaler is not None
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump({"losses": losses, "scale": me.scaler.scale, "skipped": me.scaler.skipped}, f)


def test_an_fp16_tensor_parallel_plan_trains_like_the_runtime(tmp_path: Path) -> None:
    # fp16 with loss scaling through DTensor shards (each rank unscales its own part); the gradients
    # that cross the pipeline are the mean's, as in the runtime, so both take the same steps
    from runtime.launch import TrainConfig, spawn_local, train_local

    plan = Plan("gpt2-tiny", TP2_PP2.virtual_workers, "1f1b", 2, 4, pricing=CostOptions(precision="fp16"))
    steps = 5
    export = export_plan(plan, "torch-pipelining")
    spawn_local(_fp16_rank, 4, (export, steps, str(tmp_path)), threads=1, timeout_s=120, start_method="forkserver")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    ours = train_local(plan, TrainConfig("gpt2-tiny", steps=steps, warmup=0, lr=0.001, seed=0, threads=1,
                                         timeout_s=120, data="text", progress=False), start_method="forkserver")
    assert ours["precision"] == "fp16" and ours["optimizer"] == "adam"
    assert got[2]["losses"] == got[3]["losses"] == pytest.approx(ours["loss"], rel=1e-5)
    assert {(g["scale"], g["skipped"]) for g in got} == {(r["loss_scale"]["final"], r["loss_scale"]["skipped_steps"])
                                                         for r in ours["ranks"]}
