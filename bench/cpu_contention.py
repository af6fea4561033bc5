"""Do two processes on this machine slow each other down? Compute-bound and memory-bound.

    python bench/cpu_contention.py

Runs a single-threaded 512^3 matmul loop (compute-bound) and a 256 MB in-place multiply
(memory-bandwidth-bound), first alone, then two copies at once, and prints the figures side
by side. On a machine whose cores share memory bandwidth, pipeline stages running as
processes side by side slow each other's memory-bound layers; the simulator, built for GPUs
with memory of their own, assumes they do not (docs/runtime.md).
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._machine import machine_line


def _matmul_ms(_: int) -> float:
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    for _ in range(5):
        a @ b
    t0 = time.perf_counter()
    for _ in range(200):
        a @ b
    return (time.perf_counter() - t0) / 200 * 1e3


def _stream_gbps(_: int) -> float:
    import torch

    torch.set_num_threads(1)
    a = torch.randn(64 * 2**20)  # 256 MB of float32
    for _ in range(2):
        a.mul_(1.0001)
    t0 = time.perf_counter()
    for _ in range(10):
        a.mul_(1.0001)
    return a.numel() * 4 * 2 * 10 / (time.perf_counter() - t0) / 1e9  # read + write


def main() -> None:
    print(f"machine: {machine_line()}\n")
    print("| test | alone | each of two at once | slowdown |")
    print("|---|---|---|---|")
    ctx = mp.get_context("spawn")
    for name, fn, unit, higher_is_better in (("512^3 matmul, 1 thread", _matmul_ms, "ms", False),
                                            ("256 MB in-place multiply", _stream_gbps, "GB/s", True)):
        with ctx.Pool(1) as pool:
            alone = pool.map(fn, [0])[0]
        with ctx.Pool(2) as pool:
            pair = pool.map(fn, [0, 1])
        both = sum(pair) / 2
        slow = alone / both if higher_is_better else both / alone
        print(f"| {name} | {alone:.2f} {unit} | {pair[0]:.2f}, {pair[1]:.2f} {unit} | {slow:.2f}x |")


if __name__ == "__main__":
    main()
