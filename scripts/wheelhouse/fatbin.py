"""Strip a CUDA library's device code down to the GPU architectures a host has.

A CUDA shared library (onnxruntime-gpu's ``libonnxruntime_providers_cuda.so``: 284 MB, of which 208 MiB is
device code for six architectures) keeps its device code in the ELF section ``.nv_fatbin``: a run of *fatbin
containers*, one per compiled translation unit, each a 16-byte header (magic ``0xBA55ED50``, version, header
size, size of the entries) followed by *entries*, one per architecture: a header (kind, header size, payload
size, the SM number as a u32 at byte 28, flags) and the payload (an nvcc-compressed cubin). The host side of
the library registers each container by its address (``.nvFatBinSegment`` points at it), and the driver
reads a container's header to find its entries and picks the one that matches the device.

:func:`strip` rewrites each container in place so that it holds only the entries of the kept architectures
(``compact``): the kept entries move to the front unchanged, the container's size field is set to their
total, and the bytes freed behind them are zeroed. Nothing outside ``.nv_fatbin`` changes, the section keeps
its size and every container keeps its address, so no relocation or pointer needs fixing; a container with no
kept entry (an sm_120-only kernel, which such a GPU cannot run anyway) is left as it is. What remains is what
nvcc writes for ``-gencode arch=compute_90a,code=sm_90a`` alone, and NVIDIA's ``cuobjdump`` lists and
extracts it (the tests check that the extracted cubins are byte-identical to the original's).

``zero`` mode keeps every entry header and zeroes the other architectures' payloads instead; ``cuobjdump``
refuses such a library ("Uncompress failed"), so it is offered for experiments only.

Standard library only: it runs on the offline host too.
"""

from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
CONTAINER_HEADER = struct.Struct("<IHHQ")       # magic, version, header size, size of the entries
ENTRY_HEADER = struct.Struct("<HHIQ")           # kind, version, header size, payload size
ARCH_OFFSET = 28                                # u32 SM number (75, 80, 86, 89, 90, 120, ...)
MODES = ("compact", "zero")


class FatbinError(ValueError):
    """The file is not an ELF library whose device code this module understands."""


@dataclass(frozen=True)
class Entry:
    offset: int          # of the entry header, in the file
    header_size: int
    payload_size: int
    arch: int

    @property
    def end(self) -> int:
        return self.offset + self.header_size + self.payload_size


@dataclass(frozen=True)
class Container:
    offset: int          # of the container header, in the file
    header_size: int
    size: int            # bytes of entries after the header
    entries: tuple[Entry, ...]

    @property
    def end(self) -> int:
        return self.offset + self.header_size + self.size


@dataclass(frozen=True)
class Section:
    name: str
    offset: int
    size: int
    nobits: bool         # .bss-like: occupies no file bytes


@dataclass
class StripReport:
    """What :func:`strip` did, with the figures a transfer plan needs."""
    mode: str
    keep: tuple[int, ...]
    original_sha256: str
    stripped_sha256: str
    bytes: int
    fatbin_bytes: int
    containers: int
    containers_untouched: int                 # no kept entry: left as they were
    entries_kept: int
    entries_removed: int
    removed_bytes_by_arch: dict[str, int] = field(default_factory=dict)
    kept_bytes_by_arch: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dict(vars(self), keep=[f"sm_{a}" for a in self.keep])


def parse_arches(spec: str) -> tuple[int, ...]:
    """``"sm_90"``, ``"sm_90a"``, ``"90"`` or a comma list → SM numbers (``sm_90`` and ``sm_90a`` share 90)."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        m = re.fullmatch(r"(?:sm_|compute_)?(\d{2,3})[af]?", item)
        if not m:
            raise FatbinError(f"not a CUDA architecture: {item!r} (write sm_90, sm_90a or 90)")
        out.append(int(m.group(1)))
    if not out:
        raise FatbinError("no CUDA architecture given")
    return tuple(sorted(set(out)))


def elf_sections(data: bytes | bytearray) -> list[Section]:
    """The section headers of a little-endian ELF64 file (x86-64 and aarch64 libraries)."""
    if data[:4] != b"\x7fELF":
        raise FatbinError("not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise FatbinError("only little-endian 64-bit ELF files are handled")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shoff == 0 or shnum == 0 or shoff + shnum * shentsize > len(data):
        raise FatbinError("the ELF file has no (or a truncated) section header table")
    raw = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = raw[shstrndx][4]

    def name(offset: int) -> str:
        start = strtab + offset
        return bytes(data[start:data.index(b"\0", start)]).decode("ascii", "replace")

    SHT_NOBITS = 8
    return [Section(name(r[0]), r[4], r[5], r[1] == SHT_NOBITS) for r in raw]


def fatbin_section(data: bytes | bytearray) -> Section:
    found = [s for s in elf_sections(data) if s.name == ".nv_fatbin"]
    if not found:
        raise FatbinError("the library has no .nv_fatbin section (no embedded CUDA device code)")
    return found[0]


def containers(data: bytes | bytearray, section: Section) -> list[Container]:
    """Every fatbin container of the section. Bytes between containers must be zero (alignment); anything
    else is a layout this module does not know, and it refuses rather than guess."""
    out, pos, end = [], section.offset, section.offset + section.size
    while pos < end:
        if end - pos < CONTAINER_HEADER.size or struct.unpack_from("<I", data, pos)[0] != FATBIN_MAGIC:
            if any(data[pos:min(pos + 8, end)]):
                raise FatbinError(f"unknown bytes in .nv_fatbin at file offset {pos:#x} (not a fatbin container)")
            pos += 8
            continue
        magic, version, header_size, size = CONTAINER_HEADER.unpack_from(data, pos)
        body, body_end = pos + header_size, pos + header_size + size
        if body_end > end:
            raise FatbinError(f"the fatbin container at {pos:#x} runs past the end of .nv_fatbin")
        entries, epos = [], body
        while epos < body_end:
            kind, _version, eh_size, payload = ENTRY_HEADER.unpack_from(data, epos)
            if eh_size < ARCH_OFFSET + 4 or epos + eh_size + payload > body_end:
                raise FatbinError(f"a malformed fatbin entry at {epos:#x}")
            arch, = struct.unpack_from("<I", data, epos + ARCH_OFFSET)
            entries.append(Entry(epos, eh_size, payload, arch))
            epos += eh_size + payload
        out.append(Container(pos, header_size, size, tuple(entries)))
        pos = body_end
    return out


def arch_bytes(path: str | Path) -> dict[str, int]:
    """Payload bytes per architecture of a library's device code (``{"sm_90": ..., ...}``)."""
    data = Path(path).read_bytes()
    totals: dict[str, int] = {}
    for c in containers(data, fatbin_section(data)):
        for e in c.entries:
            totals[f"sm_{e.arch}"] = totals.get(f"sm_{e.arch}", 0) + e.payload_size
    return dict(sorted(totals.items()))


def strip_bytes(data: bytes, keep: tuple[int, ...], mode: str = "compact") -> tuple[bytearray, StripReport]:
    """``data`` (an ELF library) with only the ``keep`` architectures' device code; see the module docstring."""
    if mode not in MODES:
        raise FatbinError(f"unknown strip mode {mode!r}: use one of {', '.join(MODES)}")
    section = fatbin_section(data)
    found = containers(data, section)
    if not any(e.arch in keep for c in found for e in c.entries):
        arches = sorted({e.arch for c in found for e in c.entries})
        raise FatbinError(f"the library holds no device code for {', '.join(f'sm_{a}' for a in keep)} "
                          f"(it has {', '.join(f'sm_{a}' for a in arches)}): stripping would leave nothing to run")
    out = bytearray(data)
    report = StripReport(mode, keep, hashlib.sha256(data).hexdigest(), "", len(data), section.size, len(found), 0,
                         0, 0)
    for c in found:
        kept = [e for e in c.entries if e.arch in keep]
        for e in c.entries:
            table = report.kept_bytes_by_arch if (e in kept or not kept) else report.removed_bytes_by_arch
            table[f"sm_{e.arch}"] = table.get(f"sm_{e.arch}", 0) + e.payload_size
        if not kept:
            report.containers_untouched += 1
            report.entries_kept += len(c.entries)
            continue
        report.entries_kept += len(kept)
        report.entries_removed += len(c.entries) - len(kept)
        if mode == "zero":
            for e in c.entries:
                if e not in kept:
                    out[e.offset + e.header_size:e.end] = bytes(e.payload_size)
            continue
        body = b"".join(data[e.offset:e.end] for e in kept)
        start = c.offset + c.header_size
        out[start:start + len(body)] = body
        out[start + len(body):c.end] = bytes(c.end - start - len(body))
        struct.pack_into("<Q", out, c.offset + 8, len(body))
    report.stripped_sha256 = hashlib.sha256(out).hexdigest()
    report.removed_bytes_by_arch = dict(sorted(report.removed_bytes_by_arch.items()))
    report.kept_bytes_by_arch = dict(sorted(report.kept_bytes_by_arch.items()))
    return out, report


CUDA_ERROR_NO_BINARY_FOR_GPU = 209


def driver_load(path: str | Path, device: int = 0) -> dict:
    """Hand every fatbin container of ``path`` to the CUDA driver (``cuModuleLoadData``, as the runtime does
    when it loads the library's modules) on GPU ``device``, and count the answers: the direct test of whether
    the driver accepts a stripped library's containers, one by one, without running anything. A container
    with no entry for the device's architecture answers ``CUDA_ERROR_NO_BINARY_FOR_GPU``, stripped or not.
    ctypes on ``libcuda.so.1``: standard library only."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise FatbinError(f"no CUDA driver here ({e})") from None

    def name(code: int) -> str:
        text = ctypes.c_char_p()
        cuda.cuGetErrorName(code, ctypes.byref(text))
        return text.value.decode() if text.value else f"CUDA error {code}"

    def call(what: str, code: int) -> None:
        if code != 0:
            raise FatbinError(f"{what}: {name(code)}")

    call("cuInit", cuda.cuInit(0))
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    call("cuDeviceGet", cuda.cuDeviceGet(ctypes.byref(dev), device))
    major, minor = ctypes.c_int(), ctypes.c_int()
    cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)      # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
    cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)
    call("cuDevicePrimaryCtxRetain", cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
    call("cuCtxSetCurrent", cuda.cuCtxSetCurrent(ctx))
    data = Path(path).read_bytes()
    found = containers(data, fatbin_section(data))
    answers: dict[str, int] = {}
    refused = []
    try:
        for c in found:
            image = ctypes.create_string_buffer(data[c.offset:c.end], c.end - c.offset)
            module = ctypes.c_void_p()
            code = cuda.cuModuleLoadData(ctypes.byref(module), image)
            answers[name(code)] = answers.get(name(code), 0) + 1
            if code == 0:
                cuda.cuModuleUnload(module)
            elif code != CUDA_ERROR_NO_BINARY_FOR_GPU or any(e.arch == major.value * 10 + minor.value
                                                              for e in c.entries):
                refused.append({"offset": c.offset, "arches": sorted({e.arch for e in c.entries}), "error": name(code)})
    finally:
        cuda.cuDevicePrimaryCtxRelease(dev)
    return {"device": f"sm_{major.value}{minor.value}", "containers": len(found), "answers": answers,
            "refused": refused[:20], "refused_count": len(refused)}


def strip(src: str | Path, dst: str | Path, keep: tuple[int, ...], mode: str = "compact") -> StripReport:
    """Write ``src`` with only the ``keep`` architectures' device code to ``dst`` (may be ``src``)."""
    out, report = strip_bytes(Path(src).read_bytes(), keep, mode)
    Path(dst).write_bytes(out)
    return report
