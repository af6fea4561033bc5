"""End-to-end wall time of CLI commands that never need torch: ``--help``, ``import``, ``plan --solver dp``.

    python bench/cli_startup.py [--runs 5] [--pyc] [--pipedream DIR]

Each command runs as a fresh ``python -m partitioner_cli`` process from the repository root, ``--runs``
times; the table gives the median, min and max wall time of the whole process (interpreter start,
imports, reading the inputs, solving, writing the plan) and whether torch was loaded (checked in one
extra run with ``-X importtime``). Inputs: PipeDream's profiles of vgg16, resnet50 and gnmt
(``--pipedream``, default ``tests/data/pipedream``), planned on 4 and 16 V100-SXM2-16GB (nodes of 8).

``--pyc`` lets Python cache bytecode (in a temporary ``PYTHONPYCACHEPREFIX``, after one warm-up run),
as an installed package does; without it the environment's setting is kept and printed.
Target: every row under 0.5 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._machine import machine_line  # noqa: E402

MODELS = (("vgg16", None), ("resnet50", None), ("gnmt", 64))  # PipeDream's gnmt graph needs its batch size
GPU = "V100-SXM2-16GB"


def cluster_yaml(path: Path, num_gpus: int) -> Path:
    nodes = "".join(f"  - {{name: n{k}, intra_node_GBps: 25, gpus: {{{GPU}: {min(8, num_gpus - 8 * k)}}}}}\n"
                    for k in range((num_gpus + 7) // 8))
    path.write_text(f"name: v100x{num_gpus}\ninter_node_GBps: 12.5\nnodes:\n{nodes}")
    return path


def run(argv: list[str], env: dict[str, str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "partitioner_cli", *argv], cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0, res.returncode


def loads_torch(argv: list[str], env: dict[str, str]) -> bool:
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "partitioner_cli", *argv], cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return any(line.startswith("import time:") and line.rsplit("|", 1)[-1].strip() == "torch"
               for line in res.stderr.splitlines())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="runs per command (default 5)")
    ap.add_argument("--pyc", action="store_true", help="cache bytecode in a temporary folder (warm-up run first)")
    ap.add_argument("--pipedream", type=Path, default=ROOT / "tests" / "data" / "pipedream",
                    help="folder with PipeDream's graph files (vgg16.txt, resnet50.txt, gnmt.txt)")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error(f"--runs {args.runs}: must be >= 1")
    missing = [m for m, _ in MODELS if not (args.pipedream / f"{m}.txt").is_file()]
    if missing:
        ap.error(f"--pipedream {args.pipedream}: no {', '.join(m + '.txt' for m in missing)}")

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        env = dict(os.environ)
        if args.pyc:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")
        bytecode = "cached" if "PYTHONDONTWRITEBYTECODE" not in env else "not cached (PYTHONDONTWRITEBYTECODE set)"
        clusters = {n: cluster_yaml(tmp / f"v100x{n}.yaml", n) for n in (4, 16)}
        commands: list[tuple[str, list[str]]] = [("--help", ["--help"])]
        for model, mbs in MODELS:
            extra = ["--micro-batch-size", str(mbs)] if mbs else []
            commands.append((f"import pipedream {model}", ["import", "pipedream", str(args.pipedream / f"{model}.txt"),
                                                           "--gpu-type", GPU, *extra, "-o", str(tmp / f"{model}.json")]))
        for model, _ in MODELS:
            for n, path in clusters.items():
                for flags in ([], ["--allow-fewer"]):
                    label = f"plan {model} {n}x V100 dp{' ' + ' '.join(flags) if flags else ''}"
                    commands.append((label, ["plan", str(tmp / f"{model}.json"), "--cluster", str(path),
                                             "--solver", "dp", *flags, "-o", str(tmp / "plan.json")]))

        print(f"machine: {machine_line()}")
        print(f"python -m partitioner_cli from {ROOT.name}/, median of {args.runs} runs, bytecode {bytecode}\n")
        header = f"{'command':<44} {'median_s':>9} {'min_s':>7} {'max_s':>7}  {'exit':>4}  torch"
        print(header)
        print("-" * len(header))
        for label, argv in commands:
            if args.pyc:
                run(argv, env)  # warm-up: writes the bytecode cache
            times, rc = [], 0
            for _ in range(args.runs):
                dt, rc = run(argv, env)
                times.append(dt)
            torch = "loaded" if loads_torch(argv, env) else "no"
            print(f"{label:<44} {statistics.median(times):>9.3f} {min(times):>7.3f} {max(times):>7.3f}  {rc:>4}  {torch}")
        print("\nexit 1 = infeasible (the plan was searched and none fits): still a full end-to-end run")


if __name__ == "__main__":
    main()
