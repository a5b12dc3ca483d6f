"""A small byte-level BPE tokenizer built from a GGUF's ``tokenizer.ggml.*`` metadata.

Supported: ``tokenizer.ggml.model = gpt2`` (byte-level BPE) with the ``qwen2`` pre-tokenizer, which is what
qwen4exp releases and the kit's model carry. Steps (GPT-2 byte-level BPE; pre-tokenizer regex of
llama.cpp's ``LLAMA_VOCAB_PRE_TYPE_QWEN2`` / the HF Qwen2 tokenizer):

1. special (control) tokens (``token_type`` 3, e.g. ``<|endoftext|>``) found literally in the text are
   emitted as their ids (llama.cpp ``parse_special``);
2. the rest is NFC-normalised (the HF tokenizer's normalizer) and split by the qwen2 regex;
3. each piece's UTF-8 bytes are mapped to the 256 printable stand-in characters of GPT-2's byte encoder,
   then merged pairwise by the lowest merge rank (``tokenizer.ggml.merges``) until no pair is mergeable;
4. the resulting symbols are looked up in ``tokenizer.ggml.tokens``.

Decoding inverts the byte map (invalid UTF-8 becomes U+FFFD).
"""

from __future__ import annotations

import unicodedata
from functools import cached_property, lru_cache

import regex

from stratatools.core.errors import StrataError
from stratatools.model.gguf import Model

QWEN2_PATTERN = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CONTROL = 3  # llama.cpp LLAMA_TOKEN_TYPE_CONTROL
USER_DEFINED = 4


def _byte_encoder() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (printable Latin-1 bytes map to themselves)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


BYTE_ENC = _byte_encoder()
BYTE_DEC = {c: b for b, c in BYTE_ENC.items()}


class BPETokenizer:
    """Encode/decode with a GGUF's byte-level BPE vocabulary.

    Attributes:
        tokens: id -> token string; ``ids`` the inverse; ``ranks`` merge pair -> rank.
        specials: control/user-defined token strings matched literally, longest first.
        eos_id: ``tokenizer.ggml.eos_token_id`` (None when absent).

    Raises:
        StrataError: the GGUF has no tokenizer, or one that is not gpt2/qwen2-style byte-level BPE.
    """

    def __init__(self, tokens: list[str], merges: list[str], token_types: list[int] | None = None,
                 eos_id: int | None = None, source: str = "<tokenizer>"):
        self.tokens = list(tokens)
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.ranks: dict[tuple[str, str], int] = {}
        for r, m in enumerate(merges):
            parts = m.split(" ")
            if len(parts) != 2:
                raise StrataError(f"{source}: tokenizer.ggml.merges entry {r} {m!r} is not 'left right'")
            self.ranks.setdefault((parts[0], parts[1]), r)
        types = token_types or [1] * len(tokens)
        self.specials = sorted((t for t, ty in zip(self.tokens, types) if ty in (CONTROL, USER_DEFINED) and t),
                               key=len, reverse=True)
        self.eos_id = eos_id
        self._pat = regex.compile(QWEN2_PATTERN)
        self._special_pat = regex.compile("|".join(regex.escape(s) for s in self.specials)) if self.specials else None
        self._bpe = lru_cache(maxsize=65536)(self._bpe_uncached)

    @classmethod
    def from_gguf(cls, model: Model) -> "BPETokenizer":
        """Build the tokenizer from a model's ``tokenizer.ggml.*`` metadata (gguf.md tokenizer keys). Raises
        StrataError naming the model when the metadata is absent, not byte-level BPE (``gpt2``), has no
        ``tokenizer.ggml.merges`` or an empty one (llama.cpp ``llama-vocab.cpp`` refuses a gpt2 vocabulary without merges: every
        text would otherwise split byte by byte), or has an unsupported pre-tokenizer.
        """
        kv = model.kv
        kind = kv.get("tokenizer.ggml.model")
        if kind is None or "tokenizer.ggml.tokens" not in kv:
            raise StrataError(f"{model.path}: no tokenizer.ggml.* metadata; pass token ids instead of text", model.path)
        if kind != "gpt2":
            raise StrataError(f"{model.path}: tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') is supported", model.path)
        if "tokenizer.ggml.merges" not in kv:
            raise StrataError(f"{model.path}: tokenizer.ggml.model is 'gpt2' but tokenizer.ggml.merges is missing (text would "
                              f"split byte by byte; llama.cpp refuses such a file); re-convert it, or pass token ids", model.path)
        if len(kv["tokenizer.ggml.merges"]) == 0:
            raise StrataError(f"{model.path}: tokenizer.ggml.model is 'gpt2' but tokenizer.ggml.merges is empty (text would "
                              f"split byte by byte; llama.cpp refuses a gpt2 vocabulary without merges); re-convert it, or "
                              f"pass token ids", model.path)
        pre = kv.get("tokenizer.ggml.pre", "qwen2")
        if pre not in ("qwen2", "qwen35", "default"):
            raise StrataError(f"{model.path}: pre-tokenizer {pre!r} is not supported (qwen2 only)", model.path)
        types = kv.get("tokenizer.ggml.token_type")
        eos = kv.get("tokenizer.ggml.eos_token_id")
        return cls(list(kv["tokenizer.ggml.tokens"]), list(kv["tokenizer.ggml.merges"]),
                   [int(x) for x in types] if types is not None else None,
                   int(eos) if eos is not None else None, str(model.path))

    def _bpe_uncached(self, piece: str) -> tuple[int, ...]:
        syms = [BYTE_ENC[b] for b in piece.encode("utf-8")]
        ranks = self.ranks
        while len(syms) > 1:
            best = None
            best_r = None
            for i in range(len(syms) - 1):
                r = ranks.get((syms[i], syms[i + 1]))
                if r is not None and (best_r is None or r < best_r):
                    best, best_r = i, r
            if best is None:
                break
            syms[best:best + 2] = [syms[best] + syms[best + 1]]
        out = []
        for s in syms:
            i = self.ids.get(s)
            if i is None:  # fall back to single bytes (every byte symbol is in a byte-level vocab)
                for ch in s:
                    j = self.ids.get(ch)
                    if j is None:
                        raise StrataError(f"tokenizer: byte symbol {ch!r} is not in the vocabulary")
                    out.append(j)
            else:
                out.append(i)
        return tuple(out)

    def _encode_plain(self, text: str) -> list[int]:
        text = unicodedata.normalize("NFC", text)
        out: list[int] = []
        for m in self._pat.finditer(text):
            out.extend(self._bpe(m.group(0)))
        return out

    @cached_property
    def max_token_bytes(self) -> int:
        """Most bytes of text one token stands for: the longest token string's UTF-8 length (a byte-level token
        spells each byte with one character, of one or two UTF-8 bytes; a special token is its literal text), so a
        text of n bytes has at least ceil(n / max_token_bytes) tokens."""
        return max((len(t.encode("utf-8", "replace")) for t in self.tokens), default=1) or 1

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        """Token ids of ``text`` (no BOS is added; qwen4exp has none)."""
        if not parse_special or self._special_pat is None:
            return self._encode_plain(text)
        out: list[int] = []
        pos = 0
        for m in self._special_pat.finditer(text):
            if m.start() > pos:
                out.extend(self._encode_plain(text[pos:m.start()]))
            out.append(self.ids[m.group(0)])
            pos = m.end()
        if pos < len(text):
            out.extend(self._encode_plain(text[pos:]))
        return out

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; control tokens are written as their strings."""
        buf = bytearray()
        parts: list[str] = []
        for i in ids:
            if not 0 <= int(i) < len(self.tokens):
                raise StrataError(f"token id {i} is outside the vocabulary [0, {len(self.tokens)})")
            t = self.tokens[int(i)]
            if t in self.specials:
                parts.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
                parts.append(t)
                continue
            for ch in t:
                b = BYTE_DEC.get(ch)
                if b is None:
                    buf.extend(ch.encode("utf-8"))
                else:
                    buf.append(b)
        parts.append(buf.decode("utf-8", errors="replace"))
        return "".join(parts)
