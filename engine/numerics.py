"""The dispatch points: every numeric operation of the model goes through here.

The recipe decides, this module executes (emulated, bit-exact through
`engine.formats`). Low-precision activations travel between ops as
`QTensor` records (data + scales + spec): a fused norm->quant or act->quant
hands its FP8 output straight to the next GEMM without a round trip through
high precision -- the "unified dataflow".

Dispatch points: `rmsnorm` (+ `act_quant`), `linear`, `attention`, `router`,
`moe`, `round` (residual / embedding / any storage site). Each emits named
taps through `self.tap(name, tensor)` when a tap callback is installed.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from engine.config import MoeConfig
from engine.formats import QTensor, parse_spec, quantize
from engine.formats.accumulate import matmul_accum
from engine.recipe import HIGH_PRECISION, Recipe
from engine.rope import apply_rope
from engine.routing import dispatch_plan, route

if TYPE_CHECKING:  # pragma: no cover
    from engine.parallel import ParallelContext

TapFn = Callable[[str, torch.Tensor], None]
QuantObserver = Callable[[str, str, QTensor], None]
# (module path, site, statistic, numerator, denominator): op-local conformance sums, see `Numerics.local`
LocalProbe = Callable[[str, str, str, torch.Tensor, torch.Tensor], None]

_FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _is_hp(spec: str) -> bool:
    """True for a plain high-precision float spec (a cast, no scales)."""
    return spec in HIGH_PRECISION


class Numerics:
    """Executes the model's numeric ops under a `Recipe`.

    `tap` (optional) receives (canonical tap name, fp32 tensor) for every tap;
    `observer` (optional) receives (module path, site, QTensor) for every
    quantization, so evals can collect format statistics without the model
    knowing about them.

    `local` (optional) is the op-local conformance probe: each op measures
    the error it adds *by itself*, against the same op in float64 on the
    very same inputs, so the measurement does not depend on the error
    accumulated upstream (which, from FP8 activations, drowns a BF16 softmax
    or a 14-bit accumulator end to end). It receives (module, site, stat,
    numerator, denominator) 0-d float64 sums; the statistic is
    sqrt(sum num / sum den) for ``rel_l2`` and sum num / sum den for
    ``headroom_bits``. Sites:

    * ``linear.accum`` / ``rel_l2``: the GEMM's accumulated output (before the
      output rounding) vs float64 accumulation of the same format values;
      isolates the accumulator model (`accumulate`).
    * ``attn.softmax`` / ``rel_l2``: attention probabilities vs a float64
      QK^T + softmax of the same cached Q/K; isolates the `attn.softmax`
      precision.
    * ``router`` / ``rel_l2``: MoE router logits vs float64 logits of the same
      (high-precision) input and prepared weight: the router's own precision.
    * ``kv.k`` / ``kv.v`` / ``headroom_bits``: per KV head, log2(format max /
      largest encoded |element| of that head), averaged over heads: the
      range a head's scale wastes. 0 with per-head dynamic scales; a shared
      (per-tensor) scale leaves every head but the largest with headroom,
      pushing its small values toward the format's subnormals.
    """

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.tap: Optional[TapFn] = None
        self.observer: Optional[QuantObserver] = None
        self.local: Optional[LocalProbe] = None
        # engine.parallel.ParallelContext under tensor / expert parallelism (set by engine.api.Engine), else None
        self.parallel: Optional[ParallelContext] = None

    # ------------------------------------------------------------------ basics
    @property
    def tapping(self) -> bool:
        """True when a tap callback is installed: callers skip building tap-only tensors (a dequantized
        copy, a concatenation) otherwise, so a serving step launches no kernel for taps nobody reads."""
        return self.tap is not None

    def emit(self, name: str, x: torch.Tensor) -> None:
        """Send a tap to the installed callback (no-op without one)."""
        if self.tap is not None:
            self.tap(name, x if self.parallel is None else self.parallel.gather_tap(name, x))

    def quant(self, x: torch.Tensor, site: str, module: str, spec: str | None = None) -> QTensor:
        """Quantize `x` with the recipe's spec for (site, module); the format's counts (`QTensor.stats`) are
        gathered for the observer only (nobody else reads them)."""
        spec = spec or self.recipe.spec(site, module)
        static = self.recipe.static_scale(site, module) if self.recipe.scales else None
        q = quantize(x, spec, scale=static, counts=self.observer is not None)
        if self.observer is not None:
            self.observer(module, site, q)
        return q

    def round(self, x: torch.Tensor, site: str, module: str) -> torch.Tensor:
        """Store `x` in the site's format and read it back as fp32 (fake quantization)."""
        spec = self.recipe.spec(site, module)
        if spec == "fp32":
            return x.float()
        if _is_hp(spec) and self.observer is None:
            return x.to(_FLOAT_DTYPES[spec]).float()
        return self.quant(x, site, module, spec).dequantize()

    def prepare_weight(self, w: torch.Tensor, site: str, module: str) -> torch.Tensor:
        """Weight lifecycle, step 'process after loading': quantize once, keep the dequantized values."""
        return self.round(w.float(), site, module)

    # ------------------------------------------------------------- dispatchers
    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, module: str) -> torch.Tensor:
        """RMSNorm in the `norm` compute precision (fp32 by default): w * x / sqrt(mean(x^2) + eps)."""
        dtype = _FLOAT_DTYPES[self.recipe.spec("norm", module)]
        h = x.to(dtype)
        var = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(var + eps)
        return (weight.to(dtype) * h).float()

    def rmsnorm_quant(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                      module: str) -> tuple[torch.Tensor, Optional[QTensor]]:
        """An RMSNorm whose output feeds GEMMs: (normed values, fused) where `fused` is the quantization of exactly
        those values that a backend computed in the same pass (None here: the consumer's `act_quant` quantizes)."""
        return self.rmsnorm(x, weight, eps, module), None

    def residual_norm(self, x: torch.Tensor, o: torch.Tensor, weight: torch.Tensor, eps: float, resid: str,
                      norm: str) -> tuple[torch.Tensor, torch.Tensor, Optional[QTensor]]:
        """The residual add and the RMSNorm after it: x' = residual-rounded (x + o), emitted as tap `resid`,
        and rmsnorm(x') in module `norm`. Returns (x', normed, fused) as `rmsnorm_quant`. One dispatch point so a
        backend can fuse the add, the residual rounding, the norm and the quantization that follows into one pass."""
        x = self.round(x + o, "residual", resid)
        self.emit(resid, x)
        return (x, *self.rmsnorm_quant(x, weight, eps, norm))

    def linears(self, x: torch.Tensor | QTensor, ws: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None],
                modules: Sequence[str]) -> list[torch.Tensor]:
        """Several linears on the same input (q/k/v, gate/up): `linear` each; a backend may run them as one
        GEMM on the weights stacked along N (same values; only the accumulation order can differ)."""
        return [self.linear(x, w, b, m) for w, b, m in zip(ws, biases, modules)]

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half RoPE of q (batch, heads, t, d) and k (batch, kv_heads, t, d) (fp32 math)."""
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def embed(self, tokens: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Token-embedding lookup (batch, t) -> (batch, t, d) fp32 on the prepared table (the `embed` format's
        values); a backend may store the table in that format and dequantize only the rows it looks up."""
        return F.embedding(tokens, w)

    def lm_head(self, h: torch.Tensor, w: torch.Tensor, fused: Optional[QTensor] = None) -> torch.Tensor:
        """Logits (..., vocab) fp32 of the final-norm output h: the head's input format (a float type, or the
        linear input quantization, taking the final norm's `fused` one as `act_quant` does), then an fp32 GEMM
        on the prepared head weight."""
        spec = self.recipe.spec("lm_head", "lm_head")
        if spec in _FLOAT_DTYPES:
            h = self.round(h, "lm_head", "lm_head")  # high-precision head: input in the same float type
        else:
            h = self.act_quant(h, "lm_head", fused=fused).dequantize()
        return F.linear(h, w)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, module: str) -> tuple[torch.Tensor, Optional[QTensor]]:
        """silu(gate) * up in fp32, and `fused` as `rmsnorm_quant` (None here; `act_quant` follows)."""
        return F.silu(gate) * up, None

    def act_quant(self, x: torch.Tensor, module: str, site: str = "linear.input",
                  fused: Optional[QTensor] = None) -> QTensor:
        """The '-> quant' half of norm+quant and SwiGLU+quant: one QTensor feeds every consumer GEMM. `fused`:
        the quantization of exactly x that x's producer returned (`rmsnorm_quant`, `residual_norm`, `swiglu`,
        `paged_attention`); a backend returns it when it is this site's format. The emulation makes none."""
        return self.quant(x, site, module)

    def linear(self, x: torch.Tensor | QTensor, w: torch.Tensor, bias: torch.Tensor | None, module: str,
               input_site: str = "linear.input") -> torch.Tensor:
        """y = x @ w.T (+ bias) with the recipe's input format, accumulator model and output rounding.

        `w` is a prepared weight (already in its storage format). `x` may be a QTensor
        from a fused quant upstream, in which case it is not quantized again.
        """
        xq = x if isinstance(x, QTensor) else self.quant(x, input_site, module)
        return self._gemm(xq.dequantize(), w, bias, module)

    def _gemm(self, xd: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, module: str) -> torch.Tensor:
        """The GEMM half of `linear`: `xd` already holds the input's format values (fp32)."""
        lead = xd.shape[:-1]
        a = xd.reshape(-1, xd.shape[-1])  # (tokens, K)
        acc = self.recipe.accumulate
        y = F.linear(a, w) if acc == "fp32" else matmul_accum(a, w, acc)  # (tokens, N)
        if self.local is not None:
            self._local_rel(module, "linear.accum", y, F.linear(a.double(), w.double()))
        return self.gemm_output(y, bias, module, lead)

    def gemm_output(self, y: torch.Tensor, bias: torch.Tensor | None, module: str, lead: Sequence[int]) -> torch.Tensor:
        """A GEMM's accumulated fp32 output y (tokens, N) -> (*lead, N) as `linear` returns it: under tensor
        parallelism a row-parallel GEMM's partial sums are all-reduced first (`ParallelContext.reduce_partial`),
        then the bias is added and the `linear.output` rounding applied, to the reduced sum. Shared by every
        backend whose GEMM can return the unrounded fp32 sum without the bias."""
        if self.parallel is not None:  # row-parallel GEMM: sum the ranks' fp32 partials, then bias and rounding
            y = self.parallel.reduce_partial(y, module)
        if bias is not None:
            y = y + bias.float()
        y = y.reshape(*lead, y.shape[-1])  # (..., N)
        return self.round(y, "linear.output", module)

    def kv_store(self, x: torch.Tensor, site: str, module: str) -> torch.Tensor:
        """Write K or V (batch, kv_heads, tokens, head_dim) to the cache format and read it back.

        `<fmt>:head` uses one scale per KV head (over the tokens written in this call).
        """
        spec = self.recipe.spec(site, module)
        if spec == "fp32":
            return x.float()
        b, h, t, d = x.shape
        if spec.endswith(":head"):
            rows = x.transpose(0, 1).reshape(h, b * t * d)  # (kv_heads, batch*tokens*head_dim)
            q = self.quant(rows, site, module, spec[: -len(":head")] + ":token")
            if self.local is not None:
                self._local_headroom(module, site, q, q.elements().abs().amax(dim=1))
            return q.dequantize().reshape(h, b, t, d).transpose(0, 1)
        if self.local is None or _is_hp(spec):
            return self.round(x, site, module)
        q = self.quant(x, site, module, spec)
        self._local_headroom(module, site, q, q.elements().abs().amax(dim=(0, 2, 3)))
        return q.dequantize()

    def _local_rel(self, module: str, site: str, actual: torch.Tensor, ideal: torch.Tensor) -> None:
        """Feed the local probe sum((actual - ideal)^2), sum(ideal^2) (float64; -inf/NaN-free inputs)."""
        ideal = ideal.double()
        self.local(module, site, "rel_l2", (actual.double() - ideal).pow(2).sum(), ideal.pow(2).sum())

    def _local_headroom(self, module: str, site: str, q: QTensor, head_max: torch.Tensor) -> None:
        """Feed the local probe the summed log2(format max / head max |element|) over heads with any
        non-zero element, and their count. head_max: (kv_heads,) largest decoded |element| per head."""
        fmt = q.spec.element_format
        if fmt is None:  # passthrough: no scale, nothing wasted
            return
        live = head_max > 0
        bits = torch.log2(fmt.max_normal / head_max[live].double()).clamp_min(0.0)
        self.local(module, site, "headroom_bits", bits.sum(), live.sum().double())

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                  k_pos: torch.Tensor, module: str, sliding_window: int | None = None,
                  scale: float | None = None) -> torch.Tensor:
        """Causal GQA attention; QK^T and softmax in the `attn.softmax` precision.

        q: (batch, heads, tq, d), k: (batch, kv_heads, tk, d), v: (batch, kv_heads, tk, dv)
        already in their cache formats; q_pos (tq,) or per row (batch, tq), k_pos (tk,) absolute positions;
        `scale` defaults to 1/sqrt(d). Returns (batch, tq, heads*dv) fp32.
        """
        b, h, tq, d = q.shape
        dv = v.shape[-1]
        hkv = k.shape[1]
        q = self.round(q, "attn.q", module)
        if hkv != h:
            k = k.repeat_interleave(h // hkv, dim=1)  # (batch, heads, tk, d)
            v = v.repeat_interleave(h // hkv, dim=1)
        sm = self.recipe.spec("attn.softmax", module)
        scale = (1.0 / math.sqrt(d)) if scale is None else scale
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # (batch, heads, tq, tk)
        qp = q_pos[..., :, None]  # (tq, 1), or (batch, tq, 1) per row
        mask = k_pos > qp  # (tq, tk) or (batch, tq, tk), True = masked
        if sliding_window is not None:
            mask = mask | (k_pos <= qp - sliding_window)
        if mask.dim() == 3:
            mask = mask[:, None]  # (batch, 1, tq, tk): every head of a row
        scores = scores.masked_fill(mask, float("-inf"))
        if sm != "fp32":
            scores = scores.to(_FLOAT_DTYPES[sm]).float()
        probs = torch.softmax(scores, dim=-1)
        if sm != "fp32":
            probs = probs.to(_FLOAT_DTYPES[sm]).float()
        if self.local is not None:
            ideal = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale
            self._local_rel(module, "attn.softmax", probs, torch.softmax(ideal.masked_fill(mask, float("-inf")), -1))
        out = torch.matmul(probs, v)  # (batch, heads, tq, dv)
        return out.transpose(1, 2).reshape(b, tq, h * dv)  # (batch, tq, heads*dv)

    # ------------------------------------------------------------------- paged KV cache
    def pages_native(self, dtype: torch.dtype) -> bool:
        """Whether this backend attends on KV pages of `dtype` with kernels that read the pages in place (the
        emulation never does: it gathers each sequence's pages and runs `attention`)."""
        return False

    def paged_attention(self, view, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, module: str,
                        window: int | None) -> tuple[torch.Tensor, Optional[QTensor]]:
        """The paged runtime's attention: store this call's K/V (batch, kv_heads, t, d) in the pages of `view`
        (an `engine.runtime` view: its runtime's cache, the rows' sequence ids and start positions), then attend;
        (out (batch, t, heads*dv) fp32, fused): a backend whose kernel stores the output in the `attn.out` format
        and quantizes it for o_proj returns that quantization as `fused` (None here). The emulation writes through the formats library (a KV format the pages do not
        hold is stored as `kv_store`'s values in fp32 pages) and attends each sequence on its gathered pages."""
        self._paged_write(view, layer, k, v, module)
        t = q.shape[2]
        q_pos = view.positions(t)
        # one gather per sequence (the rows' positions read on the host once per forward)
        rows = [view.rt.kv.gather(layer, sid, st + t) for sid, st in zip(*view.host_rows())]
        outs = [self.attention(q[b:b + 1], kb, vb, q_pos[b], torch.arange(kb.shape[2], device=q.device), module,
                               window) for b, (kb, vb) in enumerate(rows)]
        return torch.cat(outs), None

    def _paged_write(self, view, layer: int, k: torch.Tensor, v: torch.Tensor, module: str) -> None:
        """This call's K/V into the pages of `view` through the formats library (a KV format the pages do not hold
        is stored as `kv_store`'s values in fp32 pages)."""
        if view.rt.store_emulated:
            k, v = self.kv_store(k, "kv.k", module), self.kv_store(v, "kv.v", module)
        view.rt.kv.write(layer, view.seq_ids, view.start, k, v)

    def paged_latent(self, view, layer: int, k_pe: torch.Tensor, c_kv: torch.Tensor,
                     module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA on the paged runtime: store this call's RoPE'd key k_pe (batch, 1, t, rope) and normed latent c_kv
        (batch, 1, t, kv_lora_rank) in the pages of `view` as `paged_attention` stores K and V (sites `kv.k` /
        `kv.v`), then return every row's cached key and latent at once, ((batch, 1, n, rope), (batch, 1, n,
        kv_lora_rank)) fp32 values with n = the longest row's start + t (read on the host once per forward); a
        row's positions past its own start + t are zeros (the caller's causal mask hides them, and a per-tensor
        quantization of the latent sees only cached values). Every backend: no kernel reads MLA pages; the keys and
        values are rebuilt for the whole batch by kv_b_proj."""
        self._paged_write(view, layer, k_pe, c_kv, module)
        t, kv = k_pe.shape[2], view.rt.kv
        n = max(view.host_rows()[1]) + t
        kb, vb = kv.gather_rows(layer, view.seq_ids, -(-n // kv.block_size))
        kb, vb = kb[:, :, :n], vb[:, :, :n]  # (batch, 1, n, rope), (batch, 1, n, kv_lora_rank)
        live = (torch.arange(n, device=kb.device) < (view.start + t)[:, None])[:, None, :, None]  # (batch, 1, n, 1)
        return kb.where(live, 0.0), vb.where(live, 0.0)

    def paged_attention_rows(self, view, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, module: str,
                             window: int | None) -> tuple[torch.Tensor, Optional[QTensor]]:
        """`paged_attention` on float pages without a host read: every row attends over its sequence's pages up to
        the cache's capacity at once (`PagedKVCache.gather_rows`), the positions past its query masked by
        causality, so a CUDA graph can hold the step. The same formats as `paged_attention`; the softmax and P.V
        run over the capacity's keys (the masked ones contribute exact zeros), so the last bits can differ from
        the gathered-per-row path. The native backend's attention on fp32 pages, which its kernels do not read."""
        rt, t = view.rt, q.shape[2]
        self._paged_write(view, layer, k, v, module)
        kb, vb = rt.kv.gather_rows(layer, view.seq_ids, rt.kv.max_blocks_per_seq)
        k_pos = torch.arange(kb.shape[2], device=q.device)
        return Numerics.attention(self, q, kb, vb, view.positions(t), k_pos, module, window), None

    def paged_graphs(self, dtype: torch.dtype) -> bool:
        """Whether this backend's `paged_attention` on pages of `dtype` reads nothing on the host, so that the
        runtime can capture a decode step in a CUDA graph. The emulation gathers each row's pages by its length,
        read on the host: no."""
        return False

    def use_query_carrier(self) -> None:
        """Called by the paged runtime when this backend attends on its pages (`pages_native`): a backend whose
        kernels read the query in a narrower dtype may prepare it in `rope`. The emulation has nothing to do."""

    # ------------------------------------------------------------------- MoE
    def router(self, x: torch.Tensor, w: torch.Tensor, module: str) -> torch.Tensor:
        """Router (gate) logits x @ w.T in the `router` compute precision (fp32 by default); returned fp32.

        `x` is the high-precision normed hidden state, never the FP8 expert input.
        """
        spec = self.recipe.spec("router", module)
        if spec in _FLOAT_DTYPES:
            dtype = _FLOAT_DTYPES[spec]
            logits = F.linear(x.to(dtype), w.to(dtype)).float()
        else:
            # a quantized router (a planted bug, or an experiment): the input in that format, the prepared
            # weight already holds its values; fp32 accumulation
            logits = F.linear(self.quant(x, "router", module).dequantize(), w.float())
        if self.local is not None:  # the router's own precision: its input / weight formats and its GEMM
            self._local_rel(module, "router", logits, F.linear(x.double(), w.double()))
        return logits

    def moe(self, x: torch.Tensor, xq: QTensor, router_w: torch.Tensor, correction_bias: torch.Tensor | None,
            experts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None], cfg: MoeConfig, module: str,
            tap: str) -> torch.Tensor:
        """Routed experts of one MoE layer: (tokens, d) -> (tokens, d) fp32, the weighted sum over each token's top-k.

        x: (tokens, d) high-precision normed hidden (router input); xq: the same tokens
        quantized once at site `moe.input` (the experts' input, quantized before
        dispatch); experts[e] = prepared (gate, up, down) weights (site `moe.weight`),
        None for an expert held by another rank (expert parallelism).
        Emits `{tap}moe.router_logits` (tokens, experts) fp32 and `{tap}moe.topk`
        (tokens, k) int64. Token copies are sorted by expert, each expert's
        contiguous segment runs SwiGLU (`run_experts`), outputs are scaled by the
        routing weights in fp32 and summed back per token with index_add. Under
        expert parallelism the copies travel to the experts' ranks and back
        (`engine.parallel.ParallelContext.moe`).
        """
        n, d = x.shape
        weights, ids = self.route_tokens(x, router_w, correction_bias, cfg, module, tap)  # (tokens, k) each
        if self.parallel is not None and self.parallel.ep > 1:
            return self.parallel.moe(self, xq, weights, ids, experts, module)
        plan = dispatch_plan(ids, cfg.num_experts)
        xs = xq.dequantize().reshape(n, d).index_select(0, plan.token)  # (tokens*k, d), expert-contiguous
        # the emulation's combine (index_add), also where a backend's moe falls back here
        return Numerics.combine_dispatched(self, self.run_experts(xs, plan.counts, experts, module), weights, ids, plan)

    def run_dispatched(self, xq: QTensor, data: torch.Tensor, scales: torch.Tensor | None, counts: Sequence[int],
                       experts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None],
                       module: str) -> torch.Tensor:
        """Expert parallelism, receiving rank: this rank's experts on the token rows dispatched to it
        (`engine.parallel.ParallelContext.moe`) -> (rows, d) fp32 before the routing weights. data (rows, d): the
        rows' element codes as `xq` (the sender's `moe.input` QTensor) stores them, scales (rows, groups) fp32 or
        None (see `ParallelContext._wire_rows`), expert-contiguous: counts[e] rows for expert e (0 for experts
        held elsewhere). The emulation decodes them (the products of `QTensor.dequantize`) for `run_experts`."""
        from engine.parallel import ParallelContext

        return self.run_experts(ParallelContext._wire_values(xq, data, scales), counts, experts, module)

    def combine_dispatched(self, y: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                           plan) -> torch.Tensor:
        """Expert parallelism, dispatching rank: its tokens' expert outputs y (copies, d) fp32, back in the order of
        `plan` (`engine.routing.dispatch_plan` of `ids`), weighted by `weights` (tokens, k) and summed per token
        in that order -> (tokens, d) fp32, as `moe` combines."""
        yw = y * weights.reshape(-1)[plan.order, None]  # (copies, d)
        return torch.zeros(ids.shape[0], y.shape[1], device=y.device).index_add_(0, plan.token, yw)

    def slice_prepared(self, w: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
        """Tensor parallelism: this rank's slice of a prepared weight (`prepare_weight`'s result, quantized whole)
        along `dim` (`engine.parallel.ParallelContext.shard_weight`). The emulation holds values: a narrow."""
        return w.narrow(dim, start, length).contiguous()

    def route_tokens(self, x: torch.Tensor, router_w: torch.Tensor, correction_bias: torch.Tensor | None,
                     cfg: MoeConfig, module: str, tap: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits (`router` precision) -> (top-k weights, top-k expert ids), each (tokens, k);
        emits `{tap}moe.router_logits` and `{tap}moe.topk`. Shared by every MoE execution path."""
        logits = self.router(x, router_w, module + ".gate")  # (tokens, experts)
        self.emit(tap + "moe.router_logits", logits)
        weights, ids = route(logits, cfg, correction_bias)
        self.emit(tap + "moe.topk", ids)
        return weights, ids

    def run_experts(self, xs: torch.Tensor, counts: Sequence[int],
                    experts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None],
                    module: str) -> torch.Tensor:
        """SwiGLU of expert-contiguous token copies xs (rows, d) -> (rows, d) fp32, before the routing weights.

        counts[e] rows (in order of e) belong to expert e; gate/up run through
        `_gemm` on each segment, the down_proj input is quantized at `moe.input`
        (one quantization of all segments when the format is row-local, else
        one per expert), down_proj through `_gemm`.
        """
        segments = []  # (expert, start, count) of every non-empty expert
        start = 0
        for e, count in enumerate(counts):
            if count:
                segments.append((e, start, count))
                start += count
        if not segments:
            return xs.new_zeros(0, xs.shape[1])
        acts = []
        for e, s0, count in segments:
            path = f"{module}.experts.{e}"
            g = self._gemm(xs[s0:s0 + count], experts[e][0], None, path + ".gate_proj")  # (count, inter)
            u = self._gemm(xs[s0:s0 + count], experts[e][1], None, path + ".up_proj")
            acts.append(F.silu(g) * u)
        outs = []
        row_spec = self._rowwise_spec("moe.input", [f"{module}.experts.{e}.down_proj" for e, _, _ in segments])
        if row_spec is not None:  # row-local format: one quantization of all segments gives the same bits
            a_all = self.quant(torch.cat(acts), "moe.input", module + ".experts.down_proj", row_spec).dequantize()
            for e, s0, count in segments:
                outs.append(self._gemm(a_all[s0:s0 + count], experts[e][2], None,
                                       f"{module}.experts.{e}.down_proj"))  # (count, d)
        else:  # per-tensor / 2-D tile / NVFP4 scales: each expert's activation gets its own scale
            for (e, _, _), act in zip(segments, acts):
                path = f"{module}.experts.{e}.down_proj"
                outs.append(self.linear(self.act_quant(act, path, site="moe.input"), experts[e][2], None, path))
        return torch.cat(outs)  # (rows, d)

    def _rowwise_spec(self, site: str, modules: Sequence[str]) -> str | None:
        """The common spec of `site` over `modules` when it quantizes every row independently, else None.

        Row-local = passthrough, per-token/channel, 1xN blocks or MX blocks, with no static scale:
        quantizing the rows together or apart then gives identical bits.
        """
        specs = {self.recipe.spec(site, m) for m in modules}
        if len(specs) != 1 or self.recipe.scales.get(site):
            return None
        spec = specs.pop()
        parsed = parse_spec(spec)
        row_local = parsed.granularity in ("none", "channel", "token", "mx") or (
            parsed.granularity == "tile" and parsed.tile is not None and parsed.tile[0] == 1)
        return spec if row_local else None
