"""Train a DeepSpeed export of a plan with DeepSpeed's own pipeline engine (docs/export.md, "DeepSpeed").

    python tools/deepspeed_train.py EXPORT.json OUT.json [--steps 30] [--seed 0] [--timeout-s 900]

Run with a Python where ``deepspeed`` imports (a side venv). One gloo process per rank of the
export on this CPU (``world_size`` of them); each builds the zoo model's layers with the
project's initialisation (``runtime.stage.init_layer``: the weights ``partitioner train`` starts
from for the same seed), hands them to ``runtime.deepspeed_pipe.planned_pipeline_module`` (the
export's ``parts`` and rank order), ``deepspeed.initialize`` with the exported ``config`` as it is,
and calls ``engine.train_batch`` once per step over the plan's micro-batches: replica ``w``'s
micro-batch ``j`` is rows ``[(w * m + j) * b, (w * m + j + 1) * b)`` of the step's global batch of
the model's task (``runtime.data``), as the project's runtime feeds it.

Every rank checks DeepSpeed's view of it against the export: its pipeline stage
(``engine.stage_id``) and data-parallel index (``engine.grid.data_parallel_id``) must be the export's
``ranks[r]`` ``stage`` and ``data_parallel_rank``, and the layers DeepSpeed built the export's
``parts``; a mismatch stops the run in one line naming the rank and its device.

Writes OUT.json: the deepspeed version, the per-step losses (``train_batch``'s value: the mean over
the micro-batches, averaged over the replicas), under fp16 the loss scale after each step and the
steps skipped, each rank's stage, replica, device and parameter
dtype, the seconds ``deepspeed.init_distributed`` + ``deepspeed.initialize`` took on rank 0 and the
seconds of the steps. Exits 1 with one line on a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _rank(rank: int, world: int, export: Mapping[str, Any], steps: int, seed: int, out: str) -> None:
    import deepspeed

    from runtime.data import make_data
    from runtime.deepspeed_pipe import planned_pipeline_module
    from runtime.stage import init_layer, zoo_chain

    t0 = time.perf_counter()
    deepspeed.init_distributed(dist_backend="gloo")
    b, m, dp = export["config"]["train_micro_batch_size_per_gpu"], export["config"]["gradient_accumulation_steps"], \
        export["data_parallel"]
    chain = zoo_chain(export["model"], b)
    data = make_data(chain, "auto", b, m, dp, seed)
    layers = [init_layer(layer, i, seed) for i, (_, layer) in enumerate(chain.layers)]
    net = planned_pipeline_module(layers, export, loss_fn=data.loss)
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
                                           config=dict(export["config"]))
    init_s = time.perf_counter() - t0
    want = next(r for r in export["ranks"] if r["rank"] == rank)
    got = (engine.stage_id, engine.grid.data_parallel_id)
    if got != (want["stage"], want["data_parallel_rank"]):
        raise RuntimeError(f"rank {rank} ({want['device']}): DeepSpeed runs it as stage {got[0]}, replica {got[1]}; "
                           f"the export says stage {want['stage']}, replica {want['data_parallel_rank']}")
    if list(net.parts) != list(export["parts"]):
        raise RuntimeError(f"rank {rank}: DeepSpeed's parts {list(net.parts)} are not the export's {export['parts']}")
    w = engine.grid.data_parallel_id
    losses: list[float] = []
    scales: list[float] = []  # fp16: the loss scale after each step
    t1 = time.perf_counter()
    for step in range(steps):
        x, y = data.global_batch(step)
        assert y is not None
        rows = [slice((w * m + j) * b, (w * m + j + 1) * b) for j in range(m)]
        loss = engine.train_batch(iter([(x[r], y[r]) for r in rows]))
        losses.append(float(loss))
        scales.append(float(getattr(getattr(engine.optimizer, "loss_scale_config", None), "cur_scale", 0.0)))
    steps_s = time.perf_counter() - t1
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in net.parameters()})
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump({"rank": rank, "stage": got[0], "replica": got[1], "device": want["device"], "dtypes": dtypes,
                   "optimizer": type(engine.optimizer).__name__,
                   "inner_optimizer": type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__,
                   "losses": losses, "loss_scales": scales, "skipped_steps": int(engine.skipped_steps),
                   "init_s": init_s, "steps_s": steps_s}, f)


def train(export: Mapping[str, Any], steps: int, seed: int, timeout_s: float) -> dict[str, Any]:
    import deepspeed

    from runtime.launch import spawn_local

    world = int(export["world_size"])
    with tempfile.TemporaryDirectory(prefix="ds-train-") as tmp:
        spawn_local(_rank, world, (dict(export), steps, seed, tmp), threads=1, timeout_s=timeout_s,
                    start_method="spawn")
        per = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]
    return {"deepspeed": deepspeed.__version__, "losses": per[0]["losses"], "loss_scales": per[0]["loss_scales"],
            "skipped_steps": per[0]["skipped_steps"],
            "ranks": [{k: p[k] for k in ("rank", "stage", "replica", "device", "dtypes", "optimizer",
                                         "inner_optimizer")} for p in per],
            "init_s": per[0]["init_s"], "steps_s": per[0]["steps_s"],
            "same_losses_on_every_rank": all(p["losses"] == per[0]["losses"] for p in per)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", help="a `partitioner export --to deepspeed` JSON")
    ap.add_argument("out", help="where to write the losses (JSON)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=900.0)
    args = ap.parse_args(argv)
    try:
        export = json.loads(Path(args.export).read_text(encoding="utf-8"))
        if export.get("target") != "deepspeed":
            raise ValueError(f"target {export.get('target')!r}: give a deepspeed export")
        got = train(export, args.steps, args.seed, args.timeout_s)
    except Exception as err:  # one line, as the project's tools report
        print(f"{args.export}: {type(err).__name__}: {err}".splitlines()[0], file=sys.stderr)
        return 1
    Path(args.out).write_text(json.dumps(got), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
