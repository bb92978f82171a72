"""The package layout's rules (docs/layout.md), read from the source with ``ast``: no import circle in zerorun/,
zero/ imports nothing above it, launch/ nothing of zero/, no file over 400 lines, at most 6 modules at zerorun/'s
top level, and every run folder file named through zerorun/runfolder.py. Pure and fast: nothing is imported.

The import graph: one node per module (``zerorun/a/b.py`` is ``zerorun.a.b``, ``zerorun/a/__init__.py`` is
``zerorun.a``); an edge for every ``import`` and ``from ... import`` anywhere in a file (inside functions and
``if TYPE_CHECKING:`` too), relative ones resolved; ``from zerorun.a import b`` is an edge to ``zerorun.a.b`` when
``b`` is a submodule, else to ``zerorun.a``. Importing ``zerorun.a.b`` is not counted as an edge to its package
``zerorun.a``: a package's ``__init__`` re-exports its submodules' names, and they never import it back.
"""

from __future__ import annotations

import ast
import functools
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "zerorun")
MAX_LINES = 400
MAX_TOP_LEVEL = 6
#: what zero/ may import of zerorun outside zero/ (the ZeRO runtime is a library: Note in docs/layout.md).
ZERO_MAY_IMPORT = ("zerorun.errors", "zerorun.files", "zerorun.allocator")
#: the names the run folder's files had as literals before zerorun/runfolder.py owned them ("tensorboard" is
#: also a tracker's name, so only the file names are checked).
RUN_FOLDER_FILES = ("recipe.yaml", "commands.sh", "metrics.jsonl", "output.log", "job.json", "slurm-job.json",
                    "trackers.json", "metrics.csv")
#: Marks the whole-tree checks that pass only once every engineer's part of the layout move (issue 36) has landed.


def module_name(path: str) -> str:
    """``zerorun/a/b.py`` -> ``zerorun.a.b``; ``zerorun/a/__init__.py`` -> ``zerorun.a``."""
    parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def sources() -> dict[str, tuple[str, str]]:
    """module name -> (file path, source text) for every .py file under zerorun/."""
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                with open(path, encoding="utf-8") as fh:
                    out[module_name(path)] = (path, fh.read())
    return out


def _targets(node: ast.AST, module: str, is_package: bool, modules: set[str]) -> list[str]:
    """The zerorun modules one import statement of ``module`` names (see the module docstring)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "zerorun"]
    if node.level:  # relative: from the module's package, one package up per extra dot
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source.split(".")[0] != "zerorun":
        return []
    found = [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in modules]
    return found if len(found) == len(node.names) else [source, *found]


@functools.cache
def import_graph() -> dict[str, frozenset[str]]:
    """module -> the zerorun modules it imports (modules of zerorun only; an import of a module that is not
    there, a name from a package's ``__init__`` for instance, is an edge to the nearest module above it)."""
    modules = set(sources())
    graph = {}
    for module, (path, text) in sources().items():
        edges = set()
        for node in ast.walk(ast.parse(text, path)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, module, path.endswith("__init__.py"), modules):
                    while target not in modules and "." in target:
                        target = target.rsplit(".", 1)[0]
                    if target != module:
                        edges.add(target)
        graph[module] = frozenset(edges)
    return graph


def cycles(graph: dict[str, frozenset[str]], within: str) -> list[list[str]]:
    """One import cycle (``a -> b -> ... -> a``) per strongly connected component of more than one module, among
    the modules named ``within`` or below it (Tarjan's algorithm, iterative)."""
    nodes = sorted(m for m in graph if m == within or m.startswith(within + "."))
    inside = set(nodes)
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root] & inside)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
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
                    if len(component) > 1:
                        found.append(_one_cycle(graph, set(component)))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child] & inside))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def _one_cycle(graph: dict[str, frozenset[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the first module of ``component`` (breadth-first inside it)."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    for node in queue:
        for child in sorted(graph[node] & component):
            if child == start:
                return paths[node] + [start]
            if child not in paths:
                paths[child] = paths[node] + [child]
                queue.append(child)
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def test_the_graph_sees_every_kind_of_import():
    """The checks themselves, on made-up imports: absolute, relative, a submodule through ``from``, an import
    inside a function; a cycle; an import across a layer (today's zero/ has none to show it)."""
    modules = set(sources())
    rel = ast.parse("from . import allocator\nfrom ..errors import ZerorunError\nfrom .broadcast import x").body
    assert _targets(rel[0], "zerorun.zero.comm", False, modules) == ["zerorun.zero.allocator"]
    assert _targets(rel[1], "zerorun.zero.comm", False, modules) == ["zerorun.errors"]
    assert _targets(rel[2], "zerorun.zero", True, modules) == ["zerorun.zero.broadcast"]
    inner = ast.parse("def f():\n    from zerorun import zero, errors\n    import zerorun.launch.plan\n")
    got = [t for n in ast.walk(inner) if isinstance(n, (ast.Import, ast.ImportFrom))
           for t in _targets(n, "zerorun.x", False, modules)]
    assert got == ["zerorun.zero", "zerorun.errors", "zerorun.launch.plan"]
    fake = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"}), "d": frozenset({"a"})}
    fake = {f"z.{k}": frozenset(f"z.{v}" for v in vs) for k, vs in fake.items()}
    assert cycles(fake, "z") == [["z.a", "z.b", "z.c", "z.a"]]
    assert cycles({**fake, "z.c": frozenset()}, "z") == [] and cycles(fake, "z.d") == []
    layered = {"zerorun.zero.comm": frozenset({"zerorun.zero.flat", "zerorun.errors", "zerorun.allocator"}),
               "zerorun.zero.engine": frozenset({"zerorun.telemetry.events"}),
               "zerorun.launch.plan": frozenset({"zerorun.allocator", "zerorun.zero.paging_math"})}
    assert imports_across(layered, "zerorun.zero", zero_may_import) == [
        "zerorun.zero.engine imports zerorun.telemetry.events"]
    assert imports_across(layered, "zerorun.launch", launch_may_import) == [
        "zerorun.launch.plan imports zerorun.zero.paging_math"]


@pytest.mark.parametrize("scope", ["zerorun.zero", "zerorun.bench", "zerorun.slurm", "zerorun.telemetry",
                                   "zerorun.estimate", "zerorun.hf",
                                   "zerorun"])
def test_no_import_cycle(scope):
    found = cycles(import_graph(), scope)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def imports_across(graph: dict[str, frozenset[str]], package: str, allowed) -> list[str]:
    """``"A imports B"`` for every import of a module of ``package`` whose target ``allowed(target)`` refuses."""
    return sorted(f"{m} imports {t}" for m, targets in graph.items() if in_package(m, package)
                  for t in targets if not allowed(t))


def zero_may_import(target: str) -> bool:
    return in_package(target, "zerorun.zero") or target in ZERO_MAY_IMPORT


def launch_may_import(target: str) -> bool:
    return not in_package(target, "zerorun.zero")


def test_zero_imports_nothing_above_it():
    """The ZeRO runtime is a library (``zerorun.zero.initialize``): it may use errors, files and the rank
    allocator's torch-free names, nothing of the launcher, recipe, telemetry or CLI."""
    bad = imports_across(import_graph(), "zerorun.zero", zero_may_import)
    assert not bad, "\n".join(bad)


def test_launch_imports_nothing_of_zero():
    """The launcher never imports the runtime (nor torch with it): the allocator's names are zerorun.allocator's."""
    bad = imports_across(import_graph(), "zerorun.launch", launch_may_import)
    assert not bad, "\n".join(bad)


def test_no_file_over_400_lines():
    long = sorted(f"{os.path.relpath(path, ROOT)}: {text.count(chr(10))} lines"
                  for path, text in sources().values() if text.count("\n") > MAX_LINES)
    assert not long, "\n".join(long)


def test_at_most_6_modules_at_the_top_level():
    top = sorted(f for f in os.listdir(PACKAGE) if f.endswith(".py"))
    assert len(top) <= MAX_TOP_LEVEL, f"{len(top)} modules at zerorun/'s top level: {', '.join(top)}"


def test_run_folder_files_are_named_by_runfolder():
    """A file name of a run folder as a literal outside zerorun/runfolder.py (its one owner) is a second
    definition that a rename would miss."""
    found = sorted(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {node.value!r}"
                   for module, (path, text) in sources().items() if module != "zerorun.runfolder"
                   for node in ast.walk(ast.parse(text, path))
                   if isinstance(node, ast.Constant) and node.value in RUN_FOLDER_FILES)
    assert not found, "use zerorun.runfolder's names:\n" + "\n".join(found)


@functools.cache
def _bound_names(module: str) -> frozenset[str]:
    """The names zerorun module ``module`` binds at its top level, and every string constant in it (a
    package's lazy re-export table names its names as strings: Note [Lazy re-exports])."""
    path, text = sources()[module]
    names = set()
    tree = ast.parse(text, path)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    names.update(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str))
    return frozenset(names)


def unresolved_imports(files: list[str]) -> list[str]:
    """``"path:line: name"`` for every absolute import of zerorun in ``files`` that names a module or a name the
    tree does not have: a module moved in the layout and an import left behind (inside a function it fails only
    when that path runs, and a stale install of the old tree can hide it)."""
    modules = sources()
    bad = []
    for path in files:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                wanted = [(a.name, None) for a in node.names if a.name.split(".")[0] == "zerorun"]
            elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "zerorun":
                wanted = [(node.module, a.name) for a in node.names]
            else:
                continue
            for module, name in wanted:
                where = f"{os.path.relpath(path, ROOT)}:{node.lineno}"
                if module not in modules:
                    bad.append(f"{where}: no module {module}")
                elif name and f"{module}.{name}" not in modules and name not in _bound_names(module):
                    bad.append(f"{where}: {module} has no {name}")
    return sorted(bad)


def test_every_import_of_zerorun_resolves():
    """Every ``import zerorun...`` and ``from zerorun... import x`` in the package, tests, benchmarks and recipes
    names a module of the tree, or a name its module binds."""
    files = [os.path.join(folder, f) for top in ("zerorun", "tests", "benchmarks", "recipes")
             for folder, _, names in os.walk(os.path.join(ROOT, top)) for f in names if f.endswith(".py")]
    bad = unresolved_imports(files)
    assert not bad, "\n".join(bad)


def test_an_import_left_behind_by_a_move_is_found(tmp_path):
    """The check itself: the import inside a function that CI once failed on (``modelcheck`` had moved to
    ``zerorun.rank``), a missing module and a missing name; the right imports pass."""
    f = tmp_path / "left_behind.py"
    f.write_text("def preflight():\n    from zerorun import modelcheck\n    import zerorun.launch.gone\n"
                 "    from zerorun.errors import NoSuchError\n"
                 "    from zerorun.rank import modelcheck as ok\n    from zerorun.errors import ZerorunError\n")
    assert unresolved_imports([str(f)]) == [
        f"{os.path.relpath(str(f), ROOT)}:2: zerorun has no modelcheck",
        f"{os.path.relpath(str(f), ROOT)}:3: no module zerorun.launch.gone",
        f"{os.path.relpath(str(f), ROOT)}:4: zerorun.errors has no NoSuchError"]
