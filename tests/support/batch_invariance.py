"""Batched generation against one request at a time, within the batch invariance measured on the same requests."""

from __future__ import annotations

import torch


def parted_within_invariance(eng, requests, serving) -> int:
    """Decode `requests` together (`eng.generate_batch` under `serving`, step logits kept) and each alone
    (`eng.generate`). Before the two decodes part, the batch moves each step's logits by at most delta (measured);
    where they part, the one-at-a-time decode's top-1/top-2 margin must be within 2 * delta (a near-tie that the
    batch composition may flip), never a real error. Returns how many requests parted."""
    gens = eng.generate_batch(requests, serving, keep_logits=True)
    parted = 0
    for r, g in zip(requests, gens):
        tokens, logits = eng.generate(list(r.prompt), r.max_new_tokens, return_logits=True)
        logits = logits.cpu()
        split = next((i for i, (a, b) in enumerate(zip(g.tokens, tokens)) if a != b), None)
        upto = len(tokens) if split is None else split + 1  # the parting step's logits still share a context
        delta = (g.logits[:upto] - logits[:upto]).abs().max().item()
        if split is not None:
            parted += 1
            top = torch.topk(logits[split], 2).values
            assert (top[0] - top[1]).item() <= 2 * delta, (r, split, delta)
    return parted
