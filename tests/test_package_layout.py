"""The package's shape, as the layout issue set it: no import cycle between ``deploykit``
modules (function-local imports count: they hide a cycle, they do not remove it), no import
from the package into a root script (the stages and tools sit on top of it), and no module over
:data:`MAX_LINES` lines."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.stages import ROOT

PACKAGE = ROOT / "deploykit"
MAX_LINES = 800
#: the root scripts: what users run; the package never imports them
ROOT_SCRIPTS = {p.stem for p in ROOT.glob("*.py")}


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> tuple[set[str], set[str]]:
    """(deploykit modules, root scripts) that ``path`` imports anywhere in its body."""
    me = _name(path)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found, roots = set(), set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", ""))
              in ("load_stage", "import_module") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            targets = [node.args[0].value]
        for t in targets:
            if t.split(".")[0] in ROOT_SCRIPTS:
                roots.add(t.split(".")[0])
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != me:
                found.add(t)
    return found, roots


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    files = {_name(p): p for p in PACKAGE.rglob("*.py")}
    graph, upward = {}, {}
    for m, p in files.items():
        graph[m], upward[m] = _imports(p, set(files))
    return graph, upward


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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


def test_cycle_finder_finds_a_planted_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_package():
    graph, _ = _graph()
    assert len(graph) > 50 and any(graph.values())  # the walk found the package and its imports
    assert _cycles(graph) == [], "import cycle(s) between deploykit modules"


def test_the_package_never_imports_a_root_script():
    _, upward = _graph()
    bad = {m: sorted(r) for m, r in upward.items() if r}
    assert bad == {}, f"package modules importing root scripts (move the code down): {bad}"


def test_no_module_over_the_line_limit():
    files = [*PACKAGE.rglob("*.py"), *ROOT.glob("*.py")]
    big = {str(p.relative_to(ROOT)): n for p in files
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert big == {}, f"modules over {MAX_LINES} lines (split by concern): {big}"


def test_every_name_imported_from_the_package_exists():
    """``from deploykit.x import name`` in any first-party file (root scripts, package, tests,
    benchmarks) names something ``deploykit.x`` has: a name moved between modules must be moved
    in every importer (common.py re-exports dozens)."""
    import importlib

    files = [*ROOT.glob("*.py"), *PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py"),
             *(ROOT / "benchmarks").rglob("*.py")]
    missing, checked = [], 0
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.ImportFrom) and not node.level and node.module
                    and node.module.split(".")[0] == "deploykit"):
                continue
            mod = importlib.import_module(node.module)
            for a in node.names:
                checked += 1
                if a.name != "*" and not hasattr(mod, a.name):
                    try:  # a submodule: from deploykit.quant import graph
                        importlib.import_module(f"{node.module}.{a.name}")
                    except ImportError:
                        missing.append(f"{path.relative_to(ROOT)}:{node.lineno} "
                                       f"{node.module}.{a.name}")
    assert checked > 500
    assert missing == [], missing
