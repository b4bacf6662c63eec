"""Probes for issue 4's remaining kernel gaps (H200): each prints achieved vs the copy ceiling of the same run.

    python benchmarks/probe_kernels.py [--only gemm,attn,prefill]

* gemm: the decode FP8 block GEMM at M = 1 / 16 on the Llama-3-8B decode shapes and the issue's three shapes:
  the production kernel (`fp8_block_linear`) vs a variant that streams the weight through a TMA tensor
  descriptor (`_tma_probe_kernel`, split-K partials summed by torch: its time excludes that reduce and is a
  lower bound for an integrated version).
* attn: paged FP8 decode attention (8 x 32K) with the fp16 PV path (`pv_fp16`) vs the bf16 PV path.
* prefill: cuBLAS blockwise 8192^3 through `scaled_mm_blockwise` (scales padded per call) vs `F.scaled_mm`
  on scales padded once, on benchmark-style saturated operands and on small-magnitude (randn) operands.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_gemm import fingerprint, fp8_block_operands, time_us  # noqa: E402

DEV = "cuda"


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


def probe_attention(copy_tbs: float) -> None:
    from benchmarks.bench_attention import fill_cache
    from engine.kernels.paged_kv import PagedKVCache, paged_decode_attention, paged_decode_attention_reference

    b, ctx, h, hkv, dh, page = 8, 32768, 32, 8, 128, 64
    cache = PagedKVCache(1, b * ctx // page, page, hkv, dh, dtype=torch.float8_e4m3fn, max_seqs=b, device=DEV)
    fill_cache(cache, b, ctx)
    q = torch.randn(b, h, 1, dh, device=DEV, dtype=torch.bfloat16, generator=torch.Generator(DEV).manual_seed(1))
    ref = paged_decode_attention_reference(q, cache, 0)
    kvb = cache.kv_bytes(b * ctx)
    print(f"\n## paged FP8 decode attention {b} x {ctx} (TB/s of KV bytes; target 2.5)")
    base_fold = paged_decode_attention(q, cache, 0, fold_v_scale=True)
    for cfg in [dict(), dict(fold_v_scale=True), dict(fold_v_scale=True, pv_fp16=True),
                dict(fold_v_scale=True, pv_fp16=True, num_stages=4),
                dict(fold_v_scale=True, pv_fp16=True, num_stages=6),
                dict(fold_v_scale=True, pv_fp16=True, num_splits=8),
                dict(fold_v_scale=True, pv_fp16=True, block_n=128, num_warps=8),
                dict(fold_v_scale=True, pv_fp16=True, maxnreg=128, num_splits=16)]:
        try:
            o = paged_decode_attention(q, cache, 0, **cfg)
            e_ref = ((o.float() - ref).abs().max() / ref.abs().max()).item()
            e_fold = ((o.float() - base_fold).abs().max() / base_fold.abs().max()).item()
            t = time_us(lambda: paged_decode_attention(q, cache, 0, **cfg), reps=20)
            print(f"  {str(cfg):80} {t:7.1f} us {kvb / t / 1e6:5.2f} TB/s ({100 * kvb / t / 1e6 / copy_tbs:.0f}% "
                  f"copy) err vs fp32 {e_ref:.1e} vs bf16-PV fold {e_fold:.1e}", flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"  {cfg} FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")


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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="gemm,attn,prefill")
    args = ap.parse_args()
    print(fingerprint())
    big = torch.empty(2 ** 29, dtype=torch.bfloat16, device=DEV)
    t = time_us(lambda: big.clone(), reps=20)
    copy_tbs = 2 * big.numel() * 2 / t / 1e6
    del big
    print(f"HBM copy ceiling: {copy_tbs:.2f} TB/s")
    parts = args.only.split(",")
    if "gemm" in parts:
        probe_gemm(copy_tbs)
    if "gemv" in parts:
        probe_gemv(copy_tbs)
    if "decode_tune" in parts:
        probe_decode_tune(copy_tbs)
    if "attn" in parts:
        probe_attention(copy_tbs)
    if "prefill" in parts:
        probe_prefill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
