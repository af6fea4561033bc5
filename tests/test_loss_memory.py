"""The training loss's memory: measured on an output, kept on the profile's last layer, priced
on the stage that ends the model alike by the closed form and the simulator."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from partitioner.cluster import Cluster, Node
from partitioner.cost import CostModel
from partitioner.errors import FormatError
from partitioner.importers.sailor import import_sailor_degrees
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.pricing import CostOptions
from partitioner.profile import LayerProfile, Profile
from partitioner.simulate import simulate_plan

SAILOR = Path(__file__).resolve().parents[2] / "shared" / "data" / "sailor_opt350"
FP16 = CostOptions(precision="fp16")
LOSS, WORK = 3.0 * 2**30, 6.0 * 2**30


def test_cross_entropy_keeps_fp32_log_probabilities_and_its_backward_two_more() -> None:
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from partitioner.loss_memory import measure_loss_memory

    b, s, v = 2, 16, 1024
    target = torch.randint(0, v, (b, s))
    full = b * s * v * 4  # the log-probabilities, fp32 whatever the output's type
    for dtype in (torch.float32, torch.bfloat16):
        y = torch.randn(b, s, v, dtype=dtype)
        saved, work = measure_loss_memory(lambda o: F.cross_entropy(o.float().reshape(-1, v), target.reshape(-1)), y)
        assert full <= saved < full * 1.01
        assert 2 * full <= work < 2.01 * full  # the gradients of the log-probabilities and of the logits
    saved, _ = measure_loss_memory(lambda o: o.float().mean(), torch.randn(b, s, v))
    assert saved == 0  # a mean keeps nothing for its backward


def test_the_loss_fields_round_trip_and_belong_to_the_last_layer() -> None:
    head = LayerProfile("head", param_bytes=8.0, saved_bytes=4.0, output_bytes=4.0, loss_saved_bytes=16.0,
                        loss_work_bytes=32.0)
    p = Profile("m", 1, (LayerProfile("a", saved_bytes=1.0), head))
    assert Profile.from_dict(p.to_dict()) == p
    assert "loss_saved_bytes" not in LayerProfile("a").to_dict()
    assert p.layers[1].scaled_bytes(2.0)["loss_saved_bytes"] == 32.0
    with pytest.raises(FormatError, match=r"layers\[0\]\.loss_saved_bytes.*last layer"):
        Profile("m", 1, (head, LayerProfile("b")))
    with pytest.raises(FormatError, match="loss_work_bytes"):
        LayerProfile.from_dict({"name": "h", "loss_work_bytes": -1})


@pytest.fixture(scope="module")
def opt350() -> Profile:
    if not SAILOR.is_dir():
        pytest.skip("shared Sailor profiles not present")
    return import_sailor_degrees(SAILOR, micro_batch_size=1)


def _with_loss(p: Profile) -> Profile:
    return replace(p, layers=(*p.layers[:-1], replace(p.layers[-1], loss_saved_bytes=LOSS, loss_work_bytes=WORK)))


def _cluster() -> Cluster:
    return Cluster("c", tuple(Node(f"n{i}", ("A100-80",) * 4, 100.0) for i in range(2)), 10.0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("modes", [("none", "none", "none"), ("none", "selective", "full"), ("full",) * 3])
@pytest.mark.parametrize("devices", [("n0:0", "n0:1", "n1:0"), ("n0:0", "n0:1-2", "n1:0-1")])
def test_closed_form_and_simulator_price_the_loss_alike(opt350: Profile, schedule: str, modes: tuple[str, ...],
                                                       devices: tuple[str, ...]) -> None:
    cl, p = _cluster(), _with_loss(opt350)
    cuts = [(0, 9), (9, 17), (17, 26)]
    plan = Plan(p.model, (VirtualWorker(tuple(Stage(r, d, recompute=m) for r, d, m in
                                              zip(cuts, devices, modes, strict=True))),), schedule, 1, 8)
    plan.validate(p, cl)
    with_loss, without = CostModel(p, cl, FP16), CostModel(opt350, cl, FP16)
    tl = simulate_plan(plan, p, cl, FP16)
    assert with_loss.plan_memory_bytes(plan) == pytest.approx(dict(tl.peak_memory_bytes), rel=1e-9)
    a, b = with_loss.plan_memory_bytes(plan), without.plan_memory_bytes(plan)
    for d in devices[:-1]:
        assert a[d] == b[d]  # only the stage that ends the model computes the loss
    last = devices[-1]
    in_flight = 8 if schedule == "gpipe" else 1  # 1F1B: the last stage has one micro-batch in flight
    assert a[last] - b[last] == pytest.approx(LOSS * in_flight + WORK, rel=1e-9)


def test_a_zoo_profile_measures_its_loss() -> None:
    pytest.importorskip("torch")
    import tempfile

    from partitioner_cli.main import main
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "p.json"
        assert main(["profile", "gpt2-tiny", "--micro-batch-size", "2", "--seq-len", "16", "--repeats", "1",
                     "--warmup", "0", "-q", "-o", str(out)]) == 0
        p = Profile.load(out)
    head = p.layers[-1]
    vocab = int(p.meta["config"]["vocab"])
    assert head.output_bytes == 2 * 16 * vocab * 4
    assert 2 * 16 * vocab * 4 <= head.loss_saved_bytes < 1.01 * 2 * 16 * vocab * 4
    assert head.loss_work_bytes >= 2 * head.loss_saved_bytes * 0.99
    assert all(la.loss_saved_bytes == 0 for la in p.layers[:-1])
