"""The store owns SQL (#32): no SQL statement is written outside dpprof/store/.

Every string literal (docstrings and f-string parts included) of the package, the dashboard's pages and app.py
is read with the ast module; one holding an SQL statement's keyword outside dpprof/store/ fails, naming the file
and line. Reads a run's rows through a named function of the store (dpprof.store.queries, advisor_rows,
trace_rows, finding_rows, table_rows) instead.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STORE = ROOT / "dpprof" / "store"
# An SQL statement's start, in the upper case the package writes SQL in (prose says "select" and "deleted").
SQL = re.compile(r"\b(SELECT\b|INSERT\s+(OR\s+\w+\s+)?INTO\b|UPDATE\s+\w+\s+SET\b|DELETE\s+FROM\b|"
                 r"CREATE\s+(TEMP\s+|TEMPORARY\s+|UNIQUE\s+)?(TABLE|INDEX|VIEW|TRIGGER)\b|PRAGMA\b|"
                 r"WITH\s+RECURSIVE\b|DROP\s+(TABLE|INDEX|VIEW)\b)")


def sources() -> list[Path]:
    """The files scanned: dpprof/ (but dpprof/store/), app_pages/ and app.py."""
    files = [p for p in sorted((ROOT / "dpprof").rglob("*.py")) if STORE not in p.parents]
    files += sorted((ROOT / "app_pages").rglob("*.py"))
    return files + [ROOT / "app.py"]


def sql_strings(path: Path, root: Path = ROOT) -> list[str]:
    """Each string constant of ``path`` holding an SQL keyword, as "file:line: text" (the file relative to root)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = SQL.search(node.value)
            if match:
                text = node.value[match.start():match.start() + 60].replace("\n", " ")
                found.append(f"{path.relative_to(root)}:{node.lineno}: {text!r}")
    return found


def test_the_scan_covers_the_package_pages_and_app():
    files = sources()
    names = {p.relative_to(ROOT).as_posix() for p in files}
    assert "app.py" in names and "dpprof/advise/measured.py" in names and "dpprof/trace/export.py" in names
    assert any(n.startswith("app_pages/") for n in names)
    assert not any(n.startswith("dpprof/store/") for n in names)


def test_no_sql_outside_the_store():
    found = [hit for path in sources() for hit in sql_strings(path)]
    assert not found, "SQL outside dpprof/store/ (add a named read to the store):\n" + "\n".join(found)


@pytest.mark.parametrize("text", [
    "SELECT step FROM steps",
    "select count(*) from phases",  # not SQL to the scan: lower case (prose), as below
    "INSERT INTO runs VALUES (?)",
    "INSERT OR REPLACE INTO findings VALUES (?)",
    "UPDATE runs SET status = ?",
    "DELETE FROM phases WHERE step < ?",
    "CREATE TABLE IF NOT EXISTS x (a)",
    "CREATE UNIQUE INDEX i ON x (a)",
    "PRAGMA journal_mode=WAL",
    "WITH RECURSIVE k(s) AS (VALUES (1)) SELECT s FROM k",
])
def test_the_scan_finds_sql_in_literals_and_f_strings(tmp_path, text):
    source = tmp_path / "mod.py"
    source.write_text(f"T = 'phases'\nA = {text!r}\nB = f\"{{T}} {text} {{T}}\"\n", encoding="utf-8")
    hits = sql_strings(source, tmp_path)
    expected = 0 if text.islower() else 2
    assert len(hits) == expected, hits


@pytest.mark.parametrize("text", ["the rows it selects", "deleted from the store", "update the run's status",
                                  "Created the table of findings", "a pragma of the file"])
def test_the_scan_leaves_prose_alone(tmp_path, text):
    source = tmp_path / "mod.py"
    source.write_text(f'"""{text}."""\nX = {text!r}\n', encoding="utf-8")
    assert sql_strings(source, tmp_path) == []

