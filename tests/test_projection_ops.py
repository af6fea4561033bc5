"""Per-operator projection: the decomposition's counts, the pricing, the fit that never sees the
held-out type, and the profile fields it writes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from partitioner.cluster import resolve_gpu_type
from partitioner.errors import FormatError, PartitionerError
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner.projection.evaluation import (
    SailorConfig,
    allreduce_from_embedding,
    class_errors,
    evaluate,
    loto_fits,
    sailor_configs,
    structures,
)
from partitioner.projection.fit import Sample, fit_params, leave_one_type_out, predict_samples
from partitioner.projection.operator_model import (
    AllReduce,
    Calibration,
    Measured,
    OpModelParams,
    Rates,
    anchored_s,
    default_calibration,
    expected_error,
    gemm_rate,
    has_operators,
    layer_time_s,
    op_mix,
    project_with_ops,
    wave_efficiency,
)
from partitioner.projection.operators import (
    LayerOps,
    Op,
    OperatorTable,
    TransformerShape,
    block_ops,
    embedding_ops,
    head_ops,
    transformer_ops,
    zoo_ops,
)

SAILOR = Path(__file__).parent / "data" / "sailor_opt350"
OPT = TransformerShape(hidden=1024, heads=16, seq_len=2048, vocab=50272)
GEMMS = ("gemm", "bgemm")


# -- the decomposition -----------------------------------------------------------------------


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("b", [1, 3])
def test_block_flops_are_the_analytic_count(b, t):
    s, h = OPT.seq_len, OPT.hidden
    layer = LayerOps("block", block_ops(OPT, b, t))
    fwd = layer.flops("fwd", GEMMS)
    assert fwd == pytest.approx((24 * b * s * h * h + 4 * b * s * s * h) / t, rel=1e-12)
    assert layer.flops("bwd", GEMMS) == pytest.approx(2 * fwd, rel=1e-12)  # input and weight gradients
    rc = LayerOps("block", block_ops(OPT, b, t, recompute=True))
    assert rc.flops("bwd", GEMMS) == pytest.approx(3 * fwd, rel=1e-12)  # the forward again, then backward
    # Megatron sharding: two all-reduces of b s h elements forward, two backward (none when recomputing)
    for phase in ("fwd", "bwd"):
        ars = [op for op in rc.phase(phase) if op.kind == "allreduce"]
        assert len(ars) == (0 if t == 1 else 2)
        assert all(op.comm_bytes == b * s * h * 4 and op.group == t for op in ars)


def test_head_and_embedding_counts():
    b, t = 2, 4
    head = LayerOps("head", head_ops(OPT, b, t))
    v_t = -(-OPT.vocab // t)
    assert head.flops("fwd", GEMMS) == 2 * b * OPT.seq_len * OPT.hidden * v_t
    assert head.flops("bwd", GEMMS) == 2 * head.flops("fwd", GEMMS)
    # the cross-entropy reads and writes the logits in float32 whatever the training type
    ce = [op for op in head_ops(OPT, b, t, dtype="float16") if op.name.startswith("ce_sub_exp")]
    assert ce[0].act_bytes == b * OPT.seq_len * v_t * 4 * 4
    emb = LayerOps("embed", embedding_ops(OPT, b, t))
    assert emb.flops("fwd", GEMMS) == 0
    assert [op.name for op in emb.ops if op.kind == "allreduce"] == ["embedding_allreduce"]


@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny"])
def test_zoo_decomposition_matches_fvcore(name):
    torch = pytest.importorskip("torch")
    fvcore = pytest.importorskip("fvcore.nn")
    from partitioner.models import build_model

    m = build_model(name, 3, device="meta")
    table = zoo_ops(name, m.config, 3, [n for n, _ in m.layers])
    assert table is not None
    x = m.sample_input("meta")
    for (layer_name, module), ops in zip(m.layers, table.layers, strict=True):
        fa = fvcore.FlopCountAnalysis(module, (x,))
        fa.unsupported_ops_warnings(False)
        fa.uncalled_modules_warnings(False)
        counted = 2 * sum(v for k, v in fa.by_operator().items() if k in ("linear", "matmul", "addmm", "bmm", "mm"))
        assert ops.name == layer_name
        assert ops.flops("fwd", GEMMS) == counted  # fvcore counts one per multiply-add
        with torch.no_grad():
            x = module(x)
    assert zoo_ops("vgg19-tiny", {}, 2, ["conv0"]) is None


def test_operator_table_round_trip_and_scaling():
    names = ["embed", *[f"block{i}" for i in range(3)], "head"]
    table = transformer_ops(OPT, 2, names, tensor_parallel=2, recompute=True)
    d = json.loads(json.dumps(table.to_dict()))
    assert len(d["ops"]) == 3  # the blocks share one list
    assert OperatorTable.from_dict(d) == table
    double = table.at_size(4)
    assert double == transformer_ops(OPT, 4, names, tensor_parallel=2, recompute=True).at_size(4)
    assert double.layers[1].flops("fwd") == pytest.approx(2 * table.layers[1].flops("fwd"))
    qkv = next(op for op in double.layers[1].ops if op.name == "qkv")
    assert qkv.gemm == (1, 4 * OPT.seq_len, 3 * OPT.hidden // 2, OPT.hidden)
    with pytest.raises(FormatError, match="not an operator field"):
        Op.from_dict({"name": "x", "kind": "gemm", "phase": "fwd", "flop": 1})
    with pytest.raises(FormatError, match="kind"):
        Op("x", "conv", "fwd")


# -- pricing ---------------------------------------------------------------------------------


def test_wave_efficiency():
    assert wave_efficiency((1, 128 * 108, 128, 4096), 108) == pytest.approx(1.0)
    assert wave_efficiency((1, 128 * 109, 128, 4096), 108) == pytest.approx(109 / 216)
    assert wave_efficiency((1, 64, 128, 4096), 1) == pytest.approx(0.5)  # a half-filled tile
    assert wave_efficiency((1, 128, 128, 4096), 108) == pytest.approx(8 / 108)  # split-K in 8 chunks of 512
    assert wave_efficiency(None, 108) == wave_efficiency((1, 1, 1, 1), 0) == 1.0


def test_gemms_take_the_faster_path():
    p = OpModelParams(gemm_tensor_fraction=0.6, gemm_cuda_fraction=1.1)
    a100, r3090, v100 = (Rates.of(resolve_gpu_type(n), "tf32") for n in ("A100-SXM4-40GB", "RTX-3090", "V100-SXM2-16GB"))
    assert gemm_rate(a100, p) == pytest.approx(0.6 * 155.93472e12)
    assert gemm_rate(r3090, p) == pytest.approx(1.1 * 35.58e12)  # its TF32 tensor rate is no faster than FP32
    assert gemm_rate(v100, p) == pytest.approx(1.1 * 15.6672e12)  # no TF32 on Volta
    assert Rates.of(resolve_gpu_type("RTX-2080"), "fp16").tensor_flops_per_s == pytest.approx(40.27392e12)


def test_allreduce_interpolates_through_zero():
    ar = AllReduce({2: ((1e6, 1e-3), (3e6, 2e-3))})
    assert ar.time_s(5e5, 2) == pytest.approx(0.5e-3)
    assert ar.time_s(2e6, 2) == pytest.approx(1.5e-3)
    assert ar.time_s(5e6, 2) == pytest.approx(3e-3)
    assert ar.time_s(1e6, 1) == 0.0
    with pytest.raises(PartitionerError, match="group of 4"):
        ar.time_s(1e6, 4)


def test_projecting_a_type_onto_itself_returns_its_times():
    cal = default_calibration()
    rates = Rates.of(resolve_gpu_type("A100-SXM4-40GB"), cal.math)
    for layer in transformer_ops(OPT, 2, ["embed", "block0", "head"], tensor_parallel=2).layers:
        ar = AllReduce({2: ((8e6, 3e-4),)})
        for phase, t in (("fwd", 0.01), ("bwd", 0.025)):
            assert anchored_s(layer, phase, [Measured(t, rates, ar)], rates, ar, cal) == pytest.approx(t)
    # and through a profile: the V100-SXM2-32GB has the measured 16 GB part's rates
    prof = _sailor_profile("V100-16")
    out = project_with_ops(prof, ["V100-SXM2-32GB"])
    for layer in out.layers:
        a, b = layer.times["V100-SXM2-16GB"], layer.times["V100-SXM2-32GB"]
        assert b.fwd_s == pytest.approx(a.fwd_s) and b.bwd_s == pytest.approx(a.bwd_s)
        assert b.projected and b.measured_on == "V100-16" and b.expected_error is not None


def test_op_mix_and_expected_error():
    cal = default_calibration()
    rates = Rates.of(resolve_gpu_type("V100-SXM2-16GB"), cal.math)
    block = transformer_ops(OPT, 1, ["block0"], recompute=True).layers[0]
    mix = op_mix(block.ops, rates, cal.params)
    assert sum(mix.values()) == pytest.approx(1.0)
    assert mix["gemm"] > mix["overhead"]
    err = expected_error(block, rates, cal)
    assert err == pytest.approx(sum(mix[k] * cal.class_error[k] for k in mix))
    assert expected_error(block, rates, cal, anchored=False) >= 0


# -- fitting -----------------------------------------------------------------------------------


def _synthetic_samples(truth: OpModelParams, types: tuple[str, ...]) -> list[Sample]:
    out = []
    for name in types:
        dev = resolve_gpu_type(name)
        for b in (1, 4):
            table = transformer_ops(OPT, b, ["embed", "block0", "head"], recompute=True)
            for layer in table.layers:
                for phase in ("fwd", "bwd"):
                    s = Sample(dev.name, dev, layer, phase, 1.0)
                    t = float(predict_samples([s], truth, "tf32")[0])
                    out.append(replace(s, measured_s=t))
    return out


def test_fit_recovers_the_constants_it_was_made_with():
    truth = OpModelParams(0.55, 1.05, 1.1, 0.8, 0.95, 6e-6, 1.2e-4, 0.9e-4)
    samples = _synthetic_samples(truth, ("A100-SXM4-40GB", "V100-SXM2-16GB", "RTX-3090", "TITAN-RTX", "H100-SXM5-80GB"))
    got = fit_params(samples, "tf32", prior_weight=1e-6)
    pred = predict_samples(samples, got, "tf32")
    meas = np.array([s.measured_s for s in samples])
    assert np.max(np.abs(pred / meas - 1)) < 0.02
    assert got.gemm_tensor_fraction == pytest.approx(0.55, rel=0.05)
    assert got.memory_fraction == pytest.approx(0.8, rel=0.05)


def test_sample_level_leave_one_type_out_never_sees_the_held_out_type():
    samples = _synthetic_samples(OpModelParams(), ("A100-SXM4-40GB", "V100-SXM2-16GB", "T4"))
    calls: list[set[str]] = []

    def spy(given, math_mode, waves=True):
        calls.append({s.gpu_type for s in given})
        return OpModelParams()

    fits = leave_one_type_out(samples, "tf32", fit=spy)
    assert list(fits) == sorted({s.gpu_type for s in samples})
    assert [held not in seen for held, seen in zip(fits, calls, strict=True)] == [True] * 3
    assert all(len(seen) == 2 for seen in calls)


def _small_structs() -> dict[str, list[SailorConfig]]:
    return structures(SAILOR, ("tf32",), (True,))


def test_leave_one_type_out_never_sees_the_held_out_type():
    structs = _small_structs()
    seen: dict[str, set[str]] = {}

    def spy(cands, fitted_on):
        types = {s.gpu_type for samples in cands.values() for s in samples}
        seen[fitted_on] = types
        return Calibration(OpModelParams(), "tf32", recompute=True, fitted_on=fitted_on), next(iter(cands))

    fits = loto_fits(structs, fit=spy)
    assert set(fits) == {c.gpu_type for c in structs["float32+recompute"]}
    for held_out, (cal, _) in fits.items():
        assert held_out not in seen[cal.fitted_on]
        assert len(seen[cal.fitted_on]) == len(fits) - 1


def test_held_out_measurements_do_not_change_its_fit():
    """Corrupt one type's measurements a hundredfold: the constants used to predict it stay the
    same (the fit never sees it), those of every other type move."""
    structs = _small_structs()
    target = "TITAN-RTX"
    bad = {k: [replace(c, fwd_s=tuple(100 * x for x in c.fwd_s), bwd_s=tuple(100 * x for x in c.bwd_s))
               if c.gpu_type == target else c for c in v] for k, v in structs.items()}
    clean, dirty = loto_fits(structs, maths=("tf32",)), loto_fits(bad, maths=("tf32",))
    assert clean[target][0].params == dirty[target][0].params
    assert clean["V100-SXM2-16GB"][0].params != dirty["V100-SXM2-16GB"][0].params
    # and the held-out type's projection is judged against its (corrupted) measurement
    res = [r for r in evaluate(bad, dirty, lambda c: None) if r.target == target]
    assert res and all(r.projected_s < r.measured_s for r in res)


def test_leave_one_type_out_on_sailor_beats_the_roofline():
    structs = _small_structs()
    fits = loto_fits(structs, maths=("tf32",))
    res = evaluate(structs, fits, lambda c: None)
    errs = [r.error for r in res]
    assert np.median(errs) < 0.15  # the old per-layer roofline: about 0.35 on the same data
    cls = class_errors(res)
    assert set(cls) == {"gemm", "bgemm", "memory", "overhead"} and all(v >= 0 for v in cls.values())


def test_allreduce_from_embedding():
    configs = [c for c in sailor_configs(SAILOR) if c.gpu_type == "GH200-96GB"]
    ar = allreduce_from_embedding(configs)
    assert set(ar.points) == {2, 4}
    c = next(c for c in configs if c.tensor_parallel == 2 and c.micro_batch_size == 8)
    one = next(x for x in configs if x.tensor_parallel == 1 and x.micro_batch_size == 8)
    assert ar.time_s(c.message_bytes * 4, 2) == pytest.approx(c.fwd_s[0] - one.fwd_s[0])


# -- profiles ------------------------------------------------------------------------------------


def _sailor_profile(sailor_name: str) -> Profile:
    from partitioner.importers.sailor import import_sailor

    return import_sailor(SAILOR, gpu_types=(sailor_name,))


def test_sailor_import_is_projected_per_operator():
    prof = _sailor_profile("V100-16")
    assert has_operators(prof)
    full = {g: _sailor_profile(n) for g, n in (("A100-SXM4-40GB", "A100-40"), ("TITAN-RTX", "Titan-RTX"))}
    out = project_with_ops(prof, list(full))
    for g, real in full.items():
        got = np.array([x.times[g].total_s for x in out.layers])
        meas = np.array([x.times[g].total_s for x in real.layers])
        assert np.median(np.abs(got / meas - 1)) < 0.35
        assert out.meta["projections"][g]["method"] == "operators"
    with pytest.raises(PartitionerError, match="already has measured"):
        project_with_ops(prof, ["V100-SXM2-16GB"])


def test_profile_round_trip_with_the_new_fields(tmp_path):
    shape = TransformerShape(64, 4, 32, 512, layout="torch")
    ops = transformer_ops(shape, 2, ["embed", "block0", "head"])
    layers = tuple(LayerProfile(n, 1e9, 10.0, 20.0, 30.0,
                                {"T4": LayerTime(0.1, 0.2, projected=True, measured_on="cpu", expected_error=0.125),
                                 "cpu": LayerTime(1.0, 2.0)})
                   for n in ("embed", "block0", "head"))
    p = Profile("gpt2-tiny", 2, layers, meta={"operators": ops.to_dict()})
    path = tmp_path / "p.json"
    p.save(path)
    back = Profile.load(path)
    assert back == p
    assert back.layers[0].times["T4"].expected_error == 0.125 and back.layers[0].times["cpu"].expected_error is None
    assert OperatorTable.from_dict(back.meta["operators"]) == ops
    raw = json.loads(path.read_text())
    assert "expected_error" not in raw["layers"][0]["times"]["cpu"]  # old readers see nothing new on measurements
    del raw["layers"][0]["times"]["T4"]["expected_error"]
    old = Profile.from_dict(raw)  # a profile written before the field existed
    assert old.layers[0].times["T4"].expected_error is None
    raw["layers"][0]["times"]["T4"]["expected_error"] = -1
    with pytest.raises(FormatError, match="expected_error"):
        Profile.from_dict(raw)


def test_layer_time_s_sums_operators_and_the_pass_overhead():
    cal = default_calibration()
    rates = Rates.of(resolve_gpu_type("T4"), "fp16")
    op = Op("e", "elementwise", "fwd", act_bytes=3e8)
    t = layer_time_s([op], rates, cal.params, "fwd")
    assert t == pytest.approx(cal.params.layer_fwd_s + 3e8 / (cal.params.memory_fraction * 300e9))
    assert layer_time_s([op], rates, cal.params, "bwd") == pytest.approx(cal.params.layer_bwd_s)


def test_cli_projects_a_sailor_profile_per_operator(tmp_path, capsys):
    from partitioner_cli import main as cli

    prof = _sailor_profile("Titan-RTX")
    src = tmp_path / "titan.json"
    prof.save(src)
    out = tmp_path / "out.json"
    assert cli.main(["profile", "project", str(src), "--gpu-type", "RTX-3090", "-o", str(out)]) == 0
    assert "expected error per layer" in capsys.readouterr().out
    p = Profile.load(out)
    assert p.meta["projections"]["RTX-3090"] == {**p.meta["projections"]["RTX-3090"], "method": "operators",
                                                 "from": "TITAN-RTX", "math": "tf32"}
    assert all(0 < x.times["RTX-3090"].expected_error < 2 for x in p.layers)
    old = tmp_path / "old.json"
    assert cli.main(["profile", "project", str(src), "--gpu-type", "RTX-3090", "--method", "roofline",
                     "-o", str(old)]) == 0
    assert Profile.load(old).meta["projections"]["RTX-3090"]["method"] == "calibrated roofline"
    cnn = Profile("cnn", 1, (LayerProfile("conv0", 1e9, times={"V100": LayerTime(1e-3, 2e-3)}),))
    assert not has_operators(cnn)
    with pytest.raises(PartitionerError, match="no operators"):
        project_with_ops(cnn, ["T4"])


def test_module_ops_from_torch_reprs():
    from partitioner.projection.operators import module_ops

    n, cin, cout, hw = 8, 64, 128, 28
    conv = module_ops("Conv2d(64, 128, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))",
                      n * cin * hw * hw, n * cout * hw * hw, n)
    assert [op.name for op in conv] == ["conv", "conv.dgrad", "conv.wgrad"]
    assert conv[0].flops == 2 * n * hw * hw * cout * cin * 9 and conv[0].gemm == (1, n * hw * hw, cout, cin * 9)
    lin = module_ops("Linear(in_features=512, out_features=10, bias=True)", n * 512, n * 10, n)
    assert lin[0].flops == 2 * n * 512 * 10
    relu = module_ops("ReLU(inplace)", 100, 100, 1)
    assert [op.phase for op in relu] == ["fwd", "bwd"] and relu[0].act_bytes == 800
    assert module_ops("View(-1)", 10, 10, 1) == ()
