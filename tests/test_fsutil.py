"""Atomic writes and output guards."""

from __future__ import annotations

import pytest

from stratatools.errors import StrataError


def test_atomic_write_failure_leaves_nothing(tmp_path):
    """A rename that fails (target is a non-empty folder) is a one-line error and leaves no .tmp behind."""
    from stratatools.fsutil import write_bytes_atomic

    target = tmp_path / "out.bin"
    target.mkdir()
    (target / "keep").write_text("x")
    with pytest.raises(StrataError, match="cannot write"):
        write_bytes_atomic(target, b"data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]
    assert (target / "keep").read_text() == "x"
