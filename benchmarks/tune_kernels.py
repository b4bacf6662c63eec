"""Sweep the tuning knobs of the Triton FP8 kernels on one GPU: keep the correct configs, print achieved
bandwidth vs ceilings measured in the same run, write the best config per kernel / shape as JSON.

    python benchmarks/tune_kernels.py --out tune_kernels.json [--only quant,attention,gemm] [--budget-s 330]

Kernels and the wrapper keywords swept (issue 4 shapes):

* quant (`engine.kernels.quant`, rows x K = 16384 x 7168 bf16): `act_quant` (bm, gb, num_warps),
  `swiglu_quant` (bm, gb, num_warps, fast_silu), `rmsnorm_quant` (mode, bm, gb, num_warps, num_stages,
  programs_per_sm). TB/s of bytes moved (input read + FP8 data + fp32 scales written).
* attention (`engine.kernels.paged_kv.paged_decode_attention`, FP8 KV, batch 8 x 32K context, 32 query /
  8 KV heads, d 128, page 64): qk_fp16 / fold_v_scale, then block_n, num_warps, num_stages, maxnreg,
  then num_splits for the best three. TB/s of KV bytes (data + scales).
* gemm (`engine.kernels.gemm.fp8_block_gemm_triton`, M = 1 at N x K = 28672x4096, 4096x14336,
  7168x16384): block_n x split_k, then num_warps / num_stages and fused_reduce for the best two; the
  winner is re-timed at M = 4 and 16 next to the default dispatch. TB/s of weight bytes, x bf16 cuBLAS.

Correctness gate (a failing config is printed and dropped): act_quant / SwiGLU bit-exact vs the default
tiling; RMSNorm >= 99.9% identical FP8 bytes and scales within 2e-6 of the default (tilings change
the sum-of-squares order), and the winner's quantization bit-exact vs the formats library on its own
normed values; attention within the test tolerance (1.5e-2 of max |ref|) of the FP32 reference and
within 1e-2 of the default config; GEMM within 5e-3 (relative Frobenius) of the default dispatch,
the winner within 1e-2 of the float64 reference.

Timing: `benchmarks.common.time_us` (L2 flushed, then a GPU sleep longer than the call's host time, CUDA events,
median of REPS) and `common.host_us`. A time budget (--budget-s, default 330 s) is split over the
sections; configs beyond it are listed as skipped. Without CUDA: prints "no CUDA: nothing to tune" and
exits 0. Writes --out (default $OUT/tune_kernels.json when OUT is set) and a .txt of the printed lines.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import Report, copy_ceiling, fingerprint, finite, host_us, sync, time_us  # noqa: E402
from engine.kernels import sm_count  # noqa: E402

REPS = 30
WARMUP = 3
SECTIONS = ("quant", "attention", "gemm")
GEMM_SHAPES = [(28672, 4096), (4096, 14336), (7168, 16384)]
DEVICE = "cuda"


def _device_name() -> str:
    """The device name keying the decode configs ("" off CUDA)."""
    return torch.cuda.get_device_name(0) if torch.device(DEVICE).type == "cuda" else ""


class Log(Report):
    """The run's report (printed lines, measured rows as `records`), the chosen configs and the advice."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = self.records
        self.best: dict[str, Any] = {}
        self.advice: list[str] = []


class Section:
    """Runs configs of one section until its deadline; every config is independent (errors are printed)."""

    def __init__(self, log: Log, name: str, deadline: float, ceiling_tbs: float) -> None:
        self.log, self.name, self.deadline, self.ceiling = log, name, deadline, ceiling_tbs
        self.skipped = 0

    def run(self, kernel: str, cfg: dict[str, Any], fn: Callable[[], Any], check: Callable[[Any], tuple[bool, str]],
            nbytes: float, extra: Optional[dict[str, Any]] = None) -> Optional[dict[str, Any]]:
        """Compile + check + time fn; print one table line; return the row (None when skipped / failed)."""
        label = " ".join(f"{k}={v}" for k, v in cfg.items()) or "(default dispatch)"
        if time.time() > self.deadline:
            self.skipped += 1
            self.log.rows.append({"section": self.name, "kernel": kernel, "cfg": cfg, "status": "skipped (budget)"})
            return None
        row: dict[str, Any] = {"section": self.name, "kernel": kernel, "cfg": cfg, **(extra or {})}
        try:
            out = fn()
            sync()
            ok, detail = check(out)
            row["check"] = detail
            if not ok:
                row["status"] = "WRONG"
                self.log.say(f"  {kernel:10} {label:64} WRONG ({detail}): dropped")
                self.log.rows.append(row)
                return None
            del out
            us = time_us(fn, reps=REPS, warmup=WARMUP)
            row.update(status="ok", us=us, host_us=host_us(fn, 5), tbs=nbytes / (us * 1e-6) / 1e12)
        except Exception as exc:  # one failing config must not abort the sweep
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]
            row.update(status="error", error=msg)
            self.log.say(f"  {kernel:10} {label:64} FAILED {msg}")
            self.log.rows.append(row)
            traceback.print_exc(limit=2)
            return None
        self.log.say(f"  {kernel:10} {label:64} {row['us']:9.1f} us {row['tbs']:6.2f} TB/s "
                     f"{100 * row['tbs'] / self.ceiling:5.1f}% host {row['host_us']:5.0f} us  {detail}")
        self.log.rows.append(row)
        return row

    def note_skips(self) -> None:
        """Say how many configs the budget cut."""
        if self.skipped:
            self.log.say(f"  ({self.skipped} configs skipped: time budget)")


def best_of(rows: list[Optional[dict[str, Any]]]) -> Optional[dict[str, Any]]:
    """The fastest ok row."""
    ok = [r for r in rows if r and r.get("status") == "ok"]
    return min(ok, key=lambda r: r["us"]) if ok else None


# ------------------------------------------------------------------------------------------- quant
def tune_quant(log: Log, deadline: float, copy_tbs: float, rows_: int, k: int) -> None:
    """act_quant, SwiGLU+quant and RMSNorm+quant tilings at rows_ x k."""
    from engine.kernels import quant as Q

    sec = Section(log, "quant", deadline, copy_tbs)
    m = rows_
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16, generator=g)
    u = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16, generator=g)
    w = torch.rand(k, device=DEVICE, generator=g) + 0.5
    groups = -(-k // 128)
    out_bytes = m * k + m * groups * 4
    bits = lambda t: t.view(torch.uint8)  # noqa: E731
    log.say(f"\n## quant kernels, {m} x {k} bf16 -> e4m3 + fp32 1x128 scales (ceiling: copy {copy_tbs:.2f} TB/s; "
            "target >= 3.0 TB/s)")

    def exact(ref):
        return lambda o: ((torch.equal(bits(o[0]), bits(ref[0])) and torch.equal(o[1], ref[1])), "bit-exact vs default")

    # act_quant
    d = Q.ACT_QUANT_DEFAULTS
    ref = Q.act_quant(x)
    res = []
    for bm, gb, nw in [(d["bm"], d["gb"], d["num_warps"]), (16, 2, 4), (8, 4, 4), (64, 1, 8), (32, 2, 8), (16, 4, 8)]:
        cfg = dict(bm=bm, gb=gb, num_warps=nw)
        res.append(sec.run("act_quant", cfg, lambda cfg=cfg: Q.act_quant(x, **cfg), exact(ref), m * k * 2 + out_bytes))
    _record_best(log, "act_quant", best_of(res), res[0], dict(d))
    del ref

    # SwiGLU
    d = Q.SWIGLU_DEFAULTS
    refs = {fs: Q.swiglu_quant(x, u, fast_silu=fs) for fs in (True, False)}
    res = []
    for bm, gb, nw, fs in [(d["bm"], d["gb"], d["num_warps"], d["fast_silu"]), (16, 1, 4, False), (8, 1, 4, True),
                           (32, 1, 4, True), (8, 2, 4, True), (4, 4, 4, True), (16, 2, 8, True), (32, 2, 8, True)]:
        cfg = dict(bm=bm, gb=gb, num_warps=nw, fast_silu=fs)
        res.append(sec.run("swiglu", cfg, lambda cfg=cfg: Q.swiglu_quant(x, u, **cfg), exact(refs[fs]),
                           2 * m * k * 2 + out_bytes))
    _record_best(log, "swiglu_quant", best_of(res), res[0], dict(d))
    del refs

    # RMSNorm
    d = Q.RMSNORM_DEFAULTS
    ref = Q.rmsnorm_quant(x, w, 1e-5)

    def close(o):
        same = (bits(o[0]) == bits(ref[0])).float().mean().item()
        srel = ((o[1] - ref[1]).abs() / ref[1].abs()).max().item()
        return same > 0.999 and srel <= 2e-6, f"{100 * same:.3f}% bytes = default, scales rel {srel:.1e}"

    cfgs = [dict(d)]  # the current default first
    cfgs += [dict(mode="chunked", bm=bm, gb=gb, num_warps=nw, num_stages=st) for bm, gb, nw, st in
             [(1, 8, 4, 2), (1, 16, 4, 3), (1, 32, 4, 2), (1, 32, 8, 2), (1, 16, 8, 3), (2, 8, 4, 2), (2, 16, 8, 2),
              (4, 8, 8, 2), (1, 16, 4, 1), (8, 1, 4, 1), (1, 64, 8, 1), (1, 64, 16, 1)]]
    cfgs += [dict(mode="persistent", num_warps=nw, num_stages=st, programs_per_sm=pps) for nw, st, pps in
             [(8, 2, 2), (8, 3, 2), (8, 4, 2), (8, 3, 1), (16, 3, 1), (16, 4, 1)]]
    res = []
    for cfg in cfgs:
        res.append(sec.run("rmsnorm", cfg, lambda cfg=cfg: Q.rmsnorm_quant(x, w, 1e-5, **cfg), close,
                           m * k * 2 + k * 4 + out_bytes))
    # the winner's quantization vs the formats library on its own normed values (the GPU test's check)
    ranked = sorted((r for r in res if r and r.get("status") == "ok"), key=lambda r: r["us"])
    winner = None
    for r in ranked[:3]:
        try:
            dd, ss, hh = Q.rmsnorm_quant(x, w, 1e-5, return_hp=True, **r["cfg"])
            rd, rs = Q.act_quant_reference(hh)
            _, _, href = Q.rmsnorm_quant_reference(x, w, 1e-5)
            rel = ((hh - href).abs() / href.abs().clamp_min(1e-30))[href != 0].max().item()
            ok = torch.equal(bits(dd), bits(rd)) and torch.equal(ss.view(torch.int32), rs.view(torch.int32)) and rel < 4e-6
            log.say(f"  rmsnorm winner check {r['cfg']}: library-exact={ok} normed rel err {rel:.1e}")
            if ok:
                winner = r
                break
        except Exception as exc:
            log.say(f"  rmsnorm winner check {r['cfg']} FAILED {type(exc).__name__}: {exc}")
    _record_best(log, "rmsnorm_quant", winner, res[0], dict(d))
    sec.note_skips()


_DEFAULT_NAMES = {"act_quant": "ACT_QUANT_DEFAULTS", "swiglu_quant": "SWIGLU_DEFAULTS",
                  "rmsnorm_quant": "RMSNORM_DEFAULTS"}


def _record_best(log: Log, name: str, best: Optional[dict[str, Any]], default: Optional[dict[str, Any]],
                 default_cfg: dict[str, Any]) -> None:
    """Store the best row of a quant kernel; advise a new default when it beats the current one by > 3%."""
    if best is None:
        log.say(f"  -> {name}: no correct config measured")
        return
    ok_default = default if default and default.get("status") == "ok" else None
    log.best[name] = {"cfg": best["cfg"], "us": best["us"], "tbs": best["tbs"],
                      "default_us": ok_default["us"] if ok_default else None}
    gain = f"{ok_default['us'] / best['us']:.2f}x the default" if ok_default else "default not measured"
    log.say(f"  -> {name}: best {best['cfg']} {best['tbs']:.2f} TB/s ({gain})")
    if ok_default and ok_default["us"] / best["us"] > 1.03:
        merged = dict(default_cfg, **best["cfg"])
        log.advice.append(f"engine/kernels/quant.py: {_DEFAULT_NAMES[name]} = dict("
                          + ", ".join(f"{k}={v!r}" for k, v in merged.items())
                          + f")  # {best['tbs']:.2f} TB/s vs {ok_default['tbs']:.2f}")


# --------------------------------------------------------------------------------------- attention
def tune_attention(log: Log, deadline: float, copy_tbs: float, b: int, ctx: int) -> None:
    """Paged FP8 decode attention: flags, tiles, splits."""
    from benchmarks.bench_attention import fill_cache
    from engine.kernels.paged_kv import (PagedKVCache, decode_plan, paged_decode_attention,
                                         paged_decode_attention_reference)

    h, hkv, dh, page = 32, 8, 128, 64
    log.say(f"\n## paged decode attention, FP8 KV, batch {b} x {ctx} context, {h}/{hkv} heads, d {dh}, page {page} "
            f"(ceiling: copy {copy_tbs:.2f} TB/s; target >= 2.5 TB/s)")
    try:
        t0 = time.time()
        cache = PagedKVCache(1, b * -(-ctx // page), page, hkv, dh, dtype=torch.float8_e4m3fn, max_seqs=b,
                             device=DEVICE)
        fill_cache(cache, b, ctx)
        q = torch.randn(b, h, 1, dh, device=DEVICE, dtype=torch.bfloat16,
                        generator=torch.Generator(device=DEVICE).manual_seed(1))
        ref = paged_decode_attention_reference(q, cache, 0)
        out0 = paged_decode_attention(q, cache, 0)
        sync()
        log.say(f"  (cache filled, reference computed in {time.time() - t0:.1f} s)")
    except Exception as exc:
        log.say(f"  setup FAILED {type(exc).__name__}: {exc}")
        return
    kv_bytes = cache.kv_bytes(b * ctx)
    sms = sm_count(torch.device(DEVICE))

    def rel(a, r):
        return ((a.float() - r).abs().max() / r.abs().max()).item()

    def check(o):
        e_ref, e_def = rel(o, ref), rel(o, out0)
        return e_ref <= 1.5e-2 and e_def <= 1e-2, f"err vs fp32 ref {e_ref:.1e}, vs default {e_def:.1e}"

    sec = Section(log, "attention", deadline, copy_tbs)

    def run(cfg):
        return sec.run("decode", cfg, lambda: paged_decode_attention(q, cache, 0, **cfg), check, kv_bytes)

    try:  # torch SDPA on contiguous bf16 K/V: what a bandwidth-bound decode reaches here
        kk = torch.randn(b, hkv, ctx, dh, device=DEVICE, dtype=torch.bfloat16)
        vv = torch.randn_like(kk)
        us = time_us(lambda: torch.nn.functional.scaled_dot_product_attention(q, kk, vv, enable_gqa=True), reps=10)
        sdpa = 2 * kk.numel() * 2 / (us * 1e-6) / 1e12
        log.say(f"  torch SDPA bf16 contiguous K/V: {us:.1f} us, {sdpa:.2f} TB/s ({100 * sdpa / copy_tbs:.0f}% of copy)")
        log.rows.append({"section": "attention", "kernel": "sdpa_bf16", "us": us, "tbs": sdpa})
        kk = vv = None
    except Exception as exc:
        log.say(f"  SDPA FAILED {type(exc).__name__}: {exc}")

    base = dict(block_n=64, num_warps=4, num_stages=3)
    log.say("  -- numerics flags at the old tiles (qk_fp16: fp16 QK^T with pow2-scaled q; fold: V scale on P)")
    flags = []
    for f16, fold in [(False, False), (True, False), (False, True), (True, True)]:
        flags.append(run(dict(base, qk_fp16=f16, fold_v_scale=fold)))
    fb = best_of(flags)
    fcfg = {k: fb["cfg"][k] for k in ("qk_fp16", "fold_v_scale")} if fb else {}
    log.say(f"  -- tiles with {fcfg} (maxnreg caps registers: 255 at 4 warps = 2 programs/SM; "
            "num_stages >= 5 gives K/V two buffers past the block-table indirection)")
    tiles = []  # each tile config at the default split count and at 16 / 32 (more resident programs per SM)
    for bn, nw, st, mr in [(64, 4, 3, 128), (64, 4, 5, None), (64, 4, 5, 128), (64, 4, 5, 96), (64, 4, 6, 96),
                           (64, 8, 5, 128), (64, 8, 3, 128), (32, 4, 4, 96), (32, 4, 6, 96), (32, 4, 6, 64),
                           (128, 4, 3, 128), (128, 4, 5, 96), (128, 8, 5, 128), (16, 4, 6, None),
                           (64, 2, 5, None), (64, 2, 4, None), (128, 2, 4, None), (64, 1, 4, None),
                           (32, 1, 6, None)]:  # 2 / 1 warps: around the FP8 default (2 warps)
        cfg = dict(block_n=bn, num_warps=nw, num_stages=st, **({"maxnreg": mr} if mr else {}), **fcfg)
        for ns in (None, 16, 32):
            tiles.append(run(cfg if ns is None else dict(cfg, num_splits=ns)))
    ranked = sorted((r for r in tiles + flags if r and r.get("status") == "ok"), key=lambda r: r["us"])
    tops = []
    for r in ranked:  # the three best tile configs, whatever their split count
        key = {k: v for k, v in r["cfg"].items() if k != "num_splits"}
        if key not in tops:
            tops.append(key)
        if len(tops) == 3:
            break
    log.say(f"  -- more num_splits for the best {len(tops)} (default `decode_plan`: "
            f"{decode_plan(cache, sms, b, ctx, 64)[2]} for the default tiles)")
    splits = []
    for cfg in tops:
        for ns in (4, 12, 24, 48, 64):
            splits.append(run(dict(cfg, num_splits=ns)))
    best = best_of(flags + tiles + splits)
    first = flags[0] if flags and flags[0] else None
    if best:
        log.best["paged_decode_attention"] = {"cfg": best["cfg"], "us": best["us"], "tbs": best["tbs"],
                                              "old_default_us": first["us"] if first else None}
        ns = best["cfg"].get("num_splits")
        log.say(f"  -> paged_decode_attention: best {best['cfg']} {best['tbs']:.2f} TB/s"
                + (f" ({first['us'] / best['us']:.2f}x the old default)" if first else ""))
        kw = {k: v for k, v in best["cfg"].items() if k != "num_splits"}
        log.advice.append("engine/kernels/paged_kv.py paged_decode_attention defaults: "
                          + ", ".join(f"{k}={v!r}" for k, v in kw.items()) + f"  # {best['tbs']:.2f} TB/s")
        if ns:
            log.advice.append(f"paged_kv.py num_splits heuristic: {ns} splits x {b * hkv} (batch x kv_heads) = "
                              f"{ns * b * hkv} programs = {ns * b * hkv / sms:.2f} per SM (the default rule gives "
                              f"{max(1, 4 * sms // (b * hkv))}): set the '4 * sms' factor to ~{ns * b * hkv / sms:.0f}")
    sec.note_skips()


# -------------------------------------------------------------------------------------------- gemm
def tune_gemm(log: Log, deadline: float, copy_tbs: float) -> None:
    """Decode FP8 block GEMM (Triton split-K) per shape: tiles x splits, then pipeline / fused reduce."""
    import torch.nn.functional as F

    from benchmarks.bench_gemm import fp8_block_operands
    from engine.kernels import gemm as G
    from engine.kernels import decode_plan as P

    sec = Section(log, "gemm", deadline, copy_tbs)
    dev_name = _device_name()
    log.say(f"\n## decode FP8 block GEMM (Triton), M = 1 (TB/s of weight bytes; ceiling: copy {copy_tbs:.2f} TB/s; "
            "targets >= 3.0 TB/s and >= 1.6x bf16)")
    for n, k in GEMM_SHAPES:
        try:
            _, _, wd, ws = fp8_block_operands(1, n, k, seed=n)
            xd, xs, _, _ = fp8_block_operands(1, 16, k, seed=1)
            w16 = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
            x16 = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
            t16 = time_us(lambda: F.linear(x16, w16))
            w16 = None
            out0 = G.fp8_block_linear(xd, xs, wd, ws)
            ref = G.fp8_block_linear_reference(xd, xs, wd, ws, out_dtype=torch.float32)
        except Exception as exc:
            log.say(f"  {n}x{k} setup FAILED {type(exc).__name__}: {exc}")
            continue
        wbytes = wd.numel() + ws.numel() * 4
        log.say(f"  -- {n}x{k}: bf16 cuBLAS {t16:.1f} us ({n * k * 2 / (t16 * 1e-6) / 1e12:.2f} TB/s); "
                f"FP8 weight {wbytes / 1e6:.1f} MB")

        def relf(a, r):
            return ((a.float() - r.float()).norm() / r.float().norm()).item()

        def check(o):
            e = relf(o, out0)
            return e <= 5e-3, f"rel vs default {e:.1e}"

        def run(cfg, m_x=(xd, xs)):
            r = sec.run(f"{n}x{k}", cfg, lambda: G.fp8_block_gemm_triton(*m_x, wd, ws, **cfg), check, wbytes,
                        {"n": n, "k": k, "m": m_x[0].shape[0]})
            if r:
                r["x_bf16"] = t16 / r["us"]
            return r

        d = run({})  # the default dispatch's config (heuristic / DECODE_CONFIGS)
        stage_a = [d]
        for bn in (32, 64, 128):
            for s in (1, 2, 4, 8, 16):
                stage_a.append(run(dict(block_n=bn, split_k=s, num_warps=4, num_stages=4)))
        top = sorted((r for r in stage_a[1:] if r and r.get("status") == "ok"), key=lambda r: r["us"])[:2]
        stage_b = []
        for r in top:
            bn, s = r["cfg"]["block_n"], r["cfg"]["split_k"]
            for nw, st in ((4, 3), (4, 5), (4, 6), (8, 4), (8, 6)):
                stage_b.append(run(dict(block_n=bn, split_k=s, num_warps=nw, num_stages=st)))
            if s > 1:
                bb = best_of([r] + stage_b[-5:])
                stage_b.append(run(dict(bb["cfg"], fused_reduce=True)))
        best = best_of(stage_a + stage_b)
        if not best:
            continue
        e_ref = relf(G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.float32, **best["cfg"]), ref)
        log.say(f"  -> {n}x{k} M=1: best {best['cfg']} {best['us']:.1f} us {best['tbs']:.2f} TB/s "
                f"{best['x_bf16']:.2f}x bf16; default {d['us'] if d else float('nan'):.1f} us; "
                f"winner vs float64 reference {e_ref:.1e} ({'ok' if e_ref <= 1e-2 else 'WRONG'})")
        entry = {"cfg": best["cfg"], "us": best["us"], "tbs": best["tbs"], "x_bf16": best["x_bf16"],
                 "default_us": d["us"] if d else None, "bf16_us": t16, "rel_err_vs_reference": e_ref, "per_m": {}}
        for m in (4, 16):  # BM = 16 covers M <= 16: the M = 1 config applies; check it holds
            try:
                xm, xsm, _, _ = fp8_block_operands(m, 16, k, seed=m)
                td = time_us(lambda: G.fp8_block_linear(xm, xsm, wd, ws))
                tb = time_us(lambda: G.fp8_block_gemm_triton(xm, xsm, wd, ws, **best["cfg"]))
                entry["per_m"][m] = {"default_us": td, "best_us": tb, "tbs": wbytes / (tb * 1e-6) / 1e12}
                log.say(f"     M={m:2}: default {td:.1f} us, best config {tb:.1f} us ({wbytes / (tb * 1e-6) / 1e12:.2f} TB/s)")
            except Exception as exc:
                log.say(f"     M={m}: FAILED {type(exc).__name__}: {exc}")
        log.best[f"gemm {n}x{k}"] = entry
        if e_ref <= 1e-2 and d and d["us"] / best["us"] > 1.03:
            cfg = dict(dict(split_k=None, block_n=64, num_warps=4, num_stages=4, fused_reduce=False,
                            whole_k=False),
                       **best["cfg"])
            worse = [m for m, v in entry["per_m"].items() if v["best_us"] > 1.05 * v["default_us"]]
            knobs = {key: cfg[key] for key in P.DECODE_KNOBS if cfg.get(key) is not None}
            log.advice.append(f"engine/kernels/configs/{P.config_file_name(dev_name)} decode entry "
                              + json.dumps(dict(n=n, k=k, bm=16, knobs=knobs))
                              + f")  # {best['us']:.1f} us vs default {d['us']:.1f} us at M=1"
                              + (f"; SLOWER than the default at M={worse}: check per_m" if worse else ""))
        if torch.device(DEVICE).type == "cuda":
            torch.cuda.empty_cache()
    sec.note_skips()


# -------------------------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    """Parse arguments, run the sections within the budget, print advice, write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON path (default: $OUT/tune_kernels.json when OUT is set)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma list of {SECTIONS}")
    ap.add_argument("--budget-s", type=float, default=330.0, help="wall-clock budget for all sections")
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    args = ap.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in only if s not in SECTIONS]
    if bad:
        ap.error(f"--only: unknown section(s) {bad}; use {SECTIONS}")
    if not torch.cuda.is_available():
        print("no CUDA: nothing to tune")
        return 0
    t_start = time.time()
    log = Log()
    fp = fingerprint()
    log.say("# tune_kernels: knob sweeps of the Triton FP8 kernels")
    log.say(json.dumps(fp))
    try:
        copy_tbs = copy_ceiling(reps=10)["tbs"]
    except Exception as exc:
        copy_tbs = float("nan")
        log.say(f"copy ceiling FAILED {type(exc).__name__}: {exc}")
    log.say(f"HBM copy ceiling (1 GiB clone, read + write): {copy_tbs:.2f} TB/s")
    end = t_start + args.budget_s
    for i, name in enumerate(only):
        share = (end - time.time()) / (len(only) - i)
        deadline = min(end, time.time() + share)
        t0 = time.time()
        try:
            if name == "quant":
                tune_quant(log, deadline, copy_tbs, args.rows, args.k)
            elif name == "attention":
                tune_attention(log, deadline, copy_tbs, args.batch, args.context)
            else:
                tune_gemm(log, deadline, copy_tbs)
        except Exception as exc:  # a broken section must not lose the others' results
            log.say(f"section {name} FAILED {type(exc).__name__}: {exc}")
            traceback.print_exc()
        log.say(f"({name}: {time.time() - t0:.0f} s)")
        if torch.device(DEVICE).type == "cuda":
            torch.cuda.empty_cache()
    log.say("\n## best vs issue-4 targets (same run)")
    targets = {"act_quant": 3.0, "swiglu_quant": 3.0, "rmsnorm_quant": 3.0, "paged_decode_attention": 2.5}
    for name, b in log.best.items():
        if name in targets:
            log.say(f"  {name:24} {b['tbs']:5.2f} TB/s  target {targets[name]:.1f}  "
                    f"{'MEETS' if b['tbs'] >= targets[name] else 'BELOW'}")
        elif name.startswith("gemm"):
            ok = b["tbs"] >= 3.0 and b["x_bf16"] >= 1.6
            log.say(f"  {name:24} {b['tbs']:5.2f} TB/s {b['x_bf16']:4.2f}x bf16  targets 3.0 TB/s, 1.6x  "
                    f"{'MEETS' if ok else 'BELOW'}")
    log.say("\n## suggested default changes (best config >3% faster than the current default, checked correct)")
    for a in log.advice or ["(none)"]:
        log.say(f"  {a}")
    log.say(f"\n(total {time.time() - t_start:.0f} s)")
    out = args.out or (str(Path(os.environ["OUT"]) / "tune_kernels.json") if os.environ.get("OUT") else None)
    if out:
        p = Path(out)
        p.parent.mkdir(parents=True, exist_ok=True)
        payload = {"fingerprint": fp, "copy_tbs": copy_tbs, "best": log.best, "advice": log.advice, "rows": log.rows}
        p.write_text(json.dumps(finite(payload), indent=1, default=str) + "\n")
        p.with_suffix(".txt").write_text("\n".join(log.lines) + "\n")
        log.say(f"wrote {p} and {p.with_suffix('.txt')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
