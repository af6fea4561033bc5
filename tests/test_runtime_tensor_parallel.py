"""Tensor parallelism in the runtime (runtime/tensor_parallel.py, runtime/layout.py): a plan device
``NODE:FIRST-LAST`` runs its stages' shards on that many consecutive ranks with torch's DTensor
API; numerics equal one process (TP x PP x DP on gloo); the messages between groups of other
degrees; what is refused; checkpoints of shards load into plans of other degrees by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from partitioner.errors import PartitionerError
from partitioner.placement import supports
from partitioner.plan import Plan, Stage, VirtualWorker
from runtime.checkpoint import Manifest, load_state, restore, save_checkpoint
from runtime.data import make_data
from runtime.launch import TrainConfig, prepare, spawn_local, train_local
from runtime.layout import plan_layout
from runtime.model import ModelSpec, spec_chain
from runtime.named_state import OPTIM, model_key, rank_state
from runtime.nodes import seat
from runtime.run import chain_for
from runtime.stage import build_stage, zoo_chain
from runtime.tensor_parallel import tp_mesh, zoo_plan
from tests.test_runtime import assert_same

USER = "tests._user_models:mlp_tp"


def pipeline(*stages: tuple[int, int, str]) -> VirtualWorker:
    return VirtualWorker(tuple(Stage((a, b), d) for a, b, d in stages))


# the Done-when plan: TP 2 x PP 2 x DP 2 on 8 ranks, the two virtual workers cut differently
TP2_PP2_DP2 = Plan("gpt2-tiny", (pipeline((0, 2, "n0:0-1"), (2, 4, "n0:2-3")),
                                 pipeline((0, 1, "n1:0-1"), (1, 4, "n1:2-3"))), "1f1b", 2, 2)


# -- the layout: ranks, messages, holder sets (no processes) -------------------------------------


def test_a_group_is_consecutive_ranks_and_each_rank_receives_from_its_index_modulo_the_senders_degree() -> None:
    plan = Plan("gpt2-tiny", (pipeline((0, 1, "n0:0-3"), (1, 2, "n0:4-5"), (2, 4, "n0:6")),), "1f1b", 2, 2)
    layout = plan_layout(plan, 4)
    assert [(r.rank, r.gpu, r.device, r.tp_rank, r.tp_size, r.pipe_rank) for r in layout.ranks] == [
        (0, "n0:0", "n0:0-3", 0, 4, 0), (1, "n0:1", "n0:0-3", 1, 4, 0), (2, "n0:2", "n0:0-3", 2, 4, 0),
        (3, "n0:3", "n0:0-3", 3, 4, 0), (4, "n0:4", "n0:4-5", 0, 2, 1), (5, "n0:5", "n0:4-5", 1, 2, 1),
        (6, "n0:6", "n0:6", 0, 1, 2)]
    assert layout.pipelines == ((0, 4, 6),) and layout.ranks[5].tp_group == (4, 5)
    # 4 -> 2: receivers 4, 5 from indices 0, 1; senders of index 2, 3 send nothing
    assert [layout.peers(r)[0] for r in (4, 5)] == [0, 1]
    assert [layout.send_to(r)[1] for r in range(4)] == [(4,), (5,), (), ()]
    # 2 -> 1: rank 6 receives from index 0; its gradient goes back to both ranks of the group
    assert layout.peers(6)[1] == 4 and layout.send_to(4)[2] == (6,) and layout.send_to(5)[2] == ()
    assert layout.send_to(6)[1] == (4, 5) and [layout.peers(r)[2] for r in (4, 5)] == [6, 6]
    # the gradient from the group of 2 back to the group of 4: index i to every j with j % 2 == i
    assert layout.send_to(4)[0] == (0, 2) and layout.send_to(5)[0] == (1, 3)
    assert [layout.peers(r)[1] for r in range(4)] == [4, 5, 4, 5]
    # every rank of a group runs its device's action list
    assert all(layout.actions(r) == layout.actions(0) for r in range(4))


def test_a_shard_is_averaged_over_the_holders_of_the_same_shard() -> None:
    layout = plan_layout(TP2_PP2_DP2, 4)
    assert layout.world_size == 8 and layout.pipelines == ((0, 2), (4, 6))
    assert layout.holder_sets() == [((0, 4), (0,)), ((1, 5), (0,)), ((0, 6), (1,)), ((1, 7), (1,)),
                                    ((2, 6), (2, 3)), ((3, 7), (2, 3))]


def test_a_process_under_torchrun_plays_one_gpu_of_its_group() -> None:
    layout = plan_layout(Plan("gpt2-tiny", (pipeline((0, 2, "n0:2-3"), (2, 4, "n1:0-1")),), "1f1b", 2, 2), 4)
    got = [seat(layout, {"LOCAL_RANK": str(k), "LOCAL_WORLD_SIZE": "2"}, node) for node in ("n0", "n1")
           for k in range(2)]
    assert [(s.rank, s.device, s.gpu_index) for s in got] == [(0, "n0:2-3", 2), (1, "n0:2-3", 3),
                                                              (2, "n1:0-1", 0), (3, "n1:0-1", 1)]
    with pytest.raises(PartitionerError, match=r"node n0 holds 2 device\(s\) of the plan: start it with --nproc-per-node 2"):
        seat(layout, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, "n0")


# -- refused, in one line ----------------------------------------------------------------------


def test_a_layer_held_at_two_degrees_is_refused() -> None:
    mixed = Plan("gpt2-tiny", (pipeline((0, 2, "n0:0-1"), (2, 4, "n0:2")),
                               pipeline((0, 1, "n1:0"), (1, 4, "n1:2-3"))), "1f1b", 2, 2)
    why = supports(mixed, "runtime")
    assert why == ("layer 0 is held at tensor-parallel degree 2 by virtual_workers[0].stages[0] (n0:0-1) and 1 by "
                   "virtual_workers[1].stages[0] (n1:0): the runtime averages a layer's gradients between shards of "
                   "one degree; plan every holder of a layer at the same degree")
    with pytest.raises(PartitionerError, match="held at tensor-parallel degree 2"):
        plan_layout(mixed, 4)
    replicas = Plan("gpt2-tiny", (VirtualWorker((Stage((0, 2), "n0:0-1", replicas=("n0:2",)),
                                                 Stage((2, 4), "n0:3"))),), "1f1b", 2, 2)
    assert "by virtual_workers[0].stages[0].replicas[0] (n0:2)" in (supports(replicas, "runtime") or "")
    two_bw = Plan("gpt2-tiny", (pipeline((0, 2, "n0:0-1"), (2, 4, "n0:2")),), "2bw", 2, 2)
    assert "the runtime shards stages with the flushing schedules, not '2bw'" in (supports(two_bw, "runtime") or "")
    assert supports(TP2_PP2_DP2, "runtime") is None and supports(TP2_PP2_DP2, "simulator") is None


def test_heads_or_features_the_degree_does_not_divide_are_refused_naming_the_layer() -> None:
    three = Plan("gpt2-tiny", (pipeline((0, 2, "n0:0"), (2, 4, "n0:1-3")),), "1f1b", 2, 2)
    with pytest.raises(PartitionerError) as err:
        prepare(three, TrainConfig("gpt2-tiny"))
    assert str(err.value) == ("layer 2 (block1) at tensor-parallel degree 3 (virtual_workers[0].stages[1] on "
                              "n0:1-3): its 4 attention heads do not split 3 ways; plan a degree that divides 4")
    user = Plan(USER, (pipeline((0, 2, "n0:0"), (2, 5, "n0:1-3")),), "1f1b", 2, 2)
    with pytest.raises(PartitionerError, match=r"^layer 2 \(mlp\) at tensor-parallel degree 3 .*'0' has 32 output "
                                               r"features, which ColwiseParallel does not split 3 ways"):
        prepare(user, TrainConfig(USER))
    with pytest.raises(PartitionerError, match="eval_global: the global model is evaluated on one process"):
        prepare(Plan("gpt2-tiny", (pipeline((0, 4, "n0:0-1")),), "1f1b", 2, 2), TrainConfig("gpt2-tiny", eval_global=True))
    from torch.distributed.tensor.parallel import ColwiseParallel

    spec = ModelSpec([nn.Linear(4, 4), nn.Linear(4, 2)], lambda s, n: (torch.zeros(n, 4), torch.zeros(n).long()),
                     tensor_parallel=lambda i, layer: {"fc": ColwiseParallel()})
    plan = Plan("m:f", (pipeline((0, 2, "n0:0-1")),), "1f1b", 2, 1)
    with pytest.raises(PartitionerError, match=r"^layer 0 \(0\) .*its tensor-parallel plan names 'fc', which the "
                                               r"layer has not got$"):
        prepare(plan, TrainConfig("m:f"), chain=spec_chain("m:f", spec))
    bad = ModelSpec([nn.Linear(4, 2)], spec.make_batch, tensor_parallel=lambda i, layer: 1 / 0)
    with pytest.raises(PartitionerError, match=r"^ModelSpec.tensor_parallel\(0, layer\) raised ZeroDivisionError"):
        prepare(Plan("m:f", (pipeline((0, 1, "n0:0-1")),), "1f1b", 2, 1), TrainConfig("m:f"),
                chain=spec_chain("m:f", bad))


# -- numerics: one process ---------------------------------------------------------------------


@pytest.mark.parametrize("plan", [
    TP2_PP2_DP2,
    Plan("gpt2-tiny", (pipeline((0, 4, "n0:0-1")),), "1f1b", 2, 2),  # TP 2 alone
    # degrees 4, 2, 1, 4 along one pipeline
    Plan("gpt2-tiny", (pipeline((0, 1, "n0:0-3"), (1, 2, "n0:4-5"), (2, 3, "n0:6"), (3, 4, "n1:0-3")),), "gpipe", 2, 3),
    # a replicated stage whose replicas are groups
    Plan("gpt2-tiny", (VirtualWorker((Stage((0, 2), "n0:0-1", replicas=("n0:2-3",)), Stage((2, 4), "n0:4"))),),
         "1f1b", 2, 3),
    # interleaved: a group holds two chunks; zb-h1: the backward split into I and W
    Plan("gpt2-tiny", (pipeline((0, 1, "n0:0-1"), (1, 2, "n0:2"), (2, 3, "n0:0-1"), (3, 4, "n0:2")),),
         "interleaved", 2, 2, chunks=2),
    Plan("gpt2-tiny", (pipeline((0, 2, "n0:0-1"), (2, 4, "n0:2-3")),), "zb-h1", 2, 3),
], ids=["tp2-pp2-dp2", "tp2", "degrees-4-2-1-4", "replicas-of-groups", "interleaved", "zb-h1"])
def test_tensor_parallel_plans_match_one_process(plan: Plan, tmp_path: Path) -> None:
    assert_same(plan, tmp_path)


def test_bert_blocks_shard_too(tmp_path: Path) -> None:
    assert_same(Plan("bert-tiny", (pipeline((0, 2, "n0:0-1"), (2, 4, "n0:2-3")),), "1f1b", 2, 2), tmp_path, data="text")


def test_a_users_model_with_its_own_plan_matches_one_process(tmp_path: Path) -> None:
    plan = Plan(USER, (pipeline((0, 3, "n0:0-1"), (3, 5, "n0:2")),
                       pipeline((0, 2, "n1:0-1"), (2, 3, "n1:2-3"), (3, 5, "n1:4"))), "1f1b", 4, 2)
    steps, lr, seed = 3, 0.1, 2
    config = TrainConfig(USER, steps=steps, warmup=0, lr=lr, seed=seed, threads=1, timeout_s=60, state_dir=str(tmp_path))
    chain = chain_for(plan, config)
    model = build_stage(chain, 0, chain.num_layers, seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    source = make_data(chain, "auto", plan.micro_batch_size, plan.micro_batches, 2, seed)
    for step in range(steps):
        opt.zero_grad()
        x, y = source.global_batch(step)
        source.loss(model(x), y).backward()
        opt.step()
    metrics = train_local(plan, config, start_method="forkserver")
    assert metrics["world_size"] == 8 and [r["tp_rank"] for r in metrics["ranks"]] == [0, 1, 0, 0, 1, 0, 1, 0]
    layout = prepare(plan, config).layout
    for r in layout.ranks:
        for state in torch.load(tmp_path / f"rank{r.rank}.pt").values():
            for k, v in state.items():
                torch.testing.assert_close(v, model.state_dict()[k], rtol=1e-5, atol=1e-6, msg=f"rank {r.rank}: {k}")


# -- checkpoints: shards by name, any degree ----------------------------------------------------


def test_a_tensor_parallel_checkpoint_resumes_on_a_plan_without_tensor_parallelism_and_back(tmp_path: Path) -> None:
    tp2 = Plan("gpt2-tiny", (pipeline((0, 2, "n0:0-1"), (2, 4, "n0:2-3")),), "1f1b", 2, 2)
    tp1 = Plan("gpt2-tiny", (pipeline((0, 3, "n0:0"), (3, 4, "n0:1")),), "1f1b", 2, 2)
    tp4 = Plan("gpt2-tiny", (pipeline((0, 4, "n0:0-3")),), "1f1b", 2, 2)
    cfg = {"warmup": 0, "lr": 0.3, "seed": 3, "threads": 1, "timeout_s": 60}
    whole = train_local(tp1, TrainConfig("gpt2-tiny", steps=6, **cfg), start_method="forkserver")["loss"]  # type: ignore[arg-type]
    ckpt = str(tmp_path / "ckpt")
    first = train_local(tp2, TrainConfig("gpt2-tiny", steps=2, checkpoint_dir=ckpt, **cfg), start_method="forkserver")  # type: ignore[arg-type]
    saved = load_state(ckpt, 2)  # the shards of the two ranks of each group, whole by name
    assert saved[model_key(1, "attn.qkv.weight")].shape == (192, 64) and not any(k.startswith(OPTIM) for k in saved)
    then = train_local(tp1, TrainConfig("gpt2-tiny", steps=4, checkpoint_dir=ckpt, resume=True, **cfg),  # type: ignore[arg-type]
                       start_method="forkserver")
    last = train_local(tp4, TrainConfig("gpt2-tiny", steps=6, checkpoint_dir=ckpt, resume=True, **cfg),  # type: ignore[arg-type]
                       start_method="forkserver")
    assert (then["first_step"], last["first_step"]) == (2, 4)
    assert first["loss"] + then["loss"] + last["loss"] == pytest.approx(whole, rel=1e-5)


def _adam_shards(rank: int, world: int, plan: Plan, root: str, mode: str) -> None:
    """Rank ``rank``'s gpt2-tiny layers of ``plan`` sharded over its group, with Adam; ``save``: two
    Adam steps on gradients that depend on the values alone, then a checkpoint; ``load``: restore
    it and write the whole state by name (``root``/loaded<rank>.pt)."""
    layout = plan_layout(plan, 4, model="gpt2-tiny")
    me = layout.ranks[rank]
    chain = zoo_chain("gpt2-tiny")
    mesh = tp_mesh(layout, rank, torch.device("cpu"))
    by_layer: dict[int, nn.Module] = {}
    for s in me.stages:
        a, b = layout.stage_layers[me.worker][s]
        for k, layer in enumerate(build_stage(chain, a, b, seed=1 if mode == "save" else 9)):
            if mesh is not None and zoo_plan(layer):
                from torch.distributed.tensor.parallel import parallelize_module

                parallelize_module(layer, mesh, zoo_plan(layer))
            by_layer[a + k] = layer
    opt = torch.optim.Adam([p for m in by_layer.values() for p in m.parameters()], lr=0.01)
    if mode == "save":
        for t in range(2):
            for layer, mod in by_layer.items():
                for p in mod.parameters():
                    p.grad = torch.sin(p.detach() * (layer + 1) + t)
            opt.step()
        devices = tuple(r.device for r in layout.ranks)
        save_checkpoint(root, Manifest(3, plan, "gpt2-tiny", 0, "auto", devices), rank, by_layer, opt)
        return
    restore(root, 3, rank, by_layer, opt)
    mine = {}
    for key, value in rank_state(by_layer, opt).items():
        mine[key] = value.full_tensor() if hasattr(value, "full_tensor") else value
    torch.save(mine, Path(root) / f"loaded{rank}.pt")


@pytest.mark.slow  # by default: test_checkpoint.py reshards TP, test_zero_checkpoint.py TP shards under ZeRO
@pytest.mark.parametrize("writer", ["tp2-pp2", "tp1"])
def test_a_checkpoint_of_shards_loads_into_plans_of_other_degrees_bit_for_bit(writer: str, tmp_path: Path) -> None:
    plans = {"tp2-pp2": Plan("gpt2-tiny", (pipeline((0, 2, "n0:0-1"), (2, 4, "n0:2-3")),), "1f1b", 2, 2),
             "tp1": Plan("gpt2-tiny", (pipeline((0, 1, "n0:0"), (1, 4, "n0:1")),), "1f1b", 2, 2),
             "tp4": Plan("gpt2-tiny", (pipeline((0, 3, "n0:0-3"), (3, 4, "n0:4")),), "1f1b", 2, 2),
             # two virtual workers of one group each: every layer held by two groups of 2
             "tp2-dp2": Plan("gpt2-tiny", (pipeline((0, 4, "n0:0-1")), pipeline((0, 4, "n1:0-1"))), "1f1b", 2, 1)}
    root = str(tmp_path)
    spawn_local(_adam_shards, plan_layout(plans[writer], 4).world_size, (plans[writer], root, "save"), timeout_s=60,
                start_method="forkserver")
    saved = load_state(root, 3)
    assert any(k.endswith("attn.qkv.weight.exp_avg_sq") for k in saved)
    for name, plan in plans.items():
        world = plan_layout(plan, 4).world_size
        spawn_local(_adam_shards, world, (plan, root, "load"), timeout_s=60, start_method="forkserver")
        seen: set[str] = set()
        for rank in range(world):
            for key, value in torch.load(Path(root) / f"loaded{rank}.pt").items():
                assert value.dtype == saved[key].dtype and torch.equal(value, saved[key]), (name, rank, key)
                seen.add(key)
        assert seen == {k for k in saved if not k.startswith("rng.")}, name

