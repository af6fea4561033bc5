"""The runtime trains as the plan was priced: its precision (bf16/fp16 weights and gradients, fp32
master weights the optimizer steps, fp16 loss scaling) and its optimizer (runtime.recipe,
runtime.master), against one process applying the same recipe by hand."""

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
from runtime.recipe import LossScaler, training_recipe
from runtime.stage import build_stage, zoo_chain

ROOT = Path(__file__).resolve().parent.parent
CPU_CLUSTER = ROOT / "examples" / "clusters" / "cpu4.yaml"
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def worker(cuts: list[int], devices: list[str]) -> VirtualWorker:
    return VirtualWorker(tuple(Stage((a, b), devices[k % len(devices)])
                               for k, (a, b) in enumerate(itertools.pairwise(cuts))))


def two_workers(precision: str, schedule: str = "1f1b", zero: int = 0) -> Plan:
    # two virtual workers (data parallel 2) of two stages, cutting GPT-2 tiny's 4 layers differently,
    # priced in `precision` with Adam
    return Plan("gpt2-tiny", (worker([0, 2, 4], ["n0:0", "n0:1"]), worker([0, 1, 4], ["n0:2", "n0:3"])),
                schedule=schedule, micro_batch_size=2, micro_batches=3,
                pricing=CostOptions(precision=precision, zero=zero))


def one_process(plan: Plan, steps: int, lr: float, seed: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The recipe by hand, in one process: the whole model cast to the half type, fp32 masters
    made from its half weights, Adam on the masters. Each virtual worker's micro-batches
    accumulate their gradients (of the loss / m, its gradient scaled by fp16's initial loss scale)
    in the half type; the workers' gradients are summed and divided by the workers in the half
    type (the all-reduce), converted to fp32 and unscaled, the masters stepped and copied back.
    Returns the masters and the losses. One torch thread, as each rank runs (a reduction split
    over threads adds in another order)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _recipe_by_hand(plan, steps, lr, seed)
    finally:
        torch.set_num_threads(threads)


def _recipe_by_hand(plan: Plan, steps: int, lr: float, seed: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    half = HALF[plan.pricing.precision]
    chain = zoo_chain(plan.model, plan.micro_batch_size)
    model = build_stage(chain, 0, chain.num_layers, seed=seed).to(half)
    masters = [p.detach().float() for p in model.parameters()]
    for m in masters:
        m.requires_grad_(True)
    opt = torch.optim.Adam(masters, lr=lr)
    m, b, workers = plan.micro_batches, plan.micro_batch_size, len(plan.virtual_workers)
    source = make_data(chain, "text", b, m, workers, seed)
    scaler = LossScaler() if plan.pricing.precision == "fp16" else None
    losses = []
    for step in range(steps):
        x, y = source.global_batch(step)
        total, summed = 0.0, None
        for w in range(workers):
            for j in range(m):
                rows = slice((w * m + j) * b, (w * m + j + 1) * b)
                def task_loss(out: torch.Tensor, _j: int, t: torch.Tensor = y[rows]) -> torch.Tensor:
                    return source.loss(out, t)

                loss_fn = scaler.wrap_loss(task_loss) if scaler is not None else task_loss
                loss = loss_fn(model(x[rows]), j) / m
                total += float(loss.detach()) / workers
                loss.backward()
            grads = [p.grad for p in model.parameters()]
            summed = grads if summed is None else [a + g for a, g in zip(summed, grads, strict=True)]
            model.zero_grad(set_to_none=True)
        for master, g in zip(masters, summed, strict=True):
            master.grad = (g / workers).float()
            if scaler is not None:
                master.grad.mul_(1.0 / scaler.scale)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, master in zip(model.parameters(), masters, strict=True):
                p.copy_(master)
        losses.append(total)
    names = [n for n, _ in model.named_parameters()]
    return dict(zip(names, (t.detach() for t in masters), strict=True)), losses


def _trained(plan: Plan, root: Path, steps: int, lr: float, seed: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """A run's metrics and the weights it saved (``state_dir``: the fp32 masters), by layer name."""
    root.mkdir()
    cfg = TrainConfig(plan.model, steps=steps, warmup=0, lr=lr, seed=seed, threads=1, timeout_s=120,
                      state_dir=str(root), data="text")
    metrics = train_local(plan, cfg, start_method="forkserver")
    out: dict[str, torch.Tensor] = {}
    for r in plan_layout(plan, 4).ranks:
        for state in torch.load(root / f"rank{r.rank}.pt").values():
            for k, v in state.items():  # (the layers' names are the whole model's: "<index>_<name>.…")
                assert torch.equal(out.setdefault(k, v), v), k  # every holder of a layer holds the same
    return metrics, out


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_matches_one_process_applying_the_recipe(precision: str, tmp_path: Path) -> None:
    plan = two_workers(precision)
    steps, lr, seed = 3, 0.01, 1
    metrics, got = _trained(plan, tmp_path / "run", steps, lr, seed)
    assert (metrics["optimizer"], metrics["precision"]) == ("adam", precision)
    ref, ref_loss = one_process(plan, steps, lr, seed)
    assert metrics["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert set(got) == set(ref)
    init = build_stage(zoo_chain(plan.model), 0, 4, seed=seed).to(HALF[precision]).float().state_dict()
    for k, v in got.items():
        assert v.dtype == torch.float32  # the fp32 master copy, not the half weights
        assert torch.allclose(v, ref[k], rtol=1e-5, atol=1e-7), f"{precision}: {k}"
        assert not torch.equal(v, init[k]), k  # training moved it
    if precision == "fp16":
        assert all(r["loss_scale"] == {"final": 2.0**16, "skipped_steps": 0} for r in metrics["ranks"])
    # the runtime ran the half model: its losses are not fp32's, and near them
    fp32, _ = _trained(two_workers("fp32"), tmp_path / "fp32", steps, lr, seed)
    assert metrics["loss"] != fp32["loss"]
    assert metrics["loss"] == pytest.approx(fp32["loss"], rel=2e-2)


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_under_bf16_trains_the_masters_of_the_plain_run(zero: int, tmp_path: Path) -> None:
    """ZeRO-1/2 under bf16: each holder steps the fp32 masters of its piece alone and all-gathers
    them into the half weights; the losses and the masters equal the run without ZeRO."""
    plain, want = _trained(two_workers("bf16"), tmp_path / "plain", 3, 0.01, 1)
    metrics, got = _trained(two_workers("bf16", zero=zero), tmp_path / "zero", 3, 0.01, 1)
    assert metrics["zero"] == zero and metrics["loss"] == plain["loss"]
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == torch.float32 and torch.equal(got[k], want[k]), k


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
                                                state_dir=str(tmp_path), data="text"),
                              start_method="fork")  # (fork: the ranks inherit the patch)
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
