"""The package's layering, read from its source with ``ast``: imports point downward only.

Every module of ``shardc/`` is parsed and each ``import`` statement, at module level or
inside a function, becomes an edge of the import graph (one node per module; a package is
its ``__init__``).  Imports under ``if TYPE_CHECKING:`` never run (they name types for
annotations) and are no edge.  The graph must have no cycle, and read folder to folder (a pass each)
``ops/`` imports one way with ``lowering/`` and with ``planner/``, and the layout algebra (``sharding/``)
reaches neither ``ops/`` nor ``planner/``; a function may import only the heavy
libraries whose import is deferred for start-up time; parsing a spec reaches nothing of
planning or costing; parsing, planning and costing never reach jax; and no module passes 500 lines.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "shardc"

# imported inside a function so that a command which never needs them does not pay for them: jax (and
# ml_dtypes, its dtypes, used only beside it), matplotlib and lark, and two standard modules each needed
# on one rare path (importlib's resources for a zipped install's grammar, tomllib for --hardware-file)
DEFERRED = ("jax", "jaxlib", "ml_dtypes", "matplotlib", "lark", "importlib", "tomllib")

# The entry points import a pass only when its command or function runs: the package's ``__init__``
# runs before any of its modules (so importing a pass there would make every module import every
# pass); a command's module is loaded only when that command runs, and imports at module level all
# but the passes that load a library deferred for start-up time (jax, matplotlib, lark: ``shardc
# --help`` loads none, ``shardc explain --help`` no jax).  Their imports still count as edges of the
# graph, so they cannot hide a cycle.
ENTRY_POINTS = ("shardc", "shardc.cli")
HEAVY = ("jax", "jaxlib", "matplotlib", "lark")

# the planning and costing layers: parsing a spec must not reach any of them (the spec's own pipeline
# lines, its stage axis and layer split, are ``shardc.spec.stages``, which validation reads; the accountings'
# table, ``shardc.accountings``, imports nothing, and the parser checks an ``optimizer`` line's name against it)
PLANNING_AND_COSTING = ("shardc.planner", "shardc.sharding", "shardc.ir.plan", "shardc.ir.localops", "shardc.ops",
                        "shardc.costmodel", "shardc.collectives", "shardc.timing", "shardc.phase_time",
                        "shardc.stage_phases", "shardc.step_cost",
                        "shardc.hardware", "shardc.chip_model", "shardc.device_pieces", "shardc.layer_counts",
                        "shardc.ring_sends", "shardc.chip_choice", "shardc.quantize",
                        "shardc.layouts", "shardc.lowering", "shardc.verification", "shardc.pipeline")

# the passes that never import jax (so neither may anything they reach)
NO_JAX = ("shardc.spec", "shardc.ir", "shardc.ops", "shardc.sharding", "shardc.planner", "shardc.costmodel",
          "shardc.collectives", "shardc.timing", "shardc.phase_time", "shardc.stage_phases", "shardc.step_cost",
          "shardc.device_pieces", "shardc.layer_counts",
          "shardc.ring_sends", "shardc.chip_choice", "shardc.hardware", "shardc.chip_model", "shardc.pipeline",
          "shardc.layouts",
          "shardc.quantize",
          "shardc.export")


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``source``'s line ``line``, inside a function or not."""

    source: str
    target: str
    line: int
    deferred: bool

    def __str__(self) -> str:
        where = "in a function" if self.deferred else "at module level"
        return f"{self.source}:{self.line} -> {self.target} ({where})"


def module_names() -> dict[str, Path]:
    """Every module of the package by dotted name; a package is named by its ``__init__``."""
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


MODULES = module_names()


def _resolve(module: str, package: str, level: int) -> str:
    """The absolute name of ``from <level dots><module> import ...`` written in ``package``."""
    if level == 0:
        return module
    base = package.split(".")[: len(package.split(".")) - level + 1]
    return ".".join(base + ([module] if module else []))


def _package_of(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]


def _targets(node: ast.Import | ast.ImportFrom, source: str) -> Iterator[str]:
    """The modules an import statement loads: a submodule named in ``from`` counts as itself."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = _resolve(node.module or "", _package_of(source), node.level)
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        yield sub if sub in MODULES else base


def _annotations_only(test: ast.expr) -> bool:
    """The test of ``if TYPE_CHECKING:``, whose imports name types for annotations and never run."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, deferred: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement below ``tree`` that runs, and whether a function body holds it."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, deferred
        if isinstance(child, ast.If) and _annotations_only(child.test):
            yield from _imports(ast.Module(body=child.orelse, type_ignores=[]), deferred)
            continue
        inside = deferred or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        yield from _imports(child, inside)


def edges() -> list[Edge]:
    """Every import of every module of the package, to any module (the package's or not)."""
    found: dict[Edge, None] = {}
    for source, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node, deferred in _imports(tree):
            for target in _targets(node, source):
                found[Edge(source, target, node.lineno, deferred)] = None
    return list(found)


EDGES = edges()


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _entry_point(name: str) -> bool:
    return name == "shardc" or _within(name, ENTRY_POINTS[1:])


def _graph() -> dict[str, set[str]]:
    """The package's own import graph: module -> the package's modules it imports."""
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for edge in EDGES:
        if edge.target in MODULES and edge.target != edge.source:
            graph[edge.source].add(edge.target)
    return graph


def _loaded_graph() -> dict[str, set[str]]:
    """What a module can load: its imports, and the packages Python runs first (importing ``a.b.c``
    runs ``a`` and ``a.b``), of whose entry points only the module level (their functions run a pass)."""
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for edge in EDGES:
        if edge.target in MODULES and edge.target != edge.source and not (
                edge.deferred and _entry_point(edge.source)):
            graph[edge.source].add(edge.target)
    for name in MODULES:
        parts = name.split(".")
        graph[name] |= {".".join(parts[:k]) for k in range(1, len(parts))} - {name}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (each sorted, the list too)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return sorted(components)


def folder_of(name: str) -> str:
    """The pass a module belongs to: its folder under the package (``shardc.ops.masks``: ``shardc.ops``),
    or itself for a module at the package's top (``shardc.timing``)."""
    return ".".join(name.split(".")[:2])


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph read folder to folder: one folder imports another when one of its modules does."""
    folders: dict[str, set[str]] = {folder_of(name): set() for name in graph}
    for name, targets in graph.items():
        folders[folder_of(name)] |= {folder_of(t) for t in targets} - {folder_of(name)}
    return folders


def _module_graph() -> dict[str, set[str]]:
    """The package's imports that run, less the entry points' deferred ones (a pass each command runs)."""
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for edge in EDGES:
        if edge.target in MODULES and edge.target != edge.source and not (
                edge.deferred and _entry_point(edge.source)):
            graph[edge.source].add(edge.target)
    return graph


def _one_way(first: str, second: str) -> None:
    """Assert that no chain of imports leads from folder ``first`` to ``second`` and back."""
    folders = folder_graph(_module_graph())
    there, back = reachable(first, folders), reachable(second, folders)
    assert not (second in there and first in back), (
        f"{first} and {second} import each other: {_path(second, there)}; {_path(first, back)}\n"
        + "\n".join(str(e) for e in EDGES if e.target in MODULES and {folder_of(e.source), folder_of(e.target)}
                     == {first, second}))


def reachable(start: str, graph: dict[str, set[str]]) -> dict[str, str | None]:
    """Every module ``start`` imports, directly or not, with the module it was reached from."""
    parent: dict[str, str | None] = {start: None}
    todo = [start]
    while todo:
        node = todo.pop()
        for succ in sorted(graph[node]):
            if succ not in parent:
                parent[succ] = node
                todo.append(succ)
    return parent


def _path(target: str, parent: dict[str, str | None]) -> str:
    chain = [target]
    while (up := parent[chain[-1]]) is not None:
        chain.append(up)
    return " -> ".join(reversed(chain))


def _cycle_edges(component: list[str]) -> list[str]:
    members = set(component)
    return [str(e) for e in EDGES if e.source in members and e.target in members and e.source != e.target]


# the checker's own checks -----------------------------------------------------------------------


def test_imports_are_resolved_as_python_resolves_them() -> None:
    source = "shardc.planner.planner"
    tree = ast.parse("from shardc.ir import plan\nfrom . import zero\nfrom .. import errors\n"
                     "from shardc.ir.spec import Spec\nimport shardc.costmodel.cost_report\nfrom shardc import plan\n"
                     "if TYPE_CHECKING:\n    from shardc.lowering.api import Lowered\n"
                     "def f():\n    import jax.numpy as jnp\n")
    found = [(t, deferred) for node, deferred in _imports(tree) for t in _targets(node, source)]
    assert found == [("shardc.ir.plan", False), ("shardc.planner.zero", False), ("shardc.errors", False),
                     ("shardc.ir.spec", False), ("shardc.costmodel.cost_report", False), ("shardc", False),
                     ("jax.numpy", True)]


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert strongly_connected(graph) == [["a", "b", "c"], ["d", "e"], ["f"]]


# the package ------------------------------------------------------------------------------------


def test_the_package_has_no_import_cycle() -> None:
    cycles = [c for c in strongly_connected(_graph()) if len(c) > 1]
    assert not cycles, "import cycles:\n" + "\n".join(
        " <-> ".join(c) + "\n    " + "\n    ".join(_cycle_edges(c)) for c in cycles)


def test_the_folder_graph_reads_modules_by_their_folder() -> None:
    graph = {"shardc.a.x": {"shardc.b.y"}, "shardc.b.y": set(), "shardc.b.z": {"shardc.a.w", "shardc.t"},
             "shardc.a.w": {"shardc.a.x"}, "shardc.t": set()}
    assert folder_graph(graph) == {"shardc.a": {"shardc.b"}, "shardc.b": {"shardc.a", "shardc.t"}, "shardc.t": set()}
    assert strongly_connected(folder_graph(graph))[0] == ["shardc.a", "shardc.b"]


def test_ops_and_lowering_import_one_way() -> None:
    # codegen and the reference look the families up; a family's JAX lines are its own (ops/)
    _one_way("shardc.ops", "shardc.lowering")


def test_ops_and_planner_import_one_way() -> None:
    # the planner looks the families up; a family's planning rules are its own (ops/), written against
    # the layout algebra below both (sharding/)
    _one_way("shardc.ops", "shardc.planner")


def test_the_layout_algebra_reaches_no_family_and_no_planner() -> None:
    # sharding/ is what every family plans with: it knows no family and no planner driver
    reached = reachable("shardc.sharding", folder_graph(_module_graph()))
    assert not {"shardc.ops", "shardc.planner"} & set(reached), [_path(f, reached) for f in
                                                              ("shardc.ops", "shardc.planner") if f in reached]


def test_no_annotation_of_a_family_or_the_layout_algebra_names_a_layer_above() -> None:
    # the types a family's rule receives are defined at or below ops/ (Node, BackwardPass), so even the
    # imports under ``if TYPE_CHECKING:`` (no edge of the graph above) point down
    above = {"shardc.ops": ("shardc.planner",), "shardc.sharding": ("shardc.planner", "shardc.ops")}
    upward = []
    for source, path in MODULES.items():
        banned = above.get(folder_of(source), ())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                upward += [f"{source}:{node.lineno} -> {t}" for t in _targets(node, source) if _within(t, banned)]
    assert not upward, "\n".join(upward)


def test_functions_import_only_the_deferred_libraries() -> None:
    hidden = [str(e) for e in EDGES
              if e.deferred and not _within(e.target, DEFERRED) and not _entry_point(e.source)]
    assert not hidden, f"imports inside a function (only {', '.join(DEFERRED)} may be):\n" + "\n".join(hidden)


def test_the_entry_points_defer_only_the_package_itself() -> None:
    # the entry points' deferred imports are the passes they run, nothing else
    odd = [str(e) for e in EDGES if e.deferred and _entry_point(e.source)
           and not _within(e.target, ("shardc", *DEFERRED))]
    assert not odd, "\n".join(odd)


def _loads_a_heavy_library(name: str, heavy: tuple[str, ...] = HEAVY) -> bool:
    """Whether importing ``name`` loads jax, matplotlib or lark (its module-level imports, and theirs;
    ``heavy``: the libraries asked about)."""
    graph: dict[str, set[str]] = {n: set() for n in MODULES}
    for edge in EDGES:
        if edge.target in MODULES and not edge.deferred:
            graph[edge.source].add(edge.target)
    loaded = reachable(name, graph)
    return any(e.source in loaded and not e.deferred and _within(e.target, heavy) for e in EDGES)


def test_the_commands_defer_only_what_loads_a_heavy_library() -> None:
    # the package's own __init__ defers every pass; a command defers a pass only to spare its jax,
    # matplotlib or lark
    assert _loads_a_heavy_library("shardc.spec.parser") and not _loads_a_heavy_library("shardc.errors")
    needless = [str(e) for e in EDGES if e.deferred and _within(e.source, ENTRY_POINTS[1:]) and e.target in MODULES
                and not _loads_a_heavy_library(e.target)]
    assert not needless, "these command imports load no jax, matplotlib or lark: import them at module level\n" + \
        "\n".join(needless)


def test_parsing_reaches_nothing_of_planning_or_costing() -> None:
    graph = _loaded_graph()
    bad = []
    for name in MODULES:
        if _within(name, ("shardc.spec",)):
            parent = reachable(name, graph)
            bad += [_path(t, parent) for t in parent if _within(t, PLANNING_AND_COSTING)]
    assert not bad, "parsing imports planning or costing:\n" + "\n".join(sorted(set(bad)))


def test_parsing_loads_nothing_of_planning_or_costing() -> None:
    # the same, as Python runs it: what ``shardc.parse`` has loaded once a spec is parsed
    code = ("import sys, shardc; shardc.parse('mesh X=4\\nOut[B_X, F] = In[B_X, D] · W[D, F]\\n'); "
            "print(sorted(m for m in sys.modules if m.startswith(('jax', 'numpy')) or m.startswith("
            f"{tuple(p + '.' for p in PLANNING_AND_COSTING)!r}) or m in {PLANNING_AND_COSTING!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=PACKAGE.parent)
    assert done.stdout.strip() == "[]", done.stdout


def test_parse_plan_and_cost_never_import_jax() -> None:
    graph = _loaded_graph()
    bad = []
    for name in MODULES:
        if _within(name, NO_JAX):
            parent = reachable(name, graph)
            bad += [f"{_path(e.source, parent)} -> {e}" for e in EDGES
                    if e.source in parent and _within(e.target, ("jax", "jaxlib"))]
    assert not bad, "these passes import jax:\n" + "\n".join(sorted(set(bad)))


def test_no_two_modules_share_a_base_name() -> None:
    # a module is found by its base name alone (in tracebacks, editors, docs): each names one thing
    names: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "__init__.py":
            names.setdefault(path.stem, []).append(str(path.relative_to(PACKAGE.parent)))
    shared = {name: paths for name, paths in names.items() if len(paths) > 1}
    assert not shared, f"base names used twice: {shared}"


MODULE_LINES = 500  # the developers' guide: a module that grows past it is split along a seam of its own


def test_no_module_is_over_the_line_limit() -> None:
    long = {name: n for name, path in MODULES.items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MODULE_LINES}
    assert not long, f"modules over {MODULE_LINES} lines (split each along a concept of its own): {long}"


def test_verify_loads_no_jax_before_it_asks_for_its_devices() -> None:
    # `shardc verify` asks XLA for its emulated CPU devices before jax is up (lower_cmd.emulate_devices); a
    # module-level import reaching jax (pipeline_hlo's of pipeline_params) left it one device: "the mesh P=12,
    # Z=2, Y=2 needs 48 devices but jax sees 1" on every pipelined spec without XLA_FLAGS
    assert not _loads_a_heavy_library("shardc.cli.lower_cmd", ("jax", "jaxlib"))
