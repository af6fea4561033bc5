"""Every export of a plan against this project's runtime on the same plan (docs/export.md).

    python bench/exports.py [--steps 30] [--deepspeed-python PY] [--megatron-python PY]

GPT-2 tiny, the zoo's smallest GPT-2, on the text task (cross-entropy on the standard library's
sources), the plan's optimizer as priced (Adam, lr 0.001), on gloo ranks of this CPU:

* torch.distributed.pipelining: the export (`runtime.torch_pipelining.build_rank`, torch's own
  schedule) and `partitioner train`'s runtime train the same plan, seeds and batches for ``--steps``
  steps; their losses side by side. PP 2 x DP 2 and TP 2 x PP 2 (two tensor-parallel groups of two
  ranks: DTensor shards on gloo) in fp32 and in fp16 (the same arithmetic: equal to rtol 1e-4) and PP 2 in bf16 (both with bf16 weights and gradients and fp32 master weights, runtime/master.py;
  the gradients are summed in each schedule's own order, so a bf16 rounding may go the other way:
  the difference is printed).
* DeepSpeed: where ``deepspeed`` imports with ``--deepspeed-python`` (default: this Python), the
  export of the PP 2 x DP 2 plan trained by DeepSpeed's own pipeline engine in that Python
  (``tools/deepspeed_train.py``: the exported config as is, ``PipelineModule`` with the export's
  parts, ``engine.train_batch`` over the plan's micro-batches, 4 gloo ranks, the same initial
  weights and batches) beside the runtime, in fp32, bf16 (DeepSpeed's ``BF16_Optimizer``: bf16
  weights and gradients, fp32 master) and fp16 (where the CPU computes in fp16; DeepSpeed 0.19.8
  does not train it as priced: docs/export.md); every DeepSpeed rank's stage and replica checked
  against the plan's, the exported hostfile checked by ``export --check``'s code and a reversed one
  refused; the fp16 export also read by DeepSpeed's config class (``DeepSpeedConfig``).
* Megatron-LM: the exports of the same fp16 plan and of the TP 2 x PP 2 plan in fp16 (with
  ``--tensor-model-parallel-size 2``) checked by Megatron-Core's own code and its GPTModel built on
  gloo ranks (``tools/megatron_check.py --build``) where ``megatron.core`` imports
  with ``--megatron-python``.

Prints the tables and one line per framework; writes nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._machine import machine_line  # noqa: E402
from partitioner.errors import PartitionerError  # noqa: E402
from partitioner.export import ExportError, check_export_launch, export_plan  # noqa: E402
from partitioner.plan import Plan, Stage, VirtualWorker  # noqa: E402
from partitioner.pricing import CostOptions  # noqa: E402

MODEL, SEED = "gpt2-tiny", 0


def _worker(cuts: list[int], devices: list[str]) -> VirtualWorker:
    return VirtualWorker(tuple(Stage((a, b), devices[k % len(devices)]) for k, (a, b) in enumerate(itertools.pairwise(cuts))))


def plans() -> dict[str, Plan]:
    return {
        "PP 2 x DP 2, fp32": Plan(MODEL, (_worker([0, 2, 4], ["t0:0", "a0:0"]), _worker([0, 2, 4], ["t0:1", "a0:1"])),
                                  micro_batch_size=2, micro_batches=4, pricing=CostOptions()),
        "PP 2, bf16": Plan(MODEL, (_worker([0, 2, 4], ["t0:0", "a0:0"]),), micro_batch_size=2, micro_batches=4,
                           pricing=CostOptions(precision="bf16")),
        # two tensor-parallel groups of two: the torch export's DTensor sub-meshes, one pipeline per index
        "TP 2 x PP 2, fp32": Plan(MODEL, (_worker([0, 2, 4], ["n0:0-1", "n0:2-3"]),), micro_batch_size=2,
                                  micro_batches=4, pricing=CostOptions()),
        # the same in fp16: loss scaling through the shards (each rank unscales its part)
        "TP 2 x PP 2, fp16": Plan(MODEL, (_worker([0, 2, 4], ["n0:0-1", "n0:2-3"]),), micro_batch_size=2,
                                  micro_batches=4, pricing=CostOptions(precision="fp16")),
    }


def _torch_rank(rank: int, world: int, export: dict[str, Any], steps: int, out: str) -> None:
    import torch

    from runtime.data import make_data
    from runtime.stage import zoo_chain
    from runtime.torch_pipelining import build_rank

    chain = zoo_chain(export["model"], export["micro_batch_size"])
    data = make_data(chain, "auto", export["micro_batch_size"], export["n_microbatches"], len(export["pipelines"]), SEED)
    me = build_rank(export, rank, seed=SEED, loss_fn=data.loss)
    t = export["training"]
    opt = me.make_optimizer(t["optimizer"], t["lr"])
    losses = []
    for step in range(steps):
        x, y = data.global_batch(step)
        got = me.step(x, y)
        me.sync_gradients()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if got is not None:
            losses.append(sum(got) / len(got))
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump({"worker": me.worker, "tp_rank": me.tp_rank, "losses": losses}, f)
    del torch


def torch_losses(plan: Plan, steps: int) -> list[float]:
    from runtime.launch import spawn_local

    export = export_plan(plan, "torch-pipelining")
    with tempfile.TemporaryDirectory() as tmp:
        spawn_local(_torch_rank, export["world_size"], (export, steps, tmp), threads=1, timeout_s=600)
        per = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(export["world_size"])]
    runs = [p["losses"] for p in per if p["losses"] and p["tp_rank"] == 0]  # (a group's ranks: the same losses)
    return [sum(r[k] for r in runs) / len(runs) for k in range(steps)]


def runtime_losses(plan: Plan, steps: int) -> tuple[list[float], dict[str, Any]]:
    from runtime.launch import TrainConfig, train_local

    m = train_local(plan, TrainConfig(MODEL, steps=steps, warmup=0, lr=0.001, seed=SEED, threads=1, timeout_s=600,
                                      data="text", progress=False))
    return m["loss"], m


def _has(python: str, module: str) -> str:
    """'' when ``module`` imports with ``python``, else why not."""
    r = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, timeout=300)
    return "" if r.returncode == 0 else (r.stderr.strip().splitlines() or ["failed"])[-1]


_DS_CHECK = """
import json, sys
cfg, dp = json.loads(sys.argv[1]), int(sys.argv[2])
import deepspeed, deepspeed.comm as dcomm
dcomm.get_rank = lambda *a, **k: 0   # no process group: DeepSpeedConfig asks the rank, the degree is the mpu's
class MPU:
    def get_data_parallel_world_size(self): return dp
from deepspeed.runtime.config import DeepSpeedConfig
c = DeepSpeedConfig(cfg, mpu=MPU())
print(json.dumps({"deepspeed": deepspeed.__version__, "world_size": c.world_size,
                  "train_batch_size": c.train_batch_size, "micro_batch": c.train_micro_batch_size_per_gpu,
                  "gradient_accumulation_steps": c.gradient_accumulation_steps,
                  "fp16": c.float16_config.model_dump(), "bf16_enabled": c.bfloat16_config.enabled,
                  "optimizer": c.optimizer_name, "optimizer_params": c.optimizer_params,
                  "zero_stage": c.zero_optimization_stage}))
"""


def deepspeed_check(python: str, plan: Plan) -> str:
    e = export_plan(plan, "deepspeed")
    r = subprocess.run([python, "-c", _DS_CHECK, json.dumps(e["config"]), str(e["data_parallel"])],
                       capture_output=True, text=True, timeout=600)
    if r.returncode:
        return f"DeepSpeed: DeepSpeedConfig REFUSED the exported config: {(r.stderr.strip().splitlines() or ['?'])[-1]}"
    got = json.loads(r.stdout.strip().splitlines()[-1])
    fp16 = got["fp16"]
    return (f"DeepSpeed {got['deepspeed']}: DeepSpeedConfig read the exported config of the fp16 plan: data parallel "
            f"{got['world_size']}, train_batch_size {got['train_batch_size']} = micro-batch {got['micro_batch']} x "
            f"{got['gradient_accumulation_steps']} accumulation steps x {got['world_size']}, fp16 enabled "
            f"{fp16['enabled']} (dynamic loss scale from 2**{fp16['initial_scale_power']}, window "
            f"{fp16['loss_scale_window']}, hysteresis {fp16['hysteresis']}), optimizer {got['optimizer']} "
            f"{got['optimizer_params']}, ZeRO stage {got['zero_stage']}")


def deepspeed_layout(plan: Plan) -> list[str]:
    """The export's hostfile checked against its rank -> device mapping (``export --check``'s
    code), and the same hosts in reverse order, which must be refused."""
    e = export_plan(plan, "deepspeed")
    hostfile = e["launch"]["hostfile"]
    lines = [f"hostfile {hostfile.strip().splitlines()}: {check_export_launch(e, hostfile)}"]
    reverse = "".join(f"{ln}\n" for ln in reversed(hostfile.strip().splitlines()))
    try:
        check_export_launch(e, reverse)
        lines.append(f"hostfile {reverse.strip().splitlines()}: NOT refused (it puts stages on other GPUs)")
    except PartitionerError as err:
        lines.append(f"hostfile {reverse.strip().splitlines()}: refused: {err}")
    return lines


def deepspeed_train(python: str, plan: Plan, steps: int, timeout_s: float) -> dict[str, Any]:
    """DeepSpeed's pipeline engine trains the export of ``plan`` in ``python``
    (``tools/deepspeed_train.py``); its output, and ``wall_s`` of the subprocess, or ``error``."""
    with tempfile.TemporaryDirectory() as tmp:
        path, out = Path(tmp) / "ds.json", Path(tmp) / "out.json"
        path.write_text(json.dumps(export_plan(plan, "deepspeed")))
        t0 = time.perf_counter()
        try:
            r = subprocess.run([python, str(ROOT / "tools" / "deepspeed_train.py"), str(path), str(out),
                                "--steps", str(steps), "--seed", str(SEED), "--timeout-s", str(timeout_s)],
                               capture_output=True, text=True, timeout=timeout_s + 120, cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
        except subprocess.TimeoutExpired:
            return {"error": f"did not finish in {timeout_s + 120:.0f} s"}
        wall_s = time.perf_counter() - t0
        if r.returncode:
            return {"error": (r.stderr.strip().splitlines() or ["?"])[-1]}
        return {**json.loads(out.read_text()), "wall_s": wall_s}


def deepspeed_vs_runtime(python: str, name: str, plan: Plan, ours: list[float], steps: int) -> list[str]:
    got = deepspeed_train(python, plan, steps, timeout_s=900)
    if "error" in got:
        return [f"DeepSpeed, {name}: FAILED: {got['error']}"]
    theirs = got["losses"]
    bad = [f"rank {r['rank']} ({r['device']}) runs stage {r['stage']} of replica {r['replica']}, where the plan has "
           f"{plan.virtual_workers[r['replica']].stages[r['stage']].device}" for r in got["ranks"]
           if plan.virtual_workers[r["replica"]].stages[r["stage"]].device != r["device"]]
    rel = [abs(a - b) / abs(b) for a, b in zip(theirs, ours)]
    r0 = got["ranks"][0]
    lines = [f"\nDeepSpeed {got['deepspeed']}, {name}: {len(got['ranks'])} ranks, {r0['optimizer']} "
             f"({r0['inner_optimizer']}) on {'/'.join(r0['dtypes'])} weights; ranks (stage, replica): "
             + ", ".join(f"{r['rank']}=({r['stage']}, {r['replica']}) {r['device']}" for r in got["ranks"])
             + (": every rank the plan's stage and replica" if not bad else ": WRONG: " + "; ".join(bad)),
             f"{'step':>5}  {'runtime':>10}  {'deepspeed':>10}  {'rel. diff':>9}"]
    for k in sorted({0, 1, 2, *range(4, steps, 5), steps - 1}):
        lines.append(f"{k:>5}  {ours[k]:>10.5f}  {theirs[k]:>10.5f}  {rel[k]:>9.1e}")
    lines.append(f"max relative difference {max(rel):.1e} over {steps} steps: "
                 + ("equal to rtol 1e-4" if max(rel) <= 1e-4 else "NOT equal to rtol 1e-4"))
    if plan.pricing is not None and plan.pricing.precision == "fp16":
        lines.append(f"DeepSpeed's loss scale after the last step {got['loss_scales'][-1]:g}, steps skipped "
                     f"{got['skipped_steps']} (its fp16 step under ZeRO stage 0 divides unscaled gradients by the "
                     "scale: docs/export.md)")
    lines.append(f"time: deepspeed.init_distributed + initialize {got['init_s']:.1f} s (rank 0), {steps} steps "
                 f"{got['steps_s']:.1f} s, the subprocess {got['wall_s']:.1f} s")
    return lines


def megatron_check(python: str, plan: Plan) -> list[str]:
    why = _has(python, "megatron.core")
    if why:
        return [f"Megatron-LM: not run ({python}: {why})"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "megatron.json"
        path.write_text(json.dumps(export_plan(plan, "megatron")))
        r = subprocess.run([python, str(ROOT / "tools" / "megatron_check.py"), str(path), "--build"],
                           capture_output=True, text=True, timeout=600, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    if r.returncode:
        return [f"Megatron-LM: Megatron-Core REFUSED the export: {(r.stderr.strip().splitlines() or ['?'])[-1]}"]
    return ["Megatron-LM (Megatron-Core's own code, tools/megatron_check.py --build):",
            *(f"  {ln}" for ln in r.stdout.strip().splitlines())]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--deepspeed-python", default=sys.executable, help="a Python where deepspeed imports")
    ap.add_argument("--megatron-python", default=sys.executable, help="a Python where megatron.core imports")
    ap.add_argument("--only-deepspeed", action="store_true", help="the DeepSpeed part alone (and the runtime beside it)")
    args = ap.parse_args()
    print(machine_line())
    print(f"{MODEL}, text task (cross-entropy), the plan's optimizer as priced (adam, lr 0.001), seed {SEED}, "
          f"{args.steps} steps, gloo ranks of this CPU, one thread each")
    ours_of: dict[str, list[float]] = {}
    for name, plan in plans().items():
        if args.only_deepspeed:
            continue
        ours, metrics = runtime_losses(plan, args.steps)
        ours_of[name] = ours
        theirs = torch_losses(plan, args.steps)
        rel = [abs(a - b) / abs(b) for a, b in zip(theirs, ours)]
        print(f"\n{name}: {metrics['world_size']} ranks; runtime: {metrics['optimizer']} in {metrics['precision']}")
        print(f"{'step':>5}  {'runtime':>10}  {'torch export':>12}  {'rel. diff':>9}")
        for k in sorted({0, 1, 2, *range(4, args.steps, 5), args.steps - 1}):
            print(f"{k:>5}  {ours[k]:>10.5f}  {theirs[k]:>12.5f}  {rel[k]:>9.1e}")
        same = max(rel) <= 1e-4
        print(f"max relative difference {max(rel):.1e} over {args.steps} steps: "
              + ("equal to rtol 1e-4" if same else "NOT equal to rtol 1e-4")
              + (" (bf16: the gradients are summed in each schedule's order)" if "bf16" in name else ""))
    ppdp = plans()["PP 2 x DP 2, fp32"]
    fp16 = Plan(MODEL, ppdp.virtual_workers, micro_batch_size=2, micro_batches=4, pricing=CostOptions(precision="fp16"))
    print()
    why = _has(args.deepspeed_python, "deepspeed")
    if why:
        print(f"DeepSpeed: not run ({args.deepspeed_python}: {why}); its config was not validated")
    else:
        print(deepspeed_check(args.deepspeed_python, fp16))
        print("DeepSpeed launch order, PP 2 x DP 2 (`partitioner export --check`'s code):")
        for line in deepspeed_layout(ppdp):
            print(f"  {line}")
        for precision in ("fp32", "bf16", "fp16"):  # (fp16: see docs/export.md)
            plan = Plan(MODEL, ppdp.virtual_workers, micro_batch_size=2, micro_batches=4,
                        pricing=CostOptions(precision=precision))
            name = f"PP 2 x DP 2, {precision}"
            ours = ours_of.get(name) or runtime_losses(plan, args.steps)[0]
            for line in deepspeed_vs_runtime(args.deepspeed_python, name, plan, ours, args.steps):
                print(line)
    if args.only_deepspeed:
        return 0
    try:
        export_plan(plans()["TP 2 x PP 2, fp32"], "deepspeed")
    except ExportError as err:
        print(f"DeepSpeed, TP 2 x PP 2: the export is refused: {err}")
    tp_fp16 = Plan(MODEL, plans()["TP 2 x PP 2, fp32"].virtual_workers, micro_batch_size=2, micro_batches=4,
                   pricing=CostOptions(precision="fp16"))
    for what, plan in (("PP 2 x DP 2, fp16", fp16), ("TP 2 x PP 2, fp16", tp_fp16)):
        print(f"{what}: " + " ".join(export_plan(plan, "megatron")["layout_args"]))
        for line in megatron_check(args.megatron_python, plan):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
