"""The CUDA path: profiling with CUDA events, half precision, NCCL training, measured peak memory.

Skipped unless a CUDA device is present; run with ``pytest -m gpu``. What was measured on a
real GPU with these paths is in docs/gpu.md.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from partitioner.cluster import Cluster, DeviceType, Node
from partitioner.cost import CostModel, CostOptions
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.profiler import _Timer, profile_model
from runtime.launch import TrainConfig, train_local
from runtime.stage import build_stage, zoo_chain

from .test_runtime import reference_weights

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _zoo_profile(model: str, batch: int, device: str, dtype: torch.dtype | None = None) -> object:
    chain = zoo_chain(model, batch)
    return profile_model(build_stage(chain, 0, chain.num_layers, seed=0), chain.make_input(batch, "cpu"), device, model_name=model, gpu_type="gpu",
                         repeats=3, min_layer_time_s=0.0, dtype=dtype)


def test_cuda_profile_keeps_the_cpu_byte_counts_and_names_the_device() -> None:
    gpu, cpu = _zoo_profile("gpt2-tiny", 2, "cuda"), _zoo_profile("gpt2-tiny", 2, "cpu")
    for g, c in zip(gpu.layers, cpu.layers, strict=True):  # type: ignore[attr-defined]
        assert g.param_bytes == c.param_bytes and g.output_bytes == c.output_bytes
        t = g.times["gpu"]
        assert t.fwd_s > 0 and t.bwd_s >= 0 and not t.projected
        assert t.measured_on.startswith("cuda:")


def test_half_precision_profile_halves_parameters_and_activations() -> None:
    full = _zoo_profile("gpt2-tiny", 2, "cuda")
    half = _zoo_profile("gpt2-tiny", 2, "cuda", torch.bfloat16)
    assert half.dtype == "bfloat16"  # type: ignore[attr-defined]
    for h, f in zip(half.layers, full.layers, strict=True):  # type: ignore[attr-defined]
        assert h.param_bytes == f.param_bytes / 2
        assert h.output_bytes == f.output_bytes / 2


def test_cuda_event_timer_agrees_with_the_wall_clock() -> None:
    a = torch.randn(4096, 4096, device="cuda")
    timer = _Timer(torch.device("cuda"))

    def work() -> torch.Tensor:
        y = a
        for _ in range(20):
            y = y @ a
        return y

    work()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    work()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events, _ = timer.time(work)
    assert events == pytest.approx(wall, rel=0.15)


def _one_gpu_plan(model: str, schedule: str, m: int, n_layers: int, batch: int = 2) -> Plan:
    return Plan(model, (VirtualWorker((Stage((0, n_layers), "n0:0", "gpu"),)),), schedule=schedule,
                micro_batch_size=batch, micro_batches=m)


def test_nccl_training_matches_one_cpu_process(tmp_path: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    plan = _one_gpu_plan("gpt2-tiny", "1f1b", 3, zoo_chain("gpt2-tiny").num_layers)
    steps, lr, seed = 3, 0.05, 1
    ref = reference_weights(plan, steps, lr, seed, "text")
    cfg = TrainConfig(plan.model, steps=steps, warmup=0, lr=lr, seed=seed, device="cuda", timeout_s=120,
                      state_dir=str(tmp_path), data="text")
    metrics = train_local(plan, cfg, start_method="spawn")
    assert metrics["backend"] == "nccl"
    got = torch.load(tmp_path / "rank0.pt")[0]
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, rtol=1e-3, atol=1e-5, msg=lambda text, k=k: f"{k}: {text}")
    assert metrics["ranks"][0]["peak_memory_bytes"] > 0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_measured_peak_memory_is_near_the_cost_model(schedule: str, tmp_path: Path) -> None:
    model, batch, m = "gpt2-small", 4, 4
    profile = _zoo_profile(model, batch, "cuda")
    plan = _one_gpu_plan(model, schedule, m, profile.num_layers, batch)  # type: ignore[attr-defined]
    options = CostOptions(optimizer_state_factor=0.0, reserved_bytes=0.0)  # the runtime: fp32, plain SGD
    memory = float(torch.cuda.get_device_properties(0).total_memory)
    cluster = Cluster("one-gpu", (Node("n0", ("gpu",), 100.0),), 10.0, {"gpu": DeviceType("gpu", memory, 1e14, 1e12)})
    predicted = CostModel(profile, cluster, options).plan_memory_bytes(plan)["n0:0"]  # type: ignore[arg-type]
    cfg = TrainConfig(model, steps=3, warmup=1, lr=0.01, device="cuda", timeout_s=300, data="synthetic")
    measured = train_local(plan, cfg, start_method="spawn")["ranks"][0]["peak_memory_bytes"]
    assert measured == pytest.approx(predicted, rel=0.25), (measured / 2**30, predicted / 2**30)
