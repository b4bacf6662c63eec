"""Generation requests from the evaluations to a model: all at once, batched as the model serves them.

The engine (`engine.api.Engine.generate_batch`: the paged serving runtime, on every rank under TP / EP) and
the FP32 reference (`evalharness.reference.ReferenceLM.generate_batch`: transformers with its KV cache, padded
batches) both take the whole request list; a third-party engine that offers only the one-request
``generate(prompt, max_new_tokens, stop_ids, return_logits)`` of the narrow interface is driven one request at a
time, with the same per-step statistics.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

from engine.generation import Generation, GenerationRequest, step_statistics


def generate_many(model: Any, requests: Sequence[GenerationRequest], max_batch: int,
                  step_stats: bool = False, on_done: Callable[[int], None] | None = None) -> list[Generation]:
    """Greedy generations of `requests` by `model`, decoded `max_batch` at a time when it batches. `on_done(n)` is
    told as n more requests finish (a progress bar), where the model's `generate_batch` takes it."""
    if hasattr(model, "generate_batch"):
        kwargs = {"on_done": on_done} if on_done is not None and \
            "on_done" in inspect.signature(model.generate_batch).parameters else {}
        return model.generate_batch(requests, max_batch=max_batch, step_stats=step_stats, **kwargs)
    out = []
    for r in requests:
        if not step_stats:
            out.append(Generation([int(t) for t in model.generate(list(r.prompt), r.max_new_tokens,
                                                                  stop_ids=r.stop_ids)]))
        else:
            tokens, logits = model.generate(list(r.prompt), r.max_new_tokens, stop_ids=r.stop_ids,
                                            return_logits=True)
            ent, margin = step_statistics(logits)
            out.append(Generation([int(t) for t in tokens], ent.tolist(), margin.tolist()))
        if on_done is not None:
            on_done(1)
    return out
