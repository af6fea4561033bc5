"""The ``partitioner`` command. Each subcommand lives in ``partitioner_cli/<name>.py``
and exposes ``register(subparsers)``, which adds its parser and sets ``func``."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from partitioner import __version__
from partitioner.errors import PartitionerError
from partitioner.progress import silenced
from partitioner_cli._args import HelpFormatter, cli_message

__all__ = ["build_parser", "main", "quiet", "verbosity"]

# One module per subcommand, in the order ``--help`` lists them.
COMMAND_MODULES = (
    "partitioner_cli.bench",
    "partitioner_cli.calibrate",
    "partitioner_cli.compare",
    "partitioner_cli.explain",
    "partitioner_cli.export",
    "partitioner_cli.import_",
    "partitioner_cli.plan",
    "partitioner_cli.profile",
    "partitioner_cli.replan",
    "partitioner_cli.simulate",
    "partitioner_cli.train",
)


class _OneLineParser(argparse.ArgumentParser):
    """A bad option is one line (``PROG: error: ...``, exit 2), not the usage block. Options are
    matched whole: no abbreviations (``--micro-batch`` is not taken for ``--micro-batches``), on
    this parser and on every subcommand's (sub-parsers are of the parent's class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise PartitionerError(f"{message} (see {self.prog} --help)")


class _CommandParser(_OneLineParser):
    """A subcommand's parser: accepts ``-v/--verbose`` after the subcommand too (counted in
    ``verbose_here``, added to the count given before it), and ``-q/--quiet`` (``quiet_here``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument("-v", "--verbose", dest="verbose_here", action="count", default=argparse.SUPPRESS,
                          help="more log output (-vv: debug)")
        self.add_argument("-q", "--quiet", dest="quiet_here", action="store_true", default=argparse.SUPPRESS,
                          help="no progress lines or notes on stderr (errors and log output still appear)")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="partitioner",
        description="Partition DNN training over heterogeneous GPU clusters (pipeline + data parallel).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress lines or notes on stderr (errors and log output still appear)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_CommandParser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def verbosity(args: argparse.Namespace) -> int:
    """How many ``-v`` were given, before and after the subcommand."""
    return int(args.verbose) + int(getattr(args, "verbose_here", 0))


def quiet(args: argparse.Namespace) -> bool:
    """Whether ``-q/--quiet`` was given, before or after the subcommand."""
    return bool(getattr(args, "quiet", False) or getattr(args, "quiet_here", False))


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; returns the exit status.

    0 success, 1 infeasible (or a simulated plan that does not fit), 2 bad input (one line on
    stderr), 3 an internal error (one line; ``-v`` adds the traceback), 130 interrupted
    (Ctrl-C), 141 stdout closed early (``| head``), as a shell reports a SIGPIPE death.
    """
    command = ""
    verbose = 0
    flags: dict[str, str] = {}
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        command, verbose = args.command, verbosity(args)
        flags = getattr(args, "option_flags", {})
        level = logging.WARNING - 10 * min(verbose, 2)
        logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
        with silenced(quiet(args)):  # progress and notes off; logging unchanged
            rc = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at exit
    except PartitionerError as err:
        # Bad input and infeasible problems: one clear line, no traceback.
        print(f"{_prog(command)}: error: {cli_message(err, flags)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{_prog(command)}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _silence_stdout()
        return 141
    except (Exception, RecursionError) as exc:  # a bug: still one line, the traceback on request
        if verbose:
            logging.getLogger(__name__).exception("internal error")
        detail = " ".join(str(exc).split())[:200]
        print(f"{_prog(command)}: internal error: {type(exc).__name__}: {detail} (please report it; "
              "-v shows the traceback)", file=sys.stderr)
        return 3
    return int(rc or 0)


def _prog(command: str) -> str:
    return f"partitioner {command}" if command else "partitioner"


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # replaced by an object without a descriptor (tests)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
