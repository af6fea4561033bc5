"""Zero-bubble schedules against 1F1B and interleaved: bubble and iteration time, closed forms and simulated,
with each iteration flushed and with iterations overlapping (``--overlap-iterations``).

    python bench/schedules.py [--quick]

1. Equal stages (closed forms): ``p`` devices, one stage each (two half stages for interleaved and
   ZB-V), forward ``F``, input gradient ``B`` and weight gradient ``W`` per device, no transfers. For
   each schedule: Qi et al.'s bubble formula (per device and iteration: Table 2 of the paper; ZB-V
   zero at ``F = B = W``, section 6), then flushed -- this project's closed form
   (:meth:`partitioner.schedule.Schedule.uniform_bubble_s`, which adds the forward fill a flushing
   iteration cannot hide) and the simulated idle time per device -- and overlapped (each device
   starts its next iteration right after its own step, the paper's post-validation) -- the closed
   form (:meth:`~partitioner.schedule.Schedule.overlapped_bubble_s`), the simulated idle time per
   period, the period and what the first iteration costs more (its fill) -- and the peak activations
   in ``M_B``. Every simulated idle time must equal its closed form, the overlapped ZB-H1 and ZB-H2
   the paper's formula where ``W <= F`` and ZB-V zero at ``F = B = W``, and ZB-H1's peak 1F1B's
   (exit status 1 otherwise).
2. Real profiles (simulated): the HetPipe VGG-19 and ResNet-152 profiles on one HetPipe node (a
   TITAN V, a TITAN RTX, an RTX 2060 and a Quadro P4000) and PipeDream's profiles on 4 V100s, each
   planned by the DP for every schedule at the same micro-batch count (ZB-V by the multi-chunk DP
   on its V), then simulated flushed and overlapped (the same plan: the DP's split minimises the
   bottleneck either way): bubble, iteration time (the period when overlapped), samples/s, peak
   memory and whether it fits. Their backward split is estimated (the profiles have no measured
   ``bwd_weight_share``: W = B for layers with parameters).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._machine import machine_line  # noqa: E402
from partitioner.cluster import GIB, Cluster  # noqa: E402
from partitioner.cost import CostOptions  # noqa: E402
from partitioner.importers.pipedream import import_pipedream  # noqa: E402
from partitioner.plan import Plan, Stage, VirtualWorker  # noqa: E402
from partitioner.profile import LayerProfile, LayerTime, Profile  # noqa: E402
from partitioner.schedule import Schedule, stage_rank  # noqa: E402
from partitioner.simulate import simulate_plan  # noqa: E402
from solvers.pipeline.router import solve  # noqa: E402

SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zb-h2", "zbv")
GPU = "V100-SXM2-16GB"
PIPEDREAM = ROOT.parent / "shared" / "data" / "pipedream"
if not PIPEDREAM.exists():
    PIPEDREAM = ROOT / "tests" / "data" / "pipedream"


def paper_bubble(schedule: str, p: int, f: float, b: float, w: float) -> str:
    """Qi et al.'s bubble per device (Table 2; ZB-V section 6: zero at F = B = W)."""
    forms = {"1f1b": (p - 1) * (f + b + w), "interleaved": (p - 1) * (f + b + w) / 2,
             "zb-h1": (p - 1) * (f + b - w), "zb-h2": (p - 1) * (f + b - 2 * w)}
    if schedule == "zbv":
        return "0" if f == b == w else "-"
    return f"{forms[schedule]:g}"


def uniform_case(schedule: str, p: int, m: int, f: float, b: float, w: float, overlap: bool = False
                 ) -> tuple[float, float, float, float, float]:
    """Simulated (idle per device, bubble fraction, iteration (the period when ``overlap``), peak
    activations in M_B, the first iteration's end)."""
    v = 2 if schedule in ("interleaved", "zbv") else 1
    cluster = Cluster.homogeneous(GPU, 1, p, 16, 7)
    devs = [d.name for d in cluster.devices]
    placement = "v" if schedule == "zbv" else "loop"
    stages = tuple(Stage((s, s + 1), devs[stage_rank(s, p, placement)]) for s in range(p * v))
    plan = Plan("toy", (VirtualWorker(stages),), schedule, 1, m, chunks=v)
    layers = tuple(LayerProfile(f"l{i}", param_bytes=4.0, saved_bytes=GIB / v,
                                times={GPU: LayerTime(f / v, (b + w) / v, bwd_weight_share=w / (b + w))})
                   for i in range(p * v))
    opts = CostOptions(reserved_bytes=0.0, sync=False, optimizer_state_factor=0.0, overlap_iterations=overlap)
    tl = simulate_plan(plan, Profile("toy", 1, layers), cluster, opts)
    idle = max(tl.bubble_fraction.values()) * tl.iteration_s
    peak = max(tl.peak_memory_bytes.values()) / GIB
    return idle, max(tl.bubble_fraction.values()), tl.iteration_s, peak, tl.first_iteration_s or tl.iteration_s


def _close(a: float, b: float | None, scale: float) -> bool:
    return b is None or abs(a - b) <= 1e-9 * max(1.0, scale)


def part_uniform(quick: bool) -> bool:
    ok = True
    print("\n1. equal stages, closed forms (times per device and micro-batch; idle per device and iteration or period)")
    print(f"{'':27s} {'':>7} {'flushed':^27} {'overlapping iterations':^37}")
    print(f"{'p':>2} {'m':>3} {'F,B,W':>11} {'schedule':11s} {'paper':>7} {'closed':>7} {'simulated':>9} "
          f"{'iteration':>9} {'closed':>7} {'simulated':>9} {'period':>7} {'1st more':>8} {'bubble':>7} {'peak M_B':>8}")
    shapes = [(4, 8), (8, 16)] if not quick else [(4, 8)]
    for p, m in shapes:
        for f, b, w in ((1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (2.0, 1.0, 1.0)):
            peaks = {}
            for sched in SCHEDULES:
                v = 2 if sched in ("interleaved", "zbv") else 1
                closed = Schedule.of(sched, m).uniform_bubble_s(p, f, b, w, v)
                closed_o = Schedule.of(sched, m, overlap=True).uniform_bubble_s(p, f, b, w, v)
                idle, _, it, peak, _ = uniform_case(sched, p, m, f, b, w)
                idle_o, frac_o, period, _, first = uniform_case(sched, p, m, f, b, w, overlap=True)
                peaks[sched] = peak
                paper = paper_bubble(sched, p, f, b, w)
                good = _close(idle, closed, it) and _close(idle_o, closed_o, it)
                if (sched in ("zb-h1", "zb-h2") and w <= f) or (sched == "zbv" and paper != "-"):
                    good &= _close(idle_o, float(paper), it)  # overlapped: the paper's bubble
                ok &= good
                shown = "-" if closed is None else f"{closed:g}"
                shown_o = "-" if closed_o is None else f"{closed_o:g}"
                print(f"{p:2d} {m:3d} {f:g},{b:g},{w:g}".ljust(19) + f" {sched:11s} {paper:>7s} {shown:>7s} "
                      f"{idle:9.4g} {it:9.4g} {shown_o:>7s} {idle_o:9.4g} {period:7.4g} {first - period:8.4g} "
                      f"{frac_o:7.1%} {peak:8.3g}" + ("" if good else "  MISMATCH"))
            same = abs(peaks["zb-h1"] - peaks["1f1b"]) < 1e-9
            ok &= same
            print(f"   ZB-H1 peak activations {peaks['zb-h1']:g} M_B, 1F1B {peaks['1f1b']:g} M_B: "
                  f"{'equal' if same else 'DIFFERENT'}")
    return ok


def plans(profile: Profile, cluster: Cluster, devices: list[str], m: int, opts: CostOptions) -> None:
    for sched in SCHEDULES:
        try:
            res = solve(profile, cluster, devices, schedule=sched, micro_batches=m, options=opts,
                        chunks=2 if sched == "interleaved" else None, dag=False)  # every schedule on the chain
        except Exception as err:  # a schedule rule (interleaved's multiple of p): say it and go on
            print(f"   {sched:11s} refused: {err}")
            continue
        if not res.ok or res.plan is None:
            print(f"   {sched:11s} infeasible: {res.reason[:110]}")
            continue
        row = [f"   {sched:11s} {res.plan.num_stages:6d}"]
        for overlap in (False, True):
            o = replace(opts, overlap_iterations=overlap)
            tl = simulate_plan(replace(res.plan, pricing=o), profile, cluster, o)
            bubble = sum(tl.bubble_fraction.values()) / len(tl.bubble_fraction)
            row.append(f"{bubble:7.1%} {tl.iteration_s:10.4g} s {tl.samples_per_s:10.4g}")
        fits = all(tl.peak_memory_bytes[d] <= cluster.device(d).memory_bytes for d in tl.devices)
        peak = max(tl.peak_memory_bytes.values()) / GIB
        print(" ".join(row) + f" {peak:9.2f} GiB {'yes' if fits else 'no':>4s}")


def _header() -> None:
    print(f"   {'':18s} {'flushed':^31s} {'overlapping iterations':^31s}")
    print(f"   {'schedule':11s} {'stages':>6s} {'bubble':>7s} {'iteration':>12s} {'samples/s':>10s} {'bubble':>7s} "
          f"{'period':>12s} {'samples/s':>10s} {'peak':>13s} {'fits':>4s}")


def part_profiles(quick: bool) -> None:
    print("\n2. real profiles, simulated (each schedule planned by the DP at the same micro-batch count)")
    opts = CostOptions()
    hetpipe = Cluster.load(ROOT / "examples" / "clusters" / "hetpipe.yaml")
    node = [d.name for d in hetpipe.devices if d.name.startswith("n0:")]
    for name in ("vgg19_hetpipe", "resnet152_hetpipe"):
        prof = Profile.load(ROOT / "examples" / "profiles" / f"{name}.json")
        for m in (8,) if quick else (8, 16):
            print(f"{name} on {', '.join(node)} (HetPipe node), {m} micro-batches of {prof.micro_batch_size}")
            _header()
            plans(prof, hetpipe, node, m, opts)
    v100 = Cluster.homogeneous(GPU, 1, 4, 25.0, 10.0)
    paths = sorted(PIPEDREAM.glob("*.txt"))
    for path in paths[:2] if quick else paths:
        batch = 64 if path.stem == "gnmt" else None
        prof = import_pipedream(path, gpu_type=GPU, micro_batch_size=batch)
        print(f"{path.stem} (PipeDream profile) on 4 x {GPU}, 8 micro-batches of {prof.micro_batch_size}")
        _header()
        plans(prof, v100, [d.name for d in v100.devices], 8, opts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and profiles")
    args = parser.parse_args()
    print(f"machine: {machine_line()}")
    ok = part_uniform(args.quick)
    part_profiles(args.quick)
    print("\nequal stages: simulated idle equals the closed form (flushed and overlapped), overlapped ZB-H1, ZB-H2 "
          "and ZB-V equal the paper's bubble, ZB-H1 at 1F1B's peak activations: " + ("yes" if ok else "NO"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
