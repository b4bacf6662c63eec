"""Batched greedy generation: request and result records, per-step statistics, and the bookkeeping of a decode
loop (the paged runtime's, and the FP32 reference's in the harness).

Every evaluation that generates submits all its requests at once (`Engine.generate_batch`, and the FP32
reference's `generate_batch` in the harness); the engine decodes them through its serving runtime
(`engine.runtime.PagedRuntime.serve`: continuous batching over KV pages in the recipe's cache format, CUDA graphs
on the GPU for GQA / MQA in one process).

Nothing per step leaves the device: the next tokens, and with ``step_stats`` each step's predictive entropy and
top-1/top-2 logit margin, are written into device buffers by index (`Recorder`) and read back once per batch.
The only per-step host sync is the stop check of requests that have stop ids.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One greedy request: `max_new_tokens` after `prompt`, ending early at the first token in `stop_ids`
    (that token is kept)."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        object.__setattr__(self, "stop_ids", tuple(int(t) for t in self.stop_ids))
        if not self.prompt:
            raise ValueError("a generation request needs at least one prompt token")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")


@dataclasses.dataclass
class Generation:
    """The new tokens of one request, and per generated token (with ``step_stats``) the entropy in nats of the
    distribution it was chosen from and that distribution's top-1 minus top-2 logit; with ``keep_logits`` the
    step logits (new, vocab) fp32 on the CPU (tests and small models only)."""

    tokens: list[int]
    entropy: list[float] | None = None
    margin: list[float] | None = None
    logits: torch.Tensor | None = None


def step_statistics(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(entropy in nats, top-1 minus top-2 logit) of every row of (rows, vocab) logits, float64, on their device
    (the top-2 logit margin equals the log-probability margin)."""
    x = logits.double()
    lp = torch.log_softmax(x, dim=-1)  # (rows, vocab)
    top = torch.topk(x, k=2, dim=-1).values  # (rows, 2)
    return -(lp.exp() * lp).sum(-1), top[:, 0] - top[:, 1]


class Recorder:
    """Device buffers holding the outputs of `n` requests of at most `max_new` tokens each.

    `record(rows, pos, logits)` takes the step logits (b, vocab) of requests `rows` (b,) at output positions
    `pos` (b,) (both device tensors), writes the greedy tokens (and statistics) there and returns those tokens;
    `results(lengths)` reads everything back at once.
    """

    def __init__(self, n: int, max_new: int, device: torch.device, step_stats: bool = False,
                 keep_logits: bool = False):
        self.tokens = torch.zeros((n, max_new), dtype=torch.long, device=device)
        self.stats = torch.zeros((2, n, max_new), dtype=torch.float64, device=device) if step_stats else None
        self.logits: list[list[torch.Tensor]] | None = [[] for _ in range(n)] if keep_logits else None

    def record(self, rows: torch.Tensor, pos: torch.Tensor, logits: torch.Tensor,
               host_rows: Sequence[int] | None = None) -> torch.Tensor:
        """Greedy tokens (b,) of the step logits (b, vocab); stored at (rows, pos). `host_rows` (the same rows as
        host ints) is needed only with ``keep_logits``."""
        nxt = logits.argmax(-1)  # (b,)
        self.tokens[rows, pos] = nxt
        if self.stats is not None:
            ent, margin = step_statistics(logits)
            self.stats[0, rows, pos] = ent
            self.stats[1, rows, pos] = margin
        if self.logits is not None:
            rows_cpu = logits.float().cpu()
            for j, r in enumerate(host_rows):
                self.logits[r].append(rows_cpu[j])
        return nxt

    def results(self, lengths: Sequence[int]) -> list[Generation]:
        """The generations (request i: its first lengths[i] tokens), read back in one transfer each buffer."""
        toks = self.tokens.cpu().tolist()
        stats = self.stats.cpu().tolist() if self.stats is not None else None
        out = []
        for i, n in enumerate(lengths):
            g = Generation(toks[i][:n])
            if stats is not None:
                g.entropy, g.margin = stats[0][i][:n], stats[1][i][:n]
            if self.logits is not None:
                g.logits = torch.stack(self.logits[i][:n])
            out.append(g)
        return out


def cap_requests(requests: Sequence[GenerationRequest], max_position: int) -> list[GenerationRequest]:
    """Requests with their generation budget cut so that prompt + new tokens fit the model's context (as
    `Engine.generate` does); a prompt that leaves no room is an error naming its length."""
    out = []
    for i, r in enumerate(requests):
        room = max_position - len(r.prompt)
        if room < 1:
            raise ValueError(f"generation request {i}: its prompt of {len(r.prompt)} tokens leaves no room in the "
                             f"model's context of {max_position}; shorten the prompt")
        out.append(r if r.max_new_tokens <= room else dataclasses.replace(r, max_new_tokens=room))
    return out


def finished(req: GenerationRequest, produced: int, token: int | None) -> bool:
    """Whether a request is done after `produced` tokens, the last being `token` (None: not read back, which
    happens only for requests without stop ids)."""
    return produced >= req.max_new_tokens or (token is not None and token in req.stop_ids)


def lockstep_step(rec: Recorder, requests: Sequence[GenerationRequest], live: list[int], step: int,
                  logits: torch.Tensor, lengths: list[int],
                  on_done: Optional[Callable[[int], None]] = None) -> tuple[torch.Tensor, list[int]]:
    """One step of requests `live` decoding in lockstep (all at output position `step`): record their greedy tokens
    from logits (b, vocab), set their lengths; returns (tokens (b,), positions in `live` of those not finished).
    `on_done(n)` is told how many requests finished at this step (a progress bar)."""
    rows = torch.tensor(live, dtype=torch.long, device=logits.device)
    nxt = rec.record(rows, torch.full_like(rows, step), logits, live)
    host = nxt.tolist() if any(requests[i].stop_ids for i in live) else [None] * len(live)
    keep = []
    for j, i in enumerate(live):
        lengths[i] = step + 1
        if not finished(requests[i], step + 1, host[j]):
            keep.append(j)
    if on_done is not None and len(keep) < len(live):
        on_done(len(live) - len(keep))
    return nxt, keep
