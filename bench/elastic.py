"""Elastic training: kill a random rank, re-plan without its device, resume on the new plan.

    python bench/elastic.py [--runs 20] [--steps 6] [--every 2] [--seed 0] [--no-scale]

Each run trains gpt2-tiny with 6 blocks (8 layers) on a plan of 4 to 8 local processes (gloo,
`--local`) over a cluster of two emulated CPU types ("cpu-fast", "cpu-slow": a synthetic
profile gives the slow type twice the time; the processes themselves run on this machine's
CPU), planned by the cluster planner for 2 virtual workers of 4 micro-batches of 2 samples;
checkpoints every ``--every`` steps. A random rank is killed (SIGKILL, the runtime's fault hook)
as a random step begins; then :func:`solvers.analysis.replan.replan` plans the model over the
devices left (the global batch kept) and the run resumes on the new plan. Checked per run:

* the kill is one line naming the rank and its device;
* the resumed run starts at the last complete checkpoint's step (the last multiple of
  ``--every`` before the kill);
* every rank of the new plan, loading that checkpoint, holds the saved weights, buffers and
  optimizer state, bit for bit, by name (``runtime.checkpoint.restore``, as the ranks do);
* the resumed run's losses equal, to the bit, those of the reference: an uninterrupted run of
  the new plan started from the same weights (a copy of the checkpoint directory taken after the
  kill, before the resume, so the very checkpoint the resume loads; no kill), for the same
  steps; and the two runs end on the same state (the last checkpoint's weights, optimizer state
  and generators, by name, bit for bit);
* as a further check, they also equal those of an uninterrupted run of the old plan from the
  same step (relative 1e-5: the same data and the same global batch; the new split sums in
  another order).

Then the re-plan time on larger clusters (``--no-scale`` skips it): vgg19 on the HetPipe
cluster (16 GPUs, 4 virtual workers) and on 64 such nodes (256 GPUs, 64 virtual workers), a
random GPU lost each time. Prints one row per run, the totals and the machine; writes only
under a temporary folder.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._machine import machine_line  # noqa: E402
from partitioner.cluster import Cluster, DeviceType, Node  # noqa: E402
from partitioner.plan import Plan  # noqa: E402
from partitioner.profile import LayerProfile, LayerTime, Profile  # noqa: E402
from solvers.analysis.replan import replan  # noqa: E402
from solvers.planning import PlanRequest, plan  # noqa: E402

GIB = 2**30
LAYERS = 8  # gpt2-tiny with 6 blocks: embedding, 6 blocks, head
OPTIONS = {"num_blocks": 6}


def cluster() -> Cluster:
    types = {"cpu-fast": DeviceType("cpu-fast", 8 * GIB, 1e11, 1e10), "cpu-slow": DeviceType("cpu-slow", 8 * GIB, 5e10, 1e10)}
    return Cluster("cpu-mixed", (Node("n0", ("cpu-fast", "cpu-slow") * 4, 2.0),), 1.0, types)


def profile() -> Profile:
    base = [2.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 1.0]  # ms per layer on the fast type
    layers = tuple(LayerProfile(f"l{i}", 1e6, 1e5, 1e5, 2e4,
                                {"cpu-fast": LayerTime(t / 3e3, 2 * t / 3e3), "cpu-slow": LayerTime(2 * t / 3e3, 4 * t / 3e3)})
                   for i, t in enumerate(base))
    return Profile("gpt2-tiny", 2, layers)


def initial_plan(prof: Profile, clus: Cluster, n: int) -> Plan:
    devices = tuple(d.name for d in clus.devices[:n])
    result = plan(prof, clus, PlanRequest(virtual_workers=2, micro_batches=4, devices=devices))
    assert result.ok and result.plan is not None, result.reason
    return result.plan


def loaded_equal(new: Plan, ckpt: str, step: int) -> bool:
    """Every rank of ``new``, loading checkpoint ``step``, holds the saved state bit for bit."""
    import torch

    from runtime.checkpoint import load_state, restore
    from runtime.layout import plan_layout
    from runtime.named_state import RNG, rank_state
    from runtime.stage import build_stage, zoo_chain

    saved = load_state(ckpt, step)
    chain = zoo_chain("gpt2-tiny", new.micro_batch_size, **OPTIONS)
    layout = plan_layout(new, chain.num_layers, model=chain.name)
    seen: set[str] = set()
    for me in layout.ranks:
        by_layer: dict[int, torch.nn.Module] = {}
        for s in me.stages:
            start, stop = layout.stage_layers[me.worker][s]
            by_layer.update({start + k: m for k, m in enumerate(build_stage(chain, start, stop, seed=99))})
        opt = torch.optim.SGD([p for m in by_layer.values() for p in m.parameters()], lr=0.1)
        restore(ckpt, step, me.rank, by_layer, opt)
        mine = rank_state(by_layer, opt)
        if not all(torch.equal(v, saved[k]) and v.dtype == saved[k].dtype for k, v in mine.items()):
            return False
        seen |= set(mine)
    return seen == {k for k in saved if not k.startswith(RNG)}


def one_run(run: int, rng: random.Random, args: argparse.Namespace, prof: Profile, clus: Cluster,
            straight: dict[tuple[str, ...], list[float]]) -> dict[str, object]:
    from partitioner.errors import PartitionerError
    from runtime.checkpoint import load_state
    from runtime.launch import FAULT_ENV, RankFailed, TrainConfig, train_local

    n = rng.randint(4, 8)
    old = initial_plan(prof, clus, n)
    cfg = dict(warmup=0, lr=0.3, threads=1, timeout_s=120, progress=False, model_options=OPTIONS)
    key = tuple(sorted(old.devices))
    if key not in straight:
        straight[key] = train_local(old, TrainConfig("gpt2-tiny", steps=args.steps, **cfg),  # type: ignore[arg-type]
                                    start_method="fork")["loss"]
    world = len(old.devices)
    rank, step = rng.randrange(world), rng.randrange(1, args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        os.environ[FAULT_ENV] = f"{rank}:{step}"
        t0 = time.perf_counter()
        line = False
        try:
            train_local(old, TrainConfig("gpt2-tiny", steps=args.steps, checkpoint_dir=ckpt,  # type: ignore[arg-type]
                                         checkpoint_every=args.every, **cfg), start_method="fork")
        except RankFailed as err:
            text = str(err)
            line = "\n" not in text and f"rank {rank} (device {old.devices[rank]})" in text and "SIGKILL" in text
        except PartitionerError:
            pass
        finally:
            del os.environ[FAULT_ENV]
        failed_s = time.perf_counter() - t0
        lost = old.devices[rank]
        done = replan(old, prof, clus, [d for d in old.devices if d != lost])
        new = done.plan
        expected = step // args.every * args.every
        equal_state = loaded_equal(new, ckpt, expected) if expected else True
        ref_dir = os.path.join(tmp, "reference")  # the checkpoint the resume will load, taken before it
        if os.path.isdir(ckpt):
            shutil.copytree(ckpt, ref_dir)
        resumed = train_local(new, TrainConfig("gpt2-tiny", steps=args.steps, checkpoint_dir=ckpt, resume=True,  # type: ignore[arg-type]
                                               checkpoint_every=args.every, **cfg), start_method="fork")
        reference = train_local(new, TrainConfig("gpt2-tiny", steps=args.steps, checkpoint_dir=ref_dir,  # type: ignore[arg-type]
                                                 resume=True, checkpoint_every=args.every, **cfg), start_method="fork")
        same_end = states_equal(load_state(ckpt, args.steps), load_state(ref_dir, args.steps))
    first = resumed["first_step"]
    ref_worst = (max((abs(a - b) for a, b in zip(resumed["loss"], reference["loss"], strict=True)), default=0.0)
                 if len(resumed["loss"]) == len(reference["loss"]) else float("inf"))
    ref_equal = (reference["first_step"] == first and resumed["loss"] == reference["loss"]
                 and len(resumed["loss"]) == args.steps - first and same_end)
    old_ref = straight[key][first:]
    worst = (max((abs(a - b) / max(1.0, abs(b)) for a, b in zip(resumed["loss"], old_ref, strict=True)), default=0.0)
             if len(resumed["loss"]) == len(old_ref) else float("inf"))
    old_equal = len(resumed["loss"]) == len(old_ref) and worst <= 1e-5
    return {"run": run, "procs": world, "rank": rank, "device": lost, "step": step, "line": line,
            "failed_s": failed_s, "replan_s": done.time_s, "how": done.how,
            "new": f"{len(new.virtual_workers)}x{new.micro_batches} on {len(new.devices)}", "first": first,
            "expected": expected, "state": equal_state, "ref": ref_equal, "ref_worst": ref_worst,
            "old": old_equal, "worst": worst,
            "ok": line and first == expected and equal_state and ref_equal and old_equal}


def states_equal(a: dict[str, object], b: dict[str, object]) -> bool:
    """The same names, and every tensor equal to the bit with the same dtype."""
    import torch

    return set(a) == set(b) and all(
        isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        for x, y in ((a[k], b[k]) for k in a))


def replan_times(rng: random.Random, rounds: int) -> list[tuple[str, int, float, float, str]]:
    """(cluster, GPUs, median s, max s, how) of re-planning vgg19 after a random GPU is lost."""
    prof = Profile.load(ROOT / "examples" / "profiles" / "vgg19_hetpipe.json")
    c16 = Cluster.load(ROOT / "examples" / "clusters" / "hetpipe.yaml")
    c256 = Cluster("hetpipe-64x4", tuple(Node(f"n{i}", c16.nodes[0].gpus, 16.0) for i in range(64)), 7.0)
    out = []
    for clus, k in ((c16, 4), (c256, 64)):
        first = plan(prof, clus, PlanRequest(virtual_workers=k, micro_batches=4))
        assert first.ok and first.plan is not None, first.reason
        times, hows = [], set()
        for _ in range(rounds):
            lost = rng.choice(first.plan.devices)
            done = replan(first.plan, prof, clus, [d for d in first.plan.devices if d != lost])
            times.append(done.time_s)
            hows.add(done.how)
        out.append((clus.name, len(clus.devices), statistics.median(times), max(times), "/".join(sorted(hows))))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replan-rounds", type=int, default=5)
    ap.add_argument("--no-scale", action="store_true", help="skip the re-plan times on 16 and 256 GPUs")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    prof, clus = profile(), cluster()
    print(machine_line())
    print(f"gpt2-tiny (8 layers), 4-8 local processes (gloo), cluster {clus.name} (cpu-fast, cpu-slow), 2 virtual "
          f"workers x 4 micro-batches of 2; {args.steps} steps, a checkpoint every {args.every}; {args.runs} runs, "
          f"seed {args.seed}\n")
    print(f"{'run':>3} {'procs':>5} {'killed':>12} {'step':>4} {'one line':>8} {'failed s':>8} {'replan s':>8} "
          f"{'new plan':>12} {'how':>5} {'resumed at':>10} {'expected':>8} {'state equal':>11} "
          f"{'= new-plan ref':>14} {'= old plan':>10}")
    straight: dict[tuple[str, ...], list[float]] = {}
    rows = []
    for run in range(args.runs):
        r = one_run(run, rng, args, prof, clus, straight)
        rows.append(r)
        print(f"{run:>3} {r['procs']:>5} {'r' + str(r['rank']) + ' ' + str(r['device']):>12} {r['step']:>4} "
              f"{r['line']!s:>8} {r['failed_s']:8.2f} {r['replan_s']:8.3f} {r['new']:>12} {r['how']:>5} {r['first']:>10} "
              f"{r['expected']:>8} {r['state']!s:>11} "
              f"{r['ref']!s:>14} {r['old']!s:>10}")
    ok = sum(bool(r["ok"]) for r in rows)
    print(f"\n{ok} of {args.runs} runs: the kill in one line, resumed on the re-planned plan at the last checkpoint's "
          f"step, state equal bit for bit after loading; losses equal to the reference (the new plan run uninterrupted "
          f"from the same checkpoint) in {sum(bool(r['ref']) for r in rows)} (worst absolute difference "
          f"{max(float(str(r['ref_worst'])) for r in rows):.2e}, the last state equal by name bit for bit), and to "
          f"the old plan's uninterrupted run in {sum(bool(r['old']) for r in rows)} (worst relative difference "
          f"{max(float(str(r['worst'])) for r in rows):.2e}); re-plan time at most "
          f"{max(float(str(r['replan_s'])) for r in rows):.3f} s")
    if not args.no_scale:
        print("\nre-plan after a random GPU is lost (vgg19, the old plan's workers warm-started):")
        print(f"{'cluster':>14} {'GPUs':>5} {'median s':>9} {'max s':>7} {'how':>5}")
        for name, gpus, med, most, how in replan_times(rng, args.replan_rounds):
            print(f"{name:>14} {gpus:>5} {med:9.3f} {most:7.3f} {how:>5}")
    return 0 if ok == args.runs else 1


if __name__ == "__main__":
    raise SystemExit(main())
