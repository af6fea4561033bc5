"""``partitioner import FORMAT ...``: other tools' profiles -> partitioner.profile/1 JSON."""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Mapping
from typing import Any

from partitioner.cluster import BANDWIDTH_GBPS_RANGE, MAX_GPUS
from partitioner.profile import MAX_MICRO_BATCH_SIZE, MAX_TENSOR_PARALLEL
from partitioner_cli._args import bounded_float, bounded_int

__all__ = ["register"]


def _degree_or_all(text: str) -> str:
    """``all`` or a tensor-parallel degree in [1, MAX_TENSOR_PARALLEL]."""
    if text == "all":
        return text
    bounded_int(1, MAX_TENSOR_PARALLEL)(text)
    return text


def _pipedream(args: argparse.Namespace) -> int:
    from partitioner._io import check_outputs
    from partitioner.importers.pipedream import import_pipedream

    check_outputs({"-o": args.output}, (args.graph,))
    profile = import_pipedream(args.graph, gpu_type=args.gpu_type, micro_batch_size=args.micro_batch_size,
                               model=args.model)
    profile.save(args.output)
    chain = all(b == a + 1 for a, b in profile.graph_edges) and len(profile.graph_edges) == profile.num_layers - 1
    kind = "chain" if chain else f"a DAG of {len(profile.graph_edges)} edges, planned as convex stages of it"
    print(f"imported {profile.model}: {profile.num_layers} layers ({kind}), micro-batch "
          f"{profile.micro_batch_size}, timed on {args.gpu_type} -> {args.output}")
    return 0


def _sailor(args: argparse.Namespace) -> int:
    from pathlib import Path

    from partitioner._io import check_outputs
    from partitioner.importers.sailor import import_sailor, import_sailor_degrees

    check_outputs({"-o": args.output}, sorted(Path(args.directory).glob("*.json")), input_dirs=(args.directory,))
    if args.tensor_parallel == "all":
        profile = import_sailor_degrees(args.directory, micro_batch_size=args.micro_batch_size, model=args.model,
                                        all_sizes=args.all_sizes)
    else:
        profile = import_sailor(args.directory, micro_batch_size=args.micro_batch_size,
                                tensor_parallel=int(args.tensor_parallel), model=args.model, all_sizes=args.all_sizes)
    profile.save(args.output)
    sizes = profile.measured_sizes
    also = f" (times also at sizes {', '.join(str(x) for x in sizes if x != profile.micro_batch_size)})" \
        if len(sizes) > 1 else ""
    degrees = profile.tensor_parallel_degrees
    shards = (f", tensor-parallel degrees {', '.join(map(str, degrees))}" if len(degrees) > 1
              else f", one shard of tensor-parallel degree {profile.meta['tensor_parallel']}"
              if profile.meta.get("tensor_parallel", 1) != 1 else "")
    print(f"imported {profile.model}: {profile.num_layers} layers, micro-batch {profile.micro_batch_size}{also}"
          f"{shards}, measured on {', '.join(profile.gpu_types)} -> {args.output}")
    _clip_note(profile.meta)
    return 0


def _clip_note(meta: Mapping[str, Any]) -> None:
    """Say how many measured times the import lowered as noise (docs/formats.md, Sailor profiles)."""
    clipped = meta.get("clipped_to_larger_micro_batch")
    if clipped:
        counts = ", ".join(f"{n} on {g}" for g, n in clipped.items())
        print(f"note: layer times above the same layer's time at a larger measured micro-batch were lowered to it "
              f"as timing noise ({counts}; meta.clipped_to_larger_micro_batch); never to 0")


def _sailor_run(args: argparse.Namespace) -> int:
    import os
    from dataclasses import replace
    from pathlib import Path

    from partitioner._io import check_loadable, check_outputs, write_json
    from partitioner.cluster import Cluster
    from partitioner.importers.sailor_runs import import_sailor_run
    from partitioner.plan import Plan, group_size
    from partitioner.profile import Profile

    check_outputs({}, [args.plan_config, args.network, *sorted(Path(args.profiles).glob("*.json"))],
                  folders={"-o": (args.output, ("plan.json", "profile.json", "cluster.json"))},
                  input_dirs=(args.profiles,))
    run = import_sailor_run(args.plan_config, args.profiles, args.network, shared_nics=args.shared_nics)
    measured = {"iteration_s": run.measured_iteration_s, "peak_memory_bytes": run.measured_peak_bytes}
    plan = replace(run.plan, pricing=run.options, meta={**run.plan.meta, "measured": measured})
    paths = [os.path.join(args.output, name) for name in ("plan.json", "profile.json", "cluster.json")]
    files = [(paths[0], plan.to_dict(), Plan.from_dict, "plan"),
             (paths[1], run.profile.to_dict(), Profile.from_dict, "profile"),
             (paths[2], run.cluster.to_dict(), Cluster.from_dict, "cluster")]
    for path, data, loader, what in files:  # all three readable before any is written
        check_loadable(path, data, loader, what)
    for path, data, _, _ in files:
        write_json(path, data)
    if "tensor_parallel" in run.profile.meta:
        groups = f"{len(run.cluster.devices)} tensor-parallel groups of {run.profile.meta['tensor_parallel']} GPUs"
    else:  # mixed degrees: the plan's devices are groups NODE:FIRST-LAST of the cluster's GPUs
        sizes = Counter(group_size(d) for vw in plan.virtual_workers for st in vw.stages for d in st.devices)
        groups = "tensor-parallel groups " + ", ".join(f"{n} of {t} GPU(s)" for t, n in sorted(sizes.items()))
    print(f"imported {run.name}: {len(plan.virtual_workers)} virtual worker(s) of "
          f"{len(plan.virtual_workers[0].stages)} stage(s), {plan.micro_batches} micro-batches of "
          f"{plan.micro_batch_size}, {groups}; measured {run.measured_iteration_s:.3f} s per "
          f"iteration, peak {run.measured_peak_bytes / 2**30:.2f} GiB -> {', '.join(paths)}")
    _clip_note(run.profile.meta)
    return 0


def _sailor_network(args: argparse.Namespace) -> int:
    from partitioner._io import check_outputs
    from partitioner.cluster import MAX_GPUS, Cluster, Node
    from partitioner.errors import PartitionerError

    check_outputs({"-o": args.output}, [p for p in (args.file, args.intra) if p])
    if args.nodes * args.gpus_per_node > MAX_GPUS:
        raise PartitionerError(f"--nodes {args.nodes} x --gpus-per-node {args.gpus_per_node} = "
                               f"{args.nodes * args.gpus_per_node:,} GPUs; at most {MAX_GPUS:,} GPUs in a cluster "
                               "are supported")
    from partitioner.importers.sailor_runs import sailor_bandwidth

    nic = 0.0
    if args.shared_nics:  # one flow at one GPU's curve; the node's GPUs share the capacity of all of them
        from partitioner.importers.sailor_runs import shared_nic_curves

        inter, nic = shared_nic_curves(args.file, args.gpu_type, args.gpus_per_node)
    else:
        inter = sailor_bandwidth(args.file, "inter", args.gpu_type, args.gpus_per_node)
    intra = sailor_bandwidth(args.intra, "intra", args.gpu_type, args.gpus_per_node) if args.intra else None
    from partitioner.importers.sailor import sailor_gpu_name

    gpu = sailor_gpu_name(args.gpu_type)
    from partitioner.importers.sailor_runs import _EXTRA_TYPES

    extra = {gpu: _EXTRA_TYPES[args.gpu_type]} if args.gpu_type in _EXTRA_TYPES else {}
    nodes = tuple(Node(f"n{i}", (gpu,) * args.gpus_per_node, intra.gbps if intra else args.intra_gbps,
                       intra_curve=intra, nic_gbps=nic) for i in range(args.nodes))
    cluster = Cluster(f"{args.gpu_type}-{args.nodes}x{args.gpus_per_node}", nodes, inter.gbps, extra,
                      inter_curve=inter)
    cluster.save(args.output)
    print(f"wrote {args.output}: {args.nodes} node(s) of {args.gpus_per_node} {gpu}, inter-node curve "
          f"{inter.gbps_at(1e8):.1f} GB/s at 100 MB (cap {inter.gbps:.1f})"
          + (f", each node's GPUs sharing one NIC of {nic:.1f} GB/s" if nic else ""))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("import", help="convert another tool's profile to this project's format")
    formats = parser.add_subparsers(dest="format", required=True, metavar="FORMAT")
    pd = formats.add_parser("pipedream", help="PipeDream profiler graph.txt")
    pd.add_argument("graph", help="PipeDream graph.txt")
    pd.add_argument("-o", "--output", required=True, help="profile JSON to write")
    pd.add_argument("--gpu-type", default="V100", help="GPU type the profile was measured on (default: V100)")
    pd.add_argument("--micro-batch-size", type=bounded_int(1, MAX_MICRO_BATCH_SIZE), default=None,
                    help="samples per profiled batch (default: derived from an ImageNet-sized input)")
    pd.add_argument("--model", default=None, help="model name (default: the file's name)")
    pd.set_defaults(func=_pipedream)
    sl = formats.add_parser("sailor", help="Sailor per-layer LLM profiles (a directory of <GPU>.json)")
    sl.add_argument("directory", help="Sailor profile directory (<GPU>.json, llm_info_*.json, training_config*.json)")
    sl.add_argument("-o", "--output", required=True, help="profile JSON to write")
    sl.add_argument("--micro-batch-size", type=bounded_int(1, MAX_MICRO_BATCH_SIZE), default=1, help="micro-batch size to import (default 1)")
    sl.add_argument("--tensor-parallel", type=_degree_or_all, default="all", metavar="T|all",
                    help="all (default): every tensor-parallel degree measured, each layer's shard per degree, so "
                         "the planner chooses; T: only the shard of degree T (a group of T GPUs planned as one device)")
    sl.add_argument("--model", default=None, help="model name (default: the training config's)")
    sl.add_argument("--all-sizes", action="store_true",
                    help="also keep the times of every other measured micro-batch size (for plan --micro-batches auto)")
    sl.set_defaults(func=_sailor)
    sr = formats.add_parser("sailor-run", help="one of Sailor's measured training runs -> plan, profile, cluster")
    sr.add_argument("plan_config", help="Sailor plan_config_*.json (with the measured 'real' and 'max_mem')")
    sr.add_argument("--profiles", required=True, help="Sailor profile directory of the run's GPU type")
    sr.add_argument("--network", required=True, help="Sailor network_coeffs_all_homo.json")
    sr.add_argument("--shared-nics", action=argparse.BooleanOptionalAction, default=True,
                    help="Sailor's network with each node's GPUs sharing one NIC of the capacity measured with them "
                         "all sending, one flow at the curve measured with one GPU sending (the default); "
                         "--no-shared-nics: every flow at the curve of the node's GPU count, as Sailor prices plans")
    sr.add_argument("-o", "--output", required=True, help="directory for plan.json, profile.json, cluster.json")
    sr.set_defaults(func=_sailor_run)
    sn = formats.add_parser("sailor-network", help="Sailor's fitted NCCL curves -> a cluster file")
    sn.add_argument("file", help="Sailor network_coeffs_all_homo.json")
    sn.add_argument("--gpu-type", required=True, help="Sailor's GPU name (GH-96, A100-40, V100-16, ...)")
    sn.add_argument("--nodes", type=bounded_int(1, MAX_GPUS), required=True, help="number of nodes")
    sn.add_argument("--gpus-per-node", type=bounded_int(1, MAX_GPUS), required=True,
                    help="GPUs per node (a key of the curves)")
    sn.add_argument("--intra", metavar="FILE", help="Sailor intra_node_bandwidths.json for the intra-node curve")
    sn.add_argument("--intra-gbps", type=bounded_float(*BANDWIDTH_GBPS_RANGE), default=100.0,
                    help="flat intra-node GB/s without --intra")
    sn.add_argument("--shared-nics", action="store_true",
                    help="one flow between nodes at the curve measured with one GPU sending, each node's GPUs sharing "
                         "one NIC of the capacity measured with them all sending (as import sailor-run by default); "
                         "default: every flow at the curve of --gpus-per-node GPUs sending")
    sn.add_argument("-o", "--output", required=True, help="cluster file to write (.yaml or .json)")
    sn.set_defaults(func=_sailor_network)
