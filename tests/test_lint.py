"""Types, lint and the package's import graph, checked in the tests (so in CI, through the README's test command).

mypy and ruff run as their own processes with the configuration in pyproject.toml: mypy checks ``dpprof`` with a
per-module list of modules not yet at zero errors that may only shrink (docs/architecture.md); ruff runs its small
rule set over the checkout. The import graph is read with ``ast``: no module of ``dpprof`` imports a private name
(``_x``) from another, and its imports have no cycle: neither those run on import nor those deferred into functions
(only those under ``if TYPE_CHECKING:``, never run, are not counted).
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL_TIMEOUT_S = 280  # a cold mypy run over dpprof and torch's stubs takes about 40 s on an idle 2-core machine


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=TOOL_TIMEOUT_S)


def test_mypy_finds_no_error_in_dpprof():
    done = _run("mypy")  # files, the libraries without types and the per-module list: pyproject.toml [tool.mypy]
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success: no issues found" in done.stdout


def test_ruff_finds_nothing():
    done = _run("ruff", "check", "--no-cache", "--output-format", "concise", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def _modules(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__) for every module under ``root/package``."""
    found = {}
    for f in sorted((root / package).rglob("*.py")):
        parts = list(f.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (f, is_package)
    return found


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:``: imports for annotations only, never run."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for statement in node.body for n in ast.walk(statement)}
    return skipped


def _module_level(tree: ast.Module) -> list[ast.stmt]:
    """The statements run on import: the module's body, into its if/try blocks, not into functions or classes."""
    out: list[ast.stmt] = []
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", [])
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]
    return out


def _base(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    """The absolute module a ``from ... import`` reads from, relative imports resolved."""
    if not node.level:
        return node.module or ""
    parts = name.split(".") if is_package else name.split(".")[:-1]
    parts = parts[:len(parts) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def import_graph(root: Path, package: str, deferred: bool = False) -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """The package's import edges (module -> modules it imports: module-level ones, and with ``deferred`` those inside
    functions too), and every private name one module imports from another: (importer, module, name)."""
    modules = _modules(root, package)
    edges: dict[str, set[str]] = {}
    private: list[tuple[str, str, str]] = []
    for name, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):  # anywhere, functions included
            if isinstance(node, ast.ImportFrom):
                base = _base(node, name, is_package)
                private += [(name, base, a.name) for a in node.names if base.split(".")[0] == package
                            and a.name.startswith("_") and f"{base}.{a.name}" not in modules]
        skipped = _type_checking_only(tree)
        deps: set[str] = set()
        for node in (list(ast.walk(tree)) if deferred else _module_level(tree)):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = _base(node, name, is_package)
                deps |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        edges[name] = {d for d in deps if d in modules and d != name}
    return edges, private


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_module_of_dpprof_imports_a_private_name_from_another():
    _, private = import_graph(ROOT, "dpprof")
    assert private == [], "make these public where they are shared: " + ", ".join(
        f"{importer} imports {module}.{name}" for importer, module, name in private)


@pytest.mark.parametrize("deferred", [False, True], ids=["module-level", "deferred-too"])
def test_the_imports_of_dpprof_have_no_cycle(deferred):
    edges, _ = import_graph(ROOT, "dpprof", deferred)
    assert len(edges) > 50 and any(edges.values())  # the package was read: every module, with its imports
    assert "dpprof.store.files" in edges["dpprof.store.writer"]  # the shared file helpers sit below the writer
    assert cycles(edges) == []


PACKAGE = {  # a package with one cycle (a <-> b, one edge in an if block), one deferred import, one TYPE_CHECKING import
    "__init__.py": "",
    "a.py": "from typing import TYPE_CHECKING\nfrom pkg.b import B\nif TYPE_CHECKING:\n    from pkg.c import C\n",
    "b.py": "try:\n    from . import a\nexcept ImportError:\n    a = None\nB = 1\n",
    "c.py": "from pkg.a import _hidden\ndef f():\n    from pkg.d import D\nC = 1\n",
    "d.py": "from pkg.c import C\nD = 1\n",
}


@pytest.mark.parametrize("check", ["cycles", "private"])
def test_the_import_checks_find_what_they_look_for(tmp_path, check):
    for name, text in PACKAGE.items():
        (tmp_path / "pkg").mkdir(exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    edges, private = import_graph(tmp_path, "pkg")
    if check == "cycles":  # c -> a under TYPE_CHECKING and c -> d inside a function are not module-level
        assert edges["pkg.c"] == {"pkg.a"} and edges["pkg.a"] == {"pkg.b"}
        assert cycles(edges) == [["pkg.a", "pkg.b"]]
        everywhere, _ = import_graph(tmp_path, "pkg", deferred=True)  # the import inside c.f counts; TYPE_CHECKING's not
        assert everywhere["pkg.c"] == {"pkg.a", "pkg.d"} and everywhere["pkg.a"] == {"pkg.b"}
        assert cycles(everywhere) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]
    else:
        assert private == [("pkg.c", "pkg.a", "_hidden")]


def test_every_name_the_benchmarks_and_docs_scripts_take_from_dpprof_is_there():
    """``bench/`` and ``docs/`` scripts are not run by the tests, and they import from dpprof inside functions: a
    name renamed or moved in dpprof breaks them unseen (bench/advise.py imported ``check._argv`` for a day after it
    was gone). Every ``from dpprof... import name`` in them, at any depth, names what that module holds."""
    import importlib

    missing = []
    for script in sorted([*ROOT.glob("bench/*.py"), *ROOT.glob("docs/*.py"), ROOT / "app.py"]):
        for node in ast.walk(ast.parse(script.read_text(), str(script))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "dpprof":
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if alias.name != "*" and not hasattr(module, alias.name):
                        try:  # a submodule, imported by name
                            importlib.import_module(f"{node.module}.{alias.name}")
                        except ImportError:
                            missing.append(f"{script.relative_to(ROOT)}:{node.lineno}: {node.module}.{alias.name}")
    assert not missing, missing
