"""Reading and writing the project's files: JSON/YAML in, atomic JSON out, typed field access."""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from .errors import FormatError

__all__ = [
    "atomic_write_bytes",
    "atomic_write_text",
    "load_mapping",
    "opt_field",
    "req_field",
    "req_number",
    "write_json",
]

T = TypeVar("T")


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one.

    The data goes to a temporary file in the same directory, is flushed to disk, and is
    renamed over the target: an interrupted run never leaves a truncated file. The file gets
    the mode a plain ``open()`` would give it, or keeps the mode of the file it replaces.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        try:  # mkstemp makes the file private (0600)
            mode = target.stat().st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o666 & ~_umask()
        os.chmod(tmp, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """:func:`atomic_write_bytes` of ``text`` in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    """Atomically write ``data`` as indented JSON."""
    atomic_write_text(path, json.dumps(data, indent=1) + "\n")


def load_mapping(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a JSON or YAML file whose top level is a mapping; errors name the file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FormatError("", expected="no such file", file=str(p)) from None
    except OSError as exc:
        raise FormatError("", expected=f"cannot be read ({exc.strerror})", file=str(p)) from None
    try:
        if p.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # json.JSONDecodeError, yaml.YAMLError
        kind = "YAML" if p.suffix.lower() in (".yaml", ".yml") else "JSON"
        detail = " ".join(str(exc).split())
        raise FormatError("", expected=f"not valid {kind}: {detail}", file=str(p)) from None
    if not isinstance(data, Mapping):
        raise FormatError("top level", type(data).__name__, "must be a mapping (object)", file=str(p))
    return dict(data)


def req_field(d: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str = "") -> Any:
    """``d[key]``, which must exist and be an instance of ``kind``."""
    field = f"{where}{key}"
    if key not in d:
        raise FormatError(field)
    value = d[key]
    if isinstance(value, bool) and kind is not bool and (kind in (int, float) or kind == (int, float)):
        raise FormatError(field, value, "must be a number, not a boolean")
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise FormatError(field, value, f"must be of type {names}")
    return value


def opt_field(d: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: T, where: str = "") -> Any:
    """``d[key]`` if present (type-checked as in :func:`req_field`), else ``default``."""
    if key not in d or d[key] is None:
        return default
    return req_field(d, key, kind, where)


def req_number(
    d: Mapping[str, Any],
    key: str,
    where: str = "",
    *,
    minimum: float | None = 0.0,
    strict: bool = False,
    default: float | None = None,
) -> float:
    """A finite number field, at least ``minimum`` (greater if ``strict``), as written (int or float)."""
    field = f"{where}{key}"
    if default is not None and (key not in d or d[key] is None):
        return default
    value = req_field(d, key, (int, float), where)
    if not math.isfinite(value):
        raise FormatError(field, value, "must be a finite number")
    if minimum is not None:
        if strict and not value > minimum:
            raise FormatError(field, value, f"must be > {minimum:g}")
        if not strict and not value >= minimum:
            raise FormatError(field, value, f"must be >= {minimum:g}")
    return value
