"""Option bounds and repeated/unknown values found by a tester: each is one line naming the option (or file), the
place and the fix, exit 2, checked before any work starts."""

from __future__ import annotations

import io

import pytest

from stratatools.cli import run_captured
from stratatools.core import cluster as C
from stratatools.core.errors import StrataError


def _cli(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run_captured([str(a) for a in args], out, err)
    return code, out.getvalue(), err.getvalue()


# --- item: --cluster local:N has an upper bound (parser only: never start many workers here) ---

def test_cluster_local_workers_bounded(monkeypatch):
    monkeypatch.setattr(C.os, "cpu_count", lambda: 2)
    assert C.max_local_workers() == 8
    assert C.parse_local("local:8") == ("local", 8)
    assert C.parse_local("local-threads:3") == ("local-threads", 3)
    assert C.parse_local("local") == ("local", None)
    assert C.parse_local("tcp://127.0.0.1:1") is None
    for spec in ("local:9", "local:30", "local:99999", "local-threads:99999"):
        with pytest.raises(StrataError, match=r"^--cluster local(-threads)?:\d+: at most 8 local workers on this "
                                              r"machine \(4 x 2 CPUs\); use a smaller N"):
            C.parse_local(spec)
    with pytest.raises(StrataError, match="need at least one worker"):
        C.parse_local("local:0")
    monkeypatch.setattr(C.os, "cpu_count", lambda: None)
    assert C.max_local_workers() == 4


def test_cluster_local_huge_is_one_line_before_dask(monkeypatch):
    def no_dask():
        raise AssertionError("Dask imported before the spec was checked")
    monkeypatch.setattr(C, "_import", no_dask)
    with pytest.raises(StrataError, match=r"^--cluster local:99999: at most \d+ local workers"):
        with C.open_cluster("local:99999"):
            pass

