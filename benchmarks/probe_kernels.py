"""Kernel-variant probes on the H200: each prints achieved vs the copy ceiling of the same run.

    python benchmarks/probe_kernels.py [--only gemm,attn,prefill,gemv,...] [--flush dirty|clean]

* gemm: the decode FP8 block GEMM at M = 1 / 16 on the Llama-3-8B decode shapes and the issue's three shapes:
  the production kernel (`fp8_block_linear`) vs a variant that streams the weight through a TMA tensor
  descriptor (`_tma_probe_kernel`, split-K partials summed by torch: its time excludes that reduce and is a
  lower bound for an integrated version).
* attn: paged FP8 decode attention (8 x 32K): token-major vs dimension-major V pages over tiles, warps, stages,
  splits and register caps (errors vs the fp32 reference, bitwise equality with the token-layout default).
* prefetch: the M = 1 GEMV's L2 prefetch bytes per row, with and without programmatic dependent launch.
* rms: RMSNorm+quant (persistent) with the fast division's check on / off, IEEE division, weight held or
  reloaded, over warps / programs per SM / stages.
* decode_small_m / gemv_knobs: the production decode kernels' knobs at M = 4, 16 (split-K MMA) and M = 1 (GEMV)
  on the issue's three shapes (use --flush clean: the state a decode step finds).
* rms_tma: RMSNorm+quant with rows loaded by TMA descriptors and with capped registers (3 programs per SM).
* gemv_graph: the M = 1 decode GEMMs back to back in a CUDA graph, PDL on / off, L2 prefetch on / off.
* attn_short: paged FP8 decode attention at 140-token contexts (the e2e benchmark's), batch 1 and 8, both V page
  layouts over warps / stages / splits, per launch in a CUDA graph.
* pdl_ab: big-shape quant and decode-attention kernels with and without PDL launches.
* small: single-row (decode) latency of the quantizing kernels in a CUDA graph; SwiGLU quantization variants.
* prefill: cuBLAS blockwise 8192^3 through `scaled_mm_blockwise` (scales padded per call) vs `F.scaled_mm`
  on scales padded once, on benchmark-style saturated operands and on small-magnitude (randn) operands.
* gemm_gps / gemm_narrow (4096x14336 at M = 4 / 16): the split-K kernel walking 1-4 groups per
  pipeline step with plain or TMA weight loads (`_gps_probe_kernel`, production's bits); narrow MMA tiles;
  the GEMV generalized to 4 activation rows (`_gemv_m_probe_kernel`).
* rms_warp / rms_parts / rms_occupancy (RMSNorm+quant 16384 x 7168): 1-2 warps per row in two
  chunked passes; rows as 32 + 16 + 8 group tiles (`_rms_parts_probe_kernel`); 16 / 32 warps per row with
  registers capped for 2 programs per SM.
* gemm_floor / gemm_timeline / gemm_carveout / gemm_tail / gemm_nosplit / gemm_noswap (4096x14336):
  what one decode call can reach (the fixed cost of a timed call, the fastest read of the weight's bytes, the
  split-K access pattern without MMA on row-major and tiled weights); per-program start / end times from
  %globaltimer; time outside the programs vs shared memory and carveout; the split-K reduce's cost and its
  handshake variants (`_gps_probe_kernel` REDUCE modes); no split-K (narrow tiles, the activation on the wgmma M
  side).
* gemm_cluster / gemm_cluster_launch / gemm_reduce_timeline / attn_short64: the split-K decode GEMM
  with each tile's splits in one thread-block cluster, reduced through distributed shared memory, vs the fused
  reduce through global memory; the cost of a cluster launch itself (empty kernel, the split-K loop alone in
  clusters) and both reduces in CUDA graphs; per-program timeline of the fused reduce (`_gps_probe_kernel`
  TIMES); paged FP8 decode attention at batch 64 x 140 tokens over warps / stages / splits / block_n.
* gemm_early / decode_graph / split_rule / split_ab: split-K with a fixed reducer and no handshake
  (`_early_reduce_probe_kernel`); the Llama-3-8B decode GEMMs at M = 8 / 64 in CUDA graphs over every knob (writes
  DECODE_CONFIGS entries as JSON for bench_e2e.py --decode-configs); split counts vs tile height over 21 shapes;
  2 vs 4 splits on long-K shapes.
* gemm_wholek / gemm_wholek_rotate: the decode GEMM with no split-K through the whole-K Gluon wgmma
  kernel (`whole_k=True`, engine/kernels/gemm_wgmma.py) over rows per program, groups per stage and stages, vs
  production and bf16 cuBLAS (bits vs `split_k=1`, CUDA-graph times of the best config); its K walk rotated per
  program vs aligned (gemm_wholek_ws: also warp-specialized, a producer warp for the TMA loads).
* gemm_wgsplit / wgmma_sweep / wgmma_timeline: the Gluon kernel with K splits and the activation on
  the wgmma's N side (`launch(splits=S, swap=True)`): bits vs split-K, one call and CUDA graph; the sweep behind the
  BM-16 `wgmma` entries; per-program timelines.
* reduce_burst / wgmma_sweep32: the fused split-K reduce loading four partials per L2 round trip
  (`gemm.REDUCE_BURST` 4 vs 1) on the production dispatch, one call and CUDA graph, bits compared; the wgmma sweep
  at BM 32 (M = 24 / 32).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_gemm import DECODE_SHAPES, fingerprint, fp8_block_operands, graph_us  # noqa: E402
from benchmarks.bench_gemm import time_us as _time_us  # noqa: E402
from engine.kernels.gemm import _gemv_rows, _scaled_steps, _split_k_tile  # noqa: E402
from engine.kernels.pdl import pdl_enter  # noqa: E402
from engine.kernels.quant import (_div_by_scale, _fast_domain, _group_offsets, _quant_groups,  # noqa: E402
                                  _quant_groups_fast, _rstd, _tile_rows)

DEV = "cuda"
FLUSH = "dirty"  # --flush


def time_us(fn, **kw) -> float:
    """`bench_gemm.time_us` with the probe run's --flush."""
    return _time_us(fn, flush=FLUSH, **kw)


@triton.jit
def _tma_probe_kernel(w_desc, w_ptr, x_ptr, xs_ptr, ws_ptr, out_ptr, M, N, K, groups_per_split,
                      stride_xm, stride_xsm, stride_wsn, BM: tl.constexpr, BN: tl.constexpr, KSUB: tl.constexpr,
                      USE_TMA: tl.constexpr):
    """Grid (N tiles, splits): out[s] (M, N) = partial x @ w^T over the split's 128-groups, KSUB adjacent
    groups per loop step (KSUB*128 contiguous bytes of each weight row in flight), W through a TMA descriptor
    or plain loads; each group's dot is scaled and promoted to fp32 separately (same numerics)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    offs_k = tl.arange(0, 128)
    m_ok = offs_m < M
    g0 = pid_s * groups_per_split
    g1 = tl.minimum(g0 + groups_per_split, tl.cdiv(K, 128))
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for gg in range(g0, g1, KSUB):
        for j in tl.static_range(KSUB):
            g = gg + j
            if USE_TMA:
                w = w_desc.load([pid_n * BN, g * 128])
            else:
                w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * K + (g * 128 + offs_k)[None, :],
                            mask=(offs_n < N)[:, None], other=0.0)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (g * 128 + offs_k)[None, :], mask=m_ok[:, None],
                        other=0.0)
            ws = tl.load(ws_ptr + ((pid_n * BN) // 128) * stride_wsn + g)
            xs = tl.load(xs_ptr + offs_m * stride_xsm + g, mask=m_ok, other=0.0)
            acc += tl.dot(w, tl.trans(x)) * (xs[None, :] * ws)
    idx = pid_s * M * N + offs_m[None, :] * N + offs_n[:, None]
    tl.store(out_ptr + idx, acc, mask=(offs_n[:, None] < N) & m_ok[None, :])


def tma_gemm(xd, xs, wd, ws, bn=64, splits=1, warps=4, stages=4, ksub=1, tma=True):
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = xd.shape
    n = wd.shape[0]
    desc = TensorDescriptor.from_tensor(wd, [bn, 128]) if tma else None
    kb = -(-k // 128)
    per = -(-kb // splits)
    if per % ksub:
        raise ValueError(f"{per} groups per split is not a multiple of ksub {ksub}")
    part = torch.empty((splits, m, n), device=xd.device, dtype=torch.float32)
    _tma_probe_kernel[(-(-n // bn), splits)](desc, wd, xd, xs, ws, part, m, n, k, per, xd.stride(0), xs.stride(0),
                                             ws.stride(0), BM=max(16, triton.next_power_of_2(m)), BN=bn, KSUB=ksub,
                                             USE_TMA=tma, num_warps=warps, num_stages=stages)
    return part


def _sweep_one(res: list, cfg: dict, run, ref: torch.Tensor, quiet: str = "") -> None:
    """Run one config: rel error of run() (summed over split partials when 3-D) vs ref, and its time; appended to
    res as (us, cfg, err), or a FAILED line (unless the error message contains `quiet`)."""
    try:
        out = run()
        out = out.sum(0) if out.dim() == 3 or (out.dim() == 2 and ref.dim() == 1) else out
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        t = time_us(run, reps=30)
    except Exception as exc:  # noqa: BLE001 -- a probe: report and go on
        if not quiet or quiet not in str(exc):
            print(f"    {cfg} FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:150]}")
        return
    res.append((t, cfg, err))


def _top(res: list, wbytes: float, copy_tbs: float, against: str, n: int = 6) -> None:
    """Print the n fastest configs of a sweep (sorted in place)."""
    res.sort(key=lambda r: r[0])
    for t, cfg, err in res[:n]:
        print(f"      {t:6.1f} us {wbytes / t / 1e6:5.2f} TB/s ({100 * wbytes / t / 1e6 / copy_tbs:.0f}% copy) {cfg} "
              f"rel err vs {against} {err:.1e}", flush=True)


def probe_gemm(copy_tbs: float) -> None:
    from engine.kernels import gemm as G

    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (7168, 16384)]
    print("\n## decode GEMM: production kernel vs TMA-descriptor weight stream (us, TB/s of weight bytes)")
    for n, k in shapes:
        for m in (1, 16):
            xd, xs, wd, ws = fp8_block_operands(m, n, k)
            wbytes = n * k
            ref = G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32)
            t0 = time_us(lambda: G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32))
            line = f"  {n:5d}x{k:<5d} M={m:<2d} prod {t0:6.1f} us {wbytes / t0 / 1e6:5.2f} TB/s |"
            print(line, flush=True)
            if m != 1:
                continue
            res = []
            for tma in (True, False):
                for bn in (16, 32, 64):
                    for ksub in (1, 2, 4, 8):
                        for splits in (1, 2, 4, 8):
                            for warps, stages in ((4, 3), (4, 4)):
                                if (k // 128 // splits) % ksub or (n // bn) * splits > 8 * 132 \
                                        or (n // bn) * splits < 132:
                                    continue
                                cfg = dict(bn=bn, splits=splits, warps=warps, stages=stages, ksub=ksub, tma=tma)
                                _sweep_one(res, cfg, lambda cfg=cfg: tma_gemm(xd, xs, wd, ws, **cfg), ref)
            _top(res, wbytes, copy_tbs, "production")
            for ks in (1, 2, 4, 8):
                b = [r for r in res if r[1]["ksub"] == ks]
                if b:
                    print(f"      best ksub={ks}: {b[0][0]:6.1f} us {b[0][1]}")
            print(flush=True)


@triton.jit
def _gemv_probe_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, N, K, groups_per_split, stride_wn, stride_wsn,
                       BN: tl.constexpr, GK: tl.constexpr, STAGES: tl.constexpr):
    """M = 1 on CUDA cores, grid (N / BN, splits): each step loads a (BN, GK*128) FP8 weight tile straight into
    registers (16-byte vectors, no shared memory, no MMA), multiplies by x in fp32 (exact E4M3 products),
    sums each 128-group in fp32, scales it by w_scale * x_scale and accumulates (the block-scaled math)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    offs = tl.arange(0, GK * 128)
    g0 = pid_s * groups_per_split
    g1 = tl.minimum(g0 + groups_per_split, tl.cdiv(K, 128))
    ws_row = ws_ptr + ((pid_n * BN) // 128) * stride_wsn
    acc = tl.zeros((BN,), dtype=tl.float32)
    for gg in tl.range(g0, g1, GK, num_stages=STAGES):
        k = gg * 128 + offs
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_wn + k[None, :]).to(tl.float32)
        x = tl.load(x_ptr + k).to(tl.float32)
        part = tl.sum(tl.reshape(w * x[None, :], (BN, GK, 128)), axis=2)  # (BN, GK) group dots
        gi = gg + tl.arange(0, GK)
        sc = tl.load(ws_row + gi) * tl.load(xs_ptr + gi)
        acc += tl.sum(part * sc[None, :], axis=1)
    tl.store(out_ptr + pid_s * N + rows, acc)


def gemv(xd, xs, wd, ws, bn=8, gk=4, splits=1, warps=4, stages=2):
    n, k = wd.shape
    kb = k // 128
    per = kb // splits
    if per % gk or n % bn or kb % splits:
        raise ValueError("shape")
    part = torch.empty((splits, n), device=xd.device, dtype=torch.float32)
    _gemv_probe_kernel[(n // bn, splits)](xd, xs, wd, ws, part, n, k, per, wd.stride(0), ws.stride(0),
                                          BN=bn, GK=gk, STAGES=stages, num_warps=warps)
    return part


def probe_gemv(copy_tbs: float, shapes=((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                                        (7168, 16384))) -> None:
    from engine.kernels import gemm as G

    print("\n## M = 1 GEMV on CUDA cores (split partials summed outside the timing when splits > 1)")
    for n, k in shapes:
        xd, xs, wd, ws = fp8_block_operands(1, n, k)
        ref = G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32)[0]
        t0 = time_us(lambda: G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32), reps=30)
        res = []
        for bn in (2, 4, 8, 16, 32):
            for gk in (1, 2, 4, 8):
                for splits in (1, 2, 4, 8):
                    ctas = n // bn * splits
                    if ctas < 256 or ctas > 8192 or bn * gk * 128 > 16384 or bn * gk * 128 < 1024:
                        continue
                    for warps, stages in ((4, 1), (4, 2), (4, 3), (8, 2)):
                        cfg = dict(bn=bn, gk=gk, splits=splits, warps=warps, stages=stages)
                        _sweep_one(res, cfg, lambda cfg=cfg: gemv(xd, xs, wd, ws, **cfg), ref, quiet="shape")
        print(f"  {n}x{k}: production {t0:6.1f} us {n * k / t0 / 1e6:5.2f} TB/s", flush=True)
        _top(res, n * k, copy_tbs, "production")
        one = [r for r in res if r[1]["splits"] == 1]
        if one:
            print(f"      best with 1 split (no reduce): {one[0][0]:6.1f} us {one[0][1]}")


def probe_decode_tune(copy_tbs: float, shapes=((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))) -> None:
    """The production decode kernel (`fp8_block_gemm_triton`, fused split-K reduce included) over tiles, splits
    and pipeline depths on the Llama-3-8B decode shapes at M = 1; prints DECODE_CONFIGS-style winners."""
    from engine.kernels import gemm as G

    print("\n## decode GEMM knob sweep, production kernel, M = 1 (us, TB/s of weight bytes)")
    for n, k in shapes:
        xd, xs, wd, ws = fp8_block_operands(1, n, k)
        ref = G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32)
        t0 = time_us(lambda: G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32), reps=30)
        res = []
        for bn in (16, 32, 64, 128):
            for split in (1, 2, 4, 8):
                ctas = -(-n // bn) * split
                if ctas < 100 or ctas > 1200:
                    continue
                for warps, stages in ((4, 3), (4, 4), (4, 6), (4, 8), (8, 4)):
                    if bn == 128 and stages > 4 or bn < 64 and warps == 8:
                        continue
                    cfg = dict(split_k=split, block_n=bn, num_warps=warps, num_stages=stages, fused_reduce=True)
                    _sweep_one(res, cfg, lambda cfg=cfg: G.fp8_block_gemm_triton(
                        xd, xs, wd, ws, out_dtype=torch.float32, **cfg), ref)
        print(f"  {n}x{k}: default {t0:6.1f} us {n * k / t0 / 1e6:5.2f} TB/s", flush=True)
        _top(res, n * k, copy_tbs, "default")
        for bn in (16, 32, 64, 128):
            b = [r for r in res if r[1]["block_n"] == bn]
            if b:
                print(f"      best block_n={bn}: {b[0][0]:6.1f} us {b[0][1]}")


def _small_m_cases(shapes, ms):
    """The common setup of the small-M decode sweeps: for each (N, K) and M, yields (n, k, m, (xd, xs, wd, ws),
    weight bytes, bf16 cuBLAS us, production us, production's fp32 output)."""
    import torch.nn.functional as F

    from engine.kernels import gemm as G

    for n, k in shapes:
        _, _, wd, ws = fp8_block_operands(1, n, k, seed=n)
        w16 = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
        wbytes = wd.numel() + ws.numel() * 4
        for m in ms:
            xd, xs, _, _ = fp8_block_operands(m, 16, k, seed=m)
            x16 = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            t16 = time_us(lambda: F.linear(x16, w16), reps=30)
            ref = G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32)
            t0 = time_us(lambda: G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32), reps=30)
            yield n, k, m, (xd, xs, wd, ws), wbytes, t16, t0, ref
        del wd, ws, w16


def _case_line(n, k, m, t16, t0, wbytes, name="production"):
    """The header line of one small-M case: bf16 cuBLAS and production (or default) times."""
    print(f"  {n}x{k} M={m}: bf16 {t16:6.1f} us; {name} {t0:6.1f} us {wbytes / t0 / 1e6:5.2f} TB/s "
          f"{t16 / t0:4.2f}x bf16", flush=True)


def probe_decode_small_m(copy_tbs: float, shapes=tuple(DECODE_SHAPES), ms=(4, 16)) -> None:
    """The production split-K MMA decode kernel (`fp8_block_gemm_triton`, fused reduce) at M = 4 and 16 over
    block_n, splits and pipelines on the issue's shapes (us, TB/s of weight bytes, x bf16 cuBLAS), vs the default
    dispatch (`fp8_block_linear`)."""
    from engine.kernels import gemm as G

    print(f"\n## decode GEMM knob sweep at M = {ms}, production split-K kernel (flush {FLUSH})")
    for n, k, m, (xd, xs, wd, ws), wbytes, t16, t0, ref in _small_m_cases(shapes, ms):
        res = []
        for bn in (32, 64, 128):
            for split in (1, 2, 3, 4, 6, 8):
                for warps, stages in ((4, 3), (4, 4), (4, 5), (4, 6), (8, 4)):
                    if bn == 128 and stages > 4:
                        continue
                    cfg = dict(split_k=split, block_n=bn, num_warps=warps, num_stages=stages, fused_reduce=True)
                    _sweep_one(res, cfg, lambda cfg=cfg: G.fp8_block_gemm_triton(
                        xd, xs, wd, ws, out_dtype=torch.float32, **cfg), ref)
        _case_line(n, k, m, t16, t0, wbytes, "default")
        _top(res, wbytes, copy_tbs, "default", n=5)
        if res:
            print(f"      best: {t16 / res[0][0]:4.2f}x bf16")


def probe_gemv_knobs(copy_tbs: float, shapes=tuple(DECODE_SHAPES)) -> None:
    """The production M = 1 GEMV (`_launch_gemv`, prefetch and PDL as in production) over rows per program, groups
    per step, pipeline depth and warps (us, TB/s of weight bytes)."""
    from engine.kernels import gemm as G

    print(f"\n## M = 1 GEMV knob sweep, production kernel (flush {FLUSH})")
    for n, k in shapes:
        xd, xs, wd, ws = fp8_block_operands(1, n, k, seed=n)
        wbytes = wd.numel() + ws.numel() * 4
        ref = G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32)
        t0 = time_us(lambda: G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32), reps=30)
        res = []
        for bn in (4, 8, 16):
            for gk in (2, 4, 8):
                for warps, stages in ((4, 2), (4, 3), (4, 4), (4, 5), (2, 3), (8, 3)):
                    if bn * gk * 128 // (32 * warps) > 64:  # bytes of weight per thread per step
                        continue
                    cfg = dict(block_n=bn, groups=gk, num_stages=stages, num_warps=warps)

                    def run(cfg=cfg):
                        out = torch.empty((1, n), device=DEV, dtype=torch.float32)
                        G._launch_gemv(xd, xs, xs.stride(), wd, ws, ws.stride(), None, out, False, **cfg)
                        return out
                    _sweep_one(res, cfg, run, ref)
        print(f"  {n}x{k}: production {t0:6.1f} us {wbytes / t0 / 1e6:5.2f} TB/s", flush=True)
        _top(res, wbytes, copy_tbs, "production", n=6)
        del wd, ws


def probe_prefetch(copy_tbs: float, shapes=((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                                            (7168, 16384))) -> None:
    """The production M = 1 GEMV with 0 .. whole-row L2 prefetch per weight row (`GEMV_PREFETCH_BYTES`), launched
    with and without PDL (engine.kernels.pdl). Back-to-back launches: with PDL the next launch's prefetch
    overlaps the previous launch, as in a decode step. Outputs must not change (bit-compared)."""
    from engine.kernels import gemm as G
    from engine.kernels import pdl

    print("\n## M = 1 GEMV: L2 prefetch bytes per weight row x PDL (us, TB/s of weight bytes)")
    old = G.GEMV_PREFETCH_BYTES, pdl.enabled()
    try:
        for n, k in shapes:
            xd, xs, wd, ws = fp8_block_operands(1, n, k)
            G.GEMV_PREFETCH_BYTES, _ = 0, pdl.set_enabled(False)
            ref = G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32)
            cells = []
            for on in (False, True):
                pdl.set_enabled(on)
                for pf in (0, 1024, 2048, 4096, 8192, k):
                    G.GEMV_PREFETCH_BYTES = pf
                    out = G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32)
                    same = torch.equal(out, ref)
                    t = time_us(lambda: G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32), reps=50)
                    cells.append(f"{'pdl' if on else 'seq'} pf={pf}: {t:5.1f} us {n * k / t / 1e6:4.2f} TB/s"
                                 f"{'' if same else ' BITS DIFFER'}")
            print(f"  {n}x{k}:\n    " + "\n    ".join(cells), flush=True)
    finally:
        G.GEMV_PREFETCH_BYTES = old[0]
        pdl.set_enabled(old[1])


@triton.jit
def _max_nan(a, b):
    """max that propagates NaN (a reduction combine function)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _swiglu_probe_kernel(g_ptr, u_ptr, out_ptr, scale_ptr, hp_ptr, M, K, n_groups, BM: tl.constexpr,
                         MODE: tl.constexpr, PDL: tl.constexpr = False):
    """The SwiGLU+quant kernel's body (1 group per program column) with the quantization swapped by MODE:
    0 none (store the fp32 activation), 1 the production `_quant_groups`, 2 one NaN-propagating amax reduction
    instead of amax + NaN count + NaN sum, 3 production on a tile whose masked-out elements are 1.0, not 0.0."""
    pdl_enter(PDL)
    row, grp = _tile_rows(tl.program_id(0), tl.program_id(1), BM, 1)
    off, mask, _ = _group_offsets(row, grp, M, K)
    g = tl.load(g_ptr + off, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + off, mask=mask, other=0.0).to(tl.float32)
    h = tl.fdiv(g, 1.0 + tl.exp(-g), ieee_rounding=False) * u
    if MODE == 0:
        tl.store(hp_ptr + off, h, mask=mask)
    elif MODE == 1:
        _quant_groups(h, row, grp, M, K, n_groups, out_ptr, scale_ptr)
    elif MODE == 3:  # masked-out rows divide 1.0 instead of 0.0 (they are not stored)
        _quant_groups(tl.where(mask, h, 1.0), row, grp, M, K, n_groups, out_ptr, scale_ptr)
    else:
        amax = tl.reduce(tl.abs(h), 1, _max_nan)
        scale = tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
        scale = tl.where(amax == 0.0, 1.0, scale)
        y = tl.div_rn(h, scale[:, None])
        tl.store(out_ptr + off, y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)
        tl.store(scale_ptr + row.to(tl.int64) * n_groups + grp, scale, mask=(row < M) & (grp < n_groups))


def _swiglu_probe(g, u, bm, mode, warps=4):
    from engine.kernels.pdl import launch_opts

    m, k = g.shape
    out = torch.empty(g.shape, device=g.device, dtype=torch.float8_e4m3fn)
    sc = torch.empty((m, k // 128), device=g.device, dtype=torch.float32)
    hp = torch.empty(g.shape, device=g.device, dtype=torch.float32) if mode == 0 else sc
    _swiglu_probe_kernel[(triton.cdiv(m, bm), k // 128)](g, u, out, sc, hp, m, k, k // 128, BM=bm, MODE=mode,
                                                          num_warps=warps, **launch_opts(g))
    return out, sc


def _probe_small_attention() -> None:
    """Batch-1 paged FP8 decode attention at a short context (136 tokens, 32 / 8 heads), as the runtime calls it
    (bf16 query, bf16-rounded E4M3 1x128 output), over tiles / splits / warps: us per launch in a CUDA graph."""
    from benchmarks.bench_attention import fill_cache
    from engine.kernels.paged_kv import PagedKVCache, paged_decode_attention

    ctx, h, hkv, dh, page = 136, 32, 8, 128, 64
    cache = PagedKVCache(1, 8, page, hkv, dh, dtype=torch.float8_e4m3fn, max_seqs=1, device=DEV)
    fill_cache(cache, 1, ctx)
    q = torch.randn(1, h, 1, dh, device=DEV, dtype=torch.bfloat16)
    rows = dict(seq_ids=torch.zeros(1, dtype=torch.int32, device=DEV),
                seq_lens=torch.full((1,), ctx, dtype=torch.int32, device=DEV),
                q_pos=torch.full((1, 1), ctx - 1, dtype=torch.int32, device=DEV))  # as the runtime passes them
    print(f"\n## paged FP8 decode attention, batch 1 x {ctx} tokens (us per launch in a CUDA graph)")
    ref = None
    for cfg in [dict(), dict(block_n=128), dict(block_n=256), dict(block_n=32), dict(num_splits=2),
                dict(num_splits=3), dict(num_warps=8), dict(num_stages=2), dict(block_n=128, num_stages=2)]:
        def run(cfg=cfg):
            return paged_decode_attention(q, cache, 0, out_quant="e4m3:1x128", out_round="bf16", return_hp=True,
                                          **rows, **{"num_splits": 1, **cfg})
        try:
            hp = run()[2]
            ref = hp if ref is None else ref
            err = ((hp - ref).abs().max() / ref.abs().max()).item()
            print(f"  {str(cfg):40s} {graph_us(run):6.2f} us  rel diff vs default {err:.1e}", flush=True)
        except Exception as exc:  # noqa: BLE001 -- a probe: report and go on
            print(f"  {cfg}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:150]}")


def probe_attn_short(copy_tbs: float, batches=(1, 8), layouts=("token", "dim"),
                     tiles=((4, 5), (2, 5), (4, 3), (8, 3), (1, 3)), splits=(1, 2, 3), block_ns=(64,),
                     bf16: bool = False) -> None:
    """Paged FP8 decode attention at the e2e benchmark's short contexts (140 tokens of 192-token capacity, 32 / 8
    heads, pages of 64), called as the runtime calls it (bf16 query, bf16-rounded E4M3 1x128 output), over batches,
    V page layouts, (warps, stages), splits and block_n: us per launch in a CUDA graph, the default plan's row
    first, bits vs that row; bf16: a bf16 cache's default row too."""
    from benchmarks.bench_attention import fill_cache
    from engine.kernels.paged_kv import PagedKVCache, paged_decode_attention

    ctx, h, hkv, dh, page = 140, 32, 8, 128, 64
    print(f"\n## paged decode attention at {ctx} tokens (runtime call; us per launch in a CUDA graph)")
    for b in batches:
        caches = {}
        for layout in layouts + (("bf16",) if bf16 else ()):
            dtype = torch.bfloat16 if layout == "bf16" else torch.float8_e4m3fn
            caches[layout] = PagedKVCache(1, b * 3, page, hkv, dh, dtype=dtype, max_seqs=b, device=DEV,
                                          v_layout="dim" if layout == "bf16" else layout)
            fill_cache(caches[layout], b, ctx)
        q = torch.randn(b, h, 1, dh, device=DEV, dtype=torch.bfloat16)
        rows = dict(seq_ids=torch.arange(b, dtype=torch.int32, device=DEV),
                    seq_lens=torch.full((b,), ctx, dtype=torch.int32, device=DEV),
                    q_pos=torch.full((b, 1), ctx - 1, dtype=torch.int32, device=DEV))
        ref = None
        cases = [(layout, None, 64) for layout in caches]
        cases += [(layout, dict(num_warps=w, num_stages=st, num_splits=sp), bn) for layout in layouts
                  for w, st in tiles for sp in splits for bn in block_ns]
        for layout, kw, bn in cases:
            def run(kw=kw, layout=layout, bn=bn):
                return paged_decode_attention(q, caches[layout], 0, out_quant="e4m3:1x128", out_round="bf16",
                                              return_hp=True, block_n=bn, **rows, **(kw or {}))
            try:
                hp = run()[2]
                ref = hp if ref is None else ref
                err = ((hp - ref).abs().max() / ref.abs().max()).item()
                name = "default plan" if kw is None else f"w{kw['num_warps']} s{kw['num_stages']} splits={kw['num_splits']}"
                print(f"  b={b} {layout:5s} block_n={bn:3d} {name:24s}: {graph_us(run):6.2f} us  rel diff {err:.1e}",
                      flush=True)
            except Exception as exc:  # noqa: BLE001 -- a probe: report and go on
                print(f"  b={b} {layout} {kw} block_n={bn}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:150]}")


@triton.jit
def _rms_tma_probe_kernel(x_desc, o_desc, w_ptr, out_ptr, scale_ptr, M, K, n_groups, eps, G: tl.constexpr,
                          STAGES: tl.constexpr, STORE_TMA: tl.constexpr):
    """The persistent RMSNorm+quant's fast path with each row (G, 128) loaded by a TMA tensor descriptor (one
    bulk copy per row, no per-thread copies or addresses) and, with STORE_TMA, its FP8 data stored by one."""
    g = tl.arange(0, G)
    cols = g[:, None] * 128 + tl.arange(0, 128)[None, :]
    cmask = cols < K
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    smask = g < n_groups
    for row in tl.range(tl.program_id(0), M, tl.num_programs(0), num_stages=STAGES):
        x = tl.reshape(x_desc.load([row, 0, 0]), (G, 128)).to(tl.float32)
        h = w * (x * _rstd(tl.zeros((G,), tl.float32) + tl.sum(tl.sum(x * x, axis=1), axis=0), K, eps)[:, None])
        amax = tl.reduce(tl.abs(h), 1, _max_nan)
        scale = tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
        y = _div_by_scale(h, scale[:, None], tl.div_rn(tl.full(amax.shape, 1.0, tl.float32), scale)[:, None])
        q = y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        if STORE_TMA:
            o_desc.store([row, 0, 0], tl.reshape(q, (1, G, 128)))
        else:
            tl.store(out_ptr + tl.cast(row, tl.int64) * K + cols, q, mask=cmask)
        tl.store(scale_ptr + tl.cast(row, tl.int64) * n_groups + g, scale, mask=smask)


def _rms_report(label: str, run, ref, nbytes: int, reps: int = 30) -> None:
    """One RMSNorm+quant variant (run() -> (FP8 data, scales)): the share of FP8 bytes / scales differing from ref,
    TB/s after a dirty and a clean flush; a FAILED line instead when it raises."""
    try:
        d, sc = run()
        diff = (d.view(torch.uint8) != ref[0].view(torch.uint8)).float().mean().item()
        sdiff = (sc != ref[1]).float().mean().item()
        cells = [f"{fl} {nbytes / _time_us(run, reps=reps, flush=fl) / 1e6:5.2f}" for fl in ("dirty", "clean")]
        print(f"  {label}: {'  '.join(cells)}  FP8 bytes differing {diff:.1e}, scales {sdiff:.1e}", flush=True)
    except Exception as exc:  # noqa: BLE001 -- a probe: report and go on
        print(f"  {label}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:160]}", flush=True)


def probe_rms_tma(copy_tbs: float) -> None:
    """RMSNorm+quant 16384 x 7168 bf16: the production persistent kernel vs `_rms_tma_probe_kernel` (rows through
    TMA descriptors) over warps / programs per SM / stages; TB/s after a dirty and a clean flush; FP8 bits and
    scales vs production (the sum-of-squares order may differ with the register layout: a few last-bit rstd
    differences are expected, not more)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from engine.kernels import quant as Q
    from engine.kernels import sm_count

    m, k = 16384, 7168
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w = torch.rand(k, device=DEV) + 0.5
    ng, gp = k // 128, 64
    nbytes = x.numel() * 3 + m * ng * 4 + k * 4
    ref_d, ref_s = Q.rmsnorm_quant(x, w, 1e-5)
    print("\n## RMSNorm+quant 16384 x 7168: TMA row loads (TB/s dirty / clean L2; bits vs production)")
    for fl in ("dirty", "clean"):
        print(f"  production: {fl} {nbytes / _time_us(lambda: Q.rmsnorm_quant(x, w, 1e-5), reps=30, flush=fl) / 1e6:5.2f}")
    from engine.kernels.quant import _rmsnorm_quant_persistent_kernel as pers

    for maxr, pps, stages in ((84, 3, 3), (80, 3, 3), (84, 3, 2), (96, 2, 3)):  # production, registers capped
        out = torch.empty((m, k), device=DEV, dtype=torch.float8_e4m3fn)
        sc = torch.empty((m, ng), device=DEV, dtype=torch.float32)

        def run(maxr=maxr, pps=pps, stages=stages, out=out, sc=sc):
            pers[(min(m, pps * sm_count(x.device)),)](x, w, out, sc, out, x, out, m, k, ng, 1e-5, G=gp, STAGES=stages,
                                                      STORE_HP=False, FAST=True, num_warps=8, maxnreg=maxr)
        try:
            run()
            same = torch.equal(out.view(torch.uint8), ref_d.view(torch.uint8)) and torch.equal(sc, ref_s)
            cells = [f"{fl} {nbytes / _time_us(run, reps=30, flush=fl) / 1e6:5.2f}" for fl in ("dirty", "clean")]
            print(f"  production maxnreg={maxr} pps{pps} s{stages}: {'  '.join(cells)}  bits "
                  f"{'= production' if same else 'DIFFER'}", flush=True)
        except Exception as exc:  # noqa: BLE001 -- a probe: report and go on
            print(f"  production maxnreg={maxr}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    xd = TensorDescriptor(x, [m, ng, 128], [k, 128, 1], [1, gp, 128])
    for warps, pps, stages, st, maxr in ((8, 2, 4, False, None), (8, 3, 3, False, 84), (8, 3, 3, False, 80),
                                         (8, 3, 2, False, 84), (8, 3, 4, False, 84), (4, 5, 3, False, 96),
                                         (4, 6, 2, False, 80)):
        out = torch.empty((m, k), device=DEV, dtype=torch.float8_e4m3fn)
        sc = torch.empty((m, ng), device=DEV, dtype=torch.float32)
        od = TensorDescriptor(out, [m, ng, 128], [k, 128, 1], [1, gp, 128])
        grid = (min(m, pps * sm_count(x.device)),)

        def run(warps=warps, stages=stages, st=st, out=out, sc=sc, od=od, grid=grid, maxr=maxr):
            _rms_tma_probe_kernel[grid](xd, od, w, out, sc, m, k, ng, 1e-5, G=gp, STAGES=stages, STORE_TMA=st,
                                        num_warps=warps, **({"maxnreg": maxr} if maxr else {}))
            return out, sc
        _rms_report(f"w{warps} pps{pps} s{stages} tma_store={st!s:5} maxnreg={maxr}", run, (ref_d, ref_s), nbytes)


def probe_gemv_graph(copy_tbs: float, shapes=tuple(DECODE_SHAPES)) -> None:
    """The M = 1 GEMV back to back in a CUDA graph over rotating weight copies (as `bench_gemm`'s graph column),
    with PDL launches on / off and the L2 prefetch per row at 0 / 1 KB; the split-K MMA kernel forced at M = 1
    alongside (TB/s of weight bytes)."""
    from benchmarks.bench_gemm import GRAPH_ROTATE_BYTES
    from engine.kernels import gemm as G
    from engine.kernels import pdl

    print("\n## M = 1 decode GEMMs in a CUDA graph, back to back over weight copies (TB/s)")
    old = (G.GEMV_PREFETCH_BYTES, pdl.enabled())
    try:
        for n, k in shapes:
            xd, xs, wd, ws = fp8_block_operands(1, n, k, seed=n)
            wbytes = wd.numel() + ws.numel() * 4
            copies = [(wd, ws)] + [(wd.clone(), ws.clone()) for _ in range(max(1, -(-GRAPH_ROTATE_BYTES // wbytes) - 1))]
            cells = []
            for on in (True, False):
                pdl.set_enabled(on)
                for pf in (1024, 0):
                    G.GEMV_PREFETCH_BYTES = pf
                    t = graph_us([lambda c=c: G.fp8_block_linear(xd, xs, *c) for c in copies], n=48)
                    cells.append(f"gemv pdl={'on' if on else 'off'} pf={pf}: {wbytes / t / 1e6:4.2f}")
                # any explicit knob takes the MMA kernel (without knobs M = 1 goes to the GEMV)
                t = graph_us([lambda c=c: G.fp8_block_gemm_triton(xd, xs, *c, block_n=64) for c in copies], n=48)
                cells.append(f"split-K pdl={'on' if on else 'off'}: {wbytes / t / 1e6:4.2f}")
            print(f"  {n}x{k}: " + "; ".join(cells), flush=True)
            del copies
    finally:
        G.GEMV_PREFETCH_BYTES = old[0]
        pdl.set_enabled(old[1])


def probe_pdl_ab(copy_tbs: float) -> None:
    """Big-shape kernels with and without PDL launches (same code otherwise): act_quant, SwiGLU+quant and
    RMSNorm+quant at 16384 x 7168 bf16, paged FP8 / bf16 decode attention at 8 x 32K (TB/s)."""
    from benchmarks.bench_attention import fill_cache
    from engine.kernels import quant as Q
    from engine.kernels.paged_kv import PagedKVCache, paged_decode_attention
    from engine.kernels.pdl import set_enabled

    x = torch.randn(16384, 7168, device=DEV).to(torch.bfloat16)
    g, u = torch.randn_like(x), torch.randn_like(x)
    w = torch.rand(7168, device=DEV) + 0.5
    qb = x.numel() * 3
    caches = {}
    for dt in (torch.float8_e4m3fn, torch.bfloat16):
        c = PagedKVCache(1, 8 * 32768 // 64, 64, 8, 128, dtype=dt, max_seqs=8, device=DEV)
        fill_cache(c, 8, 32768)
        caches[dt] = c
    q = torch.randn(8, 32, 1, 128, device=DEV, dtype=torch.bfloat16)
    cases = [("act_quant", lambda: Q.act_quant(x), qb), ("swiglu_quant", lambda: Q.swiglu_quant(g, u), qb * 5 / 3),
             ("rmsnorm_quant", lambda: Q.rmsnorm_quant(x, w, 1e-5), qb)]
    cases += [(f"paged decode {'fp8' if dt != torch.bfloat16 else 'bf16'} 8x32K",
               lambda c=c: paged_decode_attention(q, c, 0), c.kv_bytes(8 * 32768)) for dt, c in caches.items()]
    print("\n## PDL A/B on big shapes (TB/s)")
    for name, fn, nbytes in cases:
        cells = []
        for on in (False, True, False, True):
            set_enabled(on)
            t = time_us(fn, reps=20)
            cells.append(f"{'pdl' if on else 'seq'} {nbytes / t / 1e6:5.2f}")
        print(f"  {name:28s} " + "  ".join(cells), flush=True)
    set_enabled(True)


def probe_small(copy_tbs: float) -> None:
    """Single-row (decode) latency of the quantizing kernels in a CUDA graph (us per launch), against a plain
    copy launch; SwiGLU with the quantization removed / merged into one reduction; and the big-shape throughput of
    those SwiGLU variants. Outputs of the variants are bit-compared with production."""
    from engine.kernels import quant as Q
    from engine.kernels.pdl import set_enabled

    print("\n## single-row kernel latency in a CUDA graph (us per launch, 64 launches per replay)")
    g1, u1 = torch.randn(1, 14336, device=DEV), torch.randn(1, 14336, device=DEV)
    x1, r1 = torch.randn(1, 4096, device=DEV), torch.randn(1, 4096, device=DEV)
    w1 = torch.rand(4096, device=DEV) + 0.5
    z1 = torch.zeros(1, 14336, device=DEV)
    cases = [("copy 16 KB (torch clone)", lambda: x1.clone()),
             ("act_quant 1x4096", lambda: Q.act_quant(x1)),
             ("swiglu_quant 1x14336 default", lambda: Q.swiglu_quant(g1, u1)),
             ("swiglu_quant bm=1", lambda: Q.swiglu_quant(g1, u1, bm=1)),
             ("swiglu probe bm=1 no quant", lambda: _swiglu_probe(g1, u1, 1, 0)),
             ("swiglu probe bm=1 prod quant", lambda: _swiglu_probe(g1, u1, 1, 1)),
             ("swiglu probe bm=1 nan-max quant", lambda: _swiglu_probe(g1, u1, 1, 2)),
             ("swiglu probe bm=16 prod quant", lambda: _swiglu_probe(g1, u1, 16, 1)),
             ("swiglu probe bm=16 masked rows 1.0", lambda: _swiglu_probe(g1, u1, 16, 3)),
             ("swiglu probe bm=1 prod, all-zero input", lambda: _swiglu_probe(z1, z1, 1, 1)),
             ("rmsnorm_quant 1x4096 default", lambda: Q.rmsnorm_quant(x1, w1, 1e-5)),
             ("add_rmsnorm_quant 1x4096 default", lambda: Q.add_rmsnorm_quant(x1, r1, w1, 1e-5))]
    for warps in (4, 8, 16):
        for gb in (8, 32):
            cases.append((f"add_rmsnorm_quant gb={gb} w{warps}",
                          lambda gb=gb, warps=warps: Q.add_rmsnorm_quant(x1, r1, w1, 1e-5, gb=gb, bm=1,
                                                                          num_warps=warps)))
    for on in (True, False):
        set_enabled(on)
        for name, fn in cases:
            try:
                print(f"  {'pdl' if on else 'seq'} {name:40s} {graph_us(fn):6.2f} us", flush=True)
            except Exception as exc:  # noqa: BLE001 -- a probe: report and go on
                print(f"  {name}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:150]}")
    set_enabled(True)
    _probe_small_attention()
    print("\n## RMSNorm+quant default at 16384 x 4096 (one row per program): 8 vs 16 warps (TB/s)")
    xb, wb = torch.randn(16384, 4096, device=DEV, dtype=torch.bfloat16), torch.rand(4096, device=DEV) + 0.5
    for warps in (8, 16):
        t = time_us(lambda: Q.rmsnorm_quant(xb, wb, 1e-5, num_warps=warps), reps=20)
        print(f"  w{warps}: {t:7.1f} us {xb.numel() * 3 / t / 1e6:5.2f} TB/s", flush=True)
    print("\n## SwiGLU variants at 16384 x 7168 (TB/s: 2 x fp32 in, fp8 + scales out) and their bits")
    gb_, ub_ = torch.randn(16384, 7168, device=DEV), torch.randn(16384, 7168, device=DEV)
    gb_[0, :128] = 0.0  # an all-zero group
    gb_[1, 5] = float("nan")  # a NaN group
    gb_[2, 7] = float("inf")
    ref_d, ref_s = _swiglu_probe(gb_, ub_, 16, 1)
    nbytes = gb_.numel() * (4 + 4 + 1) + ref_s.numel() * 4
    for bm in (8, 16, 32):
        for mode in (0, 1, 2):
            t = time_us(lambda: _swiglu_probe(gb_, ub_, bm, mode), reps=20)
            same = ""
            if mode:
                d, s = _swiglu_probe(gb_, ub_, bm, mode)
                same = (f" data {'==' if torch.equal(d.view(torch.uint8), ref_d.view(torch.uint8)) else '!='} prod,"
                        f" scales {'==' if torch.equal(s.nan_to_num(7.0), ref_s.nan_to_num(7.0)) else '!='}")
            print(f"  bm={bm:2d} mode={mode}: {t:7.1f} us {nbytes / t / 1e6:5.2f} TB/s{same}", flush=True)


ATTN_SWEEPS = {  # (block_n, num_warps, num_stages, num_splits (None: the default rule), maxnreg)
    "wide": [(64, 4, 5, None, None), (64, 4, 4, None, None), (64, 4, 3, None, None), (64, 4, 5, 8, None),
             (64, 4, 4, 8, None), (64, 4, 4, 6, 168), (64, 4, 3, 8, 168), (128, 4, 3, None, None),
             (128, 4, 4, None, None), (32, 4, 4, None, None), (32, 4, 6, None, None),
             (64, 2, 3, 8, None), (64, 2, 4, 8, None), (64, 2, 5, 8, None), (32, 2, 4, 8, None),
             (32, 2, 6, 8, None), (128, 2, 3, 8, None), (64, 2, 4, 16, None),
             (32, 1, 3, 16, None), (32, 1, 4, 16, None), (32, 1, 6, 16, None), (64, 1, 3, 16, None),
             (64, 1, 4, 16, None), (32, 1, 4, 32, None), (16, 1, 4, 32, None)],
    # around the wide sweep's best (dim-major, 2 warps, 5 stages, 8 splits: 3.29 TB/s on an H200)
    "fine": [(64, 2, 5, None, None), (64, 2, 5, 4, None), (64, 2, 5, 6, None), (64, 2, 5, 8, None),
             (64, 2, 5, 12, None), (64, 2, 5, 16, None), (64, 2, 6, 8, None), (64, 2, 6, 4, None),
             (64, 2, 4, 4, None), (128, 2, 4, 8, None), (128, 2, 3, 4, None), (64, 1, 5, 16, None),
             (64, 1, 6, 16, None), (64, 1, 5, 8, None), (32, 1, 8, 16, None), (64, 2, 5, 8, 128)],
}


def probe_attention(copy_tbs: float, sweep: str = "wide") -> None:
    """Paged FP8 decode attention 8 x 32K over the V page layouts (token-major / dimension-major) and the
    kernel's tiles: (block_n, num_warps, num_stages, num_splits, maxnreg); each row: time, TB/s of KV bytes,
    max rel error vs the fp32 reference and whether the output equals the token-layout default bit for bit."""
    from benchmarks.bench_attention import fill_cache
    from engine.kernels.paged_kv import PagedKVCache, paged_decode_attention, paged_decode_attention_reference

    b, ctx, h, hkv, dh, page = 8, 32768, 32, 8, 128, 64
    caches = {}
    for layout in ("token", "dim"):
        caches[layout] = PagedKVCache(1, b * ctx // page, page, hkv, dh, dtype=torch.float8_e4m3fn, max_seqs=b,
                                      device=DEV, v_layout=layout)
        fill_cache(caches[layout], b, ctx)
    q = torch.randn(b, h, 1, dh, device=DEV, dtype=torch.bfloat16, generator=torch.Generator(DEV).manual_seed(1))
    ref = paged_decode_attention_reference(q, caches["token"], 0)
    kvb = caches["token"].kv_bytes(b * ctx)
    base = paged_decode_attention(q, caches["token"], 0, block_n=64, num_warps=4, num_stages=5, num_splits=4)
    print(f"\n## paged FP8 decode attention {b} x {ctx}, V page layouts x tiles (TB/s of KV bytes; target 2.5); "
          f"sweep {sweep!r}; the comparison base: token-major, block_n 64, 4 warps, 5 stages, 4 splits")
    print("   layout block_n warps stages splits maxnreg       us   TB/s  % copy  err vs fp32  == token default")
    tiles = ATTN_SWEEPS[sweep]
    runs = [("token", t) for t in [(64, 4, 5, 4, None), (64, 2, 5, 8, None), (32, 1, 4, 16, None)]]
    runs += [("dim", t) for t in tiles]
    res = []
    for layout, (bn, w, st, sp, reg) in runs:
        kw = dict(block_n=bn, num_warps=w, num_stages=st, num_splits=sp, maxnreg=reg)
        try:
            o = paged_decode_attention(q, caches[layout], 0, **kw)
            err = ((o.float() - ref).abs().max() / ref.abs().max()).item()
            same = torch.equal(o, base)
            t = time_us(lambda: paged_decode_attention(q, caches[layout], 0, **kw), reps=30)
        except Exception as exc:  # noqa: BLE001 -- a probe: report and go on
            print(f"   {layout:6} {kw} FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:150]}", flush=True)
            continue
        tbs = kvb / t / 1e6
        res.append((t, layout, kw))
        print(f"   {layout:6} {bn:7d} {w:5d} {st:6d} {str(sp or 'auto'):>6} {str(reg or '-'):>7} {t:8.1f} {tbs:6.2f} "
              f"{100 * tbs / copy_tbs:6.1f}%  {err:11.1e}  {same}", flush=True)
    res.sort(key=lambda r: r[0])
    for t, layout, kw in res[:5]:
        print(f"   fastest: {t:7.1f} us {kvb / t / 1e6:5.2f} TB/s {layout} {kw}")


def probe_prefill() -> None:
    from engine.kernels import gemm as G

    n = 8192
    flops = 2.0 * n ** 3
    print("\n## prefill FP8 block 8192^3 (TFLOP/s; target 1200)")
    for label, scale in (("saturated (randn*100)", 100.0), ("randn", 1.0)):
        xd, xs, wd, ws = fp8_block_operands(n, n, n)
        if scale != 100.0:
            g = torch.Generator(DEV).manual_seed(3)
            xd = torch.randn(n, n, device=DEV, generator=g).to(torch.float8_e4m3fn)
            wd = torch.randn(n, n, device=DEV, generator=g).to(torch.float8_e4m3fn)
        kb = n // 128
        sa = xs.t().contiguous().t()  # (M, Kb) with strides (1, M)
        sb = ws.t().contiguous().t() if kb % 4 == 0 else None
        F = torch.nn.functional
        for name, fn in [
            ("scaled_mm_blockwise bf16 out", lambda: G.scaled_mm_blockwise(xd, xs, wd, ws)),
            ("scaled_mm_blockwise fp32 out", lambda: G.scaled_mm_blockwise(xd, xs, wd, ws, out_dtype=torch.float32)),
            ("F.scaled_mm prepared scales bf16", lambda: F.scaled_mm(xd, wd.t(), sa, F.ScalingType.BlockWise1x128, sb,
                                                                      F.ScalingType.BlockWise128x128,
                                                                      output_dtype=torch.bfloat16)),
        ]:
            try:
                t = time_us(fn)
                print(f"  {label:22} {name:36} {t:8.1f} us {flops / t / 1e6:7.1f} TFLOP/s", flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"  {label:22} {name:36} FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        del xd, wd


@triton.jit
def _rms_probe_kernel(x_ptr, w_ptr, out_ptr, scale_ptr, M, K, n_groups, eps, G: tl.constexpr,
                      STAGES: tl.constexpr, CHECK: tl.constexpr, W_HOIST: tl.constexpr):
    """The persistent RMSNorm+quant kernel with the quantization's division picked by CHECK: 0 the fast
    division with no domain check (measures the check; wrong bits for NaN / inf / zero / tiny groups), 1
    production (`_quant_groups` FAST: checked, IEEE fallback), 2 IEEE only. W_HOIST 0 reloads the weight per row
    (fewer registers live across the loop) instead of holding it."""
    g = tl.arange(0, G)
    cols = g[:, None] * 128 + tl.arange(0, 128)[None, :]
    cmask = cols < K
    if W_HOIST:
        wh = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    for row in tl.range(tl.program_id(0), M, tl.num_programs(0), num_stages=STAGES):
        base = tl.cast(row, tl.int64) * K
        x = tl.load(x_ptr + base + cols, mask=cmask, other=0.0).to(tl.float32)
        ss = tl.sum(tl.sum(x * x, axis=1), axis=0)
        rstd = _rstd(tl.zeros((G,), tl.float32) + ss, K, eps)
        if W_HOIST:
            h = wh * (x * rstd[:, None])
        else:
            h = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32) * (x * rstd[:, None])
        if CHECK == 0:
            amax = tl.max(tl.abs(h), axis=1)
            scale = tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
            y = _div_by_scale(h, scale[:, None], tl.div_rn(tl.full(amax.shape, 1.0, tl.float32), scale)[:, None])
            tl.store(out_ptr + base + cols, y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=cmask)
            tl.store(scale_ptr + row.to(tl.int64) * n_groups + g, scale, mask=g < n_groups)
        else:
            _quant_groups(h, tl.zeros((G,), tl.int32) + row, g, M, K, n_groups, out_ptr, scale_ptr, CHECK == 1)


def probe_rms(copy_tbs: float, hoist_sweep: bool = False) -> None:
    """RMSNorm+quant 16384 x 7168 bf16 (persistent kernel): the cost of the fast division's domain check (CHECK 1:
    a CTA-wide check and branch per row, as in `_quant_groups`; production defers it, see
    `_rmsnorm_quant_persistent_kernel`), of the IEEE division, and (hoist_sweep) of
    holding the weight in registers, over warps / programs per SM / stages. TB/s of bytes moved (x read, FP8 +
    scales written); the production wrapper's defaults first. Bits vs production printed."""
    import triton.testing

    from engine.kernels import quant as Q

    m, k = 16384, 7168
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    w = torch.rand(k, device=DEV) + 0.5
    nbytes = m * k * 3 + m * (k // 128) * 4
    ref_d, ref_s = Q.rmsnorm_quant(x, w, 1e-5, mode="persistent", num_warps=8, num_stages=3, programs_per_sm=2)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"\n## RMSNorm+quant {m} x {k} bf16, persistent kernel variants (copy ceiling {copy_tbs:.2f} TB/s)")
    for name, fn in [("production default", lambda: Q.rmsnorm_quant(x, w, 1e-5)),
                     ("production persistent w8 s3 pps2",
                      lambda: Q.rmsnorm_quant(x, w, 1e-5, mode="persistent", num_warps=8, num_stages=3,
                                              programs_per_sm=2))]:
        ms = triton.testing.do_bench(fn, warmup=10, rep=50)
        print(f"  {name:44s} {ms * 1e3:7.1f} us {nbytes / ms / 1e9:5.2f} TB/s")
    for check in (0, 1, 2):
        for hoist in (1, 0) if hoist_sweep else (1,):
            for warps, pps, stages in (((8, 2, 3), (8, 3, 3), (4, 4, 3), (4, 4, 4), (8, 2, 4), (16, 1, 4)) if hoist_sweep
                                       else ((8, 2, 3), (8, 2, 4), (4, 4, 3))):
                out = torch.empty(m, k, device=DEV, dtype=torch.float8_e4m3fn)
                sc = torch.empty(m, k // 128, device=DEV)

                def run(check=check, hoist=hoist, warps=warps, pps=pps, stages=stages, out=out, sc=sc):
                    _rms_probe_kernel[(min(m, pps * sms),)](x, w, out, sc, m, k, k // 128, 1e-5, G=64, STAGES=stages,
                                                            CHECK=check, W_HOIST=hoist, num_warps=warps)
                try:
                    ms = triton.testing.do_bench(run, warmup=10, rep=50)
                except Exception as e:  # noqa: BLE001 (out of resources: printed, next config)
                    print(f"  check={check} hoist={hoist} w{warps} pps{pps} s{stages}: {type(e).__name__}")
                    continue
                same = torch.equal(out.view(torch.uint8), ref_d.view(torch.uint8))
                print(f"  check={check} hoist={hoist} w{warps:<2d} pps{pps} s{stages}{'':22s} {ms * 1e3:7.1f} us "
                      f"{nbytes / ms / 1e9:5.2f} TB/s  bits {'= production' if same else 'DIFFER'}")


@triton.jit
def _gps_probe_kernel(w_desc, x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, groups_per_split,
                      n_splits, stride_xm, stride_wn, stride_xsm, stride_xsg, stride_wsn, stride_wsg, dbg_ptr,
                      BM: tl.constexpr, BN: tl.constexpr, GPS: tl.constexpr, USE_TMA: tl.constexpr,
                      REDUCE: tl.constexpr = 0, SPLITS: tl.constexpr = 1, t_ptr=None, TIMES: tl.constexpr = False):
    """The production split-K decode kernel (`_fp8_block_gemm_kernel`, fused reduce) walking GPS adjacent 128-groups
    per loop step (GPS*128 contiguous bytes of each weight row loaded per stage; W optionally through a TMA
    descriptor). Each group's dot is scaled and accumulated in the production order, so the bits equal
    production's for the same split when groups_per_split % GPS == 0. The next step's GPS scales are loaded one
    step ahead as a vector and picked by a one-hot sum (exact).

    REDUCE, the split-K handshake: 0 partials by tl.store, an acq_rel arrival atomic and an acq_rel counter reset;
    1 the same with the reset a plain store (production);
    2 relaxed stores from the accumulator's registers into a PENDING_BITS workspace, a relaxed arrival (no fence),
    the last split polls the partials until none reads PENDING_BITS and restores the pattern; 3 as 2 with the
    partials stored / polled by tl.store / volatile tl.load (Triton's coalescing layout). Modes 2 / 3 write the
    number of polling passes of each tile to dbg_ptr. Mode 4: partials only, no reduce.

    TIMES (modes 1 and 4): program p = (split, tile) writes t_ptr[p] = (start, loop end, end,
    SM, 1 if it summed its tile) in %globaltimer ns; the loop end is read after its partial store and a barrier."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    if TIMES:
        prog = (pid_s * tl.num_programs(1) + pid_m) * tl.num_programs(0) + pid_n
        t_start = _now(pid_n)
    offs_n, offs_m, n_ok, m_ok, w_rows, x_rows, ws_row, xs_rows, g0, g1 = _split_k_tile(
        x_ptr, xs_ptr, w_ptr, ws_ptr, pid_n, pid_m, pid_s, M, N, K, groups_per_split, stride_xm, stride_wn,
        stride_xsm, stride_wsn, BM, BN)
    offs_k = tl.arange(0, 128)
    j = tl.arange(0, GPS)
    ws_next = tl.load(ws_row + (g0 + j) * stride_wsg, mask=g0 + j < g1, other=0.0)
    xs_next = tl.load(xs_rows[:, None] + (g0 + j)[None, :] * stride_xsg, mask=m_ok[:, None] & (g0 + j < g1)[None, :],
                      other=0.0)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for g in range(g0, g1, GPS):
        wsv = ws_next
        xsv = xs_next
        gn = g + GPS + j
        ws_next = tl.load(ws_row + gn * stride_wsg, mask=gn < g1, other=0.0)
        xs_next = tl.load(xs_rows[:, None] + gn[None, :] * stride_xsg, mask=m_ok[:, None] & (gn < g1)[None, :],
                          other=0.0)
        for t in tl.static_range(GPS):
            k = (g + t) * 128 + offs_k
            if USE_TMA:
                w = w_desc.load([pid_n * BN, (g + t) * 128])
            else:
                w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
            ws = tl.sum(tl.where(j == t, wsv, 0.0), axis=0)
            xs = tl.sum(tl.where(j[None, :] == t, xsv, 0.0), axis=1)
            acc += tl.dot(w, tl.trans(x)) * (xs[None, :] * ws)
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    idx = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
    tile = pid_m * tl.num_programs(0) + pid_n
    mn = M.to(tl.int64) * N
    if n_splits == 1:
        tl.store(out_ptr + idx, acc, mask=mask)
    elif REDUCE <= 1 or REDUCE == 4:
        tl.store(part_ptr + pid_s.to(tl.int64) * M * N + idx, acc, mask=mask)
        tl.debug_barrier()
        if TIMES:
            t_loop = _now(pid_n)
        last = pid_n * 0
        if REDUCE != 4:
            arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == n_splits - 1:
                tot = tl.zeros((BN, BM), dtype=tl.float32)
                for s in range(n_splits):
                    tot += tl.load(part_ptr + s * M.to(tl.int64) * N + idx, mask=mask, other=0.0,
                                   cache_modifier=".cg")
                tl.store(out_ptr + idx, tot, mask=mask)
                if REDUCE == 0:
                    tl.atomic_xchg(cnt_ptr + tile, 0)
                else:
                    tl.store(cnt_ptr + tile, 0)
                last = pid_n * 0 + 1
        if TIMES:
            tl.store(t_ptr + prog * 5, t_start)
            tl.store(t_ptr + prog * 5 + 1, t_loop)
            tl.store(t_ptr + prog * 5 + 2, _now(last))
            tl.store(t_ptr + prog * 5 + 3, _smid(last).to(tl.int64))
            tl.store(t_ptr + prog * 5 + 4, last.to(tl.int64))
    else:  # modes 2 / 3
        bits = acc.to(tl.int32, bitcast=True)
        _put_b32(part_ptr + pid_s * mn + idx, tl.where(bits == PENDING_BITS, CANONICAL_NAN_BITS, bits), mask,
                 REDUCE == 3)
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="relaxed", scope="gpu")
        if arrived == SPLITS - 1:
            passes = 1
            tot, pending = _sum_partials(part_ptr, idx, mask, mn, BN, BM, SPLITS, REDUCE == 3)
            while pending:
                passes += 1
                tot, pending = _sum_partials(part_ptr, idx, mask, mn, BN, BM, SPLITS, REDUCE == 3)
            for s in tl.static_range(SPLITS):
                _put_b32(part_ptr + s * mn + idx, tl.full((BN, BM), PENDING_BITS, tl.int32), mask, REDUCE == 3)
            tl.store(cnt_ptr + tile, 0)
            tl.store(dbg_ptr + tile, passes)
            tl.store(out_ptr + idx, tot, mask=mask)

# Split-K handshake modes 2 / 3 of `_gps_probe_kernel` (not in production): partials live in a workspace that
# holds this fp32 NaN pattern where no partial is pending (GPU arithmetic returns the canonical NaN 0x7FFFFFFF, and a
# program storing the pattern stores that instead), so the last split can poll for partials that have not landed.
PENDING_BITS = tl.constexpr(0x7FBADBAD)
CANONICAL_NAN_BITS = tl.constexpr(0x7FFFFFFF)
_PENDING: dict = {}


def _pending_workspace(n: int) -> torch.Tensor:
    """A PENDING_BITS-filled fp32 workspace of >= n elements (modes 2 / 3 leave it so)."""
    buf = _PENDING.get("buf")
    if buf is None or buf.numel() < n:
        buf = torch.full((max(n, 1 << 20),), PENDING_BITS.value, dtype=torch.int32, device=DEV).view(torch.float32)
        _PENDING["buf"] = buf
    return buf


@triton.jit
def _st_relaxed_b32(ptr, bits, mask):
    """st.relaxed.gpu.global.b32 of int32 bits wherever mask, from the operands' own register layout."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.relaxed.gpu.global.b32 [$1], $2; "
                              "mov.u32 $0, 0; }", "=r,l,r,r", [ptr.to(tl.int64, bitcast=True), bits, mask.to(tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _ld_relaxed_b32(ptr, mask):
    """ld.relaxed.gpu.global.b32 wherever mask (0 elsewhere), re-issued on every call."""
    return tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.u32 $0, 0; "
                                     "@p ld.relaxed.gpu.global.b32 $0, [$1]; }", "=r,l,r",
                                     [ptr.to(tl.int64, bitcast=True), mask.to(tl.int32)], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _put_b32(ptr, bits, mask, PLAIN: tl.constexpr):
    """Store int32 bits as fp32 wherever mask: `_st_relaxed_b32` from the register layout, or (PLAIN) tl.store in
    Triton's own store layout."""
    if PLAIN:
        tl.store(ptr, bits.to(tl.float32, bitcast=True), mask=mask)
    else:
        _st_relaxed_b32(ptr, bits, mask)


@triton.jit
def _sum_partials(part_ptr, idx, mask, MN, BN: tl.constexpr, BM: tl.constexpr, SPLITS: tl.constexpr,
                  VOLATILE: tl.constexpr):
    """(the SPLITS partials of a tile summed in split order, whether any element still read PENDING_BITS), through
    `_ld_relaxed_b32` in the accumulator's layout or volatile tl.load in Triton's own load layout."""
    tot = tl.zeros((BN, BM), dtype=tl.float32)
    pending = tl.zeros((BN, BM), dtype=tl.int32)
    for s in tl.static_range(SPLITS):
        if VOLATILE:
            v = tl.load(part_ptr + s * MN + idx, mask=mask, other=0.0, volatile=True)
            bits = v.to(tl.int32, bitcast=True)
        else:
            bits = _ld_relaxed_b32(part_ptr + s * MN + idx, mask)
            v = bits.to(tl.float32, bitcast=True)
        pending += (bits == PENDING_BITS).to(tl.int32)
        tot += v
    return tot, tl.sum(tl.sum(pending, axis=1), axis=0) > 0


def gps_gemm(xd, xs, wd, ws, bn=64, splits=4, warps=4, stages=4, gps=1, tma=False, reduce=0, dbg=None, times=None):
    """`_gps_probe_kernel` (fp32 out, fused split-K reduce `reduce`; dbg: an int32 tensor of >= tiles elements for
    the polling passes of modes 2 / 3; times: an int64 (programs, 5) tensor for TIMES, modes 1 / 4)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from engine.kernels import gemm as G

    m, k = xd.shape
    n = wd.shape[0]
    kb = -(-k // 128)
    per = -(-kb // splits)
    if per % gps:
        raise ValueError(f"{per} groups per split is not a multiple of gps {gps}")
    bm = max(16, triton.next_power_of_2(m))
    out = torch.empty((m, n), device=xd.device, dtype=torch.float32)
    if reduce >= 2:
        part = _pending_workspace(splits * m * n)
    else:
        part = torch.empty((splits, m, n), device=xd.device, dtype=torch.float32)
    grid = (-(-n // bn), -(-m // bm), splits)
    cnt = G._tile_counters(xd.device, grid[0] * grid[1])
    desc = TensorDescriptor.from_tensor(wd, [bn, 128]) if tma else None
    _gps_probe_kernel[grid](desc, xd, xs, wd, ws, out, part, cnt, m, n, k, per, splits, xd.stride(0), wd.stride(0),
                            xs.stride(0), xs.stride(1), ws.stride(0), ws.stride(1), dbg if dbg is not None else cnt,
                            BM=bm, BN=bn, GPS=gps, USE_TMA=tma, REDUCE=reduce,
                            SPLITS=splits if reduce in (2, 3) else 1, t_ptr=times, TIMES=times is not None,
                            num_warps=warps, num_stages=stages)
    return out


def probe_gemm_gps(copy_tbs: float, shapes=((4096, 14336),), ms=(4, 16)) -> None:
    """Decode GEMM at M = 4 / 16: `_gps_probe_kernel` over groups per step (GPS), TMA / plain weight loads, block_n,
    splits and pipeline depth, vs the production dispatch (us, TB/s of weight bytes, x bf16 cuBLAS)."""
    print(f"\n## decode GEMM at M = {ms}: groups per pipeline step (GPS), TMA weight loads (flush {FLUSH})")
    for n, k, m, (xd, xs, wd, ws), wbytes, t16, t0, ref in _small_m_cases(shapes, ms):
        res = []
        kb = k // 128
        for gps in (1, 2, 4):
            for tma in (False, True):
                for bn in (32, 64, 128):
                    for split in (1, 2, 4, 7, 8, 14):
                        if (-(-kb // split)) % gps or (n // bn) * split < 132 or (n // bn) * split > 16 * 132:
                            continue
                        for warps, stages in ((4, 2), (4, 3), (4, 4), (4, 5), (8, 3)):
                            if stages * gps > 12 or (bn == 128 and stages * gps > 8):
                                continue
                            cfg = dict(bn=bn, splits=split, warps=warps, stages=stages, gps=gps, tma=tma)
                            _sweep_one(res, cfg, lambda cfg=cfg: gps_gemm(xd, xs, wd, ws, **cfg), ref,
                                       quiet="out of resource")
        _case_line(n, k, m, t16, t0, wbytes)
        _top(res, wbytes, copy_tbs, "production", n=8)
        for gps in (1, 2, 4):
            for tma in (False, True):
                b = [r for r in res if r[1]["gps"] == gps and r[1]["tma"] == tma]
                if b:
                    print(f"      best gps={gps} tma={tma!s:5}: {b[0][0]:6.1f} us {wbytes / b[0][0] / 1e6:5.2f} TB/s "
                          f"{t16 / b[0][0]:4.2f}x bf16 {b[0][1]}", flush=True)


@triton.jit
def _rms_warp_probe_kernel(x_ptr, w_ptr, out_ptr, scale_ptr, M, K, n_groups, eps, GB: tl.constexpr,
                           STAGES: tl.constexpr):
    """RMSNorm+quant, programs looping over whole rows (row pid, pid + programs, ...), each row in two chunked
    passes of GB groups: pass 1 sums x^2 (loads kept in L2: evict_last), pass 2 re-reads the chunk (evict_first),
    norms and quantizes it (`_quant_groups` FAST). Meant for 1-2 warps per program: many rows in flight per SM,
    no CTA-wide barrier per row."""
    sub = tl.arange(0, GB)
    for row in tl.range(tl.program_id(0), M, tl.num_programs(0)):
        rows = tl.zeros((GB,), tl.int32) + row
        ss = tl.zeros((GB,), tl.float32)
        for g0 in tl.range(0, n_groups, GB, num_stages=STAGES):
            off, mask, _ = _group_offsets(rows, g0 + sub, M, K)
            xc = tl.load(x_ptr + off, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            ss += tl.sum(xc * xc, axis=1)
        rstd = _rstd(tl.zeros((GB,), tl.float32) + tl.sum(ss, axis=0), K, eps)
        for g0 in tl.range(0, n_groups, GB, num_stages=STAGES):
            off, mask, cols = _group_offsets(rows, g0 + sub, M, K)
            xc = tl.load(x_ptr + off, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            wv = tl.load(w_ptr + cols, mask=cols < K, other=0.0, eviction_policy="evict_last").to(tl.float32)
            _quant_groups(wv * (xc * rstd[:, None]), rows, g0 + sub, M, K, n_groups, out_ptr, scale_ptr, True)


def probe_rms_warp(copy_tbs: float) -> None:
    """RMSNorm+quant 16384 x 7168 bf16 with few warps per row: the production chunked two-pass kernel at 1 / 2 / 4
    warps over chunk groups and pipeline depth (one row per program), and `_rms_warp_probe_kernel` (programs
    looping over rows) over programs per SM; TB/s after a dirty and a clean flush; FP8 bytes / scales differing
    from production (sum-of-squares order: last-bit rstd differences only)."""
    from engine.kernels import quant as Q
    from engine.kernels import sm_count

    m, k = 16384, 7168
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w = torch.rand(k, device=DEV) + 0.5
    ng = k // 128
    nbytes = x.numel() * 3 + m * ng * 4
    ref_d, ref_s = Q.rmsnorm_quant(x, w, 1e-5)

    def report(name, run):
        _rms_report(f"{name:39s}", run, (ref_d, ref_s), nbytes, reps=20)

    print("\n## RMSNorm+quant 16384 x 7168: few warps per row (TB/s dirty / clean L2)")
    report("production default", lambda: Q.rmsnorm_quant(x, w, 1e-5))
    for warps in (1, 2, 4):
        for gb in (4, 8, 16):
            for stages in (1, 2, 3, 4):
                if gb * 128 // (32 * warps) > 64:
                    continue
                report(f"chunked bm1 gb{gb} w{warps} s{stages}", lambda gb=gb, warps=warps, stages=stages:
                       Q.rmsnorm_quant(x, w, 1e-5, mode="chunked", bm=1, gb=gb, num_warps=warps, num_stages=stages))
    for warps in (1, 2):
        for gb in (8, 16):
            for stages in (2, 3):
                for pps in (8, 16, 24, 32):
                    out = torch.empty((m, k), device=DEV, dtype=torch.float8_e4m3fn)
                    sc = torch.empty((m, ng), device=DEV, dtype=torch.float32)

                    def run(warps=warps, gb=gb, stages=stages, pps=pps, out=out, sc=sc):
                        _rms_warp_probe_kernel[(min(m, pps * sm_count(x.device)),)](
                            x, w, out, sc, m, k, ng, 1e-5, GB=gb, STAGES=stages, num_warps=warps)
                        return out, sc
                    report(f"row-loop w{warps} gb{gb} s{stages} pps{pps}", run)


@triton.jit
def _rms_part_load(x_ptr, base, g_lo, K, G: tl.constexpr):
    """Columns, mask and fp32 values of groups g_lo .. g_lo + G - 1 of the row at base."""
    cols = (g_lo + tl.arange(0, G))[:, None] * 128 + tl.arange(0, 128)[None, :]
    cmask = cols < K
    return cols, cmask, tl.load(x_ptr + base + cols, mask=cmask, other=0.0).to(tl.float32)


@triton.jit
def _rms_part_quant(x_ptr, wv, out_ptr, scale_ptr, row, base, g_lo, x, rstd, M, K, n_groups, G: tl.constexpr,
                    RELOAD: tl.constexpr):
    """Norm (weight tile wv, held) and fast-quantize groups g_lo .. g_lo + G - 1 of one row (x re-read when
    RELOAD); (G,) bad flags."""
    cols, cmask, xr = _rms_part_load(x_ptr, base, g_lo, K, G)
    if not RELOAD:
        xr = x
    h = wv * (xr * rstd)
    g = g_lo + tl.arange(0, G)
    smask = g < n_groups
    amax, bad = _fast_domain(h, smask)
    _quant_groups_fast(h, amax, base + cols, cmask, scale_ptr + tl.cast(row, tl.int64) * n_groups + g, smask, out_ptr)
    return bad


@triton.jit
def _rms_parts_probe_kernel(x_ptr, w_ptr, out_ptr, scale_ptr, M, K, n_groups, eps, G0: tl.constexpr,
                            G1: tl.constexpr, G2: tl.constexpr, STAGES: tl.constexpr, RELOAD: tl.constexpr):
    """Persistent RMSNorm+quant (programs loop over whole rows, loop pipelined STAGES deep) with the row held as up
    to three power-of-two group tiles G0 + G1 + G2 >= n_groups (7168 columns: 32 + 16 + 8 = 56 groups, no padded
    lanes, where production's single 64-group tile computes 12.5% masked lanes). RELOAD re-reads each tile for the
    norm (a second load of the same addresses: x need not stay in registers across the sum of squares). The
    deferred domain-check flags are kept; their fallback is not run (a probe on random rows)."""
    bad0 = tl.zeros((G0,), tl.int32)
    bad1 = tl.zeros((G1 if G1 > 0 else 1,), tl.int32)
    bad2 = tl.zeros((G2 if G2 > 0 else 1,), tl.int32)
    _, _, w0 = _rms_part_load(w_ptr, 0, 0, K, G0)  # the weight, held in registers (as production)
    w1 = w0
    w2 = w0
    if G1 > 0:
        _, _, w1 = _rms_part_load(w_ptr, 0, G0, K, G1)
    if G2 > 0:
        _, _, w2 = _rms_part_load(w_ptr, 0, G0 + G1, K, G2)
    for row in tl.range(tl.program_id(0), M, tl.num_programs(0), num_stages=STAGES):
        base = tl.cast(row, tl.int64) * K
        _, _, x0 = _rms_part_load(x_ptr, base, 0, K, G0)
        ss = tl.sum(tl.sum(x0 * x0, axis=1), axis=0)
        x1 = x0
        x2 = x0
        if G1 > 0:
            _, _, x1 = _rms_part_load(x_ptr, base, G0, K, G1)
            ss += tl.sum(tl.sum(x1 * x1, axis=1), axis=0)
        if G2 > 0:
            _, _, x2 = _rms_part_load(x_ptr, base, G0 + G1, K, G2)
            ss += tl.sum(tl.sum(x2 * x2, axis=1), axis=0)
        rstd = _rstd(tl.zeros((1,), tl.float32) + ss, K, eps)[:, None]
        bad0 = bad0 | _rms_part_quant(x_ptr, w0, out_ptr, scale_ptr, row, base, 0, x0, rstd, M, K, n_groups, G0,
                                      RELOAD)
        if G1 > 0:
            bad1 = bad1 | _rms_part_quant(x_ptr, w1, out_ptr, scale_ptr, row, base, G0, x1, rstd, M, K, n_groups,
                                          G1, RELOAD)
        if G2 > 0:
            bad2 = bad2 | _rms_part_quant(x_ptr, w2, out_ptr, scale_ptr, row, base, G0 + G1, x2, rstd, M, K,
                                          n_groups, G2, RELOAD)
    # Keep the flags live, as production's fallback branch does (else the compiler drops their per-row cost):
    # a store whose mask is never true (flag is at most 3: one 0/1 maximum per tile).
    flag = tl.max(bad0, axis=0) + tl.max(bad1, axis=0) + tl.max(bad2, axis=0)
    tl.store(scale_ptr + tl.program_id(0) * 0, tl.load(scale_ptr), mask=flag > 1000000)


def _rms_case(title: str):
    """The 16384 x 7168 bf16 case of the RMSNorm+quant probes: prints the title and production's TB/s after a dirty /
    clean flush; returns (m, k, x, weight, groups per row, bytes moved, production's (FP8 data, scales))."""
    from engine.kernels import quant as Q

    m, k = 16384, 7168
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w = torch.rand(k, device=DEV) + 0.5
    ng = k // 128
    nbytes = x.numel() * 3 + m * ng * 4
    ref = Q.rmsnorm_quant(x, w, 1e-5)
    print(title)
    for fl in ("dirty", "clean"):
        print(f"  production: {fl} {nbytes / _time_us(lambda: Q.rmsnorm_quant(x, w, 1e-5), reps=30, flush=fl) / 1e6:5.2f}")
    return m, k, x, w, ng, nbytes, ref


def probe_rms_parts(copy_tbs: float) -> None:
    """RMSNorm+quant 16384 x 7168 bf16, persistent: the row as one 64-group tile (production's padding) vs 32 + 16 + 8
    group tiles, x held vs re-read for the norm, over warps / programs per SM / stages (TB/s dirty / clean)."""
    from engine.kernels import sm_count

    m, k, x, w, ng, nbytes, (ref_d, ref_s) = _rms_case("\n## RMSNorm+quant 16384 x 7168, persistent: group tiles without padding (TB/s dirty / clean L2)")
    for parts in ((64, 0, 0), (32, 16, 8)):
        for reload in (0, 1):
            for warps, pps, stages in ((8, 2, 3), (8, 2, 2), (8, 2, 4), (8, 3, 2), (8, 3, 3), (4, 4, 3), (4, 5, 2),
                                       (16, 1, 3)):
                out = torch.empty((m, k), device=DEV, dtype=torch.float8_e4m3fn)
                sc = torch.empty((m, ng), device=DEV, dtype=torch.float32)

                def run(parts=parts, reload=reload, warps=warps, pps=pps, stages=stages, out=out, sc=sc):
                    _rms_parts_probe_kernel[(min(m, pps * sm_count(x.device)),)](
                        x, w, out, sc, m, k, ng, 1e-5, G0=parts[0], G1=parts[1], G2=parts[2], STAGES=stages,
                        RELOAD=reload, num_warps=warps)
                    return out, sc
                _rms_report(f"parts={parts} reload={reload} w{warps} pps{pps} s{stages}", run, (ref_d, ref_s), nbytes)


@triton.jit
def _gemv_m_probe_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, stride_xm, stride_xsm, stride_wn, stride_wsn,
                         BN: tl.constexpr, GK: tl.constexpr, MB: tl.constexpr, STAGES: tl.constexpr):
    """The M = 1 GEMV (`_fp8_gemv_kernel`: CUDA cores, whole weight rows per program, no split-K) for M <= MB
    activation rows: each weight tile, once in registers, is multiplied with every activation row."""
    pid = tl.program_id(0)
    rows, r_ok, offs, kb, ws_row, w_rows = _gemv_rows(w_ptr, ws_ptr, pid, N, K, stride_wn, stride_wsn, BN, GK)
    mi = tl.arange(0, MB)
    acc = tl.zeros((BN, MB), dtype=tl.float32)
    for g0 in tl.range(0, kb, GK, num_stages=STAGES):
        k = g0 * 128 + offs
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        gi = g0 + tl.arange(0, GK)
        g_ok = gi < kb
        wsc = tl.load(ws_row + gi, mask=g_ok, other=0.0)
        for mm in tl.static_range(MB):
            x = tl.load(x_ptr + mm * stride_xm + k, mask=k_ok & (mm < M), other=0.0).to(tl.float32)
            part = tl.sum(tl.reshape(w * x[None, :], (BN, GK, 128)), axis=2)
            sc = wsc * tl.load(xs_ptr + mm * stride_xsm + gi, mask=g_ok & (mm < M), other=0.0)
            acc += tl.where(mi[None, :] == mm, tl.sum(part * sc[None, :], axis=1)[:, None], 0.0)
    tl.store(out_ptr + mi[None, :] * N + rows[:, None], acc, mask=r_ok[:, None] & (mi < M)[None, :])


def gemv_m(xd, xs, wd, ws, bn=8, gk=4, warps=4, stages=3):
    m, k = xd.shape
    n = wd.shape[0]
    out = torch.empty((m, n), device=xd.device, dtype=torch.float32)
    _gemv_m_probe_kernel[(-(-n // bn),)](xd, xs, wd, ws, out, m, n, k, xd.stride(0), xs.stride(0), wd.stride(0),
                                          ws.stride(0), BN=bn, GK=gk, MB=triton.next_power_of_2(m), STAGES=stages,
                                          num_warps=warps)
    return out


def probe_gemm_narrow(copy_tbs: float, shapes=((4096, 14336),), ms=(4, 16)) -> None:
    """Decode GEMM at M = 4 / 16 on 4096x14336: narrow weight tiles (block_n 16 / 32: MMA v2) with many groups per
    step and deep pipelines (`_gps_probe_kernel`), and at M = 4 the GEMV generalized to 4 activation rows
    (`_gemv_m_probe_kernel`), vs production (us, TB/s of weight bytes, x bf16 cuBLAS)."""
    print(f"\n## decode GEMM at M = {ms}: narrow MMA tiles, GEMV for 4 rows (flush {FLUSH})")
    for n, k, m, (xd, xs, wd, ws), wbytes, t16, t0, ref in _small_m_cases(shapes, ms):
        kb = k // 128
        res = []
        for bn in (16, 32):
            for split in (1, 2, 4):
                for gps in (2, 4, 8):
                    if (-(-kb // split)) % gps:
                        continue
                    for stages in (3, 4, 6, 8):
                        if gps * stages > 32 or gps * stages < 8:
                            continue
                        for tma in (False, True):
                            cfg = dict(bn=bn, splits=split, warps=4, stages=stages, gps=gps, tma=tma)
                            _sweep_one(res, cfg, lambda cfg=cfg: gps_gemm(xd, xs, wd, ws, **cfg), ref,
                                       quiet="out of resource")
        if m <= 4:
            for bn in (4, 8, 16):
                for gk in (2, 4, 8):
                    for warps in (2, 4, 8):
                        for stages in (2, 3, 4):
                            if bn * gk * 128 // (32 * warps) > 128:
                                continue
                            cfg = dict(gemv_m=1, bn=bn, gk=gk, warps=warps, stages=stages)
                            _sweep_one(res, cfg, lambda cfg=cfg: gemv_m(
                                xd, xs, wd, ws, bn=cfg["bn"], gk=cfg["gk"], warps=cfg["warps"],
                                stages=cfg["stages"]), ref, quiet="out of resource")
        _case_line(n, k, m, t16, t0, wbytes)
        _top(res, wbytes, copy_tbs, "production", n=10)
        for kind in ("gemv_m", "bn16", "bn32"):
            b = [r for r in res if (kind == "gemv_m") == ("gemv_m" in r[1])
                 and (kind == "gemv_m" or r[1].get("bn") == int(kind[2:]))]
            if b:
                print(f"      best {kind}: {b[0][0]:6.1f} us {wbytes / b[0][0] / 1e6:5.2f} TB/s "
                      f"{t16 / b[0][0]:4.2f}x bf16 {b[0][1]}", flush=True)


def probe_rms_occupancy(copy_tbs: float) -> None:
    """RMSNorm+quant 16384 x 7168 bf16: the production persistent kernel at 16 / 32 warps per row with registers
    capped so that two programs fit per SM (16 warps: 81 registers uncapped, 64 capped -> 32 warps per SM and two
    rows in flight, vs 8 warps x 122 registers x 2 programs in production); TB/s dirty / clean; bits vs production
    (the sum of squares' order follows the warp count: last-bit rstd differences only)."""
    from engine.kernels import sm_count
    from engine.kernels.quant import _rmsnorm_quant_persistent_kernel as pers

    m, k, x, w, ng, nbytes, (ref_d, ref_s) = _rms_case("\n## RMSNorm+quant 16384 x 7168, persistent kernel: warps per row x programs per SM x register cap")
    for warps, pps, stages, maxr in ((8, 2, 3, None), (16, 2, 3, 64), (16, 2, 2, 64), (16, 2, 4, 64), (16, 2, 3, 56),
                                     (16, 1, 3, None), (16, 1, 4, None), (32, 1, 3, None), (32, 1, 2, None),
                                     (16, 3, 2, 40), (8, 3, 3, 80), (8, 4, 2, 64)):
        out = torch.empty((m, k), device=DEV, dtype=torch.float8_e4m3fn)
        sc = torch.empty((m, ng), device=DEV, dtype=torch.float32)

        def run(warps=warps, pps=pps, stages=stages, maxr=maxr, out=out, sc=sc):
            pers[(min(m, pps * sm_count(x.device)),)](x, w, out, sc, out, x, out, m, k, ng, 1e-5, G=64, STAGES=stages,
                                                      STORE_HP=False, FAST=True, num_warps=warps,
                                                      **({"maxnreg": maxr} if maxr else {}))
            return out, sc
        _rms_report(f"w{warps} pps{pps} s{stages} maxnreg={maxr}", run, (ref_d, ref_s), nbytes)


# ---------------------------------------------------------------- what a single decode call can reach
@triton.jit
def _now(dep):
    """%globaltimer (ns) as int64; dep (any scalar) only orders the read after it. CUDA only."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _smid(dep):
    """The SM this program runs on. CUDA only."""
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [dep], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _noop_kernel(out_ptr):
    """One program storing one word: the fixed cost of a timed call (launch, events) with no memory traffic."""
    tl.store(out_ptr + tl.program_id(0), 0)


@triton.jit
def _chunk_read_kernel(src_ptr, out_ptr, n_words, per_prog, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Stream one contiguous chunk of per_prog int32 words per program (the tail masked); store their xor."""
    start = tl.program_id(0).to(tl.int64) * per_prog
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for i in tl.range(0, per_prog, BLOCK, num_stages=STAGES):
        offs = start + i + tl.arange(0, BLOCK)
        acc ^= tl.load(src_ptr + offs, mask=offs < n_words, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(acc, 0))


@triton.jit
def _tile_read_kernel(w_ptr, out_ptr, t_ptr, groups_per_split, n_groups, stride_wt, stride_wn, stride_wg,
                      BN: tl.constexpr, STAGES: tl.constexpr, TIMES: tl.constexpr = False):
    """The decode GEMM's weight access pattern without the MMA: grid (N tiles, K splits), one (BN, 128)-byte tile
    per step, read as int32 words (strides in words) and xor-reduced. TIMES: t[program] = (start ns, end ns, SM)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    if TIMES:
        t_start = _now(pid_n)
    base = (w_ptr + pid_n.to(tl.int64) * stride_wt + tl.arange(0, BN)[:, None] * stride_wn
            + tl.arange(0, 32)[None, :])
    g0 = pid_s * groups_per_split
    g1 = tl.minimum(g0 + groups_per_split, n_groups)
    acc = tl.zeros((BN, 32), dtype=tl.int32)
    for g in tl.range(g0, g1, num_stages=STAGES):
        acc ^= tl.load(base + g * stride_wg)
    tl.store(out_ptr + pid_n * tl.num_programs(1) + pid_s, tl.xor_sum(tl.xor_sum(acc, 1), 0))
    if TIMES:
        _store_times(t_ptr, pid_n * tl.num_programs(1) + pid_s, t_start, pid_n)


@triton.jit
def _store_times(t_ptr, prog, t_start, dep):
    """t[prog] = (t_start, now, SM id) as int64."""
    tl.store(t_ptr + prog * 3, t_start)
    tl.store(t_ptr + prog * 3 + 1, _now(dep))
    tl.store(t_ptr + prog * 3 + 2, _smid(dep).to(tl.int64))


@triton.jit
def _layout_gemm_probe_kernel(w_desc, x_ptr, xs_ptr, w_ptr, ws_ptr, part_ptr, t_ptr, M, N, K, groups_per_split,
                              stride_xm, stride_xsm, stride_wsn, stride_wt, stride_wn, stride_wg, t_row, g_row, g_col,
                              BM: tl.constexpr, BN: tl.constexpr, USE_TMA: tl.constexpr, TIMES: tl.constexpr = False,
                              SWAP: tl.constexpr = True):
    """The production split-K loop (one FP8 dot per 128-group, promoted and scaled per group, scales one step ahead)
    on a weight in any tile layout: element (n, g*128 + c) at w_ptr + (n // BN) * stride_wt + (n % BN) * stride_wn
    + g * stride_wg + c (row-major: stride_wt = BN * K, stride_wn = K, stride_wg = 128; tiled (N/BN, K/128, BN, 128):
    K/128 * BN * 128, 128, BN * 128), or through a 2-D TMA descriptor at rows pid_n * t_row + g * g_row, column
    g * g_col. Partials go to part[split] (summed by torch: the reduce is not timed, for every layout alike).
    TIMES: t[program] = (start ns, end ns, SM) as `_tile_read_kernel`. SWAP (production): acc (BN, BM) = W @ X^T, the
    weight rows on the MMA's M side; else acc (BM, BN) = X @ W^T, X's rows padded to BM >= 64 (the wgmma M) and the
    weight tile on the MMA's N side, which may be as narrow as 16."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    if TIMES:
        t_start = _now(pid_n)
    offs_m = tl.arange(0, BM)
    offs_k = tl.arange(0, 128)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_ok = offs_m < M
    w_tile = w_ptr + pid_n.to(tl.int64) * stride_wt + tl.arange(0, BN)[:, None] * stride_wn + offs_k[None, :]
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    ws_row = ws_ptr + ((pid_n * BN) // 128) * stride_wsn
    xs_rows = xs_ptr + offs_m * stride_xsm
    g0 = pid_s * groups_per_split
    g1 = tl.minimum(g0 + groups_per_split, tl.cdiv(K, 128))
    ws_next = tl.load(ws_row + g0)
    xs_next = tl.load(xs_rows + g0, mask=m_ok, other=0.0)
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for g in range(g0, g1):
        ws = ws_next
        xs = xs_next
        ws_next = tl.load(ws_row + g + 1, mask=g + 1 < g1, other=0.0)
        xs_next = tl.load(xs_rows + g + 1, mask=m_ok & (g + 1 < g1), other=0.0)
        if USE_TMA:
            w = w_desc.load([pid_n * t_row + g * g_row, g * g_col])
        else:
            w = tl.load(w_tile + g * stride_wg)
        x = tl.load(x_rows + (g * 128 + offs_k)[None, :], mask=m_ok[:, None], other=0.0)
        if SWAP:
            acc += tl.dot(w, tl.trans(x)) * (xs[None, :] * ws)
        else:
            acc += tl.dot(x, tl.trans(w)) * (xs[:, None] * ws)
    if SWAP:
        tl.store(part_ptr + pid_s * M * N + offs_m[None, :] * N + offs_n[:, None], acc, mask=m_ok[None, :])
    else:
        tl.store(part_ptr + pid_s * M * N + offs_m[:, None] * N + offs_n[None, :], acc, mask=m_ok[:, None])
    if TIMES:
        _store_times(t_ptr, pid_n * tl.num_programs(1) + pid_s, t_start, pid_n)


_LAST: dict = {}  # name -> the CompiledKernel of the wrapper's latest launch


def tile_weight(wd: torch.Tensor, bn: int) -> torch.Tensor:
    """(N, K) -> (N/bn, K/128, bn, 128) contiguous: each split-K program's weight is one contiguous range."""
    n, k = wd.shape
    return wd.view(n // bn, bn, k // 128, 128).permute(0, 2, 1, 3).contiguous()


def _cluster_call(kernel, grid, size: int, args: dict, **options) -> None:
    """Launch a probe kernel (every argument by name in args) over grid with its axis-0 programs in clusters of
    `size` (engine.kernels.cluster, no reduce region), then make the compiled kernel's plain launches plain again."""
    from engine.kernels import cluster as cl

    comp = cl.launch(kernel, (grid[0] // size,) + tuple(grid[1:]), size, 0, args, **options)
    comp.packed_metadata = (comp.metadata.num_warps, 1, comp.metadata.shared)
    comp._engine_cluster = None


def layout_gemm(xd, xs, wd, ws, wt=None, bn=64, splits=4, warps=4, stages=4, tma=False, times=None, swap=True,
                cluster=1):
    """`_layout_gemm_probe_kernel` on the row-major weight wd, or on wt = tile_weight(wd, bn) when given; returns
    the split partials (splits, M, N). times: an int64 (programs, 3) tensor to record into. cluster > 1: launched in
    clusters of that many adjacent weight tiles (the kernel has no cluster instruction: the launch's own cost)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = xd.shape
    n = wd.shape[0]
    kb = k // 128
    per = -(-kb // splits)
    part = torch.empty((splits, m, n), device=xd.device, dtype=torch.float32)  # every (split, row < M, n) written
    if wt is None:
        strides, rows = (bn * k, k, 128), (bn, 0, 128)
        desc = TensorDescriptor.from_tensor(wd, [bn, 128]) if tma else None
    else:
        strides, rows = (kb * bn * 128, 128, bn * 128), (kb * bn, bn, 0)
        desc = TensorDescriptor.from_tensor(wt.view(-1, 128), [bn, 128]) if tma else None
    args = (desc, xd, xs, wd if wt is None else wt, ws, part, times if times is not None else part, m, n, k, per,
            xd.stride(0), xs.stride(0), ws.stride(0), *strides, *rows)
    meta = dict(BM=max(16 if swap else 64, triton.next_power_of_2(m)), BN=bn, USE_TMA=tma, TIMES=times is not None,
                SWAP=swap)
    if cluster > 1:
        _cluster_call(_layout_gemm_probe_kernel, (n // bn, splits), cluster,
                      dict(zip(_layout_gemm_probe_kernel.arg_names, args), **meta), num_warps=warps, num_stages=stages)
        return part
    _LAST["layout_gemm"] = _layout_gemm_probe_kernel[(n // bn, splits)](*args, **meta, num_warps=warps,
                                                                        num_stages=stages)
    return part


def _read_floor(nbytes: int, sms: int) -> tuple[float, dict]:
    """The fastest one-call contiguous read of nbytes (programs per SM, words per step, warps, stages swept)."""
    buf = torch.ones(nbytes // 4, dtype=torch.int32, device=DEV)
    out = torch.empty(64 * sms, dtype=torch.int32, device=DEV)
    best = (float("inf"), {})
    for pps in (1, 2, 4, 8, 16, 32):
        for block in (1024, 2048, 4096):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    progs = pps * sms
                    per = -(-buf.numel() // progs)
                    per = -(-per // block) * block
                    t = time_us(lambda: _chunk_read_kernel[(progs,)](buf, out, buf.numel(), per, BLOCK=block,
                                                                     STAGES=stages, num_warps=warps), reps=20)
                    if t < best[0]:
                        best = (t, dict(progs_per_sm=pps, block=block, warps=warps, stages=stages))
    t_amax = time_us(lambda: buf.amax(), reps=20)
    if t_amax < best[0]:
        best = (t_amax, {"torch": "amax"})
    return best


def probe_gemm_floor(copy_tbs: float, ms=(4, 16)) -> None:
    """What one decode GEMM call can reach: the fixed cost of a timed call (`_noop_kernel`), the fastest contiguous
    read of each decode weight's bytes (`_chunk_read_kernel`, swept; torch amax), the split-K access pattern
    without MMA on the row-major and on a tiled (N/BN, K/128, BN, 128) weight (`_tile_read_kernel`), and the
    split-K loop itself on both layouts, plain or TMA loads (`_layout_gemm_probe_kernel`, reduce not timed), vs
    production on 4096x14336."""
    from engine.kernels import sm_count

    sms = sm_count(torch.device(DEV))
    print(f"\n## one decode call: fixed cost, read floors, access pattern, weight layout (flush {FLUSH})")
    one = torch.zeros(1, dtype=torch.int32, device=DEV)
    t_noop = time_us(lambda: _noop_kernel[(1,)](one), reps=50)
    many = torch.zeros(2 * sms, dtype=torch.int32, device=DEV)
    t_noop_full = time_us(lambda: _noop_kernel[(2 * sms,)](many), reps=50)
    print(f"  empty kernel: 1 program {t_noop:.2f} us, {2 * sms} programs {t_noop_full:.2f} us", flush=True)
    floors = {}
    for n, k in DECODE_SHAPES:
        nbytes = n * k + (n // 128) * (k // 128) * 4
        t, cfg = _read_floor(nbytes, sms)
        floors[(n, k)] = t
        print(f"  read floor {n}x{k} ({nbytes / 1e6:.1f} MB): {t:6.2f} us {nbytes / t / 1e6:5.2f} TB/s {cfg}; "
              f"3.0 TB/s needs {nbytes / 3e6:.2f} us", flush=True)
    n, k = 4096, 14336
    kb = k // 128
    _, _, wd, ws = fp8_block_operands(1, n, k, seed=n)
    wbytes = wd.numel() + ws.numel() * 4
    out = torch.empty(16 * sms * 16, dtype=torch.int32, device=DEV)
    print(f"\n  {n}x{k}: the split-K access pattern without MMA (us; fastest stages of 2-6)")
    tiled = {bn: tile_weight(wd, bn) for bn in (64, 128)}
    for bn in (64, 128):
        for split in (1, 2, 4, 7, 8, 14):
            if (n // bn) * split < sms or (n // bn) * split > 16 * sms:
                continue
            per = -(-kb // split)
            row = []
            for name, src, strides in (("row-major", wd, (bn * k // 4, k // 4, 32)),
                                       ("tiled", tiled[bn], (kb * bn * 32, 32, bn * 32))):
                w32 = src.view(torch.int32)
                ts = [time_us(lambda st=st: _tile_read_kernel[(n // bn, split)](
                    w32, out, out, per, kb, *strides, BN=bn, STAGES=st, num_warps=4), reps=20) for st in (2, 3, 4, 5, 6)]
                row.append(f"{name} {min(ts):6.2f} us {wbytes / min(ts) / 1e6:5.2f} TB/s")
            print(f"    BN={bn:3d} splits={split:2d}: " + " | ".join(row), flush=True)
    for n_, k_, m, (xd, xs, wd_, ws_), wbytes_, t16, t0, ref in _small_m_cases([(n, k)], ms):
        _case_line(n_, k_, m, t16, t0, wbytes_)
        res = []
        for layout in ("row-major", "tiled"):
            for tma in (False, True):
                for bn in (64, 128):
                    wt = tile_weight(wd_, bn) if layout == "tiled" else None
                    for split in (2, 4, 7, 8, 14):
                        if (n // bn) * split < sms or (n // bn) * split > 16 * sms:
                            continue
                        for warps, stages in ((4, 3), (4, 4), (4, 5), (4, 6), (8, 4)):
                            cfg = dict(layout=layout, bn=bn, splits=split, warps=warps, stages=stages, tma=tma)
                            _sweep_one(res, cfg, lambda cfg=cfg, wt=wt: layout_gemm(
                                xd, xs, wd_, ws_, wt=wt, **{c: v for c, v in cfg.items() if c != "layout"}), ref,
                                quiet="out of resource")
        _top(res, wbytes_, copy_tbs, "production", n=8)
        for layout in ("row-major", "tiled"):
            for tma in (False, True):
                b = [r for r in res if r[1]["layout"] == layout and r[1]["tma"] == tma]
                if b:
                    print(f"      best {layout:9} tma={tma!s:5}: {b[0][0]:6.2f} us {wbytes_ / b[0][0] / 1e6:5.2f} TB/s "
                          f"{t16 / b[0][0]:4.2f}x bf16 ({100 * floors[(n, k)] / b[0][0]:.0f}% of the read floor) "
                          f"{b[0][1]}", flush=True)


def _timed_reps(run, n_progs: int, cols: int, reps: int = 15) -> tuple[float, torch.Tensor]:
    """run(times) over reps timed like `time_us` (flush, GPU sleep, events), each into its own int64 (n_progs, cols)
    times buffer: (event us, times as float64 on the CPU) of the rep with the median event time."""
    from benchmarks.bench_gemm import _evict_l2, _gpu_sleep

    bufs = [torch.zeros((n_progs, cols), dtype=torch.int64, device=DEV) for _ in range(reps)]
    run(bufs[0])
    _evict_l2(FLUSH)
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for (a, b), buf in zip(ev, bufs):
        _evict_l2(FLUSH)
        _gpu_sleep(200.0)
        a.record()
        run(buf)
        b.record()
    torch.cuda.synchronize()
    us = [a.elapsed_time(b) * 1e3 for a, b in ev]
    i = sorted(range(reps), key=lambda j: us[j])[reps // 2]
    return us[i], bufs[i].double().cpu()


def _timeline(run, n_progs: int, reps: int = 15) -> dict:
    """Per-program (start, end, SM) of run(times) (`_timed_reps`), summarized."""
    event, t = _timed_reps(run, n_progs, 3, reps)
    st, en, sm = t[:, 0] - t[:, 0].min(), t[:, 1] - t[:, 0].min(), t[:, 2].long()
    dur = (en - st) / 1e3
    per_sm = torch.bincount(sm)
    return dict(event_us=event, span_us=float(en.max()) / 1e3, start_skew_us=float(st.max()) / 1e3,
                first_end_us=float(en.min()) / 1e3, dur_p10=float(dur.quantile(0.1)), dur_p50=float(dur.median()),
                dur_max=float(dur.max()), progs_per_sm=f"{int(per_sm[per_sm > 0].min())}-{int(per_sm.max())}",
                sms_used=int((per_sm > 0).sum()))


def _timeline_case(m: int):
    """4096x14336 operands at M = m for the timeline probes: (N, K, K/128, (xd, xs, wd, ws), weight bytes, the
    weight as int32 words, an int32 scratch output for `_tile_read_kernel`)."""
    n, k = 4096, 14336
    xd, xs, _, _ = fp8_block_operands(m, 16, k, seed=m)
    _, _, wd, ws = fp8_block_operands(1, n, k, seed=n)
    out = torch.empty(16 * 132 * 16, dtype=torch.int32, device=DEV)
    return n, k, k // 128, (xd, xs, wd, ws), wd.numel() + ws.numel() * 4, wd.view(torch.int32), out


def probe_gemm_timeline(copy_tbs: float, m: int = 4) -> None:
    """4096x14336 at M = 4: when each program starts and ends (%globaltimer) for the split-K access pattern without
    MMA (`_tile_read_kernel`) and the split-K MMA loop (`_layout_gemm_probe_kernel`), timed as `time_us`: whether
    the MMA kernel's extra time over a pure read is in its start, its steady state or its tail."""
    n, k, kb, (xd, xs, wd, ws), wbytes, w32, out = _timeline_case(m)
    print(f"\n## program timeline, {n}x{k} M={m} (flush {FLUSH}; us from the first program's start)")
    print(f"  {'kernel':58} {'event':>6} {'span':>6} {'start':>6} {'1st end':>7} {'dur p10':>7} {'p50':>6} "
          f"{'max':>6} {'TB/s span':>9} progs/SM")
    cases = []
    for bn, split, st in ((64, 4, 3), (64, 4, 5), (64, 8, 4), (128, 7, 3)):
        per = -(-kb // split)
        cases.append((f"pattern read BN={bn} splits={split} stages={st}", (n // bn) * split,
                      lambda buf, bn=bn, split=split, st=st, per=per: _tile_read_kernel[(n // bn, split)](
                          w32, out, buf, per, kb, bn * k // 4, k // 4, 32, BN=bn, STAGES=st, TIMES=True,
                          num_warps=4)))
    for bn, split, st, tiled, tma in ((64, 4, 5, False, False), (64, 4, 3, False, False), (64, 8, 4, False, False),
                                      (128, 7, 3, True, False), (128, 8, 4, False, True)):
        wt = tile_weight(wd, bn) if tiled else None
        cases.append((f"MMA {'tiled' if tiled else 'row-major'} BN={bn} splits={split} stages={st} tma={tma}",
                      (n // bn) * split,
                      lambda buf, bn=bn, split=split, st=st, wt=wt, tma=tma: layout_gemm(
                          xd, xs, wd, ws, wt=wt, bn=bn, splits=split, stages=st, tma=tma, times=buf)))
    for name, progs, run in cases:
        r = _timeline(run, progs)
        print(f"  {name:58} {r['event_us']:6.2f} {r['span_us']:6.2f} {r['start_skew_us']:6.2f} "
              f"{r['first_end_us']:7.2f} {r['dur_p10']:7.2f} {r['dur_p50']:6.2f} {r['dur_max']:6.2f} "
              f"{wbytes / r['span_us'] / 1e6:9.2f} {r['progs_per_sm']} on {r['sms_used']} SMs", flush=True)


def probe_wgmma_timeline(copy_tbs: float) -> None:
    """4096x14336, the Gluon wgmma kernel with K splits (`gemm_wgmma.launch(splits=S, swap=True)`, its
    TIMES build) timed as `time_us` (one call after a clean flush), next to the pure-read access pattern and the
    split-K MMA loop of `probe_gemm_timeline`: per program %globaltimer at its start, when its first stage has arrived,
    after its loop and at its end (us from the first program's start; p50 / max over programs)."""
    from engine.kernels import gemm_wgmma as GW

    print(f"\n## Gluon wgmma program timeline, 4096x14336 (flush {FLUSH}; us from the first program's start)")
    print(f"  {'kernel':44} {'event':>6} {'span':>6} {'start max':>9} {'1st data p50/max':>16} "
          f"{'loop end p50/max':>16} {'end p50/max':>12} {'TB/s span':>9} progs/SM")
    for m in (4, 16):
        n, k, kb, (xd, xs, wd, ws), wbytes, w32, out = _timeline_case(m)
        if m == 4:
            for bn, split, st in ((64, 4, 3),):
                r = _timeline(lambda buf, bn=bn, split=split, st=st: _tile_read_kernel[(n // bn, split)](
                    w32, out, buf, -(-kb // split), kb, bn * k // 4, k // 4, 32, BN=bn, STAGES=st, TIMES=True,
                    num_warps=4), (n // bn) * split)
                print(f"  {'pattern read BN=64 splits=4 stages=3':44} {r['event_us']:6.2f} {r['span_us']:6.2f} "
                      f"{r['start_skew_us']:9.2f} {'':>16} {'':>16} {'':>12} {wbytes / r['span_us'] / 1e6:9.2f} "
                      f"{r['progs_per_sm']}", flush=True)
        res = torch.empty((m, n), device=DEV, dtype=torch.bfloat16)
        for split, gps, st in ((1, 2, 6), (2, 2, 4), (2, 4, 3), (4, 2, 4), (4, 4, 3), (4, 2, 6), (8, 2, 3)):
            s_eff, _ = GW.split_plan(kb, split, gps)
            progs = (n // 64) * s_eff

            def run(buf, split=split, gps=gps, st=st):
                GW.launch(xd, xs, xs.stride(), wd, ws, ws.stride(), None, res, False, 64, st, gps, splits=split,
                          swap=True, times=buf)

            event, t = _timed_reps(run, progs, 5)
            t0 = t[:, 0].min()
            st_, fd, le, en = ((t[:, j] - t0) / 1e3 for j in range(4))
            first = (fd - st_)
            per_sm = torch.bincount(t[:, 4].long())
            q = lambda v: f"{float(v.median()):6.2f}/{float(v.max()):6.2f}"
            print(f"  {f'M={m} wgmma splits={s_eff} gps={gps} stages={st}':44} {event:6.2f} {float(en.max()):6.2f} "
                  f"{float(st_.max()):9.2f} {q(first):>16} {q(le):>16} {q(en):>12} "
                  f"{wbytes / float(en.max()) / 1e6:9.2f} {int(per_sm[per_sm > 0].min())}-{int(per_sm.max())} on "
                  f"{int((per_sm > 0).sum())} SMs", flush=True)


def _set_carveout(kernel, cache_config=None, carveout=None) -> None:
    """cuFuncSetCacheConfig / the preferred shared-memory carveout (percent) of a compiled Triton kernel (ctypes on
    libcuda; Triton itself sets CU_FUNC_CACHE_PREFER_SHARED on kernels with more than 48 KB of shared memory)."""
    import ctypes

    cu = ctypes.CDLL("libcuda.so.1")
    kernel._init_handles()
    fn = ctypes.c_void_p(kernel.function)
    if cache_config is not None:
        rc = cu.cuFuncSetCacheConfig(fn, ctypes.c_int(cache_config))
        assert rc == 0, f"cuFuncSetCacheConfig -> {rc}"
    if carveout is not None:
        rc = cu.cuFuncSetAttribute(fn, ctypes.c_int(9), ctypes.c_int(carveout))  # PREFERRED_SHARED_MEMORY_CARVEOUT
        assert rc == 0, f"cuFuncSetAttribute(carveout) -> {rc}"


def probe_gemm_carveout(copy_tbs: float, m: int = 4) -> None:
    """4096x14336 at M = 4: the time a single call spends outside its programs (event time minus the span from the
    first program's start to the last one's end) against the kernel's shared memory and its L1 / shared carveout
    preference, and with the same kernel run just before the flush (the SMs already configured for it)."""
    n, k, kb, (xd, xs, wd, ws), wbytes, w32, out = _timeline_case(m)
    print(f"\n## outside-the-programs time vs shared memory / carveout, {n}x{k} M={m} (flush {FLUSH})")
    print(f"  {'kernel':64} {'smem KB':>7} {'event':>6} {'span':>6} {'outside':>7} {'TB/s':>5}")

    def line(name, run, progs, kern):
        r = _timeline(run, progs)
        print(f"  {name:64} {kern.metadata.shared / 1024:7.1f} {r['event_us']:6.2f} {r['span_us']:6.2f} "
              f"{r['event_us'] - r['span_us']:7.2f} {wbytes / r['event_us'] / 1e6:5.2f}", flush=True)

    per = kb // 4
    for st in (2, 3, 4, 5, 6, 7, 8):
        run = (lambda buf, st=st: _tile_read_kernel[(n // 64, 4)](w32, out, buf, per, kb, 64 * k // 4, k // 4, 32,
                                                                   BN=64, STAGES=st, TIMES=True, num_warps=4))
        kern = run(torch.zeros((256, 3), dtype=torch.int64, device=DEV))
        line(f"pattern read BN=64 splits=4 stages={st}", run, 256, kern)
    for st in (2, 3, 4, 5, 6):
        run = (lambda buf, st=st: layout_gemm(xd, xs, wd, ws, bn=64, splits=4, stages=st, times=buf))
        run(torch.zeros((256, 3), dtype=torch.int64, device=DEV))
        kern = _LAST["layout_gemm"]
        line(f"MMA BN=64 splits=4 stages={st}", run, 256, kern)
        if st == 5:
            for cc, cv, label in ((0, None, "cache config none"), (0, 100, "none + carveout 100%"),
                                  (1, 100, "prefer shared + carveout 100%"), (3, None, "prefer equal"),
                                  (1, None, "prefer shared (Triton's)")):
                try:
                    _set_carveout(kern, cc, cv)
                    line(f"MMA BN=64 splits=4 stages=5, {label}", run, 256, kern)
                except Exception as exc:  # noqa: BLE001 -- a probe: report and go on
                    print(f"    {label}: FAILED {type(exc).__name__}: {exc}")

            print("  (next: the same kernel also runs right before each flush)")
            from benchmarks import bench_gemm as B
            orig = B._evict_l2

            def evict_after_prime(flush, run=run):
                run(torch.zeros((256, 3), dtype=torch.int64, device=DEV))
                orig(flush)
            B._evict_l2 = evict_after_prime
            try:
                line("MMA BN=64 splits=4 stages=5, primed", run, 256, kern)
            finally:
                B._evict_l2 = orig
    print("\n  production and bf16 cuBLAS, one call (us): as timed by bench_gemm | the same call also right before "
          "each flush")
    import torch.nn.functional as F

    from benchmarks import bench_gemm as B
    from engine.kernels import gemm as G

    w16 = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
    for mm in (1, 4, 16):
        xd, xs, _, _ = fp8_block_operands(mm, 16, k, seed=mm)
        x16 = torch.randn(mm, k, device=DEV, dtype=torch.bfloat16)
        row = []
        for name, fn in (("fp8", lambda: G.fp8_block_linear(xd, xs, wd, ws)), ("bf16", lambda: F.linear(x16, w16))):
            t = time_us(fn, reps=30)
            orig = B._evict_l2

            def evict_after_prime(flush, fn=fn, orig=orig):
                fn()
                orig(flush)
            B._evict_l2 = evict_after_prime
            try:
                tp = time_us(fn, reps=30)
            finally:
                B._evict_l2 = orig
            row.append((t, tp))
        (t8, t8p), (t16, t16p) = row
        print(f"    M={mm:2d}: fp8 {t8:6.2f} | {t8p:6.2f} us ({wbytes / t8 / 1e6:.2f} | {wbytes / t8p / 1e6:.2f} TB/s); "
              f"bf16 {t16:6.2f} | {t16p:6.2f} us; x bf16 {t16 / t8:.2f} | {t16p / t8p:.2f}", flush=True)


def probe_gemm_tail(copy_tbs: float, ms=(4, 16)) -> None:
    """4096x14336 at M = 4 / 16, one call each (us): production's split-K kernel with its fused reduce, with the
    separate reduce kernel, `_gps_probe_kernel` (production's loop and fused reduce), and the split-K loop alone
    (`_layout_gemm_probe_kernel`: partials only, no reduce) -- what the reduce at the end of a call costs; then
    the M = 1 GEMV's knobs on this shape."""
    from engine.kernels import gemm as G

    n, k = 4096, 14336
    f32 = torch.float32
    print(f"\n## split-K reduce cost, {n}x{k} (flush {FLUSH}; production knobs: 4 splits, BN 64, 4 warps, 5 stages)")
    for n_, k_, m, (xd, xs, wd, ws), wbytes, t16, t0, ref in _small_m_cases([(n, k)], ms):
        _case_line(n_, k_, m, t16, t0, wbytes)
        knobs = dict(split_k=4, block_n=64, num_warps=4, num_stages=5)
        dbg = torch.zeros(4096, dtype=torch.int32, device=DEV)
        for name, fn in (
                ("production, fused reduce", lambda: G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=f32,
                                                                             fused_reduce=True, **knobs)),
                ("production, reduce kernel", lambda: G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=f32,
                                                                              fused_reduce=False, **knobs)),
                ("gps probe, reduce 0 (acq_rel reset)", lambda: gps_gemm(xd, xs, wd, ws, bn=64, splits=4, stages=5)),
                ("gps probe, reduce 1 (plain reset)", lambda: gps_gemm(xd, xs, wd, ws, bn=64, splits=4, stages=5,
                                                                       reduce=1)),
                ("gps probe, reduce 2 (poll, regs)", lambda: gps_gemm(xd, xs, wd, ws, bn=64, splits=4, stages=5,
                                                                      reduce=2, dbg=dbg)),
                ("gps probe, reduce 3 (poll, tl.load)", lambda: gps_gemm(xd, xs, wd, ws, bn=64, splits=4, stages=5,
                                                                         reduce=3, dbg=dbg)),
                ("split-K loop alone, partials", lambda: layout_gemm(xd, xs, wd, ws, bn=64, splits=4, stages=5))):
            out = fn()
            err = ((out.sum(0) if out.dim() == 3 else out) - ref).abs().max().item() / ref.abs().max().item()
            ts = sorted(time_us(fn, reps=30) for _ in range(3))
            polls = ""
            if "poll" in name:
                d = dbg[: n // 64].float()
                polls = f"  polling passes per tile: mean {float(d.mean()):.2f} max {int(d.max())}"
            print(f"    {name:36} {ts[1]:6.2f} us (of 3 runs: {ts[0]:.2f}-{ts[2]:.2f}) {wbytes / ts[1] / 1e6:5.2f} TB/s "
                  f"{t16 / ts[1]:4.2f}x bf16  rel err vs production {err:.1e}{polls}", flush=True)
        r = _timeline(lambda buf: layout_gemm(xd, xs, wd, ws, bn=64, splits=4, stages=5, times=buf), 256)
        print(f"    split-K loop alone, timeline: event {r['event_us']:.2f} span {r['span_us']:.2f} outside "
              f"{r['event_us'] - r['span_us']:.2f} us", flush=True)
    probe_gemv_knobs(copy_tbs, shapes=((n, k),))


def probe_gemm_nosplit(copy_tbs: float, ms=(4, 16)) -> None:
    """4096x14336 at M = 4 / 16 without a split-K reduce: `_layout_gemm_probe_kernel` with 1-2 K splits on narrow
    weight tiles (BN 16 / 32: 256 / 128 programs) and deep pipelines, so that one call ends with its own stores
    (split 1 is a complete GEMM; split 2's partials are summed by torch, untimed)."""
    n, k = 4096, 14336
    print(f"\n## no split-K reduce: narrow tiles, deep pipelines, {n}x{k} (flush {FLUSH})")
    for n_, k_, m, (xd, xs, wd, ws), wbytes, t16, t0, ref in _small_m_cases([(n, k)], ms):
        _case_line(n_, k_, m, t16, t0, wbytes)
        res = []
        for bn, split in ((16, 1), (32, 1), (32, 2), (64, 2)):
            for warps in (1, 2, 4):
                for stages in (4, 6, 8, 10, 12, 16):
                    cfg = dict(bn=bn, splits=split, warps=warps, stages=stages)
                    _sweep_one(res, cfg, lambda cfg=cfg: layout_gemm(xd, xs, wd, ws, **cfg), ref,
                               quiet="out of resource")
        _top(res, wbytes, copy_tbs, "production", n=10)
        for bn, split in ((16, 1), (32, 1), (32, 2), (64, 2)):
            b = [r for r in res if r[1]["bn"] == bn and r[1]["splits"] == split]
            if b:
                print(f"      best BN={bn} splits={split}: {b[0][0]:6.2f} us {wbytes / b[0][0] / 1e6:5.2f} TB/s "
                      f"{t16 / b[0][0]:4.2f}x bf16 {b[0][1]}", flush=True)


def probe_gemm_noswap(copy_tbs: float, ms=(4, 16)) -> None:
    """4096x14336 at M = 4 / 16 with the activation on the MMA's M side (rows padded to 64) and the weight tile on
    its N side (`_layout_gemm_probe_kernel` SWAP=False): BN 16 / 32 weight rows per program give 256 / 128 programs
    with no K split and so no reduce; vs the swapped split-K loop alone (partials, untimed reduce)."""
    n, k = 4096, 14336
    print(f"\n## X @ W^T with narrow weight tiles on the wgmma N side, {n}x{k} (flush {FLUSH})")
    for n_, k_, m, (xd, xs, wd, ws), wbytes, t16, t0, ref in _small_m_cases([(n, k)], ms):
        _case_line(n_, k_, m, t16, t0, wbytes)
        res = []
        for bn, split in ((16, 1), (32, 1), (16, 2), (32, 2), (64, 2), (64, 4)):
            for warps in (4, 8):
                for stages in (3, 4, 6, 8, 10, 12):
                    cfg = dict(bn=bn, splits=split, warps=warps, stages=stages, swap=False)
                    _sweep_one(res, cfg, lambda cfg=cfg: layout_gemm(xd, xs, wd, ws, **cfg), ref,
                               quiet="out of resource")
        for stages in (4, 5):
            cfg = dict(bn=64, splits=4, warps=4, stages=stages, swap=True)
            _sweep_one(res, cfg, lambda cfg=cfg: layout_gemm(xd, xs, wd, ws, **cfg), ref)
        _top(res, wbytes, copy_tbs, "production", n=10)
        for bn, split in ((16, 1), (32, 1), (16, 2), (32, 2), (64, 2), (64, 4)):
            b = [r for r in res if r[1]["bn"] == bn and r[1]["splits"] == split and not r[1]["swap"]]
            if b:
                print(f"      best BN={bn} splits={split}: {b[0][0]:6.2f} us {wbytes / b[0][0] / 1e6:5.2f} TB/s "
                      f"{t16 / b[0][0]:4.2f}x bf16 {b[0][1]} rel err {b[0][2]:.1e}", flush=True)


def probe_gemm_wholek(copy_tbs: float, shapes=((4096, 14336), (28672, 4096), (7168, 16384), (4096, 4096),
                                              (6144, 4096)), ms=(4, 16)) -> None:
    """The decode GEMM with no split-K (`whole_k=2 / 4`, the Gluon wgmma kernel of
    engine.kernels.gemm_wgmma: each program streams block_n whole weight rows through a TMA ring of num_stages
    stages of 2 / 4 groups) over block_n, groups per stage and stages, vs production (the split-K kernel, fused reduce) and bf16 cuBLAS; one call each.
    Also: its bits vs the split-K kernel with one split (the same per-group math), and the best config back to
    back in a CUDA graph (3 weight copies, so that calls do not find the weight in L2)."""
    from engine.kernels import gemm as G
    from engine.kernels import gemm_wgmma as GW

    print(f"\n## whole-K Gluon wgmma decode GEMM vs production split-K (flush {FLUSH}; one call)")
    for n, k, m, (xd, xs, wd, ws), wbytes, t16, t0, ref in _small_m_cases(shapes, ms):
        _case_line(n, k, m, t16, t0, wbytes)
        f32 = torch.float32
        one = G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=f32, split_k=1, block_n=32)
        res = []
        for bn in GW.BLOCK_NS:
            for gps, stages in ((4, 2), (4, 3), (4, 4), (2, 3), (2, 4), (2, 6), (2, 8)):
                if GW.plan_error(m, n, k, bn, stages, gps):
                    continue
                cfg = dict(whole_k=gps, block_n=bn, num_stages=stages)
                _sweep_one(res, cfg, lambda cfg=cfg: G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=f32, **cfg),
                           ref)
        _top(res, wbytes, copy_tbs, "production", n=8)
        if not res:
            continue
        best = res[0][1]
        out = G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=f32, **best)
        same = torch.equal(out.view(torch.int32), G.fp8_block_gemm_triton(
            xd, xs, wd, ws, out_dtype=f32, split_k=1, block_n=best["block_n"]).view(torch.int32))
        rel1 = ((out - one).abs().max() / one.abs().max()).item()
        copies = [(wd.clone(), ws.clone()) for _ in range(3)]
        tg = graph_us([lambda w_=w_, s_=s_: G.fp8_block_gemm_triton(xd, xs, w_, s_, out_dtype=f32, **best)
                       for w_, s_ in copies])
        tg0 = graph_us([lambda w_=w_, s_=s_: G.fp8_block_linear(xd, xs, w_, s_, out_dtype=f32) for w_, s_ in copies])
        del copies
        print(f"      best {best}: {res[0][0]:6.2f} us {wbytes / res[0][0] / 1e6:5.2f} TB/s "
              f"{t16 / res[0][0]:4.2f}x bf16 (production {t0:6.2f} us); bits == split_k=1 (block_n "
              f"{best['block_n']}): {same}, rel diff vs split_k=1 block_n 32 {rel1:.1e}; CUDA graph {tg:6.2f} us "
              f"{wbytes / tg / 1e6:5.2f} TB/s (production {tg0:6.2f} us {wbytes / tg0 / 1e6:5.2f} TB/s)", flush=True)


def probe_gemm_wholek_rotate(copy_tbs: float, n: int = 4096, k: int = 14336, ms=(4, 16),
                             ws_too: bool = False) -> None:
    """The whole-K Gluon kernel with each program starting its K walk at its own chunk
    (`engine.kernels.gemm_wgmma.launch(rotate=True)`), so that the programs do not all read the same activation
    tile at once, vs the same config walking K from 0; with ws_too also warp-specialized (a producer warp for the
    TMA loads, `warp_spec=True`); one call each (us)."""
    from engine.kernels import gemm_wgmma as GW

    print(f"\n## whole-K Gluon kernel, rotated vs aligned K walk, {n}x{k} (flush {FLUSH}; one call)")
    for n_, k_, m, (xd, xs, wd, ws), wbytes, t16, t0, ref in _small_m_cases([(n, k)], ms):
        _case_line(n_, k_, m, t16, t0, wbytes)
        res = []
        for bn in (32, 64):
            for gps, stages in ((4, 3), (4, 4), (2, 6), (2, 8)):
                for rotate, warp_spec in ((False, False), (True, False)) + (((False, True), (True, True)) if ws_too
                                                                            else ()):
                    if GW.plan_error(m, n, k, bn, stages, gps):
                        continue
                    cfg = dict(block_n=bn, gps=gps, stages=stages, rotate=rotate, warp_spec=warp_spec)

                    def run(cfg=cfg):
                        out = torch.empty((m, n), device=DEV, dtype=torch.float32)
                        GW.launch(xd, xs, xs.stride(), wd, ws, ws.stride(), None, out, False, cfg["block_n"],
                                  cfg["stages"], cfg["gps"], cfg["rotate"], cfg["warp_spec"])
                        return out
                    _sweep_one(res, cfg, run, ref)
        _top(res, wbytes, copy_tbs, "production", n=16)


def probe_gemm_cluster(copy_tbs: float, ms=(4, 16)) -> None:
    """The split-K decode GEMM with the splits of each tile in one thread-block cluster, reduced through distributed
    shared memory (`cluster=True`), vs the fused reduce through global memory (production): same bits for the same
    splits and tile (checked), one call each (us). The issue's split-K shapes and the Llama-3-8B attention shapes,
    M = 4 / 16, over splits, tile rows and pipeline depth; the `_engine_max_clusters` the device holds at once."""
    from engine.kernels import gemm as G

    shapes = ((4096, 14336), (7168, 16384), (4096, 4096), (6144, 4096))
    f32 = torch.float32
    print(f"\n## cluster (DSMEM) split-K reduce vs the fused reduce (flush {FLUSH}; one call)")
    for n, k, m, (xd, xs, wd, ws), wbytes, t16, t0, ref in _small_m_cases(shapes, ms):
        _case_line(n, k, m, t16, t0, wbytes)
        res = []
        for split in (2, 4, 8):
            for bn in (32, 64, 128):
                base = dict(split_k=split, block_n=bn, num_warps=4)
                fused = G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=f32, fused_reduce=True, num_stages=4,
                                                **base)
                for stages in (3, 4, 5, 6):
                    cfg = dict(base, num_stages=stages)
                    try:
                        out = G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=f32, cluster=True, **cfg)
                    except Exception as exc:  # noqa: BLE001 -- a probe: report and go on
                        print(f"    {cfg} FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:150]}")
                        continue
                    same = torch.equal(out, fused)
                    t = time_us(lambda cfg=cfg: G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=f32, cluster=True,
                                                                        **cfg), reps=30)
                    res.append((t, dict(cfg, same_bits_as_fused=same), 0.0))
                    if not same:
                        print(f"    {cfg} BITS DIFFER from the fused reduce", flush=True)
                tf = time_us(lambda: G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=f32, fused_reduce=True,
                                                             num_stages=5, **base), reps=30)
                print(f"    fused reduce split {split} BN {bn} 5 stages: {tf:6.2f} us {wbytes / tf / 1e6:5.2f} TB/s",
                      flush=True)
        _top(res, wbytes, copy_tbs, "itself", n=8)
        if not res:
            continue
        best = res[0]
        print(f"      best cluster: {best[0]:6.2f} us {wbytes / best[0] / 1e6:5.2f} TB/s {t16 / best[0]:4.2f}x bf16 "
              f"(production {t0:6.2f} us)", flush=True)
    try:  # the compiled cluster kernels carry the occupancy engine.kernels.cluster measured for them
        compiled = list(G._fp8_block_gemm_kernel.device_caches[torch.cuda.current_device()][0].values())
    except (AttributeError, IndexError, KeyError, TypeError) as exc:
        print(f"    (no kernel cache to list: {exc})")
        compiled = []
    for kern in compiled:
        if getattr(kern, "_engine_cluster", None):
            print(f"    compiled CLUSTER={kern._engine_cluster[0]} region {kern._engine_cluster[1]} B, Triton's shared "
                  f"{kern.metadata.shared} B, {kern.metadata.num_stages} stages: {kern._engine_max_clusters} clusters "
                  "at once", flush=True)


def production_partials(xd, xs, wd, ws, splits=4, bn=64, warps=4, stages=5):
    """Production's split-K kernel (`_fp8_block_gemm_kernel`) storing its partials (splits, M, N) and nothing else:
    no counter, no reduce."""
    from engine.kernels import gemm as G
    from engine.kernels.pdl import launch_opts

    m, k = xd.shape
    n = wd.shape[0]
    part = torch.empty((splits, m, n), device=xd.device, dtype=torch.float32)
    G._fp8_block_gemm_kernel[(n // bn, 1, splits)](
        xd, xs, wd, ws, part, part, part, part, m, n, k, -(-k // 128 // splits), splits, xd.stride(0), wd.stride(0),
        xs.stride(0), xs.stride(1), ws.stride(0), ws.stride(1), BM=max(16, triton.next_power_of_2(m)), BN=bn,
        USE_PART=True, HAS_BIAS=False, FUSED_REDUCE=False, num_warps=warps, num_stages=stages, **launch_opts(xd))
    return part


@triton.jit
def _peek_partial(part_ptr, s, idx, mask, MN, SPLITS: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr):
    """Split s's partial of the tile as int32 bits (volatile loads: from L2, re-issued on every call), or +0.0 bits
    for a split that does not exist (s >= SPLITS - 1: the reducer's own)."""
    if s < SPLITS - 1:
        return tl.load(part_ptr + s * MN + idx, mask=mask, other=0.0, volatile=True).to(tl.int32, bitcast=True)
    else:
        return tl.zeros((BN, BM), dtype=tl.int32)


@triton.jit
def _any_pending(v0, v1, v2):
    """Whether any element of the three partials' bits still reads PENDING_BITS."""
    busy = ((v0 == PENDING_BITS) | (v1 == PENDING_BITS) | (v2 == PENDING_BITS)).to(tl.int32)
    return tl.sum(tl.sum(busy, axis=1), axis=0) > 0


@triton.jit
def _early_reduce_probe_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, dbg_ptr, M, N, K, per,
                               stride_xm, stride_wn, stride_xsm, stride_xsg, stride_wsn, stride_wsg,
                               BM: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr, TAIL: tl.constexpr,
                               PDL: tl.constexpr = False):
    """Split-K with a fixed reducer and no handshake. Splits 0..S-2 of a tile walk `per` 128-groups
    each and store their partial into a PENDING_BITS workspace (a partial that reads PENDING_BITS is stored as
    the canonical NaN) and exit: no fence, no counter. The last split (the highest program ids, dispatched last)
    walks the rest of K; when TAIL of its groups are left it loads the other partials (volatile), walks those
    groups while the loads are in flight, polls again while any element still reads PENDING_BITS, sums
    0 + p_0 + ... + p_(S-2) + its own accumulator in split order (the fused reduce's additions: the same bits for
    the same split boundaries), writes out and restores the pattern. SPLITS <= 4. Polling passes -> dbg_ptr."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n, offs_m, n_ok, m_ok, w_rows, x_rows, ws_row, xs_rows, g0, g1 = _split_k_tile(
        x_ptr, xs_ptr, w_ptr, ws_ptr, pid_n, pid_m, pid_s, M, N, K, per, stride_xm, stride_wn, stride_xsm,
        stride_wsn, BM, BN)
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    idx = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
    mn = M.to(tl.int64) * N
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    if pid_s < SPLITS - 1:
        acc = _scaled_steps(acc, w_rows, x_rows, ws_row, xs_rows, g0, g1, K, n_ok, m_ok, stride_wsg, stride_xsg)
        bits = acc.to(tl.int32, bitcast=True)
        bits = tl.where(bits == PENDING_BITS, CANONICAL_NAN_BITS, bits)
        tl.store(part_ptr + pid_s * mn + idx, bits.to(tl.float32, bitcast=True), mask=mask)
    else:
        g_end = tl.cdiv(K, 128)
        g_mid = tl.maximum(g_end - TAIL, g0)
        acc = _scaled_steps(acc, w_rows, x_rows, ws_row, xs_rows, g0, g_mid, K, n_ok, m_ok, stride_wsg, stride_xsg)
        v0 = _peek_partial(part_ptr, 0, idx, mask, mn, SPLITS, BN, BM)
        v1 = _peek_partial(part_ptr, 1, idx, mask, mn, SPLITS, BN, BM)
        v2 = _peek_partial(part_ptr, 2, idx, mask, mn, SPLITS, BN, BM)
        acc = _scaled_steps(acc, w_rows, x_rows, ws_row, xs_rows, g_mid, g_end, K, n_ok, m_ok, stride_wsg,
                            stride_xsg)
        passes = 1
        pending = _any_pending(v0, v1, v2)
        while pending:
            passes += 1
            v0 = _peek_partial(part_ptr, 0, idx, mask, mn, SPLITS, BN, BM)
            v1 = _peek_partial(part_ptr, 1, idx, mask, mn, SPLITS, BN, BM)
            v2 = _peek_partial(part_ptr, 2, idx, mask, mn, SPLITS, BN, BM)
            pending = _any_pending(v0, v1, v2)
        tot = tl.zeros((BN, BM), dtype=tl.float32) + v0.to(tl.float32, bitcast=True)
        if SPLITS > 2:
            tot += v1.to(tl.float32, bitcast=True)
        if SPLITS > 3:
            tot += v2.to(tl.float32, bitcast=True)
        tot += acc
        tl.store(out_ptr + idx, tot, mask=mask)
        pattern = tl.full((BN, BM), PENDING_BITS, tl.int32).to(tl.float32, bitcast=True)
        for s in tl.static_range(SPLITS - 1):
            tl.store(part_ptr + s * mn + idx, pattern, mask=mask)
        tl.store(dbg_ptr + pid_m * tl.num_programs(0) + pid_n, passes)


def early_gemm(xd, xs, wd, ws, bn=64, splits=4, per=None, tail=0, warps=4, stages=5, dbg=None, pdl=True):
    """`_early_reduce_probe_kernel` (fp32 out): splits 0..S-2 walk `per` groups each (default: an even split),
    the reducer split the rest; dbg: an int32 tensor of >= tiles elements for the polling passes."""
    from engine.kernels.pdl import launch_opts

    m, k = xd.shape
    n = wd.shape[0]
    kb = -(-k // 128)
    per = per or -(-kb // splits)
    if not 2 <= splits <= 4 or kb - (splits - 1) * per < 1:
        raise ValueError(f"splits={splits}, per={per}: 2..4 splits and a non-empty reducer split over {kb} groups")
    bm = max(16, triton.next_power_of_2(m))
    out = torch.empty((m, n), device=xd.device, dtype=torch.float32)
    part = _pending_workspace(splits * m * n)
    grid = (-(-n // bn), -(-m // bm), splits)
    dbg = dbg if dbg is not None else torch.zeros(grid[0] * grid[1], dtype=torch.int32, device=xd.device)
    opts = launch_opts(xd) if pdl else {"PDL": False}
    _early_reduce_probe_kernel[grid](xd, xs, wd, ws, out, part, dbg, m, n, k, per, xd.stride(0), wd.stride(0),
                                     xs.stride(0), xs.stride(1), ws.stride(0), ws.stride(1), BM=bm, BN=bn,
                                     SPLITS=splits, TAIL=tail, num_warps=warps, num_stages=stages, **opts)
    return out


def probe_gemm_early(copy_tbs: float, ms=(4, 16)) -> None:
    """4096x14336 at M = 4 / 16, one call each: split-K with a fixed reducer and no handshake
    (`_early_reduce_probe_kernel`: the other splits walk fewer groups, store and exit; the reducer loads their
    partials while it walks its last TAIL groups) vs production and vs its loop alone (partials only)."""
    from engine.kernels import gemm as G

    n, k = 4096, 14336
    print(f"\n## split-K with a fixed reducer, no handshake, {n}x{k} (flush {FLUSH}; production: 4 splits x 28 "
          f"groups, BN 64, 4 warps, 5 stages)")
    for n_, k_, m, (xd, xs, wd, ws), wbytes, t16, t0, ref in _small_m_cases([(n, k)], ms):
        _case_line(n_, k_, m, t16, t0, wbytes)
        dbg = torch.zeros(n // 64, dtype=torch.int32, device=DEV)
        runs = [("production (fused reduce)", lambda: G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32),
                 None),
                ("split-K loop alone, partials", lambda: production_partials(xd, xs, wd, ws), None)]
        for per in (28, 27, 26, 25):
            for tail in (0, 2, 4, 8):
                for stages in (5,) if (per, tail) != (27, 2) else (4, 5, 6):
                    runs.append((f"early per={per} tail={tail} stages={stages}",
                                 lambda per=per, tail=tail, stages=stages: early_gemm(
                                     xd, xs, wd, ws, per=per, tail=tail, stages=stages, dbg=dbg), per))
        runs.append(("production again", runs[0][1], None))
        for name, fn, per in runs:
            try:
                out = fn()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 -- a probe: report and go on
                print(f"    {name:36} FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:150]}", flush=True)
                continue
            got = out.sum(0) if out.dim() == 3 else out
            err = (got - ref).abs().max().item() / ref.abs().max().item()
            same = torch.equal(got, ref) if out.dim() == 2 else None
            dbg.zero_()
            ts = sorted(time_us(fn, reps=30) for _ in range(3))
            polls = ""
            if per is not None:
                d = dbg.float()
                polls = f" polls mean {float(d.mean()):.2f} max {int(d.max())}"
            bits = "" if same is None else (" bits = production" if same else " bits differ")
            print(f"    {name:36} {ts[1]:6.2f} us (of 3 runs: {ts[0]:.2f}-{ts[2]:.2f}) {wbytes / ts[1] / 1e6:5.2f} TB/s "
                  f"{t16 / ts[1]:4.2f}x bf16 err {err:.1e}{bits}{polls}", flush=True)
        g_prod = graph_us(lambda: G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32))
        g_early = graph_us(lambda: early_gemm(xd, xs, wd, ws, per=27, tail=2, dbg=dbg))
        print(f"    graph, 64 back to back: production {g_prod:.2f} us, early per=27 tail=2 {g_early:.2f} us", flush=True)


LLAMA_DECODE_SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # QKV, O, gate+up, down
ROTATE_BYTES = 150_000_000  # weight copies cycled through per CUDA graph (3x the 50 MB L2): no call finds its weight


def _weight_copies(n: int, k: int, elem_bytes: int = 1) -> int:
    """How many copies of an N x K weight (elem_bytes each) the graph timings rotate through (>= 3 for FP8)."""
    return max(3 if elem_bytes == 1 else 2, -(-ROTATE_BYTES // (elem_bytes * n * k)))


def _fp8_weights(n: int, k: int) -> list:
    """`_weight_copies` distinct random FP8 block weights (data, scale) of N x K."""
    return [fp8_block_operands(1, n, k, seed=n + i)[2:] for i in range(_weight_copies(n, k))]


def _decode_cfg_times(xd, xs, wts, ref, cfg: dict, one_call: bool = False):
    """One knob set of `fp8_block_gemm_triton` (bf16 out): (rel error of its fp32 output vs ref, us per call in a CUDA
    graph cycling through the weight copies wts, us of one call after a clean L2 flush when one_call else None), or
    None when it is wrong or cannot run (printed, unless out of shared memory)."""
    from engine.kernels import gemm as G

    bf = torch.bfloat16
    try:
        out = G.fp8_block_gemm_triton(xd, xs, *wts[0], out_dtype=torch.float32, **cfg)
        err = ((out - ref).norm() / ref.norm()).item()
        if not err <= 5e-3:
            print(f"    {cfg} WRONG: rel err {err:.1e}")
            return None
        t = (_time_us(lambda: G.fp8_block_gemm_triton(xd, xs, *wts[0], out_dtype=bf, **cfg), flush="clean")
             if one_call else None)
        g = graph_us([lambda w=w: G.fp8_block_gemm_triton(xd, xs, *w, out_dtype=bf, **cfg) for w in wts])
    except Exception as exc:  # noqa: BLE001 -- a probe: report and go on
        if "out of resource" not in str(exc):
            print(f"    {cfg} FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:150]}")
        return None
    return err, g, t


def probe_decode_graph(copy_tbs: float, shapes=LLAMA_DECODE_SHAPES, ms=(8, 64)) -> None:
    """The Llama-3-8B decode GEMMs at the batch sizes of the e2e benchmark above 1 (M = 8 -> BM 16, M = 64 -> BM
    64; `--only decode_graph32`: M = 32 -> BM 32), timed as a decode step runs them: per call in a CUDA graph of 64
    back-to-back calls rotating through copies of the weight (>= 150 MB, so no call finds its weight in L2), bf16 output, PDL as in production. The
    production split-K kernel over block_n, splits, warps and stages (and at M = 64 the whole-K kernel) vs the
    default dispatch and bf16 cuBLAS; prints `DECODE_CONFIGS` entries for the winners."""
    import torch.nn.functional as F

    from engine.kernels import gemm as G

    print("\n## Llama-3-8B decode GEMMs in a CUDA graph (64 calls over weight copies), M = "
          f"{ms}: production kernel knobs (us per call, TB/s of weight bytes)")
    bf = torch.bfloat16
    entries = []
    for n, k in shapes:
        wts = _fp8_weights(n, k)
        w16 = [torch.randn(n, k, device=DEV, dtype=bf) for _ in range(_weight_copies(n, k, 2))]
        wbytes = n * k + wts[0][1].numel() * 4
        for m in ms:
            xd, xs, _, _ = fp8_block_operands(m, 16, k, seed=m)
            x16 = torch.randn(m, k, device=DEV, dtype=bf)
            bm = max(16, triton.next_power_of_2(m))
            ref = G.fp8_block_linear(xd, xs, *wts[0], out_dtype=torch.float32)
            t16 = graph_us([lambda w=w: F.linear(x16, w) for w in w16])
            t0 = graph_us([lambda w=w: G.fp8_block_linear(xd, xs, *w, out_dtype=bf) for w in wts])
            print(f"  {n}x{k} M={m} (BM {bm}): bf16 cuBLAS {t16:6.2f} us; default {t0:6.2f} us "
                  f"{wbytes / t0 / 1e6:5.2f} TB/s {t16 / t0:4.2f}x bf16", flush=True)
            cfgs = []
            for bn in (32, 64, 128):
                for split in (1, 2, 4, 8):
                    progs = -(-n // bn) * split
                    if progs < 64 or progs > 2048:
                        continue
                    for warps, stages in ((4, 3), (4, 4), (4, 5), (4, 6), (8, 3), (8, 4)):
                        if bn == 128 and stages > 4 or bn == 32 and warps == 8:
                            continue
                        cfgs.append(dict(split_k=split, block_n=bn, num_warps=warps, num_stages=stages,
                                         fused_reduce=True))
            if m > 16:
                cfgs += [dict(whole_k=gps, block_n=bn) for bn in (32, 64) for gps in (2, 4)]
            res = []
            for cfg in cfgs:
                got = _decode_cfg_times(xd, xs, wts, ref, cfg)
                if got is not None:
                    res.append((got[1], cfg, got[0]))
            res.sort(key=lambda r: r[0])
            for t, cfg, err in res[:6]:
                print(f"      {t:6.2f} us {wbytes / t / 1e6:5.2f} TB/s ({100 * wbytes / t / 1e6 / copy_tbs:.0f}% copy) "
                      f"{t16 / t:4.2f}x bf16 {cfg} rel err vs default {err:.1e}", flush=True)
            if res and res[0][0] < 0.97 * t0:
                print(f"    entry: (\"{torch.cuda.get_device_name()}\", {n}, {k}, {bm}): dict("
                      + ", ".join(f"{a}={v}" for a, v in res[0][1].items()) + f"),  # {res[0][0]:.2f} vs {t0:.2f} us",
                      flush=True)
                entries.append(dict(device=torch.cuda.get_device_name(), n=n, k=k, bm=bm, knobs=res[0][1]))
        del wts, w16
    if os.environ.get("OUT"):
        suffix = "" if tuple(ms) == (8, 64) else "_m" + "_".join(str(m) for m in ms)
        path = Path(os.environ["OUT"], f"decode_graph_entries{suffix}.json")
        path.write_text(json.dumps(entries, indent=1))
        print(f"  {len(entries)} entries -> {path} (benchmarks/bench_e2e.py --decode-configs)", flush=True)


def _graph_cases(shapes, ms, name: str):
    """The setup of the sweeps timed both ways: for each (N, K), `_fp8_weights` copies; for each M, FP8 activations and
    the default dispatch (`fp8_block_linear`, bf16 out) timed one call after a clean L2 flush and per call in a CUDA
    graph over the copies, printed as one line headed `name`. Yields (n, k, m, xd, xs, weight copies, weight bytes)."""
    from engine.kernels import gemm as G

    bf = torch.bfloat16
    for n, k in shapes:
        wts = _fp8_weights(n, k)
        wbytes = n * k + wts[0][1].numel() * 4
        for m in ms:
            xd, xs, _, _ = fp8_block_operands(m, 16, k, seed=m)
            t0 = _time_us(lambda: G.fp8_block_linear(xd, xs, *wts[0], out_dtype=bf), flush="clean")
            g0 = graph_us([lambda w=w: G.fp8_block_linear(xd, xs, *w, out_dtype=bf) for w in wts])
            print(f"  {n}x{k} M={m}: {name} one call {t0:6.2f} us {wbytes / t0 / 1e6:5.2f} TB/s | graph {g0:6.2f} us "
                  f"{wbytes / g0 / 1e6:5.2f} TB/s", flush=True)
            yield n, k, m, xd, xs, wts, wbytes


def probe_decode_dual(copy_tbs: float, shapes=((7168, 16384),), ms=(4, 16)) -> None:
    """Issue decode shapes at M = 4 / 16, each split-K config timed both ways `bench_gemm` reports: one call after a
    clean L2 flush and per call in a CUDA graph over weight copies (as a decode step runs, the acceptance timing).
    A config can be fast one way and slow the other (H200, 7168x16384 at BM 16, 4 splits x 4 stages: one call
    3.38 / 3.32 TB/s, graph 2.98 / 2.90); this looks for a config at >= 3.0 TB/s in both."""
    from engine.kernels import gemm as G

    print("\n## decode GEMMs, one call (clean flush) and CUDA graph (weight copies), us per call")
    for n, k, m, xd, xs, wts, wbytes in _graph_cases(shapes, ms, "default"):
        ref = G.fp8_block_linear(xd, xs, *wts[0], out_dtype=torch.float32)
        res = []
        for bn in (64, 128):
            for split in (2, 3, 4, 6, 8):
                for warps, stages in ((4, 3), (4, 4), (4, 5), (4, 6), (8, 3), (8, 4)):
                    if bn == 128 and stages > 4:
                        continue
                    cfg = dict(split_k=split, block_n=bn, num_warps=warps, num_stages=stages, fused_reduce=True)
                    got = _decode_cfg_times(xd, xs, wts, ref, cfg, one_call=True)
                    if got is not None:
                        _, g, t = got
                        res.append((max(t, g), t, g, cfg))
        res.sort(key=lambda r: r[0])
        for _, t, g, cfg in res[:8]:
            print(f"      one call {t:6.2f} us {wbytes / t / 1e6:5.2f} TB/s | graph {g:6.2f} us "
                  f"{wbytes / g / 1e6:5.2f} TB/s  {cfg}", flush=True)


SLICED_SHAPES = ((4096, 14336), (28672, 4096), (7168, 16384), (4096, 4096), (6144, 4096))


def probe_gemm_sliced(copy_tbs: float, shapes=SLICED_SHAPES, ms=(2, 4, 8), wide=((4096, 14336),)) -> None:
    """Split-K inside one program (`sliced=S`, `_fp8_sliced_gemm_kernel`: S K slices side by side in one MMA tile,
    summed in registers) against the production dispatch and the split-K kernel with S splits and its fused reduce:
    whether the bits equal split-K's (they should), one call after a clean L2 flush and per call in a CUDA graph
    over weight copies. Shapes in `wide` sweep warps and stages too."""
    from engine.kernels import gemm as G

    print("\n## sliced (in-program split-K) decode GEMM vs production: one call (clean flush) | CUDA graph, us per call")
    for n, k, m, xd, xs, wts, wbytes in _graph_cases(shapes, ms, "production"):
        ref = G.fp8_block_linear_reference(xd, xs, *wts[0], out_dtype=torch.float32)
        res = []
        sweep = (((4, None), (4, 3), (4, 4), (4, 5), (4, 6), (2, None), (8, None))
                 if (n, k) in wide else ((4, None),))
        for sl in (2, 4, 8):
            split = G.fp8_block_gemm_triton(xd, xs, *wts[0], out_dtype=torch.float32, split_k=sl, block_n=64,
                                            fused_reduce=True, sliced=False)
            for rows in (8, 16, 32, 64):
                if sl * rows not in (64, 128):
                    continue
                for warps, stages in sweep:
                    cfg = dict(sliced=sl, block_n=rows, num_warps=warps, num_stages=stages)
                    got = _decode_cfg_times(xd, xs, wts, ref, cfg, one_call=True)
                    if got is None:
                        continue
                    same = torch.equal(G.fp8_block_gemm_triton(xd, xs, *wts[0], out_dtype=torch.float32, **cfg),
                                       split)
                    res.append((got[2], got[1], cfg, same))
        res.sort(key=lambda r: r[0])
        for t, g, cfg, same in res[:10]:
            print(f"      one call {t:6.2f} us {wbytes / t / 1e6:5.2f} TB/s | graph {g:6.2f} us "
                  f"{wbytes / g / 1e6:5.2f} TB/s  same bits as split_k={cfg['sliced']}: {same}  {cfg}", flush=True)
        print(f"      bits equal split-K in {sum(r[3] for r in res)} of {len(res)} configs", flush=True)


def _wg_run(xd, xs, wts, cfg: dict, out_dtype=torch.bfloat16, i: int = 0):
    """`engine.kernels.gemm_wgmma.launch` with the knobs in cfg (block_n, stages, gps, splits, swap, rotate) on
    weight copy i; returns out (M, N)."""
    from engine.kernels import gemm_wgmma as GW

    wd, ws = wts[i]
    out = torch.empty((xd.shape[0], wd.shape[0]), device=xd.device, dtype=out_dtype)
    GW.launch(xd, xs, (xs.stride(0), xs.stride(1)), wd, ws, (ws.stride(0), ws.stride(1)), None, out, False,
              cfg["block_n"], cfg["stages"], cfg["gps"], rotate=cfg.get("rotate", False), splits=cfg["splits"],
              swap=cfg["swap"])
    return out


def probe_gemm_wgsplit(copy_tbs: float, shapes=SLICED_SHAPES[:1], ms=(4, 16)) -> None:
    """The Gluon wgmma kernel (TMA ring, scale table in shared memory) with split-K and its fused reduce
    (`launch(splits=S)`), activation rows on the wgmma M side (64, zero-filled by TMA) or, with swap, on its N side
    (M rounded up to 8 / 16) and 64 weight rows on M; over splits, stages and groups per stage. Each config: whether
    its bits equal the split-K Triton kernel with the same K partition (64-row tiles, fused reduce, not sliced), one
    call after a clean L2 flush and per call in a CUDA graph over weight copies, against the production dispatch."""
    from engine.kernels import gemm as G
    from engine.kernels import gemm_wgmma as GW

    f32 = torch.float32
    print("\n## Gluon wgmma split-K decode GEMM vs production: one call (clean flush) | CUDA graph, us per call")
    for n, k, m, xd, xs, wts, wbytes in _graph_cases(shapes, ms, "production"):
        kb = -(-k // 128)
        ref = G.fp8_block_linear_reference(xd, xs, *wts[0], out_dtype=f32)
        res = []
        for swap in (True, False):
            for splits in (1, 2, 4, 8):
                for gps, stages in ((2, 3), (2, 4), (2, 6), (4, 2), (4, 3)):
                    for bn in (64,):
                        cfg = dict(block_n=bn, stages=stages, gps=gps, splits=splits, swap=swap)
                        if GW.plan_error(m, n, k, bn, stages, gps, splits, swap):
                            continue
                        s_eff, per = GW.split_plan(kb, splits, gps)
                        try:
                            out = _wg_run(xd, xs, wts, cfg, f32)
                            err = ((out - ref).norm() / ref.norm()).item()
                            t = _time_us(lambda: _wg_run(xd, xs, wts, cfg), flush="clean")
                            g = graph_us([lambda i=i: _wg_run(xd, xs, wts, cfg, i=i) for i in range(len(wts))])
                        except Exception as exc:  # noqa: BLE001 -- a probe: report and go on
                            print(f"    {cfg} FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:150]}")
                            continue
                        same = None
                        if G._cdiv(kb, G._cdiv(kb, s_eff)) == s_eff and G._cdiv(kb, s_eff) == per:
                            tri = G.fp8_block_gemm_triton(xd, xs, *wts[0], out_dtype=f32, split_k=s_eff, block_n=64,
                                                          fused_reduce=True, sliced=False)
                            same = torch.equal(out.view(torch.int32), tri.view(torch.int32))
                        res.append((t, g, err, same, dict(cfg, splits=s_eff)))
        res.sort(key=lambda r: r[0])
        for t, g, err, same, cfg in res[:12]:
            print(f"      one call {t:6.2f} us {wbytes / t / 1e6:5.2f} TB/s | graph {g:6.2f} us "
                  f"{wbytes / g / 1e6:5.2f} TB/s  err {err:.1e} bits == split-K: {same}  {cfg}", flush=True)
        best_g = min(res, key=lambda r: r[1]) if res else None
        if best_g:
            print(f"      best in graph: {best_g[1]:6.2f} us {wbytes / best_g[1] / 1e6:5.2f} TB/s {best_g[4]}")
        print(f"      bits equal split-K in {sum(r[3] is True for r in res)} of {sum(r[3] is not None for r in res)} "
              f"comparable configs; max err {max((r[2] for r in res), default=0):.1e}", flush=True)


def probe_wgmma_sweep(copy_tbs: float, shapes=((28672, 4096), (4096, 14336), (7168, 16384), (6144, 4096)),
                      ms=(4, 8, 16), pipes=((2, 2), (2, 3), (2, 4), (2, 5), (2, 6), (4, 2), (4, 3)),
                      splits=(1, 2, 4), top: int = 8) -> None:
    """The swapped Gluon wgmma kernel (`wgmma` knob) against the production dispatch, per call in a CUDA
    graph over weight copies (bf16 out): every (split, groups per stage, stages) timed twice, the top fastest printed
    with their shared memory per program and program count -- the data behind the H200's BM-16 `wgmma` entries and
    `gemm_wgmma.swap_stages`."""
    from engine.kernels import gemm as G
    from engine.kernels import gemm_wgmma as GW

    bf = torch.bfloat16
    print("\n## wgmma sweep: decode GEMMs per call in a CUDA graph over weight copies (us; TB/s of weight bytes)")
    for n, k in shapes:
        wts = _fp8_weights(n, k)
        wbytes = n * k + wts[0][1].numel() * 4
        for m in ms:
            xd, xs, _, _ = fp8_block_operands(m, 16, k, seed=m)
            prod = lambda: graph_us([lambda w=w: G.fp8_block_linear(xd, xs, *w, out_dtype=bf) for w in wts])
            t0, t0b = prod(), prod()
            res = []
            for sp in splits:
                for gps, stages in pipes:
                    if GW.plan_error(m, n, k, 64, stages, gps, sp, True):
                        continue
                    s_eff, per = GW.split_plan(-(-k // 128), sp, gps)
                    cfg = dict(wgmma=gps, split_k=sp, block_n=64, num_stages=stages)
                    run = lambda: graph_us([lambda w=w: G.fp8_block_gemm_triton(xd, xs, *w, out_dtype=bf, **cfg)
                                            for w in wts])
                    ta, tb = run(), run()
                    smem = GW.smem_bytes(64, stages, per, gps, GW.x_rows(m, True))
                    res.append((max(ta, tb), ta, tb, s_eff, gps, stages, smem, -(-n // 64) * s_eff))
            res.sort()
            cells = " ".join(f"S{s_}g{g}n{st}={a:6.2f}/{b:6.2f}({sm // 1024}K,{p}p)"
                             for _, a, b, s_, g, st, sm, p in res[:top])
            print(f"  {n:5d}x{k:5d} M={m:2d}: production {t0:6.2f}/{t0b:6.2f} us ({wbytes / t0 / 1e6:4.2f} TB/s) | "
                  f"{cells}", flush=True)


def probe_reduce_burst(copy_tbs: float, shapes=((4096, 14336), (28672, 4096), (7168, 16384), (6144, 4096),
                                                (4096, 4096)), ms=(4, 16, 32)) -> None:
    """The fused split-K reduce's partial loads, four per L2 round trip (`gemm.REDUCE_BURST` = 4) against
    one per loop step (1), on the production dispatch (entries included; bf16 out): one call (the
    run's --flush) and per call in a CUDA graph over weight copies, the two alternated twice (1, 4, 4, 1), and their
    outputs' bits compared."""
    from engine.kernels import gemm as G

    bf = torch.bfloat16
    print(f"\n## fused reduce: 4 vs 1 partials per round trip, production dispatch (us; flush {FLUSH}; A B B A)")
    for n, k in shapes:
        wts = _fp8_weights(n, k)
        wbytes = n * k + wts[0][1].numel() * 4
        for m in ms:
            xd, xs, _, _ = fp8_block_operands(m, 16, k, seed=m)
            times = {1: [], 4: []}
            outs = {}
            for burst in (1, 4, 4, 1):
                G.REDUCE_BURST = burst
                outs[burst] = G.fp8_block_linear(xd, xs, *wts[0], out_dtype=bf)
                one = time_us(lambda: G.fp8_block_linear(xd, xs, *wts[0], out_dtype=bf))
                gr = graph_us([lambda w=w: G.fp8_block_linear(xd, xs, *w, out_dtype=bf) for w in wts])
                times[burst].append((one, gr))
            G.REDUCE_BURST = 4
            same = torch.equal(outs[1].view(torch.int16), outs[4].view(torch.int16))
            cells = []
            for burst in (1, 4):
                ones = [t[0] for t in times[burst]]
                grs = [t[1] for t in times[burst]]
                cells.append(f"burst {burst}: one call {ones[0]:6.2f}/{ones[1]:6.2f} us "
                             f"({wbytes / min(ones) / 1e6:4.2f} TB/s), graph {grs[0]:6.2f}/{grs[1]:6.2f} us "
                             f"({wbytes / min(grs) / 1e6:4.2f} TB/s)")
            print(f"  {n:5d}x{k:5d} M={m:2d}: " + " | ".join(cells) + f" | same bits {same}", flush=True)


def _print_split_row(n: int, k: int, m: int, bm: int, heur: int, row: list, nbytes: int) -> None:
    """One split-rule sweep point: the heuristic's split count and time, the best variant, every variant's time (the
    row format benchmarks/split_rule_eval.py reads)."""
    best = min(row)
    th = next(t for t, name in row if name == f"s{heur}")
    cells = " ".join(f"{name}={t:7.2f}" for t, name in row)
    print(f"  {n:5d}x{k:5d} M={m:2d} BM={bm}: heuristic s{heur} {th:7.2f} us ({nbytes / th / 1e6:4.2f} TB/s), "
          f"best {best[1]} {best[0]:7.2f} us ({nbytes / best[0] / 1e6:4.2f} TB/s) | {cells}", flush=True)


def probe_split_rule(copy_tbs: float, ms=(12, 24, 48)) -> None:
    """Split count vs tile rows (BM 16 / 32 / 64) over a grid of decode shapes, as a decode step runs them (CUDA graph
    of 64 calls over >= 150 MB of weight copies, bf16 out): the split-K kernel with the heuristic's tiles, warps and
    stages and 1 / 2 / 4 / 8 / 16 splits, the split rule's choice when run (in the committed H200 sweep: a 2-per-SM
    rule), and the whole-K kernel (64 / 32 rows, 2 / 4 groups per stage) -- the data for `_split_k` / SPLIT_FILL;
    `benchmarks/split_rule_eval.py` scores a rule against it."""
    from engine.kernels import gemm as G
    from engine.kernels import gemm_wgmma as GW

    bf = torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"\n## split rule: us per call in a CUDA graph (64 calls over weight copies), {sms} SMs")
    for n in (2048, 4096, 6144, 8192, 14336, 28672):
        for k in (2048, 4096, 7168, 14336):
            if n * k > 120_000_000:
                continue
            wts = _fp8_weights(n, k)
            wbytes = n * k
            for m in ms:
                xd, xs, _, _ = fp8_block_operands(m, 16, k, seed=m)
                bm, bn, _, _ = G._tiles(m)
                steps = -(-k // 128)
                heur = G._plan_split(m, n, steps, bm, bn, xd.device, None)[0]
                row = []
                for split in (1, 2, 4, 8, 16):
                    if steps // split < 2:
                        continue
                    t = graph_us([lambda w=w, split=split: G.fp8_block_gemm_triton(
                        xd, xs, *w, out_dtype=bf, split_k=split) for w in wts])
                    row.append((t, f"s{split}"))
                for wbn in (32, 64):
                    for gps in (2, 4):
                        if GW.plan_error(m, n, k, wbn, GW.default_stages(wbn, gps), gps) is None:
                            t = graph_us([lambda w=w, wbn=wbn, gps=gps: G.fp8_block_gemm_triton(
                                xd, xs, *w, out_dtype=bf, whole_k=gps, block_n=wbn) for w in wts])
                            row.append((t, f"wk{wbn}x{gps}"))
                _print_split_row(n, k, m, bm, heur, row, wbytes)
            del wts


STAGE_GRID = tuple((n, k) for n in (2048, 4096, 6144, 8192, 14336, 28672) for k in (2048, 4096, 7168, 14336)
                   if 1 << 24 <= n * k <= 120_000_000)
# Held-out shapes for the stage rule fitted on STAGE_GRID (`--only decode_stages_check`): Qwen2-7B gate+up / down,
# 5120-wide attention and MLP shapes, Llama-3-70B qkv / down, two narrow ones, and the lm_heads of Llama-3-8B and
# Qwen3-30B-A3B (which have no DECODE_CONFIGS entry).
STAGE_CHECK = ((37888, 3584), (3584, 18944), (5120, 5120), (27648, 5120), (5120, 13824), (10240, 8192),
               (8192, 28672), (3072, 8192), (2560, 9728), (12288, 4096), (128256, 4096), (151936, 2048))


# Model shapes for the wgmma rule (`--only wgmma_split_check2`; held out from its first form): Mistral-Nemo-12B,
# Qwen3-8B / 14B, Gemma-2-9B, Qwen2.5-1.5B / 3B / 7B, Llama-3.2-3B projections.
WGMMA_CHECK = ((5120, 14336), (28672, 5120), (6144, 5120), (5120, 4096), (24576, 4096), (4096, 12288), (5120, 17408),
               (7168, 5120), (3584, 14336), (8192, 3584), (3584, 4096), (1536, 8960), (2048, 11008), (5120, 3072),
               (3072, 3072), (4608, 3584), (3584, 3584))
# More model shapes (`--only wgmma_split_check3`; held out from the rule's second form): Llama-3-70B's MLP and qkv
# over 8 GPUs, Phi-3-mini, Gemma-2-2B, Qwen2.5-32B's down, Qwen3-4B, DeepSeek-V2-Lite's q and o, square 2048 / 2560.
WGMMA_CHECK3 = ((1280, 8192), (7168, 8192), (9216, 3072), (16384, 3072), (2304, 9216), (5120, 27648), (6144, 2560),
                (19456, 2560), (3072, 2048), (2048, 2048), (2560, 2560), (4096, 2304))


def _wgmma_split_configs(m: int, n: int, k: int, sms: int, max_per_sm: float = 6.0) -> list[tuple[int, int, int]]:
    """(splits, groups per stage, stages) of the swapped wgmma kernel worth timing on M x N x K: 1, 2, 3, 4, 6 and 8 K
    splits (distinct effective partitions; above one split >= 4 groups per split and at most max_per_sm programs per
    SM), 2 or 4 groups per stage, each at `swap_stages`' default depth and, where every program has an SM to itself,
    also at the deepest pipeline that fits the shared memory."""
    from engine.kernels import gemm_wgmma as GW

    kb = -(-k // 128)
    seen, out = set(), []
    for sp in (1, 2, 3, 4, 6, 8):
        for gps in (2, 4):
            s_eff, per = GW.split_plan(kb, sp, gps)
            progs = -(-n // 64) * s_eff
            if (s_eff, per, gps) in seen or (s_eff > 1 and (per < 4 or progs > max_per_sm * sms)):
                continue
            seen.add((s_eff, per, gps))
            base = GW.swap_stages(m, kb, s_eff, gps)
            depths = [base]
            if progs <= sms:
                deep = max((st for st in range(base, 9) if GW.plan_error(m, n, k, 64, st, gps, s_eff, True) is None
                            and st <= -(-per // gps)), default=base)
                if deep != base:
                    depths.append(deep)
            out += [(s_eff, gps, st) for st in depths if GW.plan_error(m, n, k, 64, st, gps, s_eff, True) is None]
    return out


def probe_wgmma_split(copy_tbs: float, shapes=None, ms=(4, 16, 32)) -> None:
    """The swapped Gluon wgmma kernel on decode shapes the H200's `DECODE_CONFIGS` do not name, against
    the production dispatch without the wgmma rule (`prod`: its entries where it has them, else the split-K
    heuristic) and with it (`rule`, where `gemm.WGMMA_RULE` is on), per call in a CUDA graph of 64 calls over weight
    copies (bf16 out). Variants `w{splits}g{groups per stage}n{stages}` as `_wgmma_split_configs`; rows in
    `benchmarks/split_rule_eval.py`'s format, which scores the rule (`--wgmma`). Shapes: STAGE_GRID (default),
    STAGE_CHECK (`wgmma_split_check`), WGMMA_CHECK (`wgmma_split_check2`), WGMMA_CHECK3 (`wgmma_split_check3`); the
    final rule is fitted on all four."""
    from engine.kernels import gemm as G

    bf = torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = STAGE_GRID if shapes is None else shapes
    print(f"\n## wgmma split rule: us per call in a CUDA graph (64 calls over weight copies), {sms} SMs")
    for n, k in shapes:
        wts = _fp8_weights(n, k)
        wbytes = n * k + wts[0][1].numel() * 4
        for m in ms:
            xd, xs, _, _ = fp8_block_operands(m, 16, k, seed=m)
            bm = G._tiles(m)[0]

            def prod(xd=xd, xs=xs, wts=wts):
                return graph_us([lambda w=w: G.fp8_block_linear(xd, xs, *w, out_dtype=bf) for w in wts])

            rule_on, G.WGMMA_RULE = G.WGMMA_RULE, False
            try:
                row = [(prod(), "prod")]
            finally:
                G.WGMMA_RULE = rule_on
            if rule_on:
                row.append((prod(), "rule"))
            for s_eff, gps, st in _wgmma_split_configs(m, n, k, sms):
                cfg = dict(wgmma=gps, split_k=s_eff, block_n=64, num_stages=st)
                try:
                    t = graph_us([lambda w=w: G.fp8_block_gemm_triton(xd, xs, *w, out_dtype=bf, **cfg) for w in wts])
                except Exception as e:  # noqa: BLE001 -- a config that cannot compile is reported, not fatal
                    print(f"    {n}x{k} M={m} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                row.append((t, f"w{s_eff}g{gps}n{st}"))
            best = min(row)
            cells = " ".join(f"{name}={t:7.2f}" for t, name in row)
            print(f"  {n:5d}x{k:5d} M={m:2d} BM={bm}: heuristic prod {row[0][0]:7.2f} us "
                  f"({wbytes / row[0][0] / 1e6:4.2f} TB/s), best {best[1]} {best[0]:7.2f} us "
                  f"({wbytes / best[0] / 1e6:4.2f} TB/s) | {cells}", flush=True)
        del wts
        torch.cuda.empty_cache()


def probe_decode_stages(copy_tbs: float, shapes=STAGE_GRID, ms=(4, 16, 24)) -> None:
    """Pipeline depth of the split-K kernel on decode shapes without a `DECODE_CONFIGS` entry, as a decode step runs
    them (CUDA graph of 64 calls over weight copies, bf16 out), at the heuristic's tiles and split count: the
    autotuner (`DECODE_STAGE_CHOICE = "autotune"`: 3 / 4 / 6 stages by `do_bench` on repeated calls after a write-flush
    of L2; it can pick a depth that is slow in a graph), the stage rule in the code (`_decode_stages`, the
    default), and fixed 3 / 4 / 6 stages. Each choice is summarized as its geometric-mean and worst ratio to the best
    of the fixed depths per point; `benchmarks/stage_rule_eval.py` re-scores a rule against this output."""
    from engine.kernels import gemm as G

    bf = torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"\n## decode pipeline depth: us per call in a CUDA graph (64 calls over weight copies), {sms} SMs")
    ratios: dict[str, list[float]] = {"auto": [], "rule": [], "st3": [], "st4": [], "st6": []}
    for n, k in shapes:
        wts = _fp8_weights(n, k)
        for m in ms:
            xd, xs, _, _ = fp8_block_operands(m, 16, k, seed=m)
            bm, bn, warps, _ = G._tiles(m)
            split = G._plan_split(m, n, -(-k // 128), bm, bn, xd.device, None)[0]
            calls = [lambda w=w: G.fp8_block_gemm_triton(xd, xs, *w, out_dtype=bf, split_k=split) for w in wts]
            row = {}
            G.DECODE_STAGE_CHOICE = "autotune"
            try:
                row["auto"] = graph_us(calls)
            finally:
                G.DECODE_STAGE_CHOICE = "rule"
            picked = [c.num_stages for key, c in G._fp8_block_gemm_tuned.cache.items()
                      if key[:6] == (n, k, bm, bn, split > 1, split)]
            row["rule"] = graph_us(calls)
            rule = G._decode_stages(-(-n // bn) * split, sms)
            for st in (3, 4, 6):
                row[f"st{st}"] = graph_us([lambda w=w, st=st: G.fp8_block_gemm_triton(
                    xd, xs, *w, out_dtype=bf, split_k=split, num_warps=warps, num_stages=st) for w in wts])
            best = min(row[f"st{st}"] for st in (3, 4, 6))
            for name, t in row.items():
                ratios[name].append(t / best)
            cells = " ".join(f"{name}={t:6.2f}" for name, t in row.items())
            print(f"  {n:5d}x{k:5d} M={m:2d} BM={bm} s{split}: autotuner {picked} rule {rule} | {cells} | best "
                  f"{n * k / best / 1e6:4.2f} TB/s", flush=True)
        del wts
    for name, rs in ratios.items():
        print(f"  {name}: geomean {statistics.geometric_mean(rs):.3f}x the best fixed depth, worst {max(rs):.3f}x "
              f"({len(rs)} points)")


MX_SPLIT_SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (8192, 8192), (2048, 14336))


# Held-out shapes for the MX split rule: Qwen2.5-14B's MLP (13824 x 5120, 5120 x 13824) and Qwen2-7B's
# (18944 x 3584, 3584 x 18944), none of them in MX_SPLIT_SHAPES.
MX_SPLIT_CHECK = ((13824, 5120), (5120, 13824), (18944, 3584), (3584, 18944))


def probe_mx_split(copy_tbs: float, ms=(1, 4, 16, 32), shapes=MX_SPLIT_SHAPES) -> None:
    """The MX dequant-in-kernel GEMM's split count (the heuristic: `G.mx_split_k`, `MX_SPLIT_RULE`), as a decode step
    runs it: per call in a CUDA graph of 64 calls over >= 150 MB of weight copies, 1 / 2 / 4 / 8 / 16 splits, for
    bf16 x MXFP4, bf16 x NVFP4 and MXFP8 x MXFP8. One section per pair in `probe_kernels.py --only split_rule`'s row
    format, so `benchmarks/split_rule_eval.py`'s `score` rates a rule against each section."""
    from engine.formats import quantize
    from engine.kernels import gemm as G

    bf = torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for xkind, wspec in (("bf16", "mxfp4"), ("bf16", "nvfp4"), ("mxfp8", "mxfp8")):
        print(f"\n## split rule, MX GEMM {xkind} x {wspec}: us per call in a CUDA graph (64 calls over weight "
              f"copies), {sms} SMs", flush=True)
        for n, k in shapes:
            g = torch.Generator(device=DEV).manual_seed(n + k)
            first = G.prepare_mx_weight(quantize(torch.randn(n, k, device=DEV, generator=g), wspec))
            copies = max(3, -(-ROTATE_BYTES // first.nbytes))
            wps = [first] + [G.prepare_mx_weight(quantize(torch.randn(n, k, device=DEV, generator=g), wspec))
                             for _ in range(copies - 1)]
            for m in ms:
                xsrc = torch.randn(m, k, device=DEV, generator=g)
                if xkind == "mxfp8":
                    q = quantize(xsrc, "mxfp8")
                    args, kw = (q.data,), {"x_scale": q.scale}
                else:
                    args, kw = (xsrc.to(bf),), {}
                bm, bn, _, _ = G._tiles(m)
                steps = -(-k // 128)
                heur = G._plan_split(m, n, steps, bm, bn, xsrc.device, None, mx=True)[0]
                row = []
                for split in (1, 2, 4, 8, 16):
                    if steps // split < 2:
                        continue
                    t = graph_us([lambda wp=wp, split=split: G.mx_linear(*args, wp, split_k=split, **kw) for wp in wps])
                    row.append((t, f"s{split}"))
                _print_split_row(n, k, m, bm, heur, row, first.nbytes)
            del wps, first


def probe_split_ab(copy_tbs: float, shapes=((7168, 16384), (6144, 14336)), ms=(4, 16), splits=(2, 4)) -> None:
    """Split counts A/B on long-K shapes near one tile per SM (BM 16): one call after a clean flush and per call in a
    CUDA graph over weight copies, each measured three times alternating between the split counts (medians)."""
    import statistics

    from engine.kernels import gemm as G

    bf = torch.bfloat16
    print(f"\n## split A/B at BM 16 (flush {FLUSH}): one call / CUDA graph, us (TB/s of weight bytes)")
    for n, k in shapes:
        wts = _fp8_weights(n, k)
        for m in ms:
            xd, xs, _, _ = fp8_block_operands(m, 16, k, seed=m)
            heur = G._plan_split(m, n, -(-k // 128), 16, 64, xd.device, None)[0]
            one = {s: [] for s in splits}
            graph = {s: [] for s in splits}
            for _ in range(3):
                for s_ in splits:
                    one[s_].append(time_us(lambda s_=s_: G.fp8_block_gemm_triton(xd, xs, *wts[0], out_dtype=bf,
                                                                                   split_k=s_), reps=30))
                    graph[s_].append(graph_us([lambda w=w, s_=s_: G.fp8_block_gemm_triton(
                        xd, xs, *w, out_dtype=bf, split_k=s_) for w in wts]))
            cells = "  ".join(f"s{s_}{'*' if s_ == heur else ''}: {statistics.median(one[s_]):6.2f} "
                              f"({n * k / statistics.median(one[s_]) / 1e6:4.2f}) / "
                              f"{statistics.median(graph[s_]):6.2f} ({n * k / statistics.median(graph[s_]) / 1e6:4.2f})"
                              for s_ in splits)
            print(f"  {n}x{k} M={m}: {cells}", flush=True)
        del wts


def probe_gemm_reduce_timeline(copy_tbs: float, ms=(4, 16)) -> None:
    """Where the ~1.8 us of the split-K reduce go (4096x14336, 4 splits, BN 64, 5 stages): `_gps_probe_kernel` with
    its partials only (mode 4) and with production's fused reduce (mode 1), per-program %globaltimer at start, after
    the loop (partial stored) and at the end. Loop span vs end span; per tile, the summing split's end minus the
    latest loop end of the tile's splits (the reduce's own latency)."""
    n, k = 4096, 14336
    print(f"\n## split-K reduce timeline, {n}x{k} (flush {FLUSH}; times from the first program start, us)")
    for n_, k_, m, (xd, xs, wd, ws), wbytes, t16, t0, ref in _small_m_cases([(n, k)], ms):
        _case_line(n_, k_, m, t16, t0, wbytes)
        for mode in (4, 1):
            ts = sorted(time_us(lambda: gps_gemm(xd, xs, wd, ws, stages=5, reduce=mode), reps=30) for _ in range(3))
            event, t = _timed_reps(lambda b: gps_gemm(xd, xs, wd, ws, stages=5, reduce=mode, times=b), 256, 5)
            t0_ = t[:, 0].min()
            st, lp, en = (t[:, 0] - t0_) / 1e3, (t[:, 1] - t0_) / 1e3, (t[:, 2] - t0_) / 1e3
            line = (f"    mode {mode} ({'partials only' if mode == 4 else 'fused reduce'}): untimed-probe {ts[1]:6.2f} us; "
                    f"with times: event {event:6.2f}, last start {float(st.max()):5.2f}, loop ends p50 "
                    f"{float(lp.median()):5.2f} max {float(lp.max()):5.2f}, program ends max {float(en.max()):5.2f}, "
                    f"outside {event - float(en.max()):5.2f}")
            if mode == 1:
                tiles = t.shape[0] // 4
                lat = []
                for tile in range(tiles):
                    rows = [s * tiles + tile for s in range(4)]
                    summer = [r for r in rows if t[r, 4] == 1]
                    if len(summer) == 1:
                        lat.append(float(en[summer[0]] - lp[rows].max()))
                lat_t = torch.tensor(lat)
                last_tile = int(en.argmax()) % tiles
                rows = [s * tiles + last_tile for s in range(4)]
                line += (f"; reduce latency per tile (summer's end - latest loop end) p50 {float(lat_t.median()):.2f} "
                         f"max {float(lat_t.max()):.2f} over {len(lat)} tiles; last tile's loop ends "
                         f"{[round(float(lp[r]), 2) for r in rows]}")
            print(line, flush=True)


def probe_gemm_cluster_launch(copy_tbs: float, ms=(4, 16)) -> None:
    """Why the cluster reduce gains nothing on 4096x14336: the cost of launching in clusters itself. The empty kernel
    (256 programs) and the split-K loop alone (partials, no reduce: `_layout_gemm_probe_kernel`, 4 splits, BN 64, 5
    stages) launched plainly and in clusters of 2 / 4 / 8 adjacent programs with no cluster instruction inside (one
    call, us; per-program timeline: span, start skew, programs per SM); then production's fused vs cluster reduce one
    call at a time and back to back in a CUDA graph (3 weight copies cycled)."""
    from engine.kernels import gemm as G
    from engine.kernels import pdl

    n, k = 4096, 14336
    f32 = torch.float32
    print(f"\n## the cost of a cluster launch, {n}x{k} (flush {FLUSH})")
    buf = torch.zeros(256, dtype=torch.int32, device=DEV)
    t = time_us(lambda: _noop_kernel[(256,)](buf), reps=30)
    print(f"  empty kernel, 256 programs: plain {t:5.2f} us", flush=True)
    for size in (2, 4, 8):
        t = time_us(lambda: _cluster_call(_noop_kernel, (256,), size, dict(out_ptr=buf), num_warps=4), reps=30)
        print(f"  empty kernel, 256 programs in clusters of {size}: {t:5.2f} us", flush=True)
    for n_, k_, m, (xd, xs, wd, ws), wbytes, t16, t0, ref in _small_m_cases([(n, k)], ms):
        _case_line(n_, k_, m, t16, t0, wbytes)
        want = layout_gemm(xd, xs, wd, ws, bn=64, splits=4, stages=5)
        for size in (1, 2, 4, 8):
            same = torch.equal(layout_gemm(xd, xs, wd, ws, bn=64, splits=4, stages=5, cluster=size), want)
            ts = sorted(time_us(lambda: layout_gemm(xd, xs, wd, ws, bn=64, splits=4, stages=5, cluster=size), reps=30)
                        for _ in range(3))
            r = _timeline(lambda b: layout_gemm(xd, xs, wd, ws, bn=64, splits=4, stages=5, times=b, cluster=size),
                          256)
            print(f"    split-K loop alone, clusters of {size}: {ts[1]:6.2f} us (of 3: {ts[0]:.2f}-{ts[2]:.2f}) "
                  f"{wbytes / ts[1] / 1e6:5.2f} TB/s; timeline event {r['event_us']:.2f} span {r['span_us']:.2f} "
                  f"start skew {r['start_skew_us']:.2f} duration p50 {r['dur_p50']:.2f} max {r['dur_max']:.2f} "
                  f"programs per SM {r['progs_per_sm']} on {r['sms_used']} SMs; same partials {same}", flush=True)
        part = production_partials(xd, xs, wd, ws)
        ts = sorted(time_us(lambda: production_partials(xd, xs, wd, ws), reps=30) for _ in range(3))
        err = ((part.sum(0) - ref).abs().max() / ref.abs().max()).item()
        print(f"    production kernel, partials only (no reduce): {ts[1]:6.2f} us (of 3: {ts[0]:.2f}-{ts[2]:.2f}) "
              f"{wbytes / ts[1] / 1e6:5.2f} TB/s; rel err of their sum {err:.1e}", flush=True)
        knobs = dict(split_k=4, block_n=64, num_warps=4, num_stages=5)
        copies = [wd] + [wd.clone() for _ in range(2)]
        for name, kw in (("fused reduce", dict(fused_reduce=True)), ("cluster reduce", dict(cluster=True))):
            ts = sorted(time_us(lambda: G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=f32, **kw, **knobs),
                                reps=30) for _ in range(3))
            tg = []
            for on in (True, False):
                old = pdl.set_enabled(on)
                tg.append(graph_us([lambda w=w: G.fp8_block_gemm_triton(xd, xs, w, ws, out_dtype=f32, **kw, **knobs)
                                    for w in copies]))
                pdl.set_enabled(old)
            print(f"    production {name:14}: one call {ts[1]:6.2f} us (of 3: {ts[0]:.2f}-{ts[2]:.2f}) "
                  f"{wbytes / ts[1] / 1e6:5.2f} TB/s; in a graph {tg[0]:6.2f} us {wbytes / tg[0] / 1e6:5.2f} TB/s "
                  f"(PDL off: {tg[1]:6.2f} us)", flush=True)
        del copies


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="gemm,attn,prefill")
    ap.add_argument("--flush", default="dirty", choices=("dirty", "clean"),
                    help="L2 flush before each timed rep (benchmarks.bench_gemm._evict_l2)")
    args = ap.parse_args()
    global FLUSH
    FLUSH = args.flush
    print(fingerprint())
    big = torch.empty(2 ** 29, dtype=torch.bfloat16, device=DEV)
    t = time_us(lambda: big.clone(), reps=20)
    copy_tbs = 2 * big.numel() * 2 / t / 1e6
    del big
    print(f"HBM copy ceiling: {copy_tbs:.2f} TB/s")
    probes = {"gemm": probe_gemm, "gemv": probe_gemv, "decode_tune": probe_decode_tune, "pdl_ab": probe_pdl_ab,
              "small": probe_small, "prefetch": probe_prefetch, "rms": probe_rms, "attn": probe_attention,
              "attn_fine": lambda c: probe_attention(c, "fine"), "attn_short": probe_attn_short,
              "decode_small_m": probe_decode_small_m,
              "attn_short64": lambda c: probe_attn_short(c, batches=(64,), layouts=("dim",),
                                                         tiles=((1, 2), (2, 2), (2, 3), (4, 2), (4, 3), (8, 2)),
                                                         splits=(1, 2), block_ns=(64, 128, 256), bf16=True), "rms_tma": probe_rms_tma, "gemv_graph": probe_gemv_graph, "gemv_knobs": probe_gemv_knobs,
              "gemm_gps": probe_gemm_gps, "rms_warp": probe_rms_warp, "rms_parts": probe_rms_parts, "gemm_narrow": probe_gemm_narrow, "rms_occupancy": probe_rms_occupancy,
              "gemm_floor": probe_gemm_floor, "gemm_timeline": probe_gemm_timeline, "gemm_carveout": probe_gemm_carveout, "gemm_tail": probe_gemm_tail, "gemm_nosplit": probe_gemm_nosplit, "gemm_noswap": probe_gemm_noswap,
              "gemm_cluster": probe_gemm_cluster, "gemm_cluster_launch": probe_gemm_cluster_launch,
              "gemm_reduce_timeline": probe_gemm_reduce_timeline, "gemm_early": probe_gemm_early,
              "decode_graph": probe_decode_graph, "decode_graph32": lambda c: probe_decode_graph(c, ms=(32,)),
              "split_rule": probe_split_rule, "decode_dual": probe_decode_dual, "decode_stages": probe_decode_stages,
              "decode_stages_check": lambda c: probe_decode_stages(c, shapes=STAGE_CHECK), "mx_split": probe_mx_split,
              "mx_split64": lambda c: probe_mx_split(c, ms=(48, 64)),
              "mx_split_check": lambda c: probe_mx_split(c, ms=(4, 16, 32), shapes=MX_SPLIT_CHECK),
              "split_ab": probe_split_ab, "gemm_wholek": probe_gemm_wholek, "gemm_sliced": probe_gemm_sliced,
              "gemm_wgsplit": probe_gemm_wgsplit,
              "wgmma_timeline": probe_wgmma_timeline, "wgmma_sweep": probe_wgmma_sweep,
              "wgmma_sweep32": lambda c: probe_wgmma_sweep(c, shapes=((28672, 4096), (4096, 14336), (7168, 16384),
                                                                      (6144, 4096), (4096, 4096)), ms=(24, 32)),
              "reduce_burst": probe_reduce_burst, "wgmma_split": probe_wgmma_split,
              "wgmma_split_check": lambda c: probe_wgmma_split(c, shapes=STAGE_CHECK),
              "wgmma_split_check2": lambda c: probe_wgmma_split(c, shapes=WGMMA_CHECK),
              "wgmma_split_check3": lambda c: probe_wgmma_split(c, shapes=WGMMA_CHECK3),
              "gemm_wgsplit_all": lambda c: probe_gemm_wgsplit(c, shapes=SLICED_SHAPES[:3]),
              "gemm_wholek_rotate": probe_gemm_wholek_rotate,
              "gemm_wholek_ws": lambda c: probe_gemm_wholek_rotate(c, ws_too=True),
              "prefill": lambda _: probe_prefill()}
    parts = args.only.split(",")
    unknown = [p for p in parts if p not in probes]
    if unknown:
        ap.error(f"--only: unknown probe(s) {unknown}; choose from {sorted(probes)}")
    for name, probe in probes.items():
        if name in parts:
            probe(copy_tbs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
