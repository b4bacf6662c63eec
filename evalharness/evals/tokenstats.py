"""Token-level comparison of the engine's next-token distributions with the FP32 reference's, on the device.

The logits of a batch of windows stay where the models computed them; log-probabilities are formed in float64
over slices of rows (at most `CHUNK_BYTES` of float64 at a time, so a 128k vocabulary never needs a float64 copy
of the whole batch) and reduced to a few numbers per token before anything leaves the device. Each row's
arithmetic is the same whatever the slicing, so the results are bit-reproducible.

The reference enters in one of two forms (`reference_summary`):

* full: its fp32 logits (rows, vocab); KL(reference || engine) is exact;
* top-k: per token its top-k log-probs and ids, the log of the remaining mass and the target's log-prob; the KL
  divergence is then that of the two distributions coarsened to the top-k ids plus one tail bucket, a lower bound
  of the full KLD that is tight when the reference's tail mass is small. k-records are small enough to cache on
  disk across invocations.
"""

from __future__ import annotations

import torch

CHUNK_BYTES = 256 * 2**20  # float64 bytes of one slice of rows x vocabulary
TOPK_FIELDS = ("idx", "lp", "log_tail", "tgt")


def _slices(rows: int, vocab: int):
    """Row slices of at most CHUNK_BYTES of float64 each."""
    step = max(1, CHUNK_BYTES // (8 * vocab))
    for a in range(0, rows, step):
        yield slice(a, min(rows, a + step))


def kl_from_logprobs(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last dimension from log-probabilities (..., vocab): the one token-KLD formula of the
    harness (every evaluation, the sensitivity search and the benchmarks call it). A -inf in both at an id adds NaN
    (0 * nan): callers that can meet masked vocabularies handle non-finite results themselves."""
    return (lp.exp() * (lp - lq)).sum(-1)


def reference_summary(logits: torch.Tensor, targets: torch.Tensor, k: int | None) -> dict[str, torch.Tensor]:
    """The reference side of the comparison for logits (..., vocab) and targets (...) (negative: not scored).

    k None: {"logits": fp32 logits}; else the top-k record {"idx" (..., k) int64, "lp" (..., k) float64,
    "log_tail" (...) float64, "tgt" (...) float64}, computed on the logits' device.
    """
    if k is None:
        return {"logits": logits.float()}
    vocab = logits.shape[-1]
    z = logits.reshape(-1, vocab)
    tgt = targets.reshape(-1).to(z.device).clamp_min(0)
    parts = {name: [] for name in TOPK_FIELDS}
    for sl in _slices(z.shape[0], vocab):
        lr = torch.log_softmax(z[sl].double(), dim=-1)  # (rows, vocab)
        vals, idx = lr.topk(k, dim=-1)  # (rows, k)
        parts["idx"].append(idx)
        parts["lp"].append(vals)
        parts["log_tail"].append((1.0 - vals.exp().sum(-1)).clamp_min(1e-300).log())
        parts["tgt"].append(lr.gather(-1, tgt[sl, None])[:, 0])
    shape = tuple(logits.shape[:-1])
    return {name: torch.cat(p).reshape(shape + ((k,) if name in ("idx", "lp") else ())) for name, p in parts.items()}


def select(summary: dict[str, torch.Tensor], start: int, count: int) -> dict[str, torch.Tensor]:
    """Windows [start, start + count) of a summary of many windows (first dimension)."""
    return {name: t[start:start + count] for name, t in summary.items()}


def compare(ref: dict[str, torch.Tensor], eng_logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per token (the shape of `targets`), on the engine logits' device: ``lr_t`` / ``le_t`` (reference / engine
    log-prob of the target, float64), ``kld`` (KL(reference || engine), float64, before any clamping),
    ``agree`` (same argmax, bool), ``finite`` (the engine's row is finite, bool) and, for a top-k reference,
    ``tail`` (the reference's mass outside its top k, float64)."""
    vocab = eng_logits.shape[-1]
    dev = eng_logits.device
    e = eng_logits.reshape(-1, vocab)
    tgt = targets.reshape(-1).to(dev).clamp_min(0)
    full = "logits" in ref
    r = {name: t.reshape((e.shape[0],) + tuple(t.shape[targets.dim():])).to(dev) for name, t in ref.items()}
    out = {name: [] for name in ("lr_t", "le_t", "kld", "agree", "finite") + (() if full else ("tail",))}
    for sl in _slices(e.shape[0], vocab):
        le = torch.log_softmax(e[sl].double(), dim=-1)  # (rows, vocab)
        out["le_t"].append(le.gather(-1, tgt[sl, None])[:, 0])
        out["finite"].append(torch.isfinite(le).all(-1))
        top = le.argmax(-1)
        if full:
            lr = torch.log_softmax(r["logits"][sl].double(), dim=-1)  # (rows, vocab)
            out["lr_t"].append(lr.gather(-1, tgt[sl, None])[:, 0])
            out["kld"].append(kl_from_logprobs(lr, le))
            out["agree"].append(lr.argmax(-1) == top)
        else:
            idx, lp, log_tail = r["idx"][sl], r["lp"][sl], r["log_tail"][sl]
            le_k = le.gather(-1, idx)  # engine log-probs at the reference's top-k ids
            q_tail = (1.0 - le_k.exp().sum(-1)).clamp_min(1e-300)
            out["kld"].append(kl_from_logprobs(lp, le_k) + log_tail.exp() * (log_tail - q_tail.log()))
            out["agree"].append(idx[:, 0] == top)
            out["lr_t"].append(r["tgt"][sl])
            out["tail"].append(log_tail.exp())
    shape = tuple(targets.shape)
    return {name: torch.cat(p).reshape(shape) for name, p in out.items()}
