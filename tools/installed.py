"""Is this tree installed? Exit 0 when the packages import from this tree and every dependency in
pyproject.toml (with the ``dev`` extra) is present at a version it accepts; otherwise print what
is missing and exit 1. ``make install`` runs ``pip install -e`` only in the second case.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("partitioner", "partitioner_cli", "solvers", "runtime")


def requirements(extra: str = "dev") -> list[str]:
    """``project.dependencies`` and ``project.optional-dependencies[extra]`` of pyproject.toml."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    try:
        import tomllib
    except ImportError:  # Python 3.10: the two lists, read as TOML arrays of strings
        found = []
        for key in ("dependencies", extra):
            m = re.search(rf"^{re.escape(key)}\s*=\s*\[(.*?)\]", text, re.S | re.M)
            if m:
                body = "\n".join(line.split("#", 1)[0] for line in m.group(1).splitlines())
                found += re.findall(r'"([^"]+)"', body)
        return found
    data = tomllib.loads(text)["project"]
    return [*data.get("dependencies", []), *data.get("optional-dependencies", {}).get(extra, [])]


def scripts() -> dict[str, str]:
    """``project.scripts`` of pyproject.toml (command -> "module:function")."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    m = re.search(r"^\[project\.scripts\]\s*\n(.*?)(?:^\[|\Z)", text, re.S | re.M)
    return dict(re.findall(r'^(\S+)\s*=\s*"([^"]+)"', m.group(1), re.M)) if m else {}


def missing() -> list[str]:
    out = []
    installed = {e.name: e.value for e in metadata.entry_points(group="console_scripts")}
    for name, target in scripts().items():
        if installed.get(name) != target:
            out.append(f"the {name} command runs {installed.get(name) or 'nothing'}, not {target}")
    for pkg in PACKAGES:
        spec = importlib.util.find_spec(pkg)
        origin = Path(spec.origin).resolve() if spec and spec.origin else None
        if origin is None or ROOT not in origin.parents:
            out.append(f"{pkg} imports from {origin.parent if origin else 'nowhere'}, not {ROOT}")
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return [*out, "packaging (to check versions)"]
    for text in requirements():
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": "dev"}):
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            out.append(f"{req.name} is not installed")
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            out.append(f"{req.name} {version} does not satisfy {req.specifier}")
    return out


if __name__ == "__main__":
    gaps = missing()
    for gap in gaps:
        print(f"install needed: {gap}")
    sys.exit(1 if gaps else 0)
