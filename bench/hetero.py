"""Heterogeneity-aware planning (``opt``) against HetPipe's policies and the layer-split baselines.

    python bench/hetero.py [--quick] [--runs 3]

Cases: VGG-19 and ResNet-152 from the model zoo (measured on the CPU at micro-batch 32 and
projected to the HetPipe GPU types: examples/profiles/*_hetpipe.json) on the HetPipe cluster
(examples/clusters/hetpipe.yaml), and Sailor's OPT-350M measurements (micro-batch 2) on a mixed
RTX-3090 / RTX-2080 / TITAN-RTX cluster (Sailor's names: its "RTX-2080" is the 11 GiB RTX 2080 Ti, and
the cluster names each type as the importer does, ``sailor_gpu_name``). Every plan is checked with
``Plan.validate``.

Two figures per plan, in samples/s: the solvers' model objective (closed form: K x the slowest
virtual worker, ``sync`` with the gradient all-reduce and step, ``wsp`` without) and the discrete-event
simulator's prediction. ``opt`` must be at least as good as every baseline on the model
objective, and the bench asserts it. Then planning times for a 150-layer model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._machine import machine_line  # noqa: E402
from partitioner.cluster import Cluster, Node  # noqa: E402
from partitioner.cost import CostModel  # noqa: E402
from partitioner.importers.sailor import import_sailor, sailor_gpu_name  # noqa: E402
from partitioner.profile import Profile  # noqa: E402
from solvers import solve  # noqa: E402
from solvers.cluster.planner import plan_cluster  # noqa: E402
from tests._hetero_fixtures import synthetic_profile  # noqa: E402

SAILOR = ROOT.parent / "shared" / "data" / "sailor_opt350"
if not SAILOR.exists():
    SAILOR = ROOT / "tests" / "data" / "sailor_opt350"
POLICIES = ("opt", "np", "ed", "hd")
BASELINES = ("uniform", "parameters", "blockpartition", "pipedream")


def sailor_cluster() -> Cluster:
    """8 RTX-3090, 4 RTX-2080 and 4 Titan-RTX by Sailor's names, typed as the importer types the
    profile's times (so every node's type has times in ``import_sailor``'s profile)."""
    spec = [[sailor_gpu_name(g)] * 4 for g in ("RTX-3090", "RTX-3090", "RTX-2080", "Titan-RTX")]
    return Cluster("sailor-mixed", tuple(Node(f"n{i}", tuple(g), 12.0) for i, g in enumerate(spec)), 3.0)


def cases() -> list[tuple[str, Profile, Cluster]]:
    hetpipe = Cluster.load(ROOT / "examples" / "clusters" / "hetpipe.yaml")
    out = [(name, Profile.load(ROOT / "examples" / "profiles" / f"{name}_hetpipe.json"), hetpipe)
           for name in ("vgg19", "resnet152")]
    out.append(("opt-350m", import_sailor(SAILOR, micro_batch_size=2), sailor_cluster()))
    return out


def figures(result, profile: Profile, cluster: Cluster) -> tuple[float, float] | None:
    """(model objective, simulated) samples/s of a result's plan, or None if it has none."""
    if not result.ok:
        return None
    CostModel(profile, cluster).validate_plan(result.plan)
    return result.plan.meta["closed_form"]["samples_per_s"], result.plan.predicted["samples_per_s"]


def compare(profile: Profile, cluster: Cluster, objective: str, m: int) -> dict[str, tuple[float, float] | None]:
    out: dict[str, tuple[float, float] | None] = {}
    for pol in POLICIES:
        try:
            out[pol] = figures(plan_cluster(profile, cluster, "auto", pol, objective=objective, micro_batches=m),
                               profile, cluster)
        except ValueError as err:  # a policy that cannot apply to this cluster, e.g. hd
            out[pol] = None
            print(f"  ({pol} does not apply: {err})")
    for name in BASELINES:
        best = None
        for k, pol in ((1, None), (len(cluster.nodes), "np")):
            f = figures(solve(profile, cluster, name, virtual_workers=k, policy=pol, micro_batches=m,
                              objective=objective), profile, cluster)
            if f is not None and (best is None or f[0] > best[0]):
                best = f
        out[name] = best
    return out


def timing(profile: Profile, cluster: Cluster, runs: int) -> float:
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        r = plan_cluster(profile, cluster, "auto", "opt", micro_batches=8)
        ts.append(time.perf_counter() - t0)
        assert r.ok, r.reason
        CostModel(profile, cluster).validate_plan(r.plan)
    return statistics.median(ts)


def big_cluster() -> Cluster:
    types = ["TITAN-V", "TITAN-RTX", "RTX-2060", "Quadro-P4000", "V100-SXM2-16GB", "RTX-3090"]
    return Cluster("256-gpu-6-types", tuple(Node(f"n{i}", (types[i % 6],) * 8, 16.0) for i in range(32)), 12.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip the 256-GPU timing")
    ap.add_argument("--runs", type=int, default=3, help="timing runs (median)")
    ap.add_argument("--micro-batches", type=int, default=8)
    args = ap.parse_args()
    print(f"machine: {machine_line()}")
    print(f"samples/s per plan as 'model objective / simulated'; (x) = opt's model objective over the "
          f"baseline's; n/a = no plan fits in memory; {args.micro_batches} micro-batches, 1f1b\n")
    names = POLICIES + BASELINES
    print("| model | cluster | objective | " + " | ".join(names) + " |")
    print("|" + "---|" * (3 + len(names)))
    for model, profile, cluster in cases():
        for objective in ("wsp", "sync"):
            res = compare(profile, cluster, objective, args.micro_batches)
            opt = res["opt"]
            cells = []
            for name in names:
                f = res[name]
                if f is None:
                    cells.append("n/a")
                    continue
                cell = f"{f[0]:.1f} / {f[1]:.1f}"
                if name != "opt" and opt is not None:
                    assert opt[0] >= f[0] * (1 - 1e-9), (model, objective, name, opt, f)
                    cell += f" ({opt[0] / f[0]:.2f}x)"
                cells.append(cell)
            print(f"| {model} | {cluster.name} | {objective} | " + " | ".join(cells) + " |", flush=True)
    print("\nreplication (a stage data-parallel over a run of GPUs, of one type or several, all-reduce priced on "
          "its links) against pure pipelines; sync, samples/s as 'model objective / simulated', the ratio of the "
          "model objectives\n")
    print("| model | cluster | virtual workers | opt, pure pipelines | opt + replication | ratio | replicated stages "
          "(of several types) |")
    print("|---|---|---|---|---|---|---|")
    by_type = Cluster("hetpipe-by-type", tuple(Node(f"n{i}", (t,) * 4, 16.0) for i, t in
                                               enumerate(("TITAN-V", "TITAN-RTX", "RTX-2060", "Quadro-P4000"))), 7.0)
    for model, profile, cluster in cases():
        for cl in ((cluster, by_type) if cluster.name == "hetpipe-4x4" else (cluster,)):
            for k in (1, "auto"):
                pure = plan_cluster(profile, cl, k, "opt", micro_batches=args.micro_batches)
                rep = plan_cluster(profile, cl, k, "opt", micro_batches=args.micro_batches, replication=True)
                fp, fr = figures(pure, profile, cl), figures(rep, profile, cl)
                if fp is None or fr is None or rep.plan is None:
                    print(f"| {model} | {cl.name} | {k} | {fp and f'{fp[0]:.1f}'} | {fr and f'{fr[0]:.1f}'} | n/a | n/a |")
                    continue
                replicated = [st for vw in rep.plan.virtual_workers for st in vw.stages if st.replicas]
                mixed = sum(len({cl.device(d).gpu_type for d in st.devices}) > 1 for st in replicated)
                workers = f"{k} ({len(rep.plan.virtual_workers)})" if k == "auto" else str(k)
                print(f"| {model} | {cl.name} | {workers} | {fp[0]:.1f} / {fp[1]:.1f} | {fr[0]:.1f} / {fr[1]:.1f} | "
                      f"{fr[0] / fp[0]:.2f}x | {len(replicated)} ({mixed}) |", flush=True)
    syn = synthetic_profile(150, seed=0, param_mb=8, act_mb=10)
    hetpipe = Cluster.load(ROOT / "examples" / "clusters" / "hetpipe.yaml")
    print(f"\nplanning time, 150 layers, HetPipe 16 GPUs (opt, K auto; median of {args.runs}): "
          f"{timing(syn, hetpipe, args.runs):.2f} s")
    if not args.quick:
        print(f"planning time, 150 layers, 256 GPUs of 6 types (opt, K auto; median of {args.runs}): "
              f"{timing(syn, big_cluster(), args.runs):.2f} s")


if __name__ == "__main__":
    main()
