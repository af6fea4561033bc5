"""Argument types shared by the subcommands: numbers with a stated range, so a flag's bad
value is refused by argparse in one line (exit 2) before any work."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["MAX_SIMULATED_PASSES", "MAX_TRACED_PASSES", "bounded_float", "bounded_int", "check_simulation_size"]

# The most (stage, micro-batch, iteration) passes one simulation may take: at most about 5 s of the
# discrete-event simulator on one core (docs/formats.md).
MAX_SIMULATED_PASSES = 100_000
# With a trace or an image of every event: its size grows with the passes (about 0.9 kB each).
MAX_TRACED_PASSES = 20_000


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
    from ..errors import PartitionerError
    from ..plan import Plan
    from ..simulate import default_iterations

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
