"""scripts/gpu-wheelhouse: stripping CUDA device code, repacking wheels, parts and their manifest, the
transfer plan, and how a resolution is sorted into what the host has and what travels.

The strip tests run on ``fixtures/fatbin/libkernels.so``, a library nvcc built (``build.sh``) with compressed
cubins for sm_75/80/90a/120a in two translation units, an sm_120a-only one and cudart's own sm_75 stub: the
layout of onnxruntime-gpu's provider library in miniature. They check it with two readers that are not ours:
pyelftools for the sections and NVIDIA's ``cuobjdump`` (the nvidia-cuda-cuobjdump wheel) for the cubins.
The whole build → parts → join → offline install → gpu-check path runs in ``.ci/wheelhouse-check.sh``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from wheelhouse import fatbin, pack, plan, resolve  # noqa: E402

LIBRARY = Path(__file__).parent / "fixtures" / "fatbin" / "libkernels.so"
SCRIPT = REPO / "scripts" / "gpu-wheelhouse"


@pytest.fixture(scope="module")
def cuobjdump() -> Path:
    import nvidia

    for root in nvidia.__path__:
        found = sorted(Path(root).glob("*/bin/cuobjdump"))
        if found:
            return found[0]
    raise AssertionError("cuobjdump not found: the test extra installs nvidia-cuda-cuobjdump")


def sections(path: Path) -> dict[str, bytes]:
    with path.open("rb") as f:
        elf = ELFFile(f)
        return {s.name: s.data() for s in elf.iter_sections() if s["sh_type"] != "SHT_NOBITS"}


def fatbin_range(path: Path) -> tuple[int, int]:
    with path.open("rb") as f:
        s = ELFFile(f).get_section_by_name(".nv_fatbin")
        return s["sh_offset"], s["sh_offset"] + s["sh_size"]


def cubins(tool: Path, library: Path, workdir: Path) -> dict[str, list[bytes]]:
    """Every cubin cuobjdump extracts from ``library``, decompressed, by architecture."""
    workdir.mkdir()
    subprocess.run([str(tool), "-xelf", "all", str(library)], cwd=workdir, check=True, capture_output=True)
    out: dict[str, list[bytes]] = {}
    for f in sorted(workdir.glob("*.cubin"), key=lambda p: int(p.name.split(".")[-3])):
        out.setdefault(f.name.split(".")[-2], []).append(f.read_bytes())
    return out


def test_the_fixture_has_every_kind_of_container():
    data = LIBRARY.read_bytes()
    found = fatbin.containers(data, fatbin.fatbin_section(data))
    arches = [sorted(e.arch for e in c.entries) for c in found]
    assert sorted(arches) == [[75], [75, 80, 90, 120], [75, 80, 90, 120], [120]]


def test_compact_strip_changes_no_byte_outside_the_fatbin_section(tmp_path):
    out = tmp_path / "stripped.so"
    report = fatbin.strip(LIBRARY, out, fatbin.parse_arches("sm_90"))
    before, after = sections(LIBRARY), sections(out)
    assert list(before) == list(after)
    assert [n for n in before if before[n] != after[n]] == [".nv_fatbin"]
    start, end = fatbin_range(LIBRARY)
    a, b = LIBRARY.read_bytes(), out.read_bytes()
    assert len(a) == len(b) and a[:start] == b[:start] and a[end:] == b[end:]   # headers, tables, everything
    assert report.original_sha256 == hashlib.sha256(a).hexdigest()
    assert report.stripped_sha256 == hashlib.sha256(b).hexdigest() != report.original_sha256
    assert report.entries_removed == 6 and report.containers_untouched == 2
    assert set(report.removed_bytes_by_arch) == {"sm_75", "sm_80", "sm_120"}


def test_compact_strip_keeps_the_sm90a_cubins_byte_identical(tmp_path, cuobjdump):
    out = tmp_path / "stripped.so"
    fatbin.strip(LIBRARY, out, fatbin.parse_arches("sm_90a"))
    original, stripped = cubins(cuobjdump, LIBRARY, tmp_path / "a"), cubins(cuobjdump, out, tmp_path / "b")
    assert len(original["sm_90a"]) == 2 and stripped["sm_90a"] == original["sm_90a"]
    # what is left: the sm_90a entries, and the two containers that hold none, as they were
    assert {k: len(v) for k, v in stripped.items()} == {"sm_75": 1, "sm_90a": 2, "sm_120a": 1}
    assert stripped["sm_120a"][0] in original["sm_120a"] and stripped["sm_75"][0] in original["sm_75"]
    # and our own reading of the kept entries: header and compressed payload, byte for byte
    data, new = LIBRARY.read_bytes(), out.read_bytes()
    entry = lambda buf, e: buf[e.offset:e.end]
    kept = [entry(data, e) for c in fatbin.containers(data, fatbin.fatbin_section(data)) for e in c.entries
            if e.arch == 90]
    assert [entry(new, e) for c in fatbin.containers(new, fatbin.fatbin_section(new)) for e in c.entries
            if e.arch == 90] == kept


def test_zero_mode_keeps_every_header_and_zeroes_the_other_payloads(tmp_path):
    out = tmp_path / "zeroed.so"
    fatbin.strip(LIBRARY, out, (90,), mode="zero")
    data, new = LIBRARY.read_bytes(), out.read_bytes()
    old_c = fatbin.containers(data, fatbin.fatbin_section(data))
    new_c = fatbin.containers(new, fatbin.fatbin_section(new))
    assert old_c == new_c                                         # same containers, entries, offsets
    for c in old_c:
        has_kept = any(e.arch == 90 for e in c.entries)
        for e in c.entries:
            payload = new[e.offset + e.header_size:e.end]
            if e.arch == 90 or not has_kept:
                assert payload == data[e.offset + e.header_size:e.end]
            else:
                assert not any(payload)
            assert new[e.offset:e.offset + e.header_size] == data[e.offset:e.offset + e.header_size]


def test_strip_refuses_what_it_cannot_strip(tmp_path):
    with pytest.raises(fatbin.FatbinError, match="no device code for sm_86"):
        fatbin.strip(LIBRARY, tmp_path / "x.so", (86,))
    with pytest.raises(fatbin.FatbinError, match="no .nv_fatbin"):
        fatbin.strip(sys.executable, tmp_path / "x.so", (90,))
    (tmp_path / "text.so").write_text("not a library")
    with pytest.raises(fatbin.FatbinError, match="not an ELF"):
        fatbin.strip(tmp_path / "text.so", tmp_path / "x.so", (90,))
    damaged = bytearray(LIBRARY.read_bytes())
    start, _ = fatbin_range(LIBRARY)
    damaged[start:start + 4] = b"\x01\x02\x03\x04"             # the first container's magic
    (tmp_path / "damaged.so").write_bytes(damaged)
    with pytest.raises(fatbin.FatbinError, match="unknown bytes"):
        fatbin.strip(tmp_path / "damaged.so", tmp_path / "x.so", (90,))
    with pytest.raises(fatbin.FatbinError, match="not a CUDA architecture"):
        fatbin.parse_arches("hopper")
    assert fatbin.parse_arches("sm_90a, 90,compute_80") == (80, 90)


def test_strip_command_line(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, str(SCRIPT), *a], capture_output=True, text=True)
    ok = run("strip", str(LIBRARY), "--out", str(tmp_path / "s.so"), "--keep", "sm_90")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["keep"] == ["sm_90"]
    arches, original = json.loads(run("arches", str(tmp_path / "s.so")).stdout), fatbin.arch_bytes(LIBRARY)
    # sm_80 went; sm_75 and sm_120 stay only where a container holds no sm_90 entry
    assert sorted(arches) == ["sm_120", "sm_75", "sm_90"] and arches["sm_90"] == original["sm_90"]
    assert arches["sm_75"] < original["sm_75"] and arches["sm_120"] < original["sm_120"]
    bad = run("strip", str(LIBRARY), "--out", str(tmp_path / "s.so"), "--keep", "sm_86")
    assert bad.returncode == 2 and bad.stderr.startswith("gpu-wheelhouse: error:") and "sm_86" in bad.stderr


# ---------------------------------------------------------------------------------------------- wheels
def bundled_pip_wheel() -> Path:
    import ensurepip

    found = sorted((Path(ensurepip.__file__).parent / "_bundled").glob("pip-*.whl"))
    assert found, "ensurepip ships no pip wheel"
    return found[-1]


def test_repacked_wheel_is_stored_with_the_same_members_and_a_true_record(tmp_path):
    src = bundled_pip_wheel()
    member = "pip/__init__.py"
    new_bytes = b"# replaced\n" + pack.read_member(src, member)
    dst = tmp_path / src.name
    pack.repack_wheel(src, dst, {member: new_bytes})
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(dst) as b:
        assert [i.filename for i in a.infolist()] == [i.filename for i in b.infolist()]
        assert {i.compress_type for i in b.infolist()} == {zipfile.ZIP_STORED}
        record = next(n for n in b.namelist() if n.endswith("RECORD"))
        for line in b.read(record).decode().splitlines():
            path, digest, size = line.rsplit(",", 2)
            if digest:                                       # RECORD lists itself without a hash
                assert digest == pack.record_hash(b.read(path)) and int(size) == len(b.read(path)), path
            if path != member and path != record:
                assert b.read(path) == a.read(path)
        assert b.read(member) == new_bytes
    # pip takes it, with no index
    target = tmp_path / "target"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--target",
                           str(target), str(dst)], capture_output=True, text=True, env=resolve.offline_environment())
    assert proc.returncode == 0, proc.stderr
    assert (target / member).read_bytes() == new_bytes


# ---------------------------------------------------------------------------------------------- parts
def make_parts(tmp_path: Path, part_mib: float = 1, payload_bytes: int = 3 << 20) -> tuple[Path, dict, bytes]:
    src = tmp_path / "src"
    src.mkdir(parents=True)
    payload = hashlib.shake_256(b"wheelhouse").digest(payload_bytes)        # incompressible
    (src / "wheels").mkdir()
    (src / "wheels" / "big.whl").write_bytes(payload)
    (src / "wheelhouse.json").write_text(json.dumps({"format": 1}))
    archive = tmp_path / pack.ARCHIVE
    pack.compress([(src / "wheelhouse.json", "wheelhouse.json"), (src / "wheels" / "big.whl", "wheels/big.whl")],
                  archive, preset=0)
    parts_dir = tmp_path / "parts"
    return parts_dir, pack.split(archive, parts_dir, part_mib, {"note": "test"}), payload


def test_parts_are_within_the_limit_and_join_back(tmp_path):
    parts_dir, manifest, payload = make_parts(tmp_path)
    limit = manifest["part_limit_bytes"]
    assert limit == 1 << 20 and len(manifest["parts"]) == 4
    assert all(p["bytes"] <= limit for p in manifest["parts"])
    assert all((parts_dir / p["name"]).stat().st_size == p["bytes"] for p in manifest["parts"])
    assert not (tmp_path / pack.ARCHIVE).exists()
    figures = pack.join(parts_dir, tmp_path / "joined")
    assert (tmp_path / "joined" / "wheels" / "big.whl").read_bytes() == payload
    assert figures["parts"] == 4 and not (tmp_path / "joined" / pack.ARCHIVE).exists()


@pytest.mark.parametrize("damage, state", [("remove", "missing"), ("truncate", "short"), ("flip", "damaged"),
                                           ("extend", "long")])
def test_join_names_the_bad_part_and_unpacks_nothing(tmp_path, damage, state):
    parts_dir, manifest, _ = make_parts(tmp_path)
    victim = parts_dir / manifest["parts"][2]["name"]
    data = victim.read_bytes()
    if damage == "remove":
        victim.unlink()
    elif damage == "truncate":
        victim.write_bytes(data[:-1])
    elif damage == "flip":
        victim.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    else:
        victim.write_bytes(data + b"\0")
    with pytest.raises(pack.PartsError, match=rf"part {victim.name} is {state}"):
        pack.join(parts_dir, tmp_path / "joined")
    assert not (tmp_path / "joined").exists()


def test_join_refuses_parts_of_two_builds(tmp_path):
    parts_a, manifest_a, _ = make_parts(tmp_path / "a")
    (tmp_path / "b").mkdir()
    parts_b, manifest_b, _ = make_parts(tmp_path / "b", part_mib=1, payload_bytes=(3 << 20) + 1)
    # a consistent-looking manifest whose parts come from two builds: every part matches its own entry
    mixed = dict(manifest_a, parts=manifest_a["parts"][:3] + manifest_b["parts"][3:])
    (parts_a / pack.MANIFEST).write_text(json.dumps(mixed))
    (parts_a / manifest_b["parts"][3]["name"]).write_bytes((parts_b / manifest_b["parts"][3]["name"]).read_bytes())
    with pytest.raises(pack.PartsError, match="different builds"):
        pack.join(parts_a, tmp_path / "joined")


def test_a_part_over_the_limit_is_refused(tmp_path):
    parts_dir, manifest, _ = make_parts(tmp_path)
    manifest["part_limit_bytes"] = manifest["parts"][0]["bytes"] - 1
    (parts_dir / pack.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(pack.PartsError, match="is over the limit"):
        pack.join(parts_dir, tmp_path / "joined")


def join_cli(parts_dir: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "join", "--parts", str(parts_dir), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("where, name", [("archive", "../../victim.txt"), ("archive", "ABSOLUTE"),
                                         ("part", "../victim.txt"), ("part", "ABSOLUTE"), ("part", "sub/x.001"),
                                         ("archive", ".."), ("part", "x\0y")])
def test_a_manifest_name_that_is_a_path_is_refused_before_anything_is_written(tmp_path, where, name):
    """From the reproduction: ``"archive": {"name": "../../victim.txt"}`` overwrote and then deleted a file
    outside --out, and an absolute name with a wrong sha256 deleted it first; part names with ``../`` or an
    absolute path were read from wherever they pointed. Every name must be a plain file name in its folder;
    the manifest is refused, by name, with nothing written or removed."""
    parts_dir, manifest, _ = make_parts(tmp_path / "w" / "x")
    victim = tmp_path / "w" / "victim.txt"
    victim.write_bytes(b"keep me")
    name = str(victim) if name == "ABSOLUTE" else name
    if where == "archive":
        manifest["archive"]["name"] = name
        manifest["archive"]["sha256"] = "0" * 64          # the wrong-sha256 path deleted the file first
    else:
        manifest["parts"][1]["name"] = name
    (parts_dir / pack.MANIFEST).write_text(json.dumps(manifest))
    out = tmp_path / "w" / "x" / "out"
    proc = join_cli(parts_dir, out)
    assert proc.returncode != 0 and "is not a plain file name" in proc.stderr and repr(name) in proc.stderr, \
        proc.stderr
    assert victim.read_bytes() == b"keep me" and not out.exists()
    with pytest.raises(pack.PartsError, match="not a plain file name"):
        pack.read_manifest(parts_dir)


def test_a_part_that_is_a_symbolic_link_is_refused(tmp_path):
    """A part replaced by a symbolic link (to the real bytes, even) is refused by name: parts are regular
    files in the parts folder, read without following a link."""
    parts_dir, manifest, payload = make_parts(tmp_path)
    part = parts_dir / manifest["parts"][1]["name"]
    real = tmp_path / "elsewhere.bin"
    part.rename(real)
    part.symlink_to(real)
    with pytest.raises(pack.PartsError, match=rf"part {part.name} is a symbolic link"):
        pack.join(parts_dir, tmp_path / "joined")
    assert not (tmp_path / "joined").exists()
    proc = join_cli(parts_dir, tmp_path / "joined")
    assert proc.returncode != 0 and f"part {part.name} is a symbolic link" in proc.stderr, proc.stderr


def test_join_writes_and_removes_only_its_own_file_in_out(tmp_path):
    """A file in --out named like the archive (a link to a file outside, here) is neither followed, written
    nor removed: the joined archive is a new file of join's own, and the only one it deletes."""
    parts_dir, manifest, payload = make_parts(tmp_path)
    out = tmp_path / "joined"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"keep me")
    (out / manifest["archive"]["name"]).symlink_to(victim)
    manifest["archive"]["sha256"] = "0" * 64
    (parts_dir / pack.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(pack.PartsError, match="different builds"):
        pack.join(parts_dir, out)
    assert victim.read_bytes() == b"keep me"
    assert sorted(p.name for p in out.iterdir()) == [manifest["archive"]["name"]]      # the link, untouched


def git_repo(path: Path, ignored: str = "/.wheelhouse/", tracked_bytes: int = 1 << 20) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    (path / ".gitignore").write_text(ignored + "\n")
    (path / "code.bin").write_bytes(b"x" * tracked_bytes)
    subprocess.run(["git", "-C", str(path), "add", "-A"], check=True)
    return path


def test_plan_puts_parts_beside_the_repository_within_each_transfer(tmp_path):
    repo = git_repo(tmp_path / "repo")
    (repo / "untracked.txt").write_bytes(b"y" * 1000)          # travels too: not ignored
    parts_dir, manifest, _ = make_parts(repo / ".wheelhouse")
    p = plan.make_plan(parts_dir, repo, transfer_mib=3.5)
    assert p.problems == []
    assert p.repo_bytes == (1 << 20) + 1000 + len((repo / ".gitignore").read_bytes())
    assert all(t.bytes <= 3.5 * (1 << 20) for t in p.transfers)
    sent = [n for t in p.transfers for n in t.names]
    assert sent == [pack.MANIFEST] + [q["name"] for q in manifest["parts"]]     # in order, each once
    assert len(p.transfers) == 2
    assert p.transfers[0].carry[0] == ".wheelhouse/parts/manifest.json"
    assert "python3 scripts/gpu-check --parts /tmp/mossrt-parts" in p.transfers[-1].command
    assert all("gpu-check" not in t.command for t in p.transfers[:-1])
    text = plan.format_plan(p, manifest, parts_dir)
    assert all(q["sha256"] in text for q in manifest["parts"]) and "transfer 2/2" in text


def test_plan_says_what_cannot_travel(tmp_path):
    repo = git_repo(tmp_path / "repo", ignored="/other/", tracked_bytes=3 << 20)
    parts_dir, _, _ = make_parts(repo / ".wheelhouse")
    problems = plan.make_plan(parts_dir, repo, transfer_mib=3.5).problems
    assert any("not ignored by git" in p for p in problems)
    assert any("cannot travel" in p and "--part-mib" in p for p in problems)
    outside, _, _ = make_parts(tmp_path / "elsewhere")
    assert any("outside the repository" in p for p in plan.make_plan(outside, repo, transfer_mib=64).problems)


# ---------------------------------------------------------------------------------------------- resolution
def test_host_list_reads_freeze_lines_and_bare_names(tmp_path):
    f = tmp_path / "host.txt"
    f.write_text("# a comment\nnumpy==2.5.2\nPyYAML\nml_dtypes == 0.5.4  # trailing\n"
                 "torch @ file:///wheels/torch.whl\n-e git+https://x/y.git#egg=Local_Pkg\n\n")
    host = resolve.read_host_list(f)
    assert {n: h.version for n, h in host.items()} == {"numpy": "2.5.2", "pyyaml": None, "ml-dtypes": "0.5.4",
                                                       "torch": None, "local-pkg": None}
    f.write_text("numpy==2.5.2\nnot a package line\n")
    with pytest.raises(ValueError, match=r"host.txt:2: not a package line"):
        resolve.read_host_list(f)
    shipped = resolve.read_host_list(REPO / "scripts" / "wheelhouse" / "hosts" / "nvidia-h200.txt")
    assert shipped["onnxruntime"].version == "1.30.0" and shipped["numpy"].version == "2.5.2"
    assert "onnxruntime-gpu" not in shipped and "fastapi" not in shipped


def report_item(name, version, requires=(), extras=None, directory=False):
    info = {"url": "file:///project", "dir_info": {}} if directory else {
        "url": f"https://files.example/{name}-{version}-py3-none-any.whl",
        "archive_info": {"hashes": {"sha256": "0" * 64}}}
    item = {"download_info": info, "metadata": {"name": name, "version": version, "requires_dist": list(requires)}}
    if extras:
        item["requested_extras"] = extras
    return item


def test_resolution_is_sorted_into_host_fallback_and_missing():
    items = [
        report_item("proj", "1.0", ["numpy>=1.26", "grpcio>=1.85.1", "server[standard]>=0.27", "tqdm",
                                    "gpuonly; extra == 'cuda'"], extras=["cuda"], directory=True),
        report_item("numpy", "2.5.2"),
        report_item("grpcio", "1.85.3", ["typing-extensions>=4.12"]),
        report_item("server", "0.54", ["h11>=0.8", "uvloop>=0.15.1; extra == 'standard'",
                                       "old>=1; python_version < '3.12'"]),
        report_item("h11", "0.16"), report_item("uvloop", "0.23"), report_item("tqdm", "4.70"),
        report_item("typing-extensions", "4.16"), report_item("gpuonly", "2.0"),
        report_item("matplotlib", "3.11", ["pillow>=9"]), report_item("pillow", "13.0"),
    ]
    host = {n: resolve.HostPackage(n, v) for n, v in
            [("numpy", "2.5.2"), ("grpcio", None), ("tqdm", None), ("typing-extensions", None), ("uvloop", None),
             ("matplotlib", None), ("pillow", None)]}
    res = resolve.classify(items, ["/project[cuda]", "setuptools>=77"], resolve.Target("3.12"), host, set(),
                           sys.executable, Path("/project"))
    kinds = {p.name: p.kind for p in res.packages}
    assert kinds == {
        "numpy": "host",                    # a known version: the constraint kept it
        "grpcio": "fallback",               # the project bounds it; the host's version is unknown
        "server": "missing", "h11": "missing", "gpuonly": "missing",
        "uvloop": "fallback",               # bound by server[standard]: extras propagate below the top
        "tqdm": "host-any",                 # nothing new to the host bounds it
        "typing-extensions": "host-any",    # bound only by grpcio, itself the host's package
        "matplotlib": "host-any", "pillow": "host-any",   # host packages bounding each other
    }
    assert {p.name for p in res.carried()} == {"grpcio", "server", "h11", "gpuonly", "uvloop"}
    assert next(p for p in res.packages if p.name == "grpcio").bound == ">=1.85.1"
    replaced = resolve.classify(items, ["/project[cuda]"], resolve.Target("3.12"), host, {"numpy"},
                                sys.executable, Path("/project"))
    assert {p.name: p.kind for p in replaced.packages}["numpy"] == "missing"


# ---------------------------------------------------------------------------------------------- the real one
REAL_WHEEL = os.environ.get("MOSSRT_ORT_GPU_WHEEL")
PROVIDER_LIBRARY = "onnxruntime/capi/libonnxruntime_providers_cuda.so"


@pytest.mark.skipif(not REAL_WHEEL, reason="MOSSRT_ORT_GPU_WHEEL unset (.ci/wheelhouse-check.sh downloads the "
                                           "onnxruntime-gpu wheel and sets it)")
def test_real_provider_library_strips_to_sm90(tmp_path, cuobjdump):
    """onnxruntime-gpu's own provider library (284 MB, six architectures): stripped to sm_90, every section but
    .nv_fatbin is unchanged, cuobjdump lists only the sm_90a entries and the sm_120a-only containers, and
    the sm_90a cubins it extracts are byte-identical to the original's."""
    original = tmp_path / "original.so"
    original.write_bytes(pack.read_member(Path(REAL_WHEEL), PROVIDER_LIBRARY))
    stripped = tmp_path / "stripped.so"
    report = fatbin.strip(original, stripped, (90,))
    before, after = sections(original), sections(stripped)
    assert [n for n in before if before[n] != after[n]] == [".nv_fatbin"] and list(before) == list(after)
    listed = subprocess.run([str(cuobjdump), "--list-elf", str(stripped)], capture_output=True, text=True, check=True)
    arches = [line.rsplit(".", 2)[-2] for line in listed.stdout.splitlines() if line.strip()]
    assert set(arches) == {"sm_90a", "sm_120a"} and arches.count("sm_120a") == report.containers_untouched
    extract = lambda lib, d: (d.mkdir(), subprocess.run([str(cuobjdump), "-xelf", "sm_90a", str(lib)], cwd=d,
                                                        capture_output=True, check=True))
    extract(original, tmp_path / "a")
    extract(stripped, tmp_path / "b")
    digests = lambda d: sorted(hashlib.sha256(f.read_bytes()).hexdigest() for f in d.glob("*.cubin"))
    assert digests(tmp_path / "a") == digests(tmp_path / "b") \
        and len(digests(tmp_path / "a")) == report.entries_kept - report.containers_untouched
    print(f"stripped {report.bytes} bytes: kept {report.kept_bytes_by_arch}, removed {report.removed_bytes_by_arch}; "
          f"original sha256 {report.original_sha256}")


def test_driver_load_hands_every_container_to_the_driver():
    """On a GPU every container is loaded (an sm_120-only one answers NO_BINARY_FOR_GPU on older GPUs); here,
    with no driver, the command says so and exits 2."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "driver-load", str(LIBRARY)], capture_output=True, text=True)
    if proc.returncode == 2:
        assert "no CUDA driver here" in proc.stderr or "cuInit" in proc.stderr, proc.stderr
    else:
        result = json.loads(proc.stdout)
        assert result["containers"] == 4 and proc.returncode == (1 if result["refused_count"] else 0)


# ---------------------------------------------------------------------------------------------- pip
# pip 23.2.1 (python3.11 -m venv's bundled pip) resolving a wheel that needs Python 3.12 with --python-version
# 3.12: the ERROR line is its real output; the location warnings around it are the block a distro Python's
# pip 23.x prints for each scheme key (pip/_internal/locations), which filled the 15 lines shown before
LOCATION_WARNING = """WARNING: Value for scheme.headers does not match. Please report this to <https://github.com/pypa/pip/issues/10151>
distutils: /usr/include/python3.11/UNKNOWN
sysconfig: /usr/include/python3.11
WARNING: Additional context:
user = False
home = None
root = None
prefix = None
"""
PIP_23_2_FAILURE = LOCATION_WARNING * 3 + ("ERROR: Ignored the following versions that require a different python "
                                           """version: 1.3.3 Requires-Python >=3.12
ERROR: Cannot install mossrt[cuda]==0.1.0 because these package versions have conflicting dependencies.

The conflict is caused by:
    matplotlib 3.10.8 depends on contourpy>=1.0.1
    The user requested mossrt[cuda]==0.1.0

To fix this you could try to:
1. loosen the range of package versions you've specified
2. remove package versions to allow pip to attempt to solve the dependency conflict

ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/en/latest/topics/dependency-resolution/#dealing-with-dependency-conflicts
ERROR: Package 'newpy' requires a different Python: 3.11.7 not in '>=3.12'
""") + LOCATION_WARNING * 3


def test_a_failed_pip_shows_why_not_its_location_warnings():
    """From the reproduction: the 15 lines shown of a failed resolution were pip's location warnings and the
    cause was cut off. The lines that say why are shown, the warnings are not."""
    shown = resolve.pip_failure_lines(PIP_23_2_FAILURE)
    text = "\n".join(shown)
    assert "requires a different Python: 3.11.7 not in '>=3.12'" in text
    assert "Requires-Python >=3.12" in text and "ResolutionImpossible" in text
    assert "matplotlib 3.10.8 depends on contourpy>=1.0.1" in text
    assert not any(line.startswith(("WARNING:", "distutils:", "sysconfig:", "user =")) for line in shown), shown
    assert len(shown) <= 30


def test_the_build_needs_a_pip_that_resolves_for_the_target_python():
    """pip before 23.3 checks Requires-Python against the Python it runs in, not --python-version: the build
    refuses it at the start, naming the pip it needs and how to get it."""
    assert resolve.parse_pip_version("pip 23.2.1 from /v/lib/python3.11/site-packages/pip (python 3.11)") == (23, 2, 1)
    assert resolve.parse_pip_version("pip 26.3 from /x (python 3.12)") == (26, 3)
    assert resolve.parse_pip_version("no pip here") is None
    with pytest.raises(resolve.ResolveError, match=r"pip 23\.2\.1 of /v/bin/python is too old: .*pip 23\.3 or later"):
        resolve.require_pip("/v/bin/python", (23, 2, 1))
    with pytest.raises(resolve.ResolveError, match="has no pip"):
        resolve.require_pip("/v/bin/python", None)
    resolve.require_pip("/v/bin/python", (23, 3))
    resolve.require_pip("/v/bin/python", (26, 3))
    assert resolve.parse_pip_version(subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True,
                                                    text=True).stdout) >= resolve.MIN_PIP    # the test venv's own


def test_a_venv_with_an_old_pip_is_refused_before_resolving(tmp_path):
    """``python3 -m venv`` of a Python that bundles a pip older than 23.3 (3.11's bundles 23.2.1): ``build`` with
    it as the resolver stops at once with the message, resolving nothing (offline: ensurepip's own wheel)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
    python = str(venv / "bin" / "python")
    version = resolve.pip_version(python)
    if version is None or version >= resolve.MIN_PIP:
        pytest.skip(f"this Python bundles pip {version}: not an old one")
    major_minor = f"{sys.version_info[0]}.{sys.version_info[1]}"
    proc = subprocess.run([sys.executable, str(SCRIPT), "build", "--python-version", major_minor,
                           "--resolver-python", python, "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode != 0 and "is too old: the build needs pip 23.3 or later" in proc.stderr, proc.stderr
    assert "pip install --upgrade 'pip>=23.3'" in proc.stderr and not (tmp_path / "out" / "downloads").exists()
