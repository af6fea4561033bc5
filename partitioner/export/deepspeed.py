"""Plans as DeepSpeed's pipeline engine takes them (target ``deepspeed``, torch-free).

The export writes the layer boundaries of DeepSpeed's ``PipelineModule`` (its ``parts``: stage
``s`` holds layers ``[parts[s], parts[s + 1])``), the pipeline and data-parallel degrees, the
rank -> device order of DeepSpeed's pipe x data topology, a DeepSpeed config (batch, precision,
optimizer, ZeRO stage 0, no clipping) and a hostfile with ``deepspeed``'s command. DeepSpeed's
``partition_method`` accepts only ``'parameters'``, ``'uniform'`` and ``'type:REGEX'``; a
partition that is none of these needs ``PipelineModule._partition_layers`` overridden, which the
snippet does. DeepSpeed's pipeline engine has no tensor parallelism of its own: a plan with
tensor-parallel groups is refused.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from ..launch import NodeLaunch, deepspeed_launcher_problem, hostfile
from ..plan import Plan
from .common import (
    EXPORT_FORMAT,
    ExportError,
    _check_plan,
    _identical_cuts,
    _launch,
    _one_stage_per_rank,
    _pipeline_shape,
    _rank_order,
    _tp_degree,
    training_of,
)

__all__ = ["deepspeed_uniform_parts"]


def deepspeed_uniform_parts(num_layers: int, num_stages: int) -> list[int]:
    """The boundaries DeepSpeed's ``partition_method='uniform'`` gives: ``num_layers // num_stages``
    layers per stage, one more for each of the first ``num_layers % num_stages`` stages (one
    layer per stage, and empty stages after them, when there are fewer layers than stages)."""
    if num_layers <= num_stages:
        return [min(p, num_layers) for p in range(num_stages + 1)]
    size, extra = divmod(num_layers, num_stages)
    return [p * size + min(p, extra) for p in range(num_stages + 1)]


def _deepspeed(plan: Plan, lr: float | None = None) -> dict[str, Any]:
    target = "deepspeed"
    n_layers = _check_plan(plan, target)
    t = _tp_degree(plan, target, "DeepSpeed's PipelineModule has no tensor parallelism of its own")
    if t > 1:
        st = plan.virtual_workers[0].stages[0]
        raise ExportError(target, f"its stages run on tensor-parallel groups ({st.device}: degree {t}); DeepSpeed's "
                                  "pipeline engine has no tensor parallelism of its own (its topology's model axis "
                                  "takes layers the model shards itself, as Megatron-DeepSpeed's); export to "
                                  "torch-pipelining or megatron, or re-plan without --tensor-parallel")
    _one_stage_per_rank(plan, target, "its TrainSchedule, a 1F1B order")
    _pipeline_shape(plan, target)
    parts = _identical_cuts(plan, target, "DeepSpeed's data-parallel replicas all run one partition (PipelineModule "
                                          "parts)")
    pp, dp = len(parts) - 1, len(plan.virtual_workers)
    m, b = plan.micro_batches, plan.micro_batch_size
    vws = plan.virtual_workers
    # DeepSpeed's PipeDataParallelTopology orders ranks pipe-major (rank = stage * dp + replica); a
    # ProcessTopology(axes=['data', 'pipe']) data-major (rank = replica * pp + stage): the first whose
    # ranks a launcher can start node after node
    orders = {"pipe-major": [vws[r % dp].stages[r // dp].device for r in range(pp * dp)],
              "data-major": [vws[r // pp].stages[r % pp].device for r in range(pp * dp)]}
    order = _rank_order(plan, target, orders)
    rank_of = ((lambda s, w: s * dp + w) if order == "pipe-major" else (lambda s, w: w * pp + s))
    ranks = sorted(({"rank": rank_of(s, w), "device": vw.stages[s].device, "gpu_type": vw.stages[s].gpu_type,
                     "stage": s, "data_parallel_rank": w}
                    for s in range(pp) for w, vw in enumerate(vws)), key=lambda r: r["rank"])
    uniform = parts == deepspeed_uniform_parts(n_layers, pp)
    training = training_of(plan, lr)
    out: dict[str, Any] = {
        "format": EXPORT_FORMAT, "target": target, "model": plan.model, "num_layers": n_layers,
        "num_stages": pp, "data_parallel": dp, "parts": parts,
        "partition_method": "uniform" if uniform else None,
        "schedule": plan.schedule, "rank_order": order,
        "topology": {"axes": ["pipe", "data"] if order == "pipe-major" else ["data", "pipe"],
                     "dims": [pp, dp] if order == "pipe-major" else [dp, pp]},
        "config": _deepspeed_config(training, b, m, dp),
        "training": training,
        "world_size": pp * dp, "ranks": ranks,
    }
    nodes, out["launch"] = _launch(orders[order], ["TRAIN.py", "--deepspeed_config", "ds_config.json"])
    out["launch"].update(_deepspeed_launcher(nodes))
    out["snippet"] = _deepspeed_snippet(out)
    return out


def _deepspeed_config(t: Mapping[str, Any], b: int, m: int, dp: int) -> dict[str, Any]:
    """The DeepSpeed config of a plan's training: batch, precision (fp16 with dynamic loss scaling
    as torch.amp.GradScaler scales: from 2**16, doubled after 2000 good steps, halved at once on an
    overflow; bf16, its gradients accumulated in bf16 unless the pricing's ``allreduce_precision``
    is fp32), torch's own optimizer (Adam without weight decay, AdamW with torch's 0.01, SGD),
    ZeRO stage 0 (the pricing keeps every parameter's optimizer state on its stage) and no
    gradient clipping."""
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": b, "gradient_accumulation_steps": m,
                              "train_batch_size": b * m * dp}
    if t["precision"] == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 2000,
                          "hysteresis": 1, "min_loss_scale": 1}
    elif t["precision"] == "bf16":
        config["bf16"] = {"enabled": True}
        if (t.get("pricing") or {}).get("allreduce_precision") != "fp32":
            # DeepSpeed's bf16 optimizer accumulates gradients in fp32 unless told otherwise; the
            # pricing counts 2-byte gradients, as the runtime holds them
            config["data_types"] = {"grad_accum_dtype": "bf16"}
    lr = t["lr"]
    config["optimizer"] = {
        "adam": {"type": "Adam", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                                            "torch_adam": True, "adam_w_mode": False}},
        "adamw": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
                                              "torch_adam": True}},
        "sgd": {"type": "SGD", "params": {"lr": lr}},
    }[t["optimizer"]]
    config["zero_optimization"] = {"stage": t["zero_stage"]}
    # the plan trains without clipping; DeepSpeed clips the gradients' global norm to 1.0 unless
    # told otherwise (GRADIENT_CLIPPING_DEFAULT 1.0 in DeepSpeed 0.19.8)
    config["gradient_clipping"] = 0.0
    return config


def _deepspeed_launcher(nodes: Sequence[NodeLaunch]) -> dict[str, Any]:
    """The hostfile (nodes in rank order) and ``deepspeed``'s command, or why its launcher cannot
    hold the mapping (the torchrun lines then start the job; DeepSpeed reads their environment)."""
    problem = deepspeed_launcher_problem(nodes)
    plain = all(list(n.gpus) == list(range(n.nproc)) for n in nodes)
    slots = "".join(f"{n.node} slots={n.nproc if plain else max(n.gpus) + 1}\n" for n in nodes)
    cmd = ["deepspeed", "--hostfile", "hostfile", "--master_addr", nodes[0].node]
    if not plain:
        cmd += ["--include", "@".join(f"{n.node}:{n.cuda_visible_devices}" for n in nodes)]
    return {"hostfile": slots if problem is None else hostfile(nodes),
            "deepspeed": shlex.join([*cmd, "TRAIN.py", "--deepspeed_config", "ds_config.json"]) if problem is None
            else None,
            "deepspeed_unavailable": problem}


def _ds_stages(e: Mapping[str, Any]) -> str:
    if e["rank_order"] == "pipe-major":
        return f"num_stages={e['num_stages']}"
    return f"topology=ProcessTopology(axes=['data', 'pipe'], dims=[{e['data_parallel']}, {e['num_stages']}])"


def _deepspeed_snippet(e: Mapping[str, Any]) -> str:
    lines = [
        "import deepspeed",
        "from deepspeed.pipe import PipelineModule" + (", ProcessTopology" if e["rank_order"] != "pipe-major" else ""),
        "",
        f"# layers: the model's {e['num_layers']} layers in order (nn.Module or LayerSpec), as the plan's profile lists them",
    ]
    if e["partition_method"] == "uniform":
        lines += [f"# the plan's split is DeepSpeed's own uniform split: {e['parts']}",
                  f"net = PipelineModule(layers=layers, {_ds_stages(e)}, partition_method='uniform')"]
    else:
        lines += [
            "class PlannedPipelineModule(PipelineModule):",
            "    \"\"\"PipelineModule with the plan's stage boundaries (stage s: layers [PARTS[s], PARTS[s+1])).\"\"\"",
            "",
            f"    PARTS = {e['parts']}",
            "",
            "    def _partition_layers(self, method='parameters'):",
            "        self.parts = list(self.PARTS)",
            "        stage = self._topo.get_coord(self.global_rank).pipe",
            "        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])",
            "",
            f"net = PlannedPipelineModule(layers=layers, {_ds_stages(e)})",
        ]
    lines += ["engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(),",
              f"                                       config={e['config']!r})",
              "loss = engine.train_batch(data_iter)   # one plan iteration: gradient_accumulation_steps micro-batches",
              "",
              f"# launch (ranks {e['rank_order']}): the hostfile in rank order, then",
              f"#   {e['launch']['deepspeed']}" if e["launch"]["deepspeed"] else
              f"#   not deepspeed's launcher: {e['launch']['deepspeed_unavailable']}; instead, on each node:",
              *(f"#   {c}" for c in e["launch"]["torchrun"])]
    return "\n".join(lines) + "\n"

