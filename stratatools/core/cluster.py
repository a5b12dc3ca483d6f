"""Dask, when one machine is not enough: ``--cluster local[:N]`` starts a ``distributed.LocalCluster`` of N worker
processes (default: one per core; N is at most ``MAX_WORKERS_PER_CPU`` x the CPU count, see ``max_local_workers``),
``--cluster tcp://HOST:PORT`` connects to a running scheduler
(``dask scheduler`` on one machine, ``dask worker tcp://HOST:PORT`` on the others); without ``--cluster`` every
command runs in-process (the default). ``local-threads[:N]`` runs the workers as threads of this process (for
tests and for machines where starting processes is slow).

What runs as tasks (every task opens its trace files itself and streams them; results are combined in input order,
so they are byte-identical to the in-process path): ``trace stats`` and ``make-profile`` count per file
(partition) and combine; ``simulate``/``compare`` run every (budget, policy, profile) replay, every k-fold fold and
the in-sample run as a task. A task that fails is retried (``RETRIES``) on another worker; a result is never
silently partial: when a task still fails, the command fails with one line naming it.

Dask (``dask[distributed]``, the ``dask`` extra) is imported only when ``--cluster`` is given.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from stratatools.core.errors import StrataError

CONNECT_TIMEOUT_S = 10.0
RETRIES = 2
MAX_WORKERS_PER_CPU = 4


def max_local_workers() -> int:
    """The largest N that ``--cluster local[:N]`` / ``local-threads[:N]`` accepts: ``MAX_WORKERS_PER_CPU`` x the
    CPU count of this machine (``os.cpu_count()``, 1 when unknown). More workers than that only contend for the
    cores (and each process worker holds its own interpreter's memory)."""
    return MAX_WORKERS_PER_CPU * max(1, os.cpu_count() or 1)


def parse_local(spec: str) -> tuple[str, int | None] | None:
    """``("local" | "local-threads", N or None)`` for a local spec (N None: Dask's default, one per core); None
    for any other spec. Checked before Dask is imported or any worker starts.

    Raises:
        StrataError: N not a whole number, < 1 or > ``max_local_workers()``.
    """
    s = spec.strip()
    if not (s == "local" or s.startswith("local:") or s == "local-threads" or s.startswith("local-threads:")):
        return None
    kind, _, n = s.partition(":")
    try:
        workers = int(n) if n else None
    except ValueError:
        raise StrataError(f"--cluster {spec}: expected {kind}[:N] with N a number of workers") from None
    if workers is not None and workers < 1:
        raise StrataError(f"--cluster {spec}: need at least one worker")
    top = max_local_workers()
    if workers is not None and workers > top:
        raise StrataError(f"--cluster {spec}: at most {top} local workers on this machine "
                          f"({MAX_WORKERS_PER_CPU} x {top // MAX_WORKERS_PER_CPU} CPUs); use a smaller N, or "
                          f"tcp://HOST:PORT for a multi-machine cluster")
    return kind, workers


def _import():
    try:
        import distributed
    except ImportError:
        raise StrataError("--cluster needs Dask: pip install 'stratatools[dask]' (dask[distributed])") from None
    return distributed


@contextmanager
def open_cluster(spec: str | None, timeout: float | None = None) -> Iterator[Any]:
    """A ``distributed.Client`` for ``spec`` (module docstring), closed (and a local cluster stopped) on exit;
    None when ``spec`` is None (the in-process path).

    Raises:
        StrataError: Dask not installed; a malformed spec; a scheduler that does not answer within ``timeout``.
    """
    if not spec:
        yield None
        return
    timeout = CONNECT_TIMEOUT_S if timeout is None else timeout
    local = parse_local(spec)
    distributed = _import()
    import logging

    for name in ("distributed", "distributed.scheduler", "distributed.worker", "distributed.nanny",
                 "distributed.core", "distributed.http.proxy"):
        logging.getLogger(name).setLevel(logging.ERROR)
    s = spec.strip()
    cluster = None
    if local is not None:
        kind, workers = local
        try:
            cluster = distributed.LocalCluster(n_workers=workers, threads_per_worker=1,
                                               processes=(kind == "local"), dashboard_address=None,
                                               silence_logs=logging.ERROR)
            client = distributed.Client(cluster, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - any start-up failure is one line
            if cluster is not None:
                cluster.close()
            raise StrataError(f"--cluster {spec}: the local cluster did not start ({str(e).splitlines()[0][:160]})") \
                from None
    elif s.startswith("tcp://") or s.startswith("tls://"):
        try:
            client = distributed.Client(s, timeout=timeout)
        except (OSError, TimeoutError) as e:
            raise StrataError(f"--cluster {spec}: no Dask scheduler answered within {timeout:g} s "
                              f"({type(e).__name__}); start one with `dask scheduler` or use --cluster local") \
                from None
    else:
        raise StrataError(f"--cluster {spec}: unknown (use local, local:N or tcp://HOST:PORT)")
    try:
        yield client
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


def run_tasks(client, fn: Callable, args: Sequence[tuple], *, name: str = "task", progress=None) -> list:
    """``[fn(*a) for a in args]`` as Dask tasks (retried ``RETRIES`` times on another worker), results in
    order. ``progress``: ``update(advance=1)`` per finished task.

    Raises:
        StrataError: the task's own StrataError (one line), or one line naming the task that failed for
            another reason (a worker that died more than ``RETRIES`` times, an exception).
    """
    distributed = _import()
    futs = [client.submit(fn, *a, pure=False, retries=RETRIES, key=f"{name}-{i}-{id(args)}")
            for i, a in enumerate(args)]
    index = {f.key: i for i, f in enumerate(futs)}
    out: list = [None] * len(futs)
    try:
        for f in distributed.as_completed(futs):
            try:
                out[index[f.key]] = f.result()
            except StrataError:
                raise
            except Exception as e:  # noqa: BLE001
                msg = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
                raise StrataError(f"{name} {index[f.key]} failed on the cluster after {RETRIES} retries: {msg}") \
                    from None
            if progress is not None:
                progress.update(advance=1)
    finally:
        for f in futs:
            f.cancel()
    return out


__all__ = ["open_cluster", "run_tasks", "CONNECT_TIMEOUT_S", "RETRIES"]
