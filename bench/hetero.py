"""Heterogeneity-aware planning against baselines, and planning time.

    python bench/hetero.py [--quick]

Profile sources are looked up by name in ``PROFILES`` so a better one (the model zoo with
projection) can replace the stand-ins here. Stand-ins: ``vgg16-projected`` is PipeDream's
VGG-16 profile (V100, shared/data/pipedream) with other GPU types' times scaled by the ratio
of peak FP32 FLOP/s from the catalog (a crude projection, local to this benchmark);
``opt350`` is Sailor's OPT-350M measurements (micro-batch 4, no tensor parallelism).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from partitioner.cluster import Cluster, Node, resolve_gpu_type  # noqa: E402
from partitioner.profile import LayerProfile, LayerTime, Profile  # noqa: E402
from solvers import solve  # noqa: E402
from solvers.hetero import plan_cluster  # noqa: E402
from tests._hetero_fixtures import synthetic_profile  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
HETPIPE_TYPES = ["TITAN-V", "TITAN-RTX", "RTX-2060", "Quadro-P4000"]


def vgg16_projected() -> Profile:
    from partitioner.importers.pipedream import import_pipedream

    src = DATA / "pipedream" / "vgg16.txt"
    if not src.exists():
        src = ROOT / "examples" / "profiles" / "vgg16_pipedream_graph.txt"
    base = import_pipedream(src, gpu_type="V100")
    ref = resolve_gpu_type("V100").peak_flops
    key = base.gpu_types[0]
    prof = base
    for t in HETPIPE_TYPES:
        f = ref / resolve_gpu_type(t).peak_flops
        prof = prof.with_times(t, [LayerTime(layer.times[key].fwd_s * f, layer.times[key].bwd_s * f, True)
                                   for layer in base.layers])
    return prof


def opt350(mbs: int = 4) -> Profile:
    d = DATA / "sailor_opt350"
    info = json.loads((d / "llm_info_OPT-350_only.json").read_text())["OPT-350"]["1"]
    names = {"RTX-3090": "RTX-3090", "RTX-2080": "RTX-2080", "Titan-RTX": "TITAN-RTX"}
    times = {names[g]: json.loads((d / f"{g}.json").read_text())[str(mbs)]["1"] for g in names}
    layers = []
    for i in range(len(info)):
        li = info[str(i)]
        lt = {t: LayerTime(v[str(i)][0], v[str(i)][1] + v[str(i)][2]) for t, v in times.items()}
        layers.append(LayerProfile(f"layer{i}", 0.0, li["params_bytes"], li["act_mem_bytes"] * mbs,
                                   li["act_output_bytes"] * mbs, lt))
    return Profile("opt-350m", mbs, tuple(layers), source="sailor")


PROFILES = {"vgg16-projected": vgg16_projected, "opt350": opt350}


def hetpipe(mixed: bool) -> Cluster:
    spec = [list(HETPIPE_TYPES)] * 4 if mixed else [[t] * 4 for t in HETPIPE_TYPES]
    return Cluster("hetpipe-mixed" if mixed else "hetpipe-by-type",
                   tuple(Node(f"n{i}", tuple(g), 16.0) for i, g in enumerate(spec)), 7.0)


def sailor_cluster() -> Cluster:
    spec = [["RTX-3090"] * 4, ["RTX-3090"] * 4, ["RTX-2080"] * 4, ["TITAN-RTX"] * 4]
    return Cluster("sailor-mixed", tuple(Node(f"n{i}", tuple(g), 12.0) for i, g in enumerate(spec)), 3.0)


def compare(profile: Profile, cluster: Cluster, m: int = 8) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    nodes = len(cluster.nodes)
    for pol in ("opt", "np", "ed", "hd"):
        try:
            r = plan_cluster(profile, cluster, "auto", pol, micro_batches=m)
            out[pol] = r.plan.predicted["samples_per_s"] if r.ok else None
        except Exception as err:  # a policy that cannot apply to this cluster
            out[pol] = None
            print(f"  {pol}: {err}")
    for name in ("uniform", "parameters", "blockpartition", "pipedream"):
        best = None
        for k, pol in ((1, None), (nodes, "np")):
            r = solve(profile, cluster, name, virtual_workers=k, policy=pol, micro_batches=m)
            if r.ok:
                r.plan.validate(profile, cluster)
                v = r.plan.predicted["samples_per_s"]
                best = v if best is None else max(best, v)
        out[name] = best
    rep = plan_cluster(profile, cluster, "auto", "opt", micro_batches=m, replication=True)
    out["opt+replication"] = rep.plan.predicted["samples_per_s"] if rep.ok else None
    return out


def timing(profile: Profile, cluster: Cluster, runs: int) -> float:
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        r = plan_cluster(profile, cluster, "auto", "opt", micro_batches=8)
        ts.append(time.perf_counter() - t0)
        assert r.ok, r.reason
        r.plan.validate(profile, cluster)
    return statistics.median(ts)


def big_cluster() -> Cluster:
    types = ["TITAN-V", "TITAN-RTX", "RTX-2060", "Quadro-P4000", "V100-SXM2-16GB", "RTX-3090"]
    nodes = [Node(f"n{i}", (types[i % 6],) * 8, 16.0) for i in range(32)]
    return Cluster("256-gpu-6-types", tuple(nodes), 12.5)


def main() -> None:
    quick = "--quick" in sys.argv
    cases = [("vgg16-projected", hetpipe(True)), ("vgg16-projected", hetpipe(False)), ("opt350", sailor_cluster())]
    print("| model | cluster | " + " | ".join(["opt", "np", "ed", "hd", "uniform", "parameters",
                                             "blockpartition", "pipedream", "opt+replication"]) + " |")
    print("|" + "---|" * 11)
    for prof_name, cl in cases:
        prof = PROFILES[prof_name]()
        res = compare(prof, cl)
        opt = res["opt"]
        cells = []
        for k, v in res.items():
            if v is None:
                cells.append("n/a")
            elif k == "opt" or opt is None:
                cells.append(f"{v:.1f}")
            else:
                cells.append(f"{v:.1f} ({opt / v:.2f}x)")
            if k not in ("opt", "opt+replication") and v is not None and opt is not None:
                assert opt >= v * (1 - 1e-9), (prof_name, cl.name, k, opt, v)
        print(f"| {prof_name} | {cl.name} | " + " | ".join(cells) + " |")
    runs = 1 if quick else 3
    syn = synthetic_profile(150, seed=0, param_mb=8, act_mb=10)
    print(f"\nplanning time, 150 layers, HetPipe 16 GPUs (median of {runs}): {timing(syn, hetpipe(True), runs):.2f} s")
    print(f"planning time, 150 layers, 256 GPUs of 6 types (median of {runs}): "
          f"{timing(syn, big_cluster(), runs):.2f} s")


if __name__ == "__main__":
    main()
