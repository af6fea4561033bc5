"""Progress of long work on stderr, for the profiler and the solvers alike.

On a terminal a tqdm bar (or status line) is drawn; on anything else (a file, a pipe) one plain
line is written at most every :data:`INTERVAL_S` seconds, e.g.::

    profile gpt2-medium: layer 12/26 (forward+backward timed), 41 s elapsed, about 48 s left

Nothing is shown before the work has run :data:`INTERVAL_S` seconds (:data:`AFTER_S` on a
terminal), so quick work stays silent. Inside ``with silenced():`` (the command's ``--quiet``)
neither progress nor :func:`note` lines are written; logging is not affected.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["AFTER_S", "INTERVAL_S", "Progress", "duration", "is_silenced", "note", "silenced"]

INTERVAL_S = 5.0  # at most one plain line this often when stderr is not a terminal
AFTER_S = 2.0  # a terminal's bar appears only once the work has run this long

_SILENCED: contextvars.ContextVar[bool] = contextvars.ContextVar("partitioner_quiet", default=False)


@contextlib.contextmanager
def silenced(quiet: bool = True) -> Iterator[None]:
    """No progress and no notes on stderr inside (``quiet`` False: no change)."""
    token = _SILENCED.set(_SILENCED.get() or quiet)
    try:
        yield
    finally:
        _SILENCED.reset(token)


def is_silenced() -> bool:
    return _SILENCED.get()


def note(text: str, file: Any = None) -> None:
    """One line on stderr (or ``file``), unless silenced."""
    if is_silenced():
        return
    out = file or sys.stderr
    print(text, file=out)
    with contextlib.suppress(Exception):
        out.flush()


def duration(seconds: float) -> str:
    """``41 s``, ``2 min``, ``1.5 h``: a rounded duration for a progress line."""
    if seconds < 90:
        return f"{max(1, round(seconds))} s" if seconds > 0 else "0 s"
    if seconds < 90 * 60:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


def _is_terminal(file: Any) -> bool:
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class Progress:
    """Progress of one piece of work named ``label``: ``update(done, text)`` as it advances
    (``done`` out of ``total`` when the work has a count), ``close()`` at the end.

    ``show`` None shows unless silenced; ``terminal`` None asks the stream. ``clock`` (seconds,
    monotonic) can be injected; ``ticking`` starts a thread that keeps the line moving between
    updates (a plain line every ``interval_s`` during one long step too). ``expected_s``, an
    estimate of the whole work's time, gives the time left before the first step is done.
    """

    def __init__(self, label: str, total: int | None = None, *, unit: str = "", file: Any = None,
                 show: bool | None = None, terminal: bool | None = None, interval_s: float = INTERVAL_S,
                 after_s: float | None = None, clock: Callable[[], float] = time.monotonic, ticking: bool = False,
                 expected_s: float | None = None):
        self.label, self.total, self.unit = label, total, unit
        self.expected_s = expected_s  # the time the whole work was estimated to take, if known
        self.file = file or sys.stderr
        self.active = (not is_silenced()) if show is None else (show and not is_silenced())
        self.terminal = _is_terminal(self.file) if terminal is None else terminal
        self.interval_s = interval_s
        self.after_s = (AFTER_S if self.terminal else interval_s) if after_s is None else after_s
        self.clock = clock
        self.done = 0
        self.text = ""
        self._start = clock()
        self._last_line: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bar: Any = None
        if self.active and self.terminal:
            from tqdm import tqdm

            if total is None:
                self._bar = tqdm(total=None, desc=label, bar_format="{desc}  [{elapsed}]", delay=self.after_s,
                                 file=self.file, leave=False, dynamic_ncols=True)
            else:
                self._bar = tqdm(total=total, desc=label, unit=unit or "it", delay=self.after_s, file=self.file,
                                 dynamic_ncols=True)
        if self.active and ticking:
            threading.Thread(target=self._tick_loop, daemon=True).start()

    # -- the plain line ---------------------------------------------------------------------
    def line(self) -> str:
        """The plain line for the current state."""
        elapsed = self.clock() - self._start
        parts = []
        if self.total is not None:
            head = f"{self.unit} {self.done}/{self.total}".strip()
            parts.append(f"{head} ({self.text})" if self.text else head)
        elif self.text:
            parts.append(self.text)
        parts.append(f"{duration(elapsed)} elapsed")
        if self.total and 0 < self.done < self.total:
            parts.append(f"about {duration(elapsed / self.done * (self.total - self.done))} left")
        elif self.done == 0 and self.expected_s is not None and self.expected_s > elapsed:
            parts.append(f"about {duration(self.expected_s - elapsed)} left")
        return f"{self.label}: {', '.join(parts)}"

    def tick(self) -> None:
        """Write a plain line if one is due (not a terminal); refresh the bar (a terminal)."""
        if not self.active:
            return
        if self._bar is not None:
            with contextlib.suppress(Exception):
                self._bar.refresh()
            return
        with self._lock:
            now = self.clock()
            if now - self._start < self.after_s:
                return
            if self._last_line is not None and now - self._last_line < self.interval_s:
                return
            self._last_line = now
            text = self.line()
        with contextlib.suppress(Exception):
            print(text, file=self.file)
            self.file.flush()

    def _tick_loop(self) -> None:
        while not self._stop.wait(0.5 if self.terminal else min(1.0, self.interval_s)):
            self.tick()

    def update(self, done: int | None = None, text: str | None = None, *, refresh: bool = True) -> None:
        """Advance to ``done`` (absolute) and/or say what is going on now (``text``)."""
        if not self.active:
            return
        if text is not None:
            self.text = text
        if self._bar is not None:
            if done is not None and self.total is not None:
                self._bar.update(done - self.done)
            if text is not None:
                if self.total is None:
                    self._bar.set_description_str(f"{self.label}  {text}", refresh=refresh)
                else:
                    self._bar.set_postfix_str(text, refresh=refresh)
        if done is not None:
            self.done = done
        if self._bar is None and refresh:
            self.tick()

    def close(self) -> None:
        self._stop.set()
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
