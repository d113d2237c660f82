"""The shipped tokenizer, tracked xz-compressed (export/packed_tokenizer.py): unpacked once, checked, and
put in the user's cache where the package's folder takes no file."""

from __future__ import annotations

import hashlib
import shutil

import pytest

from export import packed_tokenizer


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    packed_tokenizer.tokenizer_json.cache_clear()
    yield tmp_path
    packed_tokenizer.tokenizer_json.cache_clear()


def test_the_unpacked_tokenizer_is_the_recorded_one(fresh):
    path = packed_tokenizer.tokenizer_json()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == packed_tokenizer.SHA256
    from export.demo import TOKENIZER_JSON
    assert TOKENIZER_JSON == path


def test_where_the_package_folder_takes_no_file_it_goes_to_the_cache(fresh, monkeypatch):
    pkg = fresh / "pkg"
    pkg.mkdir()
    shutil.copy(packed_tokenizer.PACKED, pkg / "tokenizer.json.xz")
    (pkg / "tokenizer.json").mkdir()                  # not writable as a file, even for root
    monkeypatch.setattr(packed_tokenizer, "PACKED", pkg / "tokenizer.json.xz")
    path = packed_tokenizer.tokenizer_json()
    assert path.is_relative_to(fresh / "cache" / "mossrt")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == packed_tokenizer.SHA256


def test_a_packed_file_that_unpacks_to_other_bytes_is_refused(fresh, monkeypatch):
    import lzma

    pkg = fresh / "pkg"
    pkg.mkdir()
    (pkg / "tokenizer.json.xz").write_bytes(lzma.compress(b'{"version": "1.0"}'))
    monkeypatch.setattr(packed_tokenizer, "PACKED", pkg / "tokenizer.json.xz")
    monkeypatch.setattr(packed_tokenizer, "_candidates", lambda: [pkg / "tokenizer.json"])
    with pytest.raises(RuntimeError, match="not the shipped tokenizer"):
        packed_tokenizer.tokenizer_json()
    assert not (pkg / "tokenizer.json").exists()
