"""``partitioner bench [NAME...]``: run the benchmarks of ``bench/`` from one place.

    partitioner bench --list                 the benchmarks, what each measures and needs
    partitioner bench                        the quick set (quick settings; minutes)
    partitioner bench dp_scaling fidelity    these, quick
    partitioner bench --full scale           the long setting of a benchmark
    partitioner bench --write ...            also save bench/results/runs/NAME.json and regenerate
                                             NAME's section of docs/results.md, with its plots

Every benchmark is a script of ``bench/`` run as it would be by hand (``python bench/NAME.py
ARGS``) from the repository root, so the scripts stay runnable on their own; its printed table
is kept, and the rows a script hands over (``bench/_results.py``) are saved with the machine,
the package versions and the seeds. Without ``--write`` nothing in the tree is written: the
scripts' own outputs go to a temporary folder. Works in a source checkout (``bench/`` next to
``partitioner/``). Torch is imported by no code here: only by the scripts that need it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from partitioner.errors import PartitionerError

__all__ = ["BENCHMARKS", "Benchmark", "register", "run_benchmark"]

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: ``argv`` (a script of ``bench/`` and its arguments, or ``-m partitioner_cli ...``)
    in its quick and full settings. In the arguments ``{tmp}`` is a fresh temporary folder and
    ``{img}`` the folder of the figures (docs/img with ``--write``, else ``{tmp}``).
    ``write_args`` are added with ``--write`` (a script's own figure); ``figures`` are the images
    (under ``{img}``) its section of docs/results.md shows; ``needs``: ``gpu``, ``torch`` or paths
    that must exist; ``long``: left out of the default set (run when named)."""

    name: str
    summary: str
    quick: tuple[str, ...]
    full: tuple[str, ...]
    write_args: tuple[str, ...] = ()
    write_args_full: tuple[str, ...] = ()
    figures: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    long: bool = False
    seeds: dict[str, int] = field(default_factory=dict)
    timeout_s: float = 900.0

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"benchmark name {self.name!r} must be an identifier")
        if not self.quick or not self.full:
            raise ValueError(f"benchmark {self.name}: give quick and full arguments")


def _script(name: str, *args: str) -> tuple[str, ...]:
    return (f"bench/{name}.py", *args)


_HETPIPE = ("examples/profiles/vgg19_hetpipe.json", "--cluster", "examples/clusters/hetpipe.yaml")

BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("compare", "plan quality per solver: every solver, policy and baseline on VGG-19, HetPipe cluster",
              ("-m", "partitioner_cli", "compare", *_HETPIPE, "--virtual-workers", "auto", "--time-limit", "5",
               "-o", "{tmp}/compare.json", "--png", "{img}/compare.png"),
              ("-m", "partitioner_cli", "compare", *_HETPIPE, "--virtual-workers", "auto",
               "-o", "{tmp}/compare.json", "--png", "{img}/compare.png"),
              figures=("compare.png",)),
    Benchmark("solver_agreement", "DP, CP-SAT and CBC on the same chain problems: objectives, bounds, times",
              _script("solver_agreement", "--quick", "--time-limit", "5", "--no-write"),
              _script("solver_agreement", "--no-write"), seeds={"random_chains": 0}),
    Benchmark("ilp", "convex stages of ResNet-50's and GNMT's graphs (CP-SAT, CBC) against the chain DP",
              _script("ilp", "--quick", "--time-limit", "20"), _script("ilp")),
    Benchmark("ilp_joint", "device mapping + split in one model (CP-SAT, CBC) on the HetPipe cluster: gap at 10 s "
              "and 60 s", _script("ilp", "--joint", "--quick", "--png", "{img}/ilp_joint.png"),
              _script("ilp", "--joint", "--png", "{img}/ilp_joint.png"), figures=("ilp_joint.png",)),
    Benchmark("dp_scaling", "solve time of the exact chain DP against layers x devices (log axes)",
              _script("dp_scaling", "--repeats", "3"), _script("dp_scaling", "--repeats", "5"),
              figures=("dp_scaling.png",), seeds={"instance": 0}),
    Benchmark("dp_optimality", "the DP's bottleneck against an independent exact method on PipeDream's profiles",
              _script("dp_optimality"), _script("dp_optimality")),
    Benchmark("fidelity", "simulator's predicted against Sailor's measured OPT-350M runs (GH200 nodes)",
              _script("fidelity"), _script("fidelity", "--fit", "--ablate"), write_args=("--write",),
              write_args_full=("--write",), figures=("fidelity.png",),
              needs=(str(SHARED / "sailor_validation"), str(SHARED / "sailor_opt350"))),
    Benchmark("closed_form", "the solvers' closed form against the simulator, plan by plan",
              _script("closed_form"), _script("closed_form")),
    Benchmark("schedules", "zero-bubble schedules (ZB-H1, ZB-H2, ZB-V) against 1F1B and interleaved, flushed and "
              "with overlapping iterations: closed forms on equal stages, simulated on the HetPipe and PipeDream "
              "profiles",
              _script("schedules", "--quick"), _script("schedules")),
    Benchmark("hetero", "opt against HetPipe's policies and the baselines, and planning time",
              _script("hetero", "--quick", "--runs", "1"), _script("hetero", "--runs", "3"),
              needs=(str(SHARED / "sailor_opt350"),)),
    Benchmark("simulator", "simulator closed forms on uniform stages and the speed of a large simulation",
              _script("simulator", "--runs", "3", "--out", "{tmp}/simulator.md"),
              _script("simulator", "--runs", "5", "--out", "{tmp}/simulator.md")),
    Benchmark("projection_error", "per-operator projection between GPU types, leave one type out (Sailor OPT-350M)",
              _script("projection_error", "--out", "{tmp}/projection_error.md"),
              _script("projection_error", "--out", "{tmp}/projection_error.md", "--png", "{img}/projection_loto.png"),
              figures=("projection_loto.png",),
              needs=(str(SHARED / "sailor_opt350"),)),
    Benchmark("projection_plans", "plans from projected profiles simulated on measured times (Sailor OPT-350M, "
              "mixed RTX-3090 / RTX-2080 Ti / TITAN-RTX cluster)",
              _script("projection_plans"), _script("projection_plans"),
              needs=(str(SHARED / "sailor_opt350"),)),
    Benchmark("sailor_h2h", "our tensor/pipeline/data-parallel search against Sailor's chosen plans on its three "
              "OPT-350M problems (global batch 1,024), both simulated here; planning time and certificate",
              _script("sailor_h2h", "--time-limit", "3"), _script("sailor_h2h", "--time-limit", "30"),
              needs=(str(SHARED / "sailor_opt350"), str(SHARED / "sailor_plans")), long=True),
    Benchmark("memory_levers", "per-stage recomputation and ZeRO-1 against no levers and uniform full recomputation "
              "(Sailor OPT-350M and GPT-2 medium, memory-mixed A100 / V100 / RTX 2080 Ti clusters)",
              _script("memory_levers", "--time-limit", "10"), _script("memory_levers", "--time-limit", "60"),
              needs=(str(SHARED / "sailor_opt350"),)),
    Benchmark("exact_levers", "activation recomputation in the exact models: one memory-bound pipeline (Sailor "
              "OPT-350M, 4 V100 + 4 RTX 2080 Ti) by dp, cpsat and milp, in the given order and the joint mapping",
              _script("exact_levers", "--time-limit", "20"), _script("exact_levers", "--time-limit", "120"),
              needs=(str(SHARED / "sailor_opt350"),)),
    Benchmark("levers_runtime", "memory levers run under the emulation (gpt2-tiny, 2 P100 + 2 T4 on CPU processes): "
              "measured peak memory per rank and iteration against predicted, none / selective / full / ZeRO-1 / ZeRO-2",
              _script("levers_runtime", "--rounds", "1", "--steps", "5", "--warmup", "2"),
              _script("levers_runtime", "--rounds", "5"), needs=("torch",), long=True, seeds={"weights_and_data": 0}),
    Benchmark("cli_startup", "wall time of CLI commands that never need torch",
              _script("cli_startup", "--runs", "3"), _script("cli_startup", "--runs", "5", "--pyc")),
    Benchmark("scale", "cluster planner's solve time, gap and memory against layers x GPUs",
              _script("scale", "--sizes", "150x64", "--time-limit", "5"), _script("scale"),
              write_args_full=("--write",), figures=("scale.png",)),
    Benchmark("cpu_contention", "do two processes on this machine slow each other down (compute, memory)",
              _script("cpu_contention"), _script("cpu_contention"), needs=("torch",)),
    Benchmark("profiler_fidelity", "profiler repeatability, per-layer sum against the whole model, saved bytes",
              _script("profiler_fidelity", "--models", "vgg19-tiny:8,gpt2-tiny:8", "--out", "{tmp}/pf.md"),
              _script("profiler_fidelity", "--out", "{tmp}/pf.md"), needs=("torch",), long=True),
    Benchmark("runtime_fidelity", "simulator's predicted against the runtime's measured iteration (CPU processes)",
              _script("runtime_fidelity", "--rounds", "1", "--steps", "6", "--out", "{tmp}/rf.md"),
              _script("runtime_fidelity", "--out", "{tmp}/rf.md"), needs=("torch",), long=True),
    Benchmark("sailor_profiles", "this profiler's H100 profiles of OPT-350M against Sailor's, and projection from them",
              _script("sailor_profiles", "--ours", str(ROOT / "bench" / "results" / "h100-2026-11-27")),
              _script("sailor_profiles", "--ours", str(ROOT / "bench" / "results" / "h100-2026-11-27")),
              needs=(str(SHARED / "sailor_opt350"),)),
    Benchmark("gpu_memory", "measured peak memory of the H100 training runs against the cost model's, then and now",
              _script("gpu_memory"), _script("gpu_memory"), needs=("torch",)),
    Benchmark("runtime_vs_torch", "this runtime against torch.distributed.pipelining, same split and micro-batches",
              _script("runtime_vs_torch", "--rounds", "3", "--steps", "3"), _script("runtime_vs_torch", "--rounds", "7"),
              needs=("torch",), long=True),
    Benchmark("exports", "each export against this runtime on one plan: torch pipelining's losses side by side "
                         "(GPT-2 tiny, 30 steps; PP x DP, bf16, TP 2 x PP 2 in fp32 and fp16), DeepSpeed's config "
                         "class, Megatron-Core's layout and model build",
              _script("exports", "--steps", "10"), _script("exports"), needs=("torch",), long=True),
    Benchmark("emulation", "emulated heterogeneous cluster (A100 + 2 T4 on CPU processes): measured against "
                           "predicted iteration of opt, uniform and pipedream plans; zb-h1 and zb-h2 (flushed, "
                           "overlapped) against 1f1b on 4 GPUs",
              _script("emulation", "--rounds", "2", "--zero-bubble", "--overlap"),
              _script("emulation", "--rounds", "5", "--zero-bubble", "--overlap", "--wsp", "--png", "{img}/emulation_wsp.png"),
              figures=("emulation_wsp.png",), needs=("torch",), long=True, seeds={"weights_and_data": 0}),
    Benchmark("wsp", "WSP against sync data parallelism on an emulated 3-type cluster (links emulated): time to "
                     "a held-out loss, speed-up, predicted against measured",
              _script("wsp", "--rounds", "1", "--seconds", "15", "--png", "{img}/wsp.png"),
              _script("wsp", "--rounds", "3", "--png", "{img}/wsp.png"),
              figures=("wsp.png",), needs=("torch",), long=True, seeds={"weights_and_data": 0}, timeout_s=1800.0),
    Benchmark("kill_resume", "a random rank killed at a random step, 20 times: every resume, no corrupt checkpoint",
              _script("kill_resume", "--runs", "5"), _script("kill_resume", "--runs", "20"), needs=("torch",),
              long=True, seeds={"kill": 0}),
    Benchmark("elastic", "a random rank killed, the plan re-planned without its device, the run resumed on it: "
              "resume step, state bit for bit, losses against the new plan run from the same checkpoint, re-plan "
              "time on 16 and 256 GPUs",
              _script("elastic", "--runs", "3", "--replan-rounds", "2"), _script("elastic", "--runs", "20"),
              needs=("torch",), long=True, seeds={"kill": 0}),
    Benchmark("gpu_breakdown", "one GPU's training step against its per-layer profile: time and memory",
              _script("gpu_breakdown"), _script("gpu_breakdown", "--model", "gpt2-medium", "--seq-len", "1024"),
              needs=("gpu", "torch")),
    Benchmark("fuzz", "the command line against mutated input files: tracebacks, hangs, wrong answers",
              _script("fuzz", "--files", "60", "--seed", "0"), _script("fuzz", "--files", "3000", "--seed", "2026"),
              long=True, seeds={"seed": 0}, timeout_s=1800.0),
)


def _by_name() -> dict[str, Benchmark]:
    return {b.name: b for b in BENCHMARKS}


def _versions() -> dict[str, str | None]:
    """Versions of Python, this project and the packages the benchmarks use (none imported)."""
    from importlib import metadata

    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for dist in ("numpy", "torch", "ortools", "pulp", "matplotlib"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    from partitioner import __version__

    out["partitioner"] = __version__
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["commit"] = None
    return out


def _machine() -> str:
    """bench/_machine.py's line, from a child process (nothing of bench/ is imported here)."""
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "_machine.py")], capture_output=True, text=True,
                         timeout=60, check=True)
    return res.stdout.strip()


def _has_gpu() -> tuple[bool, str]:
    """Whether torch sees a CUDA GPU, asked in a child process (this one never imports torch)."""
    try:
        res = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"could not ask torch for a GPU ({exc})"
    count = res.stdout.strip()
    if res.returncode != 0 or not count.isdigit():
        return False, "torch is not installed" if "No module named" in res.stderr else "torch could not be asked"
    return (True, "") if int(count) > 0 else (False, "no CUDA GPU on this machine")


def _missing(bench: Benchmark) -> str | None:
    """Why ``bench`` cannot run here, or None."""
    from importlib.util import find_spec

    for need in bench.needs:
        if need == "gpu":
            ok, why = _has_gpu()
            if not ok:
                return f"needs a GPU: {why}"
        elif need == "torch":
            if find_spec("torch") is None:
                return "needs torch, which is not installed"
        elif not Path(need).exists():
            return f"needs {need}, which is not there"
    return None


def run_benchmark(bench: Benchmark, *, full: bool = False, write: bool = False,
                  out_root: Path = ROOT) -> dict[str, Any]:
    """Run one benchmark; returns its record (also saved, with ``write``, to
    ``out_root/bench/results/runs/NAME.json``, figures to ``out_root/docs/img``)."""
    record: dict[str, Any] = {"format": "partitioner.bench/1", "name": bench.name, "summary": bench.summary,
                              "setting": "full" if full else "quick", "machine": _machine(),
                              "versions": _versions(), "seeds": dict(bench.seeds),
                              "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    why = _missing(bench)
    if why:
        record.update(status="skipped", reason=why)
        return record
    img = out_root / "docs" / "img"
    with tempfile.TemporaryDirectory(prefix=f"bench-{bench.name}-") as tmp:
        fig_dir = img if write else Path(tmp)
        fig_dir.mkdir(parents=True, exist_ok=True)
        args = list(bench.full if full else bench.quick)
        if write:
            args += bench.write_args_full if full else bench.write_args
        args = [a.replace("{tmp}", tmp).replace("{img}", str(fig_dir)) for a in args]
        rows_file = Path(tmp) / "rows.json"
        env = dict(os.environ, PARTITIONER_BENCH_ROWS=str(rows_file), MPLBACKEND="Agg",
                   PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
        argv = [sys.executable, *args]
        shown = [a.replace(tmp, "$TMP").replace(f"{out_root}{os.sep}", "") for a in args]
        record["command"] = " ".join(["python", *shown])
        t0, started = time.monotonic(), time.time() - 1.0
        try:
            res = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=bench.timeout_s)
            rc, out, err = res.returncode, res.stdout, res.stderr
        except subprocess.TimeoutExpired as exc:
            rc, out, err = None, _text(exc.stdout), _text(exc.stderr)
        record["wall_s"] = round(time.monotonic() - t0, 3)
        record["returncode"] = rc
        record["output"] = out.replace(tmp, "$TMP").replace(f"{out_root}{os.sep}", "").replace(
            f"{ROOT}{os.sep}", "").splitlines()
        if rc == 0:
            record["status"] = "ok"
        else:
            tail = (err.strip().splitlines() or ["(no output)"])[-1]
            record.update(status="failed", reason=(f"timed out after {bench.timeout_s:.0f} s" if rc is None
                                                   else f"exit {rc}: {tail}"))
        record.update(_rows(rows_file, Path(tmp) / "compare.json"))
        # the figures this run drew (a figure made only by the full setting is not shown for a quick run)
        record["figures"] = [f for f in bench.figures if (fig_dir / f).exists() and (fig_dir / f).stat().st_mtime >= started]
        if write:
            _save(record, out_root)
    return record


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def _rows(rows_file: Path, compare_file: Path) -> dict[str, Any]:
    """The rows a script handed over (``bench/_results.py``) or ``partitioner compare -o`` wrote."""
    for path in (rows_file, compare_file):
        if path.exists():
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            extra = {k: v for k, v in data.items() if k in ("seeds", "repeats")}
            return {"rows": data.get("rows", []), **extra}
    return {}


def _save(record: dict[str, Any], out_root: Path) -> None:
    from partitioner._io import write_json

    runs = out_root / "bench" / "results" / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    if record["status"] == "ok":
        # bench/_page.py writes the section and its figures in a child process; it prints the figures
        with tempfile.TemporaryDirectory() as tmp:
            staged = Path(tmp) / "record.json"
            write_json(str(staged), record)
            res = subprocess.run([sys.executable, str(ROOT / "bench" / "_page.py"), str(staged),
                                  str(out_root / "docs" / "results.md"), str(out_root / "docs" / "img")],
                                 capture_output=True, text=True, timeout=600)
            if res.returncode != 0:
                raise PartitionerError(f"bench/_page.py could not write {record['name']}'s section: "
                                       f"{(res.stderr.strip().splitlines() or ['no message'])[-1]}")
            record["figures"] = json.loads(res.stdout)
    write_json(str(runs / f"{record['name']}.json"), record)


def _list() -> int:
    width = max(len(b.name) for b in BENCHMARKS)
    for b in BENCHMARKS:
        tags = ["long" if b.long else "quick set"]
        tags += [("needs " + n) if n in ("gpu", "torch") else f"needs {Path(n).name}/" for n in b.needs]
        print(f"{b.name:<{width}}  {b.summary} [{', '.join(tags)}]")
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.list:
        if args.names:
            raise PartitionerError("--list takes no benchmark names")
        return _list()
    if not (ROOT / "bench").is_dir():
        raise PartitionerError(f"bench/ is not next to {ROOT / 'partitioner'}: run partitioner bench from a "
                               "source checkout")
    known = _by_name()
    unknown = [n for n in args.names if n not in known]
    if unknown:
        raise PartitionerError(f"unknown benchmark {', '.join(map(repr, unknown))}; valid names: "
                               f"{', '.join(known)}")
    chosen = [known[n] for n in dict.fromkeys(args.names)] or [b for b in BENCHMARKS if not b.long]
    if args.write and shutil.which("git") is None:
        from partitioner.progress import note

        note("note: git not found; the results record no commit")  # on stderr, unless --quiet
    failed = 0
    for bench in chosen:
        print(f"== {bench.name}: {bench.summary}", flush=True)
        rec = run_benchmark(bench, full=args.full, write=args.write)
        if rec["status"] == "skipped":
            print(f"skipped: {rec['reason']}", flush=True)
            continue
        print("\n".join(rec["output"]))
        print(f"-- {bench.name}: {rec['status']} in {rec['wall_s']:.1f} s" +
              (f" ({rec['reason']})" if rec["status"] != "ok" else ""), flush=True)
        if args.write and rec["status"] == "ok":
            print(f"wrote bench/results/runs/{bench.name}.json and its section of docs/results.md", flush=True)
        failed += rec["status"] != "ok"
    return 1 if failed else 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run the benchmarks of bench/ (quick set by default); --list names them",
                       description="Run benchmarks of bench/ by name (default: the quick set, a few minutes) and "
                                   "print their tables; --write saves bench/results/runs/NAME.json (machine, "
                                   "versions, seeds, rows) and regenerates NAME's section of docs/results.md "
                                   "with its plots.")
    p.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run (default: the quick set)")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    setting = p.add_mutually_exclusive_group()
    setting.add_argument("--quick", dest="full", action="store_false", default=False,
                         help="quick settings (the default)")
    setting.add_argument("--full", dest="full", action="store_true", help="the long settings (minutes to hours)")
    p.add_argument("--write", action="store_true",
                   help="save the results JSON and regenerate the benchmark's section of docs/results.md")
    p.set_defaults(func=_run)
