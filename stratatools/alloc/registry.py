"""The registry of known releases and profiles (``allocations/releases.toml``).

validate-release and profile provenance use it to recognise a release from a file digest (a shard, an
allocation map or a profile) and to say which revision a profile was built for. Only public facts are
recorded; a revision may be a public prefix and is matched as one.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stratatools.core.errors import StrataError
from stratatools.core.resources import packaged

DEFAULT_PATH = packaged("allocations", "releases.toml")  # allocations/releases.toml, shipped in the wheel


@dataclass(frozen=True)
class Release:
    """One release revision. ``key`` is ``name@revision``."""

    name: str
    revision: str
    model: str = ""
    date: str | None = None
    n_layers: int | None = None
    n_expert: int | None = None
    n_expert_original: int | None = None
    allocation: str | None = None
    allocation_sha256: str | None = None
    shards: tuple[dict[str, Any], ...] = ()
    notes: str = ""

    @property
    def key(self) -> str:
        """``name@revision``, the registry key of this release."""
        return f"{self.name}@{self.revision}"

    def matches_revision(self, revision: str) -> bool:
        """True when ``revision`` equals this one or one is a prefix of the other (public prefixes)."""
        a, b = self.revision.lower(), revision.lower()
        return a.startswith(b) or b.startswith(a)


@dataclass(frozen=True)
class KnownProfile:
    """A registered profile: its file ``name``, lowercase-insensitive ``sha256`` hex digest and the release key
    (``name@revision``) it was ``built_for``."""

    name: str
    sha256: str
    built_for: str
    notes: str = ""


@dataclass
class Registry:
    """Parsed registry. ``by_sha256`` maps a digest to ("shard"|"allocation"|"profile", release key, entry)."""

    releases: list[Release] = field(default_factory=list)
    profiles: list[KnownProfile] = field(default_factory=list)
    path: Path | None = None

    def find(self, name: str, revision: str | None = None) -> list[Release]:
        """Releases named ``name`` whose revision matches ``revision`` as a prefix (all revisions when None)."""
        return [r for r in self.releases if r.name == name and (revision is None or r.matches_revision(revision))]

    def identify(self, sha256: str) -> tuple[str, str] | None:
        """(kind, key) for a known digest: kind is shard, allocation or profile; key is name@revision."""
        s = sha256.lower()
        for r in self.releases:
            if r.allocation_sha256 and r.allocation_sha256.lower() == s:
                return "allocation", r.key
            for sh in r.shards:
                if str(sh.get("sha256", "")).lower() == s:
                    return "shard", r.key
        for p in self.profiles:
            if p.sha256.lower() == s:
                return "profile", p.built_for
        return None


REGISTRY_ENV = "STRATATOOLS_REGISTRY"
_MAX_REGISTRY_BYTES = 64 << 20


def load_registry(path: str | os.PathLike | None = None) -> Registry:
    """Load the registry TOML: ``path``, else ``$STRATATOOLS_REGISTRY``, else the packaged
    ``allocations/releases.toml`` (in the wheel as ``stratatools.allocations``).

    If the packaged file is missing (a broken install), with neither ``path`` nor the variable the registry
    is empty (``path`` None) and nothing is recognised by digest; provenance sidecars still work.

    Raises:
        StrataError: a named file (``path`` or the variable) is missing, or a file is not valid TOML /
            lacks required fields (name, revision) / has ``release``, ``profile`` or ``shard`` entries that
            are not arrays of tables.
    """
    if path is None and os.environ.get(REGISTRY_ENV):
        path = os.environ[REGISTRY_ENV]
    if path is None and not DEFAULT_PATH.is_file():
        return Registry(path=None)
    from stratatools.core.fsutil import check_input

    p = check_input(path, "registry") if path is not None else DEFAULT_PATH
    try:
        if p.is_file() and p.stat().st_size > _MAX_REGISTRY_BYTES:
            raise StrataError(f"{p}: {p.stat().st_size} bytes is not a release registry (at most "
                              f"{_MAX_REGISTRY_BYTES >> 20} MiB); check --registry / ${REGISTRY_ENV}", p)
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StrataError(f"{p}: release registry not found (check --registry / ${REGISTRY_ENV})", p) from None
    except (OSError, UnicodeDecodeError) as e:
        raise StrataError(f"{p}: cannot read the release registry ({e})", p) from None
    except tomllib.TOMLDecodeError as e:
        raise StrataError(f"{p}: not valid TOML: {e}", p) from None
    except RecursionError:
        raise StrataError(f"{p}: not a release registry: arrays or tables nested too deeply", p) from None
    reg = Registry(path=p)
    for table in ("release", "profile"):
        entries = data.get(table, [])
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise StrataError(f"{p}: '{table}' must be an array of tables; write each entry as a [[{table}]] "
                              f"section", p)
    for i, r in enumerate(data.get("release", [])):
        if "name" not in r or "revision" not in r:
            raise StrataError(f"{p}: [[release]] #{i + 1} needs name and revision", p)
        shards = r.get("shard", [])
        if not isinstance(shards, list) or not all(isinstance(sh, dict) for sh in shards):
            raise StrataError(f"{p}: [[release]] #{i + 1}: 'shard' must be an array of tables; write each shard "
                              f"as a [[release.shard]] section", p)
        reg.releases.append(Release(
            name=str(r["name"]), revision=str(r["revision"]), model=str(r.get("model", "")),
            date=str(r["date"]) if "date" in r else None, n_layers=r.get("n_layers"), n_expert=r.get("n_expert"),
            n_expert_original=r.get("n_expert_original"), allocation=r.get("allocation"),
            allocation_sha256=str(r["allocation_sha256"]) if r.get("allocation_sha256") is not None else None,
            shards=tuple(shards),
            notes=str(r.get("notes", ""))))
    for i, q in enumerate(data.get("profile", [])):
        if not {"name", "sha256", "built_for"} <= set(q):
            raise StrataError(f"{p}: [[profile]] #{i + 1} needs name, sha256 and built_for", p)
        reg.profiles.append(KnownProfile(str(q["name"]), str(q["sha256"]), str(q["built_for"]), str(q.get("notes", ""))))
    return reg
