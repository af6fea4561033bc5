"""The ``partitioner`` command. Each subcommand lives in ``partitioner/commands/<name>.py``
and exposes ``register(subparsers)``, which adds its parser and sets ``func``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Any

from . import __version__
from .errors import PartitionerError

__all__ = ["build_parser", "main", "verbosity"]

# One module per subcommand, in the order ``--help`` lists them.
COMMAND_MODULES = (
    "partitioner.commands.compare",
    "partitioner.commands.explain",
    "partitioner.commands.export",
    "partitioner.commands.import_",
    "partitioner.commands.plan",
    "partitioner.commands.profile",
    "partitioner.commands.simulate",
    "partitioner.commands.train",
)


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: accepts ``-v/--verbose`` after the subcommand too (counted in
    ``verbose_here``, added to the count given before it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument("-v", "--verbose", dest="verbose_here", action="count", default=argparse.SUPPRESS,
                          help="more log output (-vv: debug)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="partitioner",
        description="Partition DNN training over heterogeneous GPU clusters (pipeline + data parallel).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_CommandParser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def verbosity(args: argparse.Namespace) -> int:
    """How many ``-v`` were given, before and after the subcommand."""
    return int(args.verbose) + int(getattr(args, "verbose_here", 0))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(verbosity(args), 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        rc = args.func(args)
    except PartitionerError as err:
        # Bad input and infeasible problems: one clear line, no traceback.
        print(f"partitioner {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"partitioner {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
