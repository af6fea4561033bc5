"""Where one GPU's training iteration goes, against the per-layer profile that predicts it.

    python bench/gpu_breakdown.py [--model gpt2-small] [--batch 4] [--micro-batches 4] [--seq-len 512]

Needs a CUDA device. On one model it measures, in one process and with CUDA events:
the per-layer profile (``profile_model``, each layer alone), the whole chain's forward and
backward for one micro-batch (with a random output gradient, as the profiler does, and with
the training loss), and a GPipe and a 1F1B step of ``m`` micro-batches as the runtime runs
them on one device (gradients accumulated, then one SGD step). Memory: what a forward keeps
alive (``torch.cuda.memory_allocated`` before and after) against the profile's saved and
output bytes, and the peak of each step. Prints a table; writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from partitioner.profiler import profile_model  # noqa: E402
from runtime.data import make_data  # noqa: E402
from runtime.stage import build_stage, zoo_chain  # noqa: E402

GIB = 2**30


def cuda_ms(fn: Callable[[], object], repeats: int = 10) -> float:
    """Median milliseconds of ``fn`` between CUDA events (after two warm-up calls)."""
    for _ in range(2):
        fn()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-small")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_breakdown.py: needs a CUDA device (torch sees none)")
    b, m = args.batch, args.micro_batches
    chain = zoo_chain(args.model, b, seq_len=args.seq_len)
    prof = profile_model(build_stage(chain, 0, chain.num_layers, seed=0), chain.make_input(b, "cpu"), "cuda",
                         model_name=args.model, gpu_type="gpu", progress=False)
    per_layer_ms = sum(la.times["gpu"].fwd_s + la.times["gpu"].bwd_s for la in prof.layers) * 1e3
    saved = sum(la.saved_bytes for la in prof.layers)
    out_bytes = prof.layers[-1].output_bytes

    stage = build_stage(chain, 0, chain.num_layers, seed=0, device="cuda")
    data = make_data(chain, "auto", b, m, 1, 0)
    xs, ys = data.global_batch(0)
    x = [xs[j * b:(j + 1) * b].cuda() for j in range(m)]
    y = [ys[j * b:(j + 1) * b].cuda() if ys is not None else None for j in range(m)]
    opt = torch.optim.SGD(stage.parameters(), lr=1e-3)
    g = torch.randn(stage(x[0]).shape, device="cuda")

    def chain_grad() -> None:
        stage(x[0]).backward(g)

    def chain_loss() -> None:
        data.loss(stage(x[0]), y[0]).backward()

    def gpipe() -> None:
        losses = [data.loss(stage(x[j]), y[j]) / m for j in range(m)]
        for loss in losses:
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def one_f_one_b() -> None:
        for j in range(m):
            (data.loss(stage(x[j]), y[j]) / m).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    rows = [("per-layer profile, sum of fwd+bwd (1 micro-batch)", per_layer_ms),
            ("whole chain fwd+bwd, random output gradient", cuda_ms(chain_grad)),
            ("whole chain fwd+loss+bwd", cuda_ms(chain_loss)),
            (f"gpipe step, {m} micro-batches + SGD", cuda_ms(gpipe)),
            (f"1f1b step, {m} micro-batches + SGD", cuda_ms(one_f_one_b))]
    stage.zero_grad(set_to_none=True)

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = stage(x[0])
    kept = torch.cuda.memory_allocated() - base
    loss = data.loss(out, y[0])
    kept_loss = torch.cuda.memory_allocated() - base
    del out, loss
    torch.cuda.synchronize()
    peaks = {}
    for name, fn in (("gpipe", gpipe), ("1f1b", one_f_one_b)):
        torch.cuda.reset_peak_memory_stats()
        fn()
        peaks[name] = torch.cuda.max_memory_allocated()
    params = sum(p.numel() * p.element_size() for p in stage.parameters())

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.model}, micro-batch {b}, "
          f"seq {args.seq_len}, fp32")
    for name, ms in rows:
        print(f"  {name:52s} {ms:9.2f} ms  ({ms / per_layer_ms:.2f}x the profile)")
    print(f"  forward keeps alive {kept / GIB:.2f} GiB (+ loss: {kept_loss / GIB:.2f} GiB); profile: saved "
          f"{saved / GIB:.2f} GiB + output {out_bytes / GIB:.2f} GiB")
    for name, peak in peaks.items():
        print(f"  peak {name:5s} {peak / GIB:.2f} GiB  (parameters {params / GIB:.2f} GiB, gradients as much)")


if __name__ == "__main__":
    main()
