"""Does README.md's tour print what it says? Runs every quoted command and compares.

    python tools/check_docs.py [--doc README.md] [--show] [--keep DIR]

Every ```console block of the document is read in order; each line ``$ partitioner ...`` is a
command (pipes such as ``| tail -1`` included) and the lines under it, up to the next ``$``
line or the end of the block, are what the document says it prints. The commands run in order,
with bash, in a fresh copy of the tree (the files git tracks or would track, copied to a
temporary folder; ``../shared`` beside it points at the shared data folder, ``$SHARED_DATA``'s
parent, by default the ``shared`` folder beside this tree), with ``partitioner`` the copy's own
command line (``python -m partitioner_cli`` on the copy), so the tree checked is this one and
not whatever is installed. A command that exits 0 is compared on its stdout (warnings and
progress go to stderr and the tour does not show them); one that fails, on stderr then stdout
(the tour shows its one-line refusal).

Lines are compared with runs of spaces taken as one (tables re-pad their columns when a figure
changes width); a document line ending in ``, ...`` shows only the start of a long line (the
actual line must start with the rest). The words must be equal; so must every number, except where a rule below says
the figure is a measurement, which is then any number (still one number in its place):

* ``in X s`` and ``solved in X s``: wall-clock time of a command or a solve;
* every number of a command that measures on this machine (``partitioner profile`` of a zoo
  model, ``partitioner train``) or plans from such a measured profile (the ``vgg19_tiny``
  files of the tour): their times are this machine's, different on every run.

Every mismatch is reported with the command, the document's line and the actual line (or the
line missing or extra). ``--show`` prints each command's actual output too. Exit status 0 when
everything matches, 1 otherwise, 2 when the document cannot be read.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = Path(os.environ.get("SHARED_DATA", ROOT.parent / "shared" / "data"))
_NUMBER = re.compile(r"[-+]?\d+(?:,\d{3})*(?:\.\d+)?(?:e[-+]?\d+)?%?")
# a wall-clock time: "in 3.4 s", "solved in 0.017 s"
_TIMING = re.compile(r"\bin ([-+]?\d+(?:\.\d+)?) s\b")
# commands whose every number is a measurement on this machine (see the module's docstring)
MEASURED = (re.compile(r"^partitioner (profile (?!project|merge|emulate)|train )"), re.compile(r"vgg19_tiny"))
TIMEOUT_S = 600
ELLIPSIS = ", ..."  # a document line ending so shows only the start of a long line

__all__ = ["Mismatch", "Step", "check", "compare_lines", "main", "parse_steps"]


@dataclass
class Step:
    """One quoted command and the lines the document shows under it."""

    command: str
    expected: list[str] = field(default_factory=list)
    line_no: int = 0  # where the command is in the document (1-based)


@dataclass(frozen=True)
class Mismatch:
    command: str
    line_no: int
    expected: str | None  # None: a line the document does not show
    actual: str | None  # None: a line the command did not print
    why: str

    def __str__(self) -> str:
        return (f"README line {self.line_no}: $ {self.command}\n  {self.why}\n"
                f"  document: {self.expected if self.expected is not None else '(no line)'}\n"
                f"  actual:   {self.actual if self.actual is not None else '(no line)'}")


def parse_steps(text: str) -> list[Step]:
    """The ``$ partitioner ...`` commands of every ```console block, each with its lines."""
    steps: list[Step] = []
    inside = False
    current: Step | None = None
    for no, line in enumerate(text.splitlines(), start=1):
        if line.startswith("```"):
            inside = line.strip() == "```console" and not inside
            current = None
            continue
        if not inside:
            continue
        if line.startswith("$ "):
            current = Step(line[2:].strip(), [], no) if line[2:].startswith("partitioner") else None
            if current is not None:
                steps.append(current)
        elif current is not None:
            current.expected.append(line)
    return steps


def _measured(command: str) -> bool:
    return any(rule.search(command) for rule in MEASURED)


def _split(line: str) -> tuple[list[str], list[str]]:
    """(the words between the numbers, the numbers) of a line, spaces collapsed."""
    line = " ".join(line.split())
    return _NUMBER.split(line), _NUMBER.findall(line)


def compare_lines(command: str, expected: str, actual: str) -> str | None:
    """Why ``actual`` is not the line the document shows (None when it is, measurements aside)."""
    if " ".join(expected.split()) == " ".join(actual.split()):
        return None
    if expected.endswith(ELLIPSIS):  # the document shortens a long line: its start must match
        expected = expected[: -len(ELLIPSIS)].rstrip()
        actual = actual[: len(expected) + (len(actual) - len(actual.lstrip()))]
        if " ".join(expected.split()) == " ".join(actual.split()):
            return None
    words_e, nums_e = _split(expected)
    words_a, nums_a = _split(actual)
    if words_e != words_a or len(nums_e) != len(nums_a):
        return "the words differ"
    if _measured(command):
        return None
    free = {m.start(1) for m in _TIMING.finditer(" ".join(expected.split()))}
    starts = [m.start() for m in _NUMBER.finditer(" ".join(expected.split()))]
    for start, e, a in zip(starts, nums_e, nums_a, strict=True):
        if e != a and start not in free:
            return f"the figure {e} is {a} here"
    return None


def _copy_tree(dest: Path) -> Path:
    """The files git tracks or would track, copied to ``dest/tree``; ``dest/shared`` -> the shared folder."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    tree = dest / "tree"
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, tree / rel)
    if SHARED_DATA.parent.is_dir():
        (dest / "shared").symlink_to(SHARED_DATA.parent.resolve(), target_is_directory=True)
    return tree


def _shim(dest: Path, tree: Path) -> dict[str, str]:
    """An environment whose ``partitioner`` is the copy's command line."""
    bin_dir = dest / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "partitioner"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m partitioner_cli "$@"\n')
    exe.chmod(0o755)
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(tree)
    env.pop("COLUMNS", None)
    return env


def _run(step: Step, tree: Path, env: dict[str, str]) -> list[str]:
    """The lines ``step`` prints: stdout when it succeeds, stderr then stdout when it fails."""
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", step.command], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    out = proc.stdout if proc.returncode == 0 or "|" in step.command else proc.stderr + proc.stdout
    return out.rstrip("\n").splitlines()


def check(doc: Path, show: bool = False, keep: Path | None = None) -> list[Mismatch]:
    """Run the document's commands in a fresh copy of the tree; every mismatch found."""
    steps = parse_steps(doc.read_text())
    problems: list[Mismatch] = []
    with tempfile.TemporaryDirectory(prefix="check_docs_") as tmp:
        dest = Path(keep) if keep is not None else Path(tmp)
        dest.mkdir(parents=True, exist_ok=True)
        tree = _copy_tree(dest)
        env = _shim(dest, tree)
        for step in steps:
            actual = _run(step, tree, env)
            if show:
                print(f"$ {step.command}\n" + "\n".join(actual), flush=True)
            expected = list(step.expected)
            while expected and not expected[-1].strip():
                expected.pop()
            for k in range(max(len(expected), len(actual))):
                e = expected[k] if k < len(expected) else None
                a = actual[k] if k < len(actual) else None
                no = step.line_no + 1 + k
                if e is None or a is None:
                    why = "a line the document does not show" if e is None else "a line the command did not print"
                    problems.append(Mismatch(step.command, no, e, a, why))
                    continue
                why_not = compare_lines(step.command, e, a)
                if why_not is not None:
                    problems.append(Mismatch(step.command, no, e, a, why_not))
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--doc", default=str(ROOT / "README.md"), help="the document (default README.md)")
    ap.add_argument("--show", action="store_true", help="print every command's actual output")
    ap.add_argument("--keep", default=None, help="run in this folder and keep it (default: a temporary one)")
    args = ap.parse_args(argv)
    doc = Path(args.doc)
    if not doc.is_file():
        print(f"check_docs: {doc}: no such file", file=sys.stderr)
        return 2
    problems = check(doc, args.show, Path(args.keep) if args.keep else None)
    for p in problems:
        print(p)
    steps = parse_steps(doc.read_text())
    print(f"{len(steps)} commands of {doc.name} run; {len(problems)} mismatch(es)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
