"""A status line for long solves: incumbent, bound, gap and time, on stderr.

Solvers report through :func:`status`; nothing is shown unless the caller asked for it with
``with shown():`` (the CLI does, unless ``--quiet``), so tests and library use stay silent. It is
drawn by :class:`partitioner.progress.Progress`: on a terminal a status line once the solve has
run :data:`AFTER_S` seconds; otherwise a plain line every :data:`partitioner.progress.INTERVAL_S`
seconds once it has run that long::

    with shown():
        result = solve(...)            # a CP-SAT solve of 30 s shows, from its second second,
                                       # "cpsat  best 29.688 ms  bound 28.989 ms  gap 2.4%  [00:07]"
                                       # (not a terminal: "cpsat: best 29.69 ms  bound ..., 10 s elapsed")
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import time
from collections.abc import Iterator
from typing import Any

from partitioner.progress import AFTER_S, Progress, is_silenced

__all__ = ["AFTER_S", "Status", "shown", "solve_cpsat", "status"]

_SHOWN: contextvars.ContextVar[bool] = contextvars.ContextVar("partitioner_progress", default=False)
# the line of the outermost status open in this context: a solve inside another (a planner's
# candidate, a model inside a search) says what it does on that line, under its own label
_OPEN: contextvars.ContextVar[Any] = contextvars.ContextVar("partitioner_open_status", default=None)


class _Within:
    """The part of an outer status line an inner solve writes: its label, then its text."""

    def __init__(self, outer: Any, label: str):
        self.outer, self.label = outer, label
        self.active, self._bar = outer.active, None

    def update(self, text: str | None = None, *, refresh: bool = True) -> None:
        self.outer.update(text=f"{self.label}: {text}" if self.label else text, refresh=refresh)

    def close(self) -> None:
        pass


@contextlib.contextmanager
def shown(enabled: bool | None = None) -> Iterator[None]:
    """Show the status of the solves run inside (``enabled`` default: unless silenced)."""
    token = _SHOWN.set(not is_silenced() if enabled is None else enabled)
    try:
        yield
    finally:
        _SHOWN.reset(token)


class Status:
    """One solve's line. ``update(best, bound)`` with objective values in seconds (``best`` None
    before a first solution); the line keeps its elapsed time moving between updates."""

    def __init__(self, label: str, unit_s: float = 1e-3, unit: str = "ms", *, file: Any = None,
                 after_s: float | None = None, show: bool | None = None, terminal: bool | None = None,
                 clock: Any = None):
        self.label, self.unit_s, self.unit = label, unit_s, unit
        active = _SHOWN.get() if show is None else show
        self._shown_at = 0.0
        self._token: Any = None
        outer = _OPEN.get() if show is None else None
        self._line: Any
        if outer is not None and active:  # one line for the whole command, its clock running on
            self._line = _Within(outer, label)
        else:
            self._line = Progress(label, file=file, show=active, terminal=terminal, after_s=after_s, ticking=True,
                                  **({"clock": clock} if clock is not None else {}))
            if self._line.active and show is None:
                self._token = _OPEN.set(self._line)
        self.active = self._line.active
        self._bar: Any = self._line._bar
        if self.active:
            self._line.update(text="searching", refresh=False)

    def update(self, best: float | None, bound: float | None) -> None:
        if not self.active:
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
        self._line.update(text="  ".join(parts) or "searching", refresh=refresh)
        if refresh:
            self._shown_at = now

    def note(self, text: str) -> None:
        """Say what the solve is doing now (a phase, when there is no incumbent to show)."""
        if self.active:
            self._line.update(text=text)

    def close(self) -> None:
        self._line.close()
        self._bar = None
        if self._token is not None:
            with contextlib.suppress(ValueError):  # (closed in another context than it was opened in)
                _OPEN.reset(self._token)
            self._token = None

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
