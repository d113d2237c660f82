"""The code checks the team relies on, as part of the suite (so `.ci/run` and the README's test command run
them): ruff's lint and import order, and mypy (strict on ``engine/`` and ``app/session/``), both configured
in pyproject.toml. A finding fails the test with the checker's own report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_tool(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_ruff_finds_nothing():
    r = run_tool("ruff", "check", "--no-cache", "--output-format", "concise", ".")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


def test_mypy_finds_nothing(tmp_path):
    # the files and the strictness per package come from pyproject.toml; a cache of its own keeps the
    # checkout clean and every run complete
    r = run_tool("mypy", "--cache-dir", str(tmp_path / "mypy_cache"), "--no-error-summary")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


def test_mypy_is_strict_where_configured(tmp_path):
    """(A guard on the configuration itself: an untyped function in engine/ is a finding, one in
    export/ is not.)"""
    code = "def untyped(x):\n    return x\n"
    for module, finding in (("engine", True), ("export", False)):
        pkg = tmp_path / module
        pkg.mkdir()
        (pkg / "__init__.py").write_text("")
        (pkg / "probe.py").write_text(code)
        r = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                            "--cache-dir", str(tmp_path / "mypy_cache"), "-m", f"{module}.probe"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert ("no-untyped-def" in r.stdout) == finding, (module, r.stdout)
