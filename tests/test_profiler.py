"""The profiler: FLOPs, saved/param/output bytes checked against hand counts, the CLI."""

from __future__ import annotations

import json
from collections import OrderedDict

import pytest
import torch
from torch import nn

from partitioner.errors import PartitionerError
from partitioner.models import build_model
from partitioner.profile import Profile
from partitioner.profiler import analyze_layers, profile_model
from partitioner.projection.operators import OperatorTable
from partitioner_cli import main as cli

B, IN, OUT = 4, 32, 16


@pytest.fixture()
def run_cli(monkeypatch):
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("partitioner_cli.profile",))
    return cli.main


class Square(nn.Module):
    def forward(self, x):
        return x * x  # autograd saves x twice: one storage


class Sorts(nn.Module):
    def forward(self, x):
        return torch.sort(x, dim=1).values  # an operator fvcore has no counter for


def _chain():
    return nn.Sequential(OrderedDict([
        ("fc", nn.Linear(IN, OUT)), ("relu", nn.ReLU()), ("sq", Square()), ("sort", Sorts())]))


def test_counts_match_hand_counts():
    p = profile_model(_chain(), torch.randn(B, IN), warmup=1, repeats=3, model_name="toy")
    fc, relu, sq, srt = p.layers
    assert p.micro_batch_size == B and [layer.name for layer in p.layers] == ["fc", "relu", "sq", "sort"]
    assert fc.flops == 2 * B * IN * OUT                       # multiply-adds x 2
    assert fc.param_bytes == 4 * (IN * OUT + OUT)
    assert fc.saved_bytes == 4 * B * IN                       # the input; the weight is a parameter
    assert relu.saved_bytes == 4 * B * OUT                    # relu keeps its output
    assert sq.saved_bytes == 4 * B * OUT                      # x saved twice, counted once
    assert all(layer.output_bytes == 4 * B * OUT for layer in (fc, relu, sq, srt))
    for layer in p.layers:
        t = layer.times["cpu"]
        assert t.fwd_s > 0 and t.bwd_s > 0 and not t.projected and t.measured_on == "cpu"
    # fvcore cannot count sort: reported, not fatal.
    assert srt.flops == 0 and "aten::sort" in p.meta["unsupported_ops"]["sort"]
    assert p.meta["measured_on"] == {"cpu": "cpu"}


def test_meta_analysis_agrees_with_measurement():
    m = build_model("gpt2-tiny", 2)
    p = profile_model(m.layers, m.sample_input(), warmup=0, repeats=3, model_name="gpt2-tiny")
    mm = build_model("gpt2-tiny", 2, device="meta")
    stats = analyze_layers(mm.layers, mm.sample_input("meta"))
    for layer, s in zip(p.layers, stats, strict=True):
        assert (layer.name, layer.flops, layer.param_bytes, layer.saved_bytes, layer.output_bytes) == \
               (s.name, s.flops, s.param_bytes, s.saved_bytes, s.output_bytes)
    # A block's matmul FLOPs are 24 b s h^2 + 4 b s^2 h; fvcore adds a little for LayerNorm.
    b, s, h = 2, m.config["seq_len"], m.config["hidden"]
    matmul = 24 * b * s * h * h + 4 * b * s * s * h
    assert matmul <= p.layers[1].flops <= 1.02 * matmul


def test_bad_layer_lists():
    with pytest.raises(PartitionerError, match="twice"):
        profile_model([("a", nn.ReLU()), ("a", nn.ReLU())], torch.randn(2, 3))
    with pytest.raises(PartitionerError, match="one tensor"):
        profile_model([nn.LSTM(3, 3)], torch.randn(2, 4, 3))


def test_cli_profile_then_project(tmp_path, run_cli, capsys):
    out = tmp_path / "p.json"
    rc = run_cli(["profile", "bert-tiny", "--micro-batch-size", "2", "--seq-len", "8", "--repeats", "3",
                  "--warmup", "1", "--gpu-type", "T4", "-o", str(out)])
    assert rc == 0
    p = Profile.load(out)
    assert p.gpu_types == ("cpu", "T4") and not p.is_projected("cpu") and p.is_projected("T4")
    # a zoo transformer records its operators; from the CPU (not a GPU type) the operator model
    # alone gives the GPU's times: nothing measured on the CPU is carried over
    assert OperatorTable.from_dict(p.meta["operators"]).names == tuple(x.name for x in p.layers)
    assert all(layer.times["T4"].measured_on == "" and layer.times["T4"].expected_error is not None
               for layer in p.layers)
    assert p.meta["projections"]["T4"]["method"] == "operators, model alone"
    out2 = tmp_path / "q.json"
    assert run_cli(["profile", "project", str(out), "--gpu-type", "TITAN-V", "-o", str(out2)]) == 0
    assert Profile.load(out2).gpu_types == ("cpu", "T4", "TITAN-V")
    # the per-layer roofline stays available, calibrated on the CPU's best layers
    out3 = tmp_path / "r.json"
    assert run_cli(["profile", "project", str(out), "--gpu-type", "TITAN-V", "--method", "roofline",
                    "-o", str(out3)]) == 0
    r = Profile.load(out3)
    assert all(layer.times["TITAN-V"].measured_on == "cpu" and layer.times["TITAN-V"].expected_error is None
               for layer in r.layers)


def test_cli_analytic(tmp_path, run_cli):
    out = tmp_path / "a.json"
    assert run_cli(["profile", "vgg19-tiny", "--micro-batch-size", "4", "--analytic", "--gpu-type", "RTX-2060",
                    "-o", str(out)]) == 0
    p = Profile.load(out)
    assert p.gpu_types == ("RTX-2060",) and p.is_projected("RTX-2060")
    # Analytic counts at batch 1 scaled to 4 agree with a real measurement's counts at batch 4.
    m = build_model("vgg19-tiny", 4)
    stats = analyze_layers(m.layers, m.sample_input())
    for layer, s in zip(p.layers, stats, strict=True):
        assert layer.flops == pytest.approx(s.flops) and layer.saved_bytes == pytest.approx(s.saved_bytes)


def test_cli_errors(tmp_path, run_cli, capsys):
    out = tmp_path / "big.json"
    assert run_cli(["profile", "gpt2-xl", "--micro-batch-size", "100000", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "does not fit" in err and "100000" in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert run_cli(["profile", "no-such-model", "--micro-batch-size", "1", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "vgg19" in err and len(err.strip().splitlines()) == 1
    assert run_cli(["profile", "gpt2-tiny", "--micro-batch-size", "1", "--analytic", "-o", str(out)]) == 2


def test_profile_json_round_trip(tmp_path):
    p = profile_model(_chain(), torch.randn(B, IN), warmup=0, repeats=3, model_name="toy")
    path = tmp_path / "toy.json"
    p.save(path)
    assert Profile.load(path) == Profile.from_dict(json.loads(path.read_text()))
    assert Profile.load(path).layers == p.layers


@pytest.mark.parametrize("b, s", [(2, 32), (3, 17)])
def test_saved_bytes_of_a_transformer_block_match_the_analytic_count(b, s):
    # Pre-LN block, fp32: kept for backward are x, ln1(x), qkv (one storage for q, k, v),
    # the attention probabilities (a b s^2), the attention output, x + attn, ln2(.), fc1's
    # output and gelu's output (4 b s h each): 16 b s h + a b s^2 floats; plus the causal
    # mask (s^2 bools) and LayerNorm mean/rstd (2 b s floats per LayerNorm).
    m = build_model("gpt2-tiny", b, seq_len=s, device="meta")
    h, a = m.config["hidden"], m.config["heads"]
    stats = analyze_layers(m.layers, m.sample_input("meta"), count_flops=False)
    expected = 4 * (16 * b * s * h + a * b * s * s) + s * s + 4 * 4 * b * s
    assert [x.saved_bytes for x in stats[1:-1]] == [expected] * m.config["blocks"]


def test_interrupted_profile_keeps_the_old_file(tmp_path, run_cli, monkeypatch):
    import partitioner.profiler as profiler_mod

    out = tmp_path / "p.json"
    out.write_text("old contents\n")

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(profiler_mod, "profile_model", boom)
    assert run_cli(["profile", "gpt2-tiny", "--micro-batch-size", "1", "-o", str(out)]) == 130
    assert out.read_text() == "old contents\n" and [p.name for p in tmp_path.iterdir()] == ["p.json"]


@pytest.mark.parametrize("name", ["vgg19-tiny", "resnet50-tiny", "gpt2-tiny"])
def test_shared_saved_bytes_make_stage_sums_exact(name):
    """Per-layer saved bytes, less what adjacent layers share, add up to what autograd keeps
    over one forward of the whole chain (a ReLU's saved output is the next conv's saved input)."""
    from partitioner.profiler import saved_tensor_bytes

    model = build_model(name, 2)
    stats = analyze_layers(model.layers, model.sample_input("cpu"), count_flops=False)
    x = model.sample_input("cpu")
    _, whole = saved_tensor_bytes(model.sequential(), x.detach().requires_grad_(x.is_floating_point()))
    assert sum(s.saved_bytes - s.shared_saved_bytes for s in stats) == whole
    assert stats[0].shared_saved_bytes == 0
    if name.startswith("vgg"):
        assert any(s.shared_saved_bytes > 0 for s in stats)  # ReLU output = next conv's input


def test_half_precision_input_keeps_token_ids_that_half_types_cannot_hold() -> None:
    from partitioner.profiler import half_input

    ids = torch.tensor([[0.0, 2049.0, 50271.0]])  # token ids carried as floats
    assert half_input(ids, torch.float16).dtype == torch.float32  # 2049 and 50271 are not exact in fp16
    small = torch.tensor([[0.0, 7.0, 255.0]])  # integers fp16 holds exactly: converted
    assert half_input(small, torch.float16).dtype == torch.float16
    image = torch.randn(2, 3, 4, 4)
    assert half_input(image, torch.bfloat16).dtype == torch.bfloat16
    assert half_input(image, None) is image
