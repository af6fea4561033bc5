"""The training runtime: numerics against one process, every accepted schedule runs, bad input."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
import torch

from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.pricing import CostOptions
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner_cli import main as cli
from runtime.data import make_data
from runtime.launch import TrainConfig, check_world_size, train_local
from runtime.layout import plan_layout
from runtime.stage import build_stage, zoo_chain

ROOT = Path(__file__).resolve().parent.parent
CPU_CLUSTER = ROOT / "examples" / "clusters" / "cpu4.yaml"


def worker(cuts: list[int], devices: list[str]) -> VirtualWorker:
    """A virtual worker whose stage k holds layers [cuts[k], cuts[k + 1]) on devices[k % len]."""
    return VirtualWorker(tuple(Stage((a, b), devices[k % len(devices)])
                               for k, (a, b) in enumerate(itertools.pairwise(cuts))))


def reference_weights(plan: Plan, steps: int, lr: float, seed: int, data: str = "auto",
                      optimizer: str = "sgd") -> dict[str, torch.Tensor]:
    """Single-process SGD (or ``optimizer``, torch's own) on the whole model, the same global
    batches and the same loss."""
    chain = zoo_chain(plan.model, plan.micro_batch_size)
    model = build_stage(chain, 0, chain.num_layers, seed=seed)
    opt = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[optimizer](
        model.parameters(), lr=lr)
    source = make_data(chain, data, plan.micro_batch_size, plan.micro_batches, len(plan.virtual_workers), seed)
    for step in range(steps):
        opt.zero_grad()
        x, y = source.global_batch(step)
        source.loss(model(x), y).backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def trained_weights(plan: Plan, tmp_path: Path, steps: int, lr: float, seed: int, data: str = "auto",
                    **options: object) -> list[dict[str, torch.Tensor]]:
    """Train with the runtime; returns each virtual worker's full set of weights."""
    cfg = TrainConfig(plan.model, steps=steps, warmup=0, lr=lr, seed=seed, threads=1, timeout_s=60,
                      state_dir=str(tmp_path), data=data, **options)  # type: ignore[arg-type]
    metrics = train_local(plan, cfg, start_method="forkserver")
    assert len(metrics["step_s"]) == steps - metrics["first_step"]
    layout = plan_layout(plan, zoo_chain(plan.model).num_layers)
    out: list[dict[str, torch.Tensor]] = [{} for _ in plan.virtual_workers]
    for r in layout.ranks:
        for state in torch.load(tmp_path / f"rank{r.rank}.pt").values():
            out[r.worker].update(state)
    return out


def assert_same(plan: Plan, tmp_path: Path, steps: int = 3, lr: float = 0.05, seed: int = 1,
                data: str = "auto", reference: str = "sgd", **options: object) -> None:
    ref = reference_weights(plan, steps, lr, seed, data, reference)
    init = build_stage(zoo_chain(plan.model), 0, len(zoo_chain(plan.model).layers), seed=seed).state_dict()
    for got in trained_weights(plan, tmp_path, steps, lr, seed, data, **options):
        assert set(got) == set(ref)
        if reference == "sgd":
            for k, v in ref.items():
                torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-6, msg=f"{plan.schedule}: {k}")
        else:
            assert_adam_close(got, ref, lr, steps, plan.schedule)
    # training moved the weights (the comparison is not between two untouched copies)
    assert any(not torch.equal(init[k], ref[k]) for k in ref)


def assert_adam_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], lr: float, steps: int,
                      what: str) -> None:
    """Adam divides every gradient element by its own running magnitude, so an element whose
    gradient is zero up to rounding (attention's key bias: the softmax ignores it) moves by the
    rounding noise, which differs between a pipeline and one process. Every element within a
    tenth of a step (0.1 lr) per step of one-process Adam, and all but 0.05% of them to rtol 1e-4."""
    off, total = 0, 0
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, rtol=0.0, atol=0.1 * lr * steps, msg=f"{what}: {k}")
        off += int((~torch.isclose(got[k], v, rtol=1e-4, atol=1e-6)).sum())
        total += v.numel()
    assert off <= 5e-4 * total, f"{what}: {off} of {total} elements differ beyond rtol 1e-4"


# -- (a) numerics -----------------------------------------------------------------------------


@pytest.mark.parametrize(("schedule", "model", "data"), [("1f1b", "gpt2-tiny", "text"),
                                                         ("gpipe", "bert-tiny", "text")])
def test_two_stages_two_heterogeneous_workers_match_one_process(schedule: str, model: str, data: str,
                                                                tmp_path: Path) -> None:
    # the two virtual workers cut the 4 layers differently: gradients are averaged per layer
    plan = Plan(model, (worker([0, 2, 4], ["n0:0", "n0:1"]), worker([0, 1, 4], ["n0:2", "n0:3"])),
                schedule=schedule, micro_batch_size=2, micro_batches=3)
    assert_same(plan, tmp_path, data=data)


@pytest.mark.parametrize(("schedule", "optimizer", "given"), [("1f1b", "adam", ""), ("gpipe", "adamw", "adamw")])
def test_adam_as_priced_matches_one_process_adam(schedule: str, optimizer: str, given: str, tmp_path: Path) -> None:
    # a solver's plan records its pricing: Adam (2 words of state per parameter) by default, which
    # the runtime runs; `optimizer` adamw overrides it. Two workers cut differently, averaged per layer.
    plan = Plan("gpt2-tiny", (worker([0, 2, 4], ["n0:0", "n0:1"]), worker([0, 1, 4], ["n0:2", "n0:3"])),
                schedule=schedule, micro_batch_size=2, micro_batches=3, pricing=CostOptions())
    assert_same(plan, tmp_path, lr=1e-3, data="text", reference=optimizer, optimizer=given)


def test_adam_interleaved_matches_one_process_adam(tmp_path: Path) -> None:
    plan = Plan("vgg19-tiny", (worker([0, 4, 9, 15, 22], ["n0:0", "n0:1"]),), schedule="interleaved",
                micro_batch_size=2, micro_batches=2, chunks=2)
    assert_same(plan, tmp_path, lr=1e-3, reference="adam", optimizer="adam")


@pytest.mark.parametrize("m", [1, 2, 5])
def test_three_stages_one_worker_match_one_process(m: int, tmp_path: Path) -> None:
    plan = Plan("gpt2-tiny", (worker([0, 1, 3, 4], ["n0:0", "n0:1", "n0:2"]),), schedule="1f1b",
                micro_batch_size=2, micro_batches=m)
    assert_same(plan, tmp_path)


# -- (b) every accepted schedule completes (and still computes the same weights) ---------------


def _random_plan(rng: random.Random, schedule: str) -> Plan:
    n_layers = 22  # vgg19-tiny
    v = rng.choice([1, 2]) if schedule in ("interleaved", "bfs") else 1
    p = rng.choice([1, 2, 3])
    m = rng.randint(1, 5)
    if schedule == "interleaved":
        m = p * rng.randint(1, 2)
    cuts = [0, *sorted(rng.sample(range(1, n_layers), p * v - 1)), n_layers]
    return Plan("vgg19-tiny", (worker(cuts, [f"n0:{d}" for d in range(p)]),), schedule=schedule,
                micro_batch_size=2, micro_batches=m, chunks=v)


@pytest.mark.parametrize("draw", [0, 1, *(pytest.param(d, marks=pytest.mark.slow) for d in range(2, 8))])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "bfs"])
def test_accepted_schedules_complete_for_random_p_m(schedule: str, draw: int, tmp_path: Path) -> None:
    rng = random.Random(f"runtime-{schedule}-{draw}")
    plan = _random_plan(rng, schedule)
    assert_same(plan, tmp_path, steps=2)


# -- (c) bad input: one clear line -------------------------------------------------------------


def _cpu_profile(model: str, n: int) -> Profile:
    layers = tuple(LayerProfile(f"l{i}", 1.0, 4.0, 4.0, 4.0, {"cpu": LayerTime(1e-3, 2e-3)}) for i in range(n))
    return Profile(model, 2, layers)


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_plan_for_another_model_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = Plan("gpt2-tiny", (worker([0, 2, 4], ["n0:0", "n0:1"]),), micro_batch_size=2)
    rc = cli.main(["train", *_paths(tmp_path, plan, _cpu_profile("gpt2-tiny", 4)), "--model", "bert-tiny", "--local"])
    assert rc == 2
    assert "the plan is for model 'gpt2-tiny', not 'bert-tiny'" in _one_line(capsys)


def test_profile_with_other_layer_count_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = Plan("gpt2-tiny", (worker([0, 2, 5], ["n0:0", "n0:1"]),), micro_batch_size=2)
    rc = cli.main(["train", *_paths(tmp_path, plan, _cpu_profile("gpt2-tiny", 5)), "--model", "gpt2-tiny", "--local"])
    assert rc == 2
    assert "has 4 layers but the profile has 5" in _one_line(capsys)


def test_more_processes_needed_than_given(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    plan = Plan("gpt2-tiny", (worker([0, 1, 2, 4], ["n0:0", "n0:1", "n0:2"]),), micro_batch_size=2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    rc = cli.main(["train", *_paths(tmp_path, plan, _cpu_profile("gpt2-tiny", 4)), "--model", "gpt2-tiny"])
    assert rc == 2
    assert "runs on 3 devices (n0:0, n0:1, n0:2), one process each, but WORLD_SIZE = 2" in _one_line(capsys)
    with pytest.raises(Exception, match="WORLD_SIZE = 4"):
        check_world_size(plan_layout(plan, 4), 4)


@pytest.mark.parametrize(("schedule", "staleness", "expect"), [
    ("1f1b", 1, "staleness = 1 with schedule '1f1b': the runtime keeps virtual workers of a flushing schedule "
                "exactly synchronous; bounded staleness needs schedule wsp"),
    ("interleaved", 0, "micro_batches = 3: the interleaved schedule sends micro-batches in groups of one per "
                       "device, so micro_batches must be a multiple of the 2 devices; nearest valid: 2 or 4"),
])
def test_unsupported_schedule_or_staleness(schedule: str, staleness: int, expect: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    plan = Plan("gpt2-tiny", (worker([0, 2, 4], ["n0:0", "n0:1"]),), schedule=schedule, micro_batch_size=2,
                micro_batches=3, staleness=staleness)
    rc = cli.main(["train", *_paths(tmp_path, plan, _cpu_profile("gpt2-tiny", 4)), "--model", "gpt2-tiny", "--local"])
    assert rc == 2
    assert expect in _one_line(capsys)


def test_cli_trains_and_writes_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.launch as launch

    real = launch.train_local
    monkeypatch.setattr(launch, "train_local", lambda plan, cfg, **kw: real(plan, cfg, start_method="forkserver", **kw))
    plan = Plan("gpt2-tiny", (worker([0, 2, 4], ["n0:0", "n0:1"]),), micro_batch_size=2, micro_batches=2)
    out = tmp_path / "metrics.json"
    rc = cli.main(["train", *_paths(tmp_path, plan, _cpu_profile("gpt2-tiny", 4)), "--model", "gpt2-tiny", "--local",
                   "--steps", "3", "--warmup", "1", "--threads", "1", "-o", str(out)])
    assert rc == 0
    m = json.loads(out.read_text())
    assert m["world_size"] == 2 and len(m["step_s"]) == 3 and len(m["loss"]) == 3
    # the profile says 1 ms fwd + 2 ms bwd per layer; the simulator's figure is carried through
    assert m["predicted_iteration_s"] == pytest.approx(0.018, rel=0.01)
    assert m["measured_iteration_s"] > 0
    assert [r["device"] for r in m["ranks"]] == ["n0:0", "n0:1"]


def _paths(tmp_path: Path, plan: Plan, profile: Profile) -> list[str]:
    plan.save(tmp_path / "plan.json")
    profile.save(tmp_path / "profile.json")
    return [str(tmp_path / "plan.json"), "--profile", str(tmp_path / "profile.json"), "--cluster", str(CPU_CLUSTER)]



# -- rank layout --------------------------------------------------------------------------------


def test_layout_ranks_and_holder_sets() -> None:
    # worker 0: 2 devices x 2 chunks (interleaved); worker 1: 3 stages cut elsewhere
    plan = Plan("m", (worker([0, 2, 3, 5, 6], ["a:0", "a:1"]), worker([0, 1, 4, 6], ["b:0", "b:1", "b:2"])),
                schedule="interleaved", micro_batches=6, chunks=1)
    with pytest.raises(Exception, match="chunks=1"):
        plan_layout(plan, 6)  # 4 stages on 2 devices need chunks=2
    plan = Plan("m", plan.virtual_workers[:1], schedule="interleaved", micro_batches=2, chunks=2)
    lay = plan_layout(plan, 6)
    assert [(r.device, r.pipe_rank, r.stages) for r in lay.ranks] == [("a:0", 0, (0, 2)), ("a:1", 1, (1, 3))]
    two = Plan("m", (worker([0, 2, 3, 6], ["a:0", "a:1", "a:2"]), worker([0, 1, 4, 6], ["b:0", "b:1", "b:2"])))
    lay = plan_layout(two, 6)
    assert [r.device for r in lay.ranks] == list(two.devices)
    sets = lay.holder_sets()
    # every layer is in exactly one set, each set has one rank per virtual worker
    assert sorted(layer for _, layers in sets for layer in layers) == list(range(6))
    assert sets == [((0, 3), (0,)), ((0, 4), (1,)), ((1, 4), (2,)), ((2, 4), (3,)), ((2, 5), (4, 5))]


@pytest.mark.slow  # (tests/test_nodes.py runs torchrun against --local by default, on two nodes)
def test_torchrun_and_local_train_the_same(tmp_path: Path) -> None:
    import subprocess
    import sys

    plan = Plan("gpt2-tiny", (worker([0, 3, 4], ["n0:0", "n0:1"]),), micro_batch_size=2, micro_batches=3)
    args = _paths(tmp_path, plan, _cpu_profile("gpt2-tiny", 4))
    out = tmp_path / "torchrun.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "-m", "partitioner_cli", "train", *args, "--model", "gpt2-tiny", "--steps", "3", "--warmup", "1",
           "--threads", "1", "-o", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    via_torchrun = json.loads(out.read_text())
    local = train_local(plan, TrainConfig("gpt2-tiny", steps=3, warmup=1, threads=1), start_method="forkserver")
    assert via_torchrun["world_size"] == 2
    assert via_torchrun["loss"] == pytest.approx(local["loss"], rel=1e-6)


# -- WSP ------------------------------------------------------------------------------------------


def wsp_reference(plan: Plan, steps: int, lr: float, seed: int) -> dict[str, torch.Tensor]:
    """The WSP rule of runtime/wsp.py for one device per virtual worker, in one process: worker w
    computes wave c on the global weights of waves <= c - 1 - D plus its own updates of waves
    c - D .. c - 1; after the last wave every update is in."""
    from torch.func import functional_call

    chain = zoo_chain(plan.model, plan.micro_batch_size)
    model = build_stage(chain, 0, chain.num_layers, seed=seed)
    w0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    n_w, m, b, d = len(plan.virtual_workers), plan.micro_batches, plan.micro_batch_size, plan.staleness
    data = make_data(chain, "synthetic", b, m, n_w, seed)
    avg: list[dict[str, torch.Tensor]] = []
    own: list[list[dict[str, torch.Tensor]]] = [[] for _ in range(n_w)]
    for c in range(steps):
        batch = data.global_batch(c)[0]
        for w in range(n_w):
            weights = {}
            for k, v in w0.items():
                x = v.clone()
                for u in avg[:max(0, c - d)]:
                    x = x - lr * u[k]
                for u in own[w][max(0, c - d):c]:
                    x = x - lr * u[k]
                weights[k] = x.requires_grad_(True)
            total = {k: torch.zeros_like(v) for k, v in w0.items()}
            for j in range(m):
                rows = batch[(w * m + j) * b:(w * m + j + 1) * b]
                loss = functional_call(model, weights, (rows,)).float().mean() / m
                for k, g in zip(weights, torch.autograd.grad(loss, list(weights.values())), strict=True):
                    total[k] = total[k] + g
            own[w].append(total)
        avg.append({k: sum(own[w][c][k] for w in range(n_w)) / n_w for k in w0})
    out = {}
    for k, v in w0.items():
        for u in avg:
            v = v - lr * u[k]
        out[k] = v
    return out


LR = 2.0


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_wsp_follows_its_update_rule(staleness: int, tmp_path: Path) -> None:
    plan = Plan("gpt2-tiny", (worker([0, 4], ["n0:0"]), worker([0, 4], ["n0:1"])), schedule="wsp",
                micro_batch_size=2, micro_batches=3, staleness=staleness)
    ref = wsp_reference(plan, 4, LR, 1)
    for got in trained_weights(plan, tmp_path, 4, LR, 1, "synthetic"):
        for k, v in ref.items():
            torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-6, msg=k)
    # (a large step, so that the mean-of-output loss's nearly constant gradients still differ
    # measurably between stale and fresh weights)
    if staleness == 0:  # one device per worker and D = 0: synchronous SGD on the global batch
        sync = reference_weights(plan, 4, LR, 1, "synthetic")
        for k, v in sync.items():
            torch.testing.assert_close(ref[k], v, rtol=1e-4, atol=1e-6)
    else:  # staleness changes the result
        sync = reference_weights(plan, 4, LR, 1, "synthetic")
        assert any(not torch.allclose(ref[k], sync[k], rtol=1e-4, atol=1e-6) for k in ref)


@pytest.mark.parametrize("draw", [0, 1, 2])
def test_wsp_completes_for_random_p_m_staleness(draw: int, tmp_path: Path) -> None:
    rng = random.Random(f"runtime-wsp-{draw}")
    p, m, d = rng.choice([1, 2, 3]), rng.randint(1, 4), rng.randint(0, 2)
    cuts = [0, *sorted(rng.sample(range(1, 22), p - 1)), 22]
    plan = Plan("vgg19-tiny", (worker(cuts, [f"n0:{k}" for k in range(p)]),), schedule="wsp", micro_batch_size=2,
                micro_batches=m, staleness=d)
    cfg = TrainConfig(plan.model, steps=d + 3, warmup=1, threads=1, timeout_s=60)
    metrics = train_local(plan, cfg, start_method="forkserver")
    assert len(metrics["step_s"]) == len(metrics["loss"]) == d + 3
    assert all(t > 0 for t in metrics["step_s"])


def test_wsp_pipelines_cut_differently_end_equal(tmp_path: Path) -> None:
    plan = Plan("gpt2-tiny", (worker([0, 2, 4], ["n0:0", "n0:1"]), worker([0, 1, 4], ["n0:2", "n0:3"])),
                schedule="wsp", micro_batch_size=2, micro_batches=3, staleness=1)
    first, second = trained_weights(plan, tmp_path, 4, 0.05, 1)
    init = build_stage(zoo_chain(plan.model), 0, 4, seed=1).state_dict()
    assert set(first) == set(second) == set(init)
    for k in init:
        torch.testing.assert_close(first[k], second[k], rtol=1e-5, atol=1e-7)
    assert any(not torch.equal(init[k], first[k]) for k in init)


# -- PipeDream-2BW ----------------------------------------------------------------------------------


def twobw_reference(plan: Plan, steps: int, lr: float, seed: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The 2BW rule of runtime/twobw.py in one process: iteration c's gradient is computed on
    W(c - 1) (W(-1) = W(0)) and W(c + 1) = W(c) - lr * that gradient. Returns W(steps) and the
    loss of every iteration."""
    from torch.func import functional_call

    chain = zoo_chain(plan.model, plan.micro_batch_size)
    model = build_stage(chain, 0, chain.num_layers, seed=seed)
    source = make_data(chain, "auto", plan.micro_batch_size, plan.micro_batches, len(plan.virtual_workers), seed)
    versions = [{k: v.detach().clone() for k, v in model.named_parameters()}]
    losses = []
    for c in range(steps):
        used = {k: v.clone().requires_grad_(True) for k, v in versions[max(c - 1, 0)].items()}
        x, y = source.global_batch(c)
        loss = source.loss(functional_call(model, used, (x,)), y)
        grads = dict(zip(used, torch.autograd.grad(loss, list(used.values())), strict=True))
        versions.append({k: versions[-1][k] - lr * grads[k] for k in used})
        losses.append(float(loss))
    return versions[-1], losses


@pytest.mark.parametrize(("cuts", "m"), [([[0, 1, 3, 4]], 2),  # 3 stages, m < p: at most m in flight
                                         ([[0, 2, 4], [0, 1, 4]], 3)])  # 2 virtual workers cut differently
def test_2bw_follows_its_update_rule(cuts: list[list[int]], m: int, tmp_path: Path) -> None:
    workers = tuple(worker(c, [f"n0:{w * (len(c) - 1) + k}" for k in range(len(c) - 1)]) for w, c in enumerate(cuts))
    plan = Plan("gpt2-tiny", workers, schedule="2bw", micro_batch_size=2, micro_batches=m)
    steps, lr = 4, 0.5
    ref, ref_losses = twobw_reference(plan, steps, lr, 1)
    cfg = TrainConfig(plan.model, steps=steps, warmup=0, lr=lr, seed=1, threads=1, timeout_s=60,
                      state_dir=str(tmp_path))
    metrics = train_local(plan, cfg, start_method="forkserver")
    assert metrics["loss"] == pytest.approx(ref_losses, rel=1e-4)
    layout = plan_layout(plan, 4)
    got: list[dict[str, torch.Tensor]] = [{} for _ in plan.virtual_workers]
    for r in layout.ranks:
        for state in torch.load(tmp_path / f"rank{r.rank}.pt").values():
            got[r.worker].update(state)
    for weights in got:
        for k, v in ref.items():
            torch.testing.assert_close(weights[k], v, rtol=1e-4, atol=1e-6, msg=k)
    # the one-step delay is real: synchronous SGD on the same batches ends elsewhere
    sync = reference_weights(plan, steps, lr, 1)
    assert any(not torch.allclose(ref[k], sync[k], rtol=1e-4, atol=1e-6) for k in ref)


def test_train_builds_the_zoo_model_with_the_profiled_shape() -> None:
    from partitioner_cli.train import zoo_options

    profile = _cpu_profile("gpt2-tiny", 4)
    assert zoo_options(profile) == {}
    shaped = Profile("gpt2-tiny", 2, profile.layers,
                     meta={"config": {"blocks": 2, "hidden": 64, "heads": 4, "vocab": 300, "seq_len": 16}})
    assert zoo_options(shaped) == {"num_blocks": 2, "vocab": 300, "seq_len": 16}
    chain = zoo_chain("gpt2-tiny", 2, **zoo_options(shaped))
    assert tuple(chain.make_input(2, "cpu").shape) == (2, 16)


def test_a_seed_gives_the_same_weights_on_every_device() -> None:
    # drawn on the CPU, then moved: the meta device (no values) must not change what is drawn
    chain = zoo_chain("gpt2-tiny")
    a = build_stage(chain, 0, 2, seed=3).state_dict()
    b = build_stage(chain, 0, 2, seed=3, device="cpu").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
