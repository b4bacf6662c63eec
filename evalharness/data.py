"""Corpora and token windows for the PPL/KLD and per-layer evals.

A corpus reference is one of:

* ``builtin:NAME``: the token corpus shipped with a built-in model
  (`evalharness/builtin/NAME/corpus.json`), usable with no data dir;
* a path to a token-corpus JSON (``{"vocab_size": V, "tokens": [...]}``);
* a path to a plain-text file (tokenized with the model's tokenizer);
* ``hf:NAME[:CONFIG]:SPLIT[#FIELD]``: a dataset through `datasets.load_dataset`
  (a hub name such as ``hf:wikitext:wikitext-2-raw-v1:test``, or a local folder
  of data files), the records' FIELD (default ``text``) joined by blank lines.
  Hub names need the network or the local datasets cache (`HF_DATASETS_OFFLINE=1`
  works from the cache); on machines without either, use the files of
  ``--data-dir``.
"""

from __future__ import annotations

import codecs
import dataclasses
import io
import json
from pathlib import Path
from typing import Iterable, Iterator

import torch

from evalharness.errors import DataError
from evalharness.provenance import sha256_tensor

BUILTIN_DIR = Path(__file__).parent / "builtin"
READ_BYTES = 1 << 20  # a text corpus is read this many bytes at a time
ENCODE_CHARS = 8192  # lines are gathered into chunks of at least this many characters, each encoded on its own
MAX_LINE = 1 << 16  # a longer line is split (after a space) into parts of at most this many characters


def builtin_path(name: str) -> Path:
    """Folder of a built-in model (`builtin:NAME`)."""
    p = BUILTIN_DIR / name
    if not p.is_dir():
        avail = sorted(d.name for d in BUILTIN_DIR.iterdir() if d.is_dir()) if BUILTIN_DIR.is_dir() else []
        raise DataError(f"unknown built-in '{name}'; available: {avail}")
    return p


def _read_token_file(path: Path, vocab_size: int) -> list[int]:
    """Token ids of a token-corpus JSON, checked against the model's vocabulary."""
    try:
        obj = json.loads(path.read_text())
        tokens = [int(t) for t in obj["tokens"]]
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{path}: not a token corpus ({{'vocab_size', 'tokens'}} JSON): {exc}") from None
    corpus_vocab = int(obj.get("vocab_size", max(tokens) + 1))
    if corpus_vocab != vocab_size or (tokens and max(tokens) >= vocab_size):
        raise DataError(
            f"{path}: token corpus was made for a vocabulary of {corpus_vocab} ids but the model has {vocab_size}; "
            "use a text corpus (it is tokenized with the model's tokenizer) or the matching model"
        )
    return tokens


def _hf_text(ref: str) -> Iterator[str]:
    """The text of an ``hf:NAME[:CONFIG]:SPLIT[#FIELD]`` corpus (see the module docstring), record by record: the
    records' FIELD joined by blank lines, streamed (a large split is never one string)."""
    spec, _, field = ref.removeprefix("hf:").partition("#")
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise DataError(f"corpus '{ref}': expected hf:NAME[:CONFIG]:SPLIT[#FIELD], e.g. hf:wikitext:wikitext-2-raw-v1:test")
    name, config, split = (parts[0], None, parts[1]) if len(parts) == 2 else parts
    try:
        import datasets
    except ImportError:
        raise DataError(f"corpus '{ref}' needs the `datasets` package (pip install 'evalharness[eval]')") from None
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # network, cache miss, unknown name/split: all mean "cannot read this corpus"
        raise DataError(f"corpus '{ref}': datasets.load_dataset({name!r}, {config!r}, split={split!r}) failed "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); offline, only "
                        "datasets in the local cache load -- use a file from --data-dir instead") from None
    field = field or "text"
    if field not in ds.column_names:
        raise DataError(f"corpus '{ref}': no field '{field}' (fields: {ds.column_names}); add #FIELD to the reference")
    first = True
    for batch in ds.iter(batch_size=256):
        for t in batch[field]:
            if t:
                if not first:
                    yield "\n\n"
                first = False
                yield str(t)


def _file_text(path: Path) -> Iterator[str]:
    """The text of a corpus file, READ_BYTES at a time, decoded as strict UTF-8 with universal newlines (as
    `open(path).read()`): a file that is not UTF-8 text (a binary file, another encoding) is a DataError naming the
    byte offset, not a stream of replacement characters."""
    decoder = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8")(errors="strict"), translate=True)
    offset = 0
    try:
        with open(path, "rb") as f:
            while True:
                data = f.read(READ_BYTES)
                nul = data.find(b"\0")
                if nul >= 0:
                    raise DataError(f"corpus {path}: binary file (a NUL byte at offset {offset + nul}); a text corpus "
                                    "is UTF-8 text: give a text file, a token JSON or hf:NAME:SPLIT")
                try:
                    text = decoder.decode(data, final=not data)
                except UnicodeDecodeError as exc:
                    raise DataError(f"corpus {path}: not UTF-8 text (byte {data[exc.start]:#04x} near offset "
                                    f"{offset + exc.start}: {exc.reason}); convert it to UTF-8 (e.g. iconv -t UTF-8) "
                                    "or give a token JSON") from None
                if text:
                    yield text
                if not data:
                    return
                offset += len(data)
    except OSError as exc:
        raise DataError(f"cannot read corpus {path}: {exc.strerror}") from None


def _cut(line: str, limit: int) -> int:
    """Where to split an over-long line: after its last space in (limit / 2, limit], else at `limit`."""
    at = line.rfind(" ", limit // 2, limit)
    return at + 1 if at >= 0 else limit


def _lines(pieces: Iterable[str], limit: int = MAX_LINE) -> Iterator[str]:
    """The lines (with their ends, as `str.splitlines(keepends=True)` gives them) of the concatenated `pieces`,
    without ever holding more than one piece and one line; a line longer than `limit` characters comes in parts
    (split after a space where there is one)."""
    buf = ""
    for piece in pieces:
        buf += piece
        lines = buf.splitlines(keepends=True)
        buf = lines.pop() if lines else ""  # may still grow (or end in "\r" of a "\r\n")
        while len(buf) > limit:
            cut = _cut(buf, limit)
            lines.append(buf[:cut])
            buf = buf[cut:]
        for line in lines:
            while len(line) > limit:
                cut = _cut(line, limit)
                yield line[:cut]
                line = line[cut:]
            yield line
    if buf:
        yield buf


def load_corpus_tokens(ref: str, tokenizer, vocab_size: int, max_tokens: int) -> list[int]:
    """Token ids of a corpus, at most `max_tokens` of them.

    Text is read and tokenized as a stream and only as far as needed: lines are gathered into chunks of at least
    ENCODE_CHARS characters, each chunk encoded on its own, and reading stops once `max_tokens` ids exist, so the
    memory used does not grow with the corpus (a 50 MB file for two windows reads a few chunks). The tokens of a
    shorter read are a prefix of a longer one's. Token JSON files are read whole."""
    if ref.startswith("builtin:"):
        return _read_token_file(builtin_path(ref.removeprefix("builtin:")) / "corpus.json", vocab_size)[:max_tokens]
    if ref.startswith("hf:"):
        path = Path(ref)  # for messages only
        if tokenizer is None:
            raise DataError(f"{ref}: a text corpus needs a tokenizer, and the model has none; set 'tokenizer'")
        text = _hf_text(ref)
    else:
        path = Path(ref).expanduser()
        if not path.exists():
            raise DataError(f"corpus not found: {path} (check --data-dir and the suite's corpus path)")
        if path.suffix == ".json":
            return _read_token_file(path, vocab_size)[:max_tokens]
        if not path.is_file():
            raise DataError(f"corpus {path} is not a file; give a text file, a token JSON or hf:NAME:SPLIT")
        if tokenizer is None:
            raise DataError(f"{path}: a text corpus needs a tokenizer, and the model has none; set 'tokenizer' in "
                            "the suite")
        text = _file_text(path)
    tokens: list[int] = []
    chunk: list[str] = []
    size = 0
    lines = _lines(text)
    try:
        for line in lines:
            chunk.append(line)
            size += len(line)
            if size >= ENCODE_CHARS:
                tokens.extend(tokenizer.encode("".join(chunk), bos=False, eos=False))
                chunk, size = [], 0
                if len(tokens) >= max_tokens:
                    break
    finally:
        lines.close()  # closes the file when reading stopped early
    if chunk and len(tokens) < max_tokens:
        tokens.extend(tokenizer.encode("".join(chunk), bos=False, eos=False))
    if not tokens:
        raise DataError(f"corpus {path} produced no tokens")
    bad = [t for t in tokens[:max_tokens] if not 0 <= t < vocab_size]
    if bad:
        raise DataError(f"corpus {path}: tokenizer produced id {bad[0]} outside the model's vocab ({vocab_size})")
    return tokens[:max_tokens]


def tokens_needed(seq_len: int, stride: int | None, max_windows: int | None, max_tokens: int, bos: bool) -> int:
    """How many corpus tokens `make_windows` can use for these settings: enough for `max_windows` windows (capped by
    `max_tokens`), or `max_tokens` when the number of windows is not limited."""
    if max_windows is None:
        return max_tokens
    body = seq_len - (1 if bos else 0)
    return min(max_tokens, (max_windows - 1) * (stride or body) + body + 1)


@dataclasses.dataclass
class Windows:
    """Evaluation windows: inputs (n, seq_len) and next-token targets (n, seq_len), -1 where not scored."""

    inputs: torch.Tensor
    targets: torch.Tensor

    @property
    def n(self) -> int:
        """Number of windows."""
        return int(self.inputs.shape[0])

    @property
    def sha256(self) -> str:
        """Hash of the exact token windows (data provenance; the reference cache keys on it)."""
        return sha256_tensor(torch.stack([self.inputs, self.targets]))

    def batches(self, batch_size: int):
        """Yield (start index, inputs, targets) batches of up to `batch_size` windows."""
        for s in range(0, self.n, batch_size):
            yield s, self.inputs[s:s + batch_size], self.targets[s:s + batch_size]


def make_windows(tokens: list[int], seq_len: int, stride: int | None = None, max_windows: int | None = None,
                 bos_id: int | None = None) -> Windows:
    """Slide windows of `seq_len` tokens over the stream.

    With `stride < seq_len` windows overlap and only the last `stride` targets of
    every window but the first are scored (each token is scored once, with at
    least `seq_len - stride` tokens of context). With `bos_id`, each window
    starts with BOS followed by `seq_len - 1` stream tokens.
    """
    body = seq_len - (1 if bos_id is not None else 0)
    stride = stride or body
    if not 0 < stride <= body:
        raise ValueError(f"stride must be in 1..{body}, got {stride}")
    if len(tokens) < body + 1:
        raise DataError(f"corpus has {len(tokens)} tokens, fewer than one window of {body + 1}; lower seq_len")
    ins, tgts = [], []
    start = 0
    while start + body + 1 <= len(tokens):
        chunk = tokens[start:start + body + 1]  # body inputs + 1 extra target
        x = ([bos_id] if bos_id is not None else []) + chunk[:body]
        y = chunk[:body + 1] if bos_id is not None else chunk[1:body + 1]
        y = list(y)[-seq_len:]
        if start > 0 and stride < body:
            y = [-1] * (seq_len - stride) + y[seq_len - stride:]
        ins.append(x)
        tgts.append(y)
        start += stride
        if max_windows is not None and len(ins) >= max_windows:
            break
    return Windows(torch.tensor(ins, dtype=torch.long), torch.tensor(tgts, dtype=torch.long))
