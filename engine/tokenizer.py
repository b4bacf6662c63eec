"""Tokenizers used by the harness, behind one small protocol.

* :class:`Llama2cTokenizer` - llama2.c ``tokenizer.bin`` (sentencepiece-style
  BPE with byte fallback), e.g. ``tok512.bin`` for stories260K.
* :class:`HFTokenizer` - a HF ``transformers`` tokenizer directory or a bare
  ``tokenizers`` ``tokenizer.json``.
* :class:`ByteTokenizer` - raw UTF-8 bytes as ids, for built-in synthetic models.

:func:`load_tokenizer` picks one from a spec string, :func:`check_compatible`
verifies a tokenizer fits a model's embedding table.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import re
import struct
from pathlib import Path
from typing import Protocol, runtime_checkable

from engine.errors import TokenizerError, TokenizerMismatchError

__all__ = [
    "Tokenizer",
    "TokenizerError",
    "TokenizerMismatchError",
    "Llama2cTokenizer",
    "HFTokenizer",
    "ByteTokenizer",
    "load_tokenizer",
    "check_compatible",
]


@runtime_checkable
class Tokenizer(Protocol):
    """What the harness needs from a tokenizer.

    Attributes:
        vocab_size: number of ids the tokenizer can emit (max id + 1); must be
            ``<=`` the model's vocab (embedding rows), see :func:`check_compatible`.
        bos_id: beginning-of-sequence id, or None if the tokenizer has none.
        eos_id: end-of-sequence id, or None if the tokenizer has none.

    Methods:
        encode(text, bos=True, eos=False): token ids of ``text``, with
            ``bos_id`` prepended / ``eos_id`` appended when requested and
            defined (silently omitted when the id is None).
        decode(ids): text of ``ids``; special (BOS/EOS) ids are dropped and
            invalid UTF-8 is replaced by U+FFFD, never raised.
    """

    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """Return the token ids of ``text`` (optionally with BOS/EOS)."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Return the text of ``ids``."""
        ...


def _wrap_ids(ids: list[int], bos: bool, eos: bool, bos_id: int | None, eos_id: int | None) -> list[int]:
    """Prepend ``bos_id`` / append ``eos_id`` to ``ids`` when requested and defined."""
    if bos and bos_id is not None:
        ids = [bos_id] + ids
    if eos and eos_id is not None:
        ids = ids + [eos_id]
    return ids


# --------------------------------------------------------------------------- llama2.c

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_MAX_PIECE_BYTES = 4096  # longest piece a tokenizer.bin header may declare (real ones: tens of bytes)


class Llama2cTokenizer:
    """llama2.c ``tokenizer.bin``: sentencepiece-style BPE with byte fallback.

    File format: int32 ``max_token_length``, then for every token a float32
    ``score``, an int32 byte ``length`` and ``length`` raw bytes (UTF-8 piece
    text, sentencepiece's "▁" already turned into a space). All little-endian.

    ``vocab_size``: when given, exactly that many tokens are read (an error if
    the file ends early; trailing bytes are ignored, as llama2.c does). When
    None, tokens are read until EOF and the count becomes ``vocab_size``;
    a record cut off mid-way raises ``ValueError``.

    Ids 0/1/2 are ``<unk>``/BOS/EOS (llama convention; the BOS/EOS pieces are
    ``"\\n<s>\\n"``/``"\\n</s>\\n"``) and pieces ``"<0xXX>"`` are byte tokens
    (ids 3..258 in llama vocabs). These *special* pieces are never produced
    by merging text and never used as merge operands (sentencepiece
    semantics; llama2.c itself would in principle allow it).

    Encoding (llama2.c algorithm, same result): prepend a dummy space
    (``" " + text``, sentencepiece ``add_dummy_prefix``; not for empty text),
    map each code point to its piece id, or to its UTF-8 byte tokens
    ``<0xXX>`` if the code point is not in the vocab, then repeatedly merge
    the adjacent pair whose concatenation is a vocab piece with the highest
    score (ties: leftmost pair).

    Speed: instead of llama2.c's O(n * merges) rescans, each segment is merged
    with a priority queue (heap keyed by ``(-score, position)`` with lazy
    invalidation over a linked list), O(n log n) and exactly the same result
    as the rescanning loop, including the leftmost tie-break. In addition, when
    no mergeable piece contains a space after its first character (true for
    llama2.c/sentencepiece vocabs, where spaces only start pieces), no merge
    can cross the boundary in front of a space, so the text is split before
    every space and the segments (mostly words, e.g. ``" the"``) are encoded
    independently with a memo cache. This is exact, not an approximation; if
    the vocab has interior spaces the whole text is merged as one segment.
    """

    def __init__(self, path: str | os.PathLike, vocab_size: int | None = None):
        """Load ``tokenizer.bin`` from ``path``; see the class doc for ``vocab_size``."""
        self.path = str(path)
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(
                f"llama2.c tokenizer file {self.path!r} does not exist. Pass the path of the "
                "tokenizer.bin that matches the checkpoint (e.g. tok512.bin for stories260K)."
            )
        data = p.read_bytes()
        pieces, scores = self._parse(data, vocab_size)
        self.pieces_bytes = pieces
        self.scores = scores
        self.vocab_size = len(pieces)
        self.unk_id = 0 if self.vocab_size > 0 else None
        self.bos_id = 1 if self.vocab_size > 1 else None
        self.eos_id = 2 if self.vocab_size > 2 else None
        special = {i for i in (self.unk_id, self.bos_id, self.eos_id) if i is not None}

        # piece text <-> id. Pieces are valid UTF-8 in practice; undecodable bytes
        # become lone surrogates (surrogateescape), which ordinary text never contains.
        self.pieces = [b.decode("utf-8", errors="surrogateescape") for b in pieces]
        self.byte_ids: dict[int, int] = {}  # byte value -> id of "<0xXX>"
        self._byte_value: dict[int, int] = {}  # id -> byte value
        for i, s in enumerate(self.pieces):
            m = _BYTE_PIECE.match(s)
            if m:
                self.byte_ids.setdefault(int(m.group(1), 16), i)
                self._byte_value[i] = int(m.group(1), 16)
        self._special = special | set(self._byte_value)
        # mergeable (normal) pieces: first id wins for duplicate strings
        self._lookup: dict[str, int] = {}
        for i, s in enumerate(self.pieces):
            if i not in self._special and s not in self._lookup:
                self._lookup[s] = i
        # pair table: (left id, right id) -> merged id, for every way of
        # splitting each mergeable piece into two mergeable pieces
        self._merges: dict[tuple[int, int], int] = {}
        for s, i in self._lookup.items():
            for k in range(1, len(s)):
                a, b = self._lookup.get(s[:k]), self._lookup.get(s[k:])
                if a is not None and b is not None:
                    self._merges[(a, b)] = i
        self._split_on_space = not any(" " in s[1:] for s in self._lookup)
        self._cache: dict[str, list[int]] = {}

    def _fail(self, problem: str) -> TokenizerError:
        """A `TokenizerError` naming the file, what is wrong and what to do."""
        return TokenizerError(f"llama2.c tokenizer {self.path!r}: {problem}; the file is truncated or not a llama2.c "
                              "tokenizer.bin: use the tokenizer file exported with the checkpoint (e.g. tok512.bin "
                              "for stories260K)")

    def _parse(self, data: bytes, vocab_size: int | None) -> tuple[list[bytes], list[float]]:
        """The (piece bytes, score) records of a tokenizer.bin, validated: a garbage file fails here, naming the
        offset, instead of parsing into a vocabulary of nonsense."""
        if len(data) < 4:
            raise self._fail(f"file is {len(data)} bytes, expected a 4-byte header")
        (self.max_token_length,) = struct.unpack_from("<i", data, 0)
        if not 0 < self.max_token_length <= _MAX_PIECE_BYTES:
            raise self._fail(f"header max_token_length {self.max_token_length} is not in 1..{_MAX_PIECE_BYTES}")
        pieces: list[bytes] = []
        scores: list[float] = []
        off = 4
        while (vocab_size is None and off < len(data)) or (vocab_size is not None and len(pieces) < vocab_size):
            if off + 8 > len(data):
                raise self._fail(f"file ends at byte {len(data)} inside token {len(pieces)} (expected "
                                 f"{vocab_size if vocab_size is not None else 'a whole record'}; or vocab_size is "
                                 "wrong)")
            score, n = struct.unpack_from("<fi", data, off)
            off += 8
            if n < 0 or off + n > len(data):
                raise self._fail(f"token {len(pieces)} claims {n} bytes at offset {off} but the file has "
                                 f"{len(data) - off} left")
            if not 0 < n <= self.max_token_length or not math.isfinite(score):
                raise self._fail(f"token {len(pieces)} at offset {off - 8} has {n} bytes (the header allows 1.."
                                 f"{self.max_token_length}) and score {score}")
            pieces.append(data[off : off + n])
            scores.append(score)
            off += n
        if len(pieces) < 3:
            raise self._fail(f"it holds {len(pieces)} token(s); a llama vocabulary has at least <unk>, BOS and EOS")
        return pieces, scores

    def _char_ids(self, text: str) -> list[int]:
        """Map each code point to its piece id, or its ``<0xXX>`` byte-token ids."""
        out: list[int] = []
        for ch in text:
            i = self._lookup.get(ch)
            if i is not None:
                out.append(i)
                continue
            for b in ch.encode("utf-8", errors="surrogatepass"):
                bid = self.byte_ids.get(b)
                if bid is None:
                    if self.unk_id is None:
                        raise ValueError(f"character {ch!r} is not in {self.path!r} and it has no byte tokens")
                    bid = self.unk_id
                out.append(bid)
        return out

    def _merge(self, ids: list[int]) -> list[int]:
        """Apply BPE merges to ``ids`` (highest score first, leftmost on ties) via a heap."""
        n = len(ids)
        if n < 2:
            return ids
        ids = list(ids)
        merges, scores = self._merges, self.scores
        nxt = list(range(1, n)) + [-1]
        prv = list(range(-1, n - 1))
        heap: list[tuple[float, int, int, int]] = []  # (-score, left pos, left id, right id)
        for p in range(n - 1):
            m = merges.get((ids[p], ids[p + 1]))
            if m is not None:
                heap.append((-scores[m], p, ids[p], ids[p + 1]))
        heapq.heapify(heap)
        while heap:
            _, p, a, b = heapq.heappop(heap)
            q = nxt[p]
            # stale entry: left node changed (merged/absorbed) or right neighbour changed.
            # A node's id only changes by absorbing its right neighbour, which makes the
            # piece strictly longer, so equal ids mean the pair is unchanged.
            if ids[p] != a or q < 0 or ids[q] != b:
                continue
            m = merges[(a, b)]
            ids[p] = m
            ids[q] = -1  # dead
            r = nxt[q]
            nxt[p] = r
            if r >= 0:
                prv[r] = p
                mm = merges.get((m, ids[r]))
                if mm is not None:
                    heapq.heappush(heap, (-scores[mm], p, m, ids[r]))
            lp = prv[p]
            if lp >= 0:
                mm = merges.get((ids[lp], m))
                if mm is not None:
                    heapq.heappush(heap, (-scores[mm], lp, ids[lp], m))
        return [i for i in ids if i >= 0]

    def _encode_segment(self, seg: str) -> list[int]:
        """Encode one merge-independent segment, memoized."""
        hit = self._cache.get(seg)
        if hit is None:
            hit = self._merge(self._char_ids(seg))
            if len(self._cache) > 200_000:
                self._cache.clear()
            self._cache[seg] = hit
        return hit

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """Encode ``text`` llama2.c-style (dummy space prefix, BPE, byte fallback)."""
        ids: list[int] = []
        if text:
            text = " " + text
            if self._split_on_space:
                for seg in re.split(r"(?= )", text):  # segments start at a space
                    if seg:
                        ids.extend(self._encode_segment(seg))
            else:
                ids = self._merge(self._char_ids(text))
        return _wrap_ids(ids, bos, eos, self.bos_id, self.eos_id)

    def decode(self, ids: list[int]) -> str:
        """Decode ``ids``: concatenate pieces, ``<0xXX>`` -> raw byte, drop BOS/EOS.

        The leading space of the first piece of the text and of the first
        piece after each BOS is stripped (it is the dummy prefix added by
        :meth:`encode`). ``<unk>`` decodes as its piece text. Invalid UTF-8 is
        replaced (``errors="replace"``). Ids outside the vocab raise ``ValueError``.
        """
        out = bytearray()
        strip_next = True
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} out of range for {self.path!r} (vocab_size {self.vocab_size})")
            if i == self.bos_id:
                strip_next = True
                continue
            if i == self.eos_id:
                continue
            bv = self._byte_value.get(i)
            if bv is not None:
                out.append(bv)
            else:
                piece = self.pieces_bytes[i]
                if strip_next and piece.startswith(b" "):
                    piece = piece[1:]
                out += piece
            strip_next = False
        return out.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        """Short description with path and vocab size."""
        return f"Llama2cTokenizer({self.path!r}, vocab_size={self.vocab_size})"


# --------------------------------------------------------------------------- HF

def _special_from_config(path: Path) -> tuple[str | None, str | None]:
    """Read bos/eos token strings from a ``tokenizer_config.json`` next to ``path``."""
    cfg = path.parent / "tokenizer_config.json" if path.is_file() else path / "tokenizer_config.json"
    if not cfg.is_file():
        return None, None
    try:
        d = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, None

    def tok(v):
        """Token string from a plain string or an AddedToken-like dict."""
        if isinstance(v, dict):
            return v.get("content")
        return v if isinstance(v, str) else None

    return tok(d.get("bos_token")), tok(d.get("eos_token"))


class HFTokenizer:
    """A HF tokenizer (``transformers`` directory or ``tokenizers`` json) as a :class:`Tokenizer`.

    * a directory with ``tokenizer_config.json``/``config.json`` is loaded with
      ``transformers.AutoTokenizer.from_pretrained(path, local_files_only=True,
      trust_remote_code=False)``;
    * a ``tokenizer.json`` file (or a directory holding only that) is loaded
      with ``tokenizers.Tokenizer.from_file``; BOS/EOS come from a sibling
      ``tokenizer_config.json`` if present, else from common token names
      (``<s>``/``</s>``, ``<|begin_of_text|>``/``<|end_of_text|>``,
      ``<|endoftext|>``), else None. ``bos_id``/``eos_id`` arguments override.

    ``encode`` never lets the backend add special tokens; BOS/EOS are added
    by the ``bos``/``eos`` flags only, so behaviour is identical across
    backends. ``vocab_size`` counts added tokens (max id + 1). ``decode``
    skips special tokens by default (``skip_special_tokens``).
    """

    def __init__(
        self,
        path_or_dir: str | os.PathLike,
        bos_id: int | None = None,
        eos_id: int | None = None,
        skip_special_tokens: bool = True,
    ):
        """Load the tokenizer at ``path_or_dir``; see the class doc."""
        self.path = str(path_or_dir)
        p = Path(path_or_dir)
        if not p.exists():
            raise FileNotFoundError(
                f"HF tokenizer path {self.path!r} does not exist. Pass a model directory with "
                "tokenizer files or a tokenizer.json path."
            )
        self.skip_special_tokens = skip_special_tokens
        self._hf = None  # transformers tokenizer
        self._tk = None  # tokenizers.Tokenizer
        if p.is_dir() and ((p / "tokenizer_config.json").is_file() or (p / "config.json").is_file()):
            from transformers import AutoTokenizer

            try:
                self._hf = AutoTokenizer.from_pretrained(str(p), local_files_only=True, trust_remote_code=False)
            except Exception as e:  # noqa: BLE001 - fall back to a bare tokenizer.json below
                if not (p / "tokenizer.json").is_file():
                    raise TokenizerError(
                        f"could not load a transformers tokenizer from {self.path!r}: {e}. The directory "
                        "needs tokenizer files (tokenizer.json or tokenizer.model + tokenizer_config.json)."
                    ) from e
        if self._hf is not None:
            self.vocab_size = len(self._hf)
            self.bos_id = self._hf.bos_token_id if bos_id is None else bos_id
            self.eos_id = self._hf.eos_token_id if eos_id is None else eos_id
            return

        from tokenizers import Tokenizer as _RawTokenizer

        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise FileNotFoundError(
                f"HF tokenizer: {str(file)!r} does not exist (looked for tokenizer.json / tokenizer_config.json "
                f"in {self.path!r}). Point to a directory with tokenizer files or a tokenizer.json."
            )
        try:
            self._tk = _RawTokenizer.from_file(str(file))
        except Exception as exc:  # the tokenizers library raises its own Exception type for unparsable files
            raise TokenizerError(f"HF tokenizer {str(file)!r} cannot be read ({exc}); the file is truncated or not a "
                                 "tokenizers JSON file: use the tokenizer.json saved with the model") from None
        self.vocab_size = self._tk.get_vocab_size(with_added_tokens=True)
        bos_s, eos_s = _special_from_config(p)

        def find(name: str | None, candidates: tuple[str, ...]) -> int | None:
            """Id of ``name`` if given and present, else of the first present candidate."""
            for c in ((name,) if name else ()) + candidates:
                i = self._tk.token_to_id(c)
                if i is not None:
                    return i
            return None

        self.bos_id = bos_id if bos_id is not None else find(bos_s, ("<s>", "<|begin_of_text|>", "<bos>"))
        self.eos_id = eos_id if eos_id is not None else find(
            eos_s, ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")
        )

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """Encode without backend special tokens, then add BOS/EOS per the flags."""
        if self._hf is not None:
            ids = list(self._hf.encode(text, add_special_tokens=False))
        else:
            ids = list(self._tk.encode(text, add_special_tokens=False).ids)
        return _wrap_ids(ids, bos, eos, self.bos_id, self.eos_id)

    def decode(self, ids: list[int]) -> str:
        """Decode with the backend (``skip_special_tokens`` as configured)."""
        ids = [int(i) for i in ids]
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self._tk.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def __repr__(self) -> str:
        """Short description with path and vocab size."""
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size})"


# --------------------------------------------------------------------------- bytes

class ByteTokenizer:
    """Raw UTF-8 bytes as ids 0..255 (for built-in synthetic models).

    ``vocab_size`` must be >= 256; ``bos_id``/``eos_id`` (optional) must be in
    ``[0, vocab_size)`` and should be >= 256 so they do not shadow a byte
    (decode drops them). Ids in ``[256, vocab_size)`` that are not special
    decode to U+FFFD.
    """

    def __init__(self, vocab_size: int = 256, bos_id: int | None = None, eos_id: int | None = None):
        """Validate sizes/ids; see the class doc."""
        if vocab_size < 256:
            raise ValueError(f"ByteTokenizer needs vocab_size >= 256, got {vocab_size}")
        for name, v in (("bos_id", bos_id), ("eos_id", eos_id)):
            if v is not None and not 0 <= v < vocab_size:
                raise ValueError(f"ByteTokenizer {name}={v} is outside [0, vocab_size={vocab_size})")
        self.vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_id = eos_id

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """UTF-8 bytes of ``text`` as ids, with BOS/EOS when requested and defined."""
        return _wrap_ids(list(text.encode("utf-8")), bos, eos, self.bos_id, self.eos_id)

    def decode(self, ids: list[int]) -> str:
        """Bytes back to text; special ids dropped, other non-byte ids -> U+FFFD."""
        out = bytearray()
        special = {self.bos_id, self.eos_id}
        for i in ids:
            i = int(i)
            if i in special:
                continue
            if 0 <= i < 256:
                out.append(i)
            else:
                out += "\ufffd".encode("utf-8")
        return out.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        """Short description."""
        return f"ByteTokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id})"


# --------------------------------------------------------------------------- factory

def _resolve(path: str, model_dir: str | None) -> Path:
    """``path`` as given if it exists, else relative to ``model_dir`` if that exists, else as given."""
    p = Path(path).expanduser()
    if not p.exists() and model_dir and not p.is_absolute():
        alt = Path(model_dir) / p
        if alt.exists():
            return alt
    return p


def load_tokenizer(spec: str | None, model_dir: str | None = None) -> Tokenizer:
    """Build a tokenizer from a spec string.

    ``spec`` forms:

    * ``"llama2c:PATH"`` - :class:`Llama2cTokenizer` (vocab size inferred);
    * ``"bytes"`` - :class:`ByteTokenizer` with 256 ids and no BOS/EOS;
    * ``"hf:PATH"`` or a plain PATH - a directory or ``*.json`` file gives
      :class:`HFTokenizer`, a ``*.bin`` file :class:`Llama2cTokenizer`;
    * None / ``""`` / ``"auto"`` - look in ``model_dir``: HF tokenizer files
      (``tokenizer.json``, ``tokenizer_config.json``) then ``tokenizer.bin``.

    Relative paths that do not exist from the working directory are also
    tried relative to ``model_dir``. A missing file raises
    ``FileNotFoundError`` naming the path; an unusable spec raises ``ValueError``.
    """
    if spec in (None, "", "auto"):
        if not model_dir:
            raise ValueError(
                "no tokenizer given: pass a spec ('llama2c:PATH', 'bytes', an HF dir or tokenizer.json) "
                "or a model directory that contains tokenizer files"
            )
        d = Path(model_dir)
        if not d.is_dir():
            raise FileNotFoundError(f"model directory {model_dir!r} (searched for a tokenizer) does not exist")
        if (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file():
            return HFTokenizer(d)
        if (d / "tokenizer.bin").is_file():
            return Llama2cTokenizer(d / "tokenizer.bin")
        raise FileNotFoundError(
            f"no tokenizer found in model directory {model_dir!r} (looked for tokenizer.json, "
            "tokenizer_config.json, tokenizer.bin); pass --tokenizer 'llama2c:PATH' / 'bytes' / a path"
        )
    if spec == "bytes":
        return ByteTokenizer()
    if spec.startswith("llama2c:"):
        p = _resolve(spec[len("llama2c:"):], model_dir)
        if not p.is_file():
            raise FileNotFoundError(f"llama2.c tokenizer file {str(p)!r} (from spec {spec!r}) does not exist")
        return Llama2cTokenizer(p)
    if spec.startswith("hf:"):
        p = _resolve(spec[len("hf:"):], model_dir)
        if not p.exists():
            raise FileNotFoundError(f"HF tokenizer path {str(p)!r} (from spec {spec!r}) does not exist")
        return HFTokenizer(p)
    p = _resolve(spec, model_dir)
    if not p.exists():
        raise FileNotFoundError(
            f"tokenizer path {str(p)!r} does not exist; expected 'llama2c:PATH', 'bytes', 'hf:PATH', "
            "an HF tokenizer directory or a tokenizer.json / tokenizer.bin file"
        )
    if p.is_dir() or p.suffix == ".json":
        return HFTokenizer(p)
    if p.suffix == ".bin":
        return Llama2cTokenizer(p)
    raise ValueError(
        f"cannot tell the tokenizer type of {str(p)!r}; use 'llama2c:PATH' for llama2.c tokenizer.bin "
        "files or 'hf:PATH' for HF tokenizers"
    )


def spare_rows_allowed(model_vocab_size: int) -> int:
    """Embedding rows a model may have beyond its tokenizer's ids: padding to a round size (checkpoints pad the
    table to a multiple of 64..256 rows, or reserve a few hundred ids: at most 1% of the vocabulary, or 128 rows)."""
    return max(128, model_vocab_size // 100)


def check_compatible(tokenizer: Tokenizer, model_vocab_size: int, where: str) -> None:
    """Raise :class:`TokenizerMismatchError` if ``tokenizer`` does not belong to a model of ``model_vocab_size`` ids.

    Fails when ``tokenizer.vocab_size > model_vocab_size`` (it emits ids the model lacks), when ``bos_id`` /
    ``eos_id`` are not in ``[0, model_vocab_size)``, and when the tokenizer is so much *smaller* than the model that
    the difference cannot be padding (:func:`spare_rows_allowed`: a tokenizer of another model, e.g. a 512-piece
    tokenizer on a 32000-id model, whose text would exercise a sliver of the embedding table). ``where`` names the
    model/config being checked and appears in the message.
    """
    problems = []
    tv = int(tokenizer.vocab_size)
    if tv > model_vocab_size:
        problems.append(f"tokenizer vocab_size {tv} > model vocab_size {model_vocab_size}")
    spare = model_vocab_size - tv
    if spare > spare_rows_allowed(model_vocab_size):
        problems.append(f"tokenizer vocab_size {tv} is {spare} ids smaller than the model's {model_vocab_size} (more "
                        f"than the {spare_rows_allowed(model_vocab_size)} rows padding accounts for): it is the "
                        "tokenizer of another model")
    for name in ("bos_id", "eos_id"):
        v = getattr(tokenizer, name, None)
        if v is not None and not 0 <= int(v) < model_vocab_size:
            problems.append(f"{name}={v} is outside the model's ids [0, {model_vocab_size})")
    if problems:
        raise TokenizerMismatchError(
            f"tokenizer {tokenizer!r} does not match the model at {where}: " + "; ".join(problems)
            + ("" if tv > model_vocab_size else f" (tokenizer vocab_size {tv}, model vocab_size {model_vocab_size})")
            + ". Use the tokenizer "
            "that was trained with this model (e.g. tok512.bin for stories260K), or fix the model's vocab_size."
        )
