"""Routing traces: the in-memory/mapped :class:`~stratatools.traces.table.TraceTable` and every file format
(Strata plain and tagged, llama-moe-trace CSV, the kit CSV, Parquet) read and written by
:mod:`stratatools.traces.formats`.

May import: :mod:`stratatools.core`.
"""
