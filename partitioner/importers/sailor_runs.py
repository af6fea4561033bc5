"""Sailor's measured NCCL bandwidth curves and measured training runs, as this project's files.

**Network curves** (``network_coeffs_all_homo.json``, ``intra_node_bandwidths.json``):
``{"inter"|"intra": {gpu: {gpus_per_node: [[a, b, c], max_Bps]}}}``, bandwidth in GB/s
``a x^2 + b x + c`` with ``x = log2(message bytes / 1e6)``, capped by ``max_Bps`` (bytes/s).
:func:`sailor_bandwidth` turns one entry into a :class:`partitioner.bandwidth.Bandwidth`.

**Runs** (``plan_config_*.json`` of Sailor's validation): the layers of each pipeline stage,
per stage one entry per data-parallel replica ``[[[gpu, gpus_per_node, zone]], tp]``, ``dp``,
``mbs``, ``gbs`` and the measured ``real`` seconds per iteration and ``max_mem`` bytes. Each
replica of a stage is a tensor-parallel group of ``tp`` GPUs filling one node (the ``N`` of
a run counts nodes: the timings match Sailor's ``tp = 4`` profiles, docs/fidelity.md). Such a
group is one device here, with the profile of one shard; the plan has ``dp`` virtual workers
with the run's layer cuts under 1F1B (what Megatron-DeepSpeed runs), ``gbs / (mbs * dp)``
micro-batches each, priced in fp16 mixed precision with Adam, and the nodes' links carry the
measured inter-node curve for ``tp`` GPUs per node.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._io import load_mapping
from ..bandwidth import Bandwidth
from ..cluster import GIB, Cluster, DeviceType, Node
from ..cost import CostOptions
from ..errors import FormatError, check
from ..plan import Plan, Stage, VirtualWorker
from ..profile import Profile
from .sailor import import_sailor, sailor_gpu_name

__all__ = ["MEGATRON_DEEPSPEED_RESERVED_GIB", "SailorRun", "import_sailor_run", "sailor_bandwidth"]

# The one calibrated constant: the memory Megatron-DeepSpeed itself holds on every GPU beyond
# weights, gradients, optimizer state and activations (communication buffers, workspaces,
# allocator slack). Fitted by ``bench/fidelity.py --fit`` on Sailor's 15 Clariden runs only
# (median of measured minus modelled peak): 4.81 GiB.
MEGATRON_DEEPSPEED_RESERVED_GIB = 4.8

# Published peaks of GPU types Sailor names that the built-in catalog lacks (used only to
# project times to other types; the runs are priced with Sailor's measured times).
_EXTRA_TYPES = {
    # NVIDIA GH200 Grace Hopper Superchip datasheet (H100 GPU, 96 GB HBM3 at 4 TB/s)
    "GH-96": DeviceType("GH-96", 96 * GIB, 67e12, 4000e9, 989e12, "NVIDIA GH200 datasheet (96 GB HBM3)"),
}


def sailor_bandwidth(path: str | os.PathLike[str], kind: str, gpu: str, gpus_per_node: int) -> Bandwidth:
    """One fitted curve of Sailor's network file: ``kind`` is ``inter`` or ``intra``."""
    data = load_mapping(path)
    table = data.get(kind, data) if kind in ("inter", "intra") else None
    if not isinstance(table, dict):
        raise FormatError(kind, None, "must be 'inter' or 'intra' with a table in the file", file=str(path))
    entry = table.get(gpu, {})
    row = entry.get(str(gpus_per_node)) if isinstance(entry, dict) else None
    if row is None:
        have = sorted(table) if gpu not in table else sorted(entry)
        raise FormatError(f"{kind}.{gpu}.{gpus_per_node}", None,
                          f"not in the file (it has: {', '.join(map(str, have))})", file=str(path))
    ok = (isinstance(row, list) and len(row) == 2 and isinstance(row[0], list) and len(row[0]) == 3
          and all(isinstance(c, (int, float)) for c in row[0]) and isinstance(row[1], (int, float)) and row[1] > 0)
    check(ok, f"{kind}.{gpu}.{gpus_per_node}", row, "must be [[a, b, c], max_bytes_per_s]")
    return Bandwidth(float(row[1]) / 1e9, log2_mb_poly=tuple(float(c) for c in row[0]),
                     name=f"{Path(path).name}:{kind}.{gpu}.{gpus_per_node}")


@dataclass(frozen=True)
class SailorRun:
    """A measured run as a plan, the profile and cluster to price it with, and what was measured."""

    name: str
    plan: Plan
    profile: Profile
    cluster: Cluster
    options: CostOptions
    measured_iteration_s: float
    measured_peak_bytes: float
    nodes: int


def _field(d: dict[str, Any], key: str, kind: type, file: str) -> Any:
    v = d.get(key)
    if not isinstance(v, kind) or isinstance(v, bool):
        what = "a number" if kind in (int, float, (int, float)) else getattr(kind, "__name__", str(kind))
        raise FormatError(key, v, f"must be {what}", file=file)
    return v


def import_sailor_run(plan_config: str | os.PathLike[str], profile_dir: str | os.PathLike[str],
                      network: str | os.PathLike[str], options: CostOptions | None = None,
                      activations: str = "megatron", clip_noise: bool = True) -> SailorRun:
    """Read one of Sailor's measured runs (see the module docstring); ``activations`` and
    ``clip_noise`` are passed to :func:`partitioner.importers.sailor.import_sailor`."""
    file = str(plan_config)
    cfg = load_mapping(plan_config)
    pipes = _field(cfg, "pipeline_list", list, file)
    check(len(pipes) == 1 and isinstance(pipes[0], dict), "pipeline_list", f"{len(pipes)} pipelines",
          "one pipeline (every replica cut alike) is supported")
    pipe = pipes[0]
    stages = pipe.get("layers_per_stage")
    replicas = pipe.get("tmp_per_stage")
    dp = pipe.get("dp")
    if not (isinstance(stages, list) and isinstance(replicas, list) and isinstance(dp, list)
            and len(stages) == len(replicas) == len(dp) >= 1):
        raise FormatError("pipeline_list[0]", "layers_per_stage/tmp_per_stage/dp",
                          "must be lists with one entry per stage", file=file)
    check(len(set(dp)) == 1, "pipeline_list[0].dp", dp, "every stage must have the same replica count")
    n_dp = int(dp[0])
    try:
        gpu, gpus_per_node = str(replicas[0][0][0][0][0]), int(replicas[0][0][0][0][1])
        tp = int(replicas[0][0][1])
    except (IndexError, TypeError, ValueError):
        raise FormatError("pipeline_list[0].tmp_per_stage[0][0]", replicas[0] if replicas else None,
                          "must be [[[gpu, gpus_per_node, zone]], tensor_parallel]", file=file) from None
    mbs = int(_field(cfg, "mbs", int, file))
    gbs = int(_field(cfg, "gbs", int, file))
    check(gbs % (mbs * n_dp) == 0, "gbs", gbs, f"must be a multiple of mbs x dp = {mbs * n_dp}")
    profile = import_sailor(profile_dir, micro_batch_size=mbs, tensor_parallel=tp, gpu_types=(gpu,),
                            activations=activations, clip_noise=clip_noise)
    gpu_name = sailor_gpu_name(gpu)
    extra = {gpu_name: _EXTRA_TYPES[gpu]} if gpu in _EXTRA_TYPES else {}
    n_stages = len(stages)
    nodes = tuple(Node(f"n{k * n_dp + w}", (gpu_name,), 1000.0) for k in range(n_stages) for w in range(n_dp))
    inter = sailor_bandwidth(network, "inter", gpu, min(tp, gpus_per_node))
    cluster = Cluster(f"sailor-{gpu}-{len(nodes)}x{tp}", nodes, inter.gbps, extra, inter_curve=inter)
    workers = []
    for w in range(n_dp):
        out = []
        for k, layers in enumerate(stages):
            check(isinstance(layers, list) and layers == list(range(layers[0], layers[0] + len(layers))),
                  f"pipeline_list[0].layers_per_stage[{k}]", layers, "must be consecutive layer indices")
            out.append(Stage((layers[0], layers[-1] + 1), f"n{k * n_dp + w}:0", gpu_name))
        workers.append(VirtualWorker(tuple(out)))
    opts = options or CostOptions(precision="fp16", reserved_bytes=MEGATRON_DEEPSPEED_RESERVED_GIB * GIB)
    real = float(_field(cfg, "real", (int, float), file))  # type: ignore[arg-type]
    peak = float(_field(cfg, "max_mem", (int, float), file))  # type: ignore[arg-type]
    check(math.isfinite(real) and real > 0, "real", real, "must be > 0 seconds")
    plan = Plan(profile.model, tuple(workers), "1f1b", mbs, gbs // (mbs * n_dp),
                meta={"source": f"sailor:{Path(file).name}", "tensor_parallel": tp})
    return SailorRun(Path(file).stem, plan, profile, cluster, opts, real, peak, int(cfg.get("N", len(nodes))))
