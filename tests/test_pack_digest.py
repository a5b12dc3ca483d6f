"""Digest cache for the pack's provenance sha256: used only for an unchanged file, recomputed otherwise, never a
reason for a failed pack, and the sidecar bytes do not depend on where the digest came from."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from stratatools.core import fsutil
from stratatools.core.fsutil import cached_sha256, digest_cache_dir, sha256_fd, sha256_file_cached, store_sha256
from stratatools.pack.native import NATIVE_TXT, pack_model
from stratatools.synth.model import SynthConfig, synth_release


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    d = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(d))
    monkeypatch.delenv(fsutil.DIGEST_CACHE_ENV, raising=False)
    monkeypatch.setattr(fsutil, "_DIGEST_SETTLE_NS", 0)  # the files here were written a moment ago
    return d / "stratatools" / "sha256"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    rel = synth_release(tmp_path_factory.mktemp("rel"), SynthConfig(n_layers=2, shards=1))
    return rel.canonical


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_windowed_mmap_hash_equals_hashlib(tmp_path, monkeypatch):
    monkeypatch.setattr(fsutil, "_HASH_WINDOW", 1 << 16)  # several windows and a short last one
    for n in (0, 1, (1 << 16) - 1, 1 << 16, 3 * (1 << 16) + 5):
        p = tmp_path / f"f{n}"
        p.write_bytes(os.urandom(n))
        fd = os.open(p, os.O_RDONLY)
        try:
            assert sha256_fd(fd, n) == _sha(p)
        finally:
            os.close(fd)


def test_cache_hit_then_miss_after_same_size_rewrite(cache, tmp_path):
    p = tmp_path / "m.bin"
    p.write_bytes(b"a" * 5000)
    h, hit = sha256_file_cached(p)
    assert (h, hit) == (_sha(p), False)
    assert len(list(cache.glob("*.json"))) == 1
    assert sha256_file_cached(p) == (h, True)
    # same size, other bytes, old mtime put back: ctime still tells
    st = p.stat()
    time.sleep(0.05)
    with open(p, "r+b") as fh:
        fh.write(b"b")
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert p.stat().st_size == st.st_size and p.stat().st_mtime_ns == st.st_mtime_ns
    assert cached_sha256(p) is None
    h2, hit = sha256_file_cached(p)
    assert (h2, hit) == (_sha(p), False) and h2 != h
    # a replaced file (new inode) never inherits an entry
    q = tmp_path / "q.bin"
    q.write_bytes(p.read_bytes())
    os.replace(q, p)
    assert cached_sha256(p) is None


def test_recently_modified_or_changing_file_is_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    p = tmp_path / "m.bin"
    p.write_bytes(b"x" * 100)
    st = p.stat()
    now = time.time_ns()
    assert not store_sha256(p, _sha(p), st, now)  # modified < 2 s before the hash started
    assert cached_sha256(p) is None
    assert store_sha256(p, _sha(p), st, now + 3_000_000_000)
    assert cached_sha256(p) == _sha(p)
    time.sleep(0.05)
    p.write_bytes(b"y" * 100)  # changed after st was taken: refused whatever the time
    assert not store_sha256(p, _sha(p), st, now + 10_000_000_000)


def test_corrupt_or_foreign_entries_are_ignored(cache, tmp_path):
    p = tmp_path / "m.bin"
    p.write_bytes(b"z" * 300)
    h, _ = sha256_file_cached(p)
    entry = next(cache.glob("*.json"))
    for bad in (b"\xff\xfe not json", b"[]", json.dumps({"key": {}, "sha256": "0" * 64}).encode()):
        entry.write_bytes(bad)
        assert cached_sha256(p) is None
        assert sha256_file_cached(p) == (h, False)


def test_cache_off_and_unwritable_cache(tmp_path, monkeypatch):
    p = tmp_path / "m.bin"
    p.write_bytes(b"q" * 10)
    monkeypatch.setattr(fsutil, "_DIGEST_SETTLE_NS", 0)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv(fsutil.DIGEST_CACHE_ENV, "off")
    assert digest_cache_dir() is None
    assert sha256_file_cached(p) == (_sha(p), False) == sha256_file_cached(p)
    assert not (tmp_path / "xdg").exists()
    monkeypatch.delenv(fsutil.DIGEST_CACHE_ENV)
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("x")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    assert sha256_file_cached(p) == (_sha(p), False)


def test_pack_uses_cache_and_sidecar_bytes_do_not_change(cache, model, tmp_path, monkeypatch):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    r1 = pack_model(model, a, experts_bin=True)
    assert r1.sha256_sources == {model.name: "computed"}
    r2 = pack_model(model, b, experts_bin=True)
    assert r2.sha256_sources == {model.name: "cache"}
    assert any("digest cache" in n and "--rehash" in n for n in r2.notes)
    side = NATIVE_TXT + ".json"
    assert (a / side).read_bytes() == (b / side).read_bytes()
    prov = json.loads((b / side).read_text())
    assert prov["inputs"][0]["sha256"] == prov["model"]["sha256"] == _sha(model)
    r3 = pack_model(model, c, experts_bin=True, rehash=True)
    assert r3.sha256_sources == {model.name: "computed"}
    # a lying entry (same key, other digest) is exactly what --rehash is for; it also repairs the entry
    entry = next(cache.glob("*.json"))
    rec = json.loads(entry.read_text())
    rec["sha256"] = "0" * 64
    entry.write_text(json.dumps(rec))
    assert pack_model(model, c, force=True).sha256_sources == {model.name: "cache"}
    assert pack_model(model, c, force=True, rehash=True).sha256_sources == {model.name: "computed"}
    assert json.loads((c / side).read_text())["model"]["sha256"] == _sha(model) == cached_sha256(model)
    r = pack_model(model, c, force=True, hash_inputs=False)
    assert r.sha256_sources == {} and json.loads((c / side).read_text())["model"]["sha256"] is None


def test_cli_rehash_and_json(cache, model, tmp_path, cli):
    code, out, err = cli("pack", model, "-o", tmp_path / "p", "--json")
    assert code == 0, err
    assert json.loads(out)["sha256_sources"] == {model.name: "computed"}
    code, out, err = cli("pack", model, "-o", tmp_path / "p", "--force", "--json")
    assert json.loads(out)["sha256_sources"] == {model.name: "cache"}
    code, out, err = cli("pack", model, "-o", tmp_path / "p", "--force", "--rehash", "--json")
    assert code == 0 and json.loads(out)["sha256_sources"] == {model.name: "computed"}
