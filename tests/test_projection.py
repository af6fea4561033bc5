"""Roofline projection: exact on constructed cases, invertible, honest about provenance."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from partitioner.cluster import resolve_gpu_type
from partitioner.errors import PartitionerError
from partitioner.importers.sailor import import_sailor
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner.projection.roofline import (
    Roofs,
    analytic_profile_times,
    layer_traffic_bytes,
    project_profile,
    roofline_s,
)

SAILOR = Path(__file__).parent / "data" / "sailor_opt350"


def _profile(gpu="V100-SXM2-16GB"):
    layers = (
        LayerProfile("mm", flops=4e12, param_bytes=1e6, saved_bytes=1e6, output_bytes=1e6,  # compute-bound
                     times={gpu: LayerTime(0.5, 1.0, measured_on="cuda:V100")}),
        LayerProfile("ew", flops=1e6, param_bytes=0, saved_bytes=4e9, output_bytes=4e9,     # memory-bound
                     times={gpu: LayerTime(0.02, 0.04, measured_on="cuda:V100")}),
    )
    return Profile("toy", 8, layers)


def test_compute_and_memory_bound_layers_scale_by_their_roof():
    v100, a100 = resolve_gpu_type("V100-SXM2-16GB"), resolve_gpu_type("A100-SXM4-40GB")
    p = project_profile(_profile(), ["A100-SXM4-40GB"])
    mm, ew = (layer.times["A100-SXM4-40GB"] for layer in p.layers)
    assert mm.fwd_s == pytest.approx(0.5 * v100.peak_flops / a100.peak_flops)
    assert mm.bwd_s == pytest.approx(1.0 * v100.peak_flops / a100.peak_flops)
    assert ew.fwd_s == pytest.approx(0.02 * v100.mem_bandwidth_bps / a100.mem_bandwidth_bps)
    assert mm.projected and mm.measured_on == "cuda:V100"
    assert p.meta["projections"]["A100-SXM4-40GB"]["from"] == "V100-SXM2-16GB"


def test_projection_to_itself_and_back_is_identity():
    p = _profile()
    back = project_profile(project_profile(p, ["T4"]), ["V100-SXM2-32GB"], source="T4")
    for a, b in zip(p.layers, back.layers, strict=True):
        # V100-32GB has the same roofs as the measured V100-16GB.
        assert b.times["V100-SXM2-32GB"].fwd_s == pytest.approx(a.times["V100-SXM2-16GB"].fwd_s)


def test_analytic_is_the_roofline_over_efficiency():
    p = _profile()
    t4 = resolve_gpu_type("T4")
    times = analytic_profile_times(p, t4, efficiency=0.25)
    roof = roofline_s(p.array("flops"), layer_traffic_bytes(p), Roofs.of(t4))
    assert [t.fwd_s for t in times] == pytest.approx(list(roof / 0.25))
    assert [t.bwd_s for t in times] == pytest.approx(list(2 * roof / 0.25))
    assert all(t.projected and t.measured_on == "" for t in times)
    # Half precision uses the tensor-core roof.
    assert Roofs.of(t4, "float16").flops_per_s == t4.tensor_flops


def test_half_precision_compares_like_with_like():
    half = Profile("toy", 8, _profile().layers, dtype="float16")
    v100, a100, r2060 = (resolve_gpu_type(n) for n in ("V100-SXM2-16GB", "A100-SXM4-40GB", "RTX-2060"))
    assert r2060.tensor_flops == 0
    p = project_profile(half, ["A100-SXM4-40GB", "RTX-2060"])
    mm = p.layers[0].times
    assert mm["A100-SXM4-40GB"].fwd_s == pytest.approx(0.5 * v100.tensor_flops / a100.tensor_flops)
    assert mm["RTX-2060"].fwd_s == pytest.approx(0.5 * v100.peak_flops / r2060.peak_flops)


def test_cpu_source_uses_relative_efficiency():
    layers = tuple(LayerProfile(f"l{i}", flops=f, output_bytes=1.0, times={"cpu": LayerTime(t, 2 * t)})
                   for i, (f, t) in enumerate([(1e9, 0.01), (1e9, 0.04)]))
    p = project_profile(Profile("toy", 1, layers), ["T4"], efficiency=0.5)
    t4 = resolve_gpu_type("T4")
    best = 1e9 / t4.peak_flops / 0.5                     # the best CPU layer gets efficiency 0.5
    assert p.layers[0].times["T4"].fwd_s == pytest.approx(best, rel=1e-6)
    assert p.layers[1].times["T4"].fwd_s == pytest.approx(4 * best, rel=1e-6)  # 4x less efficient on CPU too


def test_never_projects_over_a_measurement():
    with pytest.raises(PartitionerError, match="already has measured"):
        project_profile(_profile(), ["V100-SXM2-16GB"])
    with pytest.raises(PartitionerError, match="'V100': ambiguous: it may be V100-SXM2-16GB, V100-SXM2-32GB"):
        project_profile(_profile(), ["V100"])
    with pytest.raises(PartitionerError, match="no measured"):
        project_profile(Profile("x", 1, (LayerProfile("a", flops=1.0),)), ["T4"])


def test_sailor_projection_is_in_the_right_range():
    # Real measurements on two GPUs: projecting V100 -> A100-40 on the tensor-core roof stays
    # within a factor 2 of the measured A100 time per transformer block, and the FP32 roof
    # is further off (docs/profiling.md has the figures).
    full = import_sailor(SAILOR)
    v100 = Profile(full.model, full.micro_batch_size,
                   tuple(LayerProfile(x.name, x.flops, x.param_bytes, x.saved_bytes, x.output_bytes,
                                      {"V100-SXM2-16GB": x.times["V100-SXM2-16GB"]}) for x in full.layers),
                   full.dtype)
    assert full.dtype == "float16"
    real = np.array([x.times["A100-SXM4-40GB"].total_s for x in full.layers[1:-1]])
    err = {}
    for precision in ("auto", "fp32"):
        proj = project_profile(v100, ["A100-SXM4-40GB"], precision=precision)
        got = np.array([x.times["A100-SXM4-40GB"].total_s for x in proj.layers[1:-1]])
        err[precision] = np.abs(got / real - 1)
    assert np.all(err["auto"] < 1.0)
    assert np.median(err["auto"]) < np.median(err["fp32"])
