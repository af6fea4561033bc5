"""Head to head with Sailor's planner on its three OPT-350M problems, judged by this simulator.

Problems (global batch 1,024, sequence 2,048, fp32 as Sailor's artifact scripts price them): 8
RTX-3090 + 4 RTX-2080 + 4 TITAN-RTX; 16 GH-96; 32 A100-40GB + 32 V100-16GB. Clusters are built
from Sailor's cluster file (GPUs per node) and measured NCCL curves
(``partitioner.importers.sailor_runs.sailor_cluster``); the profile holds every tensor-parallel
degree Sailor measured at the micro-batch size (``import_sailor_degrees``).

For each problem the script makes ONE planning run through the front door (what ``partitioner
plan --micro-batches auto --global-batch 1024 --time-limit T`` does; no sweep) and prints our plan (tensor-parallel degree per GPU type, pipelines,
stages, micro-batches), its simulated iteration for the global batch, the planning time and the
certificate, beside Sailor's own chosen plan (``../shared/data/sailor_plans/``) imported with
``import_sailor_run`` and simulated here. Sailor splits the global batch unevenly over its
pipelines; its plan is imported with the count rounded up (``meta.samples_per_iteration``), so
both are compared per sample as well.

    python bench/sailor_h2h.py [--time-limit 3] [--problems rtx,gh,av]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._machine import machine_line  # noqa: E402
from partitioner.importers.sailor import import_sailor_degrees  # noqa: E402
from partitioner.importers.sailor_runs import import_sailor_run, sailor_cluster  # noqa: E402
from partitioner.pricing import CostOptions  # noqa: E402
from partitioner.simulate import simulate_plan  # noqa: E402
from solvers.planning import PlanRequest, plan  # noqa: E402

SHARED = ROOT.parent / "shared" / "data"
GLOBAL_BATCH = 1024
# name: (GPUs by Sailor's names, Sailor's plan file)
PROBLEMS = {
    "rtx": ({"RTX-3090": 8, "RTX-2080": 4, "Titan-RTX": 4}, "rtx_mix_8x3090_4x2080_4xtitan.json"),
    "gh": ({"GH-96": 16}, "gh96_x16.json"),
    "av": ({"A100-40": 32, "V100-16": 32}, "a100x32_v100x32.json"),
}
FP32 = CostOptions(precision="fp32")


def _ours(name: str, time_limit_s: float, repeat: int, shared_nics: bool = False) -> dict:
    """One planning run through the front door (``plan --micro-batches auto --global-batch 1024``):
    micro-batch size, virtual workers, micro-batches and each type's tensor-parallel degree chosen
    together."""
    gpus, _ = PROBLEMS[name]
    per_node = {k: v["gpus_per_node"] for k, v in
                json.loads((SHARED / "sailor_opt350" / "basic_cluster_config.json").read_text()).items()
                if isinstance(v, dict)}
    cluster = sailor_cluster(SHARED / "sailor_validation" / "network" / "network_coeffs_all_homo.json", gpus,
                             per_node, profile_dir=SHARED / "sailor_opt350", shared_nics=shared_nics)
    profile = import_sailor_degrees(SHARED / "sailor_opt350", micro_batch_size=1, gpu_types=tuple(gpus),
                                    all_sizes=True)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        res = plan(profile, cluster, PlanRequest(micro_batches="auto", global_batch=GLOBAL_BATCH, options=FP32,
                                                 time_limit_s=time_limit_s))
        times.append(time.perf_counter() - t0)
    planning_s = statistics.median(times)
    if not res.ok or res.plan is None:
        return {"planning_s": planning_s, "reason": res.reason}
    chosen = res.details["micro_batch_choice"]  # type: ignore[typeddict-item]
    at = profile.at_size(res.plan.micro_batch_size)
    sim = simulate_plan(res.plan, at, cluster, FP32).iteration_s
    return {"iteration_s": sim, "plan": res.plan, "gap": res.gap, "bound_s": GLOBAL_BATCH * res.lower_bound,
            "tp": chosen["tensor_parallel"], "status": str(res.status), "planning_s": planning_s}


def _sailor(name: str, shared_nics: bool = False) -> dict:
    _, file = PROBLEMS[name]
    run = import_sailor_run(SHARED / "sailor_plans" / file, SHARED / "sailor_opt350",
                            SHARED / "sailor_validation" / "network" / "network_coeffs_all_homo.json", FP32,
                            shared_nics=shared_nics)
    sim = simulate_plan(run.plan, run.profile, run.cluster, FP32).iteration_s
    samples = int(run.plan.meta.get("samples_per_iteration", GLOBAL_BATCH))
    return {"iteration_s": sim, "samples": samples, "plan": run.plan}


def _shape(plan) -> str:  # type: ignore[no-untyped-def]
    w = plan.virtual_workers
    stages = sorted({len(v.stages) for v in w})
    return f"K={len(w)}, stages {'/'.join(map(str, stages))}, m={plan.micro_batches}x{plan.micro_batch_size}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=3.0, help="the planner's time limit per problem (s)")
    ap.add_argument("--problems", default="rtx,gh,av")
    ap.add_argument("--repeat", type=int, default=3, help="planning runs per problem; the median time is shown")
    ap.add_argument("--shared-nics", action="store_true",
                    help="both plans judged on the network with one flow at the one-GPU curve and each node's GPUs "
                         "sharing one NIC (import sailor-run --shared-nics)")
    args = ap.parse_args(argv)
    print(machine_line())
    print(f"time limit {args.time_limit:g} s; planning time: median of {args.repeat} runs; iteration: this simulator, "
          "fp32 with Adam as Sailor's artifact prices them"
          + ("; network: shared NICs" if args.shared_nics else "; network: every flow at its node's curve"))
    print(f"{'problem':8} {'plan':8} {'iteration_s':>11} {'s/1024':>8} {'planning_s':>10}  shape")
    for name in args.problems.split(","):
        theirs = _sailor(name, args.shared_nics)
        ours = _ours(name, args.time_limit, args.repeat, args.shared_nics)
        per = theirs["iteration_s"] * GLOBAL_BATCH / theirs["samples"]
        print(f"{name:8} {'sailor':8} {theirs['iteration_s']:11.3f} {per:8.3f} {'-':>10}  {_shape(theirs['plan'])}")
        if not ours.get("plan"):
            print(f"{name:8} {'ours':8} no plan: {ours.get('reason')}")
            continue
        print(f"{name:8} {'ours':8} {ours['iteration_s']:11.3f} {ours['iteration_s']:8.3f} "
              f"{ours['planning_s']:10.1f}  {_shape(ours['plan'])}, tp {ours['tp']}, {ours['status']}, "
              f"bound {ours['bound_s']:.3f} s (gap {100 * ours['gap']:.1f} %)")
        print(f"{'':8} ours / sailor per sample: {ours['iteration_s'] / per:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
