"""Check a Megatron-LM export with Megatron-Core's own code (docs/export.md, "Megatron-LM").

    python tools/megatron_check.py EXPORT.json [--build]     (megatron-core importable: a side venv)

The megatron-core package has no command-line parser (Megatron-LM's ``megatron/training/arguments.py``
is not in it), so the export's arguments are read here the way Megatron-LM hands them to the core
(``core_transformer_config_from_args``: ``--num-layers`` -> ``num_layers``, ``--pipeline-model-
parallel-layout`` -> ``pipeline_model_parallel_layout``, ``--decoder-first/last-pipeline-num-layers``
-> ``num_layers_in_first/last_pipeline_stage``, ``--fp16``/``--bf16``, the optimizer's flags ->
``OptimizerConfig``) and then checked by Megatron-Core itself:

* ``TransformerConfig`` validates them (its ``__post_init__``; the layout through
  ``PipelineParallelLayerLayout``);
* ``get_num_layers_to_build`` / ``get_transformer_layer_offset`` give, for every pipeline rank and
  virtual stage, the transformer layers Megatron builds: they must be the export's;
* ``RankGenerator`` (the rank order of ``initialize_model_parallel``: ``tp-cp-ep-dp-pp``, or
  ``tp-cp-ep-pp-dp`` with ``--use-tp-pp-dp-mapping``) gives the pipeline groups: each must be one
  virtual worker's devices in stage order (one per tensor-parallel index), by the export's rank -> GPU
  table, and the tensor-parallel groups: each one plan device's GPUs;
* ``OptimizerConfig`` takes the optimizer, learning rate, weight decay and precision;
* with ``--build``: ``pp x dp x tp`` gloo processes on this CPU run ``initialize_model_parallel`` with the
  export's sizes and order and build Megatron-Core's ``GPTModel`` (local layer spec, CPU
  initialisation) on every rank; each rank's built decoder layers (and whether it holds the
  embedding and the output layer) must be its stages' layers.

Prints one line per check and exits 1 at the first that fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

_CONFIG_FLAGS = {"--num-layers": ("num_layers", int), "--pipeline-model-parallel-size": ("pipeline_model_parallel_size", int),
                 "--tensor-model-parallel-size": ("tensor_model_parallel_size", int),
                 "--num-virtual-stages-per-pipeline-rank": ("num_virtual_stages_per_pipeline_rank", int),
                 "--pipeline-model-parallel-layout": ("pipeline_model_parallel_layout", str),
                 "--decoder-first-pipeline-num-layers": ("num_layers_in_first_pipeline_stage", int),
                 "--decoder-last-pipeline-num-layers": ("num_layers_in_last_pipeline_stage", int)}
_SWITCHES = {"--fp16": "fp16", "--bf16": "bf16", "--grad-reduce-in-bf16": "grad_reduce_in_bf16",
             "--use-tp-pp-dp-mapping": "use_tp_pp_dp_mapping"}
_OTHER = {"--micro-batch-size": int, "--global-batch-size": int, "--optimizer": str, "--lr": float,
          "--weight-decay": float, "--adam-beta1": float, "--adam-beta2": float, "--adam-eps": float,
          "--sgd-momentum": float, "--initial-loss-scale": float, "--loss-scale-window": float, "--hysteresis": int}


def parse_args(args: Sequence[str]) -> dict[str, Any]:
    """The export's Megatron-LM arguments as ``{dest: value}`` (Megatron-LM's dest names); an
    argument it does not know is refused."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        flag = args[i]
        if flag in _SWITCHES:
            out[_SWITCHES[flag]] = True
            i += 1
            continue
        if flag in _CONFIG_FLAGS:
            dest, kind = _CONFIG_FLAGS[flag]
        elif flag in _OTHER:
            dest, kind = flag[2:].replace("-", "_"), _OTHER[flag]
        else:
            raise SystemExit(f"unknown Megatron-LM argument {flag}")
        out[dest] = kind(args[i + 1])
        i += 2
    return out


def transformer_config(a: Mapping[str, Any], hidden: int, heads: int) -> Any:
    """Megatron-Core's TransformerConfig of the arguments (as Megatron-LM's
    core_transformer_config_from_args fills it), validated by its own __post_init__."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    vpp = a.get("num_virtual_stages_per_pipeline_rank")
    return TransformerConfig(
        num_layers=a["num_layers"], hidden_size=hidden, num_attention_heads=heads,
        pipeline_model_parallel_size=a["pipeline_model_parallel_size"],
        tensor_model_parallel_size=a.get("tensor_model_parallel_size", 1),
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        pipeline_model_parallel_layout=a.get("pipeline_model_parallel_layout"),
        num_layers_in_first_pipeline_stage=a.get("num_layers_in_first_pipeline_stage"),
        num_layers_in_last_pipeline_stage=a.get("num_layers_in_last_pipeline_stage"),
        fp16=bool(a.get("fp16")), bf16=bool(a.get("bf16")),
        params_dtype=torch.float16 if a.get("fp16") else torch.bfloat16 if a.get("bf16") else torch.float32,
        pipeline_dtype=torch.float16 if a.get("fp16") else torch.bfloat16 if a.get("bf16") else torch.float32,
        use_cpu_initialization=True)


def layers_by_stage(config: Any, pp: int, v: int) -> list[list[int]]:
    """Megatron-Core's transformer layer ids of every stage ``c * pp + d`` (virtual stage ``c`` of
    pipeline rank ``d``)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    out = []
    # the functions read the pipeline sizes and rank from parallel_state (the layout path does not
    # take pp_rank): set them as initialize_model_parallel would on that rank
    parallel_state.set_pipeline_model_parallel_world_size(pp)
    parallel_state.set_virtual_pipeline_model_parallel_world_size(v if v > 1 else None)
    try:
        for c in range(v):
            for d in range(pp):
                vp = c if v > 1 else None
                parallel_state.set_pipeline_model_parallel_rank(d)
                n = get_num_layers_to_build(config, vp_stage=vp, pp_rank=d)
                off = get_transformer_layer_offset(config, vp_stage=vp, pp_rank=d)
                out.append(list(range(off, off + n)))
    finally:
        parallel_state.set_pipeline_model_parallel_world_size(None)
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
        parallel_state.set_pipeline_model_parallel_rank(None)
    return out


def expected_layers(export: Mapping[str, Any]) -> list[list[int]]:
    counts = export["transformer_layers_per_stage"]
    starts = [sum(counts[:k]) for k in range(len(counts))]
    return [list(range(s, s + n)) for s, n in zip(starts, counts)]


def rank_groups(export: Mapping[str, Any], mapping: bool, axis: str) -> list[list[int]]:
    """Megatron-Core's groups along ``axis`` (``pp``: pipelines, ``tp``: tensor-parallel groups)."""
    from megatron.core.parallel_state import RankGenerator

    pp, dp, tp = export["pipeline_parallel"], export["data_parallel"], export.get("tensor_parallel", 1)
    order = "tp-cp-ep-pp-dp" if mapping else "tp-cp-ep-dp-pp"
    return [list(g) for g in RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=order).get_ranks(axis)]


def check(export: Mapping[str, Any], hidden: int = 64, heads: int = 2) -> list[str]:
    """Every check but the build; returns the lines it printed, raises SystemExit on a failure."""
    from megatron.core.optimizer import OptimizerConfig

    lines = []
    for key in ("layout_args", "uneven_args"):
        args = export.get(key)
        if args is None:
            lines.append(f"{key}: none ({export.get('uneven_args_unavailable')})")
            continue
        a = parse_args(args)
        config = transformer_config(a, hidden, heads)
        got = layers_by_stage(config, a["pipeline_model_parallel_size"], export["virtual_stages_per_rank"])
        want = expected_layers(export)
        if got != want:
            raise SystemExit(f"{key}: Megatron-Core builds transformer layers {got} per stage, the plan {want}")
        lines.append(f"{key}: TransformerConfig accepted; Megatron-Core builds layers "
                     f"{[f'{s[0]}-{s[-1]}' if s else '-' for s in got]} per stage = the plan's")
    a = parse_args(export["layout_args"])
    lines.extend(_check_groups(export, bool(a.get("use_tp_pp_dp_mapping"))))
    opt = OptimizerConfig(optimizer=a["optimizer"], lr=a["lr"], weight_decay=a["weight_decay"],
                          fp16=bool(a.get("fp16")), bf16=bool(a.get("bf16")),
                          adam_beta1=a.get("adam_beta1", 0.9), adam_beta2=a.get("adam_beta2", 0.999),
                          adam_eps=a.get("adam_eps", 1e-8), sgd_momentum=a.get("sgd_momentum", 0.9),
                          initial_loss_scale=a.get("initial_loss_scale", 2**32),
                          loss_scale_window=a.get("loss_scale_window", 1000), hysteresis=a.get("hysteresis", 2))
    lines.append(f"OptimizerConfig: {opt.optimizer}, lr {opt.lr:g}, weight decay {opt.weight_decay:g}, "
                 f"fp16 {opt.fp16}, bf16 {opt.bf16}")
    return lines


def _check_groups(export: Mapping[str, Any], mapping: bool) -> list[str]:
    """RankGenerator's pipeline groups (one per data-parallel rank and tensor-parallel index) and
    tensor-parallel groups, by the export's rank -> GPU table, against the plan's."""
    gpu = {r["rank"]: r.get("gpu", r["device"]) for r in export["ranks"]}
    pp = export["pipeline_parallel"]
    by_pipe: dict[tuple[int, int], dict[int, str]] = {}
    by_group: dict[str, list[str]] = {}
    for r in sorted(export["ranks"], key=lambda r: r["rank"]):
        by_pipe.setdefault((r["data_parallel_rank"], r.get("tp_rank", 0)), {})[r["pipeline_rank"]] = gpu[r["rank"]]
        by_group.setdefault(r["device"], []).append(gpu[r["rank"]])
    plan_pipes = sorted([ws[d] for d in range(pp)] for ws in by_pipe.values())
    order = "tp-cp-ep-pp-dp" if mapping else "tp-cp-ep-dp-pp"
    groups = rank_groups(export, mapping, "pp")
    got = sorted([gpu[r] for r in g] for g in groups)
    if got != plan_pipes:
        raise SystemExit(f"RankGenerator's pipeline groups run on {got}; the plan's pipelines are {plan_pipes}")
    lines = [f"RankGenerator ({order}): pipeline groups {groups} = the plan's pipelines {plan_pipes}"]
    if export.get("tensor_parallel", 1) > 1:
        tp_groups = rank_groups(export, mapping, "tp")
        got = sorted([gpu[r] for r in g] for g in tp_groups)
        want = sorted(by_group.values())
        if got != want:
            raise SystemExit(f"RankGenerator's tensor-parallel groups run on {got}; the plan's groups are {want}")
        lines.append(f"RankGenerator ({order}): tensor-parallel groups {tp_groups} = the plan's groups "
                     f"{sorted(by_group)}")
    return lines


def _build_rank(rank: int, world: int, export: Mapping[str, Any], port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    a = parse_args(export["layout_args"])
    v = export["virtual_stages_per_rank"]
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=a.get("tensor_model_parallel_size", 1),
        pipeline_model_parallel_size=a["pipeline_model_parallel_size"],
        virtual_pipeline_model_parallel_size=v if v > 1 else None,
        order="tp-cp-ep-pp-dp" if a.get("use_tp_pp_dp_mapping") else "tp-cp-ep-dp-pp")
    config = transformer_config({**a, "fp16": False, "bf16": False}, 64, 2)  # built in fp32 on the CPU
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    built = []
    for c in range(v):
        vp = c if v > 1 else None
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
        model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=512, max_sequence_length=64,
                         pre_process=first, post_process=last, vp_stage=vp)
        layers = [int(layer.layer_number) - 1 for layer in model.decoder.layers]
        # the rows of the fused qkv this rank holds (3 x hidden / tensor-parallel size when sharded)
        qkv = [tuple(layer.self_attention.linear_qkv.weight.shape) for layer in model.decoder.layers]
        built.append({"stage": c * a["pipeline_model_parallel_size"] + pp_rank, "layers": layers,
                      "embedding": hasattr(model, "embedding"), "output_layer": hasattr(model, "output_layer"),
                      "params": sum(p.numel() for p in model.parameters()), "qkv": qkv})
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump({"rank": rank, "pp_rank": pp_rank, "tp_rank": tp_rank, "built": built}, f)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    del torch


def build(export: Mapping[str, Any]) -> list[str]:
    """Megatron-Core's GPTModel built on every rank of the export (gloo, CPU); checks each rank's
    stages against the export's."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    world = export["world_size"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    want = expected_layers(export)
    n_stages = len(want)
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_build_rank, args=(world, dict(export), port, tmp), nprocs=world, start_method="spawn")
        for r in export["ranks"]:
            with open(os.path.join(tmp, f"rank{r['rank']}.json"), encoding="utf-8") as f:
                got = json.load(f)
            if got["pp_rank"] != r["pipeline_rank"] or got["tp_rank"] != r.get("tp_rank", 0):
                raise SystemExit(f"rank {r['rank']}: Megatron made it pipeline rank {got['pp_rank']}, tensor-parallel "
                                 f"rank {got['tp_rank']}; the export {r['pipeline_rank']}, {r.get('tp_rank', 0)}")
            tp = export.get("tensor_parallel", 1)
            for b in got["built"]:
                if any(rows != 3 * 64 // tp for rows, _ in b["qkv"]):
                    raise SystemExit(f"rank {r['rank']} stage {b['stage']}: fused qkv of shape {b['qkv']}, not "
                                     f"{3 * 64 // tp} rows (3 x hidden 64 / tensor parallel {tp})")
            for b in got["built"]:
                s = b["stage"]
                if b["layers"] != want[s] or b["embedding"] != (s == 0) or b["output_layer"] != (s == n_stages - 1):
                    raise SystemExit(f"rank {r['rank']} stage {s}: Megatron built {b}, the plan {want[s]}")
            lines.append(f"rank {r['rank']} ({r.get('gpu', r['device'])}): pipeline rank {got['pp_rank']}"
                         + (f", tensor-parallel rank {got['tp_rank']} of {r['device']}" if tp > 1 else "")
                         + ", GPTModel built "
                         + "; ".join(f"stage {b['stage']}: layers {b['layers']}"
                                     + (" + embedding" if b["embedding"] else "")
                                     + (" + output layer" if b["output_layer"] else "")
                                     + (f", qkv {b['qkv'][0][0]} x {b['qkv'][0][1]}" if tp > 1 and b["qkv"] else "")
                                     + f" ({b['params']:,} parameters)" for b in got["built"]))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", help="a megatron export (partitioner export --to megatron)")
    ap.add_argument("--build", action="store_true", help="also build GPTModel on pp x dp x tp gloo processes")
    args = ap.parse_args(argv)
    with open(args.export, encoding="utf-8") as f:
        export = json.load(f)
    import megatron.core

    print(f"megatron-core {megatron.core.__version__}")
    for line in check(export):
        print(line)
    if args.build:
        for line in build(export):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
