"""``scripts/gpu-wheelhouse``: the project's dependencies as wheels for a host with no package index.

  build    resolve the project (extras, build requirements) for the host's Python and platform, against
           what the host already has; download exactly what it lacks (pinned, sha256-checked), optionally
           strip CUDA libraries to the host's GPU architecture; one tar.xz in parts with a manifest
  plan     which parts go with which transfer (the repository travels with each), and the commands
  join     verify every part and the whole against the manifest, then unpack
  install  a --system-site-packages venv over the host's Python, the project installed into it offline,
           then checked: onnxruntime is the wheelhouse's build with its provider, host packages untouched
  strip    strip one library's device code to some architectures (what build does to each CUDA library)
  arches   a library's device-code bytes per architecture
  driver-load  hand each fatbin container of a library to the CUDA driver and count its answers (on a GPU:
           whether the driver accepts a stripped library, container by container)

Bad input and every failure print ``gpu-wheelhouse: error: ...`` (naming the missing wheel or the bad part)
and exit 2. Standard library and pip only: it runs on the offline host before any venv exists.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from . import fatbin
from .build import auto_part_mib, build
from .install import InstallError, install
from .pack import MIB, PartsError, join, read_manifest
from .plan import DEFAULT_DEST, DEFAULT_TRANSFER_MIB, format_plan, make_plan
from .resolve import DEFAULT_PLATFORMS, ResolveError, Target, read_host_list

REPO = Path(__file__).resolve().parents[2]
HOSTS = Path(__file__).resolve().parent / "hosts"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu-wheelhouse", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="host lists shipped as data: "
                                       f"{', '.join(sorted(f.stem for f in HOSTS.glob('*.txt')))} ({HOSTS})")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    b = sub.add_parser("build", help="download what the host lacks; strip; compress; split")
    b.add_argument("--out", required=True, help="directory for the wheels, parts and manifest (put it under an "
                                                "ignored folder of the repository, e.g. .wheelhouse, to send it)")
    b.add_argument("--project", default=str(REPO), help="the project to install (default: this repository)")
    b.add_argument("--host-has", help="what the host already has: a 'pip freeze' file, or names (version unknown); "
                                      "a shipped host's name (e.g. nvidia-h200) reads that list; default: nothing")
    b.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}",
                   help="the host's Python, major.minor (default: this one's)")
    b.add_argument("--platform", action="append", help=f"wheel platform tags the host takes, repeatable (default: "
                                                       f"{', '.join(DEFAULT_PLATFORMS)})")
    b.add_argument("--implementation", default="cp", help="Python implementation tag (default cp)")
    b.add_argument("--extras", default="cuda,loadtest", help="the project's extras (default cuda,loadtest)")
    b.add_argument("--also", action="append", default=[], help="another requirement to carry, repeatable")
    b.add_argument("--replace", action="append", default=[],
                   help="carry this package even though the host has it (installed in front of the host's)")
    b.add_argument("--strip-cuda-arch", help="keep only this GPU architecture's device code in CUDA libraries "
                                             "(sm_90 keeps sm_90 and sm_90a; comma list for several)")
    b.add_argument("--strip-mode", choices=fatbin.MODES, default="compact",
                   help="compact (default): drop the other architectures' entries; zero: zero their payloads")
    b.add_argument("--part-mib", default="60", help="largest part in MiB, or 'auto': what travels beside this "
                                                    "repository in one transfer (default 60)")
    b.add_argument("--transfer-mib", type=float, default=DEFAULT_TRANSFER_MIB,
                   help=f"what one transfer holds, repository included (for --part-mib auto; default "
                        f"{DEFAULT_TRANSFER_MIB})")
    b.add_argument("--index-url", help="package index to download from (default: pip's)")
    b.add_argument("--resolver-python", help="a Python of the host's version to resolve with (default: one on "
                                             "PATH, else this one: environment markers follow it)")
    b.add_argument("--xz-preset", type=int, choices=range(0, 10), default=6, metavar="0-9", help="default 6")

    pl = sub.add_parser("plan", help="the transfers that take the parts to the host, in order")
    pl.add_argument("--parts", required=True, help="the parts directory (with manifest.json)")
    pl.add_argument("--repo", default=str(REPO), help="the repository that travels with each transfer")
    pl.add_argument("--transfer-mib", type=float, default=DEFAULT_TRANSFER_MIB)
    pl.add_argument("--dest", default=DEFAULT_DEST, help=f"where the host keeps the parts (default {DEFAULT_DEST})")

    j = sub.add_parser("join", help="verify the parts and unpack the wheelhouse")
    j.add_argument("--parts", required=True)
    j.add_argument("--out", required=True, help="directory to unpack into")

    i = sub.add_parser("install", help="a layered venv with the project installed offline, then checked")
    i.add_argument("--wheelhouse", required=True, help="an unpacked wheelhouse (join's --out, or build's --out)")
    i.add_argument("--venv", required=True, help="venv to create")
    i.add_argument("--python", default=sys.executable, help="the host's Python (default: this one)")
    i.add_argument("--project", default=str(REPO), help="the project to install (default: this repository)")
    i.add_argument("--extras", help="comma list (default: the wheelhouse's)")
    i.add_argument("--json", help="write the install's figures here")

    s = sub.add_parser("strip", help="strip one CUDA library's device code")
    s.add_argument("library")
    s.add_argument("--out", required=True)
    s.add_argument("--keep", required=True, help="architectures to keep, e.g. sm_90")
    s.add_argument("--mode", choices=fatbin.MODES, default="compact")

    a = sub.add_parser("arches", help="device-code bytes per architecture of a CUDA library")
    a.add_argument("library")

    d = sub.add_parser("driver-load", help="hand every fatbin container of a CUDA library to the CUDA driver "
                                           "(cuModuleLoadData) and count its answers (needs a GPU)")
    d.add_argument("library")
    d.add_argument("--device", type=int, default=0, help="GPU index (default 0)")
    return p


def _host_list(spec: str | None):
    if not spec:
        return {}, "nothing"
    path = Path(spec)
    if not path.exists() and (HOSTS / f"{spec}.txt").is_file():
        path = HOSTS / f"{spec}.txt"
    if not path.is_file():
        raise ValueError(f"--host-has {spec}: no such file, and no shipped host list of that name "
                         f"({', '.join(sorted(f.stem for f in HOSTS.glob('*.txt')))})")
    return read_host_list(path), path.name


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _dispatch(args)
    except (ValueError, ResolveError, PartsError, InstallError, fatbin.FatbinError, OSError) as e:
        print(f"gpu-wheelhouse: error: {e}", file=sys.stderr)
        return 2


def _dispatch(args) -> int:
    if args.command == "build":
        host, name = _host_list(args.host_has)
        target = Target(args.python_version, tuple(args.platform or DEFAULT_PLATFORMS), args.implementation)
        project = Path(args.project).resolve()
        part_mib = auto_part_mib(REPO, args.transfer_mib) if args.part_mib == "auto" else float(args.part_mib)
        manifest = build(project, Path(args.out).resolve(), target, [e for e in args.extras.split(",") if e], host,
                         name, args.also, args.replace, args.strip_cuda_arch, args.strip_mode, part_mib,
                         args.index_url, args.xz_preset, args.resolver_python)
        parts = Path(args.out).resolve() / "parts"
        try:
            print(format_plan(make_plan(parts, REPO, args.transfer_mib), manifest, parts))
        except (OSError, ValueError, subprocess.CalledProcessError) as e:   # not a git checkout: the parts stay
            print(f"(no transfer plan: {e})")
        return 0
    if args.command == "plan":
        parts = Path(args.parts).resolve()
        plan = make_plan(parts, Path(args.repo), args.transfer_mib, args.dest)
        print(format_plan(plan, read_manifest(parts), parts))
        return 2 if plan.problems else 0
    if args.command == "join":
        figures = join(Path(args.parts).resolve(), Path(args.out).resolve())
        print(f"joined {figures['parts']} part(s), {figures['archive_bytes'] / MIB:.1f} MiB, verified in "
              f"{figures['verify_s']} s, unpacked in {figures['unpack_s']} s into {args.out}")
        return 0
    if args.command == "install":
        extras = None if args.extras is None else [e for e in args.extras.split(",") if e]
        done = install(Path(args.wheelhouse).resolve(), Path(args.venv).absolute(), args.python,
                       Path(args.project).resolve(), extras)
        f = done.figures
        print(f"installed into {done.venv}: onnxruntime {f['onnxruntime']} ({f['onnxruntime_file']}), providers "
              f"{f['providers']}; {len(f['installed_from_wheelhouse'])} packages from the wheelhouse, host packages "
              f"kept" + (f"; NVIDIA libraries: {':'.join(done.library_path)}" if done.library_path else ""))
        if args.json:
            Path(args.json).write_text(json.dumps(f, indent=1) + "\n")
        return 0
    if args.command == "strip":
        report = fatbin.strip(args.library, args.out, fatbin.parse_arches(args.keep), args.mode)
        print(json.dumps(report.as_dict(), indent=1))
        return 0
    if args.command == "driver-load":
        result = fatbin.driver_load(args.library, args.device)
        print(json.dumps(result, indent=1))
        return 0 if result["refused_count"] == 0 else 1
    if args.command == "arches":
        print(json.dumps({k: v for k, v in fatbin.arch_bytes(args.library).items()}, indent=1))
        return 0
    raise AssertionError(args.command)
