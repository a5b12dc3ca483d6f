"""Atomic writes and output guards."""

from __future__ import annotations

import pytest

from stratatools.core.errors import StrataError


def test_atomic_write_failure_leaves_nothing(tmp_path):
    """A rename that fails (target is a non-empty folder) is a one-line error and leaves no .tmp behind."""
    from stratatools.core.fsutil import write_bytes_atomic

    target = tmp_path / "out.bin"
    target.mkdir()
    (target / "keep").write_text("x")
    with pytest.raises(StrataError, match="is a folder"):
        write_bytes_atomic(target, b"data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]
    assert (target / "keep").read_text() == "x"


def test_cli_turns_os_errors_into_one_line(cli, monkeypatch, tmp_path):
    """An OSError that escapes a command (disk full, permission denied) is one line and exit 2."""
    import errno

    import stratatools.release.validate as release

    def boom(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x.json"))

    monkeypatch.setattr(release, "resolve_inputs", boom)
    code, out, err = cli("validate-release", "--model", tmp_path / "m.gguf")
    assert code == 2
    assert err.strip() == f"error: {tmp_path / 'x.json'}: No space left on device (check the path, free space and permissions)"
