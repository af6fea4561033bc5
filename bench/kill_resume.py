"""Kill a random rank at a random step, resume, and check: every resume, no corrupt checkpoint.

    python bench/kill_resume.py [--runs 20] [--steps 6] [--every 2] [--seed 0]

gpt2-tiny on two CPU processes (`--local`, gloo), SGD, checkpoints every ``--every`` steps. Each
run kills rank R (SIGKILL, through the runtime's fault hook ``PARTITIONER_FAULT_KILL``) as step S
begins, R and S drawn at random; then the same training is started again with resume. Checked
per run: the kill is reported in one line naming the rank and the signal; the last complete
checkpoint is the last multiple of ``--every`` before S; every complete checkpoint's files are
those its manifest lists (sizes and SHA-256) and load by name; the resumed run starts there and its losses equal an
uninterrupted run's from that step on (relative 1e-5). Prints one row per run and the totals.
The kill lands as a step begins (the hook's one point), so it never interrupts a checkpoint
being written; those writes are atomic by construction (temporary file, then rename).
Writes only under a temporary folder.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from bench._machine import machine_line  # noqa: E402
from partitioner.errors import PartitionerError  # noqa: E402
from partitioner.plan import Plan, Stage, VirtualWorker  # noqa: E402
from runtime.checkpoint import latest_complete, load_state, read_manifest, step_dir, verify  # noqa: E402
from runtime.launch import FAULT_ENV, TrainConfig, train_local  # noqa: E402

PLAN = Plan("gpt2-tiny", (VirtualWorker((Stage((0, 2), "n0:0"), Stage((2, 4), "n0:1"))),), micro_batch_size=2,
            micro_batches=2)


def intact(root: str) -> tuple[int, int]:
    """(complete checkpoints, those among them whose files are not the manifest's or do not load)."""
    complete = bad = 0
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if not name.startswith("step-"):
            continue
        step = int(name.removeprefix("step-"))
        manifest = read_manifest(step_dir(root, step), step)
        if manifest is None:
            continue
        complete += 1
        try:
            verify(root, manifest)
            load_state(root, step)
        except Exception:
            bad += 1
    return complete, bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    cfg = dict(steps=args.steps, warmup=0, lr=0.3, threads=1, timeout_s=120, progress=False)
    straight = train_local(PLAN, TrainConfig("gpt2-tiny", **cfg), start_method="fork")["loss"]  # type: ignore[arg-type]
    print(machine_line())
    print(f"gpt2-tiny, 2 ranks (gloo), {args.steps} steps, checkpoint every {args.every}, {args.runs} runs, "
          f"seed {args.seed}\n")
    print(f"{'run':>3} {'rank':>4} {'step':>4} {'one line':>8} {'resumed at':>10} {'expected':>8} "
          f"{'complete ckpts':>14} {'corrupt':>7} {'losses equal':>12} {'s':>5}")
    ok_runs = corrupt_total = 0
    for run in range(args.runs):
        rank, step = rng.randrange(2), rng.randrange(1, args.steps)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = os.path.join(tmp, "ckpt")
            os.environ[FAULT_ENV] = f"{rank}:{step}"
            try:
                train_local(PLAN, TrainConfig("gpt2-tiny", **cfg, checkpoint_dir=ckpt,  # type: ignore[arg-type]
                                              checkpoint_every=args.every), start_method="fork")
                line = False
            except PartitionerError as err:
                text = str(err)
                line = "\n" not in text and f"rank {rank}" in text and "SIGKILL" in text
            finally:
                del os.environ[FAULT_ENV]
            expected = step // args.every * args.every
            complete, bad = intact(ckpt)
            manifest = latest_complete(ckpt)
            assert manifest is None or os.path.isdir(step_dir(ckpt, manifest.step))
            resumed = train_local(PLAN, TrainConfig("gpt2-tiny", **cfg, checkpoint_dir=ckpt,  # type: ignore[arg-type]
                                                    checkpoint_every=args.every, resume=True),
                                  start_method="fork")
            first = resumed["first_step"]
            equal = len(resumed["loss"]) == args.steps - first and all(
                abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(resumed["loss"], straight[first:], strict=True))
        good = line and first == expected and bad == 0 and equal
        ok_runs += good
        corrupt_total += bad
        print(f"{run:>3} {rank:>4} {step:>4} {line!s:>8} {first:>10} {expected:>8} {complete:>14} {bad:>7} "
              f"{equal!s:>12} {time.perf_counter() - t0:5.1f}")
    print(f"\n{ok_runs} of {args.runs} runs resumed where expected with the uninterrupted losses; "
          f"{corrupt_total} corrupt checkpoints")
    return 0 if ok_runs == args.runs and corrupt_total == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
