"""Do plans made from projected profiles rank with plans made from measured ones?

OPT-350M from Sailor's measured per-layer profiles (micro-batch 2, tensor parallel 1) on a mixed
cluster of 8 RTX-3090, 4 RTX-2080 Ti and 4 TITAN-RTX (bench/hetero.py's Sailor cluster, with
Sailor's "RTX-2080" named for what it is: an 11 GiB RTX 2080 Ti). For each case, some of the
cluster's types get times projected with the per-operator model instead of their measurements;
the cluster planner (``plan_cluster``, K auto, policy opt, 8 micro-batches, 1f1b) plans on that
profile, and the plan is simulated on the MEASURED profile. Ratio: that plan's simulated
samples/s over the samples/s of the plan made from the measured profile (simulated the same
way). 1.00: the projection cost nothing; the target is >= 0.95.

Cases:

* **held out**: one cluster type projected leave-one-type-out (constants fitted without it,
  anchored on the six other measured types, as bench/projection_error.py), the others measured;
* **one source, LOTO constants**: every cluster type other than the source projected from that
  one type's measurements (constants for each target fitted without it);
* **one source, its constants**: the same with constants fitted on the source alone;
* **control** (not counted): one type's measured times scaled by 0.5 or 2, to show that the
  ratio does move when a type's times are wrong enough.

The HetPipe cluster's VGG-19 profile (examples/profiles/vgg19_hetpipe.json) has no measured GPU
times at all (its four types are projected from a CPU measurement), so it has no reference to
rank against; the script says so instead of inventing one.

    python bench/projection_plans.py [--sailor DIR] [--micro-batches 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._machine import machine_line  # noqa: E402
from partitioner.cluster import Cluster, Node  # noqa: E402
from partitioner.importers.sailor import import_sailor  # noqa: E402
from partitioner.profile import LayerProfile, LayerTime, Profile  # noqa: E402
from partitioner.projection.evaluation import (  # noqa: E402
    SailorConfig,
    declared_choice,
    loto_fits,
    single_source_fits,
    structures,
)
from partitioner.projection.operator_model import Calibration, Measured, Rates, anchored_s  # noqa: E402
from partitioner.simulate import simulate_plan  # noqa: E402
from solvers.cluster.planner import plan_cluster  # noqa: E402

SHARED = ROOT.parent / "shared" / "data"
MICRO_BATCH = 2
TARGET = 0.95
# the cluster's types, by Sailor's names; the profile's key for Sailor's RTX-2080 is renamed to the Ti
CLUSTER = (("RTX-3090", 8), ("RTX-2080", 4), ("Titan-RTX", 4))
RENAME = {"RTX-2080": "RTX-2080-Ti"}


def cluster() -> Cluster:
    spec = [["RTX-3090"] * 4, ["RTX-3090"] * 4, ["RTX-2080-Ti"] * 4, ["TITAN-RTX"] * 4]
    return Cluster("sailor-mixed-2080ti", tuple(Node(f"n{i}", tuple(g), 12.0) for i, g in enumerate(spec)), 3.0)


def measured_profile(sailor: Path) -> tuple[Profile, dict[str, str]]:
    """Sailor's profile at micro-batch 2, tensor parallel 1, its RTX-2080 keyed RTX-2080-Ti; and
    Sailor's name -> the profile's key."""
    prof = import_sailor(sailor, micro_batch_size=MICRO_BATCH)
    names = {s: RENAME.get(s, g) for s, g in prof.meta["sailor_gpu_names"].items()}
    back = {g: s for s, g in prof.meta["sailor_gpu_names"].items()}
    layers = tuple(replace(x, times={names[back[g]]: t for g, t in x.times.items()}) for x in prof.layers)
    return replace(prof, layers=layers), names


def projected_times(configs: Sequence[SailorConfig], cal: Calibration, target: str,
                    sources: Sequence[str]) -> list[tuple[float, float]]:
    """Every layer's (forward, backward) seconds on ``target`` (Sailor's name) at micro-batch 2,
    tensor parallel 1, anchored on ``sources``' measurements of the same configuration."""
    table = {c.sailor_name: c for c in configs if (c.micro_batch_size, c.tensor_parallel) == (MICRO_BATCH, 1)}
    tgt = table[target]
    srcs = [table[s] for s in sources if s in table and s != target]
    r_t = Rates.of(tgt.device, cal.math)
    rates = {s.sailor_name: Rates.of(s.device, cal.math) for s in srcs}
    out = []
    for i, layer in enumerate(tgt.ops.layers):
        fb = [anchored_s(layer, ph, [Measured((s.fwd_s if ph == "fwd" else s.bwd_s)[i], rates[s.sailor_name])
                                     for s in srcs], r_t, None, cal) for ph in ("fwd", "bwd")]
        out.append((fb[0], fb[1]))
    return out


def with_times(prof: Profile, key: str, times: Sequence[tuple[float, float]], source: str) -> Profile:
    """``prof`` with ``key``'s times replaced by projected ones (update step kept)."""
    layers = []
    for x, (f, b) in zip(prof.layers, times, strict=True):
        old = x.times[key]
        new = dict(x.times)
        new[key] = LayerTime(f, b, projected=True, measured_on=source, update_s=old.update_s)
        layers.append(LayerProfile(x.name, x.flops, x.param_bytes, x.saved_bytes, x.output_bytes, new,
                                   x.shared_saved_bytes, {}, x.own_output_bytes))
    return replace(prof, layers=tuple(layers))


@dataclass
class Outcome:
    samples_per_s: float  # the plan simulated on measured times
    believed: float  # the same plan simulated on the profile it was made from
    shape: str
    cuts: tuple[tuple[tuple[int, int], str], ...] = ()  # every stage's layers and device


def plan_on(prof: Profile, measured: Profile, cl: Cluster, m: int) -> Outcome:
    res = plan_cluster(prof, cl, "auto", "opt", micro_batches=m)
    if not res.ok or res.plan is None:
        return Outcome(0.0, 0.0, f"no plan ({res.reason})")
    plan = res.plan
    real = simulate_plan(plan, measured, cl).samples_per_s
    believed = simulate_plan(plan, prof, cl).samples_per_s
    shape = " / ".join(f"{'+'.join(str(len(s.devices)) if len(s.devices) > 1 else s.devices[0].split(':')[0] for s in vw.stages)}"
                       for vw in plan.virtual_workers)
    cuts = tuple((st.layers, st.device) for vw in plan.virtual_workers for st in vw.stages)
    return Outcome(real, believed, shape, cuts)


def whole_error(prof: Profile, measured: Profile, keys: Sequence[str]) -> str:
    """Per projected type, the error of its whole-model forward + backward time."""
    out = []
    for k in keys:
        p = sum(x.times[k].total_s for x in prof.layers)
        r = sum(x.times[k].total_s for x in measured.layers)
        out.append(f"{k} {100 * (p / r - 1):+.1f}")
    return ", ".join(out)


def hetpipe_note() -> str:
    prof = Profile.load(ROOT / "examples" / "profiles" / "vgg19_hetpipe.json")
    proj = prof.meta.get("projections", {})
    measured = sorted({g for x in prof.layers for g, t in x.times.items() if not t.projected})
    return (f"HetPipe cluster (examples/clusters/hetpipe.yaml), VGG-19 (examples/profiles/vgg19_hetpipe.json): "
            f"its GPU types ({', '.join(sorted(proj))}) are all projected "
            f"({', '.join(sorted({str(v.get('method')) + ' from ' + str(v.get('from')) for v in proj.values()}))}); "
            f"measured only on: {', '.join(measured) or 'nothing'}. No measured GPU reference exists, so no ratio "
            "is given for it.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sailor", default=str(SHARED / "sailor_opt350"))
    ap.add_argument("--micro-batches", type=int, default=8)
    args = ap.parse_args()
    t0 = time.perf_counter()
    sailor = Path(args.sailor)
    if not sailor.is_dir():
        sailor = ROOT / "tests" / "data" / "sailor_opt350"
    measured, names = measured_profile(sailor)
    cl = cluster()
    m = args.micro_batches
    structs = structures(sailor)
    fits = loto_fits(structs)  # keyed by catalog type
    math_mode, key = declared_choice(fits)
    singles = single_source_fits({key: structs[key]}, maths=(math_mode,))
    configs0 = next(iter(structs.values()))
    cat = {c.sailor_name: c.gpu_type for c in configs0}  # Sailor's name -> catalog type of the projection
    all_sailor = sorted(cat)
    in_cluster = [s for s, _ in CLUSTER]

    ref = plan_on(measured, measured, cl, m)
    print(f"machine: {machine_line()}")
    print(f"OPT-350M (Sailor, micro-batch {MICRO_BATCH}, TP 1) on {cl.name}: "
          + ", ".join(f"{n} x {names[s]}" for s, n in CLUSTER)
          + f"; plan_cluster K auto, opt, {m} micro-batches, 1f1b, objective sync")
    print(f"plan from measured times: {ref.samples_per_s:.2f} samples/s simulated (stages: {ref.shape})\n")
    print("| case | projected types | constants | types' whole-model fwd+bwd error % | "
          "plan believes samples/s | on measured samples/s | ratio | within 5 % | same plan | "
          "stages per virtual worker |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ratios: list[float] = []

    def row(case: str, prof: Profile, proj_keys: Sequence[str], consts: str) -> None:
        o = plan_on(prof, measured, cl, m)
        r = o.samples_per_s / ref.samples_per_s
        ratios.append(r)
        print(f"| {case} | {', '.join(proj_keys)} | {consts} | {whole_error(prof, measured, proj_keys)} | "
              f"{o.believed:.2f} | {o.samples_per_s:.2f} | {r:.3f} | {'yes' if r >= TARGET else 'NO'} | "
              f"{'yes' if o.cuts == ref.cuts else 'no'} | {o.shape} |",
              flush=True)

    for s in in_cluster:
        cal, k = fits[cat[s]]
        t = projected_times(structs[k], cal, s, [x for x in all_sailor if x != s])
        row(f"held out: {names[s]}", with_times(measured, names[s], t, "others"), [names[s]],
            f"LOTO ({cal.math}, {k})")
    for src in all_sailor:
        for label, by_target in (("LOTO", True), ("source alone", False)):
            prof = measured
            keys = []
            for s in in_cluster:
                if s == src:
                    continue
                cal, k = fits[cat[s]] if by_target else singles[cat[src]]
                prof = with_times(prof, names[s], projected_times(structs[k], cal, s, [src]), src)
                keys.append(names[s])
            row(f"one source: {names[src]}", prof, keys, label)
    n_ok = sum(r >= TARGET for r in ratios)
    # controls (not projections, not counted): one type's measured times scaled, to show the ratio can move
    for s, f in (("RTX-2080", 0.5), ("RTX-2080", 2.0), ("Titan-RTX", 2.0)):
        k = names[s]
        scaled = [(x.times[k].fwd_s * f, x.times[k].bwd_s * f) for x in measured.layers]
        row(f"control: {k} measured x {f:g}", with_times(measured, k, scaled, "scaled"), [k], "none")
    ratios = ratios[:-3]
    print(f"\n{n_ok} of {len(ratios)} cases within 5 % of the measured plan (worst ratio {min(ratios):.3f}, "
          f"best {max(ratios):.3f}).")
    print("\n" + hetpipe_note())
    print(f"\n({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
