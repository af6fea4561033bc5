"""Errors the user sees: one line naming the file, the field, the value and what is valid."""

from __future__ import annotations

import reprlib
from typing import Any

__all__ = ["FormatError", "OptionError", "PartitionerError", "check"]


class PartitionerError(Exception):
    """Base class of every error this library raises on purpose."""


class FormatError(PartitionerError, ValueError):
    """A file or object has a field with a missing, malformed or inconsistent value.

    ``str(err)`` reads ``FILE: FIELD = VALUE: WHAT IS VALID`` (the file part only when
    the data came from a file).
    """

    _MISSING = object()

    def __init__(self, field: str, value: Any = _MISSING, expected: str = "", file: str | None = None):
        self.field = field
        self.value = value
        self.expected = expected
        self.file = file
        super().__init__(self._render())

    def _render(self) -> str:
        where = f"{self.file}: " if self.file else ""
        if not self.field:  # about the file as a whole
            return f"{where}{self.expected}"
        if self.value is FormatError._MISSING:
            what = f"{self.field} is missing"
        else:
            shown = _short_repr(self.value)
            what = f"{self.field} = {shown}"
        tail = f": {self.expected}" if self.expected else ""
        return f"{where}{what}{tail}"

    def in_file(self, file: str) -> FormatError:
        """The same error, attributed to ``file`` (kept if a file was already named)."""
        if self.file:
            return self
        return type(self)(self.field, self.value, self.expected, file=str(file))

    def under(self, prefix: str) -> FormatError:
        """The same error with ``prefix`` prepended to the field path (``layers[3].`` ...)."""
        return type(self)(f"{prefix}{self.field}", self.value, self.expected, file=self.file)


class OptionError(FormatError):
    """An option of a call (a keyword argument: ``micro_batches``) with a bad value. The library
    names the option by its keyword; the command line names it by the flag that gives it
    (``--micro-batches``). In any error's text, an option written ```keyword``` is shown the same
    way."""


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 6, 6, 4, 60, 60


def _short_repr(value: Any) -> str:
    """At most 80 characters of ``repr(value)``, in bounded time whatever its size or nesting."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        shown = f"<an integer of about {int(value.bit_length() * 0.30103) + 1} digits>"
    else:
        try:
            shown = _REPR.repr(value)
        except Exception:  # a value whose repr fails (an integer past Python's digit limit inside a list)
            shown = f"<{type(value).__name__}>"
    return shown if len(shown) <= 80 else shown[:77] + "..."


def check(condition: bool, field: str, value: Any, expected: str,
          error: type[FormatError] = FormatError) -> None:
    """Raise ``error`` (:class:`FormatError`, or :class:`OptionError` for an option) unless
    ``condition`` holds."""
    if not condition:
        raise error(field, value, expected)
