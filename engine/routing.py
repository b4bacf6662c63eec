"""MoE routing math: router logits -> (top-k weights, top-k expert ids), and the sort-by-expert plan.

Pure tensor functions, no recipe: `Numerics.moe` (the dispatch point) calls
them. Formulas (tokens n, experts E, k experts per token), all in fp32:

* scores: ``softmax(logits)`` over the E experts, or ``sigmoid(logits)``;
* choice scores: ``scores + correction_bias`` (DeepSeek-V3), used for
  *selection only* -- the weights are always taken from the unbiased scores;
* group-limited top-k: experts form G groups of E/G; a group's score is its
  ``max`` choice score (DeepSeek-V2) or the sum of its two best (``top2sum``,
  DeepSeek-V3); only the `topk_group` best groups stay eligible (others -inf);
* ids = top-k of the eligible choice scores; weights = scores[ids];
* ``norm_topk_prob``: weights /= sum(weights) (+1e-20 for sigmoid scores, as
  DeepSeek-V3 does); then weights *= ``routed_scaling_factor``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.config import MoeConfig


def route(logits: torch.Tensor, cfg: MoeConfig, correction_bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of fp32 `logits` (tokens, experts) -> weights (tokens, k) fp32, ids (tokens, k) int64."""
    logits = logits.float()
    scores = torch.softmax(logits, dim=-1) if cfg.scoring == "softmax" else torch.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias.float()  # (tokens, experts)
    if cfg.group_limited:
        n = choice.shape[0]
        grouped = choice.view(n, cfg.n_group, cfg.num_experts // cfg.n_group)  # (tokens, groups, per_group)
        if cfg.group_score == "max":
            group_scores = grouped.max(dim=-1).values  # (tokens, groups)
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (tokens, groups)
        keep_groups = group_scores.topk(cfg.topk_group, dim=-1).indices  # (tokens, topk_group)
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(n, cfg.num_experts)  # (tokens, experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = choice.topk(cfg.top_k, dim=-1).indices  # (tokens, k), best first
    weights = scores.gather(1, ids)  # (tokens, k)
    if cfg.norm_topk_prob:
        denom = weights.sum(dim=-1, keepdim=True)
        if cfg.scoring == "sigmoid":
            denom = denom + 1e-20
        weights = weights / denom
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return weights, ids


class DispatchPlan(NamedTuple):
    """Token copies sorted by expert: copy j of the sorted order is token `token[j]` going to an expert.

    order: (tokens*k,) positions into the flattened (tokens, k) choices, sorted by expert id (stable);
    token: (tokens*k,) the token index of each sorted copy;
    counts: per-expert number of copies (a Python list: the segment boundaries).
    """

    order: torch.Tensor
    token: torch.Tensor
    counts: list[int]


def dispatch_plan(ids: torch.Tensor, num_experts: int) -> DispatchPlan:
    """Sort the (tokens, k) expert choices by expert into contiguous per-expert segments.

    The segment sizes come to the host with one ``bincount(...).tolist()`` per
    layer. That sync is fine for the CPU emulation; the GPU path must avoid it
    (a grouped GEMM reading device-side segment offsets).
    """
    k = ids.shape[1]
    flat = ids.reshape(-1)  # (tokens*k,)
    order = torch.argsort(flat, stable=True)  # (tokens*k,)
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # the one host sync per layer
    return DispatchPlan(order=order, token=order // k, counts=counts)
