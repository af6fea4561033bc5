"""``partitioner import FORMAT ...``: other tools' profiles -> partitioner.profile/1 JSON."""

from __future__ import annotations

import argparse

from ..profile import MAX_MICRO_BATCH_SIZE
from ._args import bounded_int

__all__ = ["register"]


def _pipedream(args: argparse.Namespace) -> int:
    from .._io import check_outputs
    from ..importers.pipedream import import_pipedream

    check_outputs({"-o": args.output}, (args.graph,))
    profile = import_pipedream(args.graph, gpu_type=args.gpu_type, micro_batch_size=args.micro_batch_size,
                               model=args.model)
    profile.save(args.output)
    kind = "DAG linearised to a chain" if profile.edges else "chain"
    print(f"imported {profile.model}: {profile.num_layers} layers ({kind}), micro-batch "
          f"{profile.micro_batch_size}, timed on {args.gpu_type} -> {args.output}")
    return 0


def _sailor(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .._io import check_outputs
    from ..importers.sailor import import_sailor

    check_outputs({"-o": args.output}, sorted(Path(args.directory).glob("*.json")))
    profile = import_sailor(args.directory, micro_batch_size=args.micro_batch_size,
                            tensor_parallel=args.tensor_parallel, model=args.model)
    profile.save(args.output)
    print(f"imported {profile.model}: {profile.num_layers} layers, micro-batch {profile.micro_batch_size}, "
          f"measured on {', '.join(profile.gpu_types)} -> {args.output}")
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
    sl.add_argument("--tensor-parallel", type=bounded_int(1, 4096), default=1, help="tensor-parallel degree to import (default 1)")
    sl.add_argument("--model", default=None, help="model name (default: the training config's)")
    sl.set_defaults(func=_sailor)
