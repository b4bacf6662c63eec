"""Reader for llama2.c "legacy" fp32 checkpoints, converted to HF Llama layout.

The llama2.c legacy format (``run.c`` version 0) is a flat binary file:

* a 28-byte header of 7 little-endian int32:
  ``dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len``.
  A *negative* ``vocab_size`` means the classifier (``wcls``) is stored
  separately at the end of the file; a positive one means it is tied to the
  token embedding.
* then raw little-endian fp32 tensors, in this order (shapes are row-major,
  linear weights stored as ``(out_features, in_features)`` like ``nn.Linear``)::

      token_embedding (vocab, dim)
      rms_att         (L, dim)
      wq              (L, dim, dim)
      wk              (L, kv_dim, dim)
      wv              (L, kv_dim, dim)
      wo              (L, dim, dim)
      rms_ffn         (L, dim)
      w1              (L, hidden, dim)
      w2              (L, dim, hidden)
      w3              (L, hidden, dim)
      rms_final       (dim,)
      freq_cis_real   (seq_len, head_size // 2)
      freq_cis_imag   (seq_len, head_size // 2)
      wcls            (vocab, dim)        # only when the header vocab is < 0

  with ``kv_dim = dim * n_kv_heads // n_heads`` and ``head_size = dim // n_heads``.

:func:`read_llama2c` returns an HF ``LlamaForCausalLM``-compatible config dict
and a state dict with HF parameter names, so the checkpoint can be loaded into
``transformers.LlamaForCausalLM(LlamaConfig(**config))`` with ``strict=True``.
The only non-trivial part is the RoPE layout conversion of ``wq``/``wk``; see
:func:`permute_rope_rows`.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

import numpy as np
import torch

from engine.errors import CheckpointError

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "HEADER_FORMAT",
    "read_llama2c",
    "read_llama2c_header",
    "permute_rope_rows",
]

#: numpy dtype of the header: 7 little-endian int32.
HEADER_FORMAT = np.dtype("<i4")
_HEADER_INTS = 7
_HEADER_BYTES = _HEADER_INTS * HEADER_FORMAT.itemsize  # 28
_F32 = np.dtype("<f4")  # every tensor in the file is little-endian fp32

_ROPE_THETA = 10000.0
_RMS_EPS = 1e-5


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint path does not exist (also a ``FileNotFoundError``)."""


def _fail(path: str | os.PathLike, problem: str, fix: str) -> CheckpointError:
    """Build a :class:`CheckpointError` with a uniform 'file: problem. fix' message."""
    return CheckpointError(f"llama2.c checkpoint {str(path)!r}: {problem}. {fix}")


def read_llama2c_header(path: str | os.PathLike) -> dict:
    """Read and validate the 28-byte llama2.c legacy header of ``path``.

    Returns a dict with keys ``dim, hidden_dim, n_layers, n_heads, n_kv_heads,
    vocab_size, seq_len`` (``vocab_size`` made positive), plus ``shared_classifier``
    (True when the header vocab size was positive, i.e. tied embeddings),
    ``head_size`` and ``kv_dim``.

    Raises :class:`CheckpointNotFoundError` for a missing path and
    :class:`CheckpointError` for a file shorter than the header or a header
    that cannot describe a Llama model (non-positive sizes, ``dim`` not
    divisible by ``n_heads``, ``n_heads`` not divisible by ``n_kv_heads``, odd
    head size).
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointNotFoundError(
            f"llama2.c checkpoint {str(path)!r} does not exist. Check the path "
            "(e.g. the --data-dir / EVALHARNESS_DATA_DIR setting) or download the "
            "checkpoint (stories260K.bin etc.) to that location."
        )
    if not p.is_file():
        raise _fail(path, "is not a regular file", "Pass the path of the .bin checkpoint itself")
    size = p.stat().st_size
    if size < _HEADER_BYTES:
        raise _fail(
            path,
            f"file is {size} bytes, shorter than the {_HEADER_BYTES}-byte header "
            "(7 int32: dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len)",
            "The file is truncated or not a llama2.c legacy checkpoint; re-download or re-export it",
        )
    raw = np.fromfile(p, dtype=HEADER_FORMAT, count=_HEADER_INTS)
    dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_raw, seq_len = (int(x) for x in raw)
    fields = dict(
        dim=dim, hidden_dim=hidden_dim, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=n_kv_heads, vocab_size=abs(vocab_raw), seq_len=seq_len,
    )
    hint = (
        "This does not look like a llama2.c legacy (version 0) fp32 checkpoint; "
        "newer llama2.c exports (version 1/2, magic 'ak42') are not supported: "
        "re-export with export.py --version 0"
    )
    bad = [k for k, v in fields.items() if v <= 0]
    if bad:
        raise _fail(path, f"header has non-positive field(s) {bad} (header: {fields})", hint)
    if dim % n_heads:
        raise _fail(path, f"dim={dim} is not divisible by n_heads={n_heads} (header: {fields})", hint)
    if n_heads % n_kv_heads:
        raise _fail(
            path, f"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads} (header: {fields})", hint
        )
    head_size = dim // n_heads
    if head_size % 2:
        raise _fail(path, f"head size dim/n_heads={head_size} is odd; RoPE needs an even head size", hint)
    fields["shared_classifier"] = vocab_raw > 0
    fields["head_size"] = head_size
    fields["kv_dim"] = dim * n_kv_heads // n_heads
    return fields


def _tensor_layout(h: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Return ``[(llama2.c name, shape), ...]`` in file order for header ``h``."""
    L, d, hid, kv, V = h["n_layers"], h["dim"], h["hidden_dim"], h["kv_dim"], h["vocab_size"]
    half = h["head_size"] // 2
    layout = [
        ("token_embedding", (V, d)),
        ("rms_att", (L, d)),
        ("wq", (L, d, d)),
        ("wk", (L, kv, d)),
        ("wv", (L, kv, d)),
        ("wo", (L, d, d)),
        ("rms_ffn", (L, d)),
        ("w1", (L, hid, d)),
        ("w2", (L, d, hid)),
        ("w3", (L, hid, d)),
        ("rms_final", (d,)),
        ("freq_cis_real", (h["seq_len"], half)),
        ("freq_cis_imag", (h["seq_len"], half)),
    ]
    if not h["shared_classifier"]:
        layout.append(("wcls", (V, d)))
    return layout


def permute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder q/k projection rows from llama2.c's interleaved RoPE to HF's rotate-half.

    llama2.c rotates *adjacent* pairs of each head's vector: for ``i`` in
    ``[0, hs/2)`` the pair ``(x[2i], x[2i+1])`` is rotated by angle
    ``pos * theta**(-2i/hs)``. HF Llama (``rotate_half``) rotates the pair
    ``(x[i], x[i + hs/2])`` by the same angle ``pos * inv_freq[i]`` with
    ``inv_freq[i] = theta**(-2i/hs)``.

    So if, inside every head, output row ``2i`` of the projection is moved to
    position ``i`` and row ``2i+1`` to position ``i + hs/2``, HF's rotate-half
    applies exactly the rotation llama2.c applied to that pair. The new row
    order within a head is ``[0, 2, 4, ..., hs-2, 1, 3, ..., hs-1]`` (evens,
    then odds). Because q and k are permuted identically (per head) and the
    attention score is a dot product over the whole head, ``q.k`` is unchanged
    by the reordering itself; only the rotation pairing had to match. ``wv``
    and ``wo`` need no change.

    Args:
        w: ``(n_heads * hs, in_features)`` weight (``nn.Linear`` layout).
        n_heads: number of heads the rows are split into (``n_kv_heads`` for wk).

    Returns:
        A new contiguous tensor of the same shape with permuted rows.
    """
    out_features, in_features = w.shape
    if out_features % (2 * n_heads):
        raise ValueError(f"cannot split {out_features} rows into {n_heads} heads of even size")
    hs = out_features // n_heads
    # (H*hs, in) -> (H, hs/2, 2, in): axis 1 = pair index i, axis 2 = member (2i or 2i+1)
    w4 = w.reshape(n_heads, hs // 2, 2, in_features)
    # (H, hs/2, 2, in) -> (H, 2, hs/2, in): all pair-first members, then all pair-second members
    w4 = w4.transpose(1, 2)
    # (H, 2, hs/2, in) -> (H*hs, in)
    return w4.reshape(out_features, in_features).contiguous()


def _check_rope_tables(path, h: dict, real: np.ndarray, imag: np.ndarray) -> None:
    """Warn if the stored freq_cis tables do not match RoPE with theta=10000."""
    hs = h["head_size"]
    inv_freq = _ROPE_THETA ** (-np.arange(0, hs, 2, dtype=np.float64) / hs)  # (hs/2,)
    pos = np.arange(h["seq_len"], dtype=np.float64)[:, None]  # (seq, 1)
    ang = pos * inv_freq[None, :]  # (seq, hs/2)
    err = max(np.abs(real - np.cos(ang)).max(), np.abs(imag - np.sin(ang)).max())
    if not math.isfinite(err) or err > 1e-3:
        warnings.warn(
            f"llama2.c checkpoint {str(path)!r}: stored freq_cis tables differ from RoPE with "
            f"theta={_ROPE_THETA} by up to {err:.3g}; the converted config assumes "
            f"rope_theta={_ROPE_THETA}, so outputs may differ from llama2.c",
            stacklevel=3,
        )


def read_llama2c(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a llama2.c legacy fp32 checkpoint as an HF Llama config + state dict.

    Args:
        path: path of the ``.bin`` checkpoint (e.g. ``stories260K.bin``).

    Returns:
        ``(hf_config, state_dict)``. ``hf_config`` is a plain dict usable as
        ``transformers.LlamaConfig(**hf_config)`` (``model_type`` "llama",
        rope_theta 10000, rms_norm_eps 1e-5, bos 1 / eos 2, no biases, silu).
        ``state_dict`` maps HF ``LlamaForCausalLM`` parameter names to fp32
        CPU tensors; q/k weights are row-permuted for HF's rotate-half RoPE
        (see :func:`permute_rope_rows`). For tied checkpoints
        ``state_dict["lm_head.weight"]`` *is* ``state_dict["model.embed_tokens.weight"]``
        (same tensor object), so use ``safetensors.torch.save_model`` or drop
        the duplicate before ``save_file``.

    Raises:
        CheckpointNotFoundError: the file does not exist.
        CheckpointError: bad header, or the file size differs from what the
            header implies (truncated or trailing data).
    """
    h = read_llama2c_header(path)
    layout = _tensor_layout(h)
    n_floats = sum(math.prod(shape) for _, shape in layout)
    expected = _HEADER_BYTES + n_floats * _F32.itemsize
    size = Path(path).stat().st_size
    if size != expected:
        what = "truncated" if size < expected else "has trailing data"
        raise _fail(
            path,
            f"file is {size} bytes but the header (dim={h['dim']}, hidden_dim={h['hidden_dim']}, "
            f"n_layers={h['n_layers']}, n_heads={h['n_heads']}, n_kv_heads={h['n_kv_heads']}, "
            f"vocab_size={h['vocab_size']}, seq_len={h['seq_len']}, "
            f"{'shared' if h['shared_classifier'] else 'unshared'} classifier) implies "
            f"{expected} bytes ({what}, difference {size - expected:+d})",
            "Re-download or re-export the checkpoint as a llama2.c legacy (version 0) fp32 file",
        )

    flat = np.fromfile(path, dtype=_F32, offset=_HEADER_BYTES)  # (n_floats,) little-endian
    flat = flat.astype(np.float32, copy=False)  # native byte order for torch
    if flat.size != n_floats:  # file changed under us
        raise _fail(path, f"read {flat.size} floats, expected {n_floats}", "Retry; is the file being written?")
    t: dict[str, np.ndarray] = {}
    off = 0
    for name, shape in layout:
        n = math.prod(shape)
        t[name] = flat[off : off + n].reshape(shape)  # (n,) -> shape from the layout table
        off += n
    _check_rope_tables(path, h, t["freq_cis_real"], t["freq_cis_imag"])

    def tt(a: np.ndarray) -> torch.Tensor:
        """Copy a numpy view into its own contiguous fp32 torch tensor."""
        return torch.from_numpy(np.ascontiguousarray(a)).clone()

    sd: dict[str, torch.Tensor] = {}
    sd["model.embed_tokens.weight"] = tt(t["token_embedding"])
    for i in range(h["n_layers"]):
        pre = f"model.layers.{i}."
        sd[pre + "self_attn.q_proj.weight"] = permute_rope_rows(tt(t["wq"][i]), h["n_heads"])
        sd[pre + "self_attn.k_proj.weight"] = permute_rope_rows(tt(t["wk"][i]), h["n_kv_heads"])
        sd[pre + "self_attn.v_proj.weight"] = tt(t["wv"][i])
        sd[pre + "self_attn.o_proj.weight"] = tt(t["wo"][i])
        sd[pre + "mlp.gate_proj.weight"] = tt(t["w1"][i])
        sd[pre + "mlp.up_proj.weight"] = tt(t["w3"][i])
        sd[pre + "mlp.down_proj.weight"] = tt(t["w2"][i])
        sd[pre + "input_layernorm.weight"] = tt(t["rms_att"][i])
        sd[pre + "post_attention_layernorm.weight"] = tt(t["rms_ffn"][i])
    sd["model.norm.weight"] = tt(t["rms_final"])
    if h["shared_classifier"]:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    else:
        sd["lm_head.weight"] = tt(t["wcls"])
    del flat, t

    hf_config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": h["dim"],
        "intermediate_size": h["hidden_dim"],
        "num_hidden_layers": h["n_layers"],
        "num_attention_heads": h["n_heads"],
        "num_key_value_heads": h["n_kv_heads"],
        "head_dim": h["head_size"],
        "vocab_size": h["vocab_size"],
        "max_position_embeddings": h["seq_len"],
        "rms_norm_eps": _RMS_EPS,
        "rope_theta": _ROPE_THETA,
        "tie_word_embeddings": bool(h["shared_classifier"]),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    return hf_config, sd
