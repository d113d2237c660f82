"""``build``: resolve, download, strip, repack, compress and split a wheelhouse for an offline host."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from . import fatbin
from .pack import MIB, compress, member_names, read_member, repack_wheel, sha256_file, split
from .plan import DEFAULT_TRANSFER_MIB, travelling_bytes
from .resolve import HostPackage, Resolution, Target, canonical, download, resolve

ONNXRUNTIME_DISTS = {"onnxruntime-gpu": "CUDAExecutionProvider", "onnxruntime": "CPUExecutionProvider"}
# the manifest travels with the first part, and the repository may grow a little between the build and the
# transfers (a session's commits: kilobytes; the parts are cut anew at each build, from the tree as it is then).
# Each part's margin is room the archive cannot use: 3 x 1 MiB put the documented H200 archive in 4 transfers
# once the tree reached 25.1 MiB
MANIFEST_MARGIN = 64 << 10
GROWTH_MARGIN = 256 << 10


def auto_part_mib(repo: Path, transfer_mib: float = DEFAULT_TRANSFER_MIB) -> float:
    """The largest part that travels beside the repository in one transfer, in MiB (one decimal), with 256 KiB
    to spare for the repository's growth before the parts are sent (the plan says when it outgrew them)."""
    room = transfer_mib * MIB - travelling_bytes(repo) - MANIFEST_MARGIN - GROWTH_MARGIN
    if room < MIB:
        raise ValueError(f"the repository takes {travelling_bytes(repo) / MIB:.1f} MiB of a {transfer_mib:g} MiB "
                         "transfer: no room for a part")
    return int(room / MIB * 10) / 10


def _short_version(python: str) -> str | None:
    from .resolve import _version_of
    return _version_of(python)


def _cuda_libraries(wheel: Path) -> list[str]:
    """Members of ``wheel`` that are ELF libraries with embedded CUDA device code."""
    found = []
    for name in member_names(wheel):
        if not (name.endswith(".so") or ".so." in name.rsplit("/", 1)[-1]):
            continue
        data = read_member(wheel, name)
        try:
            fatbin.fatbin_section(data)
        except fatbin.FatbinError:
            continue
        found.append(name)
    return found


def build(project: Path, out: Path, target: Target, extras: list[str], host: dict[str, HostPackage],
          host_list_name: str, also: Sequence[str] = (), replace: Sequence[str] = (), strip_arch: str | None = None,
          strip_mode: str = "compact", part_mib: float = 60.0, index_url: str | None = None, preset: int = 6,
          resolver: str | None = None, log=print) -> dict:
    """The whole build; returns the manifest (its ``wheelhouse`` entry describes what was built)."""
    t0 = time.monotonic()
    keep = fatbin.parse_arches(strip_arch) if strip_arch else None
    log(f"[wheelhouse] resolving {project.name}[{','.join(extras)}] for Python {target.python_version} "
        f"({target.platforms[0]}…) against {host_list_name} ({len(host)} host packages)")
    res: Resolution = resolve(project, extras, target, host, list(also), list(replace), index_url, resolver)
    if _short_version(res.resolver_python) != target.python_version:
        log(f"[wheelhouse] warning: no Python {target.python_version} here to resolve with (--resolver-python): "
            f"environment markers were evaluated for {res.resolver_python}")
    downloads, wheels = out / "downloads", out / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    log(f"[wheelhouse] downloading {len(res.carried())} wheel(s) (resolved with {res.resolver_python})")
    download(res, downloads, index_url)
    records, strips = [], []
    for p in res.carried():
        src = downloads / p.filename
        dst = wheels / p.filename
        replace_members: dict[str, bytes] = {}
        if keep:
            for lib in _cuda_libraries(src):
                stripped, report = fatbin.strip_bytes(read_member(src, lib), keep, strip_mode)
                replace_members[lib] = bytes(stripped)
                strips.append({"wheel": p.filename, "library": lib, **report.as_dict()})
                log(f"[wheelhouse] {p.filename}: {lib} stripped to {strip_arch} ({strip_mode}): "
                    f"{report.bytes / MIB:.1f} MiB, removed "
                    + ", ".join(f"{a} {b / MIB:.1f}" for a, b in report.removed_bytes_by_arch.items()) + " MiB")
        repack_wheel(src, dst, replace_members)
        records.append({**asdict(p), "downloaded_bytes": src.stat().st_size, "stored_bytes": dst.stat().st_size,
                        "carried_sha256": sha256_file(dst)})
    pins = {p.name: p.version for p in res.packages if p.kind == "missing"}
    host_pins = {name: h.version for name, h in sorted(host.items())
                 if h.version and name not in {canonical(r) for r in replace}}
    (out / "constraints.txt").write_text(
        "# offline install constraints: the carried wheels' versions and the host's own (kept as they are);\n"
        "# fallbacks (host has it, version unknown) are not pinned: the host's is kept when it satisfies\n"
        + "".join(f"{n}=={v}\n" for n, v in sorted({**host_pins, **pins}.items())))
    ort = next((p for p in res.packages if p.name in ONNXRUNTIME_DISTS), None)
    expect = {"dist": ort.name, "onnxruntime": ort.version, "provider": ONNXRUNTIME_DISTS[ort.name]} if ort else {}
    meta = {
        "format": 1, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python_version": target.python_version, "platforms": list(target.platforms),
        "implementation": target.implementation, "extras": list(extras), "also": list(also),
        "build_requires": [r for r in res.requirements if not r.startswith(str(project)) and r not in also],
        "host_list": host_list_name, "host_pins": host_pins, "replace": sorted(canonical(r) for r in replace),
        "resolver_python": res.resolver_python, "expect": expect,
        "wheels": records,
        "host_packages": [{"name": p.name, "version": p.version, "kind": p.kind, "bound": p.bound}
                          for p in res.packages if not p.carried],
        "strip": strips[0] if len(strips) == 1 else ({"libraries": strips} if strips else None),
    }
    (out / "wheelhouse.json").write_text(json.dumps(meta, indent=1) + "\n")
    members = [(out / "wheelhouse.json", "wheelhouse.json"), (out / "constraints.txt", "constraints.txt")]
    members += [(wheels / r["filename"], f"wheels/{r['filename']}") for r in records]
    archive = out / "mossrt-wheelhouse.tar.xz"
    log(f"[wheelhouse] compressing {sum(r['stored_bytes'] for r in records) / MIB:.1f} MiB of wheels (xz -{preset})")
    seconds = compress(members, archive, preset)
    summary = {k: meta[k] for k in ("python_version", "platforms", "extras", "expect", "strip", "host_list")}
    summary["wheels"] = [f"{r['name']}=={r['version']}" for r in records]
    summary["compress_s"] = round(seconds, 1)
    summary["build_s"] = round(time.monotonic() - t0, 1)
    manifest = split(archive, out / "parts", part_mib, summary)
    log(f"[wheelhouse] {manifest['archive']['bytes'] / MIB:.1f} MiB in {len(manifest['parts'])} part(s) of at most "
        f"{part_mib:g} MiB: {out / 'parts'} ({summary['build_s']:.0f} s)")
    return manifest
