"""Triton kernels: fused RMSNorm -> FP8 quant and SwiGLU -> FP8 quant (E4M3, 1x128 per-token groups).

Each kernel writes FP8 data plus fp32 group scales in the layout of
`engine.formats.quantize(x, "e4m3:1x128")` (data (M, K) float8_e4m3fn, scales
(M, ceil(K/128))), and its quantization is bit-exact with that library:

* scale = amax(group) / 448 with IEEE round-to-nearest division (`tl.div_rn`),
  1 for an all-zero group, NaN for a group holding a NaN;
* element = RNE(x / scale) with `tl.div_rn`, converted to E4M3 with
  round-to-nearest-even (values never exceed 448 for dynamic scales).

The norm / activation part is fp32 math whose reduction order differs from
torch's, so the fused kernels can return their pre-quant values
(`return_hp=True`) to check the quantization bit-exactly on exactly those
values. The pure-torch references sit beside each wrapper (`*_reference`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 128
E4M3_MAX = 448.0


@triton.jit
def _quant_tile(h, rows, cols, M, K, n_groups, gid, out_ptr, scale_ptr):
    """Quantize an fp32 tile h (BM, 128) = one 1x128 group of BM rows; store FP8 data and the BM scales."""
    amax = tl.max(tl.abs(h), axis=1)  # (BM,)
    n_nan = tl.sum((h != h).to(tl.int32), axis=1)
    scale = tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))  # E4M3 max normal
    scale = tl.where(amax == 0.0, 1.0, scale)
    nan = tl.sum(tl.where(h != h, h, 0.0), axis=1)  # NaN exactly where the group holds a NaN
    scale = tl.where(n_nan > 0, nan, scale)
    y = tl.div_rn(h, scale[:, None])  # (BM, 128)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], y.to(tl.float8e4nv, fp_downcast_rounding="rtne"),
             mask=mask)
    tl.store(scale_ptr + rows * n_groups + gid, scale, mask=rows < M)


@triton.jit
def _act_quant_kernel(x_ptr, out_ptr, scale_ptr, M, K, n_groups, BM: tl.constexpr):
    """Grid (row blocks, groups): plain 1x128 quantization of one (BM, 128) tile."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    gid = tl.program_id(1)
    cols = gid * 128 + tl.arange(0, 128)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    h = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    _quant_tile(h, rows, cols, M, K, n_groups, gid, out_ptr, scale_ptr)


@triton.jit
def _rmsnorm_quant_kernel(x_ptr, w_ptr, out_ptr, scale_ptr, hp_ptr, M, K, n_groups, eps,
                          BM: tl.constexpr, STORE_HP: tl.constexpr):
    """Grid (row blocks,): pass 1 sums x^2 over the row in 128-wide chunks; pass 2 computes
    h = w * (x * 1/sqrt(mean(x^2) + eps)) in fp32 and quantizes each 1x128 group."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    acc = tl.zeros((BM,), tl.float32)
    for gid in range(0, n_groups):
        cols = gid * 128 + tl.arange(0, 128)
        mask = (rows[:, None] < M) & (cols[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(x * x, axis=1)
    var = tl.div_rn(acc, tl.full(acc.shape, K, tl.float32))
    rstd = tl.div_rn(tl.full(acc.shape, 1.0, tl.float32), tl.sqrt_rn(var + eps))
    for gid in range(0, n_groups):
        cols = gid * 128 + tl.arange(0, 128)
        mask = (rows[:, None] < M) & (cols[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        h = w[None, :] * (x * rstd[:, None])
        if STORE_HP:
            tl.store(hp_ptr + rows[:, None] * K + cols[None, :], h, mask=mask)
        _quant_tile(h, rows, cols, M, K, n_groups, gid, out_ptr, scale_ptr)


@triton.jit
def _rmsnorm_quant_row_kernel(x_ptr, w_ptr, out_ptr, scale_ptr, hp_ptr, M, K, n_groups, eps,
                              G: tl.constexpr, STORE_HP: tl.constexpr):
    """Grid (rows,): single pass. The whole row is held as a (G, 128) register tile (G = n_groups
    rounded up to a power of two), so x is read from HBM once: sum x^2, h = w * (x * 1/sqrt(mean + eps)),
    then every 1x128 group (a tile row) is quantized like `_quant_tile`."""
    row = tl.program_id(0)
    g = tl.arange(0, G)
    c = tl.arange(0, 128)
    cols = g[:, None] * 128 + c[None, :]  # (G, 128)
    mask = cols < K
    x = tl.load(x_ptr + row * K + cols, mask=mask, other=0.0).to(tl.float32)
    ss = tl.sum(tl.sum(x * x, axis=1), axis=0)
    var = tl.div_rn(ss, K * 1.0)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    h = w * (x * rstd)
    if STORE_HP:
        tl.store(hp_ptr + row * K + cols, h, mask=mask)
    amax = tl.max(tl.abs(h), axis=1)  # (G,)
    n_nan = tl.sum((h != h).to(tl.int32), axis=1)
    scale = tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    scale = tl.where(amax == 0.0, 1.0, scale)
    nan = tl.sum(tl.where(h != h, h, 0.0), axis=1)
    scale = tl.where(n_nan > 0, nan, scale)
    y = tl.div_rn(h, scale[:, None])
    tl.store(out_ptr + row * K + cols, y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(scale_ptr + row * n_groups + g, scale, mask=g < n_groups)


@triton.jit
def _swiglu_quant_kernel(g_ptr, u_ptr, out_ptr, scale_ptr, hp_ptr, M, K, n_groups,
                         BM: tl.constexpr, STORE_HP: tl.constexpr):
    """Grid (row blocks, groups): h = silu(g) * u = g / (1 + exp(-g)) * u in fp32, then 1x128 quant."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    gid = tl.program_id(1)
    cols = gid * 128 + tl.arange(0, 128)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    g = tl.load(g_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h = tl.div_rn(g, 1.0 + tl.exp(-g)) * u
    if STORE_HP:
        tl.store(hp_ptr + rows[:, None] * K + cols[None, :], h, mask=mask)
    _quant_tile(h, rows, cols, M, K, n_groups, gid, out_ptr, scale_ptr)


def _launch_shape(x: torch.Tensor) -> tuple[int, int, int]:
    """(rows, K, groups) for a (..., K) CUDA tensor; asserts contiguity."""
    assert x.is_cuda and x.is_contiguous(), "kernels take contiguous CUDA tensors"
    k = x.shape[-1]
    return x.numel() // k, k, triton.cdiv(k, GROUP)


BM_TILE = 32  # rows per tile for the per-group kernels
BM_NORM = 8  # rows per program for the two-pass RMSNorm kernel


def _outputs(x: torch.Tensor, rows: int, k: int, groups: int, return_hp: bool):
    """Allocate FP8 data, scales and (optionally) the fp32 pre-quant buffer."""
    out = torch.empty(x.shape, device=x.device, dtype=torch.float8_e4m3fn)
    scales = torch.empty((*x.shape[:-1], groups), device=x.device, dtype=torch.float32)
    hp = torch.empty(x.shape, device=x.device, dtype=torch.float32) if return_hp else out
    return out, scales, hp


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 1x128 quantization of x (..., K): (data, scales). Reference: `act_quant_reference`."""
    rows, k, groups = _launch_shape(x)
    out, scales, _ = _outputs(x, rows, k, groups, False)
    _act_quant_kernel[(triton.cdiv(rows, BM_TILE), groups)](x, out, scales, rows, k, groups, BM=BM_TILE, num_warps=4)
    return out, scales


def act_quant_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The formats library's e4m3:1x128 quantization, the bits every kernel must reproduce."""
    from engine.formats import quantize

    q = quantize(x.float(), "e4m3:1x128")
    return q.data, q.scale


ROW_KERNEL_MAX_GROUPS = 128  # the single-pass kernel holds at most 128 groups (16384 columns) per row


def rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, return_hp: bool = False,
                  single_pass: bool | None = None):
    """Fused RMSNorm -> E4M3 1x128 quant: (data, scales[, fp32 normed]).

    Default: the two-pass kernel (x read twice, any width; the faster one on the H200, where
    the one-pass kernel's whole-row register tile limits occupancy). `single_pass=True` holds
    rows of up to 16384 elements in registers and reads x once.
    """
    rows, k, groups = _launch_shape(x)
    assert weight.shape == (k,) and weight.is_cuda
    out, scales, hp = _outputs(x, rows, k, groups, return_hp)
    if single_pass is None:  # measured on the H200 at 16384 x 7168: two-pass 1.52 TB/s, one-pass 1.01 TB/s
        single_pass = False
    if single_pass:
        if groups > ROW_KERNEL_MAX_GROUPS:
            raise ValueError(f"single_pass: rows of {k} columns exceed {ROW_KERNEL_MAX_GROUPS * 128}; use two-pass")
        g = triton.next_power_of_2(groups)
        _rmsnorm_quant_row_kernel[(rows,)](x, weight.contiguous(), out, scales, hp, rows, k, groups, eps,
                                           G=g, STORE_HP=return_hp, num_warps=4 if g <= 16 else 8 if g <= 64 else 16)
    else:
        _rmsnorm_quant_kernel[(triton.cdiv(rows, BM_NORM),)](x, weight.contiguous(), out, scales, hp, rows, k,
                                                             groups, eps, BM=BM_NORM, STORE_HP=return_hp,
                                                             num_warps=4)
    return (out, scales, hp) if return_hp else (out, scales)


def rmsnorm_quant_reference(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """Torch RMSNorm (the engine's fp32 `Numerics.rmsnorm` math) then the library quantizer."""
    h = x.float()
    h = weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))
    d, s = act_quant_reference(h)
    return d, s, h


def swiglu_quant(gate: torch.Tensor, up: torch.Tensor, return_hp: bool = False, bm: int = 16,
                 num_warps: int = 4):
    """Fused SwiGLU (silu(gate) * up) -> E4M3 1x128 quant: (data, scales[, fp32 activation]).

    `bm` rows x 128 columns per program (a tiling knob the benchmark sweeps; any value gives the same bits;
    16 measured best on the H200: 2.88 TB/s vs 2.40 at 32)."""
    assert gate.shape == up.shape and up.is_contiguous()
    rows, k, groups = _launch_shape(gate)
    out, scales, hp = _outputs(gate, rows, k, groups, return_hp)
    _swiglu_quant_kernel[(triton.cdiv(rows, bm), groups)](gate, up, out, scales, hp, rows, k, groups,
                                                          BM=bm, STORE_HP=return_hp, num_warps=num_warps)
    return (out, scales, hp) if return_hp else (out, scales)


def swiglu_quant_reference(gate: torch.Tensor, up: torch.Tensor):
    """Torch SwiGLU (the engine's `F.silu(g) * u`) then the library quantizer."""
    h = torch.nn.functional.silu(gate.float()) * up.float()
    d, s = act_quant_reference(h)
    return d, s, h
