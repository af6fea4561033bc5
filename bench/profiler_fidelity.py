"""Profiler fidelity on the CPU: repeatability, per-layer sum vs whole model, saved bytes.

1. Repeatability: each model is profiled twice; per layer, |t1 - t2| / t1 of fwd+bwd.
2. Sum of per-layer fwd+bwd medians vs the median fwd+bwd time of the whole chain.
3. Saved bytes: the sum of per-layer saved bytes less what adjacent layers share (a layer's
   output that the next layer also saves as its input is one tensor: ``shared_saved_bytes``),
   against the bytes autograd keeps over one forward of the whole chain (same hooks, storages
   de-duplicated), and the plain per-layer sum for comparison.

    python bench/profiler_fidelity.py [--models gpt2-tiny,...] [--out bench/results/profiler_fidelity.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from partitioner._io import atomic_write_text
from partitioner.models import build_model
from partitioner.profiler import profile_model, saved_tensor_bytes

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = "vgg19-tiny:8,resnet50-tiny:8,gpt2-tiny:8,bert-tiny:8,gpt2-small:1:128,resnet50:1"


def whole_model_s(seq: torch.nn.Module, x: torch.Tensor, runs: int = 5) -> float:
    xi = x.detach().requires_grad_(x.is_floating_point())
    times = []
    for _ in range(runs + 1):
        t0 = time.perf_counter()
        y = seq(xi)
        y.backward(torch.ones_like(y))
        times.append(time.perf_counter() - t0)
        xi.grad = None
    seq.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=DEFAULT, help="name:batch[:seq_len], comma separated")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "profiler_fidelity.md"))
    args = ap.parse_args()
    torch.manual_seed(0)
    lines = [f"# Profiler fidelity on CPU (torch {torch.__version__}, {torch.get_num_threads()} threads)", "",
             "| model | batch | layers | repeat diff median % | repeat diff max % | sum of layers s | "
             "whole model s | sum/whole - 1 % | saved, plain sum MB | saved, shared once MB | saved whole MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for spec in args.models.split(","):
        name, batch, *rest = spec.split(":")
        m = build_model(name, int(batch), seq_len=int(rest[0]) if rest else None)
        x = m.sample_input()
        runs = [profile_model(m.layers, x, warmup=2, repeats=7, model_name=name) for _ in range(2)]
        t1, t2 = (np.array([layer.times["cpu"].total_s for layer in p.layers]) for p in runs)
        diff = 100 * np.abs(t2 - t1) / t1
        seq = m.sequential()
        whole = whole_model_s(seq, x)
        per_layer = statistics.mean([t1.sum(), t2.sum()])
        _, saved_whole = saved_tensor_bytes(seq, x.detach().requires_grad_(x.is_floating_point()), name)
        saved_layers = sum(layer.saved_bytes for layer in runs[0].layers)
        saved_once = saved_layers - sum(layer.shared_saved_bytes for layer in runs[0].layers)
        lines.append(f"| {name} | {batch}{'x' + rest[0] if rest else ''} | {len(m.layers)} | "
                     f"{np.median(diff):.1f} | {diff.max():.1f} | {per_layer:.4f} | {whole:.4f} | "
                     f"{100 * (per_layer / whole - 1):+.1f} | {saved_layers / 1e6:.1f} | {saved_once / 1e6:.1f} | "
                     f"{saved_whole / 1e6:.1f} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    atomic_write_text(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
