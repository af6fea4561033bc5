"""Sailor's measured NCCL bandwidth curves and measured training runs, as this project's files.

**Network curves** (``network_coeffs_all_homo.json``, ``intra_node_bandwidths.json``):
``{"inter"|"intra": {gpu: {gpus_per_node: [[a, b, c], max_Bps]}}}``, bandwidth in GB/s
``a x^2 + b x + c`` with ``x = log2(message bytes / 1e6)``, capped by ``max_Bps`` (bytes/s).
:func:`sailor_bandwidth` turns one entry into a :class:`partitioner.bandwidth.Bandwidth`.

**Runs** (``plan_config_*.json`` of Sailor's validation): the layers of each pipeline stage,
per stage one entry per data-parallel replica ``[[[gpu, gpus_per_node, zone]], tp]``, ``dp``,
``mbs``, ``gbs`` and the measured ``real`` seconds per iteration and ``max_mem`` bytes. Each
replica of a stage is a tensor-parallel group of ``tp`` GPUs (on Clariden ``tp = 4`` fills a
node; the ``N`` of a run counts nodes: the timings match Sailor's ``tp = 4`` profiles,
docs/fidelity.md). Such a group is one device here, with the profile of one shard; groups of a
GPU type fill nodes of that type, ``gpus_per_node // tp`` to a node. Replicas may be of
different GPU types. When every stage has ``dp`` replicas, replica ``d`` of every stage forms
virtual worker ``d`` (as Megatron-DeepSpeed runs them), with ``gbs / (mbs * dp)`` micro-batches;
when the counts differ, one pipeline of replicated stages takes all ``gbs / mbs``. The plan runs
1F1B in fp16 mixed precision with Adam; links between nodes carry the measured inter-node
curve of their GPU type for ``gpus_per_node`` GPUs (between two types, the slower one's), links
inside a node the intra-node curve where the file has one. Where the profile directory holds
Sailor's ``basic_cluster_config.json``, its ``mem_per_gpu`` is each type's memory (the catalog's
usable fraction of it kept where the catalog knows one).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .._io import is_finite_number, load_mapping
from ..bandwidth import Bandwidth
from ..cluster import (
    BANDWIDTH_GBPS_RANGE,
    GIB,
    MAX_GPUS,
    Cluster,
    DeviceType,
    Link,
    Node,
    device_name,
    resolve_gpu_type,
)
from ..cost import CostOptions
from ..errors import FormatError
from ..plan import MAX_MICRO_BATCHES, Plan, Stage, VirtualWorker
from ..profile import MAX_BYTES, MAX_LAYER_S, MAX_LAYERS, MAX_MICRO_BATCH_SIZE, Profile
from .sailor import import_sailor, import_sailor_degrees, sailor_gpu_name

MIXED = 0  # _Layout.tp of a run whose replicas differ in tensor-parallel degree

__all__ = ["MEGATRON_DEEPSPEED_RESERVED_GIB", "SailorRun", "import_sailor_run", "sailor_bandwidth", "sailor_cluster",
           "sailor_device_types", "shared_nic_curves"]

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
        have = sorted(map(str, table)) if not isinstance(entry, dict) or gpu not in table else sorted(entry)
        raise FormatError(f"{kind}.{gpu}.{gpus_per_node}", None,
                          f"not in the file (it has: {', '.join(have)})", file=str(path))
    lo, hi = BANDWIDTH_GBPS_RANGE
    ok = (isinstance(row, list) and len(row) == 2 and isinstance(row[0], list) and len(row[0]) == 3
          and all(is_finite_number(c) and abs(c) <= 1e12 for c in row[0]) and is_finite_number(row[1])
          and lo * 1e9 <= row[1] <= hi * 1e9)
    if not ok:
        raise FormatError(f"{kind}.{gpu}.{gpus_per_node}", row,
                          f"must be [[a, b, c], max_bytes_per_s]: finite coefficients, the cap in "
                          f"[{lo * 1e9:g}, {hi * 1e9:g}] bytes/s", file=str(path))
    return Bandwidth(float(row[1]) / 1e9, log2_mb_poly=tuple(float(c) for c in row[0]),
                     name=f"{Path(path).name}:{kind}.{gpu}.{gpus_per_node}")


def _inter_counts(path: str | os.PathLike[str], gpu: str) -> list[int]:
    """The GPUs-per-node counts Sailor's network file measured ``gpu``'s inter-node curve at, in
    rising order (empty where it has none)."""
    table = load_mapping(path).get("inter", {})
    entry = table.get(gpu, {}) if isinstance(table, dict) else {}
    return sorted(int(k) for k in entry if isinstance(k, str) and k.isdigit() and 1 <= int(k) <= MAX_GPUS) \
        if isinstance(entry, dict) else []


def shared_nic_curves(network: str | os.PathLike[str], gpu: str, gpus_per_node: int,
                      group: int = 1) -> tuple[Bandwidth, float]:
    """Sailor's inter-node curves of ``gpu`` read as a node behind one shared NIC (see
    :func:`_cluster_of`): the link of a device of ``group`` GPUs (the curve of ``group`` GPUs
    sending, its pipeline sends at one GPU's rate: ``p2p_scale``) and the NIC's GB/s (the cap with
    the node's ``gpus_per_node`` GPUs sending); each count the most measured up to it."""
    counts = _inter_counts(network, gpu)
    if not counts:
        raise FormatError("inter", [gpu], "no inter-node curve for these GPU types", file=str(network))

    def measured(gpus: int) -> Bandwidth:
        return sailor_bandwidth(network, "inter", gpu, max([k for k in counts if k <= gpus], default=counts[0]))

    one, side_by_side = measured(1), measured(group)
    flow = replace(side_by_side, p2p_scale=one.gbps / side_by_side.gbps) if side_by_side != one else one
    return flow, measured(gpus_per_node).gbps


def sailor_device_types(profile_dir: str | os.PathLike[str], names: list[str]) -> dict[str, DeviceType]:
    """The GPU types ``names`` (Sailor's spelling) as ``Cluster.device_types`` entries keyed by
    their catalog name, with the memory per GPU that Sailor's ``basic_cluster_config.json`` in
    ``profile_dir`` states (its ``mem_per_gpu``, bytes); the catalog's usable memory is scaled
    with it. Types the file does not name keep the catalog's figures (``_EXTRA_TYPES`` for
    GPUs the catalog lacks); no file: no override."""
    path = Path(profile_dir) / "basic_cluster_config.json"
    out: dict[str, DeviceType] = {}
    data = load_mapping(path) if path.exists() else {}
    for name in names:
        gpu = sailor_gpu_name(name)
        base = _EXTRA_TYPES[name] if name in _EXTRA_TYPES else _catalog_type(gpu)
        entry = data.get(name)
        if base is None or not isinstance(entry, dict) or "mem_per_gpu" not in entry:
            if base is not None and name in _EXTRA_TYPES:
                out[gpu] = base
            continue
        mem = entry["mem_per_gpu"]
        if not (is_finite_number(mem) and 0 < mem <= 1e6 * GIB):
            raise FormatError(f"{name}.mem_per_gpu", mem, "must be a number of bytes > 0", file=str(path))
        usable = base.usable_memory_bytes * mem / base.memory_bytes
        out[gpu] = replace(base, name=gpu, memory_bytes=float(mem), usable_memory_bytes=usable,
                           source=f"{base.source}; memory from Sailor's basic_cluster_config.json")
    return out


def _catalog_type(gpu: str) -> DeviceType | None:
    try:
        return resolve_gpu_type(gpu)
    except FormatError:
        return None


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


def _field(d: dict[str, Any], key: str, kind: type | tuple[type, ...], file: str) -> Any:
    v = d.get(key)
    if not isinstance(v, kind) or isinstance(v, bool):
        what = "a number" if kind in (int, float, (int, float)) else getattr(kind, "__name__", str(kind))
        raise FormatError(key, v, f"must be {what}", file=file)
    return v


def _int_field(d: dict[str, Any], key: str, file: str, least: int, most: int) -> int:
    v = d.get(key)
    if not (isinstance(v, int) and not isinstance(v, bool) and least <= v <= most):
        raise FormatError(key, v, f"must be an integer in [{least:,}, {most:,}]", file=file)
    return v


def _num_field(d: dict[str, Any], key: str, file: str, most: float, unit: str) -> float:
    """A measured figure: a finite number > 0 and at most ``most``."""
    v: Any = d.get(key)
    if not (is_finite_number(v) and 0 < v <= most):
        raise FormatError(key, v, f"must be a number of {unit} > 0 and <= {most:g} (a measured figure)", file=file)
    return float(v)


def import_sailor_run(plan_config: str | os.PathLike[str], profile_dir: str | os.PathLike[str],
                      network: str | os.PathLike[str], options: CostOptions | None = None,
                      activations: str = "megatron", clip_noise: bool = True, shared_nics: bool = True) -> SailorRun:
    """Read one of Sailor's measured runs (see the module docstring); ``activations`` and
    ``clip_noise`` are passed to :func:`partitioner.importers.sailor.import_sailor`;
    ``shared_nics`` (the default for measured runs: what Sailor's curves measure): the network as
    :func:`_cluster_of` says. Every field
    is checked, and the plan against the profile and cluster built, before it is returned: a bad
    field is one :class:`FormatError` naming the file, the field and what is valid."""
    file = str(plan_config)
    cfg = load_mapping(plan_config)
    layout = _read_layout(cfg, file)
    mbs = _int_field(cfg, "mbs", file, 1, MAX_MICRO_BATCH_SIZE)
    gbs = _int_field(cfg, "gbs", file, 1, 2**53)
    same_dp = len(set(layout.dp)) == 1
    n_dp = int(layout.dp[0]) if same_dp else 1
    _check(-(-gbs // (mbs * n_dp)) <= MAX_MICRO_BATCHES, "gbs", gbs,
           f"gives gbs / (mbs x dp) = {gbs // (mbs * n_dp):,} micro-batches per pipeline; a plan holds at most "
           f"{MAX_MICRO_BATCHES:,} (gbs at most {MAX_MICRO_BATCHES * mbs * n_dp:,})", file)
    real = _num_field(cfg, "real", file, MAX_LAYER_S, "seconds")
    peak = _num_field(cfg, "max_mem", file, MAX_BYTES, "bytes")
    if layout.tp == MIXED:  # every degree, each group priced with its own
        profile = import_sailor_degrees(profile_dir, micro_batch_size=mbs, gpu_types=tuple(layout.types),
                                        activations=activations, clip_noise=clip_noise)
    else:
        profile = import_sailor(profile_dir, micro_batch_size=mbs, tensor_parallel=layout.tp,
                                gpu_types=tuple(layout.types), activations=activations, clip_noise=clip_noise)
    placed = _place(layout)
    cluster = _cluster(network, layout, placed, sailor_device_types(profile_dir, layout.types), shared_nics)
    where = "pipeline_list[0]"
    ranges = layout.ranges
    _check(ranges[-1][1] == profile.num_layers, f"{where}.layers_per_stage[{len(ranges) - 1}]",
           layout.stages[-1], f"must end at the model's last layer, {profile.num_layers - 1} (the profile has "
           f"{profile.num_layers})", file)
    groups, device = layout.groups, placed.device
    if same_dp:  # replica d of every stage forms pipeline d (as Megatron-DeepSpeed runs them)
        workers = [VirtualWorker(tuple(Stage(r, device[(k, w)], sailor_gpu_name(groups[k][w][0]))
                                       for k, r in enumerate(ranges))) for w in range(n_dp)]
    else:  # replica counts differ by stage: one pipeline whose stages are replicated
        workers = [VirtualWorker(tuple(Stage(r, device[(k, 0)], sailor_gpu_name(groups[k][0][0]),
                                             tuple(device[(k, i)] for i in range(1, len(groups[k]))))
                                       for k, r in enumerate(ranges)))]
    opts = options or CostOptions(precision="fp16", reserved_bytes=MEGATRON_DEEPSPEED_RESERVED_GIB * GIB)
    meta: dict[str, Any] = {"source": f"sailor:{Path(file).name}"}
    if layout.tp != MIXED:
        meta["tensor_parallel"] = layout.tp
    micro_batches = -(-gbs // (mbs * n_dp))
    if micro_batches * mbs * n_dp != gbs:  # Sailor's planner splits a global batch unevenly: round up
        meta["samples_per_iteration"] = micro_batches * mbs * n_dp
    plan = Plan(profile.model, tuple(workers), "1f1b", mbs, micro_batches, meta=meta)
    try:  # what a reader checks of the three files together (every field above was checked on its own)
        plan.validate(profile, cluster)
    except FormatError as err:
        raise err.in_file(file) from None
    n_field = cfg.get("N")
    return SailorRun(Path(file).stem, plan, profile, cluster, opts, real, peak,
                     n_field if isinstance(n_field, int) and not isinstance(n_field, bool) else len(cluster.nodes))


def _check(ok: bool, field: str, value: Any, expected: str, file: str) -> None:
    if not ok:
        raise FormatError(field, value, expected, file=file)


@dataclass(frozen=True)
class _Layout:
    """A run's pipeline as its file states it: each stage's layers and range, each stage's
    replicas as (GPU type, GPUs per node, tensor-parallel degree), the replica counts, the one
    tensor-parallel degree and the GPU types in order of first use."""

    stages: list[list[int]]
    ranges: list[tuple[int, int]]
    groups: list[list[tuple[str, int, int]]]
    dp: list[int]
    tp: int
    types: list[str]


def _read_layout(cfg: dict[str, Any], file: str) -> _Layout:
    pipes = _field(cfg, "pipeline_list", list, file)
    _check(len(pipes) == 1 and isinstance(pipes[0], dict), "pipeline_list", f"{len(pipes)} pipelines",
           "one pipeline (every replica cut alike) is supported", file)
    pipe = pipes[0]
    stages, replicas, dp = pipe.get("layers_per_stage"), pipe.get("tmp_per_stage"), pipe.get("dp")
    if not (isinstance(stages, list) and isinstance(replicas, list) and isinstance(dp, list)
            and len(stages) == len(replicas) == len(dp) >= 1):
        raise FormatError("pipeline_list[0]", "layers_per_stage/tmp_per_stage/dp",
                          "must be lists with one entry per stage", file=file)
    ranges = _read_ranges(stages, file)
    groups = _read_replicas(replicas, dp, file)
    tps = sorted({tp for row in groups for _, _, tp in row})
    for row in groups:
        for gpu, gpn, tp in row:
            _check(tp <= gpn, "pipeline_list[0].tmp_per_stage", f"{gpu} at tensor-parallel degree {tp}",
                   f"a tensor-parallel group is GPUs of one node: at most gpus_per_node = {gpn}", file)
    types = list(dict.fromkeys(g for row in groups for g, _, _ in row))
    return _Layout(stages, ranges, groups, dp, tps[0] if len(tps) == 1 else MIXED, types)


def _read_ranges(stages: list[Any], file: str) -> list[tuple[int, int]]:
    """Stage ``k`` holds layers ``[start, stop)``; the stages cover the layers in order, without
    overlap or gap."""
    where = "pipeline_list[0]"
    _check(len(stages) <= MAX_LAYERS, f"{where}.layers_per_stage", f"{len(stages):,} stages",
           f"at most {MAX_LAYERS:,} (one layer each) are supported", file)
    ranges: list[tuple[int, int]] = []
    for k, layers in enumerate(stages):
        start = ranges[-1][1] if ranges else 0
        ok = (isinstance(layers, list) and 1 <= len(layers) <= MAX_LAYERS
              and all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
              and layers == list(range(layers[0], layers[0] + len(layers))))
        _check(ok, f"{where}.layers_per_stage[{k}]", layers, "must be consecutive layer indices", file)
        if layers[0] != start:
            what = (f"overlaps stage {k - 1}, which ends at layer {start - 1}" if layers[0] < start
                    else f"skips layer {start}" if layers[0] == start + 1 else f"skips layers {start}..{layers[0] - 1}")
            _check(False, f"{where}.layers_per_stage[{k}]", layers,
                   f"{what}; the stages must cover the layers in order from layer 0", file)
        ranges.append((layers[0], layers[-1] + 1))
    return ranges


def _read_replicas(replicas: list[Any], dp: list[Any], file: str) -> list[list[tuple[str, int, int]]]:
    """Per stage, per replica: (GPU type, GPUs per node, tensor-parallel degree)."""
    where = "pipeline_list[0]"
    groups: list[list[tuple[str, int, int]]] = []
    total = 0
    for k, reps in enumerate(replicas):
        count = dp[k]
        _check(isinstance(count, int) and not isinstance(count, bool) and 1 <= count <= MAX_GPUS
               and isinstance(reps, list) and len(reps) == count, f"{where}.dp[{k}]", count,
               f"must be the number of replicas listed in tmp_per_stage[{k}] (1 to {MAX_GPUS:,})", file)
        total += count
        _check(total <= MAX_GPUS, f"{where}.dp", f"{total:,} replicas or more",
               f"at most {MAX_GPUS:,} GPUs in a cluster are supported", file)
        row = []
        for i, rep in enumerate(reps):
            try:
                gpu, gpn, tp = rep[0][0][0], rep[0][0][1], rep[1]
            except (IndexError, KeyError, TypeError):
                raise FormatError(f"{where}.tmp_per_stage[{k}][{i}]", rep,
                                  "must be [[[gpu, gpus_per_node, zone]], tensor_parallel]", file=file) from None
            _check(isinstance(gpu, str) and gpu != "", f"{where}.tmp_per_stage[{k}][{i}][0][0][0]", gpu,
                   "must be a GPU type name", file)
            for name, v, at in (("gpus_per_node", gpn, "[0][0][1]"), ("tensor_parallel", tp, "[1]")):
                _check(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_GPUS,
                       f"{where}.tmp_per_stage[{k}][{i}]{at}", v,
                       f"{name} must be an integer in [1, {MAX_GPUS:,}]", file)
            row.append((gpu, gpn, tp))
        groups.append(row)
    return groups


@dataclass(frozen=True)
class _Placement:
    """Nodes (their GPU type, GPUs per node, GPUs used) and each (stage, replica)'s device."""

    node_types: list[str]
    node_gpus: list[int]
    slots: list[int]
    device: dict[tuple[int, int], str]


def _place(layout: _Layout) -> _Placement:
    """Tensor-parallel groups fill nodes of their GPU type in order. One degree for the run: a node
    holds ``gpus_per_node // tp`` groups, one device each (``NODE:SLOT``). Mixed degrees: the nodes
    are GPUs, each group takes the next ``tp`` GPUs of a node of its type (a new node when the open
    one has fewer left) and is the device ``NODE:FIRST-LAST`` of them."""
    grouped = layout.tp == MIXED
    node_types: list[str] = []
    node_gpus: list[int] = []
    slots: list[int] = []
    open_node: dict[str, int] = {}
    device: dict[tuple[int, int], str] = {}
    for k, row in enumerate(layout.groups):
        for i, (gpu, gpn, tp) in enumerate(row):
            size, room = (tp, gpn) if grouped else (1, max(1, gpn // layout.tp))
            n = open_node.get(gpu)
            if n is None or slots[n] + size > room:
                n = open_node[gpu] = len(node_types)
                node_types.append(gpu)
                node_gpus.append(gpn)
                slots.append(0)
            device[(k, i)] = device_name(f"n{n}", slots[n], tp if grouped else 1)
            slots[n] += size
    return _Placement(node_types, node_gpus, slots, device)


def sailor_cluster(network: str | os.PathLike[str], gpus: Mapping[str, int], gpus_per_node: Mapping[str, int],
                   name: str = "", profile_dir: str | os.PathLike[str] | None = None,
                   shared_nics: bool = False) -> Cluster:
    """A cluster of ``gpus`` (Sailor's GPU name -> count) on nodes of ``gpus_per_node`` of each type
    (the last node of a type holds the rest), with Sailor's measured curves as :func:`import_sailor_run`
    gives a run's nodes, and the memory sizes of ``profile_dir``'s ``basic_cluster_config.json``
    (:func:`sailor_device_types`). Single GPUs: a planner views it as tensor-parallel groups.
    ``shared_nics``: the network as :func:`_cluster_of` says (off by default here: the planners do
    not yet see how a plan's flows will share NICs, docs/fidelity.md)."""
    node_types: list[str] = []
    node_gpus: list[int] = []
    slots: list[int] = []
    for gpu, count in gpus.items():
        per = gpus_per_node.get(gpu)
        if not (isinstance(per, int) and per >= 1):
            raise FormatError(f"gpus_per_node.{gpu}", per, "must be a GPU count >= 1", file=str(network))
        if not (isinstance(count, int) and 1 <= count <= MAX_GPUS):
            raise FormatError(f"gpus.{gpu}", count, f"must be a GPU count in [1, {MAX_GPUS:,}]", file=str(network))
        for first in range(0, count, per):
            node_types.append(gpu)
            node_gpus.append(per)
            slots.append(min(per, count - first))
    extra = sailor_device_types(profile_dir, list(gpus)) if profile_dir is not None else {
        sailor_gpu_name(g): _EXTRA_TYPES[g] for g in gpus if g in _EXTRA_TYPES}
    made = _cluster_of(network, tuple(gpus), _Placement(node_types, node_gpus, slots, {}), 1, extra, shared_nics)
    return replace(made, name=name or "+".join(f"{c}x{g}" for g, c in gpus.items()))


def _cluster(network: str | os.PathLike[str], layout: _Layout, placed: _Placement,
             extra: dict[str, DeviceType], shared_nics: bool = False) -> Cluster:
    """The run's nodes (:func:`_cluster_of`)."""
    return _cluster_of(network, tuple(layout.types), placed, layout.tp, extra, shared_nics)


def _cluster_of(network: str | os.PathLike[str], types: tuple[str, ...], placed: _Placement, tp: int,
                extra: dict[str, DeviceType], shared_nics: bool = False) -> Cluster:
    """Nodes with Sailor's measured curves: each type's intra-node curve inside a node (its
    inter-node one where none is given); between two nodes of one type that type's inter-node
    curve, between nodes of two types the slower type's.

    Sailor measured the inter-node curves with 1, 2, 4 (8) GPUs of a node sending at once. Without
    ``shared_nics`` (as Sailor prices its plans) every flow between nodes runs at the curve measured
    with the node's GPU count sending. With ``shared_nics`` what those GPUs carry together is the
    node's network capacity (a GH200 node's grows with its GPUs, each behind its own NIC; an RTX
    node's stays at one NIC's): one flow runs at the curve measured with one GPU sending, and each
    node gets one shared NIC of the capacity measured with its GPU count sending (the largest
    count measured up to it), which the flows crossing it at once share (:mod:`partitioner.flows`):
    a lone flow at its own curve, ``k`` flows at most the capacity together. Where a device stands
    for a tensor-parallel group of ``tp`` GPUs (one degree for the run), its data-parallel
    collectives are ``tp`` rings side by side, one per GPU: they run on the curve measured with
    ``tp`` GPUs sending, and a pipeline send from the group at one GPU's rate (the link's
    ``p2p_scale``, the ratio of the two curves' caps)."""
    node_types, node_gpus = placed.node_types, placed.node_gpus

    def curve(kind: str, gpu: str, gpn: int) -> Bandwidth | None:
        try:
            return sailor_bandwidth(network, kind, gpu, gpn)
        except FormatError:
            return None

    if shared_nics:  # a device's flow (a group of tp GPUs: tp rings side by side, sends at one GPU's rate)
        inter_of = {g: shared_nic_curves(network, g, 1, max(tp, 1))[0] if _inter_counts(network, g) else None
                    for g in types}
    else:  # every flow at the curve of the node's GPUs sending (one GPU's where that count was not measured)
        inter_of = {g: curve("inter", g, node_gpus[node_types.index(g)]) or curve("inter", g, 1) for g in types}
    missing = [g for g, c in inter_of.items() if c is None]
    if missing:
        raise FormatError("inter", missing, "no inter-node curve for these GPU types", file=str(network))
    nodes = []
    for n, (gpu, gpn) in enumerate(zip(node_types, node_gpus, strict=True)):
        intra = curve("intra", gpu, gpn) or inter_of[gpu]
        assert intra is not None
        nic = shared_nic_curves(network, gpu, gpn)[1] if shared_nics else 0.0  # 0: every flow on its own link
        nodes.append(Node(f"n{n}", (sailor_gpu_name(gpu),) * placed.slots[n], intra.gbps, intra_curve=intra,
                          nic_gbps=nic))

    def speed(c: Bandwidth | None) -> float:
        return c.gbps_at(1e8) if c is not None else 0.0

    slowest = min(types, key=lambda g: speed(inter_of[g]))
    inter = inter_of[slowest]  # the cluster's inter-node curve: every pair not listed below
    assert inter is not None
    links: list[Link] = []
    if len(types) > 1:  # nodes of one type: its own curve; of two types: the slower type's
        for x in range(len(nodes)):
            for y in range(x + 1, len(nodes)):
                c = min(inter_of[node_types[x]], inter_of[node_types[y]], key=speed)
                assert c is not None
                if c != inter:
                    links.append(Link(f"n{x}", f"n{y}", c.gbps, c))
    return Cluster(f"sailor-{'+'.join(types)}-{len(nodes)}n-tp{tp if tp != MIXED else 'mixed'}", tuple(nodes), inter.gbps, extra,
                   tuple(links), inter_curve=inter)
