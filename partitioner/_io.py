"""Reading and writing the project's files: JSON/YAML in, atomic JSON out, typed field access."""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from .errors import FormatError, PartitionerError

__all__ = [
    "MAX_FILE_BYTES",
    "MAX_YAML_NODES",
    "atomic_write_bytes",
    "atomic_write_text",
    "check_loadable",
    "check_outputs",
    "finite_json",
    "load_mapping",
    "opt_field",
    "read_text",
    "req_field",
    "req_int",
    "req_number",
    "write_json",
    "write_loadable",
]

T = TypeVar("T")

# Input limits (docs/formats.md): files are read whole, so their size is bounded; YAML
# anchors and aliases may share a node many times, so the document's size with every alias
# expanded is bounded too (a few hundred bytes of nested aliases would otherwise expand to
# billions of nodes).
MAX_FILE_BYTES = 64 * 2**20
MAX_YAML_NODES = 1_000_000


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one.

    The data goes to a temporary file in the same directory, is flushed to disk, and is
    renamed over the target: an interrupted run never leaves a truncated file. A new file
    gets the mode a plain ``open()`` would give it (0666 less the umask, applied by the
    kernel); a replaced file keeps its mode. Failures raise :class:`PartitionerError` in
    one line naming the path.
    """
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _create_temp(target)
    except OSError as exc:
        raise PartitionerError(f"cannot write {target}: {exc.strerror or exc}") from None
    try:
        with contextlib.suppress(FileNotFoundError):
            os.fchmod(fd, target.stat().st_mode & 0o7777)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise PartitionerError(f"cannot write {target}: {exc.strerror or exc}") from None
        raise


def _create_temp(target: Path) -> tuple[int, str]:
    """A new, empty file next to ``target``, created with mode 0666 (the umask applies)."""
    for _ in range(100):
        tmp = str(target.parent / f".{target.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name next to {target}")


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """:func:`atomic_write_bytes` of ``text`` in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


def finite_json(data: Any, path: str = "") -> None:
    """Raise :class:`PartitionerError` naming the first field of ``data`` that is NaN or infinite.

    Strict JSON has no NaN or Infinity; a non-finite number in an output means the inputs
    were out of the range the model handles, and a reader would reject the file anyway.
    """
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        where, x = stack.pop()
        if isinstance(x, float) and not math.isfinite(x):
            shown = where or "the value"
            raise PartitionerError(f"{path + ': ' if path else ''}{shown} = {x}: the result is not a finite "
                                   "number, so the inputs are out of the range the model handles "
                                   "(see the limits in docs/formats.md); nothing was written")
        if isinstance(x, Mapping):
            stack.extend((f"{where}.{k}" if where else str(k), v) for k, v in reversed(list(x.items())))
        elif isinstance(x, (list, tuple)):
            stack.extend((f"{where}[{i}]", v) for i, v in reversed(list(enumerate(x))))


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    """Atomically write ``data`` as strict JSON (no NaN or Infinity: see :func:`finite_json`),
    indented when it is small (plans, profiles), compact when large (traces)."""
    try:
        text = json.dumps(data, allow_nan=False)  # the C encoder: fast, and refuses NaN / Infinity
    except ValueError:
        finite_json(data, str(path))  # names the field
        raise
    if len(text) < _INDENT_BELOW_CHARS:
        text = json.dumps(data, indent=1, allow_nan=False)
    atomic_write_text(path, text + "\n")


_INDENT_BELOW_CHARS = 4 * 2**20


def check_loadable(path: str | os.PathLike[str], data: Mapping[str, Any], loader: Any, what: str) -> None:
    """Refuse ``data``, to be written to ``path``, unless ``loader`` (a ``from_dict``) accepts it:
    a command never writes a file its own reader refuses. A value beyond the file format's limits
    (a projected time past 1e6 s, a bandwidth past 1e6 GB/s, 10^17 micro-batches) is refused in one
    line naming the field."""
    try:
        loader(data)
    except FormatError as err:
        raise PartitionerError(f"{path}: not written: the {what} would have {err}, which its reader refuses "
                               "(the inputs are beyond the limits of docs/formats.md)") from None


def write_loadable(path: str | os.PathLike[str], data: Mapping[str, Any], loader: Any, what: str) -> None:
    """:func:`write_json` of ``data`` once :func:`check_loadable` accepts it (else nothing is written)."""
    check_loadable(path, data, loader, what)
    write_json(path, data)


def _same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """``a`` and ``b`` name one file: the same resolved path, or (both existing) the same inode, so
    that symbolic and hard links count."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        sa, sb = os.stat(a), os.stat(b)
    except (OSError, ValueError):
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _writable_at(flag: str, out: str | os.PathLike[str], real: str) -> None:
    """Refuse ``real`` (the resolved output path) unless its nearest existing directory takes a new file."""
    parent = Path(real).parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise PartitionerError(f"{flag} {out}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PartitionerError(f"{flag} {out}: the directory {parent} is not writable")
    # try it: permissions are not the whole story (read-only mounts, /proc, /sys)
    try:
        fd, tmp = _create_temp(parent / Path(real).name)
    except OSError as exc:
        raise PartitionerError(f"{flag} {out}: cannot write in {parent} ({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(tmp)


def check_outputs(outputs: Mapping[str, str | os.PathLike[str] | None],
                  inputs: Iterable[str | os.PathLike[str]], *,
                  folders: Mapping[str, tuple[str | os.PathLike[str] | None, Sequence[str]]] | None = None,
                  input_dirs: Iterable[str | os.PathLike[str]] = ()) -> None:
    """Refuse, before any work, outputs that would replace an input or cannot be written.

    ``outputs`` maps a flag (``-o``, ``--trace``) to a file path or ``None``; ``folders`` maps a
    flag to an output folder and the names of the files it will receive (``-o OUTDIR``:
    ``plan.json``, ...); ``input_dirs`` are folders whose files are read (a Sailor profile
    directory). Refused: an output file, or a file an output folder will receive, that is one of
    ``inputs`` (by resolved path, and by inode when both exist, so symbolic and hard links count)
    or another output, or a directory; an output folder that is an existing file or one of
    ``input_dirs``; an output file directly inside one of ``input_dirs`` (it would be read as
    one of its files next time); a place where nothing can be written.
    """
    ins = [Path(p) for p in inputs]
    in_dirs = [Path(p) for p in input_dirs]
    files: list[tuple[str, str | os.PathLike[str], bool]] = []  # (flag, path, inside an output folder)
    for flag, out in outputs.items():
        if out is not None and str(out) != "":
            files.append((flag, out, False))
    for flag, (folder, names) in (folders or {}).items():
        if folder is None or str(folder) == "":
            continue
        d = Path(folder)
        if d.exists() and not d.is_dir():
            raise PartitionerError(f"{flag} {folder} is a file; name a folder (new or existing) for "
                                   f"{', '.join(names)}")
        same_dir = next((p for p in (*in_dirs, *ins) if _same_file(d, p)), None)
        if same_dir is not None:
            raise PartitionerError(f"{flag} {folder} is the input folder {same_dir}; name another folder")
        files += [(flag, d / name, True) for name in names]
    written: list[tuple[str, str | os.PathLike[str]]] = []
    for flag, out, in_folder in files:
        o = Path(out)
        same = next((p for p in ins if _same_file(o, p)), None)
        if same is not None:
            what = f"{flag} {o.parent} would receive {o.name}, which" if in_folder else f"{flag} {out}"
            raise PartitionerError(f"{what} is one of the input files ({same}); name a new output "
                                   f"{'folder' if in_folder else 'file'}")
        other = next((f for f, p in written if _same_file(o, p)), None)
        if other is not None:
            raise PartitionerError(f"{flag} {out} is also the {other} output; name two different files")
        written.append((flag, out))
        if o.is_dir():
            raise PartitionerError(f"{flag} {out} is a directory; name a file")
        inside = next((d for d in in_dirs if d.is_dir() and _same_file(o.parent, d)), None)
        if inside is not None:
            raise PartitionerError(f"{flag} {out} is inside the input folder {inside}, whose files are read as "
                                   "input; name a file elsewhere")
        _writable_at(flag, out, os.path.realpath(o))


def read_text(path: str | os.PathLike[str]) -> str:
    """A UTF-8 text file (a byte-order mark is allowed), at most :data:`MAX_FILE_BYTES`; errors name the file."""
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise FormatError("", expected="no such file", file=str(p)) from None
    except OSError as exc:
        raise FormatError("", expected=f"cannot be read ({exc.strerror or exc})", file=str(p)) from None
    if len(raw) > MAX_FILE_BYTES:
        raise FormatError("", expected=f"larger than {MAX_FILE_BYTES // 2**20} MiB, the most this reads",
                          file=str(p))
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise FormatError("", expected="is UTF-16 text; save it as UTF-8", file=str(p))
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise FormatError("", expected=f"is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                          "save it as UTF-8", file=str(p)) from None
    if "\x00" in text:
        raise FormatError("", expected="contains NUL characters; not a text file", file=str(p))
    return text


def _yaml_load(text: str) -> Any:
    """``yaml.safe_load`` that refuses documents expanding (through aliases) past :data:`MAX_YAML_NODES`."""
    import yaml

    class _Loader(yaml.SafeLoader):
        def construct_document(self, node: Any) -> Any:
            _check_yaml_size(node)
            return super().construct_document(node)

    loader = _Loader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _check_yaml_size(root: Any) -> None:
    """Count the nodes of a composed YAML document with every alias expanded, without expanding it."""
    import yaml

    size: dict[int, int] = {}
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if id(node) in size:
            continue
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [x for kv in node.value for x in kv]
        else:
            size[id(node)] = 1
            continue
        if done:
            total = 1 + sum(size.get(id(c), 0) for c in children)
            if total > MAX_YAML_NODES:
                raise FormatError("", expected=f"expands (through YAML aliases) to more than {MAX_YAML_NODES:,} "
                                  "nodes, the most this reads")
            size[id(node)] = total
        else:
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in size)


def is_finite_number(value: Any) -> bool:
    """A real number a float can hold (not a boolean, NaN, an infinity, or an integer past 1e308)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return abs(value) < 1e308 if isinstance(value, int) else math.isfinite(value)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number in JSON (write a finite number)")


def load_mapping(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a JSON or YAML file whose top level is a mapping; errors name the file.

    The file must be UTF-8 and at most :data:`MAX_FILE_BYTES`; a YAML file may not expand
    through aliases to more than :data:`MAX_YAML_NODES` nodes.
    """
    p = Path(path)
    text = read_text(p)
    is_yaml = p.suffix.lower() in (".yaml", ".yml")
    try:
        data = _yaml_load(text) if is_yaml else json.loads(text, parse_constant=_no_constant)
    except FormatError as err:
        raise err.in_file(str(p)) from None
    except RecursionError:
        raise FormatError("", expected="nests too deeply", file=str(p)) from None
    except Exception as exc:  # json.JSONDecodeError, yaml.YAMLError, ValueError (an integer of > 4300 digits)
        kind = "YAML" if is_yaml else "JSON"
        detail = " ".join(str(exc).split())
        if len(detail) > 200:
            detail = detail[:197] + "..."
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
    maximum: float | None = None,
) -> float:
    """A finite number field, at least ``minimum`` (greater if ``strict``) and at most ``maximum``,
    as written (int or float; an integer too large for a float is refused)."""
    field = f"{where}{key}"
    if default is not None and (key not in d or d[key] is None):
        return default
    value = req_field(d, key, (int, float), where)
    if isinstance(value, int) and abs(value) > 2**53:
        raise FormatError(field, value, f"must be a number of magnitude at most {maximum or 2**53:g}")
    if not math.isfinite(value):
        raise FormatError(field, value, "must be a finite number")
    if minimum is not None and not (value > minimum if strict else value >= minimum):
        upper = f" and <= {maximum:g}" if maximum is not None else ""
        raise FormatError(field, value, f"must be {'>' if strict else '>='} {minimum:g}{upper}")
    if maximum is not None and value > maximum:
        raise FormatError(field, value, f"must be <= {maximum:g}")
    return value


def req_int(d: Mapping[str, Any], key: str, where: str = "", *, minimum: int = 0, maximum: int,
            default: int | None = None) -> int:
    """An integer field in ``[minimum, maximum]`` (``default`` when absent or null, if given)."""
    field = f"{where}{key}"
    if default is not None and (key not in d or d[key] is None):
        return default
    value = req_field(d, key, int, where)
    if not minimum <= value <= maximum:
        raise FormatError(field, value, f"must be an integer in [{minimum}, {maximum:,}]")
    return int(value)
