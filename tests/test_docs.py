"""The README and the docs site: the site builds with ``mkdocs build --strict``, the README stays short, the dashboard's
pages are shown as pictures, and every shell command in the README and docs/ runs as written after the set-up line.

Shell commands are the lines of the fenced ``bash`` blocks. The fast ones (listing, showing and exporting a run, and the
shell lines that activate the environment and set ``RUN``) run in bash, in order, from a directory laid out as a checkout after set-up
(``.venv`` is this interpreter's environment, ``reports/`` holds a run the CPU backend recorded), with the
environment's ``bin`` on ``PATH`` as ``source .venv/bin/activate`` leaves it. The slow ones (installs, ``streamlit
run``, training, the pre-flight check, calibrating, benchmarks, files a user brings) are checked without being run: a ``dpprof`` command
parses under the CLI's own argparse parser, and a script, requirements file or app it names exists.
"""
from __future__ import annotations

import itertools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dpprof.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
MAX_README_LINES = 300  # issue 32: a README a newcomer reads in a few screens; the rest is the docs site
MAX_PNG_BYTES = 300 * 1024  # the pictures are committed: docs/screenshots.py keeps each under this
# dpprof subcommands that read or write a stored run without loading torch, in about a second on an idle machine
# (no training, no calibration, no files a user must bring): these run as written. `dpprof check` imports torch
# (over 20 s under a load average of 8 here), so it is parsed, like the commands that train.
FAST_SUBCOMMANDS = {"runs", "show", "export"}
SHELL_LANGS = {"bash", "sh", "shell"}


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def shell_commands(path: Path) -> list[tuple[int, str]]:
    """(line number, command) for every command line of the file's fenced bash blocks; a trailing backslash joins
    lines, blank lines and whole-line comments are left out."""
    commands: list[tuple[int, str]] = []
    lang: str | None = None
    pending, start = "", 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            lang = None if lang is not None else (line[3:].strip() or "text")
            continue
        if lang not in SHELL_LANGS:
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        command = (pending + line).strip()
        pending = ""
        if command and not command.startswith("#"):
            commands.append((start, command))
    return commands


def _segments(command: str) -> list[list[str]]:
    """The simple commands of a shell line, split at ``&&``, ``||``, ``;``, ``|`` and braces, comments dropped."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|{}()")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    segments: list[list[str]] = [[]]
    for token in lexer:
        if token and set(token) <= set(";&|{}()"):
            segments.append([])
        else:
            segments[-1].append(token)
    return [s for s in segments if s]


def _dpprof_argv(words: list[str]) -> list[str] | None:
    """The arguments a segment passes to dpprof's CLI, or None when the segment does not run dpprof."""
    if not words:
        return None
    program = words[0]
    if program.endswith("/dpprof") or program == "dpprof":
        return words[1:]
    if (program == "torchrun" or program.endswith(("python", "python3"))) and "-m" in words \
            and words[words.index("-m") + 1:words.index("-m") + 2] == ["dpprof"]:
        return words[words.index("-m") + 2:]
    return None


def _subcommand(argv: list[str]) -> str | None:
    words = [w for w in argv if not w.startswith("-")]
    if "--reports-dir" in argv:
        words = words[1:]
    return words[0] if words else None


def _is_fast(command: str) -> bool:
    """Runs in about a second as written: a dpprof command that reads a run, or a shell line that sets RUN."""
    if command.startswith("RUN=$(ls ") or command == "source .venv/bin/activate":
        return True
    segments = _segments(command)
    argv = _dpprof_argv(segments[0])
    if argv is None or any(_dpprof_argv(s) is not None for s in segments[1:]):
        return False
    return argv in (["--help"], ["-h"]) or _subcommand(argv) in FAST_SUBCOMMANDS


def _check_parses(where: str, command: str) -> None:
    """A command that is not run: its dpprof arguments parse, and the files it names from the checkout exist."""
    for words in _segments(command):
        argv = _dpprof_argv(words)
        if argv is not None:
            try:
                build_parser().parse_args(argv)
            except SystemExit as exit_:
                assert exit_.code == 0, f"{where}: `{command}` does not parse under dpprof's CLI (exit {exit_.code})"
            continue
        program = words[0]
        if program.endswith(("python", "python3")):
            scripts = [w for w in words[1:] if w.endswith(".py")]
            for script in scripts:
                if script.startswith(("bench/", "docs/", "tests/")):
                    assert (ROOT / script).is_file(), f"{where}: `{command}` names {script}, which is missing"
        elif program.startswith("bench/"):
            assert (ROOT / program).is_file(), f"{where}: `{command}` names {program}, which is missing"
        elif program.endswith("streamlit"):
            assert words[1:3] == ["run", "app.py"] and (ROOT / "app.py").is_file(), f"{where}: `{command}`"
        elif program.endswith("pip"):
            for flag, value in itertools.pairwise(words):
                if flag == "-r":
                    assert (ROOT / value).is_file(), f"{where}: `{command}` names {value}, which is missing"


def test_the_readme_fits_on_a_few_screens():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines, over {MAX_README_LINES}: move detail to docs/"


def test_the_readmes_links_reach_files_and_headings_of_the_checkout():
    """README.md is not part of the site, so mkdocs does not check its links: each reaches a file, and its #anchor a
    heading of that page (slugged as the site's table of contents slugs them)."""
    from markdown.extensions.toc import slugify

    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", README.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        page = ROOT / target if target else README
        assert page.exists(), f"README.md links to {target}, which is missing"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE)
            assert anchor in {slugify(h, "-") for h in headings}, f"README.md links to {target}#{anchor}: no such heading"


def test_the_files_the_docs_name_exist():
    """A path of the checkout written in code (`dpprof/store/sketch.py`, `bench/overhead.py`) names a file that is
    there: a module renamed or moved fails here until the docs follow it."""
    pattern = re.compile(r"`((?:dpprof|bench|tests|app_pages|docs)/[\w./-]+)`")
    named = {(path.name, m) for path in _markdown_files() for m in pattern.findall(path.read_text())}
    assert len(named) >= 30, "fewer paths than the docs name: is the pattern broken?"
    missing = sorted(f"{page}: {name}" for page, name in named if not (ROOT / name).exists())
    assert not missing, "the docs name files that are not in the checkout:\n" + "\n".join(missing)


def test_the_set_up_lines_are_the_ones_ci_runs():
    """The README's two set-up lines, byte for byte: .ci/run runs the test line verbatim, and the docs repeat both."""
    readme = [c for _, c in shell_commands(README) if c.startswith(("python3 -m venv", "{ [ -x /usr/bin/chromium ]"))]
    assert len(readme) == 2, "the README should hold the set-up line and the test line"
    setup, test_line = readme
    assert setup.endswith(".venv/bin/streamlit run app.py") and "dpprof profile cifar-lenet" in setup
    assert test_line.endswith(".venv/bin/python -m pytest")
    assert test_line in (ROOT / ".ci" / "run").read_text().splitlines(), ".ci/run must run the README's test line"
    started = [c for _, c in shell_commands(DOCS / "getting-started.md")]
    assert setup in started and test_line in started, "docs/getting-started.md should show the README's set-up lines"


def test_the_docs_show_every_dashboard_page_as_a_picture():
    """Each page app.py registers has a section in docs/dashboard.md with its picture, committed and small."""
    titles = [t for t in re.findall(r'st\.Page\([^)]*title="([^"]+)"', (ROOT / "app.py").read_text()) if t != "Home"]
    assert len(titles) >= 9, titles
    page = (DOCS / "dashboard.md").read_text()
    for title in titles:
        section = re.search(rf"^## {re.escape(title)}\n\n!\[[^\]]*\]\((img/[^)]+\.png)\)", page, re.MULTILINE)
        assert section, f"docs/dashboard.md has no section '## {title}' opening with its picture"
        png = DOCS / section.group(1)
        assert png.is_file(), f"{png} is missing: run docs/screenshots.py"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{png} is not a PNG"
        assert png.stat().st_size < MAX_PNG_BYTES, f"{png} is {png.stat().st_size:,} bytes, over {MAX_PNG_BYTES:,}"
    assert "](docs/img/overview.png)" in README.read_text(), "the README shows the Overview's picture"


def test_mkdocs_builds_the_site_strictly(tmp_path):
    """A broken link, a missing page or image, a page left out of the nav or an API name that moved fails the build."""
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                           "--site-dir", str(site)], cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}{done.stderr}"
    for page in sorted(DOCS.glob("*.md")):
        built = site / ("index.html" if page.stem == "index" else f"{page.stem}/index.html")
        assert built.is_file(), f"{page.name} was not built"
    api = (site / "api" / "index.html").read_text()
    for name in ("parallel.DataParallel", "parallel.cpu_devices", "recording.record", "instrument.instrument",
                 "store.load_run", "store.list_runs", "devices.check_balance"):
        assert f'id="dpprof.{name}"' in api, f"the API page does not render dpprof.{name} from its docstring"


def test_every_command_that_is_not_run_parses():
    slow = [(f"{path.name}:{n}", c) for path in _markdown_files() for n, c in shell_commands(path) if not _is_fast(c)]
    assert len(slow) >= 20, "fewer shell commands than the docs hold: is the extraction broken?"
    for where, command in slow:
        _check_parses(where, command)


@pytest.mark.slow
def test_the_fast_commands_run_as_written(tmp_path):
    """README's and the docs' fast commands, in order, as a user types them after set-up and `source
    .venv/bin/activate`, in a checkout whose reports/ holds a recorded run."""
    venv = Path(sys.prefix)
    if not (venv / "bin" / "activate").is_file():
        pytest.skip(f"not run from a virtual environment ({sys.prefix} has no bin/activate), as the set-up makes")
    from recorded import record  # the CPU backend's real recording

    checkout = tmp_path / "checkout"
    (checkout / "reports").mkdir(parents=True)
    (checkout / ".venv").symlink_to(venv)
    for name in ("bench", "app.py", "docs"):
        (checkout / name).symlink_to(ROOT / name)
    record(checkout / "reports", "docs", workers=2, steps=24, batch_size=30, workload="tutorial-linear")

    seen: set[str] = set()
    lines = ["set -o pipefail"]
    fast = 0
    for path in _markdown_files():
        for number, command in shell_commands(path):
            key = repr(_segments(command))  # the same command with other spacing or comment runs once
            if not _is_fast(command) or key in seen:
                continue
            seen.add(key)
            fast += 1
            where = shlex.quote(f"{path.name}:{number}: {command}")
            lines.append(f"{command}\nrc=$?; [ $rc -eq 0 ] || {{ echo FAILED $rc: {where} >&2; exit 1; }}")
    assert fast >= 10, f"only {fast} fast commands found"
    env = {k: v for k, v in os.environ.items() if k not in ("DPPROF_REPORTS", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(ROOT),
               XDG_CACHE_HOME=str(tmp_path / "cache"), HOME=str(tmp_path))
    done = subprocess.run(["bash", "-c", "\n".join(lines)], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=240, check=False)
    assert done.returncode == 0, f"{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert (checkout / "csv" / "steps.csv").is_file() and (checkout / "run.json.gz").is_file()
