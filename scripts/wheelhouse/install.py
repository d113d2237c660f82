"""Install the project from an unpacked wheelhouse into a venv that sees the host's own packages.

The venv is made ``--system-site-packages`` from the host's Python, so the host's numpy, onnx, pytest… are
used as they are; what the wheelhouse carries goes into the venv, in front of them on ``sys.path`` (that is
how onnxruntime-gpu's ``onnxruntime`` module shadows a CPU onnxruntime the host has). When the host's Python
is itself a venv (the GPU host's ``python3`` is ``/opt/torch/.venv/bin/python3``), ``--system-site-packages``
would reach the base interpreter's packages only, so the parent venv's site-packages are added behind the
new venv's own with a ``.pth`` file. pip runs with no index, no configuration file and no ``PIP_*``
variable: the wheelhouse's find-links and constraints are all it sees.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .pack import read_wheelhouse
from .resolve import canonical, offline_environment

LAYER_PTH = "mossrt-host-site-packages.pth"


class InstallError(RuntimeError):
    """The offline install failed; the message names the missing wheel or the failed check."""


@dataclass
class Installed:
    venv: Path
    python: Path
    figures: dict
    library_path: list[str]          # directories of NVIDIA's libraries the venv sees (for LD_LIBRARY_PATH)


def _run(cmd: list, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=timeout)


def python_info(python: str | Path) -> dict:
    probe = ("import json, site, sys, sysconfig; print(json.dumps({'version': '%d.%d.%d' % sys.version_info[:3], "
             "'prefix': sys.prefix, 'base_prefix': sys.base_prefix, 'purelib': sysconfig.get_paths()['purelib'], "
             "'site': [p for p in site.getsitepackages()]}))")
    proc = _run([python, "-c", probe])
    if proc.returncode != 0:
        raise InstallError(f"{python} does not run: {proc.stderr.strip()[-300:]}")
    return json.loads(proc.stdout)


def make_venv(python: str | Path, venv: Path) -> tuple[Path, dict]:
    """A ``--system-site-packages`` venv layered over ``python``'s packages (module docstring)."""
    host = python_info(python)
    made = _run([python, "-m", "venv", "--system-site-packages", venv])
    pip_in_venv = made.returncode == 0
    if not pip_in_venv:      # no ensurepip (Debian/Ubuntu without python3-venv): the host's pip serves
        made = _run([python, "-m", "venv", "--system-site-packages", "--without-pip", "--clear", venv])
        if made.returncode != 0:
            raise InstallError(f"cannot create a venv with {python}: {made.stderr.strip()[-500:]}")
    vpython = venv / "bin" / "python"
    mine = python_info(vpython)
    layered = []
    if host["prefix"] != host["base_prefix"]:   # the host's Python is a venv: its packages are not "system"
        layered = [p for p in host["site"] + [host["purelib"]] if Path(p).is_dir() and p not in layered]
        layered = list(dict.fromkeys(layered))
        (Path(mine["purelib"]) / LAYER_PTH).write_text("".join(p + "\n" for p in layered))
    pip = _run([vpython, "-m", "pip", "--version"], env=offline_environment())
    if pip.returncode != 0:
        raise InstallError(f"the venv has no pip and the host's Python lends none: {pip.stderr.strip()[-300:]}")
    return vpython, {"host_python": str(python), "host_python_version": host["version"],
                     "host_is_venv": bool(layered), "layered_site_packages": layered, "pip_in_venv": pip_in_venv,
                     "pip": pip.stdout.strip()}


MISSING_PATTERNS = (r"No matching distribution found for ([^\s]+)",
                    r"Could not find a version that satisfies the requirement ([^\s]+)",
                    r"The user requested \(constraint\) ([^\s]+)")


def missing_wheel(pip_output: str) -> str | None:
    """The requirement pip could not satisfy from the wheelhouse, if its output names one."""
    for pattern in MISSING_PATTERNS:
        m = re.search(pattern, pip_output)
        if m:
            return m.group(1)
    return None


def pip_install(vpython: Path, wheelhouse: Path, args: list[str]) -> str:
    cmd = [vpython, "-m", "pip", "install", "--no-index", "--find-links", wheelhouse / "wheels",
           "-c", wheelhouse / "constraints.txt", "--no-input", "--progress-bar", "off", *args]
    proc = _run(cmd, env=offline_environment())
    if proc.returncode != 0:
        output = proc.stdout + proc.stderr
        req = missing_wheel(output)
        if req:
            raise InstallError(f"the wheelhouse has no wheel for {req}: rebuild it with scripts/gpu-wheelhouse build "
                               f"(pip: {output.strip().splitlines()[-1][:300]})")
        tail = "\n".join(output.strip().splitlines()[-12:])
        raise InstallError(f"pip install {' '.join(str(a) for a in args)} failed offline:\n{tail}")
    return proc.stdout


CHECK = r"""
import importlib.metadata as md, json, os, sys
out = {"python": sys.version.split()[0], "sys_path": sys.path}
try:
    import onnxruntime as ort
    out.update(onnxruntime=ort.__version__, onnxruntime_file=ort.__file__, providers=ort.get_available_providers())
except Exception as e:
    out["onnxruntime_error"] = f"{type(e).__name__}: {e}"
dists = {}
for d in md.distributions():
    name = (d.metadata["Name"] or "").lower()
    if name and name not in dists:       # the first on sys.path wins, as imports do
        dists[name] = {"version": d.version, "path": str(d.locate_file(""))}
out["dists"] = dists
nv = []
for p in sys.path:
    root = os.path.join(p, "nvidia")
    if os.path.isdir(root):
        for sub in sorted(os.listdir(root)):
            lib = os.path.join(root, sub, "lib")
            if os.path.isdir(lib) and any(f.endswith(".so") or ".so." in f for f in os.listdir(lib)):
                nv.append(lib)
out["nvidia_lib_dirs"] = list(dict.fromkeys(nv))
print(json.dumps(out))
"""


def check_wheels(wheelhouse: Path, meta: dict) -> None:
    """Every wheel the wheelhouse's manifest lists is there, byte for byte; else the first missing or
    damaged one is named (before pip, whose message for a pinned wheel that is gone is a conflict)."""
    from .pack import sha256_file

    for w in meta.get("wheels", []):
        path = wheelhouse / "wheels" / w["filename"]
        needed_by = f", needed by {', '.join(w['needed_by'])}" if w.get("needed_by") else ""
        what = f"{w['name']} {w['version']}{needed_by}"
        if not path.is_file():
            raise InstallError(f"the wheelhouse has no wheel for {w['name']}: {w['filename']} ({what}) is missing; "
                               "join the parts again or rebuild with scripts/gpu-wheelhouse build")
        if w.get("carried_sha256") and sha256_file(path) != w["carried_sha256"]:
            raise InstallError(f"the wheel {w['filename']} ({what}) is damaged: its sha256 is not the wheelhouse's")


def install(wheelhouse: Path, venv: Path, python: str | Path = sys.executable, project: Path | None = None,
            extras: list[str] | None = None) -> Installed:
    """Make the venv, install the build requirements, then the project (editable) with ``extras`` (default:
    the wheelhouse's), all offline; then check what imports: onnxruntime the wheelhouse's build, with its
    provider, and every host package of a known version left as the host has it."""
    meta = read_wheelhouse(wheelhouse)
    check_wheels(wheelhouse, meta)
    project = (project or Path(meta.get("project_dir", "."))).resolve()
    extras = meta.get("extras", []) if extras is None else extras
    vpython, figures = make_venv(python, venv)
    if meta.get("build_requires"):
        pip_install(vpython, wheelhouse, list(meta["build_requires"]))
    target = f"{project}[{','.join(extras)}]" if extras else str(project)
    pip_install(vpython, wheelhouse, ["--no-build-isolation", "-e", target, *meta.get("also", [])])
    proc = _run([vpython, "-c", CHECK], env=offline_environment())
    if proc.returncode != 0:
        raise InstallError(f"the venv's Python fails its check: {proc.stderr.strip()[-500:]}")
    seen = json.loads(proc.stdout)
    dists = {canonical(k): v for k, v in seen["dists"].items()}
    expect = meta.get("expect", {})
    problems = []
    if "onnxruntime_error" in seen:
        problems.append(f"onnxruntime does not import: {seen['onnxruntime_error']}")
    else:
        if expect.get("onnxruntime") and seen["onnxruntime"] != expect["onnxruntime"]:
            problems.append(f"onnxruntime {seen['onnxruntime']} imports ({seen['onnxruntime_file']}), not the "
                            f"wheelhouse's {expect['onnxruntime']}: the host's build shadows it")
        if not str(Path(seen["onnxruntime_file"]).resolve()).startswith(str(venv.resolve())):
            problems.append(f"onnxruntime imports from {seen['onnxruntime_file']}, outside the venv")
        if expect.get("provider") and expect["provider"] not in seen["providers"]:
            problems.append(f"onnxruntime offers {seen['providers']}, not {expect['provider']}")
    replaced = []
    for name, version in (meta.get("host_pins") or {}).items():
        got = dists.get(name)
        if got is None:
            problems.append(f"the host's {name}=={version} is not visible in the venv")
        elif got["version"] != version:
            replaced.append(f"{name} {version} -> {got['version']}")
    if replaced:
        problems.append(f"host packages were replaced: {', '.join(replaced)}")
    from_wheelhouse = sorted(n for n, d in dists.items() if d["path"].startswith(str(venv.resolve())))
    figures.update(onnxruntime=seen.get("onnxruntime"), onnxruntime_file=seen.get("onnxruntime_file"),
                   providers=seen.get("providers"), installed_from_wheelhouse=from_wheelhouse,
                   nvidia_lib_dirs=seen["nvidia_lib_dirs"],
                   host_freeze=sorted(f"{n}=={d['version']}" for n, d in dists.items() if n not in from_wheelhouse))
    if problems:
        raise InstallError("; ".join(problems))
    return Installed(venv, vpython, figures, seen["nvidia_lib_dirs"])
