"""``partitioner profile``: measure a zoo model, merge profiles, project to other GPU types.

    partitioner profile MODEL --micro-batch-size B [--seq-len S] [--device cpu|cuda]
                              [--gpu-type NAME ...] [--analytic] -o profile.json
    partitioner profile merge a.json b.json [...] -o merged.json
    partitioner profile project IN.json --gpu-type NAME [--gpu-type ...] -o OUT.json
    partitioner profile emulate IN.json --cluster C [--reference TYPE] -o OUT.json
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from partitioner.errors import PartitionerError
from partitioner.profile import MAX_MICRO_BATCH_SIZE, LayerProfile, Profile
from partitioner_cli._args import Renamed, bounded_float, bounded_int

__all__ = ["register"]

log = logging.getLogger(__name__)


def _degrees(text: str) -> tuple[int, ...]:
    """``2,4``: tensor-parallel degrees >= 2."""
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give degrees as T[,T...], e.g. 2,4") from None
    if not out or any(not 2 <= t <= 64 for t in out):
        raise argparse.ArgumentTypeError(f"{text!r}: each degree must be in [2, 64]")
    return tuple(dict.fromkeys(out))


def _zoo_names() -> tuple[str, ...]:
    from partitioner.zoo import MODEL_NAMES

    return MODEL_NAMES


def _build(args: argparse.Namespace, batch: int, device: str) -> Any:
    from partitioner.models import build_model

    return build_model(args.model, batch, seq_len=args.seq_len, image_size=args.image_size, vocab=args.vocab,
                       device=device)


def _stats(args: argparse.Namespace) -> list[Any]:
    """FLOPs and bytes per layer without measuring time, at the requested batch size.

    On the meta device when fvcore can trace the model there (transformers); otherwise
    (convolutions) on the CPU at batch 1, scaled linearly to the batch size.
    """
    from dataclasses import replace

    from partitioner.profiler import analyze_layers

    try:
        m = _build(args, args.batch_size, "meta")
        return analyze_layers(m.layers, m.sample_input("meta"))
    except (RuntimeError, TypeError) as exc:
        log.info("meta-device analysis failed (%s); counting at batch 1 on the CPU", str(exc).splitlines()[0])
    m = _build(args, 1, "cpu")
    b = float(args.batch_size)
    return [replace(s, flops=s.flops * b, saved_bytes=s.saved_bytes * b, output_bytes=s.output_bytes * b)
            for s in analyze_layers(m.layers, m.sample_input("cpu"))]


def _in_dtype(stats: list[Any], dtype: str) -> list[Any]:
    """Byte counts analysed in float32 (the zoo's type) converted to ``dtype``."""
    from dataclasses import replace

    scale = {"float32": 1.0, "float16": 0.5, "bfloat16": 0.5}[dtype]
    return [replace(s, param_bytes=s.param_bytes * scale, saved_bytes=s.saved_bytes * scale,
                    output_bytes=s.output_bytes * scale, shared_saved_bytes=s.shared_saved_bytes * scale)
            for s in stats]


def _memory_check(args: argparse.Namespace, device: str) -> None:
    from partitioner.models import build_model
    from partitioner.profiler import analyze_layers, available_memory_bytes

    m = build_model(args.model, args.batch_size, seq_len=args.seq_len, image_size=args.image_size, vocab=args.vocab,
                    device="meta")
    stats = analyze_layers(m.layers, m.sample_input("meta"), count_flops=False)
    stats = _in_dtype(stats, args.dtype)
    params = sum(s.param_bytes for s in stats)
    inputs = [stats[0].output_bytes, *(s.output_bytes for s in stats[:-1])]
    work = max(i + 2 * s.saved_bytes + 3 * s.output_bytes for i, s in zip(inputs, stats, strict=False))
    need = 2 * params + work
    have = available_memory_bytes(device)
    if need > have:
        raise PartitionerError(
            f"micro-batch size {args.batch_size} of {args.model} does not fit in memory: it needs about {need / 2**30:.1f} GiB on {device} "
            f"(parameters and gradients {2 * params / 2**30:.1f} GiB, largest layer {work / 2**30:.1f} GiB) "
            f"but {have / 2**30:.1f} GiB is free; use a smaller --micro-batch-size or --analytic")


def _operators(args: argparse.Namespace, names: list[str], config: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"operators": table}`` for a transformer of the zoo (its layers' operators, for the
    per-operator projection), else nothing."""
    from partitioner.projection.operators import zoo_ops

    if config is None:
        config = _build(args, 1, "meta").config
    table = zoo_ops(args.model, config, args.batch_size, names, args.dtype)
    return {} if table is None else {"operators": table.to_dict()}


def _projected(profile: Profile, targets: list[str], method: str, source: str | None, efficiency: float,
               math_mode: str | None = None) -> Profile:
    """``profile`` with projected times on ``targets``: per operator (``method`` ops, or auto when
    the profile has operators or a transformer shape), else the per-layer roofline."""
    from partitioner.projection.operator_model import has_operators, project_with_ops
    from partitioner.projection.roofline import project_profile

    if method == "auto":
        method = "ops" if has_operators(profile) else "roofline"
    if method == "ops":
        return project_with_ops(profile, targets, source=source, math_mode=math_mode)
    return project_profile(profile, targets, source=source, efficiency=efficiency)


def _profile(args: argparse.Namespace) -> int:
    from partitioner._io import check_outputs
    from partitioner.cluster import resolve_gpu_type
    from partitioner.projection.roofline import project_profile

    check_outputs({"-o": args.output}, ())
    targets = [resolve_gpu_type(g).name for g in args.gpu_type or []]
    t0 = time.perf_counter()
    if args.analytic:
        if not targets:
            raise PartitionerError("--analytic needs at least one --gpu-type to compute roofline times for")
        if getattr(args, "tensor_parallel", ()):
            raise PartitionerError("--tensor-parallel measures each block's shard; --analytic measures nothing "
                                   "(leave one out)")
        stats = _in_dtype(_stats(args), args.dtype)
        base = Profile(args.model, args.batch_size,
                       tuple(LayerProfile(s.name, s.flops, s.param_bytes, s.saved_bytes, s.output_bytes,
                                          shared_saved_bytes=s.shared_saved_bytes) for s in stats),
                       dtype=args.dtype, source="partitioner analytic (FLOPs and bytes, no timing)",
                       meta={"unsupported_ops": {s.name: s.unsupported_ops for s in stats if s.unsupported_ops},
                             "measured_on": {}, **_operators(args, [s.name for s in stats])})
        profile = project_profile(base, targets, efficiency=args.efficiency, analytic=True)
    else:
        _check_device(args)
        _memory_check(args, args.device)
        m = _build(args, args.batch_size, "cpu")
        profile = _measure(args, args.model, m.layers, m.sample_input("cpu"), targets,
                           {"config": m.config, **_operators(args, [n for n, _ in m.layers], m.config)})
        if getattr(args, "tensor_parallel", ()):  # transformers only
            profile = _shards(args, profile, m)
        profile = _with_loss(args, profile, m)
    _save(args, profile, t0)
    return 0


def _with_loss(args: argparse.Namespace, profile: Profile, m: Any) -> Profile:
    """``profile`` with the memory of the zoo model's training loss (its real task: cross-entropy
    over the vocabulary or the classes, as ``train`` runs it) on its last layer, measured on one
    micro-batch's output (partitioner/loss_memory.py)."""
    import torch

    from partitioner.profiler import half_input
    from runtime.data import with_loss_memory
    from runtime.stage import LayerChain

    half = getattr(torch, args.dtype) if args.dtype != "float32" else None
    with torch.no_grad():
        y = half_input(m.sample_input("cpu").to(torch.device(args.device)), half)
        for _, layer in m.layers:
            y = layer(y)
    return with_loss_memory(profile, LayerChain(args.model, list(m.layers), m.make_input, dict(m.config)), y)


def _shards(args: argparse.Namespace, profile: Profile, m: Any) -> Profile:
    """The profile with each degree of ``--tensor-parallel`` measured: one GPU's shard of every block
    (partitioner/shard_profiler.py; the all-reduces priced by the cost model on the cluster's links)."""
    from partitioner.models import build_model
    from partitioner.shard_profiler import profile_shards

    shards = {t: build_model(args.model, args.batch_size, seq_len=args.seq_len, vocab=args.vocab,
                             tensor_parallel=t).layers for t in args.tensor_parallel}
    blocks = [n for n, _ in m.layers if n.startswith("block")]
    return profile_shards(profile, m.layers, shards, m.sample_input("cpu"), args.device, sharded=blocks,
                          warmup=args.warmup, repeats=args.repeats)


def _profile_model_ref(args: argparse.Namespace) -> int:
    """``partitioner profile model MODULE:FUNCTION``: a user's model, the ``runtime.model.ModelSpec``
    its function returns (as ``train --model`` takes it), measured per layer on its own batches."""
    from partitioner._io import check_outputs
    from partitioner.cluster import resolve_gpu_type
    from runtime.hf import is_hf_ref
    from runtime.model import is_model_ref, load_model_spec

    check_outputs({"-o": args.output}, ())
    hf = is_hf_ref(args.ref)
    if not (hf or is_model_ref(args.ref)):
        raise PartitionerError(f"model {args.ref!r}: give MODULE:FUNCTION, a function returning a "
                               f"runtime.model.ModelSpec, or hf:TYPE?field=value&... for a transformers model "
                               f"(the zoo's models are profiled by name)")
    for flag, given in (("--analytic", args.analytic), ("--seq-len", args.seq_len and not hf),
                        ("--image-size", args.image_size), ("--vocab", args.vocab)):
        if given:
            raise PartitionerError(f"{flag}: applies to the zoo's models; your model's function sets its own "
                                   f"shapes and its batches come from its make_batch (a transformers model "
                                   f"takes --seq-len, its vocabulary as hf:TYPE?vocab_size=N)")
    targets = [resolve_gpu_type(g).name for g in args.gpu_type or []]
    t0 = time.perf_counter()
    _check_device(args)
    if hf:
        from runtime.hf import hf_spec

        spec = hf_spec(args.ref, args.seq_len)
    else:
        spec = load_model_spec(args.ref)
    sample = spec.batch(0, args.batch_size)[0]
    profile = _measure(args, args.ref, spec.layers, sample, targets, {"model_ref": args.ref})
    _save(args, profile, t0)
    return 0


def _check_device(args: argparse.Namespace) -> None:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise PartitionerError("--device cuda: torch sees no CUDA device here (use --device cpu, or --analytic)")


def _measure(args: argparse.Namespace, name: str, layers: Any, sample: Any, targets: list[str],
             meta: dict[str, Any]) -> Profile:
    """``layers`` measured per layer on ``sample`` (the first --gpu-type names the GPU measured with
    --device cuda), with the other types projected."""
    import torch

    from partitioner.profiler import profile_model

    key = None
    if args.device == "cuda" and targets:
        key, targets = targets[0], targets[1:]  # the first --gpu-type names the measured GPU
    profile = profile_model(layers, sample, args.device, model_name=name, gpu_type=key, warmup=args.warmup,
                            repeats=args.repeats, threads=args.threads, meta=meta, dtype=getattr(torch, args.dtype))
    return _projected(profile, targets, "auto", None, args.efficiency) if targets else profile


def _save(args: argparse.Namespace, profile: Profile, t0: float) -> None:
    profile.save(args.output)
    types = ", ".join(f"{g}{' (projected)' if profile.is_projected(g) else ''}" for g in profile.gpu_types)
    print(f"profiled {profile.model}: {profile.num_layers} layers, micro-batch {profile.micro_batch_size}, "
          f"times for {types} in {time.perf_counter() - t0:.1f} s -> {args.output}")


def _merge(args: argparse.Namespace) -> int:
    from partitioner._io import check_outputs
    from partitioner.merge import merge_profiles

    check_outputs({"-o": args.output}, args.inputs)
    profiles = [Profile.load(p) for p in args.inputs]
    try:
        merged = merge_profiles(profiles)
    except PartitionerError as err:
        raise PartitionerError(f"{err} (profile 1 = {args.inputs[0]})") from None
    merged.save(args.output)
    print(f"merged {len(profiles)} profiles of {merged.model}: times for {', '.join(merged.gpu_types)} "
          f"-> {args.output}")
    return 0


def _project(args: argparse.Namespace) -> int:
    from partitioner._io import check_outputs

    check_outputs({"-o": args.output}, (args.input,))
    profile = Profile.load(args.input)
    out = _projected(profile, args.gpu_type, args.method, args.source, args.efficiency, args.math)
    out.save(args.output)
    added = [g for g in out.gpu_types if g not in profile.gpu_types or profile.is_projected(g)]
    print(f"projected {out.model} to {', '.join(_expected(out, g) for g in added)} -> {args.output}")
    return 0


def _expected(profile: Profile, gpu: str) -> str:
    """``TYPE`` and, when the projection estimated them, the range of its layers' expected errors."""
    errs = [x.times[gpu].expected_error for x in profile.layers]
    known = [e for e in errs if e is not None]
    if not known:
        return gpu
    return f"{gpu} (per operator; expected error per layer {100 * min(known):.0f}-{100 * max(known):.0f} %)"


def _emulate(args: argparse.Namespace) -> int:
    from partitioner._io import check_outputs
    from partitioner.cluster import Cluster
    from partitioner.emulation import LOCAL_DEVICE, emulated_profile
    from partitioner.errors import FormatError

    check_outputs({"-o": args.output}, (args.input, args.cluster))
    profile = Profile.load(args.input)
    cluster = Cluster.load(args.cluster)
    try:
        out = emulated_profile(profile, cluster, local=args.local or LOCAL_DEVICE, reference=args.reference)
    except FormatError as err:
        raise err.in_file(args.input) from None
    out.save(args.output)
    types = [g for g in out.gpu_types if g != (args.local or LOCAL_DEVICE)]
    print(f"emulated {out.model}: times of {', '.join(types)} as this machine's {args.local or LOCAL_DEVICE} plays "
          f"them (reference {out.meta['emulated']['reference']}) -> {args.output}; plan on it, then "
          "train --emulate with the same reference")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("profile", help="measure a zoo model, merge profiles, project to other GPU types",
                            description="Measure a model of the zoo per layer (or merge/project profiles).")
    actions = parser.add_subparsers(dest="target", required=True, metavar="MODEL|model|merge|project|emulate")

    eff = argparse.ArgumentParser(add_help=False)
    eff.add_argument("--efficiency", type=bounded_float(1e-3, 1.0), default=0.5,
                     help="fraction of the roofline a GPU reaches, for analytic times and CPU-calibrated "
                          "projections (default 0.5)")

    common = argparse.ArgumentParser(add_help=False, parents=[eff])
    common.add_argument("--micro-batch-size", "--batch-size", action=Renamed, dest="batch_size",
                        type=bounded_int(1, MAX_MICRO_BATCH_SIZE), required=True, help="micro-batch size to profile")
    common.add_argument("--seq-len", type=bounded_int(1, 2**20), default=None, help="sequence length (transformers)")
    common.add_argument("--image-size", type=bounded_int(1, 2**16), default=None, help="image side in pixels (CNNs)")
    common.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to measure (default cpu)")
    common.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                        help="parameter and activation type while measuring (default float32); half types "
                             "are what mixed-precision training runs")
    common.add_argument("--vocab", type=bounded_int(2, 2**24), default=None,
                        help="vocabulary size (transformers; e.g. 50272 for OPT)")
    common.add_argument("--gpu-type", action="append", default=None, metavar="NAME",
                        help="catalog GPU type: with --device cuda the first one names the GPU measured; other "
                             "types get projected times; with --analytic, the types to compute times for")
    common.add_argument("--analytic", action="store_true",
                        help="no timing: FLOPs and bytes only, times from the roofline (marked projected)")
    common.add_argument("--warmup", type=bounded_int(0, 10_000), default=2, help="untimed runs per layer (default 2)")
    common.add_argument("--repeats", type=bounded_int(1, 10_000), default=7, help="timed runs per layer, median kept (default 7)")
    common.add_argument("--threads", type=bounded_int(1, 4096), default=None,
                        help="torch CPU threads while measuring (default: torch's); match what each training "
                             "process will get, e.g. 1 when one process per core trains")
    common.add_argument("-o", "--output", required=True, help="profile JSON to write")
    for name in _zoo_names():
        p = actions.add_parser(name, parents=[common], help=f"profile the zoo model {name}")
        p.set_defaults(func=_profile, model=name)
        if name.startswith(("gpt2", "bert")):
            p.add_argument("--tensor-parallel", type=_degrees, default=(), metavar="T[,T...]",
                           help="also measure one GPU's shard of every block at these tensor-parallel degrees "
                                "(heads and MLP units split T ways; the group's all-reduces are priced on the "
                                "cluster's links when planning)")

    up = actions.add_parser("model", parents=[common],
                            help="profile your own model: MODULE:FUNCTION returning a runtime.model.ModelSpec "
                                 "(as train --model takes it), or a transformers model hf:TYPE?field=value&...")
    up.add_argument("ref", metavar="MODULE:FUNCTION|hf:TYPE",
                    help="e.g. mypkg.models:build (importable from here), or hf:gpt2?n_layer=2&n_embd=64 (a "
                         "transformers model type built from its config class, nothing downloaded; needs the "
                         "transformers package)")
    up.set_defaults(func=_profile_model_ref)

    mp = actions.add_parser("merge", help="combine profiles of one model measured on different GPU types")
    mp.add_argument("inputs", nargs="+", help="profile JSON files of the same model")
    mp.add_argument("-o", "--output", required=True, help="merged profile JSON to write")
    mp.set_defaults(func=_merge)

    pp = actions.add_parser("project", parents=[eff], help="add projected times for other GPU types")
    pp.add_argument("input", help="profile JSON with measured times")
    pp.add_argument("--gpu-type", action="append", required=True, metavar="NAME", help="catalog GPU type")
    pp.add_argument("--source", default=None, help="measured type to project from (default: the first)")
    pp.add_argument("--method", choices=("auto", "ops", "roofline"), default="auto",
                    help="ops: per operator, with the calibration fitted on Sailor's seven GPU types "
                         "(docs/profiling.md); roofline: per layer; auto (default): ops when the profile has "
                         "operators (meta.operators) or a transformer's shape")
    pp.add_argument("--math", choices=("fp32", "tf32", "fp16", "bf16"), default=None,
                    help="how the profile's GEMMs ran (default: from its dtype; Sailor's profiles: tf32)")
    pp.add_argument("-o", "--output", required=True, help="profile JSON to write")
    pp.set_defaults(func=_project)

    ep = actions.add_parser("emulate", help="the times train --emulate plays: local times x type / reference, "
                                            "for planning the emulated cluster",
                            description="Write the emulated profile of a cluster's GPU types (docs/runtime.md, "
                                        "Emulating a heterogeneous cluster): per layer, this machine's time x the "
                                        "type's time / the reference's. Plan on it to plan for the emulated run.")
    ep.add_argument("input", help="profile JSON with this machine's times and the cluster's GPU types")
    ep.add_argument("--cluster", required=True, help="the cluster file (YAML or JSON)")
    ep.set_defaults(option_flags={"emulate_reference": "--reference", "emulate_local": "--local"})
    ep.add_argument("--reference", metavar="TYPE", default=None,
                    help="the type that runs at this machine's speed (default: the fastest of the cluster's, per layer)")
    ep.add_argument("--local", metavar="KEY", default=None, help="the profile's key of this machine's times (default cpu)")
    ep.add_argument("-o", "--output", required=True, help="profile JSON to write")
    ep.set_defaults(func=_emulate)
