"""Measured peak memory of training runs on a GPU against the cost model's prediction, then and now.

    python bench/gpu_memory.py [--results bench/results/h100-2026-11-27]

Each ``train_NAME.json`` in ``--results`` is a ``partitioner train --device cuda`` run (one GPU;
``torch.cuda.max_memory_allocated``) of ``plan_NAME.json`` made from the profile the plan names
(``gpt2s_<dtype>_b4.json``, see bench/gpu_checks.sh). The table shows the measured peak, the
prediction the run recorded, and the simulator's peak for the same plan and profile with today's
cost model. A profile taken before the profiler measured the training loss's memory gets it
here: the zoo model's loss measured on this machine's CPU on an output of the profiled shape
(the loss's bytes depend on the output's shape and type, not on the device;
partitioner/loss_memory.py), said in the table's note. Reads files only; writes nothing.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from partitioner.cluster import Cluster  # noqa: E402
from partitioner.plan import Plan  # noqa: E402
from partitioner.pricing import CostOptions  # noqa: E402
from partitioner.profile import Profile  # noqa: E402
from partitioner.simulate import simulate_plan  # noqa: E402

GIB = 2**30


def with_loss(profile: Profile) -> tuple[Profile, bool]:
    """``profile`` with its zoo loss's memory (measured here on the CPU when the profile lacks it)."""
    head = profile.layers[-1]
    if head.loss_saved_bytes or "config" not in profile.meta:
        return profile, False
    import torch

    from partitioner.models import build_model
    from runtime.data import with_loss_memory
    from runtime.stage import LayerChain

    cfg = profile.meta["config"]
    m = build_model(profile.model, profile.micro_batch_size, device="meta", seq_len=cfg.get("seq_len"),
                    vocab=cfg.get("vocab"))
    half = profile.dtype in ("float16", "bfloat16")
    # an output of the profiled shape: micro-batch x positions x the head's width
    width = int(head.output_bytes) // (2 if half else 4) // (profile.micro_batch_size * int(cfg["seq_len"]))
    y = torch.randn(profile.micro_batch_size, int(cfg["seq_len"]), width, dtype=getattr(torch, profile.dtype))
    return with_loss_memory(profile, LayerChain(profile.model, list(m.layers), m.make_input, dict(m.config)), y), True


def autocast_activations(model: str = "gpt2-tiny", batch: int = 4, seq_len: int = 128) -> None:
    """What one micro-batch's forward keeps, on this CPU: fp32, autocast to bf16 with fp32 weights
    (what ``train`` runs for a bf16 plan), and the model cast to bf16 (what a bf16 profile measures)."""
    import torch

    from partitioner.loss_memory import LiveBytes
    from partitioner.models import build_model

    m = build_model(model, batch, seq_len=seq_len)
    chain = torch.nn.Sequential(*[layer for _, layer in m.layers])
    x = m.sample_input("cpu")
    kept = {}
    for name, cast, auto in (("fp32", None, False), ("autocast bf16", None, True), ("bf16 weights", torch.bfloat16, False)):
        net = chain.to(cast) if cast is not None else chain
        meter = LiveBytes()
        with meter, torch.autocast("cpu", dtype=torch.bfloat16, enabled=auto):
            y = net(x)
        kept[name] = meter.live_bytes - y.untyped_storage().nbytes()  # the graph's, less the output
        del y
    print(f"\n{model}, micro-batch {batch}, {seq_len} positions, on this CPU: bytes one forward keeps for backward")
    for name, v in kept.items():
        print(f"  {name:<14} {v / 2**20:8.2f} MiB  ({v / kept['fp32']:.2f} of fp32)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(ROOT / "bench" / "results" / "h100-2026-11-27"))
    ap.add_argument("--cluster", default=str(ROOT / "examples" / "clusters" / "h100x1.yaml"))
    args = ap.parse_args()
    res = Path(args.results)
    cluster = Cluster.load(args.cluster)
    gpu = (res / "gpu.txt").read_text().splitlines()[1:2] if (res / "gpu.txt").exists() else ["?"]
    print(f"runs: {res} ({gpu[0] if gpu else '?'}); priced here on {platform.processor() or platform.machine()}\n")
    print(f"{'run':<22} {'measured GiB':>12} {'then GiB':>9} {'then/meas':>9} {'now GiB':>8} {'now/meas':>8}")
    ratios: dict[str, list[float]] = {"then": [], "now": []}
    added = []
    for train in sorted(res.glob("train_*.json")):
        name = train.stem[len("train_"):]
        run = json.loads(train.read_text())
        plan = Plan.load(res / f"plan_{name}.json")
        dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[run["precision"]]
        profile, measured_here = with_loss(Profile.load(res / f"gpt2s_{dtype}_b4.json"))
        if measured_here:
            added.append(name)
        options = plan.pricing or CostOptions()
        options = replace(options, reserved_bytes=0.0)  # max_memory_allocated has no CUDA context
        now = simulate_plan(plan, profile, cluster, options).peak_memory_bytes
        for rank in run["memory"]["ranks"]:
            meas, then = rank["measured_bytes"], rank["predicted_bytes"]
            pred = now[rank["device"]]
            ratios["then"].append(then / meas)
            ratios["now"].append(pred / meas)
            print(f"{name:<22} {meas / GIB:12.2f} {then / GIB:9.2f} {then / meas:9.2f} {pred / GIB:8.2f} "
                  f"{pred / meas:8.2f}")
    for k, v in ratios.items():
        print(f"{k}: predicted / measured median {statistics.median(v):.2f}, range {min(v):.2f}-{max(v):.2f}")
    if added:
        print(f"(loss memory measured on this CPU for the profiles of: {', '.join(added)})")
    autocast_activations()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
