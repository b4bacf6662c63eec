"""Triton kernels: fused RMSNorm -> FP8 quant and SwiGLU -> FP8 quant (E4M3, 1x128 per-token groups or MXFP8).

Each kernel writes FP8 data plus fp32 group scales in the layout of
`engine.formats.quantize(x, "e4m3:1x128")` (data (M, K) float8_e4m3fn, scales
(M, ceil(K/128))), and its quantization is bit-exact with that library:

* scale = amax(group) / 448 with IEEE round-to-nearest division (`tl.div_rn`; on CUDA's fast path the same
  quotient by refinement with RN(1/448), `_quant_groups_fast`), 1 for an all-zero group, NaN for a group
  holding a NaN;
* element = RNE(x / scale) with `tl.div_rn` -- on CUDA the same quotient from the reciprocal refinement of
  `_div_by_scale` wherever it is exact (`_quant_groups` FAST) -- converted to E4M3 with
  round-to-nearest-even (values never exceed 448 for dynamic scales).

With ``fmt="mxfp8"`` every kernel quantizes to OCP MXFP8 instead (`_quant_groups_mx`): E4M3 elements with one
E8M0 scale per 1x32 block, in the layout and bits of `engine.formats.quantize(x, "mxfp8")` (scales (M, ceil(K/32))
fp32 powers of two).

The norm / activation part is fp32 math whose reduction order differs from
torch's, so the fused kernels can return their pre-quant values
(`return_hp=True`) to check the quantization bit-exactly on exactly those
values. The pure-torch references sit beside each wrapper (`*_reference`).

Tiling. Every kernel works on (R, 128) register tiles whose row r is one 1x128
group: `_tile_rows` maps tile row r of a (BM rows x GB groups) program to
(row, group), so a tile of GB consecutive groups of BM rows needs no in-kernel
reshape. The wrappers take the tiling as keyword arguments (defaults in the
`*_DEFAULTS` dicts; `benchmarks/tune_kernels.py` sweeps them). Tilings never
change act_quant / SwiGLU bits; for RMSNorm they change the order of the
sum of squares (so the last ulp of 1/rms), never the quantization of the
returned normed values.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from engine.kernels import kernel_device_ok, sm_count
from engine.kernels.options import DEFAULT_OPTIONS, KernelOptions
from engine.kernels.pdl import launch_opts, pdl_enter

GROUP = 128
E4M3_MAX = 448.0
RCP_448 = tl.constexpr(0.0022321429569274187)  # RN_fp32(1 / 448) = 0x3B124925, exact in fp32 (_quant_groups_fast)


# ------------------------------------------------------------------ jit helpers
@triton.jit
def _tile_rows(pid_m, pid_g, BM: tl.constexpr, GB: tl.constexpr):
    """(row, group) int32 (BM*GB,) of each tile row: GB consecutive groups of each of BM rows."""
    r = tl.arange(0, BM * GB)
    return pid_m * BM + r // GB, pid_g * GB + r % GB


@triton.jit
def _group_offsets(row, grp, M, K):
    """Element offsets (R, 128) int64 and mask of the groups grp (R,) of rows row (R,) in a (M, K) tensor."""
    cols = grp[:, None] * 128 + tl.arange(0, 128)[None, :]
    mask = (row < M)[:, None] & (cols < K)
    return row.to(tl.int64)[:, None] * K + cols, mask, cols


@triton.jit
def _max_keep_nan(a, b):
    """max that propagates NaN (a reduction combine function: the amax of a group holding a NaN is NaN)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _quant_groups(h, row, grp, M, K, n_groups, out_ptr, scale_ptr, FAST: tl.constexpr = False,
                  MX: tl.constexpr = False):
    """Quantize h (R, 128) fp32, tile row r = the 1x128 group grp[r] of row row[r]; store FP8 data and R scales
    (MX: MXFP8, 4 block scales per tile row, `_quant_groups_mx`).

    Masked-out elements must be 0 in h (they never raise an amax).

    FAST (GPU only; same bits): when every stored group of the tile has a finite amax >= 2^-80, each element
    is divided by the reciprocal refinement of `_div_by_scale` (3 instructions instead of the IEEE division's
    ~10 and its slow-path branch); any other tile (a NaN, an inf, an all-zero or tiny group) takes the IEEE
    path below. The CPU interpreter's fma rounds twice, so there FAST must stay off."""
    off, mask, _ = _group_offsets(row, grp, M, K)
    smask = (row < M) & (grp < n_groups)
    sptr = scale_ptr + row.to(tl.int64) * n_groups + grp
    if MX:
        _quant_groups_mx(h, row, grp, M, K, off, mask, out_ptr, scale_ptr)
    elif FAST:
        amax, bad = _fast_domain(h, smask)
        if tl.max(bad, axis=0) == 0:
            _quant_groups_fast(h, amax, off, mask, sptr, smask, out_ptr)
        else:
            _quant_groups_ieee(h, off, mask, sptr, smask, out_ptr)
    else:
        _quant_groups_ieee(h, off, mask, sptr, smask, out_ptr)


@triton.jit
def _fast_domain(h, smask):
    """(amax (R,), bad (R,) int32) of the groups of h: amax NaN where a group holds a NaN; bad 1 for a stored
    group outside the fast division's domain (2^-80 <= amax < inf, no NaN)."""
    amax = tl.reduce(tl.abs(h), 1, _max_keep_nan)
    ok = (amax >= 8.271806125530277e-25) & (amax < float("inf"))
    return amax, (smask & (ok == 0)).to(tl.int32)


@triton.jit
def _quant_groups_fast(h, amax, off, mask, sptr, smask, out_ptr):
    """The fast-division quantization of h (R, 128) with its group amaxes (exact for groups in the domain of
    `_fast_domain`, wrong bits for the others). CUDA only (inline PTX).

    scale = RN(amax / 448) by Markstein's refinement with the constant RN(1/448) (`_div_by_scale`: exact for
    every amax in the fast domain, whose quotients are all normal; tests/engine/kernels/test_quant.py checks a whole
    binade against IEEE division); 1/scale by PTX rcp.rn.f32 (IEEE round-to-nearest, the bits of
    div_rn(1, scale)). Each replaces an IEEE division's ~10-instruction sequence and slow-path branch. The
    scales are stored from the reduction's own register layout (`_store_f32`)."""
    scale = _div_by_scale(amax, tl.full(amax.shape, 448.0, tl.float32),  # E4M3 max normal
                          tl.full(amax.shape, RCP_448, tl.float32))
    y = _div_by_scale(h, scale[:, None], _rcp_rn(scale)[:, None])
    tl.store(out_ptr + off, y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)
    _store_f32(sptr, scale, smask)


@triton.jit
def _rcp_rn(x):
    """RN(1 / x) in fp32: PTX rcp.rn.f32 (IEEE 754 round to nearest; subnormals, zeros, infs as IEEE). CUDA only."""
    return tl.inline_asm_elementwise("rcp.rn.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _store_f32(ptr, v, mask):
    """Masked fp32 store of v (any shape) from v's own register layout. CUDA only (inline PTX st.global.f32).

    A tl.store of a reduction's result (a slice layout) makes Triton convert it to a store layout through
    shared memory, with two CTA barriers; the quant kernels store their scales with this instead
    (docs/design/performance.md#quantization-kernels). Threads that hold the same element store the same value
    to the same address (one transaction per warp)."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.f32 [$1], $2; mov.u32 $0, 0; }",
                              "=r,l,f,r", [ptr.to(tl.int64, bitcast=True), v, mask.to(tl.int32)], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _div_by_scale(x, s, r):
    """x / s correctly rounded to fp32 for the E4M3 conversion, from r = RN(1/s) (Markstein's refinement):
    q = RN(x * r) is within 1 ulp, the fma residual x - q*s is then exact, and RN(q + residual * r) is
    RN(x / s) -- for every quotient that E4M3 does not flush to zero, given 2^-80 <= amax < inf (smaller
    quotients may differ in the last fp32 bits, below E4M3's smallest subnormal: the same FP8 bits). The
    residual is formed as q*s - x and added times -r, so that x = -0 gives -0: `-x` in Triton is 0 - x
    (+0 for x = +0), `x * -1.0` the exact negation; -r is exact (r > 0). tests/engine/kernels/test_quant.py checks
    the algorithm against IEEE division with an exact fma on the CPU; the GPU kernel tests check the
    kernels' bits."""
    q = x * r
    return tl.fma(tl.fma(q, s, x * -1.0), -r, q)


@triton.jit
def _quant_groups_ieee(h, off, mask, sptr, smask, out_ptr):
    """The IEEE-division quantization of h (R, 128) (see `_quant_groups`): NaN-carrying and zero groups too."""
    amax = tl.max(tl.abs(h), axis=1)  # (R,)
    n_nan = tl.sum((h != h).to(tl.int32), axis=1)
    scale = tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))  # E4M3 max normal
    scale = tl.where(amax == 0.0, 1.0, scale)
    nan = tl.sum(tl.where(h != h, h, 0.0), axis=1)  # NaN exactly where the group holds a NaN
    scale = tl.where(n_nan > 0, nan, scale)
    y = tl.div_rn(h, scale[:, None])  # (R, 128)
    tl.store(out_ptr + off, y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(sptr, scale, mask=smask)


@triton.jit
def _quant_groups_mx(h, row, grp, M, K, off, mask, out_ptr, scale_ptr):
    """OCP MXFP8 of h (R, 128): tile row r holds the 1x32 blocks 4*grp[r] .. 4*grp[r]+3 of row row[r]. Per block
    (the bits of `engine.formats.quantize(x, "mxfp8")`): X = 2**(floor(log2(amax)) - 8) read from amax's exponent
    field and clamped to E8M0's 2**-127 (all-zero and tiny blocks, amax < 2**-119), NaN for a block holding a NaN or
    an inf; elements x * (1/X) -- exact, 1/X is a power of two -- rounded to E4M3 (RNE, saturating at 448: with the
    floor rule amax / X reaches up to 2**9); NaN in a NaN block. No division, so no fast / IEEE split. Scales go to
    scale_ptr as (M, ceil(K/32)) fp32; masked-out elements must be 0 in h."""
    R: tl.constexpr = h.shape[0]
    h3 = tl.reshape(h, (R, 4, 32))
    amax = tl.reduce(tl.abs(h3), 2, _max_keep_nan)  # (R, 4)
    ef = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent; 0 for zero and subnormal amaxes
    e = tl.maximum(ef - 135, -127)  # floor(log2(amax)) - emax(E4M3) = (ef - 127) - 8, E8M0-clamped
    bad = ef == 255  # NaN or inf in the block
    scale = tl.where(e > -127, (e + 127) << 23, 0x00400000).to(tl.float32, bitcast=True)  # 2**-127: subnormal
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2**-e, a normal number for every e in [-127, 119]
    scale = tl.where(bad, float("nan"), scale)
    inv = tl.where(bad, float("nan"), inv)
    y = tl.reshape(h3 * inv[:, :, None], (R, 128))
    tl.store(out_ptr + off, y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)
    nb = tl.cdiv(K, 32)
    blk = grp[:, None] * 4 + tl.arange(0, 4)[None, :]
    tl.store(scale_ptr + row.to(tl.int64)[:, None] * nb + blk, scale, mask=(row < M)[:, None] & (blk < nb))


@triton.jit
def _rstd(ss, K, eps):
    """1 / sqrt(ss / K + eps) with IEEE-rounded division and square root (ss: sums of squares)."""
    var = tl.div_rn(ss, tl.full(ss.shape, K, tl.float32))
    return tl.div_rn(tl.full(ss.shape, 1.0, tl.float32), tl.sqrt_rn(var + eps))


@triton.jit
def _norm_quant_store(x, rstd, row, grp, w_ptr, hp_ptr, out_ptr, scale_ptr, M, K, n_groups,
                      STORE_HP: tl.constexpr, FAST: tl.constexpr, MX: tl.constexpr = False):
    """h = w * (x * rstd) for x (R, 128) fp32 (rstd (R,) per tile row); optionally store h; quantize h."""
    off, mask, cols = _group_offsets(row, grp, M, K)
    w = tl.load(w_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    h = w * (x * rstd[:, None])
    if STORE_HP:
        tl.store(hp_ptr + off, h, mask=mask)
    _quant_groups(h, row, grp, M, K, n_groups, out_ptr, scale_ptr, FAST, MX)


# ---------------------------------------------------------------------- kernels
@triton.jit
def _act_quant_kernel(x_ptr, out_ptr, scale_ptr, M, K, n_groups, BM: tl.constexpr, GB: tl.constexpr,
                      FAST: tl.constexpr = False, PDL: tl.constexpr = False, MX: tl.constexpr = False):
    """Grid (row blocks, group blocks): plain 1x128 (MX: MXFP8) quantization of a (BM rows x GB groups) tile."""
    pdl_enter(PDL)
    row, grp = _tile_rows(tl.program_id(0), tl.program_id(1), BM, GB)
    off, mask, _ = _group_offsets(row, grp, M, K)
    h = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    _quant_groups(h, row, grp, M, K, n_groups, out_ptr, scale_ptr, FAST, MX)


@triton.jit
def _round_bf16(x):
    """x fp32 rounded to the nearest bf16 (ties to even), as fp32: torch's `.to(bfloat16).float()`, done on the
    bits (add 0x7FFF + the kept lsb, clear the low half) so the interpreter and the GPU round alike. NaN stays NaN."""
    bits = x.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return tl.where(x != x, x, r.to(tl.float32, bitcast=True))


@triton.jit
def _load_f32(ptrs, mask, EVICT: tl.constexpr):
    """Masked load as fp32 (0 outside); EVICT 1: keep in cache (evict_last), 2: stream (evict_first), 0: default."""
    if EVICT == 1:
        v = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_last")
    elif EVICT == 2:
        v = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        v = tl.load(ptrs, mask=mask, other=0.0)
    return v.to(tl.float32)


@triton.jit
def _residual_in(x_ptr, res_ptr, rout_ptr, off, mask, HAS_RES: tl.constexpr, RES_BF16: tl.constexpr,
                 STORE_RES: tl.constexpr, EVICT: tl.constexpr):
    """x (R, 128) fp32 at off; with HAS_RES the residual add x + res in fp32, rounded to bf16 (RNE) with
    RES_BF16 -- torch's `(x + o).to(bfloat16).float()` -- and stored to rout_ptr with STORE_RES."""
    x = _load_f32(x_ptr + off, mask, EVICT)
    if HAS_RES:
        x = x + _load_f32(res_ptr + off, mask, EVICT)
        if RES_BF16:
            x = _round_bf16(x)
        if STORE_RES:
            tl.store(rout_ptr + off, x, mask=mask)
    return x


@triton.jit
def _rmsnorm_quant_kernel(x_ptr, w_ptr, out_ptr, scale_ptr, hp_ptr, res_ptr, rout_ptr, M, K, n_groups, eps,
                          BM: tl.constexpr, GB: tl.constexpr, ONE_PASS: tl.constexpr, STAGES: tl.constexpr,
                          STORE_HP: tl.constexpr, HAS_RES: tl.constexpr = False, RES_BF16: tl.constexpr = False,
                          FAST: tl.constexpr = False, PDL: tl.constexpr = False, MX: tl.constexpr = False):
    """Grid (row blocks,): BM rows per program, walked in (BM*GB, 128) tiles (GB groups of each row).

    ONE_PASS (GB*128 >= K): the whole rows stay in registers (x read once). Otherwise pass 1 sums x^2
    chunk by chunk and pass 2 re-reads the chunks this program has just read (L1 / L2 hits: HBM still
    sees x once) to compute h = w * (x * 1/sqrt(mean(x^2) + eps)) in fp32 and quantize each 1x128
    group. STAGES > 1 software-pipelines both chunk loops (loads of later chunks in flight through
    shared memory; Triton pipelines a loop without tl.dot only when tl.range asks for it).

    HAS_RES: the normed rows are x + res (residual add, rounded to bf16 with RES_BF16), also written to
    rout_ptr (fp32): the residual stream update and the norm that reads it in one pass."""
    pdl_enter(PDL)
    row, sub = _tile_rows(tl.program_id(0), 0, BM, GB)
    if ONE_PASS:
        off, mask, _ = _group_offsets(row, sub, M, K)
        x = _residual_in(x_ptr, res_ptr, rout_ptr, off, mask, HAS_RES, RES_BF16, True, 0)
        ss = tl.sum(x * x, axis=1)
    else:
        ss = tl.zeros((BM * GB,), tl.float32)
        for g0 in tl.range(0, n_groups, GB, num_stages=STAGES):
            off, mask, _ = _group_offsets(row, g0 + sub, M, K)
            xc = _residual_in(x_ptr, res_ptr, rout_ptr, off, mask, HAS_RES, RES_BF16, False, 1)
            ss += tl.sum(xc * xc, axis=1)
    if BM == 1:
        rstd = _rstd(tl.zeros((GB,), tl.float32) + tl.sum(ss, axis=0), K, eps)
    else:  # per-row totals, broadcast back to the row's GB tile rows
        tot = tl.sum(tl.reshape(ss, (BM, GB)), axis=1)  # (BM,)
        rstd = tl.reshape(tl.broadcast_to(_rstd(tot, K, eps)[:, None], (BM, GB)), (BM * GB,))
    if ONE_PASS:
        _norm_quant_store(x, rstd, row, sub, w_ptr, hp_ptr, out_ptr, scale_ptr, M, K, n_groups, STORE_HP, FAST, MX)
    else:
        for g0 in tl.range(0, n_groups, GB, num_stages=STAGES):
            off, mask, _ = _group_offsets(row, g0 + sub, M, K)
            xc = _residual_in(x_ptr, res_ptr, rout_ptr, off, mask, HAS_RES, RES_BF16, True, 2)
            _norm_quant_store(xc, rstd, row, g0 + sub, w_ptr, hp_ptr, out_ptr, scale_ptr, M, K, n_groups,
                              STORE_HP, FAST, MX)


@triton.jit
def _rmsnorm_quant_persistent_kernel(x_ptr, w_ptr, out_ptr, scale_ptr, hp_ptr, res_ptr, rout_ptr, M, K, n_groups, eps,
                                     G: tl.constexpr, STAGES: tl.constexpr, STORE_HP: tl.constexpr,
                                     HAS_RES: tl.constexpr = False, RES_BF16: tl.constexpr = False,
                                     FAST: tl.constexpr = False, PDL: tl.constexpr = False, MX: tl.constexpr = False):
    """Grid (programs,): one pass over whole rows (G = n_groups rounded up to a power of two groups per
    (G, 128) tile). Each program loops over rows pid, pid + programs, ...; STAGES > 1 pipelines the
    loop, so the next rows are loading (into shared memory) while this one is normalized and
    quantized -- bytes in flight without holding more rows in registers. The weight is loaded once.
    HAS_RES / RES_BF16: the residual add of `_rmsnorm_quant_kernel` (rows x + res, written to rout_ptr).

    FAST: every row is quantized with the fast division unchecked, and the groups outside its domain are
    only or-ed into a per-group flag (no CTA-wide reduction or branch per row, which would also stop the
    loop's pipelining); a program whose flag is set walks its rows once more after a barrier (rare: a
    NaN, inf, all-zero or tiny group) and re-quantizes them with `_quant_groups` over the bits they got
    (`_requant_rows`)."""
    pdl_enter(PDL)
    g = tl.arange(0, G)
    cols = g[:, None] * 128 + tl.arange(0, 128)[None, :]  # (G, 128)
    cmask = cols < K
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    bad = tl.zeros((G,), tl.int32)
    for row in tl.range(tl.program_id(0), M, tl.num_programs(0), num_stages=STAGES):
        off = tl.cast(row, tl.int64) * K + cols
        x = _residual_in(x_ptr, res_ptr, rout_ptr, off, cmask, HAS_RES, RES_BF16, True, 0)
        h = w * (x * _row_rstd(x, K, eps, G)[:, None])
        if STORE_HP:
            tl.store(hp_ptr + off, h, mask=cmask)
        rows = tl.zeros((G,), tl.int32) + row
        if MX:
            _quant_groups(h, rows, g, M, K, n_groups, out_ptr, scale_ptr, False, True)
        elif FAST:
            smask = (rows < M) & (g < n_groups)
            amax, bad_row = _fast_domain(h, smask)
            _quant_groups_fast(h, amax, off, cmask, scale_ptr + rows.to(tl.int64) * n_groups + g, smask, out_ptr)
            bad = bad | bad_row
        else:
            _quant_groups(h, rows, g, M, K, n_groups, out_ptr, scale_ptr, False)
    if FAST and not MX:
        if tl.max(bad, axis=0) > 0:
            _requant_rows(w_ptr, x_ptr, rout_ptr, out_ptr, scale_ptr, cols, cmask, M, K, n_groups, eps, HAS_RES)


@triton.jit
def _row_rstd(x, K, eps, N: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of one row tile x (G, 128), as (N,) copies: the persistent kernel's reduction
    order, the same in both of its walks."""
    return _rstd(tl.zeros((N,), tl.float32) + tl.sum(tl.sum(x * x, axis=1), axis=0), K, eps)


@triton.jit
def _requant_rows(w_ptr, x_ptr, rout_ptr, out_ptr, scale_ptr, cols, cmask, M, K, n_groups, eps,
                  HAS_RES: tl.constexpr):
    """The persistent kernel's second walk over its rows: after a barrier (every thread's fast-path stores
    are ordered before these), each row's sum of squares is recomputed from the row as it was normed (the
    stored residual with HAS_RES) with the same code on the same tile, so to the same bits, and the row is
    normed and re-quantized by `_quant_groups` (IEEE for a group tile with a group outside the fast domain,
    else the fast path's own bits again) 8 groups at a time: few registers live, so this rare path does not
    raise the kernel's register count (docs/design/performance.md#quantization-kernels)."""
    tl.debug_barrier()
    src = rout_ptr if HAS_RES else x_ptr
    gc = tl.arange(0, 8)
    for row in tl.range(tl.program_id(0), M, tl.num_programs(0)):
        base = tl.cast(row, tl.int64) * K
        rstd = _row_rstd(_load_f32(src + base + cols, cmask, 0), K, eps, 8)
        for g0 in tl.range(0, n_groups, 8):
            ccols = (g0 + gc)[:, None] * 128 + tl.arange(0, 128)[None, :]
            cm = ccols < K
            xc = _load_f32(src + base + ccols, cm, 0)
            h = tl.load(w_ptr + ccols, mask=cm, other=0.0).to(tl.float32) * (xc * rstd[:, None])
            _quant_groups(h, tl.zeros((8,), tl.int32) + row, g0 + gc, M, K, n_groups, out_ptr, scale_ptr, True)


@triton.jit
def _swiglu_quant_kernel(g_ptr, u_ptr, out_ptr, scale_ptr, hp_ptr, M, K, n_groups, stride_g, stride_u,
                         BM: tl.constexpr, GB: tl.constexpr, FAST_SILU: tl.constexpr, STORE_HP: tl.constexpr,
                         FAST: tl.constexpr = False, PDL: tl.constexpr = False, MX: tl.constexpr = False):
    """Grid (row blocks, group blocks): h = silu(g) * u = g / (1 + exp(-g)) * u in fp32, then 1x128 (MX: MXFP8)
    quant.
    g and u are read at their own row strides (stride_g / stride_u elements; columns contiguous), so the two
    halves of a gate/up GEMM output are read in place; out, scales and hp are contiguous (M, K).

    FAST_SILU: the silu division is the approximate full-range one (div.full.f32, <= 2 ulp; tl.exp is
    already approximate) instead of IEEE; the quantization's divisions stay IEEE (bit-exactness)."""
    pdl_enter(PDL)
    row, grp = _tile_rows(tl.program_id(0), tl.program_id(1), BM, GB)
    off, mask, cols = _group_offsets(row, grp, M, K)
    g = tl.load(g_ptr + row.to(tl.int64)[:, None] * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row.to(tl.int64)[:, None] * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    if FAST_SILU:
        h = tl.fdiv(g, 1.0 + tl.exp(-g), ieee_rounding=False) * u
    else:
        h = tl.div_rn(g, 1.0 + tl.exp(-g)) * u
    if STORE_HP:
        tl.store(hp_ptr + off, h, mask=mask)
    _quant_groups(h, row, grp, M, K, n_groups, out_ptr, scale_ptr, FAST, MX)


# --------------------------------------------------------------------- wrappers
def _check_device(x: torch.Tensor, name: str) -> None:
    """The Triton quant kernels run on CUDA tensors (CPU tensors only under TRITON_INTERPRET=1)."""
    if not kernel_device_ok(x):
        raise ValueError(f"{name}: the Triton quant kernels need CUDA tensors (got device {x.device})")


def _launch_shape(x: torch.Tensor, name: str = "x") -> tuple[int, int, int]:
    """(rows, K, groups) for a contiguous (..., K) CUDA tensor (CPU under TRITON_INTERPRET=1)."""
    _check_device(x, name)
    if not x.is_contiguous() or x.dim() < 1:
        raise ValueError(f"{name}: needs a contiguous (..., K) tensor, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}; call .contiguous() first")
    k = x.shape[-1]
    return x.numel() // max(k, 1), k, triton.cdiv(k, GROUP)


def fast_division(x: torch.Tensor, options: KernelOptions = DEFAULT_OPTIONS) -> bool:
    """Whether the quant kernels may take the fast path (`_quant_groups_fast`, same bits): on NVIDIA CUDA (it
    uses inline PTX), unless `options.fast_division` is off (IEEE division only; recorded by
    `Engine.kernel_settings`); never under the CPU interpreter, whose fma rounds twice, nor on a ROCm build
    (where `is_cuda` is also true)."""
    return options.fast_division and x.is_cuda and torch.version.hip is None


def _pow2_knob(name: str, v: int, hi: int) -> int:
    """Validate a power-of-two tiling knob in [1, hi]."""
    if not (isinstance(v, int) and 1 <= v <= hi and v & (v - 1) == 0):
        raise ValueError(f"{name}={v!r}: use a power of two between 1 and {hi}")
    return v


def _default_bm(bm: int, rows: int) -> int:
    """The default rows per program, capped at the call's rows rounded up to a power of two: a decode step's
    single row in a 16- or 32-row tile wastes the masked rows' work (docs/design/performance.md#quantization-kernels).
    Tilings never change act_quant / SwiGLU bits."""
    return min(bm, triton.next_power_of_2(max(rows, 1)))


def _row_view(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) as (rows, K) with contiguous columns: a view where the leading dims collapse to one row stride
    (a column slice of a wider GEMM output, e.g. the gate or up half of a stacked gate/up GEMM), a copy otherwise."""
    if x.dim() < 1:
        raise ValueError("needs a (..., K) tensor, got a 0-d tensor")
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 or x2.shape[-1] <= 1 else x2.contiguous()


QUANT_FORMATS = ("e4m3:1x128", "mxfp8")  # what the kernels write (`fmt`)


def _mx_fmt(fmt: str, name: str) -> bool:
    """True for fmt "mxfp8", False for "e4m3:1x128"; anything else is an error naming the call."""
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"{name}: fmt {fmt!r}: the quant kernels write one of {QUANT_FORMATS}")
    return fmt == "mxfp8"


def _outputs(x: torch.Tensor, rows: int, k: int, groups: int, return_hp: bool, mx: bool = False):
    """Allocate FP8 data, scales (one per 1x128 group, or per 1x32 block for MX) and (optionally) the fp32
    pre-quant buffer."""
    out = torch.empty(x.shape, device=x.device, dtype=torch.float8_e4m3fn)
    scales = torch.empty((*x.shape[:-1], triton.cdiv(k, 32) if mx else groups), device=x.device,
                         dtype=torch.float32)
    hp = torch.empty(x.shape, device=x.device, dtype=torch.float32) if return_hp else out
    return out, scales, hp


# Tiling defaults, picked by benchmarks/tune_kernels.py on 16384 x 7168 bf16. Evidence:
# docs/design/performance.md#quantization-kernels (benchmarks/results/h200-2026-11-30/bench_quant_kernels.txt).
ACT_QUANT_DEFAULTS = dict(bm=32, gb=1, num_warps=4)
SWIGLU_DEFAULTS = dict(bm=16, gb=1, num_warps=4, fast_silu=True)
# RMSNorm: "chunked" = _rmsnorm_quant_kernel (bm rows, gb groups per step, two passes unless gb*128 >= K),
# "persistent" = _rmsnorm_quant_persistent_kernel (programs_per_sm programs per SM, one pass, pipelined).
# Rows of 33..128 groups default to persistent (faster than chunked two-pass: same evidence as the tilings above);
# wider rows and mode="chunked" take the chunked knobs.
RMSNORM_DEFAULTS = dict(mode="persistent", num_warps=8, num_stages=3, programs_per_sm=2)
RMSNORM_CHUNKED_DEFAULTS = dict(bm=1, gb=8, num_warps=4, num_stages=2)
SMALL_ROW_GROUPS = 32  # rows of <= 32 groups (K <= 4096) default to the one-pass whole-row tile (see rmsnorm_quant)
ROW_KERNEL_MAX_GROUPS = 128  # one-pass kernels hold at most 128 groups (16384 columns) per row in registers


def act_quant(x: torch.Tensor, *, fmt: str = "e4m3:1x128", bm: int | None = None, gb: int | None = None,
              num_warps: int | None = None,
              options: KernelOptions = DEFAULT_OPTIONS) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 1x128 quantization of x (..., K): (data (..., K) fp8, scales (..., ceil(K/128)) fp32); fmt="mxfp8":
    MXFP8, scales (..., ceil(K/32)) (E8M0 values as fp32).

    Tiling knobs (same bits for every value): `bm` rows x `gb` groups per program, `num_warps`;
    None takes `ACT_QUANT_DEFAULTS`. `options`: the backend's kernel variants (PDL, fast division; every wrapper
    of this file takes it). Reference: `act_quant_reference`."""
    mx = _mx_fmt(fmt, "act_quant")
    rows, k, groups = _launch_shape(x)
    bm = _pow2_knob("bm", _default_bm(ACT_QUANT_DEFAULTS["bm"], rows) if bm is None else bm, 256)
    gb = _pow2_knob("gb", ACT_QUANT_DEFAULTS["gb"] if gb is None else gb, 64)
    out, scales, _ = _outputs(x, rows, k, groups, False, mx)
    if rows == 0 or k == 0:
        return out, scales
    _act_quant_kernel[(triton.cdiv(rows, bm), triton.cdiv(groups, gb))](
        x, out, scales, rows, k, groups, BM=bm, GB=gb, FAST=fast_division(x, options) and not mx, MX=mx,
        num_warps=num_warps or ACT_QUANT_DEFAULTS["num_warps"], **launch_opts(x, options.pdl))
    return out, scales


def act_quant_reference(x: torch.Tensor, fmt: str = "e4m3:1x128") -> tuple[torch.Tensor, torch.Tensor]:
    """The formats library's quantization to fmt ("e4m3:1x128" or "mxfp8"), the bits every kernel must
    reproduce."""
    from engine.formats import quantize

    _mx_fmt(fmt, "act_quant_reference")
    q = quantize(x.float(), fmt)
    return q.data, q.scale


def rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, return_hp: bool = False,
                  single_pass: bool | None = None, *, mode: str | None = None, bm: int | None = None,
                  gb: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                  programs_per_sm: int | None = None, fmt: str = "e4m3:1x128",
                  options: KernelOptions = DEFAULT_OPTIONS):
    """Fused RMSNorm -> E4M3 1x128 quant of x (..., K) with weight (K,): (data, scales[, fp32 normed (..., K)]);
    fmt="mxfp8": MXFP8 (see `act_quant`).

    Kernels (knob None -> `RMSNORM_DEFAULTS` (persistent) for rows of up to `ROW_KERNEL_MAX_GROUPS` groups,
    `RMSNORM_CHUNKED_DEFAULTS` for wider rows and mode="chunked"; except rows of at most `SMALL_ROW_GROUPS`
    groups, which default to the one-pass whole-row tile: one memory round trip instead of a serial chunk
    loop, which is what a decode step's single row waits on. The choice depends on K only, so a row's bits
    never depend on how many rows share the call):

    * mode="chunked": `bm` rows per program in steps of `gb` groups; one pass when gb*128 >= K, else
      two passes whose second read hits L1/L2; `num_stages` pipelines the chunk loops.
    * mode="persistent": `programs_per_sm` programs per SM loop over whole rows (one pass), the loop
      pipelined `num_stages` deep; K <= 16384.

    `single_pass=True` is the one-row-per-program one-pass kernel (chunked, bm=1, gb >= groups);
    `single_pass=False` the chunked two-pass kernel with the given / default tiling.
    """
    mx = _mx_fmt(fmt, "rmsnorm_quant")
    rows, k, groups = _launch_shape(x)
    _check_norm_weight(x, weight, k)
    out, scales, hp = _outputs(x, rows, k, groups, return_hp, mx)
    _launch_rmsnorm(x, weight.contiguous(), out, scales, hp, None, None, rows, k, groups, eps, return_hp, False,
                    single_pass, mode, bm, gb, num_warps, num_stages, programs_per_sm, mx, options)
    return (out, scales, hp) if return_hp else (out, scales)


def add_rmsnorm_quant(x: torch.Tensor, res: torch.Tensor, weight: torch.Tensor, eps: float,
                      round_bf16: bool = True, fmt: str = "e4m3:1x128", options: KernelOptions = DEFAULT_OPTIONS,
                      **tiling):
    """Residual add + RMSNorm + E4M3 1x128 (fmt="mxfp8": MXFP8) quant in one pass: r = x + res (fp32 add, rounded
    to bf16 and held in fp32 with `round_bf16`), then the fused RMSNorm -> quant of r.

    x, res: (..., K) contiguous fp32 / bf16, same shape. Returns (r fp32 (..., K), data, scales, normed fp32
    (..., K)); the norm's bits are `rmsnorm_quant(r, weight, eps, return_hp=True)`'s with the same tiling
    (`tiling`: its keyword knobs). Reference: `add_rmsnorm_quant_reference`."""
    rows, k, groups = _launch_shape(x)
    if res.shape != x.shape or not res.is_contiguous() or res.device != x.device:
        raise ValueError(f"add_rmsnorm_quant: res must be a contiguous tensor of x's shape {tuple(x.shape)} on "
                         f"{x.device}, got {tuple(res.shape)} on {res.device}")
    _check_norm_weight(x, weight, k)
    mx = _mx_fmt(fmt, "add_rmsnorm_quant")
    out, scales, hp = _outputs(x, rows, k, groups, True, mx)
    r = torch.empty(x.shape, device=x.device, dtype=torch.float32)
    _launch_rmsnorm(x, weight.contiguous(), out, scales, hp, res, r, rows, k, groups, eps, True, round_bf16,
                    tiling.get("single_pass"), tiling.get("mode"), tiling.get("bm"), tiling.get("gb"),
                    tiling.get("num_warps"), tiling.get("num_stages"), tiling.get("programs_per_sm"), mx, options)
    return r, out, scales, hp


def _check_norm_weight(x: torch.Tensor, weight: torch.Tensor, k: int) -> None:
    """The norm weight is (K,) on x's device."""
    if weight.shape != (k,) or weight.device != x.device:
        raise ValueError(f"weight must be ({k},) on {x.device} for x {tuple(x.shape)}, got "
                         f"{tuple(weight.shape)} on {weight.device}")


def _launch_rmsnorm(x, w, out, scales, hp, res, rout, rows, k, groups, eps, return_hp, round_bf16,
                    single_pass, mode, bm, gb, num_warps, num_stages, programs_per_sm, mx=False,
                    options: KernelOptions = DEFAULT_OPTIONS) -> None:
    """Resolve the RMSNorm tiling (see `rmsnorm_quant`) and launch; `res` not None adds the residual; `mx`:
    MXFP8."""
    d, c = RMSNORM_DEFAULTS, RMSNORM_CHUNKED_DEFAULTS
    small = (groups <= SMALL_ROW_GROUPS and single_pass is None and mode is None and bm is None and gb is None)
    if small:  # 16 warps: the single row's loads, reduction and stores spread over more threads (latency-bound;
        # docs/design/performance.md#quantization-kernels)
        mode, bm, gb = "chunked", 1, triton.next_power_of_2(groups)
        num_warps = num_warps or 16
    if single_pass is not None:  # the two historical kernels, expressed in the chunked kernel's knobs
        mode = "chunked"
    if mode is None:  # a chunk knob given alone asks for the chunked kernel
        chunk_knobs = bm is not None or gb is not None
        mode = d["mode"] if groups <= ROW_KERNEL_MAX_GROUPS and not chunk_knobs else "chunked"
    knobs = d if mode == "persistent" else c
    bm = _pow2_knob("bm", c["bm"] if bm is None else bm, 64)
    gb = _pow2_knob("gb", c["gb"] if gb is None else gb, 128)
    stages = knobs["num_stages"] if num_stages is None else num_stages
    warps = num_warps or knobs["num_warps"]
    if single_pass:
        bm, gb = 1, triton.next_power_of_2(groups)
    elif single_pass is False and gb >= groups:
        gb = max(1, triton.next_power_of_2(groups) // 2)
    one_pass = mode == "persistent" or gb * GROUP >= k
    if one_pass and groups > ROW_KERNEL_MAX_GROUPS:
        raise ValueError(f"rmsnorm_quant: one-pass tiling of rows of {k} columns exceeds "
                         f"{ROW_KERNEL_MAX_GROUPS * GROUP}; use mode='chunked' with gb*128 < K")
    if not (rows and k):
        return
    if mode == "persistent":
        progs = max(1, min(rows, (programs_per_sm or d["programs_per_sm"]) * sm_count(x.device)))
        _rmsnorm_quant_persistent_kernel[(progs,)](
            x, w, out, scales, hp, res if res is not None else x, rout if rout is not None else hp, rows, k, groups,
            eps, G=triton.next_power_of_2(groups), STAGES=stages, STORE_HP=return_hp, HAS_RES=res is not None,
            RES_BF16=round_bf16, FAST=fast_division(x, options) and not mx, MX=mx, num_warps=warps,
            **launch_opts(x, options.pdl))
    elif mode == "chunked":
        _rmsnorm_quant_kernel[(triton.cdiv(rows, bm),)](
            x, w, out, scales, hp, res if res is not None else x, rout if rout is not None else hp, rows, k, groups,
            eps, BM=bm, GB=gb, ONE_PASS=one_pass, STAGES=stages, STORE_HP=return_hp, HAS_RES=res is not None,
            RES_BF16=round_bf16, FAST=fast_division(x, options) and not mx, MX=mx, num_warps=warps,
            **launch_opts(x, options.pdl))
    else:
        raise ValueError(f"rmsnorm_quant: mode {mode!r}: use 'chunked' or 'persistent'")


def add_rmsnorm_quant_reference(x: torch.Tensor, res: torch.Tensor, weight: torch.Tensor, eps: float,
                                round_bf16: bool = True, fmt: str = "e4m3:1x128"):
    """Torch: r = x + res (fp32; `.to(bfloat16).float()` with round_bf16), then `rmsnorm_quant_reference(r)`."""
    r = x.float() + res.float()
    if round_bf16:
        r = r.to(torch.bfloat16).float()
    d, s, h = rmsnorm_quant_reference(r, weight, eps, fmt)
    return r, d, s, h


def rmsnorm_quant_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, fmt: str = "e4m3:1x128"):
    """Torch RMSNorm (the engine's fp32 `Numerics.rmsnorm` math) then the library quantizer (fmt)."""
    h = x.float()
    h = weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))
    d, s = act_quant_reference(h, fmt)
    return d, s, h


def swiglu_quant(gate: torch.Tensor, up: torch.Tensor, return_hp: bool = False, bm: int | None = None,
                 num_warps: int | None = None, *, gb: int | None = None, fast_silu: bool | None = None,
                 fmt: str = "e4m3:1x128", options: KernelOptions = DEFAULT_OPTIONS):
    """Fused SwiGLU (silu(gate) * up) of gate, up (..., K) -> E4M3 1x128 quant: (data, scales[, fp32 activation]);
    fmt="mxfp8": MXFP8 (see `act_quant`).

    gate and up may be views whose rows are strided and whose columns are contiguous, such as the two column halves
    of a stacked gate/up GEMM output: the kernel reads them in place (other layouts are copied first).
    Tiling knobs (same bits for every value): `bm` rows x `gb` groups per program, `num_warps`.
    `fast_silu` picks the approximate silu division (see `_swiglu_quant_kernel`). None -> `SWIGLU_DEFAULTS`."""
    if gate.shape != up.shape or gate.device != up.device:
        raise ValueError(f"swiglu_quant: gate {tuple(gate.shape)} on {gate.device} and up {tuple(up.shape)} on "
                         f"{up.device} must have one shape and device")
    _check_device(gate, "gate")
    mx = _mx_fmt(fmt, "swiglu_quant")
    g2, u2 = _row_view(gate), _row_view(up)  # (rows, K), columns contiguous
    rows, k = g2.shape
    groups = triton.cdiv(k, GROUP)
    d = SWIGLU_DEFAULTS
    bm = _pow2_knob("bm", _default_bm(d["bm"], rows) if bm is None else bm, 256)
    gb = _pow2_knob("gb", d["gb"] if gb is None else gb, 64)
    out, scales, hp = _outputs(gate, rows, k, groups, return_hp, mx)
    if rows and k:
        _swiglu_quant_kernel[(triton.cdiv(rows, bm), triton.cdiv(groups, gb))](
            g2, u2, out, scales, hp, rows, k, groups, g2.stride(0), u2.stride(0), BM=bm, GB=gb,
            FAST_SILU=d["fast_silu"] if fast_silu is None else fast_silu, STORE_HP=return_hp,
            FAST=fast_division(gate, options) and not mx, MX=mx, num_warps=num_warps or d["num_warps"],
            **launch_opts(gate, options.pdl))
    return (out, scales, hp) if return_hp else (out, scales)


def swiglu_quant_reference(gate: torch.Tensor, up: torch.Tensor, fmt: str = "e4m3:1x128"):
    """Torch SwiGLU (the engine's `F.silu(g) * u`) then the library quantizer (fmt)."""
    h = torch.nn.functional.silu(gate.float()) * up.float()
    d, s = act_quant_reference(h, fmt)
    return d, s, h
