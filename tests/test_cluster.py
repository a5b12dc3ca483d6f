"""Dask (--cluster): trace stats, make-profile and simulate on a LocalCluster of 2 workers give byte-identical
results to the in-process path; a scheduler that does not answer is a one-line error."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("distributed")

from stratatools.core import cluster as C  # noqa: E402
from stratatools.traces.formats import write_trace  # noqa: E402

from test_trace_sources import _dataset  # noqa: E402


def test_cluster_results_equal_in_process(tmp_path, cli):
    _dataset(tmp_path / "ds", np.random.default_rng(7))
    ds = str(tmp_path / "ds")
    outs = {}
    for mode in ("in-process", "cluster"):
        extra = ["--cluster", "local-threads:2"] if mode == "cluster" else []
        code, st, err = cli("trace", "stats", ds, "--json", *extra)
        assert code == 0, err
        prof = tmp_path / f"{mode}.strp"
        code, _, err = cli("make-profile", ds, "-o", str(prof), "--n-layer", "4", "--n-expert", "8", *extra)
        assert code == 0, err
        code, sim, err = cli("simulate", "--traces", ds, "--profile", str(tmp_path / "in-process.strp"),
                             "--slots", "12", "--kfold", "3", "--report", str(tmp_path / f"rep-{mode}"), "--json",
                             *extra)
        assert code == 0, err
        outs[mode] = (json.loads(st), prof.read_bytes(), json.loads(sim))
    a, b = outs["in-process"], outs["cluster"]
    assert a[0] == b[0]
    assert a[1] == b[1]
    assert a[2] == b[2]
    assert len(a[2]["results"]) >= 6 and len(a[2]["kfold"]["folds"]) == 3


def test_unreachable_scheduler_is_one_line(tmp_path, cli, monkeypatch):
    monkeypatch.setattr(C, "CONNECT_TIMEOUT_S", 1.0)
    t = tmp_path / "t.parquet"
    from test_trace_sources import _table

    write_trace(_table(np.random.default_rng(1), 8), t, "parquet")
    code, out, err = cli("trace", "stats", str(t), "--cluster", "tcp://127.0.0.1:9")
    assert code == 2 and "no Dask scheduler answered" in err and len(err.strip().splitlines()) == 1
    code, out, err = cli("trace", "stats", str(t), "--cluster", "udp://x")
    assert code == 2 and "unknown (use local" in err


def _flaky(marker: str) -> int:
    import os

    if not os.path.exists(marker):
        open(marker, "w").close()
        raise OSError("worker lost")
    return 42


def _broken() -> int:
    raise RuntimeError("boom")


def test_tasks_are_retried_and_failures_are_one_line(tmp_path):
    from stratatools.core.errors import StrataError

    with C.open_cluster("local-threads:2") as client:
        assert C.run_tasks(client, _flaky, [(str(tmp_path / "m"),)], name="flaky") == [42]
        with pytest.raises(StrataError, match=r"^broken 0 failed on the cluster after 2 retries: boom$"):
            C.run_tasks(client, _broken, [()], name="broken")


def test_a_worker_process_killed_mid_task_is_retried_and_never_partial(tmp_path):
    """A LocalCluster of 2 worker processes: a task whose worker process is killed mid-task (SIGKILL, the first
    time it runs) is rerun by Dask and the results equal the in-process ones; a task that kills every worker
    it runs on ends in one line naming it, never in a partial result."""
    from stratatools.core.errors import StrataError

    marker = str(tmp_path / "killed")

    def square_once_killed(i: int) -> int:
        import os
        import signal

        if i == 2 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)  # the worker process dies mid-task
        return i * i

    def always_killed() -> int:
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
        return 0

    args = [(i,) for i in range(5)]
    with C.open_cluster("local:2") as client:
        got = C.run_tasks(client, square_once_killed, args, name="square")
        assert (tmp_path / "killed").exists()  # the kill happened
        assert got == [square_once_killed(*a) for a in args] == [0, 1, 4, 9, 16]
        with pytest.raises(StrataError, match=r"^killed 0 failed on the cluster after 2 retries: ") as e:
            C.run_tasks(client, always_killed, [()], name="killed")
        assert len(str(e.value).splitlines()) == 1


def test_every_cluster_option_states_its_worker_bound(cli):
    """Each command that takes --cluster says in its help how many local workers it allows (the bound
    core.cluster enforces), not only the ones written first."""
    import re

    want = f"at most {C.MAX_WORKERS_PER_CPU} x the CPU count"
    for cmd in (["trace", "stats"], ["make-profile"], ["simulate"], ["tune"]):
        code, out, err = cli(*cmd, "--help")
        assert code == 0, err
        text = re.sub(r"[\s│|]+", " ", out)  # the help box wraps and frames the text
        assert "--cluster" in text and want in text, (cmd, text[-1500:])
