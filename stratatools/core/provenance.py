"""Provenance sidecars: ``<output>.json`` beside every profile or pack stratatools writes.

A sidecar records the tool version, what kind of artefact it is, every input with its sha256 (and weight
where inputs are merged), the model and allocation the artefact was built for (sha256, revision when the
release registry knows it), and the options. ``profile-diff``, ``remap-profile`` and ``validate-release``
read it to tell which release a profile was built for.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from stratatools.core.version import __version__
from stratatools.core.errors import StrataError
from stratatools.core.fsutil import sha256_file_cached, write_json_atomic

SIDECAR_SUFFIX = ".json"
FORMAT = "stratatools-provenance/1"


def sidecar_path(artifact: str | os.PathLike) -> Path:
    """``<artifact>.json`` (e.g. ``profile.bin.json``)."""
    p = Path(artifact)
    return p.with_name(p.name + SIDECAR_SUFFIX)


def describe_file(path: str | os.PathLike, weight: float | None = None, role: str | None = None) -> dict[str, Any]:
    """{path, name, size_bytes, sha256[, weight][, role]} of an input file."""
    p = Path(path)
    d: dict[str, Any] = {"name": p.name, "path": str(p), "size_bytes": p.stat().st_size, "sha256": sha256_file_cached(p)[0]}
    if weight is not None:
        d["weight"] = float(weight)
    if role is not None:
        d["role"] = role
    return d


def describe_shards(paths: list[str | os.PathLike]) -> list[dict[str, Any]]:
    """{name, size_bytes, sha256} of each model file, the digest taken from the digest cache only (a pack or a
    validate-release run of the model fills it); ``sha256`` is None when it is not cached, so that describing
    a multi-GB model never re-reads it."""
    from stratatools.core.fsutil import cached_sha256

    out = []
    for f in paths:
        fp = Path(f)
        out.append({"name": fp.name, "size_bytes": fp.stat().st_size, "sha256": cached_sha256(fp)})
    return out


def build(kind: str, inputs: list[dict[str, Any]], options: dict[str, Any] | None = None,
          model: dict[str, Any] | None = None, allocation: dict[str, Any] | None = None,
          extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Assemble a provenance record.

    Args:
        kind: ``"profile"``, ``"pack"``, ...
        inputs: :func:`describe_file` dicts.
        options: the command's options (JSON-able).
        model: {sha256, name, n_layers, n_expert, revision?} of the model the artefact is for.
        allocation: {sha256, name, revision?} of the allocation map it is for.
    """
    rec: dict[str, Any] = {"format": FORMAT, "tool": "stratatools", "tool_version": __version__, "kind": kind,
                           "inputs": inputs, "options": options or {}}
    if model is not None:
        rec["model"] = model
    if allocation is not None:
        rec["allocation"] = allocation
    if extra:
        rec.update(extra)
    return rec


def write_sidecar(artifact: str | os.PathLike, record: dict[str, Any]) -> Path:
    """Write ``record`` atomically next to ``artifact``; returns the sidecar path. Deterministic bytes.

    When the record has no ``output`` entry and the artifact exists, ``output`` = {name, sha256} of the
    artifact is added, so a reader can tell a sidecar left behind by a replaced artifact.
    """
    p = sidecar_path(artifact)
    a = Path(artifact)
    if "output" not in record and a.is_file():
        from stratatools.core.fsutil import sha256_file

        record = dict(record, output={"name": a.name, "sha256": sha256_file(a)})
    write_json_atomic(p, record)
    return p


def write_with_sidecar(artifact: str | os.PathLike, data: bytes, record: dict[str, Any],
                       inputs: "list[str | os.PathLike] | tuple" = ()) -> Path:
    """Write ``data`` to ``artifact`` and ``record`` to its sidecar as one set (both temps written first, so a
    full disk leaves neither; the sidecar is renamed first, the artefact last). ``output`` = {name, sha256} of
    ``data`` is added to the record when absent. Returns the sidecar path. Raises StrataError (one line)."""
    import hashlib

    from stratatools.core.fsutil import _json_default, write_files_atomic

    a = Path(artifact)
    if "output" not in record:
        record = dict(record, output={"name": a.name, "sha256": hashlib.sha256(data).hexdigest()})
    p = sidecar_path(a)
    text = json.dumps(record, indent=2, sort_keys=True, default=_json_default) + "\n"
    write_files_atomic([(p, text.encode("utf-8")), (a, data)], inputs)
    return p


def read_sidecar(artifact: str | os.PathLike) -> dict[str, Any] | None:
    """The sidecar of ``artifact`` or None when there is none. Raises StrataError when it is not valid JSON."""
    p = sidecar_path(artifact)
    if not p.exists():
        return None
    try:
        rec = json.loads(p.read_text(encoding="utf-8"))
    except RecursionError:
        raise StrataError(f"{p}: not a valid provenance sidecar (nested too deeply); delete it or regenerate the "
                          f"artefact", p) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StrataError(f"{p}: not a valid provenance sidecar ({e}); delete it or regenerate the artefact", p) from None
    if not isinstance(rec, dict):
        raise StrataError(f"{p}: not a valid provenance sidecar (expected a JSON object)", p)
    return rec
