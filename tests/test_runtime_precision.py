"""The runtime trains as the plan was priced: its precision (bf16/fp16 autocast, fp16 loss scaling,
fp32 master weights) and its optimizer (runtime.recipe), against one process doing the same."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.pricing import CostOptions
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner_cli import main as cli
from runtime.data import make_data
from runtime.launch import TrainConfig, prepare, train_local
from runtime.layout import plan_layout
from runtime.recipe import AutocastStage, LossScaler, training_recipe
from runtime.stage import build_stage, zoo_chain

ROOT = Path(__file__).resolve().parent.parent
CPU_CLUSTER = ROOT / "examples" / "clusters" / "cpu4.yaml"
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def worker(cuts: list[int], devices: list[str]) -> VirtualWorker:
    return VirtualWorker(tuple(Stage((a, b), devices[k % len(devices)])
                               for k, (a, b) in enumerate(itertools.pairwise(cuts))))


def two_workers(precision: str, schedule: str = "1f1b") -> Plan:
    # two virtual workers cutting GPT-2 tiny's 4 layers differently, priced in `precision` with SGD
    return Plan("gpt2-tiny", (worker([0, 2, 4], ["n0:0", "n0:1"]), worker([0, 1, 4], ["n0:2", "n0:3"])),
                schedule=schedule, micro_batch_size=2, micro_batches=3,
                pricing=CostOptions(precision=precision, optimizer_state_factor=0.0))


def one_process(plan: Plan, steps: int, lr: float, seed: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The whole model in one process, every micro-batch through the plan's stages of its worker
    under autocast with the outputs cast to the half type at the same cuts, the loss's gradient
    scaled by the initial loss scale under fp16 and the gradients unscaled before plain SGD."""
    precision = plan.pricing.precision if plan.pricing else "fp32"
    chain = zoo_chain(plan.model, plan.micro_batch_size)
    model = build_stage(chain, 0, chain.num_layers, seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    m, b, workers = plan.micro_batches, plan.micro_batch_size, len(plan.virtual_workers)
    source = make_data(chain, "text", b, m, workers, seed)
    scale = LossScaler().scale if precision == "fp16" else 1.0
    losses = []
    for step in range(steps):
        x, y = source.global_batch(step)
        total = 0.0
        for w, vw in enumerate(plan.virtual_workers):
            last = len(vw.stages) - 1
            stages = [AutocastStage(model[st.start:st.stop], "cpu", HALF[precision], cast_output=k != last)
                      for k, st in enumerate(vw.stages)]
            for j in range(m):
                rows = slice((w * m + j) * b, (w * m + j + 1) * b)
                h = x[rows]
                for stage in stages:
                    h = stage(h)
                loss = source.loss(h, y[rows]) / m
                total += float(loss.detach()) / workers
                (loss * scale).backward()
        for p in model.parameters():
            p.grad /= workers * scale
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {k: v.detach() for k, v in model.state_dict().items()}, losses


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_matches_one_process_doing_the_same(precision: str, tmp_path: Path) -> None:
    plan = two_workers(precision)
    steps, lr, seed = 3, 0.05, 1
    cfg = TrainConfig(plan.model, steps=steps, warmup=0, lr=lr, seed=seed, threads=1, timeout_s=90,
                      state_dir=str(tmp_path), data="text")
    metrics = train_local(plan, cfg, start_method="forkserver")
    assert (metrics["optimizer"], metrics["precision"]) == ("sgd", precision)
    ref, ref_loss = one_process(plan, steps, lr, seed)
    assert metrics["loss"] == pytest.approx(ref_loss, rel=1e-4)
    # The gradients are summed in another order (per rank, then all-reduced between the workers), and
    # a half-precision rounding can go the other way: every tensor within 1% (bf16: 8 bits of
    # mantissa) or 0.2% (fp16: 11 bits) of how far the training moved it, nearly all far closer.
    init = build_stage(zoo_chain(plan.model), 0, 4, seed=seed).state_dict()
    share = {"bf16": 1e-2, "fp16": 2e-3}[precision]
    for r in plan_layout(plan, 4).ranks:
        for state in torch.load(tmp_path / f"rank{r.rank}.pt").values():
            for k, v in state.items():
                assert v.dtype == torch.float32  # the weights are the fp32 master copy
                moved = float((ref[k] - init[k]).abs().max())
                assert float((v - ref[k]).abs().max()) <= share * moved + 1e-7, f"{precision}: {k}"
    if precision == "fp16":
        assert all(r["loss_scale"] == {"final": 2.0**16, "skipped_steps": 0} for r in metrics["ranks"])
    # half precision is not fp32: the losses differ from an fp32 run, a little
    fp32 = train_local(two_workers("fp32"), TrainConfig(plan.model, steps=steps, warmup=0, lr=lr, seed=seed, threads=1,
                                                          timeout_s=90, data="text"), start_method="forkserver")
    assert metrics["loss"] != fp32["loss"]
    assert metrics["loss"] == pytest.approx(fp32["loss"], rel=2e-2)


def test_loss_scaling_skips_a_step_on_every_rank_when_one_overflows(tmp_path: Path) -> None:
    # a loss scale of 2**40 overflows fp16 gradients: every rank skips the step (the weights stay
    # the initial ones) and halves the scale, the same on every rank
    import runtime.recipe as recipe

    real = recipe.LossScaler.__init__

    def huge(self: recipe.LossScaler, scale: float = 2.0**40, **kw: float) -> None:
        real(self, scale, **kw)

    recipe.LossScaler.__init__ = huge  # type: ignore[method-assign]
    try:
        plan = two_workers("fp16")
        metrics = train_local(plan, TrainConfig(plan.model, steps=2, warmup=0, lr=0.05, seed=1, threads=1, timeout_s=90,
                                                state_dir=str(tmp_path), data="text"), start_method="forkserver")
    finally:
        recipe.LossScaler.__init__ = real  # type: ignore[method-assign]
    scales = [r["loss_scale"] for r in metrics["ranks"]]
    assert len({json.dumps(s) for s in scales}) == 1
    assert scales[0]["skipped_steps"] >= 1 and scales[0]["final"] < 2.0**40


def test_recipe_follows_the_pricing_and_says_what_differs() -> None:
    priced = two_workers("bf16")
    adam = Plan(priced.model, priced.virtual_workers, micro_batch_size=2, micro_batches=3, pricing=CostOptions())
    assert training_recipe(adam) == training_recipe(adam, "adam")
    assert (training_recipe(adam).optimizer, training_recipe(adam).precision, training_recipe(adam).notes) == (
        "adam", "fp32", ())
    r = training_recipe(adam, "sgd")
    assert r.optimizer == "sgd" and len(r.notes) == 1 and "differs from the plan's pricing (adam" in r.notes[0]
    assert training_recipe(priced).precision == "bf16"
    by_hand = Plan(priced.model, priced.virtual_workers, micro_batch_size=2, micro_batches=3)
    assert training_recipe(by_hand).optimizer == "sgd" and "no pricing" in training_recipe(by_hand).notes[0]
    two = Plan(priced.model, (worker([0, 2, 4], ["n0:0", "n0:1"]),), schedule="2bw", micro_batch_size=2,
               micro_batches=2, pricing=CostOptions(precision="fp16"))
    r = training_recipe(two)
    assert (r.optimizer, r.precision) == ("sgd", "fp32") and "plain SGD in fp32" in r.notes[0]
    with pytest.raises(Exception, match=r"`optimizer` adam: the 2bw executor updates its weight versions with "
                                        "plain SGD in fp32"):
        prepare(two, TrainConfig("gpt2-tiny", optimizer="adam"))
    with pytest.raises(Exception, match="optimizer = 'lamb'"):
        TrainConfig("gpt2-tiny", optimizer="lamb")


def _profile() -> Profile:
    chain = zoo_chain("gpt2-tiny", 2)
    layers = tuple(LayerProfile(name, 1.0, float(sum(p.numel() * 4 for p in build_stage(chain, i, i + 1).parameters())),
                                4096.0, 4096.0, {"cpu": LayerTime(1e-3, 2e-3)})
                   for i, (name, _) in enumerate(chain.layers))
    return Profile("gpt2-tiny", 2, layers)


@pytest.mark.parametrize(("extra", "optimizer", "note"), [
    ([], "adam", None),
    (["--optimizer", "sgd"], "sgd", "note: optimizer sgd differs from the plan's pricing (adam: 2 word(s)"),
])
def test_cli_trains_the_plans_recipe_and_prints_memory(extra: list[str], optimizer: str, note: str | None,
                                                       tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.launch as launch

    real = launch.train_local
    monkeypatch.setattr(launch, "train_local", lambda plan, cfg, **kw: real(plan, cfg, start_method="forkserver", **kw))
    plan = Plan("gpt2-tiny", (worker([0, 2, 4], ["n0:0", "n0:1"]),), micro_batch_size=2, micro_batches=2,
                pricing=CostOptions(precision="fp16"))
    plan.save(tmp_path / "plan.json")
    _profile().save(tmp_path / "profile.json")
    out = tmp_path / "m.json"
    rc = cli.main(["train", str(tmp_path / "plan.json"), "--profile", str(tmp_path / "profile.json"), "--cluster",
                   str(CPU_CLUSTER), "--model", "gpt2-tiny", "--local", "--steps", "2", "--warmup", "0",
                   "--threads", "1", "-o", str(out), *extra])
    assert rc == 0
    text = capsys.readouterr().out
    lr = "0.001" if optimizer == "adam" else "0.01"
    assert f"optimizer {optimizer} (lr {lr}), precision fp16" in text
    assert (note in text) if note else "note:" not in text
    m = json.loads(out.read_text())
    assert (m["optimizer"], m["precision"]) == (optimizer, "fp16")
    rows = m["memory"]["ranks"]
    assert [r["device"] for r in rows] == ["n0:0", "n0:1"]
    # CPU: the model state held (fp32 weights + fp32 gradients + Adam's two moments) against the cost
    # model's (fp16 weights + gradients + an fp32 master copy + the moments): the same bytes; the peak
    # adds the activations held (runtime.memory) against the simulator's peak
    for r in rows:
        assert r["model_state_bytes"] == pytest.approx(r["predicted_model_state_bytes"], rel=1e-9)
        assert r["measured_bytes"] > r["model_state_bytes"] and r["predicted_bytes"] > r["predicted_model_state_bytes"]
        assert f"rank {r['rank']}  {r['device']}" in text
    per_param = {"adam": 16, "sgd": 8}[optimizer]
    chain = zoo_chain("gpt2-tiny", 2)
    n0 = sum(p.numel() for p in build_stage(chain, 0, 2).parameters())
    assert rows[0]["model_state_bytes"] == per_param * n0
