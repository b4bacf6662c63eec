"""The `cuda-native` backend: the same recipe, executed by real FP8 kernels on the GPU.

`NativeNumerics` subclasses the emulating `Numerics` and overrides the hot
dispatch points with kernels from `engine.kernels` whenever the recipe's
format at that site has a native kernel on this GPU:

* ``act_quant`` / ``quant`` for ``e4m3:1x128`` and ``mxfp8`` -> the Triton
  quant kernel (bit-exact with `engine.formats.quantize`: same scales, same
  FP8 bits);
* ``rmsnorm`` / ``swiglu`` (fp32 norm compute) -> the fused Triton
  RMSNorm+quant / SwiGLU+quant kernels: one launch computes the fp32 values
  *and* their 1x128 E4M3 (or MXFP8) quantization, returned together; the
  model hands that QTensor to the ``act_quant`` of those very values, which
  takes it instead of quantizing again (the kernels quantize their own fp32
  output bit-exactly, so this changes no bit). The norm's sum of squares and SwiGLU's silu (approximate division,
  <= 2 ulp) differ from torch's in the last bits: kernel error, measured by
  the three-way eval like the GEMMs' accumulation order;
* ``linear``: FP8 block (``e4m3:1x128`` x ``e4m3:128x128``) -> cuBLAS
  blockwise `scaled_mm` for large M, the Triton small-M kernel for decode;
  per-tensor FP8 -> `_scaled_mm`; MXFP8 / MXFP4 / NVFP4 weights -> Triton
  dequant-in-kernel GEMMs; bf16 -> cuBLAS bf16 (fp32 accumulate);
* ``attention`` -> the Triton flash-attention kernel (QK^T and softmax in
  FP32, P in bf16 for the PV product);
* ``moe`` -> tokens sorted by expert on the device, grouped FP8 GEMMs.

Anything else (an accumulator model such as ``tc14``, static scales, a
format without a kernel, an installed quant observer) runs through the
inherited emulation, and `NativeNumerics.coverage` counts, per op, how many
calls ran native and how many fell back and why, so a `cuda-native` result
says exactly what was native. Quantization is bit-exact with the emulation;
only GEMM / attention accumulation order (and attention's bf16 P) differ:
that is the "kernel" part of the three-way comparison (FP32 vs emulation
vs native).

Weights: `prepare_weight` keeps the quantized weight as a `NativeWeight`
(kernel-ready data + scales, no fp32 copy) for the linear / MoE sites.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from types import MappingProxyType
from typing import Mapping, Optional, Sequence

import torch
import torch.nn.functional as F

from engine.backends.native_parallel import NativeParallel
from engine.backends.native_weight import NativeWeight, dense_experts, dense_values
from engine.config import MoeConfig
from engine.formats import QTensor, grouping, parse_spec, quantize
from engine.numerics import _FLOAT_DTYPES, Numerics
from engine.recipe import Recipe



@dataclasses.dataclass(frozen=True)
class NativeFormats:
    """Which formats have a native kernel: every format check of `NativeNumerics` reads this one table
    (tests/engine/test_native_formats.py checks it against the kernels' own lists)."""

    quant: tuple[str, ...]  # activation formats the quant kernels write, also fused into RMSNorm / SwiGLU
    gemm: Mapping[str, tuple[str, ...]]  # weight format -> the activation formats its GEMM reads
    float_input_gemm: tuple[str, ...]  # weight formats whose GEMM reads a float activation (W4A16, float weights)
    float_weights: tuple[str, ...]  # weight formats kept in their own dtype for cuBLAS
    half: tuple[str, ...]  # 16-bit formats carried in their dtype (attention query, lm_head, contiguous K/V)
    paged_pages: tuple[torch.dtype, ...]  # KV page dtypes the paged kernels read in place
    paged_out_quant: str  # the paged attention output's quantization for o_proj (from bf16-rounded values)
    moe: tuple[str, str]  # (expert weight, expert input) formats of the grouped MoE GEMMs


NATIVE_FORMATS = NativeFormats(
    quant=("e4m3:1x128", "mxfp8"),
    gemm=MappingProxyType({
        "e4m3:128x128": ("e4m3:1x128",),
        "e4m3:tensor": ("e4m3:tensor",),
        "mxfp8": ("mxfp8",),
        "mxfp4": ("bf16", "fp32", "fp16"),
        "nvfp4": ("bf16", "fp32", "fp16"),
        "bf16": ("bf16",),
        "fp32": ("fp32",),
    }),
    float_input_gemm=("mxfp4", "nvfp4", "bf16", "fp32", "fp16"),
    float_weights=("fp32", "bf16", "fp16"),
    half=("bf16", "fp16"),
    paged_pages=(torch.float8_e4m3fn, torch.bfloat16, torch.float16),
    paged_out_quant="e4m3:1x128",
    moe=("e4m3:128x128", "e4m3:1x128"),
)


def _row_local(spec: str) -> bool:
    """A format whose scales belong to single rows (1xN groups, MX / NVFP4 blocks) or to the whole tensor: a
    gathered row set dequantizes on its own to the same values as in the whole table."""
    q = parse_spec(spec)
    return not q.is_passthrough and (q.granularity == "tensor" or grouping.group_shape(q, 2, 128)[0] == 1)


def prepare_embedding(w: torch.Tensor, spec: str) -> NativeWeight | None:
    """The token-embedding table stored in its `embed` format: a float format in that dtype, a row-local
    quantized format as its QTensor (FP8 data + scales); None for anything else (the caller keeps the
    emulation's fp32 values)."""
    if spec in _FLOAT_DTYPES:
        return NativeWeight(spec, w.shape, kernel=w.to(_FLOAT_DTYPES[spec]).contiguous())
    if _row_local(spec) and w.dim() == 2:
        return NativeWeight(spec, w.shape, q=quantize(w.float(), spec))
    return None


def embedding_lookup(tokens: torch.Tensor, w: NativeWeight) -> torch.Tensor:
    """Rows `tokens` (any shape) of a `prepare_embedding` table as fp32 (..., d): a float table's rows widened,
    a quantized table's gathered codes and scales dequantized -- the same values as the fp32 rows of the
    whole table's dequantization (one elementwise product per element either way)."""
    if w.q is None:
        return F.embedding(tokens, w.kernel).float()
    q = w.q
    v, d = q.shape
    rows = tokens.reshape(-1)
    scale = q.scale
    if scale is not None and q.spec.granularity != "tensor":
        scale = scale.reshape(v, -1)[rows]
    sub = QTensor(data=q.data.reshape(v, d)[rows], scale=scale, spec=q.spec, shape=torch.Size((rows.numel(), d)),
                  orig_dtype=q.orig_dtype, tensor_scale=q.tensor_scale)
    return sub.dequantize().reshape(*tokens.shape, d)


def _block_qtensor(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, spec: str = "e4m3:1x128") -> QTensor:
    """The `spec` QTensor of x (..., K) from a Triton quant kernel's FP8 data and (rows, K/128) -- "mxfp8":
    (rows, K/32) -- scales."""
    return QTensor(data=data.reshape(x.shape), scale=scale.reshape(*x.shape[:-1], -1),
                   spec=parse_spec(spec), shape=x.shape, orig_dtype=x.dtype)


def _consecutive(ts: Sequence[torch.Tensor]) -> bool:
    """The 2-d row-major tensors `ts` lie back to back in one storage (a stack of them is a view)."""
    t0 = ts[0]
    if not all(t.is_contiguous() and t.dim() == 2 and t.shape[1] == t0.shape[1] for t in ts):
        return False
    ptr = t0.untyped_storage().data_ptr()
    off = t0.storage_offset()
    for t in ts:
        if t.untyped_storage().data_ptr() != ptr or t.storage_offset() != off:
            return False
        off += t.numel()
    return True


class NativeNumerics(NativeParallel, Numerics):
    """`Numerics` with real GPU kernels at the dispatch points that have one (module docstring).

    `small_m`: token count at or below which linear layers use the decode
    (small-M) FP8 kernels instead of cuBLAS (64: the measured crossover, docs/design/performance.md, Decode GEMMs;
    bench_e2e.py --small-m compares). `attn_block`: the attention
    kernel's key/query tile (64, 128 or 256; a serving-config knob). `decode_policy`: which GEMM kernel and
    configuration each call gets (`engine.kernels.decode_plan.DecodePolicy`; default `DEFAULT_POLICY`, the shipped
    per-device configs and rules), handed to every GEMM call; an A/B measurement passes another one. `options`:
    the kernel variants (`engine.kernels.options.KernelOptions`: PDL, fast division, the MX decode paths; default
    `DEFAULT_OPTIONS`), handed to every kernel call. `kernel_settings` reports both for a result's provenance.
    """

    def __init__(self, recipe: Recipe, small_m: int = 64, attn_block: int = 64, decode_policy=None, options=None):
        super().__init__(recipe)
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'cuda-native' needs a CUDA GPU; none is visible (use cpu-emulated)")
        from engine.kernels import attention as attn_k  # noqa: F401  (fail early when Triton is missing)
        from engine.kernels import gemm, gemm_mx, quant
        from engine.kernels.decode_plan import DEFAULT_POLICY
        from engine.kernels.options import DEFAULT_OPTIONS

        self.decode_policy = decode_policy if decode_policy is not None else DEFAULT_POLICY
        self.options = options if options is not None else DEFAULT_OPTIONS
        self._quant_k, self._gemm_k, self._mx_k, self._attn_k = quant, gemm, gemm_mx, attn_k
        self.small_m = small_m
        self.attn_block = attn_block
        self.coverage: collections.Counter[str] = collections.Counter()
        self._moe_stacks: dict[str, tuple] = {}
        self._stacks: dict[tuple, tuple] = {}  # merged q/k/v, gate/up weights (see `linears`)
        self._mm_dtype_broken: Optional[str] = None  # why torch.mm(out_dtype=) failed, if it did (lm_head)
        # (fp32 q after RoPE, its bf16 rounding) from the last `rope`, taken by the next `query_carrier`; set only
        # when every attention reads a bf16 query (the paged runtime's kernels)
        self._q_bf16: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._q_carrier_bf16 = False

    def kernel_settings(self) -> dict:
        """What chose this backend's kernels, JSON-ready: the kernel variants and the decode policy's summary."""
        return {"options": self.options.summary(), "decode_policy": self.decode_policy.summary(),
                "small_m": self.small_m, "attn_block": self.attn_block}

    def _count(self, op: str, how: str) -> None:
        """Record one call of `op` that ran `how` (native, or fallback:<reason>)."""
        self.coverage[f"{op}:{how}"] += 1

    def coverage_summary(self) -> dict[str, float]:
        """Fraction of calls that ran native, per op, plus raw counts (for result provenance)."""
        out: dict[str, float] = {}
        ops = {k.split(":", 1)[0] for k in self.coverage}
        for op in sorted(ops):
            total = sum(v for k, v in self.coverage.items() if k.split(":", 1)[0] == op)
            out[f"{op}.native_frac"] = self.coverage.get(f"{op}:native", 0) / total
        out.update({k: float(v) for k, v in sorted(self.coverage.items())})
        return out

    # ------------------------------------------------------- fused producers
    def _fusable(self, x: torch.Tensor) -> bool:
        """A fused producer kernel may run: the recipe's activations are E4M3 1x128 or MXFP8 (else there is no
        quantization to fuse, and the kernel's last-ulp differences would be pure cost: under bf16 they
        flip zoo-moe's expert choices), CUDA fp32/bf16 input, 128-multiple rows, nobody observing quants."""
        return (self.recipe.spec("linear.input") in NATIVE_FORMATS.quant and x.is_cuda and self.observer is None
                and x.dim() >= 1 and x.shape[-1] % 128 == 0 and x.numel() > 0
                and x.dtype in (torch.float32, torch.bfloat16))

    def _fused_quant_spec(self) -> str:
        """The format the fused producers (RMSNorm, SwiGLU, residual + RMSNorm) quantize to: the recipe's default
        GEMM input format (a module whose input format differs re-quantizes in `quant`)."""
        return self.recipe.spec("linear.input")

    def query_carrier(self, q: torch.Tensor, module: str) -> torch.Tensor:
        """The attention query in its `attn.q` format for a kernel: bf16 / fp16 formats as that dtype (the
        same values as `round`, half the bytes), anything else as `round`'s fp32 values."""
        spec = self.recipe.spec("attn.q", module)
        carried, self._q_bf16 = self._q_bf16, None
        if spec in NATIVE_FORMATS.half and self.observer is None:
            if spec == "bf16" and carried is not None and q is carried[0]:
                self._count("query_carrier", "native")
                return carried[1]  # written by the RoPE launch (`rope`): no cast kernel
            self._count("query_carrier", "fallback:cast")
            return q.to(_FLOAT_DTYPES[spec])
        return self.round(q, "attn.q", module)

    def pages_native(self, dtype: torch.dtype) -> bool:
        """The paged kernels read FP8, bf16 and fp16 pages (`NATIVE_FORMATS.paged_pages`); fp32 pages (the fp32 recipe's
        cache, and formats stored as emulated values) attend through the emulation: the kernels' P.V products are
        half precision, which an fp32 cache must not get."""
        return dtype in NATIVE_FORMATS.paged_pages

    def paged_graphs(self, dtype: torch.dtype) -> bool:
        """Every paged attention of this backend reads nothing on the host: the kernels on their pages,
        `paged_attention_rows` on fp32 pages."""
        return True

    def paged_attention(self, view, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, module: str,
                        window: int | None) -> tuple[torch.Tensor, Optional[QTensor]]:
        """On pages the kernels read (`pages_native`): the fused quantize + scatter write (`kv_write`, bit-exact
        with the library write) and the paged decode attention over the block table. bf16 queries travel as bf16
        (`query_carrier`); an attention output stored in bf16 and quantized E4M3 1x128 for o_proj comes out of
        the kernel already rounded and quantized, returned as `fused` for o_proj (`fused_attn_out`). Calls
        longer than the serving config's `fp8_paged_max_tq` on FP8 pages take the emulation's path; fp32 pages
        attend through `paged_attention_rows` (no host read: CUDA graphs hold those steps too)."""
        from engine.kernels.paged_kv import kv_write, paged_decode_attention

        rt, t = view.rt, q.shape[2]
        if not rt.native_attention:  # fp32 pages: every row over the pages at once, no host read
            self._count("attention", "fallback:fp32-pages")
            return self.paged_attention_rows(view, layer, q, k, v, module, window)
        cap = rt.config.fp8_paged_max_tq
        if cap is not None and rt.kv.fp8 and t > cap:
            return super().paged_attention(view, layer, q, k, v, module, window)
        rt.kv.write(layer, view.seq_ids, view.start, k, v, kernel=functools.partial(kv_write, options=self.options))
        q_in = self.query_carrier(q, module)
        fused = self.fused_attn_out(module + ".o_proj")
        ids32, lens32, qpos32 = view.kernel_rows(t)
        out = paged_decode_attention(q_in, rt.kv, layer, seq_lens=lens32, seq_ids=ids32, q_pos=qpos32,
                                     sliding_window=window, block_n=rt.attn_block,
                                     num_splits=rt.splits_for(q.shape[0]),
                                     out_quant=NATIVE_FORMATS.paged_out_quant if fused else None,
                                     out_round="bf16" if fused else None, return_hp=fused, options=self.options)
        if fused:
            data, scale, hp = out
            return hp, _block_qtensor(hp, data, scale, NATIVE_FORMATS.paged_out_quant)
        return out.float(), None

    def use_query_carrier(self) -> None:
        """Called by a caller whose attention reads the query through `query_carrier` (the paged runtime): from
        now on `rope` also writes q rounded to bf16 in its launch, which `query_carrier` hands out."""
        self._q_carrier_bf16 = True

    def fused_attn_out(self, o_proj: str) -> bool:
        """The paged attention may emit o_proj's input directly: the attention output is stored in bf16
        (`attn.out`) and o_proj quantizes its input E4M3 1x128 dynamically, nobody observing quants."""
        return (self.recipe.spec("attn.out", o_proj) == "bf16" and self.recipe.spec("linear.input", o_proj)
                == NATIVE_FORMATS.paged_out_quant and self.observer is None
                and not (self.recipe.scales and self.recipe.static_scale("linear.input", o_proj) is not None))

    def rmsnorm_quant(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                      module: str) -> tuple[torch.Tensor, Optional[QTensor]]:
        """fp32 RMSNorm through the fused RMSNorm+quant kernel: (normed values, their quantization to the recipe's
        GEMM input format), which the consumer's `act_quant` takes."""
        if self.recipe.spec("norm", module) != "fp32" or not self._fusable(x) or weight.shape != x.shape[-1:]:
            self._count("rmsnorm", "fallback")
            return super().rmsnorm(x, weight, eps, module), None
        spec = self._fused_quant_spec()
        data, scale, hp = self._quant_k.rmsnorm_quant(x.contiguous(), weight.float().contiguous(), eps,
                                                      return_hp=True, fmt=spec, options=self.options)
        self._count("rmsnorm", "native")
        hp = hp.reshape(x.shape)
        return hp, _block_qtensor(hp, data, scale, spec)

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, module: str) -> torch.Tensor:
        """The values of `rmsnorm_quant` (q/k norms, MLA's latent norm: nothing quantizes them for a GEMM)."""
        return self.rmsnorm_quant(x, weight, eps, module)[0]

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, module: str) -> tuple[torch.Tensor, Optional[QTensor]]:
        """silu(gate) * up through the fused SwiGLU+quant kernel: (values, their quantization) as `rmsnorm_quant`."""
        if not (self._fusable(gate) and up.shape == gate.shape and up.dtype == gate.dtype):
            self._count("swiglu", "fallback")
            return super().swiglu(gate, up, module)
        # gate / up are usually the two column halves of the stacked gate/up GEMM's output (`linears`): the kernel
        # reads them at their row stride, with no copy kernels before it
        spec = self._fused_quant_spec()
        data, scale, hp = self._quant_k.swiglu_quant(gate, up, return_hp=True, fmt=spec, options=self.options)
        self._count("swiglu", "native")
        hp = hp.reshape(gate.shape)
        return hp, _block_qtensor(hp, data, scale, spec)

    def residual_norm(self, x: torch.Tensor, o: torch.Tensor, weight: torch.Tensor, eps: float, resid: str,
                      norm: str) -> tuple[torch.Tensor, torch.Tensor, Optional[QTensor]]:
        """Residual add (+ its bf16 / fp32 rounding) and the fp32 RMSNorm -> quant of the result in one Triton
        pass (`add_rmsnorm_quant`); the residual is bit-exact with the emulation, the norm as `rmsnorm_quant`."""
        res_spec = self.recipe.spec("residual", resid)
        if (res_spec not in ("bf16", "fp32") or self.recipe.spec("norm", norm) != "fp32" or not self._fusable(x)
                or o.shape != x.shape or o.device != x.device or weight.shape != x.shape[-1:]
                or x.shape[-1] > self._quant_k.ROW_KERNEL_MAX_GROUPS * 128):
            self._count("residual_norm", "fallback")
            return super().residual_norm(x, o, weight, eps, resid, norm)
        spec = self._fused_quant_spec()
        r, data, scale, hp = self._quant_k.add_rmsnorm_quant(x.contiguous(), o.contiguous(), weight.float().contiguous(),
                                                             eps, round_bf16=res_spec == "bf16", fmt=spec,
                                                             options=self.options)
        r = r.reshape(x.shape)
        self.emit(resid, r)
        self._count("residual_norm", "native")
        hp = hp.reshape(x.shape)
        return r, hp, _block_qtensor(hp, data, scale, spec)

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half RoPE of q and k in one Triton launch (bit-identical to `apply_rope`) on fp32 CUDA input."""
        if not (q.is_cuda and q.dtype == k.dtype == cos.dtype == sin.dtype == torch.float32 and q.shape[-1] <= 256):
            self._count("rope", "fallback")
            return super().rope(q, k, cos, sin)
        from engine.kernels.rope import rope_qk

        self._count("rope", "native")
        if self._q_carrier_bf16 and self.observer is None:
            # a bf16 query carrier (`query_carrier`): the same launch writes q rounded to bf16 as well
            q_out, k_out, q16 = rope_qk(q, k, cos, sin, q_bf16=True, options=self.options)
            self._q_bf16 = (q_out, q16)
            return q_out, k_out
        return rope_qk(q, k, cos, sin, options=self.options)

    def embed(self, tokens: torch.Tensor, w: torch.Tensor | NativeWeight) -> torch.Tensor:
        """Lookup in a table stored in its `embed` format (`prepare_embedding`): only the looked-up rows are
        widened / dequantized (the emulation's values)."""
        if isinstance(w, NativeWeight):
            self._count("embed", "native")
            return embedding_lookup(tokens, w)
        self._count("embed", "fallback")
        return super().embed(tokens, w)

    def lm_head(self, h: torch.Tensor, w: torch.Tensor | NativeWeight, fused: Optional[QTensor] = None) -> torch.Tensor:
        """A bf16 / fp16 head (the recipe's `lm_head` format) as one cuBLAS GEMM on the weight stored in that
        dtype (half the bytes of its fp32 values), fp32 accumulation and fp32 logits; else the emulation."""
        spec = self.recipe.spec("lm_head", "lm_head")
        if (isinstance(w, NativeWeight) and w.q is None and h.is_cuda and self.observer is None
                and spec in NATIVE_FORMATS.half and w.kernel.dtype == _FLOAT_DTYPES[spec]
                and not self._mm_dtype_broken):
            k = h.shape[-1]
            try:
                y = torch.mm(h.reshape(-1, k).to(w.kernel.dtype), w.kernel.t(), out_dtype=torch.float32)
            except (RuntimeError, NotImplementedError, TypeError) as exc:  # no mm(out_dtype=) in this torch build
                self._mm_dtype_broken = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            else:
                self._count("lm_head", "native")
                return y.reshape(*h.shape[:-1], w.shape[0])
        self._count("lm_head", "fallback")
        return super().lm_head(h, dense_values(w), fused)

    # ----------------------------------------------------------------- quant
    def _quant_native(self, x: torch.Tensor, site: str, module: str, spec: str) -> bool:
        """The quant kernels write `spec` for this call: a kernel format, CUDA input, a dynamic scale, nobody
        observing quants."""
        return spec in NATIVE_FORMATS.quant and x.is_cuda and self.observer is None and not (
            self.recipe.scales and self.recipe.static_scale(site, module) is not None)

    def act_quant(self, x: torch.Tensor, module: str, site: str = "linear.input",
                  fused: Optional[QTensor] = None) -> QTensor:
        """The producer's own quantization `fused` of exactly x (a fused kernel's, bit-exact with the quant
        kernel) when it is this site's format and the quant kernel would run; else `quant`."""
        spec = self.recipe.spec(site, module)
        if fused is not None and fused.shape == x.shape and fused.spec == parse_spec(spec) \
                and self._quant_native(x, site, module, spec):
            self._count("quant", "native")
            return fused
        return self.quant(x, site, module)

    def quant(self, x: torch.Tensor, site: str, module: str, spec: str | None = None) -> QTensor:
        """`e4m3:1x128` and `mxfp8` through the Triton kernel (bit-exact); anything else emulated."""
        spec = spec or self.recipe.spec(site, module)
        if self._quant_native(x, site, module, spec):
            k = x.shape[-1]
            data, scale = self._quant_k.act_quant(x.float().reshape(-1, k).contiguous(), fmt=spec, options=self.options)
            self._count("quant", "native")
            return _block_qtensor(x, data, scale, spec)
        if spec in _FLOAT_DTYPES and self.observer is None and x.is_cuda and not (
                self.recipe.scales and self.recipe.static_scale(site, module) is not None):
            # a float "format" is a cast; without an observer nobody reads the library's overflow / underflow
            # counts (a dozen reductions per call), so the cast alone: the same data
            self._count("quant", "native")
            return QTensor(data=x.to(_FLOAT_DTYPES[spec]), scale=None, spec=parse_spec(spec), shape=x.shape,
                           orig_dtype=x.dtype)
        self._count("quant", "fallback:" + spec)
        return super().quant(x, site, module, spec)

    # ---------------------------------------------------------------- weights
    def prepare_weight(self, w: torch.Tensor, site: str, module: str) -> torch.Tensor | NativeWeight:
        """Linear / MoE weights -> `NativeWeight` (quantized once, kernel-ready); others as emulated."""
        if site == "lm_head" and w.is_cuda and self.recipe.spec(site, module) in ("bf16", "fp16") \
                and self.observer is None:  # kept in its dtype for the head GEMM (`lm_head`)
            spec = self.recipe.spec(site, module)
            return NativeWeight(spec, w.shape, kernel=w.to(_FLOAT_DTYPES[spec]).contiguous())
        if site == "embed" and self.observer is None and not (self.recipe.scales and
                                                              self.recipe.static_scale(site, module) is not None):
            nw = prepare_embedding(w, self.recipe.spec(site, module))
            if nw is not None:
                return nw
        if site not in ("linear.weight", "moe.weight"):
            return super().prepare_weight(w, site, module)
        spec = self.recipe.spec(site, module)
        if spec in NATIVE_FORMATS.float_weights:  # kept in its own dtype: cuBLAS reads half the bytes of fp32
            return NativeWeight(spec, w.shape, kernel=w.to(_FLOAT_DTYPES[spec]).contiguous())
        static = self.recipe.static_scale(site, module) if self.recipe.scales else None
        q = quantize(w.float(), spec) if static is None else quantize(w.float(), spec, scale=static)
        nw = NativeWeight(spec, w.shape, q=q)
        if spec in NATIVE_FORMATS.gemm:
            nw.kernel = self._mx_k.prepare_weight(q)
        return nw

    # ---------------------------------------------------------------- linear
    def _native_gemm(self, xq: QTensor | torch.Tensor, w: NativeWeight, bias: torch.Tensor | None,
                     module: str, partial: bool = False) -> torch.Tensor | None:
        """Run the native GEMM for (input, weight) formats, or None (with the reason counted). `partial`: a
        row-parallel GEMM's fp32 sum, without the bias and unrounded (`linear` finishes it)."""
        if self.recipe.accumulate != "fp32":
            self._count("linear", "fallback:accumulate=" + self.recipe.accumulate)
            return None
        out_spec = self.recipe.spec("linear.output", module)
        if out_spec not in _FLOAT_DTYPES:
            self._count("linear", "fallback:output=" + out_spec)
            return None
        out_dtype = torch.float32 if partial else _FLOAT_DTYPES[out_spec]
        x_spec = str(xq.spec) if isinstance(xq, QTensor) else "float"
        native = (x_spec in NATIVE_FORMATS.gemm.get(w.spec, ()) if isinstance(xq, QTensor)
                  else w.spec in NATIVE_FORMATS.float_input_gemm)
        if not native:
            self._count("linear", f"fallback:{x_spec}x{w.spec}")
            return None
        g = self._gemm_k
        if isinstance(xq, QTensor):
            k = xq.shape[-1]
            lead = xq.shape[:-1]
            if w.spec == "e4m3:128x128":
                # a bf16 output comes back as its fp32 values (the model's carrier) without a cast kernel
                rnd = "bf16" if out_dtype == torch.bfloat16 else None
                y = g.fp8_block_linear(xq.data.reshape(-1, k), xq.scale.reshape(-1, xq.scale.shape[-1]),
                                       w.q.data, w.q.scale, bias=bias, small_m=self.small_m, out_round=rnd,
                                       out_dtype=torch.float32 if rnd else out_dtype, policy=self.decode_policy,
                                       options=self.options)
            elif w.spec == "e4m3:tensor":
                y = g.fp8_tensor_linear(xq.data.reshape(-1, k), xq.scale, w.q.data, w.q.scale, bias=bias,
                                        out_dtype=out_dtype, policy=self.decode_policy,
                                        options=self.options)
            elif w.spec == "mxfp8":
                y = self._mx_k.mx_linear(xq, w.kernel if w.kernel is not None else w.q, bias=bias,
                                         out_dtype=out_dtype, policy=self.decode_policy,
                                         options=self.options)
            else:
                self._count("linear", f"fallback:{x_spec}x{w.spec}")
                return None
        else:  # a float activation (bf16 / fp32 input site): w4a16 MX/NVFP4 or a float weight
            lead, k = xq.shape[:-1], xq.shape[-1]
            x2 = xq.reshape(-1, k)
            if w.spec in ("mxfp4", "nvfp4"):
                y = self._mx_k.mx_linear(x2.to(torch.bfloat16), w.kernel if w.kernel is not None else w.q,
                                         bias=bias, out_dtype=out_dtype, policy=self.decode_policy,
                                         options=self.options)
            elif partial:  # cuBLAS in a half dtype writes that dtype: a rounded partial sum
                self._count("linear", f"fallback:row-parallel-{w.spec}")
                return None
            else:  # float weight: cuBLAS in the weight's dtype (fp32 accumulate; TF32 off by the reference setup)
                dt = w.kernel.dtype
                y = F.linear(x2.to(dt), w.kernel, None if bias is None else bias.to(dt))
        self._count("linear", "native")
        # bf16/fp16 outputs are exactly representable in fp32: the rest of the model stays fp32-typed
        return y.float().reshape(*lead, w.shape[0])

    def linear(self, x: torch.Tensor | QTensor, w: torch.Tensor | NativeWeight, bias: torch.Tensor | None,
               module: str, input_site: str = "linear.input") -> torch.Tensor:
        """Native GEMM when (input format, weight format) has a kernel, else the emulation."""
        if isinstance(w, NativeWeight):
            in_spec = self.recipe.spec(input_site, module)
            if isinstance(x, QTensor) and x.spec.is_passthrough:  # a float "quantization" (bf16 / fp32 input)
                xin: QTensor | torch.Tensor = x.dequantize().to(_FLOAT_DTYPES[str(x.spec)])
            elif isinstance(x, QTensor):
                xin = x
            elif in_spec in _FLOAT_DTYPES:
                xin = x.to(_FLOAT_DTYPES[in_spec])
            else:
                xin = self.quant(x, input_site, module)
            # row-parallel (tensor parallelism): the fp32 partial sum is all-reduced before the bias and rounding
            partial = self.parallel is not None and self.parallel.is_row_parallel(module)
            y = self._native_gemm(xin, w, None if partial else bias, module, partial)
            if y is not None:
                return self.gemm_output(y.reshape(-1, y.shape[-1]), bias, module, y.shape[:-1]) if partial else y
            xd = xin.dequantize() if isinstance(xin, QTensor) else xin.float()
            return self._gemm(xd, w.dequantize(), bias, module)
        if self.parallel is not None:  # a shard cut inside a scale group holds its emulated values
            self._count("linear", "fallback:unaligned-shard")
        return super().linear(x, w, bias, module, input_site)

    def linears(self, x: torch.Tensor | QTensor, ws: Sequence[torch.Tensor | NativeWeight],
                biases: Sequence[torch.Tensor | None], modules: Sequence[str]) -> list[torch.Tensor]:
        """q/k/v or gate/up as ONE FP8 block GEMM on their weights stacked along N (one launch, one weight
        stream; each output column is computed from the same values, only the split-K summation order can
        differ from separate calls). The stacked weight is built on first use and the per-module weights
        become views into it (no second copy). Anything else: one `linear` per module."""
        stack = self._stacked(x, ws, modules)
        if stack is None:
            return super().linears(x, ws, biases, modules)
        merged, sizes = stack
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.float() if b is not None else torch.zeros(n, device=merged.device)
                              for b, n in zip(biases, sizes)])
        y = self._native_gemm(x, merged, bias, modules[0])
        if y is None:
            return super().linears(x, ws, biases, modules)
        self.coverage["linear:native"] += len(ws) - 1
        return list(y.split(list(sizes), dim=-1))

    def _stacked(self, x, ws, modules) -> Optional[tuple[NativeWeight, tuple[int, ...]]]:
        """The N-stacked e4m3:128x128 weight of `ws` for a merged GEMM, or None when the call does not qualify
        (other formats, N not a multiple of 128, differing K / output formats, a local probe watching)."""
        if (len(ws) < 2 or not isinstance(x, QTensor) or str(x.spec) != "e4m3:1x128" or self.local is not None
                or not all(isinstance(w, NativeWeight) and w.spec == "e4m3:128x128"
                           and w.q is not None and w.shape[0] % 128 == 0 for w in ws)
                or len({w.shape[1] for w in ws}) != 1
                or len({self.recipe.spec("linear.output", m) for m in modules}) != 1):
            return None
        key = tuple(id(w) for w in ws)
        hit = self._stacks.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[2], ws)):
            return hit[0], hit[1]
        q0 = ws[0].q
        if _consecutive([w.q.data for w in ws]) and _consecutive([w.q.scale for w in ws]):
            # already views of one stack (another Numerics sharing these weights stacked them): reuse it
            data = q0.data.as_strided((sum(w.shape[0] for w in ws), q0.data.shape[1]), q0.data.stride())
            scale = q0.scale.as_strided((data.shape[0] // 128, q0.scale.shape[1]), q0.scale.stride())
        else:
            data = torch.cat([w.q.data for w in ws])  # (sum N, K)
            scale = torch.cat([w.q.scale for w in ws])  # (sum N / 128, K / 128)
        merged = NativeWeight("e4m3:128x128", torch.Size((data.shape[0], data.shape[1])),
                              q=dataclasses.replace(q0, data=data, scale=scale, shape=data.shape))
        r = 0
        for w in ws:  # the module weights become views of the stack: one copy of the bytes
            n = w.shape[0]
            w.q = dataclasses.replace(w.q, data=data[r:r + n], scale=scale[r // 128:(r + n) // 128])
            r += n
        sizes = tuple(w.shape[0] for w in ws)
        self._stacks[key] = (merged, sizes, tuple(ws))
        return merged, sizes

    def _gemm(self, xd: torch.Tensor, w: torch.Tensor | NativeWeight, bias: torch.Tensor | None,
              module: str) -> torch.Tensor:
        """Emulated GEMM on a (possibly native) weight."""
        return super()._gemm(xd, dense_values(w), bias, module)

    # ------------------------------------------------------------- attention
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                  k_pos: torch.Tensor, module: str, sliding_window: int | None = None,
                  scale: float | None = None) -> torch.Tensor:
        """The Triton flash-attention kernel (FP32 QK^T + softmax) when softmax is fp32, else emulated."""
        sm = self.recipe.spec("attn.softmax", module)
        if sm != "fp32" or not q.is_cuda:
            self._count("attention", "fallback:softmax=" + sm)
            return super().attention(q, k, v, q_pos, k_pos, module, sliding_window, scale)
        q = self.round(q, "attn.q", module)

        def _carrier(t: torch.Tensor, site: str) -> torch.Tensor:
            # K/V/Q hold their storage format's values in fp32; bf16/fp16 formats travel losslessly
            # in that dtype, scaled FP8 values stay fp32 (exact) for the kernel.
            s = self.recipe.spec(site, module)
            return t.to(_FLOAT_DTYPES[s]) if s in NATIVE_FORMATS.half else t

        qc, kc, vc = _carrier(q, "attn.q"), _carrier(k, "kv.k"), _carrier(v, "kv.v")
        if qc.dtype == torch.float32 or kc.dtype == torch.float32 or vc.dtype == torch.float32:
            # Scaled FP8 (or fp32) K/V in the contiguous cache arrive as fp32 values without their scales;
            # the FP8-reading attention is the paged runtime's (FP8 pages + scales, `engine.runtime`).
            self._count("attention", "fallback:fp32-carrier")
            return super().attention(q, k, v, q_pos, k_pos, module, sliding_window, scale)
        flash = functools.partial(self._attn_k.flash_attention, scale=scale, sliding_window=sliding_window,
                                  block_m=self.attn_block, block_n=self.attn_block)
        if q_pos.dim() == 2:  # positions per row (MLA on the paged runtime): the kernel takes one row's at a time
            out = torch.cat([flash(qc[r:r + 1].contiguous(), kc[r:r + 1].contiguous(), vc[r:r + 1].contiguous(),
                                   q_pos[r], k_pos) for r in range(q.shape[0])])
        else:
            out = flash(qc.contiguous(), kc.contiguous(), vc.contiguous(), q_pos, k_pos)
        self._count("attention", "native")
        return out.float()

    # ------------------------------------------------------------------- MoE
    def moe(self, x: torch.Tensor, xq: QTensor, router_w: torch.Tensor, correction_bias: torch.Tensor | None,
            experts: Sequence[tuple], cfg: MoeConfig, module: str, tap: str) -> torch.Tensor:
        """Sorted-by-expert grouped FP8 GEMMs for block-FP8 experts, else the emulation. Under expert parallelism
        the rows travel (`engine.parallel.ParallelContext.moe`) and this rank's experts run in `run_dispatched`."""
        why = self._moe_fallback(xq, experts, module)
        if why is not None:
            self._count("moe", "fallback:" + why)
            return super().moe(x, xq, router_w, correction_bias, dense_experts(experts), cfg, module, tap)
        if self.parallel is not None and self.parallel.ep > 1:
            weights, ids = self.route_tokens(x, router_w, correction_bias, cfg, module, tap)  # (tokens, k)
            return self.parallel.moe(self, xq, weights, ids, experts, module)
        from engine.kernels import moe as moe_k

        n, d = x.shape
        weights, ids = self.route_tokens(x, router_w, correction_bias, cfg, module, tap)  # (tokens, k)
        stacks, out_dtype = self._expert_stacks(experts, module)
        y = moe_k.grouped_fp8_moe(xq.data.reshape(n, d), xq.scale.reshape(n, -1), *stacks, weights, ids,
                                  mode="block", out_dtype=out_dtype)
        self._count("moe", "native")
        return y.float()

    def _moe_fallback(self, xq: QTensor, experts: Sequence[tuple | None], module: str) -> Optional[str]:
        """Why the routed experts of `module` cannot run on the grouped FP8 GEMMs (None: they can)."""
        specs = {e.spec for ex in experts if ex is not None for e in ex if isinstance(e, NativeWeight)}
        in_spec = str(xq.spec)
        w_spec, x_spec = NATIVE_FORMATS.moe
        ok = (specs == {w_spec} and in_spec == x_spec and self.recipe.accumulate == "fp32"
              and self.observer is None and self._rowwise_spec(
                  "moe.input", [f"{module}.experts.{e}.down_proj" for e in range(len(experts))]) == x_spec)
        return None if ok else (",".join(sorted(specs)) or "float") + "/" + in_spec

    def _expert_stacks(self, experts: Sequence[tuple | None], module: str) -> tuple[tuple, torch.dtype]:
        """(gate, up, down) of the experts held here stacked once per layer -- (E, N, K) FP8 + (E, N/128, K/128)
        scales -- and the GEMMs' output dtype (the experts' `linear.output`)."""
        from engine.kernels import moe as moe_k

        stacks = self._moe_stacks.get(module)
        if stacks is None:
            stacks = tuple(moe_k.stack_expert_weights([ex[j].q for ex in experts if ex is not None]) for j in range(3))
            self._moe_stacks[module] = stacks
        return stacks, _FLOAT_DTYPES.get(self.recipe.spec("linear.output", module + ".experts"), torch.bfloat16)

