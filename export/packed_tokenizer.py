"""The shipped tokenizer, stored xz-compressed (1.4 MB instead of 5.4 MB: every tracked byte travels with each
call to a lent GPU machine, docs/gpu.md) and unpacked on first use.

:func:`tokenizer_json` returns the path of the plain ``tokenizer.json``: beside the compressed one when that
folder is writable (a checkout, a venv), else in the user's cache (a read-only install), else in the
temporary folder. The unpacked bytes are checked against the sha256 recorded here, so a damaged or swapped
file fails by name rather than tokenizing differently.
"""

from __future__ import annotations

import functools
import hashlib
import lzma
import os
import tempfile
from pathlib import Path

PACKED = Path(__file__).parent / "data" / "tokenizer.json.xz"
# the MOSS-TTS-Realtime tokenizer (Qwen3 BPE with <|audio_pad|>/<|text_pad|> renamed), as upstream ships it
SHA256 = "8ee46de81f33cc48697412e40e0ed84a9e34538496552613743b48e6f3236a01"
BYTES = 5363083


def _is_current(path: Path) -> bool:
    return path.is_file() and path.stat().st_size == BYTES and hashlib.sha256(path.read_bytes()).hexdigest() == SHA256


def _candidates() -> list[Path]:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mossrt"
    name = f"tokenizer-{SHA256[:16]}.json"
    return [PACKED.with_suffix(""), cache / name, Path(tempfile.gettempdir()) / f"mossrt-{os.getuid()}" / name]


@functools.cache
def tokenizer_json() -> Path:
    """The plain tokenizer.json, unpacked (and checked) the first time."""
    places = _candidates()
    for path in places:
        if _is_current(path):
            return path
    data = lzma.decompress(PACKED.read_bytes())
    got = hashlib.sha256(data).hexdigest()
    if got != SHA256:
        raise RuntimeError(f"{PACKED}: unpacks to sha256 {got}, not the shipped tokenizer's {SHA256}")
    for path in places:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
            return path
        except OSError:
            continue
    raise RuntimeError(f"nowhere to unpack {PACKED.name}: none of {', '.join(map(str, places))} is writable")
