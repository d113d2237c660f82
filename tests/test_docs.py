"""The documentation says what the code does: every relative link in the README and ``docs/`` leads to a file
(and a heading, where it names one), every ``--flag`` they mention is a flag of one of our commands (or of a
named outside tool), every test they name is a test of that file, the table of settings and the error catalogue
are the ones the code generates, and the README stays a five-minute read that keeps its two set-up commands."""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]+")
# flags of outside tools the docs show in their commands (pip, venv, docker/podman, helm, local-ai, cuobjdump)
OUTSIDE_FLAGS = {"--no-index", "--find-links", "--only-binary", "--platform", "--ignore-installed", "--dry-run",
                 "--report", "--system-site-packages", "--format", "--gpus", "--secret", "--create-namespace",
                 "--external-grpc-backends", "--list-elf", "--help"}
# a test as the docs name it: `tests/test_x.py`, `tests/test_x.py::test_y[id]`, or a bare `test_y`
TEST_FILE = re.compile(r"(tests/[\w/.-]+\.py)(?:::(\w+(?:::\w+)*)(?:\[[^\]]*\])?)?")
TEST_NAME = re.compile(r"(test_\w+)(?:\[[^\]]*\])?")
SETUP = ["python3 -m venv .venv && .venv/bin/pip install -e '.[cpu]' && .venv/bin/mossrt serve",
         "python3 -m venv .venv && .venv/bin/pip install -e '.[cpu,test]' && .venv/bin/python -m pytest -q"]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[`*_]", lambda m: "_" if m.group() == "_" else "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_leads_somewhere(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.name}: {broken}"


def test_every_doc_is_reached_from_the_readme():
    reached = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md") if t.partition("#")[0]}
    assert not [d.name for d in DOCS if d.resolve() not in reached]


def named_tests(page: Path) -> list[tuple[str | None, str | None, str]]:
    """(file, test, as written) for each test a page names in a code span. A bare ``test_y`` in clients.md (whose
    every line names the test beside it) is of the test file named last above it in its section; elsewhere, or
    with none above it, of any test file (file None)."""
    found, current = [], None
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    for m in re.finditer(r"^#{1,6} .*$|`([^`]+)`", text, flags=re.M):
        span = m.group(1)
        if span is None:                                         # a heading: a new section
            current = None
        elif named := TEST_FILE.fullmatch(span):
            if Path(named.group(1)).name.startswith("test_"):
                current = named.group(1)
            found.append((named.group(1), named.group(2), span))
        elif bare := TEST_NAME.fullmatch(span):
            found.append((current if page.name == "clients.md" else None, bare.group(1), span))
    return found


def defined_tests(path: Path) -> set[str]:
    """The test functions of a test file, as pytest names them (``test_x``, ``TestY::test_x``)."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            names |= {f"{node.name}::{f.name}" for f in node.body
                      if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name.startswith("test")}
    return names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_named_test_exists(page):
    every = set().union(*(defined_tests(path) for path in (ROOT / "tests").rglob("test_*.py")))
    missing = []
    for file, test, written in named_tests(page):
        if file is not None and not (ROOT / file).is_file():
            missing.append(f"{written} (no such file)")
        elif test is not None and test not in (defined_tests(ROOT / file) if file else every):
            missing.append(f"{written} (no such test in {file or 'tests/'})")
    assert not missing, f"{page.name}: {missing}"


def _options(parser: argparse.ArgumentParser) -> set[str]:
    found = set()
    for action in parser._actions:
        found.update(o for o in action.option_strings if o.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _options(sub)
    return found


def our_flags() -> set[str]:
    from export.codec_agreement import build_parser as codec_agreement_parser
    from loadtest.cli import build_parser as loadtest_parser
    from mossrt.cli import build_parser

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from wheelhouse.cli import _parser as wheelhouse_parser
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    check = "".join(subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--help"], capture_output=True,
                                   text=True, timeout=60, check=True).stdout
                    for script in ("gpu-check", "normalization-storm"))
    return (_options(build_parser()) | _options(loadtest_parser()) | _options(wheelhouse_parser())
            | _options(codec_agreement_parser())
            | set(FLAG.findall(check)))


def test_every_documented_flag_exists():
    known = our_flags() | OUTSIDE_FLAGS
    unknown = {}
    for page in PAGES:
        for flag in set(FLAG.findall(page.read_text(encoding="utf-8"))) - known:
            unknown.setdefault(flag, []).append(page.name)
    assert not unknown, unknown


def _between(page: Path, marker: str) -> str:
    text = page.read_text(encoding="utf-8")
    m = re.search(rf"<!-- {marker}:begin -->\n(.*?)\n<!-- {marker}:end -->", text, flags=re.S)
    assert m, f"{page.name} has no {marker} markers"
    return m.group(1)


def test_the_settings_table_is_the_generated_one():
    from app.settings import settings_table

    assert _between(ROOT / "docs" / "operations.md", "settings-table") == settings_table(), \
        "docs/operations.md's settings table differs: paste app.settings.settings_table()"


def test_the_error_catalogue_is_the_generated_one():
    from app.errors import catalogue_table

    assert _between(ROOT / "docs" / "errors.md", "error-catalogue") == catalogue_table(), \
        "docs/errors.md's catalogue differs: paste app.errors.catalogue_table()"


def test_the_readme_is_short_and_keeps_its_two_set_up_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 300
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S)
    assert [b for b in blocks if b in SETUP] == SETUP, "the README's two set-up commands, in this order"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert ".venv/bin/pip install -q -e '.[cpu,test]'" in ci and ".venv/bin/python -m pytest -q" in ci
