"""Exported plans run on the frameworks themselves: torch.distributed.pipelining on gloo ranks
(the same losses and weights as this project's runtime), torch's tracing frontend with the
exported split points, and DeepSpeed's PipelineModule where DeepSpeed is installed."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from partitioner.export import export_plan
from partitioner.models import build_model
from partitioner.plan import Plan, Stage, VirtualWorker
from runtime.data import SyntheticData
from runtime.launch import TrainConfig, spawn_local, train_local
from runtime.layout import plan_layout
from runtime.model import is_model_ref, spec_chain
from runtime.stage import LayerChain, build_stage, zoo_chain


def worker(cuts: list[int], devices: list[str]) -> VirtualWorker:
    return VirtualWorker(tuple(Stage((a, b), devices[k % len(devices)])
                               for k, (a, b) in enumerate(itertools.pairwise(cuts))))


def _chain(model: str, micro_batch_size: int = 1) -> LayerChain:
    return spec_chain(model) if is_model_ref(model) else zoo_chain(model, micro_batch_size)


def _torch_rank(rank: int, world: int, export: dict[str, Any], steps: int, lr: float, seed: int, out: str) -> None:
    from runtime.torch_pipelining import build_rank

    me = build_rank(export, rank, seed=seed)
    opt = torch.optim.SGD(list(me.parameters()), lr=lr)
    chain = _chain(export["model"], export["micro_batch_size"])
    workers = len(export["pipelines"])
    data = SyntheticData(chain.make_input, export["micro_batch_size"], export["n_microbatches"], workers, seed)
    losses = []
    for step in range(steps):
        got = me.step(data.global_batch(step)[0])
        me.sync_gradients()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if got is not None:
            losses.append(sum(got) / len(got))
    state = {k: v for mod in me.modules.values() for k, v in mod.state_dict().items()}
    torch.save({"worker": me.worker, "losses": losses, "state": state}, os.path.join(out, f"torch{rank}.pt"))
    dist.barrier()


def _run_torch(plan: Plan, tmp: Path, steps: int, lr: float, seed: int) -> tuple[list[dict], list[float]]:
    export = export_plan(plan, "torch-pipelining")
    spawn_local(_torch_rank, export["world_size"], (export, steps, lr, seed, str(tmp)), threads=1, timeout_s=90,
                start_method="forkserver")
    weights: list[dict] = [{} for _ in plan.virtual_workers]
    losses: list[list[float]] = []
    for r in range(export["world_size"]):
        got = torch.load(tmp / f"torch{r}.pt")
        weights[got["worker"]].update(got["state"])
        if got["losses"]:
            losses.append(got["losses"])
    mean = [sum(ls[k] for ls in losses) / len(losses) for k in range(steps)]
    return weights, mean


def _run_runtime(plan: Plan, tmp: Path, steps: int, lr: float, seed: int) -> tuple[list[dict], list[float]]:
    cfg = TrainConfig(plan.model, steps=steps, warmup=0, lr=lr, seed=seed, threads=1, timeout_s=90,
                      state_dir=str(tmp), data="synthetic")  # torch's side: the same inputs, loss = mean output
    metrics = train_local(plan, cfg, start_method="forkserver")
    layout = plan_layout(plan, _chain(plan.model).num_layers)
    weights: list[dict] = [{} for _ in plan.virtual_workers]
    for r in layout.ranks:
        for state in torch.load(tmp / f"rank{r.rank}.pt").values():
            weights[r.worker].update(state)
    return weights, metrics["loss"]


CASES = {
    # one pipeline of two ranks, 1F1B, a micro-batch count that is not a multiple of the ranks
    "gpt2-1f1b": Plan("gpt2-tiny", (worker([0, 3, 4], ["n0:0", "n0:1"]),), schedule="1f1b", micro_batch_size=2,
                      micro_batches=3),
    # two stages per rank (stage c*p + d on rank d)
    "vgg-interleaved": Plan("vgg19-tiny", (worker([0, 4, 9, 15, 22], ["n0:0", "n0:1"]),), schedule="interleaved",
                            micro_batch_size=2, micro_batches=2, chunks=2),
    "vgg-bfs": Plan("vgg19-tiny", (worker([0, 6, 11, 20, 22], ["n0:0", "n0:1"]),), schedule="bfs",
                    micro_batch_size=2, micro_batches=3, chunks=2),
    # two virtual workers of two ranks, cut differently: gradients averaged per set of holders
    "gpt2-two-workers": Plan("gpt2-tiny", (worker([0, 2, 4], ["n0:0", "n0:1"]), worker([0, 1, 4], ["n0:2", "n0:3"])),
                             schedule="gpipe", micro_batch_size=2, micro_batches=2),
    # zero-bubble: ZB-H1 as torch's ScheduleInterleavedZeroBubble (ZB1P), ZB-V as its ScheduleZBVZeroBubble
    # (two stages per rank in a V: n0:0 holds the first and the last)
    "gpt2-zb-h1": Plan("gpt2-tiny", (worker([0, 1, 3, 4], ["n0:0", "n0:1", "n0:2"]),), schedule="zb-h1",
                       micro_batch_size=2, micro_batches=3),
    "gpt2-zbv": Plan("gpt2-tiny", (VirtualWorker((Stage((0, 1), "n0:0"), Stage((1, 2), "n0:1"), Stage((2, 3), "n0:1"),
                                                  Stage((3, 4), "n0:0"))),), schedule="zbv", micro_batch_size=2,
                     micro_batches=4, chunks=2),
    # a user's module:function model, exported and built on torch's side through the same reference
    "user-mlp-1f1b": Plan("tests._user_models:mlp", (worker([0, 2, 5], ["n0:0", "n0:1"]),), schedule="1f1b",
                          micro_batch_size=4, micro_batches=3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_torch_pipelining_trains_like_the_runtime(case: str, tmp_path: Path) -> None:
    plan = CASES[case]
    steps, lr, seed = 3, 0.05, 1
    (tmp_path / "torch").mkdir()
    (tmp_path / "runtime").mkdir()
    got_w, got_loss = _run_torch(plan, tmp_path / "torch", steps, lr, seed)
    ref_w, ref_loss = _run_runtime(plan, tmp_path / "runtime", steps, lr, seed)
    assert got_loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    chain = _chain(plan.model)
    init = build_stage(chain, 0, chain.num_layers, seed=seed).state_dict()
    for got, ref in zip(got_w, ref_w, strict=True):
        assert set(got) == set(ref) == set(init)
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-6, msg=f"{case}: {k}")
    assert any(not torch.equal(init[k], ref_w[0][k]) for k in init)  # training moved the weights


@pytest.mark.parametrize(("model", "cuts"), [("vgg19-tiny", [0, 5, 12, 22]), ("gpt2-tiny", [0, 1, 3, 4])])
def test_traced_split_spec_gives_the_plans_stages(model: str, cuts: list[int]) -> None:
    from torch.distributed.pipelining import SplitPoint, pipeline

    zoo = build_model(model, 2)
    plan = Plan(model, (worker(cuts, ["a:0", "a:1", "a:2"]),), micro_batch_size=2)
    export = export_plan(plan, "torch-pipelining", [name for name, _ in zoo.layers])
    spec = {name: getattr(SplitPoint, where) for name, where in export["pipelines"][0]["split_spec"].items()}
    pipe = pipeline(zoo.sequential(), mb_args=(zoo.sample_input(),), split_spec=spec)
    assert pipe.num_stages == len(cuts) - 1
    layers = [m for _, m in zoo.layers]
    for s, (a, b) in enumerate(itertools.pairwise(cuts)):
        want = sum(p.numel() for m in layers[a:b] for p in m.parameters())
        assert sum(p.numel() for p in pipe.get_stage_module(s).parameters()) == want


# -- DeepSpeed (optional: pip install hetpartition[deepspeed] with DS_BUILD_OPS=0) -------------


def _deepspeed_rank(rank: int, world: int, export: dict[str, Any], out: str) -> None:
    import deepspeed
    from torch import nn

    from runtime.deepspeed_pipe import planned_pipeline_module

    os.environ.setdefault("LOCAL_RANK", str(rank))
    deepspeed.init_distributed(dist_backend="gloo")
    layers = [nn.Linear(4, 4) for _ in range(export["num_layers"])]
    net = planned_pipeline_module(layers, export)
    built = sum(1 for _ in net.parameters()) // 2  # weight and bias per built Linear
    torch.save({"parts": list(net.parts), "stage": net.stage_id, "built": built}, os.path.join(out, f"ds{rank}.pt"))


@pytest.mark.parametrize("cuts", [[0, 2, 7], [0, 5, 7]])
def test_deepspeed_pipeline_module_takes_the_exported_parts(cuts: list[int], tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    plan = Plan("toy", (worker(cuts, ["a:0", "a:1"]),), micro_batch_size=2, micro_batches=4)
    export = export_plan(plan, "deepspeed")
    # (a first deepspeed.init_distributed on a CPU machine compiles a communication op: minutes)
    spawn_local(_deepspeed_rank, 2, (export, str(tmp_path)), threads=1, timeout_s=600, start_method="forkserver")
    for r in range(2):
        got = torch.load(tmp_path / f"ds{r}.pt")
        assert got["parts"] == cuts
        assert got["stage"] == r
        assert got["built"] == cuts[r + 1] - cuts[r]


def test_deepspeed_trains_the_export_as_the_runtime(tmp_path: Path) -> None:
    """DeepSpeed's pipeline engine (tools/deepspeed_train.py: the exported config as is) trains the
    export of a PP 2 x DP 2 plan to the runtime's losses, every rank the plan's stage and replica."""
    pytest.importorskip("deepspeed")
    import json
    import subprocess
    import sys

    from partitioner.pricing import CostOptions

    root = Path(__file__).resolve().parents[1]
    plan = Plan("gpt2-tiny", (worker([0, 2, 4], ["a:0", "b:0"]), worker([0, 2, 4], ["a:1", "b:1"])),
                micro_batch_size=2, micro_batches=2, pricing=CostOptions())
    export = export_plan(plan, "deepspeed")
    (tmp_path / "ds.json").write_text(json.dumps(export))
    # (a first deepspeed.init_distributed on a CPU machine compiles a communication op: minutes)
    subprocess.run([sys.executable, str(root / "tools" / "deepspeed_train.py"), str(tmp_path / "ds.json"),
                    str(tmp_path / "out.json"), "--steps", "3"], check=True, timeout=900, cwd=root,
                   env={**os.environ, "PYTHONPATH": str(root)})
    got = json.loads((tmp_path / "out.json").read_text())
    assert [(r["stage"], r["replica"], r["device"]) for r in got["ranks"]] == \
        [(s, w, plan.virtual_workers[w].stages[s].device) for s in range(2) for w in range(2)]
    assert got["same_losses_on_every_rank"]
    ours = train_local(plan, TrainConfig("gpt2-tiny", steps=3, warmup=0, lr=0.001, seed=0, threads=1, data="text",
                                         progress=False))["loss"]
    assert got["losses"] == pytest.approx(ours, rel=1e-4)
    assert got["losses"][-1] < got["losses"][0]
