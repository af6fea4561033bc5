"""A status line for long solves: incumbent, bound, gap and time, on a terminal only.

Solvers report through :func:`status`; nothing is shown unless the caller asked for it with
``with shown():`` (the CLI does, when stderr is a terminal) and the solve has run for more than
:data:`AFTER_S` seconds, so quick solves, tests, pipes and library use stay silent::

    with shown():
        result = solve(...)            # a CP-SAT solve of 30 s shows, from its second second,
                                       # "cpsat  best 29.688 ms  bound 28.989 ms  gap 2.4%  [00:07]"
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["AFTER_S", "Status", "shown", "solve_cpsat", "status"]

AFTER_S = 2.0  # a solve shorter than this shows nothing
_SHOWN: contextvars.ContextVar[bool] = contextvars.ContextVar("partitioner_progress", default=False)


@contextlib.contextmanager
def shown(enabled: bool | None = None) -> Iterator[None]:
    """Show the status of the solves run inside (``enabled`` default: stderr is a terminal)."""
    token = _SHOWN.set(sys.stderr.isatty() if enabled is None else enabled)
    try:
        yield
    finally:
        _SHOWN.reset(token)


class Status:
    """One solve's line. ``update(best, bound)`` with objective values in seconds (``best`` None
    before a first solution); the line keeps its elapsed time moving between updates."""

    def __init__(self, label: str, unit_s: float = 1e-3, unit: str = "ms", *, file: Any = None,
                 after_s: float | None = None, show: bool | None = None):
        self.label, self.unit_s, self.unit = label, unit_s, unit
        self._bar: Any = None
        self.active = _SHOWN.get() if show is None else show
        self._shown_at = 0.0
        self._stop = threading.Event()
        if self.active:
            from tqdm import tqdm

            self._bar = tqdm(total=None, desc=label, bar_format="{desc}  [{elapsed}]", delay=AFTER_S if after_s is None else after_s,
                             file=file or sys.stderr, leave=False, dynamic_ncols=True)
            self._bar.set_description_str(f"{label}  searching", refresh=False)
            threading.Thread(target=self._tick, daemon=True).start()

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            with contextlib.suppress(Exception):
                self._bar.refresh()

    def update(self, best: float | None, bound: float | None) -> None:
        if self._bar is None:
            return
        parts = []
        if best is not None and math.isfinite(best):
            parts.append(f"best {best / self.unit_s:.4g} {self.unit}")
        if bound is not None and math.isfinite(bound):
            parts.append(f"bound {bound / self.unit_s:.4g} {self.unit}")
        if best and bound is not None and math.isfinite(best) and math.isfinite(bound) and best > 0:
            parts.append(f"gap {100 * max(0.0, best - bound) / best:.1f}%")
        now = time.monotonic()
        refresh = now - self._shown_at >= 0.2  # the solver may hold the GIL: refresh from here too
        self._bar.set_description_str(f"{self.label}  {'  '.join(parts) or 'searching'}", refresh=refresh)
        if refresh:
            self._shown_at = now

    def note(self, text: str) -> None:
        """Say what the solve is doing now (a phase, when there is no incumbent to show)."""
        if self._bar is not None:
            self._bar.set_description_str(f"{self.label}  {text}", refresh=True)

    def close(self) -> None:
        self._stop.set()
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Status:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def status(label: str, unit_s: float = 1e-3, unit: str = "ms") -> Status:
    """A :class:`Status` for one solve (shows nothing unless inside :func:`shown`)."""
    return Status(label, unit_s, unit)


def solve_cpsat(solver: Any, model: Any, label: str, tick_s: float) -> Any:
    """``solver.solve(model)``, its incumbents and bound (in ticks of ``tick_s`` seconds) on the
    status line when shown; the search itself is the same either way."""
    with status(label) as line:
        if not line.active:
            return solver.solve(model)
        from ortools.sat.python import cp_model

        class _Incumbents(cp_model.CpSolverSolutionCallback):
            def on_solution_callback(self) -> None:
                line.update(self.objective_value * tick_s, self.best_objective_bound * tick_s)

        if hasattr(solver, "best_bound_callback"):  # the bound also moves between solutions
            solver.best_bound_callback = lambda b: line.update(None, b * tick_s)
        return solver.solve(model, _Incumbents())
