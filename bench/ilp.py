"""Convex stages of the real graph (CP-SAT, CBC) against the chain order (DP) on PipeDream's DAGs.

    python bench/ilp.py [--time-limit 60] [--quick] [--write]

ResNet-50 and GNMT (PipeDream's profiles, one V100, micro-batch 128 and 64) over 4 and 16
identical V100s, in two settings:

* ``compute``: PipeDream's straight-pipeline setting: transfers free (every tensor's bytes set
  to 0), memory not binding, a stage's time its forward+backward. Here an independent exact
  answer exists: a DP over every down-set of the graph (the states of PipeDream's antichain
  DP, all of them), ``f_k(D) = min_{D' in D} max(f_{k-1}(D'), w(D) - w(D'))``, which the graph
  models must equal. PipeDream's own optimizer enumerates a subset of these states, so its
  figure is never below this one.
* ``network``: the same GPUs four to a node (25 GB/s inside a node, 1.25 GB/s between
  nodes), every tensor crossing a cut sent each way, 1F1B with as many micro-batches as GPUs.

Columns: the DP on the importer's topological order (chain), the down-set DP, CP-SAT's and
CBC's graph models (objective, proven bound, status, seconds, including their second solve
for the least total stage time), and the graph plan's gain over the chain. Prints the table;
``--write`` puts it into docs/solvers.md between its markers.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._machine import machine_line  # noqa: E402
from bench._page import write_between  # noqa: E402
from bench._results import emit  # noqa: E402
from partitioner.cluster import GIB, Cluster, DeviceType, Node  # noqa: E402
from partitioner.cost import CostOptions  # noqa: E402
from partitioner.importers.pipedream import import_pipedream  # noqa: E402
from partitioner.profile import Profile  # noqa: E402
from solvers import SolveResult, solve  # noqa: E402

__all__ = ["downset_optimum", "main"]

PROFILES = ROOT / "tests" / "data" / "pipedream"
DOC = ROOT / "docs" / "solvers.md"
MARKERS = ("<!-- ilp-table:start -->", "<!-- ilp-table:end -->")
MODELS = {"resnet50": None, "gnmt": 64}
V100 = DeviceType("V100", 1e6 * GIB, 15.7e12, 900e9)  # memory never binds here


def load(name: str, compute_only: bool) -> Profile:
    prof = import_pipedream(PROFILES / f"{name}.txt", gpu_type="V100", micro_batch_size=MODELS[name])
    if compute_only:
        prof = dataclasses.replace(prof, layers=tuple(dataclasses.replace(
            x, output_bytes=0.0, own_output_bytes=None if x.own_output_bytes is None else 0.0) for x in prof.layers))
    return prof


def cluster_of(gpus: int, compute_only: bool) -> Cluster:
    if compute_only:
        return Cluster("same", (Node("n0", ("V100",) * gpus, 25.0),), 1.25, {"V100": V100})
    nodes = tuple(Node(f"n{i}", ("V100",) * 4, 25.0) for i in range(gpus // 4))
    return Cluster(f"{gpus // 4}x4", nodes, 1.25, {"V100": V100})


def downset_optimum(profile: Profile, stages: int, limit: int = 100_000) -> float:
    """Least bottleneck of ``stages`` non-empty convex stages when a stage's time is its layers'
    forward+backward on V100 (transfers free), by a DP over every down-set of the graph."""
    n = profile.num_layers
    pred = [0] * n
    for a, b in profile.graph_edges:
        pred[b] |= 1 << a
    seen = {0}
    frontier = [0]
    while frontier:
        nxt = []
        for d in frontier:
            for v in range(n):
                if not d >> v & 1 and pred[v] & ~d == 0 and (e := d | 1 << v) not in seen:
                    seen.add(e)
                    nxt.append(e)
        frontier = nxt
        if len(seen) > limit:
            raise RuntimeError(f"more than {limit} down-sets")
    ideals = sorted(seen, key=lambda d: (d.bit_count(), d))
    fwd, bwd = profile.times_for("V100")
    w_layer = fwd + bwd
    words = (n + 63) // 64
    bits = np.zeros((len(ideals), words), dtype=np.uint64)
    for i, d in enumerate(ideals):
        for k in range(words):
            bits[i, k] = (d >> (64 * k)) & ((1 << 64) - 1)
    weight = np.array([sum(w_layer[v] for v in range(n) if d >> v & 1) for d in ideals])
    # inside[i, j]: ideal j is a proper subset of ideal i (so ideal i minus ideal j is a stage)
    inside = np.ones((len(ideals), len(ideals)), dtype=bool)
    for k in range(words):
        inside &= (bits[None, :, k] & ~bits[:, None, k]) == 0
    np.fill_diagonal(inside, False)
    f = np.where(np.array([d != 0 for d in ideals]), weight, np.inf)  # one stage
    for _ in range(stages - 1):
        cand = np.maximum(f[None, :], weight[:, None] - weight[None, :])
        cand[~inside] = np.inf
        f = cand.min(axis=1)
    return float(f[-1])  # the last ideal holds every layer


def _fmt(r: SolveResult) -> tuple[str, str, str, str]:
    obj = f"{r.objective * 1e3:.3f}" if r.ok else r.status.value
    return obj, f"{r.lower_bound * 1e3:.3f}", r.status.value, f"{r.runtime_s:.1f}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=60.0, help="per CP-SAT / CBC solve, seconds (default 60)")
    ap.add_argument("--quick", action="store_true", help="the compute setting only")
    ap.add_argument("--write", action="store_true", help="write the table into docs/solvers.md")
    args = ap.parse_args(argv)

    header = ["model", "GPUs", "setting", "chain DP ms", "down-set DP ms", "CP-SAT ms", "CP-SAT bound ms",
              "CP-SAT status", "CP-SAT s", "CBC ms", "CBC bound ms", "CBC status", "CBC s", "graph vs chain"]
    rows, table = [], []
    settings = ("compute",) if args.quick else ("compute", "network")
    for name in MODELS:
        for gpus in (4, 16):
            for setting in settings:
                compute_only = setting == "compute"
                prof, cluster = load(name, compute_only), cluster_of(gpus, compute_only)
                kw = {"schedule": "gpipe", "micro_batches": 1} if compute_only else {"schedule": "1f1b"}
                kw["options"] = CostOptions(reserved_bytes=0.0)
                chain = solve(prof, cluster, "dp", **kw)
                t0 = time.perf_counter()
                exact = downset_optimum(prof, gpus) if compute_only else float("nan")
                exact_s = time.perf_counter() - t0
                cp = solve(prof, cluster, "cpsat", time_limit_s=args.time_limit, **kw)
                cb = solve(prof, cluster, "milp", time_limit_s=args.time_limit, **kw)
                best = min(r.objective for r in (cp, cb) if r.ok)
                gain = f"{100 * (best / chain.objective - 1):+.3f}%"
                cells = [name, str(gpus), setting, f"{chain.objective * 1e3:.3f}",
                         f"{exact * 1e3:.3f}" if compute_only else "-", *_fmt(cp), *_fmt(cb), gain]
                table.append(cells)
                rows.append({"model": name, "gpus": gpus, "setting": setting, "chain_s": chain.objective,
                             "downset_s": exact if compute_only else None, "downset_time_s": exact_s,
                             "cpsat_s": cp.objective, "cpsat_bound_s": cp.lower_bound, "cpsat_status": cp.status.value,
                             "cpsat_time_s": cp.runtime_s, "cbc_s": cb.objective, "cbc_bound_s": cb.lower_bound,
                             "cbc_status": cb.status.value, "cbc_time_s": cb.runtime_s,
                             "cpsat_layer_order": cp.plan is not None and cp.plan.layer_order is not None})
                print(" | ".join(cells), flush=True)
    lines = [f"Machine: {machine_line()}. CP-SAT and CBC single-threaded, time limit {args.time_limit:g} s per "
             "solve (first solve and the least-total second solve together), the DP's split as hint. "
             "Objective: bottleneck stage time per micro-batch (ms).", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in table]
    text = "\n".join(lines)
    print()
    print(text)
    emit(rows, seeds={})
    if args.write:
        write_between(DOC, *MARKERS, text)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
