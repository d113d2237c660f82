"""Which wheels an offline host is missing: pip's own resolver, run for the host's Python and platform.

``pip install --dry-run --ignore-installed --report`` resolves the project (with its extras and build
requirements) for the target as if nothing were installed, with the host's known versions as constraints
(so the resolution is the one the host will make: its numpy stays its numpy). Each package of the result is
then one of:

* **host**: the host has it at a known version (the constraint made the resolver take that version);
* **host, any version**: the host has it, its version is unknown, and nothing new to the host bounds it;
* **fallback**: the host has it at an unknown version and the project, a requested requirement or a package
  the host lacks puts a bound on it (``grpcio>=1.85.1``): the wheel is carried, and the offline install
  takes it only if the host's version does not satisfy. Bounds that the host's own packages put on each other
  do not count: the host's installer met them when it installed those packages;
* **missing**: the host does not have it: carried.

Standard library and pip only (pip's vendored ``packaging`` reads requirement strings).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

try:                                    # pip's own copy: the script needs nothing but pip
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet
except ImportError:                     # pragma: no cover - a pip without its vendored packaging
    from packaging.markers import default_environment
    from packaging.requirements import Requirement  # type: ignore[assignment]  # the same API, not vendored
    from packaging.specifiers import SpecifierSet  # type: ignore[assignment]

# pip 23.3 is the first to check Requires-Python against --python-version rather than the Python it runs in
# (pypa/pip#12216, fixed by #12218): an older pip resolving for 3.12 from 3.11 refuses every package that needs
# 3.12 ("requires a different Python", then ResolutionImpossible)
MIN_PIP = (23, 3)
# what pip prints that is not why it failed: its location-mismatch warnings (a distro Python's pip 23.x prints
# dozens), deprecations and notices
PIP_NOISE = re.compile(r"^(WARNING: |DEPRECATION: |\[notice\] |INFO: |(distutils|sysconfig): "
                       r"|(user|home|root|prefix) = )")
# and what says why: a Python it needs, a conflict and what caused it, a requirement nothing satisfies
PIP_CAUSE = re.compile(r"^ERROR|Requires-Python|requires a different python|conflict|depends on|user requested|"
                       r"No matching distribution|Could not find a version|ResolutionImpossible", re.IGNORECASE)
DEFAULT_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                     "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64")


class ResolveError(RuntimeError):
    """pip could not resolve the project for the target (its message says why)."""


def canonical(name: str) -> str:
    """PEP 503 name: ``PyYAML`` → ``pyyaml``, ``ml_dtypes`` → ``ml-dtypes``."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class HostPackage:
    name: str                # canonical
    version: str | None      # None: the host has it, version not known


def read_host_list(path: str | Path) -> dict[str, HostPackage]:
    """A host's packages: ``pip freeze`` lines (``name==version``), bare names (version unknown), ``#``
    comments. ``name @ url`` and ``-e ...#egg=name`` lines count as present with an unknown version."""
    out: dict[str, HostPackage] = {}
    for lineno, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if raw.strip().startswith("-e "):      # an editable install: named by #egg=, else unnamed
            if "#egg=" not in raw:
                continue
            raw = raw.rsplit("#egg=", 1)[1]
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:(?:==|===)\s*([^\s;]+)|@\s*\S+)?\s*", line)
        if not m:
            raise ValueError(f"{path}:{lineno}: not a package line (name, or name==version): {raw!r}")
        name = canonical(m.group(1))
        out[name] = HostPackage(name, m.group(2))
    return out


@dataclass
class Target:
    python_version: str                      # "3.12"
    platforms: tuple[str, ...] = DEFAULT_PLATFORMS
    implementation: str = "cp"

    @property
    def abi(self) -> str:
        return f"{self.implementation}{self.python_version.replace('.', '')}"

    def pip_args(self) -> list[str]:
        args = ["--only-binary=:all:", "--python-version", self.python_version, "--implementation", self.implementation]
        for p in self.platforms:
            args += ["--platform", p]
        return args


@dataclass
class Package:
    name: str                                # canonical
    version: str
    filename: str
    url: str
    sha256: str
    kind: str                                # "missing" | "fallback" | "host" | "host-any"
    needed_by: list[str] = field(default_factory=list)
    bound: str = ""                          # the specifiers the closure puts on it

    @property
    def carried(self) -> bool:
        return self.kind in ("missing", "fallback")


@dataclass
class Resolution:
    target: Target
    requirements: list[str]                  # what was resolved (the project with extras, build requirements)
    packages: list[Package]
    resolver_python: str

    def carried(self) -> list[Package]:
        return [p for p in self.packages if p.carried]


def build_requirements(project: Path) -> list[str]:
    """The project's ``[build-system] requires`` (the offline install builds it without isolation)."""
    data = tomllib.loads((project / "pyproject.toml").read_text(encoding="utf-8"))
    return list(data.get("build-system", {}).get("requires", []))


def resolver_python(version: str, given: str | None = None) -> str:
    """The interpreter pip resolves with: ``given``, else one of the target's version on PATH that runs and has
    pip (pip evaluates environment markers for the interpreter it runs in, not for ``--python-version``),
    else this one (markers then follow this Python: say so in the log)."""
    candidates = [given] if given else [sys.executable if _version_of(sys.executable) == version else None,
                                        shutil.which(f"python{version}")]
    for python in filter(None, candidates):
        if _version_of(python) == version and subprocess.run([python, "-m", "pip", "--version"],
                                                             capture_output=True).returncode == 0:
            return python
    if given:
        raise ResolveError(f"--resolver-python {given} is not a Python {version} with pip")
    return sys.executable


def _version_of(python: str) -> str | None:
    try:
        out = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=60)
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def pip_version(python: str) -> tuple[int, ...] | None:
    """The version of ``python -m pip`` (None: no pip there)."""
    try:
        out = subprocess.run([python, "-m", "pip", "--version"], capture_output=True, text=True, timeout=120)
    except OSError:
        return None
    return parse_pip_version(out.stdout) if out.returncode == 0 else None


def parse_pip_version(text: str) -> tuple[int, ...] | None:
    """``pip 23.2.1 from /x/site-packages/pip (python 3.11)`` → ``(23, 2, 1)``."""
    m = re.match(r"pip (\d+(?:\.\d+)*)", text.strip())
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def require_pip(python: str, version: tuple[int, ...] | None) -> None:
    """Refuse, naming the pip needed and how to get it, a pip older than :data:`MIN_PIP`."""
    need = ".".join(map(str, MIN_PIP))
    if version is None:
        raise ResolveError(f"{python} has no pip: the build needs pip {need} or later")
    if version < MIN_PIP:
        raise ResolveError(
            f"pip {'.'.join(map(str, version))} of {python} is too old: the build needs pip {need} or later (older "
            f"pips check Requires-Python against the Python they run in, not --python-version, and fail with "
            f"ResolutionImpossible). Upgrade it: {python} -m pip install --upgrade 'pip>={need}' (a venv made by "
            f"python3 -m venv brings the pip bundled with its Python), or pass --resolver-python a Python whose "
            f"pip is {need} or later")


def pip_failure_lines(output: str, limit: int = 30) -> list[str]:
    """The lines of a failed pip's output that say why (module constants): its errors and the conflict's
    causes, then its last lines, in pip's order, without its location warnings; at most ``limit``."""
    lines = [line.rstrip() for line in output.splitlines() if line.strip() and not PIP_NOISE.match(line)]
    causes = [i for i, line in enumerate(lines) if PIP_CAUSE.search(line)][-limit:]
    last = list(range(max(0, len(lines) - 5), len(lines)))
    keep = sorted(set(causes) | set(last))[-limit:]
    return [lines[i] for i in keep]


def run_pip(python: str, args: list[str], what: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([python, "-m", "pip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        why = pip_failure_lines(f"{proc.stdout}\n{proc.stderr}")
        raise ResolveError(f"pip could not {what}:\n" + "\n".join(why or ["(pip printed nothing but warnings)"]))
    return proc


def resolve(project: Path, extras: list[str], target: Target, host: dict[str, HostPackage],
            also: Sequence[str] = (), replace: Sequence[str] = (), index_url: str | None = None,
            python: str | None = None) -> Resolution:
    """Resolve ``project[extras]`` + ``also`` + its build requirements for ``target`` against ``host``."""
    replaced = {canonical(n) for n in replace}
    python = resolver_python(target.python_version, python)
    require_pip(python, pip_version(python))
    top = [f"{project}[{','.join(extras)}]" if extras else str(project), *also, *build_requirements(project)]
    with tempfile.TemporaryDirectory(prefix="wheelhouse-resolve-") as tmp:
        constraints = Path(tmp) / "host-constraints.txt"
        constraints.write_text("".join(f"{p.name}=={p.version}\n" for p in host.values()
                                       if p.version and p.name not in replaced))
        report = Path(tmp) / "report.json"
        # --target: older pips take platform options only with it (nothing is installed: --dry-run)
        args = ["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
                "--target", str(Path(tmp) / "target"),
                "-c", str(constraints), *target.pip_args(), *top]
        if index_url:
            args[1:1] = ["--index-url", index_url]
        run_pip(python, args, f"resolve {' '.join(top)} for Python {target.python_version}")
        items = json.loads(report.read_text())["install"]
    return classify(items, top, target, host, replaced, python, project)


def _marker_env(target: Target, extra: str) -> dict[str, str]:
    env = cast(dict[str, str], default_environment())       # a TypedDict of str values: keys are added below
    env.update(python_version=target.python_version, python_full_version=f"{target.python_version}.0", extra=extra)
    return env


def classify(items: list[dict], top: list[str], target: Target, host: dict[str, HostPackage], replace: set[str],
             python: str, project: Path) -> Resolution:
    """Sort pip's report into host / host-any / fallback / missing (module docstring)."""
    by_name = {canonical(i["metadata"]["name"]): i for i in items}
    project_name = next((n for n, i in by_name.items() if i["download_info"].get("dir_info") is not None), None)
    # the extras each package is asked for: pip's report gives them for the top-level requests only, so they
    # are propagated down the requirements (uvicorn[standard] from the project) until nothing changes
    extras = {n: set(i.get("requested_extras") or []) for n, i in by_name.items()}
    applies = lambda req, asked: req.marker is None or any(req.marker.evaluate(_marker_env(target, e))
                                                           for e in ["", *sorted(asked)])
    changed = True
    while changed:
        changed = False
        for n, item in by_name.items():
            for r in item["metadata"].get("requires_dist") or []:
                req = Requirement(r)
                dep = canonical(req.name)
                if req.extras and dep in extras and applies(req, extras[n]) and not set(req.extras) <= extras[dep]:
                    extras[dep] |= set(req.extras)
                    changed = True
    bounds: dict[str, list[tuple[str, str]]] = {}          # name -> [(who, specifier)]
    for n, item in by_name.items():
        for r in item["metadata"].get("requires_dist") or []:
            req = Requirement(r)
            if applies(req, extras[n]):
                bounds.setdefault(canonical(req.name), []).append((n, str(req.specifier)))
    for r in top:
        if not r.startswith(str(project)):
            req = Requirement(r)
            bounds.setdefault(canonical(req.name), []).append(("(requested)", str(req.specifier)))
    packages = []
    for item in items:
        meta, info = item["metadata"], item["download_info"]
        name = canonical(meta["name"])
        if name == project_name:
            continue
        if "archive_info" not in info or not info["url"].endswith(".whl"):
            raise ResolveError(f"{name} {meta['version']} resolved to {info['url']}, not a wheel")
        h = host.get(name)
        new_to_host = lambda who: who not in host or who in replace     # the project and "(requested)" too
        specs = [s for who, s in bounds.get(name, []) if s and new_to_host(who)]
        if h is None or name in replace:
            kind = "missing"
        elif h.version is not None:
            kind = "host"
        else:
            kind = "fallback" if specs else "host-any"
        sha = info["archive_info"].get("hashes", {}).get("sha256") or info["archive_info"]["hash"].split("=", 1)[1]
        packages.append(Package(name, meta["version"], info["url"].rsplit("/", 1)[-1], info["url"], sha, kind,
                                sorted({who for who, _ in bounds.get(name, [])}),
                                str(SpecifierSet(",".join(specs))) if specs else ""))
    packages.sort(key=lambda p: p.name)
    return Resolution(target, top, packages, python)


def download(resolution: Resolution, dest: Path, index_url: str | None = None) -> list[Path]:
    """Every carried wheel into ``dest``, pinned and checked against the sha256 the resolver saw."""
    dest.mkdir(parents=True, exist_ok=True)
    carried = resolution.carried()
    if not carried:
        return []
    with tempfile.TemporaryDirectory(prefix="wheelhouse-download-") as tmp:
        reqs = Path(tmp) / "pinned.txt"
        reqs.write_text("".join(f"{p.name}=={p.version} --hash=sha256:{p.sha256}\n" for p in carried))
        args = ["download", "--no-deps", "--quiet", "--dest", str(dest), *resolution.target.pip_args(), "-r", str(reqs)]
        if index_url:
            args[1:1] = ["--index-url", index_url]
        run_pip(resolution.resolver_python, args, "download the carried wheels")
    paths = []
    for p in carried:
        path = dest / p.filename
        if not path.is_file():
            raise ResolveError(f"pip download did not write {p.filename} ({p.name} {p.version})")
        paths.append(path)
    return paths


def offline_environment() -> dict[str, str]:
    """This process's environment with every pip setting removed and no configuration file read: an
    offline install sees the wheelhouse and nothing else (no find-links or index from the machine)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env
