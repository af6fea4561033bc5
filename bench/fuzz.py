"""Fuzz the command line with mutated input files: tracebacks, hangs and silent wrong answers.

Run from the repository root: ``python bench/fuzz.py [--files 3000] [--seed 0] [--timeout 10]
[--out bench/results/fuzz.md]``.

The example profiles, clusters and PipeDream graphs, plans made from them, a copy of the
Sailor test profile, one of Sailor's measured runs and its network files are mutated
(:func:`mutate`: deleted fields, swapped types, extreme numbers, truncation, other encodings,
NUL bytes, YAML alias bombs, deep nesting, cycles ...) and every command that reads that kind
of file is run on each mutated file: ``plan``, ``simulate``, ``compare``, ``explain``,
``export`` (all three targets, with a snippet), ``import pipedream``, ``import sailor``,
``import sailor-run``, ``import sailor-network``, ``profile project``, ``profile merge`` and
``train`` (its argument and file validation only: the process launch is replaced by a stub,
nothing trains). Each call runs in a child process forked from this one (which has imported
everything once), with a wall-clock limit (``--timeout``, default 10 s) and an address-space
limit. A call is counted as

* **traceback**: it printed a Python traceback, reported an internal error, or ended with an
  exit status other than 0 (done), 1 (infeasible / does not fit) or 2 (bad input);
* **hang**: it ran past the limit and was killed;
* **silent wrong**: it succeeded but an output file is not strict JSON (NaN, Infinity), is a
  plan, profile or cluster its own reader refuses, is a generated Python snippet that does not
  parse, or its printed report shows ``nan`` / ``inf``; or any call changed one of its inputs.

The mutation helpers are also used by ``tests/test_fuzz.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import random
import re
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from partitioner._io import _yaml_load  # noqa: E402  (the project's bounded YAML reader)

__all__ = ["Corpus", "build_corpus", "check_outputs_finite", "check_outputs_valid", "command_lines", "mutate",
           "output_paths", "run_in_process"]

EXTREME_NUMBERS: tuple[Any, ...] = (
    0, -1, 1, 2, 0.5, -0.0, 1e-320, 5e-324, 1e-300, 1e308, -1e308, 1.7976931348623157e308, 2**31, 2**53 + 1,
    2**63, -(2**63), 2**64, 10**30, 10**400, 1_000_000_000, 4096, 4097, 64, 65, 1024, 1025, 100_001, 1e6, 1e9, 1e15,
    1e21,
)
ODD_VALUES: tuple[Any, ...] = (None, True, False, "", "x", "n0:0", "9" * 50, [], {}, [1, 2], {"a": 1}, [[1]],
                               "é" * 3, "a" * 5000, [None], {"": None})


# -- mutations ---------------------------------------------------------------------------------


def _paths(tree: Any) -> list[tuple[Any, Any]]:
    """(container, key) of every value in a parsed JSON/YAML tree."""
    out: list[tuple[Any, Any]] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in list(items):
            out.append((node, k))
            if isinstance(v, (dict, list)):
                stack.append(v)
    return out


def _tree_mutation(tree: Any, rng: random.Random) -> Any:
    tree = copy.deepcopy(tree)
    paths = _paths(tree)
    if not paths:
        return rng.choice(ODD_VALUES)
    numeric = [(c, k) for c, k in paths if isinstance(c[k], (int, float)) and not isinstance(c[k], bool)]
    op = rng.choice(("delete", "type", "extreme", "extreme", "extreme", "odd", "dup", "empty", "rename", "negate",
                     "scale", "swap"))
    if op in ("extreme", "negate", "scale") and numeric:
        c, k = rng.choice(numeric)
        if op == "extreme":
            c[k] = rng.choice(EXTREME_NUMBERS)
        elif op == "negate":
            c[k] = -c[k]
        else:
            c[k] = c[k] * rng.choice((10, 1000, 1e6, 1e-6, 1e100))
        return tree
    c, k = rng.choice(paths)
    if op == "delete":
        del c[k]
    elif op in ("type", "odd", "extreme", "negate", "scale"):
        v = c[k]
        choices: list[Any] = list(ODD_VALUES)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            choices += [str(v), [v], float(v) + 0.5, int(v) if isinstance(v, float) and abs(v) < 1e18 else 1]
        c[k] = rng.choice(choices)
    elif op == "dup" and isinstance(c[k], list) and c[k]:
        c[k] = c[k] + c[k][: rng.randint(1, len(c[k]))]
    elif op == "dup" and isinstance(c, list):
        c.insert(k, copy.deepcopy(c[k]))
    elif op == "empty":
        c[k] = type(c[k])() if isinstance(c[k], (list, dict, str)) else None
    elif op == "rename" and isinstance(c, dict):
        c[f"{k}_x" if rng.random() < 0.5 else str(k).upper()] = c.pop(k)
    elif op == "swap":
        c2, k2 = rng.choice(paths)
        if c2 is not c or k2 != k:
            a, b = c[k], c2[k2]
            with contextlib.suppress(Exception):
                c[k], c2[k2] = copy.deepcopy(b), copy.deepcopy(a)
    return tree


def _dump(tree: Any, kind: str, rng: random.Random) -> bytes:
    if kind == "yaml":
        import yaml

        return yaml.safe_dump(tree, sort_keys=False, allow_unicode=rng.random() < 0.5).encode("utf-8")
    return json.dumps(tree, indent=rng.choice((None, 1))).encode("utf-8")


def _alias_bomb(levels: int) -> bytes:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    lines.append(f"nodes: *a{levels - 1}")
    return ("\n".join(lines) + "\n").encode()


def _byte_mutation(data: bytes, kind: str, rng: random.Random) -> bytes:
    op = rng.choice(("truncate", "utf16", "utf32", "latin1", "bom", "nul", "flip", "flip", "deep", "bomb", "empty",
                     "append", "dupline", "bigint", "crlf", "tabs"))
    text = data.decode("utf-8", errors="replace")
    if op == "truncate":
        return data[: rng.randint(0, max(0, len(data) - 1))]
    if op == "utf16":
        return text.encode("utf-16")
    if op == "utf32":
        return text.encode("utf-32")
    if op == "latin1":
        i = rng.randint(0, len(text))
        return (text[:i] + "é£ñ" + text[i:]).encode("latin-1", errors="replace")
    if op == "bom":
        return b"\xef\xbb\xbf" + data
    if op == "nul":
        i = rng.randint(0, len(data))
        return data[:i] + b"\x00" * rng.randint(1, 8) + data[i:]
    if op == "flip":
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            if b:
                b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b)
    if op == "deep":
        n = rng.choice((1000, 100_000))
        inner = "[" * n + "]" * n
        return (f'{{"nodes": {inner}}}' if kind == "json" else f"nodes: {inner}\n").encode()
    if op == "bomb":
        return _alias_bomb(rng.randint(6, 10)) if kind != "json" else data
    if op == "empty":
        return b""
    if op == "append":
        return data + rng.choice((b"\n{}", b"\n- x", b" garbage", b"\n\t\tnode1 -- node1\n"))
    if op == "dupline":
        lines = data.splitlines(keepends=True)
        if lines:
            i = rng.randrange(len(lines))
            lines.insert(i, lines[rng.randrange(len(lines))])
        return b"".join(lines)
    if op == "bigint":
        return re.sub(rb"\d+", lambda m: b"9" * rng.choice((19, 400, 5000)) if rng.random() < 0.1 else m.group(0),
                      data, count=50)
    if op == "crlf":
        return data.replace(b"\n", b"\r\n")
    return data.replace(b"  ", b"\t")


def _graph_mutation(data: bytes, rng: random.Random) -> bytes:
    """PipeDream graph.txt: numbers, node ids, edges (cycles, self loops, unknown nodes)."""
    lines = data.decode("utf-8", errors="replace").splitlines()
    op = rng.choice(("number", "number", "cycle", "self", "unknown", "delete", "dupnode", "bignode", "metric"))
    nodes = [ln.split(" -- ")[0] for ln in lines if ln.startswith("node")]
    edges = [i for i, ln in enumerate(lines) if ln.startswith("\t")]
    if op == "number" and any("=" in ln for ln in lines):
        i = rng.choice([k for k, ln in enumerate(lines) if "=" in ln])
        value = rng.choice(("-1", "nan", "inf", "1e400", "1e308", "0", "abc", "[1; -2]", "[]", "9" * 400, "1e-320"))
        key = rng.choice(("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size"))
        lines[i] = re.sub(rf"{key}=[^,\s]+", f"{key}={value}", lines[i])
    elif op == "cycle" and edges:
        a, b = lines[rng.choice(edges)].strip().split(" -- ")
        lines.append(f"\t{b} -- {a}")
    elif op == "self" and nodes:
        n = rng.choice(nodes)
        lines.append(f"\t{n} -- {n}")
    elif op == "unknown":
        lines.append("\tnode1 -- node999999")
    elif op == "delete" and lines:
        del lines[rng.randrange(len(lines))]
    elif op == "dupnode" and nodes:
        pick = rng.choice(nodes)
        line = next((ln for ln in lines if ln.startswith(pick + " ")), None)  # an earlier round may have cut it
        if line is not None:
            lines.append(line)
    elif op == "bignode":
        lines.append(f"node{'7' * rng.choice((19, 5000))} -- Relu -- forward_compute_time=1.0, "
                     "backward_compute_time=1.0, activation_size=1.0, parameter_size=0.0")
    elif op == "metric" and lines:
        i = rng.randrange(len(lines))
        lines[i] = lines[i].replace("activation_size", "activation_sise")
    return ("\n".join(lines) + "\n").encode()


def mutate(data: bytes, kind: str, rng: random.Random) -> bytes:
    """One mutation of a file of ``kind`` (``json``, ``yaml`` or ``graph``): structural (on the
    parsed tree, re-serialised) or on the bytes, sometimes two in a row."""
    rounds = 2 if rng.random() < 0.2 else 1
    for _ in range(rounds):
        r = rng.random()
        if kind == "graph" and r < 0.6:
            data = _graph_mutation(data, rng)
            continue
        if kind in ("json", "yaml") and r < 0.65:
            # Parsed as the project reads files: a YAML alias bomb left by an earlier round is
            # refused, not expanded (yaml.safe_load would expand it without bound), and a tree
            # too deep to copy falls back to a byte mutation.
            try:
                text = data.decode("utf-8")
                tree = _yaml_load(text) if kind == "yaml" else json.loads(text)
                data = _dump(_tree_mutation(tree, rng), kind, rng)
            except Exception:  # includes RecursionError and the loader's FormatError
                data = _byte_mutation(data, kind, rng)
            continue
        data = _byte_mutation(data, kind, rng)
    return data


# -- the corpus: base files and the command lines that read them ---------------------------------


@dataclass(frozen=True)
class Base:
    """A family of consistent inputs: profile, cluster, plan, and what to call them with."""

    name: str
    profile: Path
    cluster: Path
    plan: Path
    model: str  # zoo model for ``train`` ("" when the profile is not of a zoo model)
    plan_flags: tuple[str, ...] = ()


@dataclass(frozen=True)
class Corpus:
    bases: tuple[Base, ...]
    graphs: tuple[Path, ...]
    sailor: Path
    sailor_run: Path  # one of Sailor's measured runs (plan_config_*.json), read with sailor and network
    network: Path  # Sailor's fitted inter-node curves
    intra: Path  # Sailor's intra-node curves


def _zoo_profile(path: Path) -> None:
    from partitioner.profile import LayerProfile, LayerTime, Profile
    from runtime.stage import zoo_chain

    n = zoo_chain("gpt2-tiny", 2).num_layers
    Profile("gpt2-tiny", 2, tuple(LayerProfile(f"l{i}", 1e6, 4e5, 1e5, 1e5, {"cpu": LayerTime(1e-3, 2e-3)})
                                  for i in range(n)), source="fuzz").save(path)


def build_corpus(work: Path) -> Corpus:
    """Base files in ``work``: the examples, plans made from them, a zoo-model profile."""
    from partitioner.cluster import Cluster
    from partitioner.profile import Profile
    from solvers import solve

    work.mkdir(parents=True, exist_ok=True)
    ex = ROOT / "examples"
    _zoo_profile(work / "gpt2_tiny.json")
    specs = (
        ("vgg16", ex / "profiles/vgg16_v100.json", ex / "clusters/v100x8.yaml", "", {"allow_fewer": True},
         ("--allow-fewer",)),
        ("vgg19-het", ex / "profiles/vgg19_hetpipe.json", ex / "clusters/hetpipe.yaml", "",
         {"schedule": "gpipe", "micro_batches": 4}, ("--schedule", "gpipe")),
        ("resnet152-het", ex / "profiles/resnet152_hetpipe.json", ex / "clusters/hetpipe.yaml", "",
         {"allow_fewer": True, "schedule": "2bw"}, ("--allow-fewer", "--schedule", "2bw")),
        ("gpt2-tiny", work / "gpt2_tiny.json", ex / "clusters/cpu4.yaml", "gpt2-tiny",
         {"devices": ["n0:0", "n0:1"], "micro_batches": 3}, ("--devices", "n0:0,n0:1")),
    )
    bases = []
    for name, prof, cl, model, kwargs, flags in specs:
        res = solve(Profile.load(prof), Cluster.load(cl), solver="dp", **kwargs)
        assert res.plan is not None, (name, res.reason)
        plan_path = work / f"{name}_plan.json"
        res.plan.save(plan_path)
        bases.append(Base(name, prof, cl, plan_path, model, flags))
    graphs = (ex / "profiles/vgg16_pipedream_graph.txt", ROOT / "tests/data/pipedream/resnet18.txt")
    data = ROOT / "tests/data"
    return Corpus(tuple(bases), graphs, data / "sailor_opt350",
                  data / "sailor_validation/clariden_opt350/plan_config_N4_D2.json",
                  data / "sailor_validation/network/network_coeffs_all_homo.json",
                  data / "sailor_validation/network/intra_node_bandwidths.json")


ROLES = ("profile", "cluster", "plan", "graph", "sailor", "sailor-run", "network", "intra")
EXPORT_TARGETS = ("torch-pipelining", "deepspeed", "megatron")


def output_paths(out: Path) -> list[Path]:
    """Every file a command line of :func:`command_lines` may write, given its ``out``."""
    return [out, out.with_suffix(".py"), out.with_suffix(".sh"), out.with_suffix(".png"),
            *(out.with_suffix("") / name for name in ("plan.json", "profile.json", "cluster.json"))]


def command_lines(corpus: Corpus, role: str, base: Base | None, mutated: Path, out: Path,
                  pick: int = 0) -> list[list[str]]:
    """Every command that reads a file of ``role`` (see :data:`ROLES`), with ``mutated`` in that
    place; outputs go to ``out`` (and the other names of :func:`output_paths`). ``pick`` varies
    the choices a role has (the export target)."""
    o = str(out)
    folder = str(out.with_suffix(""))
    if role == "graph":
        return [["import", "pipedream", str(mutated), "-o", o],
                ["import", "pipedream", str(mutated), "--micro-batch-size", "4", "--model", "m", "-o", o]]
    if role == "sailor":
        return [["import", "sailor", str(mutated), "-o", o],
                ["import", "sailor-run", str(corpus.sailor_run), "--profiles", str(mutated), "--network",
                 str(corpus.network), "-o", folder]]
    if role == "sailor-run":
        return [["import", "sailor-run", str(mutated), "--profiles", str(corpus.sailor), "--network",
                 str(corpus.network), "-o", folder]]
    if role in ("network", "intra"):
        net, intra = (mutated, corpus.intra) if role == "network" else (corpus.network, mutated)
        lines = [["import", "sailor-network", str(net), "--gpu-type", "GH-96", "--nodes", "2", "--gpus-per-node",
                  "4", "--intra", str(intra), "-o", o]]
        if role == "network":
            lines.append(["import", "sailor-run", str(corpus.sailor_run), "--profiles", str(corpus.sailor),
                          "--network", str(mutated), "-o", folder])
        return lines
    assert base is not None
    prof = str(mutated) if role == "profile" else str(base.profile)
    cl = str(mutated) if role == "cluster" else str(base.cluster)
    plan = str(mutated) if role == "plan" else str(base.plan)
    lines = []
    if role in ("profile", "cluster"):
        lines.append(["plan", prof, "--cluster", cl, *base.plan_flags, "-o", o])
        lines.append(["compare", prof, "--cluster", cl, "--micro-batches", "4", "--time-limit", "1", "-o", o])
    lines.append(["simulate", plan, "--profile", prof, "--cluster", cl, "--trace", o])
    lines.append(["explain", plan, "--profile", prof, "--cluster", cl, "--json", o, "--no-what-if"])
    if role in ("plan", "profile"):
        target = EXPORT_TARGETS[pick % len(EXPORT_TARGETS)]
        snippet = out.with_suffix(".sh" if target == "megatron" else ".py")  # Megatron-LM's is a command line
        lines.append(["export", plan, "--to", target, *(["--profile", prof] if target == "torch-pipelining" else []),
                      "-o", o, "--snippet", str(snippet)])
    if role == "profile":
        lines.append(["profile", "project", prof, "--gpu-type", "A100-SXM4-40GB", "-o", o])
        lines.append(["profile", "merge", prof, str(base.profile), "-o", o])
    if base.model:
        lines.append(["train", plan, "--profile", prof, "--cluster", cl, "--model", base.model, "--local",
                      "--steps", "2", "-o", o])
    return lines


def _stub_training() -> None:
    """Replace the process launch of ``train --local`` with figures that look like a run's."""
    import runtime.launch as launch

    def fake_train_local(plan: Any, config: Any, start_method: str = "spawn", *, run: Any = None) -> dict[str, Any]:
        return {"format": "partitioner.train-metrics/1", "model": plan.model, "world_size": len(plan.devices),
                "measured_iteration_s": 0.01, "samples_per_s": 100.0, "loss": [1.0, 0.9], "step_s": [0.01, 0.01],
                "data": "synthetic", "first_step": 0}

    launch.train_local = fake_train_local  # type: ignore[assignment]


# -- running one call --------------------------------------------------------------------------


def check_outputs_finite(paths: Sequence[Path]) -> str:
    """'' if every existing path is strict JSON; else what is wrong."""

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} in the output")

    for p in paths:
        if not p.exists():
            continue
        try:
            json.loads(p.read_text(encoding="utf-8"), parse_constant=refuse)
        except (ValueError, UnicodeDecodeError) as exc:
            return f"{p.name}: {exc}"
    return ""


def check_outputs_valid(paths: Sequence[Path]) -> str:
    """'' if every existing path is strict JSON (:func:`check_outputs_finite`), every plan, profile
    or cluster among them loads with its reader, every ``.py`` file parses and every line of a
    ``.sh`` file splits into words as a shell reads them; else what is wrong."""
    import ast
    import shlex

    from partitioner.cluster import Cluster
    from partitioner.errors import PartitionerError
    from partitioner.plan import Plan
    from partitioner.profile import Profile

    readers = {"partitioner.plan/1": Plan.load, "partitioner.profile/1": Profile.load,
               "partitioner.cluster/1": Cluster.load}
    for p in paths:
        if not p.exists():
            continue
        if p.suffix == ".py":
            try:
                ast.parse(p.read_text(encoding="utf-8"))
            except (SyntaxError, ValueError, UnicodeDecodeError) as exc:
                return f"{p.name}: the generated Python does not parse: {exc}"
            continue
        if p.suffix == ".sh":
            for line in p.read_text(encoding="utf-8").splitlines():
                try:
                    shlex.split(line, comments=True)
                except ValueError as exc:
                    return f"{p.name}: a generated command line does not split: {exc}: {line[:120]}"
            continue
        if p.suffix != ".json":
            continue
        bad = check_outputs_finite([p])
        if bad:
            return bad
        data = json.loads(p.read_text(encoding="utf-8"))
        reader = readers.get(str(data.get("format"))) if isinstance(data, dict) else None
        if reader is not None:
            try:
                reader(p)
            except PartitionerError as exc:
                return f"{p.name}: written, but its reader refuses it: {exc}"
    return ""


_NON_FINITE_WORD = re.compile(r"(?<![\w.-])-?(nan|inf|infinity)(?![\w])", re.IGNORECASE)


@dataclass(frozen=True)
class Outcome:
    rc: int | None  # None: killed after the time limit
    seconds: float
    stdout: str
    stderr: str

    @property
    def traceback(self) -> bool:
        return self.rc is not None and (self.rc not in (0, 1, 2) or "Traceback (most recent call last)" in self.stderr
                                        or "internal error" in self.stderr)

    @property
    def hang(self) -> bool:
        return self.rc is None


def run_in_process(argv: Sequence[str]) -> tuple[int, str, str, float]:
    """``partitioner_cli.main.main(argv)`` here, stdout and stderr captured: (status, stdout, stderr, seconds).
    An exception escaping ``main`` is written to the captured stderr as a traceback, status 99."""
    from partitioner_cli.main import main

    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        except BaseException:
            traceback.print_exc()
            rc = 99
    return int(rc), out.getvalue(), err.getvalue(), time.perf_counter() - t0


def run_forked(argv: Sequence[str], timeout_s: float, scratch: Path, mem_bytes: int) -> Outcome:
    """``run_in_process(argv)`` in a forked child with a wall-clock and an address-space limit."""
    out_p, err_p = scratch / "stdout", scratch / "stderr"
    sys.stdout.flush()
    sys.stderr.flush()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # child
        rc = 99
        try:
            resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
            rc, out, err, _ = run_in_process(argv)
            out_p.write_text(out, encoding="utf-8", errors="replace")
            err_p.write_text(err, encoding="utf-8", errors="replace")
        except BaseException:
            with contextlib.suppress(BaseException):
                err_p.write_text(traceback.format_exc())
        finally:
            os._exit(rc if 0 <= rc < 256 else 99)
    deadline = t0 + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.perf_counter() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return Outcome(None, time.perf_counter() - t0, "", "")
        time.sleep(0.002)
    seconds = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)

    def read(p: Path) -> str:
        return p.read_text(encoding="utf-8", errors="replace") if p.exists() else ""

    outcome = Outcome(rc if rc >= 0 else 128 - rc, seconds, read(out_p), read(err_p))
    for p in (out_p, err_p):
        p.unlink(missing_ok=True)
    return outcome


# -- the campaign ------------------------------------------------------------------------------


PRELOAD = ("partitioner_cli.main", "partitioner_cli.import_", "partitioner_cli.plan",
           "partitioner_cli.profile", "partitioner_cli.simulate", "partitioner_cli.train",
           "partitioner_cli.compare", "partitioner_cli.explain", "partitioner_cli.export",
           "solvers.analysis.compare", "solvers.analysis.explain", "partitioner.export",
           "partitioner.importers.sailor_runs", "matplotlib.pyplot",
           "partitioner.simulate", "partitioner.trace", "runtime.launch", "runtime.stage", "solvers", "yaml")


def _vm_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def campaign(n_files: int, seed: int, timeout_s: float, work: Path,
             progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    import importlib

    for name in PRELOAD:  # imported once here, so that every forked call starts warm
        importlib.import_module(name)
    corpus = build_corpus(work / "base")
    _stub_training()
    rng = random.Random(seed)
    mem = _vm_bytes() + 3 * 2**30
    roles: list[tuple[str, Base | None, Path, str]] = []
    for b in corpus.bases:
        roles += [("profile", b, b.profile, "json"), ("cluster", b, b.cluster, "yaml"), ("plan", b, b.plan, "json")]
    roles += [("graph", None, g, "graph") for g in corpus.graphs]
    roles += [("sailor", None, corpus.sailor, "json"), ("sailor-run", None, corpus.sailor_run, "json"),
              ("network", None, corpus.network, "json"), ("intra", None, corpus.intra, "json")]
    counts: Counter[str] = Counter()
    by_command: dict[str, Counter[str]] = {}
    examples: dict[str, list[str]] = {"traceback": [], "hang": [], "silent wrong": []}
    slowest = (0.0, "")
    files_dir = work / "files"
    files_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    for i in range(n_files):
        role, base, src, kind = roles[i % len(roles)]
        case = files_dir / f"{i:05d}"
        shutil.rmtree(case, ignore_errors=True)
        case.mkdir()
        if role == "sailor":
            target_dir = case / "sailor"
            shutil.copytree(src, target_dir)
            victim = rng.choice(sorted(target_dir.glob("*.json")))
            victim.write_bytes(mutate(victim.read_bytes(), "json", rng))
            mutated = target_dir
            label = f"sailor/{victim.name}"
        else:
            suffix = ".txt" if kind == "graph" else src.suffix
            mutated = case / f"in{suffix}"
            mutated.write_bytes(mutate(src.read_bytes(), kind, rng))
            label = f"{role}:{src.name}"
        out = case / "out.json"
        inputs = [p for p in (mutated.rglob("*") if mutated.is_dir() else [mutated]) if p.is_file()]
        before = {p: p.read_bytes() for p in inputs}
        for argv in command_lines(corpus, role, base, mutated, out, pick=i // len(roles)):
            command = " ".join(argv[:2]) if argv[0] in ("import", "profile") else argv[0]
            o = run_forked(argv, timeout_s, case, mem)
            counts["calls"] += 1
            per = by_command.setdefault(command, Counter())
            per["calls"] += 1
            verdict = ""
            bad = ""
            if o.hang:
                verdict = "hang"
            elif o.traceback:
                verdict = "traceback"
            elif any(not p.exists() or p.read_bytes() != data for p, data in before.items()):
                verdict, bad = "silent wrong", "an input was changed"
            elif o.rc == 0:
                bad = check_outputs_valid(output_paths(out))
                if not bad and _NON_FINITE_WORD.search(o.stdout):
                    bad = f"printed {_NON_FINITE_WORD.search(o.stdout).group(0)!r}"  # type: ignore[union-attr]
                if bad:
                    verdict = "silent wrong"
            per[f"rc{o.rc}" if o.rc is not None else "killed"] += 1
            if verdict:
                counts[verdict] += 1
                per[verdict] += 1
                if len(examples[verdict]) < 20:
                    tail = bad or (o.stderr.strip().splitlines() or [""])[-1][:300]
                    examples[verdict].append(f"{label} | {' '.join(argv[:2])} | rc {o.rc} | {tail}")
                    keep = work / "kept" / f"{i:05d}"
                    shutil.copytree(case, keep, dirs_exist_ok=True)
            if o.seconds > slowest[0]:
                slowest = (o.seconds, f"{label} | {' '.join(argv[:2])}")
            for p in output_paths(out):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            shutil.rmtree(out.with_suffix(""), ignore_errors=True)
        shutil.rmtree(case, ignore_errors=True)
        counts["files"] += 1
        if (i + 1) % 200 == 0:
            progress(f"{i + 1} files, {counts['calls']} calls, {counts['traceback']} tracebacks, {counts['hang']} "
                     f"hangs, {counts['silent wrong']} silent wrong, {time.perf_counter() - t_start:.0f} s")
    return {"counts": counts, "by_command": by_command, "examples": examples, "slowest": slowest,
            "seconds": time.perf_counter() - t_start}


def _report(result: dict[str, Any], args: argparse.Namespace) -> str:
    c = result["counts"]
    lines = [
        "# Fuzzing the command line with mutated input files",
        "",
        f"`python bench/fuzz.py --files {args.files} --seed {args.seed} --timeout {args.timeout:g}`: "
        f"{c['files']:,} mutated files, {c['calls']:,} calls in {result['seconds']:.0f} s "
        f"(slowest call {result['slowest'][0]:.2f} s: {result['slowest'][1]}).",
        "",
        f"**tracebacks {c['traceback']}, hangs {c['hang']}, silent wrong {c['silent wrong']}**",
        "",
        "| command | calls | exit 0 | exit 1 | exit 2 | tracebacks | hangs | silent wrong |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cmd, per in sorted(result["by_command"].items()):
        lines.append(f"| `{cmd}` | {per['calls']} | {per['rc0']} | {per['rc1']} | {per['rc2']} | {per['traceback']} "
                     f"| {per['hang']} | {per['silent wrong']} |")
    for kind, ex in result["examples"].items():
        if ex:
            lines += ["", f"{kind}:", "", *(f"* {e}" for e in ex)]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=3000,
                    help="mutated files (default 3000; 200 is a quick run of a few minutes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds per call before it counts as a hang")
    ap.add_argument("--out", default=None, help="write the Markdown report here")
    ap.add_argument("--keep", default=None, help="directory to keep the failing cases in (default: a temp dir)")
    args = ap.parse_args(argv)
    import logging

    logging.disable(logging.WARNING)  # the solvers' warnings on odd inputs are expected; the counts matter
    with tempfile.TemporaryDirectory(prefix="partitioner-fuzz-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        result = campaign(args.files, args.seed, args.timeout, work, lambda s: print(s, flush=True))
        text = _report(result, args)
    print(text)
    if args.out:
        from partitioner._io import atomic_write_text

        atomic_write_text(args.out, text)
    c = result["counts"]
    return 1 if c["traceback"] or c["hang"] or c["silent wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
