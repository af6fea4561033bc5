"""The import graph of ``partitioner``, ``solvers`` and ``runtime`` (docs/ARCHITECTURE.md, import rules).

Read from the sources with ``ast``: every ``import`` and ``from ... import``, at module level or
inside functions (a lazy import is still a dependency), except under ``if TYPE_CHECKING:``
(annotations only, never executed). Registries that name modules as strings
(``"solvers.pipeline.dp:solve"``, ``"partitioner_cli.plan"``) are imports too. An import of a
package's name (``from partitioner import Plan``) is an edge to its ``__init__``; importing
``a.b`` is not counted as importing ``a``'s ``__init__`` (which Python runs first) so that a
package re-exporting its own modules is not read as a cycle.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("partitioner", "partitioner_cli", "solvers", "runtime")
_NAMED = re.compile(r"^((?:partitioner_cli|partitioner|solvers|runtime)(?:\.\w+)+)(?::\w+)?$")

# The CLI: the top layer, which nothing below imports.
CLI = ("partitioner_cli",)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(name: str) -> str | None:
    """The deepest module of ``name`` in the three packages (``a.b.C`` -> ``a.b``), or None."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in MODULES:
            return candidate
        parts.pop()
    return None


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _walk(node: ast.AST) -> Iterator[ast.AST]:
    """Every node below ``node`` except the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _type_checking(child):
            for other in child.orelse:
                yield other
                yield from _walk(other)
            continue
        yield child
        yield from _walk(child)


def _imports(module: str) -> set[str]:
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    package = module if _is_package(module) else module.rpartition(".")[0]
    out: set[str] = set()
    for node in _walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join([*base, node.module] if node.module else base)
            else:
                stem = node.module or ""
            # ``from a import b``: the module a.b when it is one, else a's __init__
            targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in MODULES else stem for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            named = _NAMED.match(node.value)
            if named and _resolve(named.group(1)) == named.group(1):
                targets = [named.group(1)]
        for t in targets:
            r = _resolve(t)
            if r is not None and r != module:
                out.add(r)
    return out


class _Graph(dict):
    """Each module's imports, parsed on first use (collection stays fast; a test worker parses
    only the modules its tests ask about)."""

    def __missing__(self, module: str) -> set[str]:
        self[module] = out = _imports(module)
        return out

    def whole(self) -> dict[str, set[str]]:
        return {m: self[m] for m in MODULES}


GRAPH = _Graph()


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _in(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_graph_is_read():
    # the walker sees module-level, lazy (in a function) and registry imports, not TYPE_CHECKING ones
    assert "partitioner.cost" in GRAPH["partitioner.simulate"]
    assert "solvers.pipeline.router" in GRAPH["solvers"]  # SOLVERS = {"dp": "solvers.pipeline.router:solve", ...}
    assert "partitioner_cli.plan" in GRAPH["partitioner_cli.main"]  # COMMAND_MODULES
    assert "solvers" in GRAPH["partitioner_cli.plan"]  # inside _run
    assert "partitioner.cluster" not in GRAPH["partitioner.plan"]  # under TYPE_CHECKING only


def test_no_import_cycle():
    assert _cycles(GRAPH.whole()) == []


def test_plans_do_not_know_the_cost_model():
    # Plan.validate is structural; the cost model prices plans and checks their memory
    assert not [t for t in GRAPH["partitioner.plan"] if t in ("partitioner.cost", "partitioner.simulate")]


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _in(m, ("partitioner",)) and not _in(m, CLI)))
def test_partitioner_never_imports_upward(module):
    up = sorted(t for t in GRAPH[module] if _in(t, ("solvers", "runtime", *CLI)))
    assert up == [], f"{module} imports {up}: partitioner is the bottom layer"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _in(m, ("solvers",))))
def test_solvers_never_import_the_runtime_or_the_cli(module):
    up = sorted(t for t in GRAPH[module] if _in(t, ("runtime", *CLI)))
    assert up == [], f"{module} imports {up}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _in(m, ("runtime",))))
def test_the_runtime_never_imports_solvers_or_the_cli(module):
    up = sorted(t for t in GRAPH[module] if _in(t, ("solvers", *CLI)))
    assert up == [], f"{module} imports {up}"


# solvers/ by floors: a module imports only modules of its own sub-package or of a lower floor
# (docs/ARCHITECTURE.md). ``solvers`` is the front door's __init__ itself.
SOLVER_FLOORS: tuple[tuple[str, ...], ...] = (
    ("solvers.result", "solvers.progress", "solvers.predictions"),
    ("solvers.pipeline",),
    ("solvers.exact", "solvers.cluster"),
    ("solvers.baselines",),
    ("solvers.__init__",),
    ("solvers.planning",),
    ("solvers.analysis",),
)


def _solver_room(module: str) -> tuple[int, str]:
    """(floor, sub-package or module) of a module of ``solvers``."""
    name = "solvers.__init__" if module == "solvers" else module
    for floor, rooms in enumerate(SOLVER_FLOORS):
        for room in rooms:
            if name == room or name.startswith(room + "."):
                return floor, room
    raise AssertionError(f"{module} is on no floor of SOLVER_FLOORS; add it")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _in(m, ("solvers",))))
def test_solvers_import_only_downward(module):
    floor, room = _solver_room(module)
    bad = []
    for target in GRAPH[module]:
        if not _in(target, ("solvers",)):
            continue
        t_floor, t_room = _solver_room(target)
        if t_room != room and t_floor >= floor:
            bad.append(target)
    assert not bad, f"{module} (floor {floor}) imports {sorted(bad)} on its own floor or above"


# Modules below the command line that spell other programs' flags: Megatron-LM's arguments, and
# torchrun's and DeepSpeed's launchers', in the exports' modules (partitioner.export's targets and
# what they share) and in partitioner.launch (the launch recipes and the advice of the runtime's seats).
FOREIGN_FLAGS = {"partitioner.export.common", "partitioner.export.torch_pipelining", "partitioner.export.deepspeed",
                 "partitioner.export.megatron", "partitioner.launch", "runtime.nodes"}
_FLAG = re.compile(r"(?:^|[\s(`/])--[a-zA-Z]")


@pytest.mark.parametrize("package", ["partitioner", "solvers", "runtime"])
def test_no_cli_flag_is_spelled_below_the_cli(package):
    """Below the command line an option is named by its keyword (``micro_batches``); the CLI shows
    its flag (partitioner_cli._args.cli_message). Docstrings may say which flag gives a value."""
    found = []
    for name, path in MODULES.items():
        if not _in(name, (package,)) or name in FOREIGN_FLAGS:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                    and _FLAG.search(node.value):
                found.append(f"{name}:{node.lineno}: {node.value[:60]!r}")
    assert not found, "CLI flags spelled below the CLI:\n" + "\n".join(found)


def test_the_plan_command_plans_through_one_front_door():
    # solvers.planning.plan; ``solvers`` itself for the --solver choices
    assert {t for t in GRAPH["partitioner_cli.plan"] if _in(t, ("solvers",))} == {"solvers", "solvers.planning"}


def test_only_the_cli_imports_the_cli():
    for module, targets in GRAPH.whole().items():
        if _in(module, CLI):
            continue
        assert not [t for t in targets if _in(t, CLI)], f"{module} imports the CLI"


def test_schedule_names_are_compared_only_in_the_schedule_registry() -> None:
    """What a schedule is (flushes, chunks, executor, ...) is said once, in
    ``partitioner/schedule.py``; elsewhere code asks its ``ScheduleSpec``, never its name."""
    from partitioner.schedule import SCHEDULE_NAMES

    found = []
    for name, path in MODULES.items():
        if name == "partitioner.schedule":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Compare) or "schedule" not in ast.unparse(node).lower():
                continue  # ("wsp" is also an objective's name, "2bw" an executor's)
            for side in (node.left, *node.comparators):
                elts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                if any(isinstance(e, ast.Constant) and e.value in SCHEDULE_NAMES for e in elts):
                    found.append(f"{name}:{node.lineno}")
    assert not found, f"schedule names compared outside partitioner/schedule.py: {found}"
