"""Triton kernel: rotate-half RoPE of q and k in one launch, bit-identical to `engine.rope.apply_rope`.

`apply_rope(x, cos, sin)` computes ``x * cos + cat(-x[..., d/2:], x[..., :d/2]) * sin`` with every fp32
multiply and add rounded on its own. With x1 = x[..., :d/2] and x2 = x[..., d/2:] the two halves are

    out1 = x1 * cos1 + (-x2) * sin1 = x1 * cos1 - x2 * sin1
    out2 = x2 * cos2 + x1 * sin2

The first equality holds bit for bit under round-to-nearest: (-a) * b rounds to exactly -(a * b), and
IEEE defines a - b as a + (-b), signed zeros included. The kernel writes out1 that way on purpose:
Triton lowers unary minus to ``0 - x``, which turns -0 into +0, whereas torch's negation flips the
sign bit; ``x1 * cos1 - x2 * sin1`` needs no negation at all. The launch passes
``enable_fp_fusion=False`` (a Triton compile option: LLVM may not contract and ptxas runs with
``--fmad=false``), so no multiply-add is fused into an FMA, which would round once instead of twice.

NaN payloads are not part of the contract: the GPU returns the canonical NaN from any arithmetic on
a NaN (as torch's CUDA kernels do), while the reference on CPU may keep the payload.

Layout. q (batch, heads, t, d) and k (batch, kv_heads, t, d) may be any strided views with unit
stride on d -- in the model they are ``q.view(b, t, h, d).transpose(1, 2)`` of a contiguous GEMM
output -- and cos/sin are (t, d) (contiguous KV cache) or (batch | 1, 1, t, d) (paged runtime, each
sequence at its own position), read with stride 0 over the broadcast dims. Outputs are contiguous.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from engine.kernels import kernel_device_ok
from engine.kernels.options import DEFAULT_OPTIONS, KernelOptions
from engine.kernels.pdl import launch_opts, pdl_enter
from engine.kernels.quant import _round_bf16


# ---------------------------------------------------------------------- kernels
@triton.jit
def _rope_heads(x_ptr, o_ptr, o16_ptr, c1, c2, s1, s2, b, ti, h0, H, T, sxb, sxh, sxt,
                HALF: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr, BF16_COPY: tl.constexpr):
    """Rotate heads h0 .. h0+BH-1 (masked to H) of position ti of sequence b; c*/s* are the (BD,) halves of cos/sin.

    x is (batch, H, T, 2*HALF) with strides (sxb, sxh, sxt, 1); the output is contiguous. BF16_COPY also
    stores the output rounded to bf16 (RNE, on the bits) at o16_ptr, same layout."""
    hh = h0 + tl.arange(0, BH)  # (BH,) head indices
    j = tl.arange(0, BD)  # (BD,) index within a half
    mask = (hh < H)[:, None] & (j < HALF)[None, :]  # (BH, BD)
    xrow = x_ptr + b.to(tl.int64) * sxb + ti.to(tl.int64) * sxt + hh.to(tl.int64)[:, None] * sxh
    x1 = tl.load(xrow + j[None, :], mask=mask, other=0.0)  # (BH, BD) first half
    x2 = tl.load(xrow + HALF + j[None, :], mask=mask, other=0.0)  # (BH, BD) second half
    out1 = x1 * c1[None, :] - x2 * s1[None, :]  # = x1*cos1 + (-x2)*sin1 bit for bit (module docstring)
    out2 = x2 * c2[None, :] + x1 * s2[None, :]
    row = ((b.to(tl.int64) * H + hh.to(tl.int64)[:, None]) * T + ti) * (2 * HALF)  # (BH, 1) output offsets
    tl.store(o_ptr + row + j[None, :], out1, mask=mask)
    tl.store(o_ptr + row + HALF + j[None, :], out2, mask=mask)
    if BF16_COPY:
        tl.store(o16_ptr + row + j[None, :], _round_bf16(out1).to(tl.bfloat16), mask=mask)
        tl.store(o16_ptr + row + HALF + j[None, :], _round_bf16(out2).to(tl.bfloat16), mask=mask)


@triton.jit
def _rope_qk_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, q16_ptr, cos_ptr, sin_ptr, T, H, HKV, n_qblocks,
                    sqb, sqh, sqt, skb, skh, skt, scb, sct, ssb, sst,
                    HALF: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr, Q_BF16: tl.constexpr = False,
                    PDL: tl.constexpr = False):
    """Grid (batch * t, q head blocks + k head blocks): one program rotates BH heads of one position.

    cos/sin rows are read once per program (strides (scb, sct) / (ssb, sst); 0 where broadcast) and
    shared by its heads; program column < n_qblocks works on q, the rest on k. Q_BF16: q's output is also
    stored rounded to bf16 at q16_ptr (the attention kernel's query carrier, without a cast launch)."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    blk = tl.program_id(1)
    b = pid // T
    ti = pid % T
    j = tl.arange(0, BD)
    jm = j < HALF
    crow = cos_ptr + b.to(tl.int64) * scb + ti.to(tl.int64) * sct
    srow = sin_ptr + b.to(tl.int64) * ssb + ti.to(tl.int64) * sst
    c1 = tl.load(crow + j, mask=jm, other=0.0)
    c2 = tl.load(crow + HALF + j, mask=jm, other=0.0)
    s1 = tl.load(srow + j, mask=jm, other=0.0)
    s2 = tl.load(srow + HALF + j, mask=jm, other=0.0)
    if blk < n_qblocks:
        _rope_heads(q_ptr, qo_ptr, q16_ptr, c1, c2, s1, s2, b, ti, blk * BH, H, T, sqb, sqh, sqt, HALF, BH, BD,
                    Q_BF16)
    else:
        _rope_heads(k_ptr, ko_ptr, ko_ptr, c1, c2, s1, s2, b, ti, (blk - n_qblocks) * BH, HKV, T, skb, skh, skt,
                    HALF, BH, BD, False)


# --------------------------------------------------------------------- wrappers
ROPE_MAX_HEAD_DIM = 1024  # one program holds BH x d/2 pairs in registers; real models use d <= 256


def _check_qk(x: torch.Tensor, name: str) -> None:
    """x must be a (batch, heads, t, d) fp32 CUDA tensor (CPU under TRITON_INTERPRET=1) with unit stride on d."""
    if not kernel_device_ok(x):
        raise ValueError(f"{name}: the Triton RoPE kernel needs CUDA tensors (got device {x.device}); "
                         "use engine.rope.apply_rope on CPU")
    if x.dim() != 4:
        raise ValueError(f"{name}: expected (batch, heads, t, d), got shape {tuple(x.shape)}")
    if x.dtype != torch.float32:
        raise ValueError(f"{name}: expected float32, got {x.dtype}; apply_rope's bits are defined for fp32")
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name}: needs unit stride on the last (d) dim, got strides {x.stride()} for "
                         f"shape {tuple(x.shape)}; call .contiguous() first")


def _table(c: torch.Tensor, name: str, like: torch.Tensor) -> torch.Tensor:
    """cos/sin as a (batch, 1, t, d) view (stride 0 over broadcast dims) of a (t, d) or (batch | 1, 1, t, d) table."""
    b, _, t, d = like.shape
    if c.dtype != torch.float32:
        raise ValueError(f"{name}: expected float32, got {c.dtype}")
    if c.device != like.device:
        raise ValueError(f"{name}: on {c.device}, q is on {like.device}")
    bad_lead = c.dim() == 4 and (c.shape[1] != 1 or c.shape[0] not in (1, b))
    if c.dim() not in (2, 4) or c.shape[-2:] != (t, d) or bad_lead:
        raise ValueError(f"{name}: expected (t, d) = {(t, d)} or (batch | 1, 1, t, d) with batch = {b}, "
                         f"got shape {tuple(c.shape)}")
    if d > 1 and c.stride(-1) != 1:
        raise ValueError(f"{name}: needs unit stride on the last (d) dim, got strides {c.stride()}; "
                         "call .contiguous() first")
    return c.expand(b, 1, t, d)  # (batch, 1, t, d): expand gives stride 0 where broadcast


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
            block_h: int | None = None, num_warps: int | None = None, q_bf16: bool = False,
            options: KernelOptions = DEFAULT_OPTIONS):
    """Rotate-half RoPE of q (batch, heads, t, d) and k (batch, kv_heads, t, d) fp32 in one launch.

    cos/sin: (t, d), (1, 1, t, d) or (batch, 1, t, d) fp32 (`engine.rope.rope_tables`). q, k and the
    tables may be strided with unit stride on d. Returns contiguous fp32 (batch, heads, t, d) and
    (batch, kv_heads, t, d), bit-identical to ``apply_rope(q, cos, sin), apply_rope(k, cos, sin)``
    (NaN payloads aside). d must be even. Knobs (same bits for every value): `block_h` heads per
    program (power of two; default: up to 16, at most the smaller head count), `num_warps`.
    q_bf16=True also returns q's output rounded to bf16 (a third tensor, (batch, heads, t, d) bf16, equal to
    ``q_out.to(torch.bfloat16)``), written by the same launch. Reference: `rope_qk_reference`."""
    _check_qk(q, "q")
    _check_qk(k, "k")
    b, h, t, d = q.shape
    if k.shape[0] != b or k.shape[2:] != (t, d):
        raise ValueError(f"k: shape {tuple(k.shape)} does not match q {tuple(q.shape)} in batch, t or d "
                         "(expected (batch, kv_heads, t, d))")
    if k.device != q.device:
        raise ValueError(f"k: on {k.device}, q is on {q.device}")
    if d % 2 or d > ROPE_MAX_HEAD_DIM:
        raise ValueError(f"q: head dim d={d} must be even and at most {ROPE_MAX_HEAD_DIM} for rotate-half RoPE")
    hkv = k.shape[1]
    cos_b, sin_b = _table(cos, "cos", q), _table(sin, "sin", q)
    q_out = torch.empty((b, h, t, d), device=q.device, dtype=torch.float32)
    k_out = torch.empty((b, hkv, t, d), device=k.device, dtype=torch.float32)
    q16 = torch.empty((b, h, t, d), device=q.device, dtype=torch.bfloat16) if q_bf16 else None
    if q_out.numel() == 0 and k_out.numel() == 0:
        return (q_out, k_out, q16) if q_bf16 else (q_out, k_out)
    half = d // 2
    bd = triton.next_power_of_2(half)
    if block_h is None:
        block_h = min(16, triton.next_power_of_2(max(1, min(h or hkv, hkv or h))), max(1, 4096 // bd))
    if not (isinstance(block_h, int) and 1 <= block_h <= 64 and block_h & (block_h - 1) == 0):
        raise ValueError(f"block_h={block_h!r}: use a power of two between 1 and 64")
    if num_warps is None:
        num_warps = max(1, min(8, block_h * bd // 128))
    n_qblocks = triton.cdiv(h, block_h)
    grid = (b * t, n_qblocks + triton.cdiv(hkv, block_h))
    _rope_qk_kernel[grid](
        q, k, q_out, k_out, q16 if q_bf16 else q_out, cos_b, sin_b, t, h, hkv, n_qblocks,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        cos_b.stride(0), cos_b.stride(2), sin_b.stride(0), sin_b.stride(2),
        HALF=half, BH=block_h, BD=bd, Q_BF16=q_bf16, num_warps=num_warps, enable_fp_fusion=False,
        **launch_opts(q_out, options.pdl))
    return (q_out, k_out, q16) if q_bf16 else (q_out, k_out)


def rope_qk_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """`engine.rope.apply_rope` on q (batch, heads, t, d) and k (batch, kv_heads, t, d): the bits of `rope_qk`."""
    from engine.rope import apply_rope

    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
