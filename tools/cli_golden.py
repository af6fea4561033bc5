"""Does the command line print and write what it did before a change? (refactoring's check)

    python tools/cli_golden.py record DIR [--cli "python -m partitioner_cli"] [--benches]
    python tools/cli_golden.py compare OLD NEW [OLD2]

``record`` runs a fixed list of commands (the README tour on its shipped inputs, every
command and target on them, the refusals, and with ``--benches`` the quick benchmarks that
need no torch) and keeps each command's stdout, stderr, exit status and the files it wrote.
``compare`` says, command by command, where NEW differs from OLD. Some figures change from
run to run (solve times, the wall clock): record OLD twice (OLD and OLD2); a line that
differs between them is compared with its numbers masked, every other line byte for byte.
Written files are compared the same way, line by line, except images (their size only) and
the times that JSON files carry. Commands that measure (profile, train) are left out: their
outputs are measurements, not functions of the inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("SHARED_DATA", ROOT.parent / "shared" / "data"))
_NUMBER = re.compile(r"-?\d+(?:[.,]\d+)*(?:e[-+]?\d+)?")

# {o}: this run's output folder; {s}: the shared data folder.
_HET = "examples/profiles/vgg19_hetpipe.json --cluster examples/clusters/hetpipe.yaml"
COMMANDS: tuple[str, ...] = (
    "--help",
    "import pipedream examples/profiles/vgg16_pipedream_graph.txt --gpu-type V100-SXM2-16GB --model vgg16 -o {o}/vgg16.json",
    "plan {o}/vgg16.json --cluster examples/clusters/v100x8.yaml --micro-batches 16 --allow-fewer -o {o}/vgg16_plan.json",
    "simulate {o}/vgg16_plan.json --profile {o}/vgg16.json --cluster examples/clusters/v100x8.yaml --trace {o}/vgg16_trace.json --png {o}/vgg16_timeline.png",
    "explain {o}/vgg16_plan.json --profile {o}/vgg16.json --cluster examples/clusters/v100x8.yaml --json {o}/vgg16_explain.json",
    "plan {o}/vgg16.json --cluster examples/clusters/v100x8.yaml --micro-batches 16 --solver cpsat --time-limit 20 --workers 1 -o {o}/vgg16_cpsat.json",
    "plan {o}/vgg16.json --cluster examples/clusters/v100x8.yaml --micro-batches 16 --solver milp --time-limit 20 -o {o}/vgg16_milp.json",
    "plan {o}/vgg16.json --cluster examples/clusters/v100x8.yaml --micro-batches 16 --schedule gpipe --solver uniform -o {o}/vgg16_uniform.json",
    "plan {o}/vgg16.json --cluster examples/clusters/v100x8.yaml --micro-batches 16 --schedule interleaved --chunks 2 -o {o}/vgg16_int.json",
    "simulate {o}/vgg16_int.json --profile {o}/vgg16.json --cluster examples/clusters/v100x8.yaml",
    "plan {o}/vgg16.json --cluster examples/clusters/v100x8.yaml --micro-batches 16 --schedule bfs --chunks auto -o {o}/vgg16_bfs.json",
    "plan {o}/vgg16.json --cluster examples/clusters/v100x8.yaml --micro-batches 8 --schedule 2bw -o {o}/vgg16_2bw.json",
    "plan {o}/vgg16.json --cluster examples/clusters/v100x8.yaml --micro-batches auto --global-batch 2048 -o {o}/vgg16_auto.json",
    "export {o}/vgg16_plan.json --to torch-pipelining -o {o}/vgg16_torch.json --snippet {o}/vgg16_torch.py",
    "export {o}/vgg16_plan.json --to deepspeed -o {o}/vgg16_ds.json",
    "export {o}/vgg16_plan.json --to megatron -o {o}/vgg16_mg.json",
    "plan " + _HET + " --virtual-workers auto --policy opt --micro-batches 8 -o {o}/vgg19_opt.json",
    "plan " + _HET + " --virtual-workers auto --policy ed --micro-batches 8 -o {o}/vgg19_ed.json",
    "plan " + _HET + " --virtual-workers 4 --policy hd --micro-batches 8 --schedule wsp -o {o}/vgg19_wsp.json",
    "plan " + _HET + " --virtual-workers auto --policy opt --micro-batches 8 --replication -o {o}/vgg19_rep.json",
    "simulate {o}/vgg19_opt.json --profile examples/profiles/vgg19_hetpipe.json --cluster examples/clusters/hetpipe.yaml",
    "simulate {o}/vgg19_wsp.json --profile examples/profiles/vgg19_hetpipe.json --cluster examples/clusters/hetpipe.yaml",
    "explain {o}/vgg19_ed.json --profile examples/profiles/vgg19_hetpipe.json --cluster examples/clusters/hetpipe.yaml",
    "compare " + _HET + " --virtual-workers 4 --time-limit 5 -o {o}/compare.json",
    "plan examples/profiles/resnet152_hetpipe.json --cluster examples/clusters/hetpipe.yaml --virtual-workers auto --policy opt --micro-batches 8 -o {o}/r152.json",
    "profile project examples/profiles/vgg19_hetpipe.json --gpu-type A100-SXM4-40GB -o {o}/vgg19_a100.json",
    "profile emulate examples/profiles/vgg19_hetpipe.json --cluster examples/clusters/hetpipe.yaml --reference TITAN-V -o {o}/vgg19_emu.json",
    "import sailor {s}/sailor_opt350 -o {o}/opt350.json",
    "import sailor-run {s}/sailor_validation/clariden_opt350/plan_config_N16_D4.json --profiles {s}/sailor_opt350 --network {s}/sailor_validation/network/network_coeffs_all_homo.json -o {o}/n16d4",
    "simulate {o}/n16d4/plan.json --profile {o}/n16d4/profile.json --cluster {o}/n16d4/cluster.json",
    "train {o}/vgg16_plan.json --profile {o}/vgg16.json --cluster examples/clusters/v100x8.yaml --model vgg16 --launch-lines",
    "plan {o}/vgg16.json --cluster examples/bad/small.yaml --schedule gpipe --micro-batches 8",
    "plan {o}/vgg16.json --cluster examples/bad/typo.yaml",
    "plan {o}/missing.json --cluster examples/bad/typo.yaml",
    "plan {o}/vgg16.json --cluster examples/clusters/v100x8.yaml --micro-batches 0",
)

# The quick benchmarks that need no torch, with their quick arguments (bench/NAME.py ...).
BENCHES: tuple[str, ...] = ("fidelity", "closed_form", "dp_optimality", "projection_error",
                            "solver_agreement", "hetero", "simulator")


def _run(argv: list[str], cwd: Path, timeout_s: float) -> dict:
    env = dict(os.environ, COLUMNS="100", PYTHONHASHSEED="0", MPLBACKEND="Agg")
    try:
        p = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, env=env)
        return {"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr}
    except subprocess.TimeoutExpired:
        return {"rc": "timeout", "stdout": "", "stderr": ""}


def record(out: Path, cli: str, benches: bool) -> None:
    if out.exists():
        shutil.rmtree(out)
    (out / "files").mkdir(parents=True)
    results = []
    for i, template in enumerate(COMMANDS):
        line = template.format(o="{o}", s=SHARED)
        argv = [*shlex.split(cli), *shlex.split(line.replace("{o}", str(out / "files")))]
        r = _run(argv, ROOT, 600)
        r["command"] = line
        results.append(r)
        print(f"[{i + 1}/{len(COMMANDS)}] rc {r['rc']}: {line[:90]}", file=sys.stderr)
    if benches:
        for name in BENCHES:
            r = _run([sys.executable, f"bench/{name}.py"], ROOT, 900)
            r["command"] = f"bench/{name}.py"
            results.append(r)
            print(f"[bench] rc {r['rc']}: {name}", file=sys.stderr)
    (out / "runs.json").write_text(json.dumps(results, indent=1))


def _mask(line: str) -> str:
    return _NUMBER.sub("#", line)


def _lines_differ(old: list[str], new: list[str], volatile: set[int], label: str) -> list[str]:
    problems = []
    if len(old) != len(new):
        problems.append(f"{label}: {len(old)} lines before, {len(new)} now")
    for k, (a, b) in enumerate(zip(old, new)):
        if a == b or (k in volatile and _mask(a) == _mask(b)):
            continue
        problems.append(f"{label} line {k + 1}:\n    before: {a}\n    now:    {b}")
    return problems


def _volatile(a: list[str], b: list[str]) -> set[int]:
    return {k for k, (x, y) in enumerate(zip(a, b)) if x != y}


def _files(root: Path) -> dict[str, Path]:
    base = root / "files"
    return {str(p.relative_to(base)): p for p in sorted(base.rglob("*")) if p.is_file()}


def _file_lines(path: Path, base: Path) -> list[str]:
    if path.suffix == ".png":
        return [f"png of {path.stat().st_size // 4096 * 4096} bytes (4 KiB steps)"]
    text = path.read_text(errors="replace").replace(str(base), "{o}")
    return text.splitlines()


def compare(old: Path, new: Path, old2: Path | None) -> int:
    a = json.loads((old / "runs.json").read_text())
    b = json.loads((new / "runs.json").read_text())
    a2 = json.loads((old2 / "runs.json").read_text()) if old2 else a
    problems: list[str] = []
    by_cmd = {r["command"]: r for r in b}
    for r, r2 in zip(a, a2):
        s = by_cmd.get(r["command"])
        if s is None:
            problems.append(f"{r['command']}: not run now")
            continue
        if r["rc"] != s["rc"]:
            problems.append(f"{r['command']}: exit {r['rc']} before, {s['rc']} now")
        for stream in ("stdout", "stderr"):
            x = r[stream].replace(str(old / "files"), "{o}").splitlines()
            x2 = r2[stream].replace(str((old2 or old) / "files"), "{o}").splitlines()
            y = s[stream].replace(str(new / "files"), "{o}").splitlines()
            problems += _lines_differ(x, y, _volatile(x, x2), f"{r['command']} [{stream}]")
    fa, fb = _files(old), _files(new)
    fa2 = _files(old2) if old2 else fa
    for name in sorted(set(fa) | set(fb)):
        if name not in fa or name not in fb:
            problems.append(f"file {name}: {'only now' if name in fb else 'only before'}")
            continue
        x, y = _file_lines(fa[name], old / "files"), _file_lines(fb[name], new / "files")
        x2 = _file_lines(fa2[name], (old2 or old) / "files") if name in fa2 else x
        problems += _lines_differ(x, y, _volatile(x, x2), f"file {name}")
    for p in problems:
        print(p)
    print(f"{len(a)} commands, {len(fa)} files compared: {len(problems)} difference(s)")
    return 1 if problems else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    r = sub.add_parser("record")
    r.add_argument("out", type=Path)
    r.add_argument("--cli", default=f"{sys.executable} -m partitioner_cli")
    r.add_argument("--benches", action="store_true")
    c = sub.add_parser("compare")
    c.add_argument("old", type=Path)
    c.add_argument("new", type=Path)
    c.add_argument("old2", type=Path, nargs="?")
    args = ap.parse_args()
    if args.verb == "record":
        record(args.out.resolve(), args.cli, args.benches)
        return 0
    return compare(args.old.resolve(), args.new.resolve(), args.old2.resolve() if args.old2 else None)


if __name__ == "__main__":
    sys.exit(main())
