"""Convex stages of the real graph (CP-SAT, CBC) against the chain order (DP) on PipeDream's DAGs,
and (``--joint``) device mapping + split decided in one model on the HetPipe cluster.

    python bench/ilp.py [--time-limit 60] [--quick] [--write]
    python bench/ilp.py --joint [--quick] [--threads 2] [--png FILE] [--write]

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

Columns: the DP on the importer's topological order (chain, ``dag=False``), the down-set DP
written here (an independent check), the solver named dp as it plans a graph by default (its own
down-set DP, :mod:`solvers.pipeline.downsets`: objective and seconds), CP-SAT's and
CBC's graph models (objective, proven bound, status, seconds, including their second solve
for the least total stage time), and the graph plan's gain over the chain. Prints the table;
``--write`` puts it into docs/solvers.md between its markers.

``--joint``: the joint mapping models (:mod:`solvers.exact.cpsat.joint`, :mod:`solvers.exact.cbc.joint`) on
ResNet-152 (``examples/profiles/resnet152_hetpipe.json``: 52 layers, measured on a CPU and
projected to the four GPU types by the calibrated roofline) over the HetPipe cluster
(``examples/clusters/hetpipe.yaml``: 16 GPUs of 4 types on 4 nodes) and over that cluster doubled
(32 GPUs, 8 nodes), and PipeDream's ResNet-50 (177 layers in the importer's chain order, measured
on a V100 at batch 128, projected the same way) over both; 1F1B, as many micro-batches as GPUs.
Each solver runs with each time limit (10 s and 60 s; ``--quick``: 10 s) from scratch, the time
limit covering everything (the heuristic mapping that gives the hint, the relaxation, the model);
columns: the DP over the cluster's listed order, the relaxation's bound, the objective, the
proven bound, gap, status and seconds, and the machine's load average over the solve. Prints the
table; ``--png`` draws the gaps; ``--write`` puts the table into docs/solvers.md and the figure
into docs/img/ilp_joint.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._machine import machine_line  # noqa: E402
from bench._page import write_between  # noqa: E402
from bench._results import emit  # noqa: E402
from partitioner.cluster import GIB, Cluster, DeviceType, Node  # noqa: E402
from partitioner.cost import CostOptions  # noqa: E402
from partitioner.errors import PartitionerError  # noqa: E402
from partitioner.importers.pipedream import import_pipedream  # noqa: E402
from partitioner.profile import Profile  # noqa: E402
from solvers import SolveResult, solve  # noqa: E402
from solvers.pipeline.downsets import down_sets  # noqa: E402

__all__ = ["downset_optimum", "main"]

PROFILES = ROOT / "tests" / "data" / "pipedream"
DOC = ROOT / "docs" / "solvers.md"
MARKERS = ("<!-- ilp-table:start -->", "<!-- ilp-table:end -->")
JOINT_MARKERS = ("<!-- joint-table:start -->", "<!-- joint-table:end -->")
JOINT_FIGURE = ROOT / "docs" / "img" / "ilp_joint.png"
HETPIPE_TYPES = ("TITAN-V", "TITAN-RTX", "RTX-2060", "Quadro-P4000")
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
    ideals = down_sets(n, profile.graph_edges, limit)  # the down-sets only; the DP below is this bench's own
    if ideals is None:
        raise RuntimeError(f"more than {limit} down-sets")
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


def joint_instances() -> list[tuple[str, Profile, Cluster]]:
    """(name, profile, cluster) of the joint mapping benchmark."""
    from partitioner.projection.roofline import project_profile

    hetpipe = Cluster.load(ROOT / "examples" / "clusters" / "hetpipe.yaml")
    node = hetpipe.nodes[0]
    doubled = Cluster("hetpipe-8x4", tuple(Node(f"n{i}", node.gpus, node.intra_gbps) for i in range(8)),
                      hetpipe.inter_gbps, hetpipe.device_types)
    resnet152 = Profile.load(ROOT / "examples" / "profiles" / "resnet152_hetpipe.json")
    resnet50 = import_pipedream(PROFILES / "resnet50.txt", gpu_type="V100-SXM2-16GB")
    resnet50 = dataclasses.replace(project_profile(resnet50, HETPIPE_TYPES, source="V100-SXM2-16GB"), edges=())
    return [(f"{name} x {len(cl.devices)}", prof, cl) for name, prof in (("resnet152", resnet152),
                                                                           ("resnet50", resnet50))
            for cl in (hetpipe, doubled)]


def joint_main(args: argparse.Namespace) -> None:
    """The joint mapping table (and figure): see the module docstring."""
    limits = (10.0,) if args.quick else (10.0, 60.0)
    header = ["instance", "L", "GPUs", "listed order DP ms", "relaxation bound ms", "solver", "limit s", "ms",
              "bound ms", "gap", "status", "s", "load"]
    rows, table = [], []
    for name, prof, cluster in joint_instances():
        listed = solve(prof, cluster, "dp")
        for solver in ("cpsat", "milp"):
            for limit in limits:
                load0 = os.getloadavg()[0]
                try:
                    r = solve(prof, cluster, solver, time_limit_s=limit, threads=args.threads)
                except PartitionerError as err:  # the model is larger than max_arcs
                    print(f"{name}: {solver}: {err}", flush=True)
                    table.append([name, str(prof.num_layers), str(len(cluster.devices)), "", "",
                                  "CP-SAT" if solver == "cpsat" else "CBC", f"{limit:g}", "refused", "", "", "refused",
                                  "", ""])
                    rows.append({"instance": name, "layers": prof.num_layers, "gpus": len(cluster.devices),
                                 "solver": solver, "time_limit_s": limit, "status": "refused", "gap": float("nan"),
                                 "reason": str(err)})
                    continue
                load = (load0 + os.getloadavg()[0]) / 2
                relaxed = r.details.get("relaxed_bound_s", float("nan"))
                bound = r.details.get("bound_s", float("nan"))
                cells = [name, str(prof.num_layers), str(len(cluster.devices)),
                         f"{listed.objective * 1e3:.3f}" if listed.ok else str(listed.status.value),
                         f"{relaxed * 1e3:.3f}", "CP-SAT" if solver == "cpsat" else "CBC", f"{limit:g}",
                         f"{r.objective * 1e3:.3f}" if r.ok else r.status.value, f"{bound * 1e3:.3f}",
                         f"{100 * r.gap:.2f}%", r.status.value, f"{r.runtime_s:.1f}", f"{load:.1f}"]
                table.append(cells)
                rows.append({"instance": name, "layers": prof.num_layers, "gpus": len(cluster.devices),
                             "listed_s": listed.objective, "relaxed_bound_s": relaxed, "solver": solver,
                             "time_limit_s": limit, "objective_s": r.objective, "bound_s": bound, "gap": r.gap,
                             "status": r.status.value, "time_s": r.runtime_s, "load": load,
                             "hint_s": r.details.get("hint_s"), "arcs": r.details.get("arcs"),
                             "mapping": r.details.get("mapping")})
                print(" | ".join(cells), flush=True)
    lines = [f"Machine: {machine_line()}. CP-SAT and CBC with {args.threads} worker(s)/thread(s); each time limit "
             "covers the whole solve (hint, relaxation, model, second solve); `load` is the 1-minute load average "
             "during the solve (other work shared the machine). Objective: bottleneck stage time per micro-batch "
             "(ms), 1F1B, micro-batches = GPUs; `listed order DP` splits the cluster's own device order."]
    text = _report(lines, header, table, rows)
    png = JOINT_FIGURE if args.write else (Path(args.png) if args.png else None)
    if png is not None:
        _plot_joint(rows, png)
        print(f"wrote {png}")
    if args.write:
        write_between(DOC, *JOINT_MARKERS, text)
        print(f"wrote {DOC}")


def _plot_joint(rows: list[dict], path: Path) -> None:
    """The gap each solver reached at each time limit, per instance (grouped bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["instance"] for r in rows))
    series = list(dict.fromkeys((r["solver"], r["time_limit_s"]) for r in rows))
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / len(series)
    for k, (solver, limit) in enumerate(series):
        gaps = []
        for name in names:
            hit = [r for r in rows if r["instance"] == name and r["solver"] == solver and r["time_limit_s"] == limit]
            gap = hit[0]["gap"] if hit else float("nan")
            gaps.append(100 * gap if gap == gap else float("nan"))  # refused: no bar
        label = f"{'CP-SAT' if solver == 'cpsat' else 'CBC'} {limit:g} s"
        ax.bar([i + (k - (len(series) - 1) / 2) * width for i in range(len(names))], gaps, width, label=label)
    ax.set_xticks(range(len(names)), [f"{n}\n({rows[[r['instance'] for r in rows].index(n)]['layers']} layers)"
                                      for n in names], fontsize=8)
    ax.set_ylabel("gap to the proven bound (%)")
    ax.set_ylim(bottom=0)
    ax.set_title("joint device mapping + split: gap at the time limit (0: proven optimal)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=60.0, help="per CP-SAT / CBC solve, seconds (default 60)")
    ap.add_argument("--quick", action="store_true", help="the compute setting only (--joint: the 10 s limit only)")
    ap.add_argument("--write", action="store_true", help="write the table into docs/solvers.md")
    ap.add_argument("--joint", action="store_true", help="the joint device mapping + split table instead")
    ap.add_argument("--threads", type=int, default=2, help="--joint: CP-SAT workers and CBC threads (default 2)")
    ap.add_argument("--png", default=None, help="--joint: draw the gaps into this file")
    args = ap.parse_args(argv)
    if args.joint:
        joint_main(args)
        return

    header = ["model", "GPUs", "setting", "chain DP ms", "down-set DP ms", "dp (default) ms", "dp s", "CP-SAT ms",
              "CP-SAT bound ms",
              "CP-SAT status", "CP-SAT s", "CBC ms", "CBC bound ms", "CBC status", "CBC s", "graph vs chain"]
    rows, table = [], []
    settings = ("compute",) if args.quick else ("compute", "network")
    for name in MODELS:
        for gpus in (4, 16):
            for setting in settings:
                compute_only = setting == "compute"
                prof, cluster = load(name, compute_only), cluster_of(gpus, compute_only)
                kw: dict[str, Any] = {"schedule": "gpipe", "micro_batches": 1} if compute_only else {"schedule": "1f1b"}
                kw["options"] = CostOptions(reserved_bytes=0.0)
                chain = solve(prof, cluster, "dp", dag=False, **kw)
                default = solve(prof, cluster, "dp", **kw)  # the solver's own down-set DP over the graph
                t0 = time.perf_counter()
                exact = downset_optimum(prof, gpus) if compute_only else float("nan")
                exact_s = time.perf_counter() - t0
                cp = solve(prof, cluster, "cpsat", time_limit_s=args.time_limit, **kw)
                cb = solve(prof, cluster, "milp", time_limit_s=args.time_limit, **kw)
                best = min(r.objective for r in (cp, cb) if r.ok)
                gain = f"{100 * (best / chain.objective - 1):+.3f}%"
                cells = [name, str(gpus), setting, f"{chain.objective * 1e3:.3f}",
                         f"{exact * 1e3:.3f}" if compute_only else "-", f"{default.objective * 1e3:.3f}",
                         f"{default.runtime_s:.2f}", *_fmt(cp), *_fmt(cb), gain]
                table.append(cells)
                rows.append({"model": name, "gpus": gpus, "setting": setting, "chain_s": chain.objective,
                             "downset_s": exact if compute_only else None, "downset_time_s": exact_s,
                             "dp_graph_s": default.objective, "dp_graph_time_s": default.runtime_s,
                             "cpsat_s": cp.objective, "cpsat_bound_s": cp.lower_bound, "cpsat_status": cp.status.value,
                             "cpsat_time_s": cp.runtime_s, "cbc_s": cb.objective, "cbc_bound_s": cb.lower_bound,
                             "cbc_status": cb.status.value, "cbc_time_s": cb.runtime_s,
                             "cpsat_layer_order": cp.plan is not None and cp.plan.layer_order is not None})
                print(" | ".join(cells), flush=True)
    lines = [f"Machine: {machine_line()}. CP-SAT and CBC single-threaded, time limit {args.time_limit:g} s per "
             "solve (first solve and the least-total second solve together), the DP's split as hint. "
             "Objective: bottleneck stage time per micro-batch (ms)."]
    text = _report(lines, header, table, rows)
    if args.write:
        write_between(DOC, *MARKERS, text)
        print(f"wrote {DOC}")


def _report(intro: list[str], header: list[str], table: list[list[str]], rows: list[dict]) -> str:
    """The intro, a blank line and the table as Markdown: printed, its rows emitted, returned."""
    text = "\n".join([*intro, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                      *("| " + " | ".join(r) + " |" for r in table)])
    print()
    print(text)
    emit(rows, seeds={})
    return text

if __name__ == "__main__":
    main()
