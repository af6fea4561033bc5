"""Import Sailor's per-layer LLM profiles (eth-easl/sailor) as one :class:`Profile`.

A Sailor profile directory holds one ``<GPU>.json`` per GPU type, laid out as
``{micro_batch_size: {tensor_parallel_degree: {layer_index: [fwd_s, bwd_s, update_s]}}}``,
plus ``llm_info_*.json`` (per-layer ``params_bytes``, ``act_output_bytes``,
``act_mem_bytes`` for one sample, by tensor-parallel degree) and ``training_config*.json``
(model shape). The import keeps one micro-batch size and one tensor-parallel degree and
gives one profile with measured times for every GPU type found.

GPU names are mapped to catalog names with :func:`partitioner.cluster.resolve_gpu_type`
(``A100-40`` -> ``A100-SXM4-40GB``, ``Titan-RTX`` -> ``TITAN-RTX``, ...); a name the catalog
lacks (Sailor's ``GH-96``, a Grace-Hopper 96 GB part) is kept as Sailor spells it. Sailor's
``RTX-2080`` is an 11 GiB part (its ``basic_cluster_config.json``: 11811160064 bytes per GPU), so
an RTX 2080 Ti (the RTX 2080 has 8 GiB): it is mapped to ``RTX-2080-Ti`` (:data:`SAILOR_GPU_TYPES`).

Sailor records no FLOPs; they are computed from the model shape for a GPT-style decoder:
a block does ``24 b s h^2 + 4 b s^2 h`` forward FLOPs, the head ``2 b s h V``, the
embedding one addition per element (``b s h``). Sailor's optimizer-update time per layer
becomes each layer's ``LayerTime.update_s``.

The profile's ``dtype`` is ``float16`` (mixed precision): the measured speed ratios between
GPU types follow their tensor-core peaks, not their FP32 peaks (docs/profiling.md), so
projection uses the tensor-core roof. Parameters and boundary tensors are counted at 2 bytes
per element (``params_floats``, ``act_output_floats``: what an fp16 model holds and sends);
a transformer block's saved activations follow Megatron-LM's published formula (or Sailor's
``act_mem_bytes`` with ``activations="sailor"``); docs/fidelity.md compares both with the
measured Clariden peaks. A layer time above the same layer's time at a larger measured
micro-batch is treated as noise and bounded by it (``meta.clipped_to_larger_micro_batch``). With ``tensor_parallel`` t > 1 the counts and times
are those of one of the t shards: plan a tensor-parallel group as one device.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from .._io import load_mapping
from ..cluster import resolve_gpu_type
from ..errors import FormatError
from ..profile import (
    MAX_BYTES,
    MAX_LAYER_S,
    MAX_LAYERS,
    MAX_MICRO_BATCH_SIZE,
    MAX_TENSOR_PARALLEL,
    LayerProfile,
    LayerShard,
    LayerTime,
    Profile,
)

__all__ = ["SAILOR_GPU_TYPES", "SAILOR_SKIP", "import_sailor", "import_sailor_degrees", "sailor_degrees",
           "sailor_gpu_name"]

SAILOR_SKIP = ("basic_cluster_config", "llm_info", "training_config")

# Sailor's names whose catalog part is not the one the name resolves to: Sailor's "RTX-2080"
# nodes have 11 GiB per GPU (basic_cluster_config.json: 11811160064 bytes), the RTX 2080 Ti's size.
SAILOR_GPU_TYPES = {"RTX-2080": "RTX-2080-Ti"}


def sailor_gpu_name(name: str) -> str:
    """The catalog name for a Sailor GPU name, or the Sailor name if the catalog lacks it."""
    if name in SAILOR_GPU_TYPES:
        return SAILOR_GPU_TYPES[name]
    try:
        return resolve_gpu_type(name).name
    except FormatError:
        return name


def _one(directory: Path, prefix: str) -> Path:
    found = sorted(directory.glob(f"{prefix}*.json"))
    if not found:
        raise FormatError("directory", str(directory), f"has no {prefix}*.json (a Sailor profile directory has one)")
    return found[0]


def _num(d: Any, key: str, where: str, most: float = MAX_BYTES) -> float:
    """A number in ``[0, most]``."""
    value = d.get(key) if isinstance(d, dict) else d
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= most):
        raise FormatError(f"{where}{key}", value, f"must be a number >= 0 and <= {most:g}")
    return float(value)


def _count(d: dict[str, Any], key: str, most: int) -> int:
    """A positive integer field of the model shape, at most ``most``."""
    value = d.get(key)
    if not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= most):
        raise FormatError(key, value, f"must be an integer in [1, {most:,}]")
    return value


def _times(row: Any, field: str, path: Path) -> tuple[float, float, float]:
    """``[fwd_s, bwd_s]`` or ``[fwd_s, bwd_s, update_s]``: numbers (not booleans) of seconds in [0, 1e6]."""
    if not (isinstance(row, list) and 2 <= len(row) <= 3 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= MAX_LAYER_S for v in row)):
        raise FormatError(field, row, f"must be [fwd_s, bwd_s, update_s], numbers of seconds in [0, {MAX_LAYER_S:g}]",
                          file=str(path))
    return float(row[0]), float(row[1]), float(row[2]) if len(row) > 2 else 0.0


def _int_key(k: str) -> tuple[int, str]:
    return (int(k), "") if k.isdigit() and len(k) < 19 else (2**63, k)


def _monotone(fwd: float, bwd: float, larger: list[tuple[str, Any]], layer: str, path: Path) -> tuple[float, float]:
    """A layer does not take longer on fewer samples: a time above the same layer's time at a
    larger measured micro-batch (``larger``: (field prefix, table) pairs) is measurement noise,
    and that larger time bounds it. A bound of 0 is a time below the timer's resolution and
    bounds nothing, so a measured time is never lowered to 0 (a measured 0 is kept)."""
    for where, table in larger:
        row = table.get(layer)
        if row is None:
            continue
        f, b, _ = _times(row, f"{where}.{layer}", path)
        if 0 < f < fwd:
            fwd = f
        if 0 < b < bwd:
            bwd = b
    return fwd, bwd


ACTIVATION_MODELS = ("megatron", "sailor")


def _megatron_block_bytes(seq: int, batch: int, hidden: int, heads: int, tp: int) -> float:
    """Activations a transformer block keeps for backward in fp16 under t-way tensor parallelism,
    without sequence parallelism or recomputation: ``s b h (10 + 24 / t + 5 a s / (h t))`` bytes
    (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022)."""
    return float(seq * batch * hidden * (10 + 24 / tp + 5 * heads * seq / (hidden * tp)))


def _other_sizes(data: dict[str, Any], tp: str, own: int, n_all: int, clip_noise: bool, sailor_name: str,
                 path: Path) -> dict[int, list[LayerTime]]:
    """Times of every other micro-batch size measured at degree ``tp`` on all ``n_all`` layers
    (a size measured on fewer layers is left out)."""
    sizes = sorted(int(k) for k in data if str(k).isdigit() and len(str(k)) < 19 and isinstance(data[k], dict)
                   and isinstance(data[k].get(tp), dict))
    out: dict[int, list[LayerTime]] = {}
    for size in sizes:
        if size == own or size > MAX_MICRO_BATCH_SIZE:
            continue
        table = data[str(size)][tp]
        if not all(str(i) in table for i in range(n_all)):
            continue
        larger = [(f"{x}.{tp}", data[str(x)][tp]) for x in sizes if x > size] if clip_noise else []
        rows = []
        for i in range(n_all):
            fwd0, bwd0, up = _times(table[str(i)], f"{size}.{tp}.{i}", path)
            fwd, bwd = _monotone(fwd0, bwd0, larger, str(i), path)
            rows.append(LayerTime(fwd, bwd, measured_on=sailor_name, update_s=up))
        out[size] = rows
    return out


def import_sailor(directory: str | os.PathLike[str], *, micro_batch_size: int = 1, tensor_parallel: int = 1,
                  model: str | None = None, dtype: str = "float16", activations: str = "megatron",
                  gpu_types: tuple[str, ...] = (), clip_noise: bool = True, all_sizes: bool = False) -> Profile:
    """Read a Sailor profile directory into one profile (see the module docstring).

    ``activations``: ``megatron`` prices a transformer block's saved activations with the published
    formula of Megatron-LM (:func:`_megatron_block_bytes`), ``sailor`` keeps Sailor's
    ``act_mem_bytes`` (7% lower per block at t = 4); the embedding and head keep Sailor's.
    ``gpu_types`` (Sailor's names) limits the import to those types; default: every file.
    ``clip_noise=False`` keeps every time as measured (see the module docstring). ``all_sizes``
    also keeps the times of every other micro-batch size measured at this degree on every GPU
    type (``LayerProfile.times_at``), so that micro-batch choice uses measured numbers.
    """
    if activations not in ACTIVATION_MODELS:
        raise FormatError("activations", activations, f"must be one of {', '.join(ACTIVATION_MODELS)}")
    root = Path(directory)
    if not root.is_dir():
        raise FormatError("directory", str(root), "is not a directory")
    cfg_path = _one(root, "training_config")
    cfg = load_mapping(cfg_path)
    try:
        h, s = _count(cfg, "hidden_size", 2**20), _count(cfg, "sequence_length", 2**24)
        vocab, n_all = _count(cfg, "vocab_size", 2**24), _count(cfg, "num_all_layers", MAX_LAYERS)
        heads = _count(cfg, "heads", 2**20) if activations == "megatron" else 0
    except FormatError as err:
        raise err.in_file(str(cfg_path)) from None
    name = model or str(cfg.get("model", root.name))
    info_path = _one(root, "llm_info")
    info_all = load_mapping(info_path)
    info_model = info_all.get(str(cfg.get("model")), next(iter(info_all.values()), None))
    tp = str(tensor_parallel)
    if not isinstance(info_model, dict) or tp not in info_model:
        have = sorted(info_model) if isinstance(info_model, dict) else []
        raise FormatError("tensor parallel degree", tensor_parallel,
                          f"not in {info_path.name} (has {', '.join(have)})", file=str(info_path))
    info = info_model[tp]
    if not isinstance(info, dict):
        raise FormatError(tp, info, "must be an object {layer: {params_bytes, ...}}", file=str(info_path))
    b = micro_batch_size
    elem = 2 if dtype in ("float16", "bfloat16") else 4
    gpu_files = sorted(p for p in root.glob("*.json") if not p.name.startswith(SAILOR_SKIP)
                       and (not gpu_types or p.stem in gpu_types))
    if not gpu_files:
        wanted = f" for {', '.join(gpu_types)}" if gpu_types else ""
        raise FormatError("directory", str(root), f"has no <GPU>.json profile files{wanted}")
    times, times_at, noise, names_map = _gpu_times(gpu_files, b, tp, n_all, clip_noise, all_sizes)
    layers = []
    for i in range(n_all):
        li = info.get(str(i))
        if not isinstance(li, dict):
            raise FormatError(f"{tp}.{i}", li, "missing layer info", file=str(info_path))
        if i == 0:
            lname, flops = "embed", float(b * s * h)
        elif i == n_all - 1:
            lname, flops = "head", float(2 * b * s * h * vocab)
        else:
            lname, flops = f"block{i - 1}", float(24 * b * s * h * h + 4 * b * s * s * h)
        where = f"{tp}.{i}."
        try:
            layers.append(LayerProfile(
                name=lname, flops=flops,
                param_bytes=_num(li, "params_floats", where) * elem,
                saved_bytes=(_num(li, "act_mem_bytes", where) * b if activations == "sailor" or lname[:5] != "block"
                             else _megatron_block_bytes(s, b, h, heads, tensor_parallel)),
                output_bytes=_num(li, "act_output_floats", where) * elem * b,
                times={gpu: t[i] for gpu, t in times.items()},
                times_at={size: {g: t[i] for g, t in by_gpu.items()} for size, by_gpu in times_at.items()
                          if len(by_gpu) == len(times)}))
        except FormatError as err:
            raise err.in_file(str(info_path)) from None
    meta = {"measured_on": {g: s_name for s_name, g in names_map.items()},
            "sailor_gpu_names": names_map, "tensor_parallel": tensor_parallel,
            "seq_len": s, "hidden_size": h, "vocab_size": vocab,
            "flops": "analytic: block 24bsh^2+4bs^2h, head 2bshV, embedding bsh"}
    if noise:
        meta["clipped_to_larger_micro_batch"] = noise
    return Profile(name, b, tuple(layers), dtype=dtype, source=f"sailor:{root.name}", meta=meta)


def _gpu_times(gpu_files: list[Path], b: int, tp: str, n_all: int, clip_noise: bool, all_sizes: bool
               ) -> tuple[dict[str, list[LayerTime]], dict[int, dict[str, list[LayerTime]]], dict[str, int],
                          dict[str, str]]:
    """Each GPU file's per-layer times at micro-batch ``b`` and degree ``tp`` (with ``all_sizes``,
    at every other size too), the noise clips counted per GPU type, and Sailor's name of each type."""
    times: dict[str, list[LayerTime]] = {}
    times_at: dict[int, dict[str, list[LayerTime]]] = {}
    noise: dict[str, int] = {}
    names_map: dict[str, str] = {}
    for path in gpu_files:
        sailor_name = path.stem
        gpu = sailor_gpu_name(sailor_name)
        names_map[sailor_name] = gpu
        data = load_mapping(path)
        by_tp = data.get(str(b))
        if not isinstance(by_tp, dict) or tp not in by_tp:
            have = sorted((k for k, v in data.items() if isinstance(v, dict) and tp in v), key=_int_key)
            raise FormatError(f"{b}.{tp}", None, f"no times for micro-batch {b} at tensor-parallel degree {tp}; "
                              f"micro-batch sizes with that degree: {', '.join(have) or 'none'}", file=str(path))
        per_layer = by_tp[tp]
        if not isinstance(per_layer, dict):
            raise FormatError(f"{b}.{tp}", per_layer, "must be an object {layer: [fwd_s, bwd_s, update_s]}",
                              file=str(path))
        larger = [(f"{k}.{tp}", data[k][tp]) for k in sorted(data, key=_int_key)
                  if str(k).isdigit() and b < _int_key(str(k))[0] < 2**63 and isinstance(data[k], dict) and tp in data[k]
                  and isinstance(data[k][tp], dict)]
        rows = []
        clipped = 0
        for i in range(n_all):
            fwd0, bwd0, up = _times(per_layer.get(str(i)), f"{b}.{tp}.{i}", path)
            fwd, bwd = _monotone(fwd0, bwd0, larger if clip_noise else [], str(i), path)
            clipped += (fwd, bwd) != (fwd0, bwd0)
            rows.append(LayerTime(fwd, bwd, projected=False, measured_on=sailor_name, update_s=up))
        times[gpu] = rows
        if clipped:
            noise[gpu] = clipped
        if all_sizes:
            for size, table in _other_sizes(data, tp, b, n_all, clip_noise, sailor_name, path).items():
                times_at.setdefault(size, {})[gpu] = table
    return times, times_at, noise, names_map


def sailor_degrees(directory: str | os.PathLike[str], micro_batch_size: int,
                   gpu_types: tuple[str, ...] = ()) -> dict[int, tuple[str, ...]]:
    """Tensor-parallel degree -> Sailor's GPU names with times at ``micro_batch_size`` and that
    degree on every layer's row (read from the ``<GPU>.json`` files; ``gpu_types`` limits them)."""
    root = Path(directory)
    out: dict[int, list[str]] = {}
    for path in sorted(p for p in root.glob("*.json") if not p.name.startswith(SAILOR_SKIP)
                       and (not gpu_types or p.stem in gpu_types)):
        by_tp = load_mapping(path).get(str(micro_batch_size))
        if isinstance(by_tp, dict):
            for t, rows in by_tp.items():
                if (str(t).isdigit() and len(str(t)) <= 3 and 1 <= int(t) <= MAX_TENSOR_PARALLEL
                        and isinstance(rows, dict) and rows):
                    out.setdefault(int(t), []).append(path.stem)
    return {t: tuple(v) for t, v in sorted(out.items())}


def import_sailor_degrees(directory: str | os.PathLike[str], *, micro_batch_size: int = 1,
                          gpu_types: tuple[str, ...] = (), **options: Any) -> Profile:
    """One profile with every tensor-parallel degree Sailor measured at ``micro_batch_size``: the
    layers at degree 1 (the GPU types measured there) and, for each degree t > 1, the shard of one
    GPU of a group of t (``LayerProfile.shards``: bytes per GPU, times of the GPU types measured at
    t). ``options`` are :func:`import_sailor`'s."""
    degrees = sailor_degrees(directory, micro_batch_size, gpu_types)
    if 1 not in degrees:
        sizes = sorted({int(k) for p in Path(directory).glob("*.json") if not p.name.startswith(SAILOR_SKIP)
                        for k, v in load_mapping(p).items()
                        if str(k).isdigit() and len(str(k)) < 19 and isinstance(v, dict) and "1" in v})
        raise FormatError("micro_batch_size", micro_batch_size, f"no times for micro-batch {micro_batch_size} at "
                          f"tensor-parallel degree 1 on any GPU type (degrees measured at this size: "
                          f"{', '.join(map(str, degrees)) or 'none'}); micro-batch sizes with that degree: "
                          f"{', '.join(map(str, sizes)) or 'none'}", file=str(directory))
    base = import_sailor(directory, micro_batch_size=micro_batch_size, gpu_types=degrees[1], **options)
    layers = list(base.layers)
    for t, names in degrees.items():
        if t == 1:
            continue
        shard = import_sailor(directory, micro_batch_size=micro_batch_size, tensor_parallel=t, gpu_types=names,
                              **options)
        layers = [replace(layer, shards={**layer.shards, t: LayerShard(
            x.param_bytes, x.saved_bytes, x.times, x.shared_saved_bytes, x.times_at)})
            for layer, x in zip(layers, shard.layers, strict=True)]
    meta = {k: v for k, v in base.meta.items() if k != "tensor_parallel"}
    meta["tensor_parallel_types"] = {str(t): [sailor_gpu_name(n) for n in names] for t, names in degrees.items()}
    return replace(base, layers=tuple(layers), meta=meta)
