"""Expert profiles: STRP v1 reading and writing (Strata expert_cache.cpp / tools/make_profile.py, formats.md 2).

Layout (little-endian): ``b"STRP"``, u32 version=1, u32 n_layers, u32 n_expert, u32 slots, u32 n_ranked,
n_ranked x (u16 layer, u16 expert), then a trailer of n_layers*n_expert x i32 rank (position in the list,
-1 unranked; what our writers write) or x f32 frequency (a second upstream tool's trailer; read only).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.core.fsutil import check_input, write_bytes_atomic

MAGIC = b"STRP"
VERSION = 1
HEADER_BYTES = 24
# Plausibility bounds of the reader and writer (ours, stricter than the engine): pairs are u16, so an expert
# or layer index past 65535 cannot be named; the largest known model is 48 x 512 (formats.md 1). The bound on
# L x E keeps the rank table of any accepted header at 64 MiB.
MAX_LAYERS = 4096
MAX_EXPERTS = 1 << 16
MAX_PAIRS = 1 << 24


def check_dims(n_layers: int, n_expert: int, path: str | os.PathLike | None = None) -> None:
    """Raise StrataError (``byte 8``) unless 1 <= n_layers <= 4096, 1 <= n_expert <= 65536 and
    n_layers x n_expert <= 2**24 (u16 pair fields, formats.md 2; bounds are ours)."""
    if not (1 <= n_layers <= MAX_LAYERS and 1 <= n_expert <= MAX_EXPERTS and n_layers * n_expert <= MAX_PAIRS):
        p = os.fspath(path) if path is not None else "<profile>"
        raise StrataError(f"{p}: byte 8: {n_layers} layers x {n_expert} experts is implausible (a profile needs "
                          f"1..{MAX_LAYERS} layers, 1..{MAX_EXPERTS} experts, at most {MAX_PAIRS} pairs); "
                          f"the header is damaged or this is not a profile", p)



@dataclass
class Profile:
    """A priority order of (layer, expert) pairs, hottest first.

    Attributes:
        n_layers: L (trunk layers of the model it is for).
        n_expert: E (experts per layer of that model; dense indices for a pruned model).
        pairs: int64 array [n_ranked, 2] of (layer, expert), no duplicates.
        slots: the header's slots field (writers set it to n_ranked).
        trailer: what the file carried after the pairs: ``"rank"`` (int32 rank table), ``"freq"``
            (float32 frequency table), ``"none"``, or ``"unknown"``; ``"rank"`` for profiles built in memory.
        freq: the float32 frequency table [L, E] when ``trailer == "freq"``.
        version: the header's version field.
        warnings: non-fatal findings of the reader.
    """

    n_layers: int
    n_expert: int
    pairs: np.ndarray
    slots: int | None = None
    trailer: str = "rank"
    freq: np.ndarray | None = None
    version: int = VERSION
    warnings: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pairs = np.asarray(self.pairs, dtype=np.int64).reshape(-1, 2)
        if self.slots is None:
            self.slots = len(self.pairs)

    @property
    def n_ranked(self) -> int:
        """Number of ranked (layer, expert) pairs in the profile."""
        return int(len(self.pairs))

    @property
    def complete(self) -> bool:
        """True when every (layer, expert) pair of the model is ranked."""
        return self.n_ranked == self.n_layers * self.n_expert

    def flat(self) -> np.ndarray:
        """Flat indices ``layer*n_expert + expert`` in rank order, int64 [n_ranked]."""
        return self.pairs[:, 0] * self.n_expert + self.pairs[:, 1]

    def rank_table(self) -> np.ndarray:
        """int32 [n_layers, n_expert]: each pair's position in the list, -1 when unranked."""
        t = np.full(self.n_layers * self.n_expert, -1, dtype=np.int32)
        t[self.flat()] = np.arange(self.n_ranked, dtype=np.int32)
        return t.reshape(self.n_layers, self.n_expert)

    def validate(self, path: str | os.PathLike | None = None) -> None:
        """Raise StrataError for out-of-range or duplicate pairs (our writers never emit either)."""
        p = path or "<profile>"
        L, E = self.n_layers, self.n_expert
        check_dims(L, E, p)
        if len(self.pairs):
            bad = np.nonzero((self.pairs[:, 0] < 0) | (self.pairs[:, 0] >= L) | (self.pairs[:, 1] < 0) | (self.pairs[:, 1] >= E))[0]
            if len(bad):
                i = int(bad[0])
                raise StrataError(
                    f"{p}: byte {HEADER_BYTES + 4 * i}: pair #{i} (layer {self.pairs[i, 0]}, expert {self.pairs[i, 1]}) "
                    f"is out of range for {L} layers x {E} experts ({len(bad)} such pairs)")
            flat = self.flat()
            _, first, counts = np.unique(flat, return_index=True, return_counts=True)
            if (counts > 1).any():
                dup_flat = np.unique(flat)[counts > 1]
                # position of the second occurrence of the first duplicated value
                seen: set[int] = set()
                for i, f in enumerate(flat.tolist()):
                    if f in seen:
                        break
                    seen.add(f)
                raise StrataError(
                    f"{p}: byte {HEADER_BYTES + 4 * i}: pair #{i} (layer {self.pairs[i, 0]}, expert {self.pairs[i, 1]}) "
                    f"repeats an earlier pair ({len(dup_flat)} duplicated pairs); rebuild the profile with stratatools")

    def to_bytes(self) -> bytes:
        """STRP v1 bytes with the int32 rank-table trailer, slots = n_ranked (what Strata's writer emits)."""
        self.validate()
        head = MAGIC + struct.pack("<5I", VERSION, self.n_layers, self.n_expert, self.n_ranked, self.n_ranked)
        body = self.pairs.astype("<u2").tobytes()
        return head + body + self.rank_table().astype("<i4").tobytes()

    def write(self, path: str | os.PathLike) -> None:
        """Write atomically (``<path>.tmp`` then rename)."""
        write_bytes_atomic(path, self.to_bytes())


def parse_profile(data: bytes, path: str | os.PathLike | None = None,
                  expect: tuple[int, int] | None = None, file_size: int | None = None) -> Profile:
    """Parse STRP bytes; stricter than the engine.

    Args:
        data: the file's bytes.
        path: for messages.
        expect: (n_layers, n_expert) of the target model; a mismatch is an error.
        file_size: the file's length when ``data`` is only its first bytes (:func:`read_profile` reads the
            header, the pairs and one table, never a whole multi-GB file given by mistake); the bytes past
            ``data`` count as trailing bytes.

    Raises:
        StrataError: bad magic, implausible dims (:func:`check_dims`), truncation, dims mismatch,
            n_ranked > slots, out-of-range or duplicate pairs.
    Warnings are collected in ``Profile.warnings`` (trailer inconsistencies, trailing bytes, version != 1).
    """
    p = os.fspath(path) if path is not None else "<profile>"
    data = bytes(data)
    size = len(data) if file_size is None else max(int(file_size), len(data))
    if len(data) < 4 and MAGIC.startswith(data):
        raise StrataError(f"{p}: byte {len(data)}: truncated STRP header ({len(data)} of {HEADER_BYTES} bytes)", p)
    if len(data) < 4 or data[:4] != MAGIC:
        raise StrataError(f"{p}: byte 0: not an expert profile (magic {bytes(data[:4])!r}, expected b'STRP')", p)
    if len(data) < HEADER_BYTES:
        raise StrataError(f"{p}: byte {len(data)}: truncated STRP header ({len(data)} of {HEADER_BYTES} bytes)", p)
    version, L, E, slots, n = struct.unpack_from("<5I", data, 4)
    warns: list[str] = []
    if version != VERSION:
        warns.append(f"version is {version}, expected 1 (the engine ignores it)")
    check_dims(L, E, p)
    if expect is not None and (L, E) != tuple(expect):
        raise StrataError(
            f"{p}: byte 8: profile is for {L} layers x {E} experts but the model has {expect[0]} x {expect[1]}; "
            f"remap it with `stratatools remap-profile` or rebuild it with `stratatools make-profile`", p)
    if n > slots:
        raise StrataError(f"{p}: byte 20: n_ranked {n} exceeds slots {slots}", p)
    end_pairs = HEADER_BYTES + 4 * n
    if len(data) < end_pairs:
        raise StrataError(f"{p}: byte {len(data)}: truncated pair list ({(len(data) - HEADER_BYTES) // 4} of {n} pairs)", p)
    pairs = np.frombuffer(data, dtype="<u2", count=2 * n, offset=HEADER_BYTES).astype(np.int64).reshape(n, 2)
    prof = Profile(L, E, pairs, slots=slots, version=version)
    prof.validate(p)
    rest = size - end_pairs
    table = L * E * 4
    trailer = "none"
    freq = None
    if rest == 0:
        trailer = "none"
        warns.append("no trailer after the pair list (the engine does not need one)")
    elif rest >= table:
        raw = data[end_pairs:end_pairs + table]
        as_i = np.frombuffer(raw, dtype="<i4")
        expected = prof.rank_table().ravel()
        if np.array_equal(as_i, expected):
            trailer = "rank"
        else:
            as_f = np.frombuffer(raw, dtype="<f4")
            ints_plausible = bool(((as_i >= -1) & (as_i < max(n, 1))).all())
            if ints_plausible:
                trailer = "rank"
                warns.append(f"rank-table trailer disagrees with the pair list at {int((as_i != expected).sum())} entries")
            elif np.isfinite(as_f).all() and (as_f >= 0).all():
                trailer = "freq"
                freq = as_f.reshape(L, E).copy()
            else:
                trailer = "unknown"
                warns.append("trailer is neither an int32 rank table nor a float32 frequency table")
        if rest > table:
            warns.append(f"{rest - table} trailing bytes after the trailer")
    else:
        raise StrataError(f"{p}: byte {size}: the file ends inside its trailer ({rest} of {table} bytes of the "
                          f"n_layers x n_expert table): it is cut; get or write the whole profile again", p)
    prof.trailer = trailer
    prof.freq = freq
    prof.warnings = warns
    return prof


def read_profile(path: str | os.PathLike, expect: tuple[int, int] | None = None) -> Profile:
    """Read a STRP v1 file; see :func:`parse_profile`. Raises StrataError for a missing file.

    Reads at most the header, the pair list and one L x E table (bounded by :func:`check_dims`), so a model
    passed by mistake is refused from its first bytes.
    """
    path = check_input(path, "profile")
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            data = fh.read(HEADER_BYTES)
            if len(data) == HEADER_BYTES and data[:4] == MAGIC:
                _, L, E, _, n = struct.unpack_from("<5I", data, 4)
                check_dims(L, E, path)
                data += fh.read(max(0, min(4 * n + 4 * L * E, size - HEADER_BYTES)))
    except FileNotFoundError:
        raise StrataError(f"{path}: no such file", path) from None
    except IsADirectoryError:
        raise StrataError(f"{path}: is a directory, expected a STRP profile", path) from None
    return parse_profile(data, path, expect, file_size=size)


def summarize(prof: Profile, top: int = 8) -> dict:
    """What ``profile show`` prints: header fields, trailer kind, warnings, per-layer counts and top-K.

    Args:
        prof: a parsed profile.
        top: how many experts of each layer to list, in rank order (the layer's first ``top`` ranked pairs).

    Returns:
        a JSON-able dict: ``n_layers``, ``n_expert``, ``slots``, ``n_ranked``, ``complete``, ``trailer``,
        ``version``, ``warnings``, ``layers`` (per layer: ``ranked`` pairs, ``first_rank`` (position of its
        first pair, or None), ``share_top`` (its pairs among the first ``n_layers*top`` ranks: how many of
        its experts a global fill of that many slots admits), ``top`` experts).
    """
    L, E = prof.n_layers, prof.n_expert
    lay = prof.pairs[:, 0]
    counts = np.bincount(lay, minlength=L)
    share = np.bincount(lay[: L * top], minlength=L)
    # pairs grouped by layer, rank order kept inside each group (one stable sort, not a scan per layer)
    order = np.argsort(lay, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)])
    experts = prof.pairs[order, 1]
    layers = []
    for layer in range(L):
        a, b = int(starts[layer]), int(starts[layer + 1])
        layers.append({"layer": layer, "ranked": int(counts[layer]),
                       "first_rank": int(order[a]) if b > a else None,
                       "share_top": int(share[layer]),
                       "top": experts[a:min(b, a + top)].tolist()})
    return {"n_layers": L, "n_expert": E, "slots": int(prof.slots or 0), "n_ranked": prof.n_ranked,
            "complete": prof.complete, "trailer": prof.trailer, "version": prof.version,
            "warnings": list(prof.warnings), "top": top, "layers": layers,
            "top_pairs": prof.pairs[:top].tolist()}
