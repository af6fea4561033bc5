"""Plans as Megatron-LM takes them (target ``megatron``, torch-free).

The export writes Megatron-LM's arguments for a GPT-style chain (embedding, transformer layers,
output head): the pipeline layout string of ``--pipeline-model-parallel-layout`` (any contiguous
split), and, where the split has equal middle stages, the older
``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` form; the
pipeline, virtual-stage, data- and tensor-parallel sizes (``--tensor-model-parallel-size``, one
per job), the batch and the plan's training (precision, optimizer, learning rate), and the rank
order with the tensor-parallel index fastest.
"""

from __future__ import annotations

import itertools
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from ..launch import group_gpus
from ..plan import Plan
from ..schedule import spec
from .common import (
    EXPORT_FORMAT,
    ExportError,
    _check_plan,
    _identical_cuts,
    _launch,
    _pipeline_shape,
    _rank_order,
    _tp_degree,
    training_of,
)

__all__ = ["megatron_layer_kinds"]


def megatron_layer_kinds(model: str, num_layers: int) -> list[str] | None:
    """Megatron's layer letters for the chain of ``model`` (``E`` embedding, ``t`` transformer
    layer, ``L`` output head and loss), or ``None`` when the model is not a GPT-style chain.
    The zoo's GPT-2 models are: embedding, ``num_layers - 2`` blocks, head."""
    if model.startswith("gpt2") and num_layers >= 3:
        return ["E", *["t"] * (num_layers - 2), "L"]
    return None


def _layout_stage(kinds: Sequence[str]) -> str:
    t = kinds.count("t")
    body = "" if t == 0 else ("t" if t == 1 else f"t*{t}")
    return ("E" if "E" in kinds else "") + body + ("L" if "L" in kinds else "")


def _megatron(plan: Plan, lr: float | None = None) -> dict[str, Any]:
    target = "megatron"
    n_layers = _check_plan(plan, target)
    kinds = megatron_layer_kinds(plan.model, n_layers)
    if kinds is None:
        raise ExportError(target, f"model '{plan.model}' is not a GPT-style chain (embedding, transformer layers, "
                                  f"output head), the only model Megatron-LM's pipeline builds; the zoo's gpt2-* are")
    if spec(plan.schedule).breadth_first:
        raise ExportError(target, f"schedule {plan.schedule}: Megatron-LM's interleaved schedule runs micro-batches depth-first "
                                  "and has no breadth-first order; re-plan with interleaved")
    sizes = _pipeline_shape(plan, target)
    cuts = _identical_cuts(plan, target, "Megatron-LM's data-parallel replicas all run one pipeline split")
    tp = _tp_degree(plan, target, "Megatron-LM has one --tensor-model-parallel-size for the whole job; re-plan with "
                                  "one degree (`partitioner plan --tensor-parallel T`)")
    pp, v, dp = sizes[0], plan.chunks, len(plan.virtual_workers)
    m, b = plan.micro_batches, plan.micro_batch_size
    vws = plan.virtual_workers
    stage_kinds = [kinds[a:c] for a, c in itertools.pairwise(cuts)]
    counts = [k.count("t") for k in stage_kinds]
    layout = "|".join(_layout_stage(k) for k in stage_kinds)
    n_t = n_layers - 2
    # Megatron-LM's rank order: tp-cp-ep-dp-pp (tensor-parallel index fastest, then data-parallel rank,
    # pipeline rank slowest: rank = (pipeline rank * dp + data-parallel rank) * tp + index), or with
    # --use-tp-pp-dp-mapping tp-cp-ep-pp-dp (rank = (data-parallel rank * pp + pipeline rank) * tp + index)
    coords = {"pipe-major": [((r // tp) // dp, (r // tp) % dp, r % tp) for r in range(pp * dp * tp)],
              "data-major": [((r // tp) % pp, (r // tp) // pp, r % tp) for r in range(pp * dp * tp)]}
    orders = {name: [group_gpus(vws[w].stages[d].device)[i] for d, w, i in c] for name, c in coords.items()}
    order = _rank_order(plan, target, orders)
    training = training_of(plan, lr)
    args: list[str] = ["--num-layers", str(n_t), "--pipeline-model-parallel-size", str(pp)]
    if tp > 1:
        args += ["--tensor-model-parallel-size", str(tp)]
    if v > 1:
        args += ["--num-virtual-stages-per-pipeline-rank", str(v)]
    args += ["--micro-batch-size", str(b), "--global-batch-size", str(b * m * dp), *_megatron_training(training)]
    if order == "data-major":
        args.append("--use-tp-pp-dp-mapping")
    uneven, why = _megatron_uneven(counts, pp, v)
    ranks = [{"rank": r, "device": vws[w].stages[d].device, "gpu": orders[order][r],
              "gpu_type": vws[w].stages[d].gpu_type, "pipeline_rank": d, "data_parallel_rank": w, "tp_rank": i,
              "tp_size": tp, "stages": list(range(d, pp * v, pp))} for r, (d, w, i) in enumerate(coords[order])]
    out: dict[str, Any] = {
        "format": EXPORT_FORMAT, "target": target, "model": plan.model, "num_layers": n_layers,
        "transformer_layers_per_stage": counts, "pipeline_parallel": pp, "virtual_stages_per_rank": v,
        "data_parallel": dp, "tensor_parallel": tp, "schedule": plan.schedule, "layout": layout, "rank_order": order,
        "training": training,
        "args": args, "layout_args": [*args, "--pipeline-model-parallel-layout", layout],
        "uneven_args": None if uneven is None else [*args, *uneven],
        "uneven_args_unavailable": why, "world_size": pp * dp * tp, "ranks": ranks,
    }
    chosen = out["layout_args"]
    _, out["launch"] = _launch(orders[order], ["pretrain_gpt.py", *chosen])
    out["snippet"] = _megatron_snippet(out)
    return out


def _megatron_training(t: Mapping[str, Any]) -> list[str]:
    """Megatron-LM's arguments for a plan's training: precision (``--fp16`` with dynamic loss
    scaling as torch.amp.GradScaler does it, ``--bf16``; both keep fp32 main weights; under bf16
    Megatron-LM accumulates and all-reduces the gradients in fp32 unless ``--grad-reduce-in-bf16``,
    which the export adds where the pricing counts bf16 gradients, as the runtime runs them: its
    ``allreduce_precision`` is not fp32), the optimizer
    (Megatron's ``adam`` is decoupled weight decay, 0.01 by default: 0 for Adam, 0.01 for AdamW;
    its ``sgd`` has momentum 0.9 by default: 0 for plain SGD) and the learning rate."""
    args: list[str] = []
    if t["precision"] == "fp16":
        args += ["--fp16", "--initial-loss-scale", "65536", "--loss-scale-window", "2000", "--hysteresis", "1"]
    elif t["precision"] == "bf16":
        fp32_grads = (t.get("pricing") or {}).get("allreduce_precision") == "fp32"
        args += ["--bf16"] if fp32_grads else ["--bf16", "--grad-reduce-in-bf16"]
    lr = repr(float(t["lr"]))
    if t["optimizer"] == "sgd":
        return [*args, "--optimizer", "sgd", "--sgd-momentum", "0", "--weight-decay", "0", "--lr", lr]
    decay = "0.01" if t["optimizer"] == "adamw" else "0"
    return [*args, "--optimizer", "adam", "--adam-beta1", "0.9", "--adam-beta2", "0.999", "--adam-eps", "1e-08",
            "--weight-decay", decay, "--lr", lr]


def _megatron_uneven(counts: Sequence[int], pp: int, v: int) -> tuple[list[str] | None, str | None]:
    """``--decoder-first/last-pipeline-num-layers`` for ``counts`` (transformer layers per stage),
    or ``None`` and the reason they cannot express it."""
    if len(set(counts)) == 1:
        return [], None
    if v > 1:
        return None, ("the virtual stages hold different numbers of transformer layers; without a layout "
                      "Megatron-LM gives every virtual stage the same count")
    mid = counts[1:-1]
    if len(set(mid)) > 1:
        return None, (f"middle stages hold {mid} transformer layers; without a layout Megatron-LM gives every "
                      f"stage but the first and the last the same count")
    if 0 in counts:
        return None, "a stage holds no transformer layer (only the embedding or the head)"
    extra: list[str] = []
    if pp == 2:
        return ["--decoder-first-pipeline-num-layers", str(counts[0])], None
    if counts[0] != mid[0]:
        extra += ["--decoder-first-pipeline-num-layers", str(counts[0])]
    if counts[-1] != mid[0]:
        extra += ["--decoder-last-pipeline-num-layers", str(counts[-1])]
    return extra, None


def _megatron_snippet(e: Mapping[str, Any]) -> str:
    tp = e.get("tensor_parallel", 1)
    lines = [f"# {e['pipeline_parallel']} pipeline x {e['data_parallel']} data-parallel"
             + (f" x {tp} tensor-parallel" if tp > 1 else "") + " ranks; "
             f"transformer layers per stage {e['transformer_layers_per_stage']}"]
    if e["uneven_args"] is not None:
        lines += ["# Megatron-LM with --decoder-first/last-pipeline-num-layers:",
                  "torchrun ... pretrain_gpt.py " + " ".join(e["uneven_args"])]
    else:
        lines += [f"# --decoder-first/last-pipeline-num-layers cannot express it: {e['uneven_args_unavailable']}"]
    lines += ["# Megatron-LM with --pipeline-model-parallel-layout:",
              "torchrun ... pretrain_gpt.py " + " ".join(e["args"]) + " --pipeline-model-parallel-layout "
              + shlex.quote(e["layout"]),
              f"# launch (ranks {e['rank_order']}), each line on its node, node k first with --node-rank k:",
              *e["launch"]["torchrun"]]
    return "\n".join(lines) + "\n"

