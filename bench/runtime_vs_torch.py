"""This project's pipeline runtime against torch.distributed.pipelining, side by side.

    python bench/runtime_vs_torch.py [--models vgg19-tiny:32,gpt2-tiny:16,bench._runtime_models:mlp:64]
                                     [--schedules gpipe,1f1b]
                                     [--micro-batches 8] [--rounds 5] [--steps 4]

Two gloo ranks on this machine (one thread each), one pipeline of two stages cut at the
middle layer, the same layers from the same seeds, the same micro-batches, the loss = mean of
the output (synthetic data) and SGD in both. In each process both runtimes are built once;
then, round after round, ``--steps`` steps of ours and ``--steps`` of torch's schedule
(``Schedule1F1B`` / ``ScheduleGPipe``) alternate, every step timed between barriers. Prints the
median step of each and the ratio theirs / ours (> 1: ours is faster), beside the schedule's own
bound for this split: each stage's forward and backward per micro-batch (``t1``, ``t2``, measured
here first in one process on one thread), ``(m - 1) max(t1, t2) + t1 + t2``, the best any
runtime of this schedule can do without overlapping a stage's work with itself. Writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench._machine import machine_line  # noqa: E402
from partitioner.export import export_plan  # noqa: E402
from partitioner.plan import Plan, Stage, VirtualWorker  # noqa: E402
from partitioner.schedule import build_schedule  # noqa: E402
from runtime.data import SyntheticData  # noqa: E402
from runtime.executor import PipelineExecutor  # noqa: E402
from runtime.launch import spawn_local  # noqa: E402
from runtime.model import is_model_ref, spec_chain  # noqa: E402
from runtime.stage import LayerChain, boundary_shapes, build_stage, zoo_chain  # noqa: E402


def _rank(rank: int, world: int, plan_dict: dict, rounds: int, steps: int, out: str) -> None:
    from runtime.torch_pipelining import build_rank

    plan = Plan.from_dict(plan_dict)
    chain = _chain(plan.model, plan.micro_batch_size)
    (a, b) = plan.virtual_workers[0].stages[rank].layers
    m, mb = plan.micro_batches, plan.micro_batch_size
    data = SyntheticData(chain.make_input, mb, m, 1, 0)
    batch = data.global_batch(0)[0]

    ours = {rank: build_stage(chain, a, b, seed=0)}
    shapes = boundary_shapes(chain, mb)
    inputs = {rank: shapes[a - 1]} if a > 0 else {}
    executor = PipelineExecutor(ours, 2, [0, 1], inputs, m, lambda j: batch[j * mb:(j + 1) * mb],
                                lambda y, j: y.float().mean(),
                                torch.optim.SGD(ours[rank].parameters(), lr=1e-3), torch.device("cpu"))
    actions = build_schedule(plan.schedule, 2, m)[rank]

    theirs = build_rank(export_plan(plan, "torch-pipelining"), rank, seed=0)
    opt = torch.optim.SGD(list(theirs.parameters()), lr=1e-3)

    def torch_step() -> None:
        theirs.step(batch)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    for _ in range(2):  # warm-up
        timed(lambda: executor.run(actions))
        timed(torch_step)
    mine, other = [], []
    for _ in range(rounds):
        mine += [timed(lambda: executor.run(actions)) for _ in range(steps)]
        other += [timed(torch_step) for _ in range(steps)]
    if rank == 0:
        Path(out).write_text(json.dumps({"ours": mine, "torch": other}))


def _chain(model: str, mbs: int) -> LayerChain:
    """A zoo model, or a user's ``module:function`` (e.g. ``bench._runtime_models:mlp``)."""
    return spec_chain(model) if is_model_ref(model) else zoo_chain(model, mbs)


def stage_times_s(model: str, mbs: int, m: int, cut: int, repeats: int = 5) -> tuple[float, float]:
    """Median seconds per micro-batch of each stage's forward and backward (the loss and SGD step
    included in the last), in one process on one thread, the two stages run one after the other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        chain = _chain(model, mbs)
        first, last = build_stage(chain, 0, cut, seed=0), build_stage(chain, cut, chain.num_layers, seed=0)
        opt = torch.optim.SGD([*first.parameters(), *last.parameters()], lr=1e-3)
        batch = SyntheticData(chain.make_input, mbs, m, 1, 0).global_batch(0)[0]
        t1, t2 = [], []
        for _ in range(repeats + 1):
            a = b = 0.0
            for j in range(m):
                t0 = time.perf_counter()
                y = first(batch[j * mbs:(j + 1) * mbs])
                a += time.perf_counter() - t0
                t0 = time.perf_counter()
                x = y.detach().requires_grad_(True)
                last(x).float().mean().backward()
                b += time.perf_counter() - t0
                t0 = time.perf_counter()
                y.backward(x.grad)
                a += time.perf_counter() - t0
            t0 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            b += time.perf_counter() - t0
            t1.append(a / m)
            t2.append(b / m)
        return statistics.median(t1[1:]), statistics.median(t2[1:])
    finally:
        torch.set_num_threads(threads)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="vgg19-tiny:32,gpt2-tiny:16,bench._runtime_models:mlp:64",
                    help="MODEL:MICRO_BATCH_SIZE, comma-separated (MODEL: a zoo name or a module:function)")
    ap.add_argument("--schedules", default="gpipe,1f1b")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    print(machine_line())
    print(f"torch {torch.__version__}, gloo, 2 ranks x 1 thread, {args.micro_batches} micro-batches, "
          f"{args.rounds} rounds x {args.steps} steps each, interleaved\n")
    print(f"{'model':>12} {'mbs':>4} {'schedule':>8} {'bound ms':>9} {'ours ms':>9} {'torch ms':>9} "
          f"{'torch/ours':>10} {'ours/bound':>10}")
    for item in args.models.split(","):
        model, _, mbs = item.rpartition(":")
        if not model or not mbs.isdigit() or int(mbs) < 1:
            ap.error(f"--models: '{item}' is not MODEL:MICRO_BATCH_SIZE (a zoo name or module:function, then "
                     "an integer >= 1)")
        n = _chain(model, int(mbs)).num_layers
        t1, t2 = stage_times_s(model, int(mbs), args.micro_batches, n // 2)
        bound = (args.micro_batches - 1) * max(t1, t2) + t1 + t2  # fill, then the slower stage paces
        for schedule in args.schedules.split(","):
            plan = Plan(model, (VirtualWorker((Stage((0, n // 2), "n0:0"), Stage((n // 2, n), "n0:1"))),),
                        schedule, int(mbs), args.micro_batches)
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "times.json")
                spawn_local(_rank, 2, (plan.to_dict(), args.rounds, args.steps, out), threads=1, timeout_s=600)
                times = json.loads(Path(out).read_text())
            ours, theirs = statistics.median(times["ours"]), statistics.median(times["torch"])
            print(f"{model.rpartition(':')[2]:>12} {mbs:>4} {schedule:>8} {bound * 1e3:9.2f} {ours * 1e3:9.2f} {theirs * 1e3:9.2f} "
                  f"{theirs / ours:10.3f} {ours / bound:10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
