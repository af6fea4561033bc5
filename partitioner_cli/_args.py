"""Argument types shared by the subcommands: numbers with a stated range, so a flag's bad
value is refused by argparse in one line (exit 2) before any work; and renamed options, whose
old spellings still work (:class:`Renamed`)."""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "MAX_SIMULATED_PASSES",
    "MAX_TRACED_PASSES",
    "OPTION_FLAGS",
    "HelpFormatter",
    "Renamed",
    "add_plan_inputs",
    "as_flags",
    "bounded_float",
    "bounded_int",
    "canonical_names",
    "check_simulation_size",
    "cli_message",
    "count_or_auto",
    "device_list",
]

# The most (stage, micro-batch, iteration) passes one simulation may take: at most about 5 s of the
# discrete-event simulator on one core (docs/formats.md).
MAX_SIMULATED_PASSES = 100_000
# With a trace or an image of every event: its size grows with the passes (about 0.9 kB each).
MAX_TRACED_PASSES = 20_000


def add_plan_inputs(parser: argparse.ArgumentParser) -> None:
    """The three inputs of a command that reads a saved plan: PLAN, ``--profile``, ``--cluster``."""
    parser.add_argument("plan", help="plan JSON (from `partitioner plan`)")
    parser.add_argument("--profile", required=True, help="the profile the plan was made for")
    parser.add_argument("--cluster", required=True, help="the cluster file (YAML or JSON)")


def bounded_int(least: int, most: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[least, most]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not least <= value <= most:
            raise argparse.ArgumentTypeError(f"{text} is out of range: use an integer in [{least}, {most:,}]")
        return value

    parse.__name__ = "integer"
    return parse


def bounded_float(least: float, most: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite number in ``[least, most]``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and least <= value <= most):
            raise argparse.ArgumentTypeError(f"{text} is out of range: use a number in [{least:g}, {most:g}]")
        return value

    parse.__name__ = "number"
    return parse


def check_simulation_size(plan: object, iterations: int | None, what: str, traced: bool = False) -> None:
    """Refuse a simulation of more than :data:`MAX_SIMULATED_PASSES` (stage, micro-batch, iteration)
    passes, or :data:`MAX_TRACED_PASSES` when every event is to be drawn or written (``traced``)."""
    from partitioner.errors import PartitionerError
    from partitioner.plan import Plan
    from partitioner.simulate import default_iterations

    assert isinstance(plan, Plan)
    n_iter = iterations if iterations is not None else default_iterations(plan.schedule, plan.staleness)
    stages = sum(len(st.devices) for vw in plan.virtual_workers for st in vw.stages)
    passes = stages * plan.micro_batches * n_iter
    limit = MAX_TRACED_PASSES if traced else MAX_SIMULATED_PASSES
    if passes > limit:
        traced_note = " with --trace or --png" if traced else ""
        raise PartitionerError(f"{what}: {stages} stage devices x {plan.micro_batches} micro-batches x {n_iter} "
                               f"iterations = {passes:,} simulated passes; at most {limit:,} are supported"
                               f"{traced_note} (fewer micro-batches, a lower staleness or fewer --iterations)")


# Old spelling -> the option's name, and argparse's "--name/--old" -> the name, for every option
# declared with Renamed (filled as the parsers are built).
_OLD_SPELLINGS: dict[str, str] = {}
_JOINED: dict[str, str] = {}


class Renamed(argparse._StoreAction):
    """A stored option whose first option string is its name and whose other option strings are
    old spellings: they still work, and the first use of each in a command line says once on
    stderr ``--old is deprecated; use --new``. ``--help`` shows the name only (the old spellings
    in its text), and errors name the option by its name (:func:`canonical_names`).

        parser.add_argument("--micro-batches", "--microbatches", action=Renamed, ...)
    """

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        if len(option_strings) < 2 or not all(o.startswith("--") for o in option_strings):
            raise ValueError(f"Renamed needs a --name and at least one --old-spelling, not {option_strings}")
        self.name = option_strings[0]
        self.old_spellings = tuple(option_strings[1:])
        for old in self.old_spellings:
            _OLD_SPELLINGS[old] = self.name
        _JOINED["/".join(option_strings)] = self.name
        self._warned: set[str] = set()

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if option_string in self.old_spellings and option_string not in self._warned:
            self._warned.add(option_string)
            print(f"partitioner: warning: {option_string} is deprecated; use {self.name}", file=sys.stderr)
        super().__call__(parser, namespace, values, option_string)


class HelpFormatter(argparse.HelpFormatter):
    """Shows a :class:`Renamed` option under its name, its old spellings at the end of its help."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, Renamed):
            shown = argparse.Action(option_strings=[action.name], dest=action.dest, nargs=action.nargs,
                                    metavar=action.metavar)
            return super()._format_action_invocation(shown)
        return super()._format_action_invocation(action)

    def _expand_help(self, action: argparse.Action) -> str:
        text = super()._expand_help(action)
        if isinstance(action, Renamed):
            text += f" (old spelling {', '.join(action.old_spellings)}: deprecated)"
        return text


def canonical_names(message: str) -> str:
    """``message`` with every option named by its name: argparse's ``--new/--old`` and an old
    spelling alone (in the messages of the commands) become ``--new``."""
    for joined, new in _JOINED.items():
        message = message.replace(joined, new)
    for old, new in _OLD_SPELLINGS.items():
        message = re.sub(rf"(?<![\w-]){re.escape(old)}(?![\w-])", new, message)
    return message


# The library's options by the flag that gives them: an error below the command line names an
# option by its keyword (an OptionError's field ``micro_batches``; ```micro_batches``` in any
# error's text), and the command shows the flag.
OPTION_FLAGS: dict[str, str] = {
    "solver": "--solver", "schedule": "--schedule", "devices": "--devices", "allow_fewer": "--allow-fewer",
    "chunks": "--chunks", "micro_batches": "--micro-batches", "global_batch": "--global-batch",
    "virtual_workers": "--virtual-workers", "tensor_parallel": "--tensor-parallel",
    "pipeline_parallel": "--pipeline-parallel-size", "policy": "--policy", "replication": "--replication",
    "time_limit_s": "--time-limit", "threads": "--threads", "seed": "--seed", "chain_order": "--chain-order",
    "fixed_order": "--fixed-order", "emulate": "--emulate", "emulate_rule": "--emulate-rule",
    "emulate_local": "--emulate-local", "emulate_reference": "--emulate-reference",
    "emulate_link_gbps": "--emulate-link-GBps", "emulate_links": "--emulate-links", "plan_node": "--plan-node",
    "checkpoint_dir": "--checkpoint-dir", "max_seconds": "--max-seconds", "steps": "--steps", "data": "--data",
    "device": "--device", "micro_batch_size": "--micro-batch-size", "precision": "--precision",
    "allreduce_precision": "--allreduce-precision", "optimizer": "--optimizer",
    "recompute": "--recompute", "zero": "--zero",
}
_BACKQUOTED = re.compile(r"`(\w+)`")


def cli_message(err: Exception, flags: Mapping[str, str] | None = None) -> str:
    """``err``'s line as the command line says it: an option the library names by its keyword
    (an :class:`~partitioner.errors.OptionError`'s field, or ```keyword``` in any error's text) by
    its flag (``flags``, a command's own, over :data:`OPTION_FLAGS`), and a renamed option by
    its name (:func:`canonical_names`)."""
    from partitioner.errors import FormatError, OptionError

    names = {**OPTION_FLAGS, **(flags or {})}
    text = str(err)
    if isinstance(err, OptionError) and err.field in names:
        text = str(FormatError(names[err.field], err.value, err.expected, file=err.file))
    return as_flags(text, flags)


def as_flags(text: str, flags: Mapping[str, str] | None = None) -> str:
    """``text`` (a message of the library: an infeasibility reason, a note) with every option
    written ```keyword``` named by its flag (``flags``, a command's own, over :data:`OPTION_FLAGS`)."""
    names = {**OPTION_FLAGS, **(flags or {})}
    text = _BACKQUOTED.sub(lambda m: names.get(m.group(1), m.group(0)), text)
    return canonical_names(text)


def device_list(text: str | None) -> list[str] | None:
    """``--devices a,b,c`` as a list of names (``None`` when not given); an empty name (``a,,b``,
    ``,``) is refused, not dropped."""
    from partitioner.errors import FormatError

    if text is None:
        return None
    names = [d.strip() for d in text.split(",")]
    if not all(names):
        raise FormatError("--devices", text, "must be comma-separated device names (NODE:INDEX), none empty")
    return names


def count_or_auto(text: str | None) -> int | str | None:
    """An option's ``auto|N`` text as the library takes it: ``None``, ``"auto"``, an integer, or
    the text itself when it is no integer (the library refuses it, naming the option)."""
    if text is None or text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        return text
