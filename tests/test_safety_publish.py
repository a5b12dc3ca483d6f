"""Publishing outputs: an existing output is never replaced without --force, even by two runs at once (the check
and the rename used to be separate steps); a Ctrl-C / SIGTERM around a folder swap either leaves the old output
(before the swap) or lets the command finish with exit 0 (after it), with no temp or lock left either way."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from pathlib import Path

import pytest

from stratatools.core import fsutil
from stratatools.core.errors import StrataError
from stratatools.core.fsutil import guard_output, publish_dir, write_bytes_atomic


def _leftovers(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if "stratatools-" in n)


# ---------------------------------------------------------------------------------------- no-replace files
def test_file_that_appears_after_the_check_is_not_replaced(tmp_path):
    """guard_output (no --force) passed while the output was absent; another run then wrote it: the publish
    refuses (one line, exit 2) and leaves the other run's bytes and no temp."""
    out = tmp_path / "same.csv"
    guard_output(out, [], False)
    out.write_bytes(b"the other run's trace\n")
    with pytest.raises(StrataError, match=r"same\.csv: already exists \(pass --force") as ei:
        write_bytes_atomic(out, b"mine\n")
    assert ei.value.exit_code == 2
    assert out.read_bytes() == b"the other run's trace\n" and _leftovers(tmp_path) == []


def test_force_still_replaces_and_an_own_output_can_be_rewritten(tmp_path):
    out = tmp_path / "t.bin"
    out.write_bytes(b"old")
    guard_output(out, [], True)
    write_bytes_atomic(out, b"new")
    assert out.read_bytes() == b"new"
    fresh = tmp_path / "fresh.bin"
    guard_output(fresh, [], False)
    write_bytes_atomic(fresh, b"1")  # published no-replace ...
    write_bytes_atomic(fresh, b"2")  # ... then it is this run's own file: a rewrite replaces it
    assert fresh.read_bytes() == b"2"


def test_files_atomic_set_is_published_no_replace(tmp_path):
    a, b = tmp_path / "p.strp", tmp_path / "p.strp.json"
    guard_output(a, [], False)
    guard_output(b, [], False)
    a.write_bytes(b"theirs")
    with pytest.raises(StrataError, match="already exists"):
        fsutil.write_files_atomic([(a, b"mine"), (b, b"{}")])
    assert a.read_bytes() == b"theirs" and not b.exists() and _leftovers(tmp_path) == []


def test_rename_noreplace_fallback_without_renameat2(tmp_path, monkeypatch):
    """Where renameat2 is missing, the hard-link publish gives the same answer."""
    monkeypatch.setattr(fsutil, "_renameat2", lambda a, b, flags: False)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(b"1")
    fsutil.rename_noreplace(src, dst)
    assert dst.read_bytes() == b"1" and not src.exists()
    src.write_bytes(b"2")
    with pytest.raises(FileExistsError):
        fsutil.rename_noreplace(src, dst)
    assert dst.read_bytes() == b"1" and src.exists()


def _racer(path: str, payload: bytes, barrier, q) -> None:
    try:
        guard_output(path, [], False)  # both pass: the output is absent
        barrier.wait(timeout=30)
        write_bytes_atomic(path, payload)
        q.put(("ok", payload))
    except StrataError as e:
        q.put(("err", str(e)))


def test_two_processes_racing_to_publish_one_path(tmp_path):
    """Two runs (processes) at once, no --force: exactly one publishes, the other gets the one-line error, the
    winner's bytes are intact and no temp is left."""
    ctx = mp.get_context("fork")
    out = tmp_path / "same.csv"
    for rnd in range(3):
        if out.exists():
            out.unlink()
        barrier, q = ctx.Barrier(2), ctx.Queue()
        payloads = [b"A" * 100_000 + bytes([rnd]), b"B" * 200_000 + bytes([rnd])]
        ps = [ctx.Process(target=_racer, args=(str(out), p, barrier, q)) for p in payloads]
        for p in ps:
            p.start()
        res = [q.get(timeout=60) for _ in ps]
        for p in ps:
            p.join(60)
        oks = [r[1] for r in res if r[0] == "ok"]
        errs = [r[1] for r in res if r[0] == "err"]
        assert len(oks) == 1 and len(errs) == 1, res
        assert "already exists (pass --force" in errs[0] and "\n" not in errs[0]
        assert out.read_bytes() == oks[0]
        assert _leftovers(tmp_path) == []


# --------------------------------------------------------------------------------------- folder outputs
def test_folder_published_meanwhile_is_not_replaced(tmp_path):
    """The caller's "already exists" check runs again under the lock: a run that checked before another run
    published (and took the lock after it finished) refuses instead of swapping over it."""
    out = tmp_path / "rel"

    def refuse(t: Path) -> None:
        if (t / "release.json").exists():
            raise StrataError(f"{t / 'release.json'}: already exists (pass --force to replace the release)")

    refuse(out)  # our early check: absent
    with publish_dir(out) as st:  # the other run publishes first
        (st / "release.json").write_text("theirs")
    with pytest.raises(StrataError, match="already exists"):
        with publish_dir(out, refuse=refuse) as st:
            (st / "release.json").write_text("mine")
    assert (out / "release.json").read_text() == "theirs" and _leftovers(tmp_path) == []


def test_synth_refuses_a_release_published_while_it_was_built(tmp_path, cli, monkeypatch):
    """synth without --force checked (absent), then another synth published the release before the swap."""
    from stratatools.synth import model as synth_model

    out = tmp_path / "rel"
    real = synth_model._write_release

    def other_run_first(stage, cfg, progress, t0):
        info = real(stage, cfg, progress, t0)
        out.mkdir()
        (out / "release.json").write_text("theirs")
        return info

    monkeypatch.setattr(synth_model, "_write_release", other_run_first)
    code, _o, err = cli("synth", out, "--layers", 2, "--experts", 8, "--keep", 4, "--swap", 1, "--seed", 1)
    assert code == 2 and "release.json: already exists (pass --force" in err, err
    assert sorted(os.listdir(out)) == ["release.json"] and _leftovers(tmp_path) == []


# -------------------------------------------------------------------------- signals around the folder swap
def _synth(cli, out: Path, *extra) -> tuple[int, str, str]:
    return cli("synth", out, "--layers", 2, "--experts", 8, "--keep", 4, "--swap", 1, *extra)


@pytest.fixture()
def old_release(tmp_path, cli):
    out = tmp_path / "rel"
    code, _o, err = _synth(cli, out, "--seed", 3)
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    return out, before


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_signal_before_the_swap_leaves_the_old_release(tmp_path, cli, monkeypatch, old_release, sig):
    from stratatools.cli import entry

    out, before = old_release
    handler = entry._interrupted if sig == "SIGINT" else entry._terminated
    real = fsutil._fsync_tree

    def fsync_then_signal(folder):  # the last step before the swap
        real(folder)
        handler(getattr(signal, sig), None)

    monkeypatch.setattr(fsutil, "_fsync_tree", fsync_then_signal)
    code, _o, err = _synth(cli, out, "--seed", 2, "--force")
    assert code == 128 + getattr(signal, sig), err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("where", ["right_after_the_swap", "removing_the_old_release"])
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_signal_after_the_swap_completes_with_exit_0(tmp_path, cli, monkeypatch, old_release, sig, where):
    """A signal that lands once the new release is in place is dropped: the command finishes (its "wrote" line),
    exits 0, the release is the new one, complete, and the old one, temp and lock are gone."""
    from stratatools.cli import entry

    out, before = old_release
    handler = entry._interrupted if sig == "SIGINT" else entry._terminated
    sent = []
    if where == "right_after_the_swap":
        real_x = fsutil._renameat2_exchange

        def exchange_then_signal(a, b):
            r = real_x(a, b)
            if r:
                sent.append(1)
                handler(getattr(signal, sig), None)
            return r

        monkeypatch.setattr(fsutil, "_renameat2_exchange", exchange_then_signal)
        real_rn = os.rename

        def rename_then_signal(a, b, *x, **k):  # the fallback swap (no RENAME_EXCHANGE): the second rename
            real_rn(a, b, *x, **k)
            if Path(b) == out and not sent:
                sent.append(1)
                handler(getattr(signal, sig), None)

        monkeypatch.setattr(os, "rename", rename_then_signal)
    else:
        real_rm = fsutil._remove_tree

        def remove_after_signal(p):
            if not sent:
                sent.append(1)
                handler(getattr(signal, sig), None)
            real_rm(p)

        monkeypatch.setattr(fsutil, "_remove_tree", remove_after_signal)
    code, _o, err = _synth(cli, out, "--seed", 2, "--force")
    monkeypatch.undo()
    assert sent and code == 0, (code, err)
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert after.keys() == before.keys() and after != before
    assert b'"seed": 2' in after["release.json"]
    assert _leftovers(tmp_path) == []
    # the new release is complete: a fresh synth of the same config writes the same bytes
    code, _o, err = _synth(cli, tmp_path / "again", "--seed", 2)
    assert code == 0 and {p.name: p.read_bytes() for p in (tmp_path / "again").iterdir()} == after


def test_a_folder_published_inside_another_keeps_ctrl_c_working(tmp_path, monkeypatch):
    """The demo publishes step outputs (a synth release, a pack) inside its own folder output: the inner swap
    drops signals only until its clean-up ends (Ctrl-C still stops the demo); the outer, final swap makes the
    CLI's process ignore SIGINT/SIGTERM to its exit."""
    from stratatools.cli import entry

    monkeypatch.setitem(fsutil._DEFER, "cli", True)
    old_int, old_term = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        with publish_dir(tmp_path / "demo") as outer:
            with publish_dir(outer / "rel") as inner:
                (inner / "release.json").write_text("{}")
            assert signal.getsignal(signal.SIGINT) is old_int and not fsutil._DEFER["committed"]
            with pytest.raises(KeyboardInterrupt):
                entry._interrupted(signal.SIGINT, None)
            (outer / "index.md").write_text("x")
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        entry._interrupted(signal.SIGINT, None)  # dropped: the demo is out
        entry._terminated(signal.SIGTERM, None)
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
        fsutil.cli_signals(False)
    assert (tmp_path / "demo" / "rel" / "release.json").exists() and _leftovers(tmp_path) == []
