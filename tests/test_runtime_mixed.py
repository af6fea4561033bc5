"""Mixed precision holds what the cost model counts (runtime/master.py): half weights and
gradients, an fp32 master copy (divided between the holders under ZeRO); checkpoints hold the
masters; tensor-parallel shards train through masters of their own."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.pricing import CostOptions
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner.profiler import analyze_layers, half_input
from partitioner_cli import main as cli
from runtime.checkpoint import load_state, restore
from runtime.launch import TrainConfig, train_local
from runtime.master import MasterStep, half_stages
from runtime.named_state import model_key
from runtime.stage import build_stage, zoo_chain

ROOT = Path(__file__).resolve().parent.parent
CPU_CLUSTER = ROOT / "examples" / "clusters" / "cpu4.yaml"
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def worker(cuts: list[int], devices: list[str]) -> VirtualWorker:
    return VirtualWorker(tuple(Stage((a, b), devices[k % len(devices)])
                               for k, (a, b) in enumerate(itertools.pairwise(cuts))))


def two_workers(precision: str, zero: int = 0) -> Plan:
    """Data parallel 2 x 2 stages of GPT-2 tiny, Adam, priced in ``precision``."""
    return Plan("gpt2-tiny", (worker([0, 2, 4], ["n0:0", "n0:1"]), worker([0, 2, 4], ["n0:2", "n0:3"])),
                micro_batch_size=2, micro_batches=2, pricing=CostOptions(precision=precision, zero=zero))


def _profile(precision: str) -> Profile:
    """GPT-2 tiny's layers measured for memory on the CPU (no timing) as ``partitioner profile
    --dtype`` measures them (cast to the half type under bf16), with its loss's memory."""
    from partitioner.models import build_model
    from runtime.data import with_loss_memory
    from runtime.stage import LayerChain

    m = build_model("gpt2-tiny", 2)
    half = HALF.get(precision)
    for _, layer in m.layers:
        layer.to(half or torch.float32)
    x = half_input(m.sample_input("cpu"), half)
    stats = analyze_layers(m.layers, x, count_flops=False)
    profile = Profile("gpt2-tiny", 2, tuple(
        LayerProfile(s.name, 0.0, s.param_bytes, s.saved_bytes, s.output_bytes, {"cpu": LayerTime(1e-3, 2e-3)},
                     shared_saved_bytes=s.shared_saved_bytes) for s in stats),
        dtype=str(half or torch.float32).replace("torch.", ""))
    with torch.no_grad():
        for _, layer in m.layers:
            x = layer(x)
    return with_loss_memory(profile, LayerChain("gpt2-tiny", list(m.layers), m.make_input, dict(m.config)), x)


@pytest.mark.parametrize(("precision", "zero"), [("fp32", 0), ("bf16", 0), ("bf16", 1)])
def test_train_holds_the_model_state_the_cost_model_prices(precision: str, zero: int, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Per rank, the bytes of its weights, gradients, masters and Adam state after `train` equal the
    cost model's for its layers: 16 bytes per parameter in fp32 (4 + 4 + 8) and in bf16 (2 + 2 + a
    4-byte master + 8), 10 in bf16 under ZeRO-1 over two holders (2 + 2 + (4 + 8) / 2)."""
    import runtime.launch as launch

    real = launch.train_local
    monkeypatch.setattr(launch, "train_local", lambda plan, cfg, **kw: real(plan, cfg, start_method="forkserver", **kw))
    two_workers(precision, zero).save(tmp_path / "plan.json")
    _profile(precision).save(tmp_path / "profile.json")
    out = tmp_path / "m.json"
    assert cli.main(["train", str(tmp_path / "plan.json"), "--profile", str(tmp_path / "profile.json"), "--cluster",
                     str(CPU_CLUSTER), "--model", "gpt2-tiny", "--local", "--steps", "2", "--warmup", "0",
                     "--threads", "1", "-o", str(out)]) == 0
    m = json.loads(out.read_text())
    assert (m["precision"], m["zero"]) == (precision, zero)
    n0 = sum(p.numel() for p in build_stage(zoo_chain("gpt2-tiny", 2), 0, 2).parameters())
    per_param = 10 if zero else 16
    for r in m["memory"]["ranks"]:
        assert r["model_state_bytes"] == pytest.approx(r["predicted_model_state_bytes"], rel=2e-3)
    assert m["memory"]["ranks"][0]["model_state_bytes"] == pytest.approx(per_param * n0, rel=2e-3)
    # the activations held (runtime/memory.py) are those of the half model the profile measured:
    # measured peak (model state + activations) against the simulator's, as bench/levers_runtime.py
    for r in m["memory"]["ranks"]:
        assert r["measured_bytes"] == pytest.approx(r["predicted_bytes"], rel=0.2), r


def test_half_activations_are_half_the_fp32_ones() -> None:
    """A first stage's activation peak (runtime/memory.py) under bf16 is half its fp32 one: the
    half model keeps half tensors (under autocast fp32 inputs were kept besides, and half copies of
    the weights); the last stage's less than 0.7 of it (the loss keeps its log-probabilities in fp32)."""
    cfg = dict(steps=1, warmup=0, lr=0.001, seed=1, threads=1, timeout_s=120, data="text", progress=False)
    peaks = {}
    for precision in ("fp32", "bf16"):
        m = train_local(two_workers(precision), TrainConfig("gpt2-tiny", **cfg),  # type: ignore[arg-type]
                        start_method="forkserver")
        peaks[precision] = [r["activation_peak_bytes"] for r in m["ranks"]]
    for rank, (fp32, bf16) in enumerate(zip(peaks["fp32"], peaks["bf16"], strict=True)):
        low, high = (0.45, 0.55) if rank in (0, 2) else (0.45, 0.7)  # ranks 0 and 2 hold the first stages
        assert low * fp32 < bf16 < high * fp32, peaks


def test_a_mixed_precision_checkpoint_holds_the_masters_and_resumes_exactly(tmp_path: Path) -> None:
    """A bf16 run's checkpoint holds the fp32 masters (not the half weights) and their Adam state:
    resumed, the run ends with the masters of a run never interrupted, bit for bit; the checkpoint
    loads into an fp32 model (the masters themselves) and into a bf16 one (masters exact, weights
    their rounding)."""
    plan = two_workers("bf16")
    cfg = dict(warmup=0, lr=0.01, seed=1, threads=1, timeout_s=120, data="text", progress=False)
    ckpt = tmp_path / "ckpt"
    train_local(plan, TrainConfig("gpt2-tiny", steps=2, checkpoint_dir=str(ckpt), **cfg),  # type: ignore[arg-type]
                start_method="forkserver")
    for name, state_dir, extra in (("resumed", tmp_path / "a", {"checkpoint_dir": str(ckpt), "resume": True}),
                                   ("straight", tmp_path / "b", {})):
        state_dir.mkdir()
        run = train_local(plan, TrainConfig("gpt2-tiny", steps=4, state_dir=str(state_dir), **cfg, **extra),  # type: ignore[arg-type]
                          start_method="forkserver")
        if name == "resumed":
            assert run["first_step"] == 2
            resumed_loss = run["loss"]
        else:
            assert resumed_loss == run["loss"][2:]
    a, b = (torch.load(d / "rank0.pt")[0] for d in (tmp_path / "a", tmp_path / "b"))
    assert all(v.dtype == torch.float32 and torch.equal(v, b[k]) for k, v in a.items())

    saved = load_state(str(ckpt), 2)
    chain = zoo_chain("gpt2-tiny", 2)
    fp32 = build_stage(chain, 0, 2, seed=5)
    by_layer = dict(enumerate(fp32))
    restore(str(ckpt), 2, 0, by_layer, None)
    half = build_stage(chain, 0, 2, seed=5)
    half_stages([half], torch.bfloat16)
    step = MasterStep(half.parameters(), "adam", 0.01)
    restore(str(ckpt), 2, 0, dict(enumerate(half)), step)
    masters = step.master_of()
    for layer, (mf, mh) in enumerate(zip(fp32, half, strict=True)):
        for (name, pf), (_, ph) in zip(mf.named_parameters(), mh.named_parameters(), strict=True):
            stored = saved[model_key(layer, name)]
            assert stored.dtype == torch.float32
            assert torch.equal(pf.detach(), stored) and torch.equal(masters[id(ph)].detach(), stored)
            assert ph.dtype == torch.bfloat16 and torch.equal(ph.detach(), stored.to(torch.bfloat16))
            assert not torch.equal(stored, stored.to(torch.bfloat16).float())  # the masters are finer than bf16
            assert set(step.state[masters[id(ph)]]) == {"step", "exp_avg", "exp_avg_sq"}


def test_a_tensor_parallel_group_trains_its_shards_through_masters_of_their_own(tmp_path: Path) -> None:
    """bf16 on a tensor-parallel group of 2 (DTensor shards with DTensor masters): the masters it
    saves are fp32 and near those of the run without tensor parallelism (the partial sums are
    rounded to bf16 before they are added: every tensor within 5% of how far SGD moved it), the
    losses too."""
    def plan(first: str) -> Plan:
        return Plan("gpt2-tiny", (VirtualWorker((Stage((0, 3), first), Stage((3, 4), "n0:2"))),), "1f1b", 2, 2,
                    pricing=CostOptions(precision="bf16"))

    runs = {}
    for name, first in (("tp", "n0:0-1"), ("plain", "n0:0")):
        root = tmp_path / name
        root.mkdir()
        m = train_local(plan(first), TrainConfig("gpt2-tiny", steps=3, warmup=0, lr=0.1, seed=1, threads=1, optimizer="sgd",
                                                 timeout_s=120, data="text", state_dir=str(root), progress=False),
                        start_method="forkserver")
        runs[name] = (m["loss"], torch.load(root / "rank0.pt")[0])
    (tp_loss, tp), (loss, plain) = runs["tp"], runs["plain"]
    assert tp_loss == pytest.approx(loss, rel=1e-2)
    init = build_stage(zoo_chain("gpt2-tiny", 2), 0, 3, seed=1).to(torch.bfloat16).float().state_dict()
    for k, v in tp.items():
        assert v.dtype == torch.float32 and v.shape == plain[k].shape
        moved = float((plain[k] - init[k]).abs().max())
        assert moved > 0 and float((v - plain[k]).abs().max()) <= 0.05 * moved, k


def test_a_cnn_takes_its_images_in_the_half_type() -> None:
    """VGG-19 tiny on its image task in bf16: the first stage casts the fp32 images to bf16 as it
    takes them (runtime.master.half_stages), and the first step's loss (before any update) is
    fp32's to the rounding of a bf16 forward."""
    losses = {}
    for precision in ("fp32", "bf16"):
        plan = Plan("vgg19-tiny", (VirtualWorker((Stage((0, 11), "n0:0"), Stage((11, 22), "n0:1"))),), "1f1b", 2, 2,
                    pricing=CostOptions(precision=precision))
        m = train_local(plan, TrainConfig("vgg19-tiny", steps=1, warmup=0, seed=1, threads=1, timeout_s=120,
                                          progress=False), start_method="forkserver")
        assert (m["precision"], m["data"]) == (precision, "classes")
        losses[precision] = m["loss"][0]
    assert losses["bf16"] != losses["fp32"]
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=2e-2)


def test_gradients_are_exchanged_in_the_priced_precision(tmp_path: Path) -> None:
    """fp32 training priced with ``allreduce_precision`` bf16 (2 bytes per gradient element on the
    wire): the data-parallel average is taken in bf16 and rounded back, so the weights move a
    little otherwise than the plain fp32 run's, and near them."""
    runs = {}
    for name, options in (("plain", CostOptions(optimizer_state_factor=0.0)),
                          ("bf16 wire", CostOptions(optimizer_state_factor=0.0, allreduce_precision="bf16"))):
        root = tmp_path / name.replace(" ", "-")
        root.mkdir()
        plan = Plan("gpt2-tiny", two_workers("fp32").virtual_workers, micro_batch_size=2, micro_batches=2,
                    pricing=options)
        m = train_local(plan, TrainConfig("gpt2-tiny", steps=2, warmup=0, lr=0.1, seed=1, threads=1, timeout_s=120,
                                          data="text", state_dir=str(root), progress=False), start_method="forkserver")
        runs[name] = (m["loss"], torch.load(root / "rank0.pt")[0])
    (loss, plain), (wire_loss, wire) = runs["plain"], runs["bf16 wire"]
    assert wire_loss[0] == loss[0]  # the same forward before any step
    init = build_stage(zoo_chain("gpt2-tiny", 2), 0, 2, seed=1).state_dict()
    assert any(not torch.equal(wire[k], plain[k]) for k in plain)
    for k in plain:
        moved = float((plain[k] - init[k]).abs().max())
        assert float((wire[k] - plain[k]).abs().max()) <= 0.02 * moved + 1e-7, k


def test_the_master_step_chunk_by_chunk_is_one_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """MasterStep converts the gradients to fp32 a chunk at a time: with chunks of 100 elements
    (every tensor of GPT-2 tiny's block alone, or a few together) Adam gives the masters and the
    half weights of one whole step, bit for bit, and its state counts one step per step."""
    import runtime.master as master

    chain = zoo_chain("gpt2-tiny", 2)
    steps = []
    for chunk in (master.CHUNK_ELEMENTS, 100):
        monkeypatch.setattr(master, "CHUNK_ELEMENTS", chunk)
        block = build_stage(chain, 1, 2, seed=3)
        half_stages([block], torch.bfloat16)
        step = MasterStep(block.parameters(), "adam", 0.01)
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            for p in block.parameters():
                p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
            step.step()
            step.zero_grad()
        steps.append((block, step))
    (whole, a), (chunked, b) = steps
    for p in chunked.parameters():
        p.grad = torch.zeros_like(p)
    assert len(list(b._chunks())) > 10  # (the chunks the steps were taken in)
    for pa, pb, ma, mb in zip(whole.parameters(), chunked.parameters(), a.masters, b.masters, strict=True):
        assert torch.equal(pa, pb) and torch.equal(ma, mb) and pb.dtype == torch.bfloat16 and mb.dtype == torch.float32
        assert float(b.state[mb]["step"]) == 3.0
