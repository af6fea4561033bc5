"""``partitioner import FORMAT ...``: other tools' profiles -> partitioner.profile/1 JSON."""

from __future__ import annotations

import argparse

__all__ = ["register"]


def _pipedream(args: argparse.Namespace) -> int:
    from ..importers.pipedream import import_pipedream

    profile = import_pipedream(args.graph, gpu_type=args.gpu_type, micro_batch_size=args.micro_batch_size,
                               model=args.model)
    profile.save(args.output)
    kind = "DAG linearised to a chain" if profile.edges else "chain"
    print(f"imported {profile.model}: {profile.num_layers} layers ({kind}), micro-batch "
          f"{profile.micro_batch_size}, timed on {args.gpu_type} -> {args.output}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("import", help="convert another tool's profile to this project's format")
    formats = parser.add_subparsers(dest="format", required=True, metavar="FORMAT")
    pd = formats.add_parser("pipedream", help="PipeDream profiler graph.txt")
    pd.add_argument("graph", help="PipeDream graph.txt")
    pd.add_argument("-o", "--output", required=True, help="profile JSON to write")
    pd.add_argument("--gpu-type", default="V100", help="GPU type the profile was measured on (default: V100)")
    pd.add_argument("--micro-batch-size", type=int, default=None,
                    help="samples per profiled batch (default: derived from an ImageNet-sized input)")
    pd.add_argument("--model", default=None, help="model name (default: the file's name)")
    pd.set_defaults(func=_pipedream)
