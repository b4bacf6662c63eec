"""Benchmark the quantized GEMMs on the GPU: achieved vs ceilings measured in the same run.

    python benchmarks/bench_gemm.py [--only prefill,decode,mx]   # writes $OUT/bench_gemm.{json,txt} when OUT is set

Sections (every case is independent: a failure is printed and the run continues):

1. ceilings: HBM copy bandwidth (1 GiB clone, read + write) and HBM read bandwidth (1 GiB, clean L2);
2. prefill 8192^3: FP8 block (1x128 x 128x128) through ``fp8_block_linear`` (cuBLAS blockwise,
   padded scales), the Triton blockwise fallback, per-tensor ``_scaled_mm``, bf16 ``torch.mm``
   (target >= 1200 TFLOP/s for FP8 block);
3. decode M = 1, 4, 16 at N x K = 28672x4096, 4096x14336, 7168x16384: the Triton small-M kernel
   vs bf16 cuBLAS ``F.linear`` and cuBLAS blockwise FP8 (M padded to 4): us, TB/s of weight bytes
   (FP8 data + fp32 scales; bf16: 2 bytes/weight), % of the read ceiling, speed-up vs bf16
   (targets >= 3.0 TB/s and >= 1.6x), back to back in a CUDA graph as the engine runs decode (the
   acceptance timing) and one call after a clean and after a dirty L2 flush (see Timing; `decode_section`);
   plus a split-K sweep at M = 1 for tuning;
4. MX / NVFP4 dequant-in-kernel GEMMs at 4096^3 (TFLOP/s) and M = 1, 4096x4096 (us, TB/s).

Timing: CUDA events around one call, after warm-up (which also runs any autotuning), with a
256 MiB flush before every rep so weights come from HBM (cold L2, as in a real decode step), then a
GPU-side sleep longer than the call's host time, so the whole call is queued before the start event
runs and the events time GPU work only; the median of >= 20 reps is reported. Without the sleep, a
wrapper whose Python work (validation, allocations, the autotuner's dispatch, a second launch for
split-K) outlasts the flush is timed partly as CPU time (on the H200, 79.6 us for 4096x14336 M=1 where
the split-K sweep of the same kernel and split, timed without that host work, showed ~40 us);
benchmarks/tune_kernels.py times both ways side by side with the host time per call.
The flush is a write ("dirty", the default, as `triton.testing.do_bench` flushes) or a read ("clean"):
a written flush leaves ~50 MB of modified lines in L2, whose write-back the timed call pays -- for a
read-only decode GEMM that is a third of its own traffic, which a real decode step does not have
(`_evict_l2`; the decode section shows both).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPS = 25
WARMUP = 5
DECODE_SHAPES = [(28672, 4096), (4096, 14336), (7168, 16384)]  # (N, K)
DECODE_M = [1, 4, 16]
PREFILL = 8192  # M = N = K of the prefill GEMMs
MX_SIZE = 4096  # N = K (and M of the large case) of the MX GEMMs
FLUSH_BYTES = 256 * 2**20  # written or read before every timed rep: evicts L2 (50 MB on H200)
GRAPH_ROTATE_BYTES = 320 * 2**20  # weight copies cycled through by the CUDA-graph decode timing
COPY_BYTES = 2**30  # buffer of the HBM copy ceiling
DEVICE = "cuda"
TARGET_PREFILL_TFLOPS = 1200.0
TARGET_DECODE_TBS = 3.0
TARGET_DECODE_SPEEDUP = 1.6

_flush = None
_sleep_cycles_per_us: float | None = None


def _gpu_sleep(us: float) -> None:
    """Keep the GPU busy for ~us microseconds (torch.cuda._sleep, calibrated once; a big memset without it)."""
    global _sleep_cycles_per_us
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:  # private API: fall back to GPU work of roughly that length (~4 bytes / ns)
        torch.empty(int(us * 4e3), dtype=torch.uint8, device=DEVICE).zero_()
        return
    if _sleep_cycles_per_us is None:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sleep(1000)  # first launch
        s.record()
        sleep(2_000_000)
        e.record()
        torch.cuda.synchronize()
        _sleep_cycles_per_us = 2_000_000 / max(s.elapsed_time(e) * 1e3, 1.0)
    sleep(int(us * _sleep_cycles_per_us))


try:  # the read ceiling's kernel; the benchmark itself needs a GPU, importing this module does not
    import triton
    import triton.language as tl

    @triton.jit
    def _read_kernel(src_ptr, out_ptr, per_prog, BLOCK: tl.constexpr):
        """Stream per_prog int32 words of one contiguous chunk per program; store their xor (keeps the loads)."""
        base = src_ptr + tl.program_id(0).to(tl.int64) * per_prog
        acc = tl.zeros((BLOCK,), dtype=tl.int32)
        for i in tl.range(0, per_prog, BLOCK, num_stages=3):
            acc ^= tl.load(base + i + tl.arange(0, BLOCK))
        tl.store(out_ptr + tl.program_id(0), tl.xor_sum(acc, 0))
except ImportError:  # pragma: no cover
    _read_kernel = None


def read_ceiling(nbytes: int = COPY_BYTES) -> dict[str, Any]:
    """HBM read bandwidth, clean-flushed L2: a streaming Triton read (16 KB per loop step, 1 MiB per program)
    and torch's amax over the same buffer; the faster one is the ceiling of read-only kernels (decode GEMMs)."""
    buf = torch.ones(nbytes // 4, dtype=torch.int32, device=DEVICE)
    per = 2**18  # words per program
    out = torch.empty(buf.numel() // per, dtype=torch.int32, device=DEVICE)
    t_tri = time_us(lambda: _read_kernel[(out.numel(),)](buf, out, per, BLOCK=4096, num_warps=8), reps=20,
                    flush="clean")
    t_amax = time_us(lambda: buf.amax(), reps=20, flush="clean")
    return {"triton_tbs": nbytes / t_tri / 1e6, "amax_tbs": nbytes / t_amax / 1e6,
            "tbs": nbytes / min(t_tri, t_amax) / 1e6}


def host_us(fn: Callable[[], Any], n: int = 7) -> float:
    """Median CPU microseconds of one fn() call without synchronizing (Python + launch overhead)."""
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(ts)


FLUSHES = ("clean", "dirty")


def _evict_l2(flush: str) -> None:
    """Push the previous rep's lines out of L2 (50 MB on the H200) before a timed call.

    "dirty": write FLUSH_BYTES (as `triton.testing.do_bench` does): L2 is left full of modified lines, and the timed
    call pays their write-back to HBM -- up to ~50 MB of extra traffic a real decode step never has.
    "clean": read FLUSH_BYTES (an amax over it): L2 is left full of clean lines that are dropped for free,
    the state a decode step's GEMV finds (the previous kernels read weights and wrote KBs)."""
    global _flush
    if _flush is None:
        _flush = torch.zeros(FLUSH_BYTES // 4, dtype=torch.int32, device=DEVICE)
    if flush == "dirty":
        _flush.zero_()
    elif flush == "clean":
        _flush.amax()
    else:
        raise ValueError(f"flush={flush!r}: use one of {FLUSHES}")


def time_us(fn: Callable[[], Any], reps: int = REPS, warmup: int = WARMUP, shield: bool = True,
            flush: str = "dirty") -> float:
    """Median GPU microseconds of fn() (CUDA events; L2 flushed before each rep, `flush` as in `_evict_l2`;
    see the module docstring).

    shield=False is the pre-fix methodology (flush only), kept to show the host-time artefact."""
    for _ in range(warmup):
        fn()
    _evict_l2(flush)  # the first clean flush also writes back what allocating the flush buffer left dirty
    torch.cuda.synchronize()
    sleep_us = min(5000.0, max(100.0, 2.0 * host_us(fn, 3))) if shield else 0.0
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        _evict_l2(flush)
        if shield:
            _gpu_sleep(sleep_us)
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def graph_us(fn: Callable[[], Any] | Sequence[Callable[[], Any]], n: int = 64, reps: int = 20) -> float:
    """Median microseconds per call over CUDA-graph replays of n back-to-back calls, as in a captured decode step
    (launch gaps included; PDL edges where the kernels launch with it). A list of callables is cycled through --
    e.g. one per copy of a weight, so that each call reads what the previous calls evicted from L2."""
    fns = list(fn) if isinstance(fn, (list, tuple)) else [fn]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compilation, autotuning) outside the capture
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / n)
    return statistics.median(ts)


def fingerprint() -> dict[str, Any]:
    """GPU name, compute capability, driver, torch / CUDA / Triton versions."""
    try:
        from evalharness.provenance import hardware_fingerprint

        return hardware_fingerprint("cuda")
    except Exception as exc:  # the harness package is optional here: fall back to the basics
        import triton

        p = torch.cuda.get_device_properties(0)
        return {"gpu": p.name, "compute_capability": f"{p.major}.{p.minor}", "torch": torch.__version__,
                "cuda": torch.version.cuda, "triton": triton.__version__, "driver": None,
                "fingerprint_error": repr(exc)}


def _finite(obj: Any) -> Any:
    """NaN / Inf floats -> None, recursively (strict JSON)."""
    if isinstance(obj, float) and obj != obj or obj in (float("inf"), float("-inf")):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def fp8_block_operands(m: int, n: int, k: int, seed: int = 0):
    """Random e4m3:1x128 activations / e4m3:128x128 weights (values only need to be realistic, not quantized)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    xd = (torch.randn(m, k, device=DEVICE, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    wd = (torch.randn(n, k, device=DEVICE, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)  # e4m3fn casts overflow to NaN
    xs = torch.rand(m, -(-k // 128), device=DEVICE, generator=g) * 1e-2 + 1e-3
    ws = torch.rand(-(-n // 128), -(-k // 128), device=DEVICE, generator=g) * 1e-3 + 1e-4
    return xd, xs, wd, ws


SECTIONS = ("prefill", "decode", "mx")


def main(argv: list[str] | None = None) -> int:
    """Run the ceilings and the chosen sections; print the tables; write JSON + text under $OUT."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    only = set(ap.parse_args(argv).only.split(","))
    if only - set(SECTIONS):
        ap.error(f"--only: unknown section(s) {sorted(only - set(SECTIONS))}; choose from {SECTIONS}")
    from engine.kernels import gemm as G

    lines: list[str] = []
    rows: list[dict[str, Any]] = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    def case(section: str, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        try:
            r = fn()
        except Exception as exc:  # one failing case must not abort the others
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            say(f"  {name:44} FAILED {msg}")
            traceback.print_exc(limit=3)
            rows.append({"section": section, "case": name, "error": msg})
            return None
        r.update(section=section, case=name)
        rows.append(r)
        return r

    fp = fingerprint()
    say("# bench_gemm: quantized GEMMs, achieved vs ceilings measured in this run")
    say(json.dumps(fp))
    say(f"F.scaled_mm available: {G.has_scaled_mm()}")

    # ---------------------------------------------------------------- 1. ceilings
    say("\n## ceilings")
    def copy_ceiling() -> dict[str, Any]:
        big = torch.empty(COPY_BYTES // 2, dtype=torch.bfloat16, device=DEVICE)
        t = time_us(lambda: big.clone(), reps=20)
        return {"us": t, "tbs": 2 * big.numel() * 2 / (t * 1e-6) / 1e12}

    r = case("ceiling", "hbm_copy", copy_ceiling)
    copy_tbs = r["tbs"] if r else float("nan")
    say(f"  HBM copy ({COPY_BYTES / 2**30:g} GiB clone, read+write): {copy_tbs:.2f} TB/s")
    r = case("ceiling", "hbm_read", read_ceiling)
    read_tbs = r["tbs"] if r else float("nan")
    if r:
        say(f"  HBM read ({COPY_BYTES / 2**30:g} GiB, clean L2): {read_tbs:.2f} TB/s (Triton stream "
            f"{r['triton_tbs']:.2f}, torch amax {r['amax_tbs']:.2f})")

    # ---------------------------------------------------------------- 2. prefill
    if "prefill" in only:
        prefill_section(say, case, G)
    if "decode" in only:
        decode_section(say, case, G, copy_tbs, read_tbs)
    if "mx" in only:
        mx_section(say, case, G, copy_tbs)
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "bench_gemm.txt").write_text("\n".join(lines) + "\n")
        payload = _finite({"fingerprint": fp, "copy_tbs": copy_tbs, "read_tbs": read_tbs, "rows": rows})
        (Path(out_dir) / "bench_gemm.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
        say(f"\nwrote {out_dir}/bench_gemm.json and bench_gemm.txt")
    return 0


def prefill_section(say, case, G) -> None:
    """FP8 block / per-tensor / bf16 GEMMs at PREFILL^3 (TFLOP/s)."""
    say(f"\n## prefill {PREFILL}^3 (TFLOP/s; target FP8 block >= {TARGET_PREFILL_TFLOPS:.0f})")
    m = n = k = PREFILL
    flops = 2.0 * m * n * k
    xd, xs, wd, ws = fp8_block_operands(m, n, k)
    a16 = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    b16 = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
    one = torch.ones((), device=DEVICE)
    prefill = {}

    def prefill_case(name, fn):
        def run():
            us = time_us(fn)
            return {"us": us, "tflops": flops / (us * 1e-6) / 1e12}
        r = case("prefill", name, run)
        if r:
            prefill[name] = r["tflops"]
            say(f"  {name:44} {r['us']:9.1f} us {r['tflops']:8.1f} TFLOP/s")

    prefill_case("bf16 torch.mm", lambda: torch.mm(a16, b16.t()))
    prefill_case("fp8 per-tensor torch._scaled_mm", lambda: torch._scaled_mm(xd, wd.t(), scale_a=one, scale_b=one,
                                                                          out_dtype=torch.bfloat16))
    prefill_case("fp8 block scaled_mm_blockwise (cuBLAS)", lambda: G.scaled_mm_blockwise(xd, xs, wd, ws))
    prefill_case("fp8 block fp8_block_linear", lambda: G.fp8_block_linear(xd, xs, wd, ws))
    prefill_case("fp8 block Triton fallback", lambda: G.fp8_block_gemm_triton(xd, xs, wd, ws))
    blk = prefill.get("fp8 block fp8_block_linear")
    if blk is not None:
        ref = prefill.get("fp8 per-tensor torch._scaled_mm")
        say(f"  -> FP8 block {blk:.0f} TFLOP/s: {'MEETS' if blk >= TARGET_PREFILL_TFLOPS else 'BELOW'} target "
            f"{TARGET_PREFILL_TFLOPS:.0f}; {blk / prefill.get('bf16 torch.mm', float('nan')):.2f}x bf16"
            + (f"; {100 * blk / ref:.0f}% of per-tensor FP8" if ref else ""))
    del xd, xs, wd, ws, a16, b16



def decode_section(say, case, G, copy_tbs: float, read_tbs: float) -> None:
    """Decode-shaped GEMMs (M = 1, 4, 16): the Triton kernels vs bf16 cuBLAS and cuBLAS blockwise FP8.

    Each case is timed three ways: per call in a CUDA graph of 48 back-to-back calls that cycle through copies
    of the weights (GRAPH_ROTATE_BYTES in all, so no call finds its weights in L2), as the engine's captured
    decode step runs them -- the acceptance timing: launches overlap (PDL, back-to-back launches) for bf16 and
    FP8 alike; one call after a clean L2 flush (`_evict_l2`), which adds each call's own launch and ramp, shown
    as well; and one call after a dirty flush, which also charges the call the write-back of ~50 MB of L2 lines
    it never wrote."""
    from engine.kernels import gemm_wgmma as gw
    from engine.kernels import decode_plan as P
    say(f"\n## decode (weight-bytes TB/s; ceilings: read {read_tbs:.2f} TB/s, copy {copy_tbs:.2f} TB/s; targets "
        f">= {TARGET_DECODE_TBS} TB/s and >= {TARGET_DECODE_SPEEDUP}x bf16, judged in the CUDA graph; one call "
        f"after a clean L2 flush shown as well)")
    say(f"  {'':17} {'one call, clean L2':^46} | {'one call, dirty L2':^26} | {'CUDA graph, back to back':^26} |")
    say(f"  {'N x K':13} {'M':>3} {'bf16 us':>8} {'TB/s':>5} {'fp8 us':>7} {'TB/s':>5} {'%read':>5} {'x bf16':>6} | "
        f"{'bf16 TB/s':>9} {'fp8 TB/s':>8} {'x bf16':>6} | {'bf16 TB/s':>9} {'fp8 TB/s':>8} {'x bf16':>6} | "
        f"{'cuBLAS blk x bf16':>17}  config")
    for n, k in DECODE_SHAPES:
        w16 = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
        _, _, wd, ws = fp8_block_operands(1, n, k, seed=n)
        fp8_bytes = wd.numel() + ws.numel() * 4
        for m in DECODE_M:
            xd, xs, _, _ = fp8_block_operands(m, 16, k, seed=m)
            x16 = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)

            def run(m=m, xd=xd, xs=xs, x16=x16, w16=w16, wd=wd, ws=ws, n=n, k=k):
                res = {"n": n, "k": k, "m": m}
                for fl in FLUSHES:
                    sfx = "" if fl == "clean" else "_dirty"
                    t16 = time_us(lambda: F.linear(x16, w16), flush=fl)
                    t8 = time_us(lambda: G.fp8_block_linear(xd, xs, wd, ws), flush=fl)
                    res.update({f"bf16_us{sfx}": t16, f"bf16_tbs{sfx}": n * k * 2 / (t16 * 1e-6) / 1e12,
                                f"fp8_us{sfx}": t8, f"fp8_tbs{sfx}": fp8_bytes / (t8 * 1e-6) / 1e12,
                                f"speedup_vs_bf16{sfx}": t16 / t8})
                # in a CUDA graph, back to back, each call on another copy of the weights (L2 holds none of it)
                c8, c16 = (max(2, -(-GRAPH_ROTATE_BYTES // b)) for b in (fp8_bytes, n * k * 2))
                w8s = [(wd, ws)] + [(wd.clone(), ws.clone()) for _ in range(c8 - 1)]
                w16s = [w16] + [w16.clone() for _ in range(c16 - 1)]
                g16 = graph_us([lambda w=w: F.linear(x16, w) for w in w16s], n=48)
                g8 = graph_us([lambda p=p: G.fp8_block_linear(xd, xs, *p) for p in w8s], n=48)
                del w8s, w16s
                res.update({"bf16_us_graph": g16, "bf16_tbs_graph": n * k * 2 / (g16 * 1e-6) / 1e12,
                            "fp8_us_graph": g8, "fp8_tbs_graph": fp8_bytes / (g8 * 1e-6) / 1e12,
                            "speedup_vs_bf16_graph": g16 / g8})
                h8 = host_us(lambda: G.fp8_block_linear(xd, xs, wd, ws))
                bm, bn, _, _ = P._tiles(m)
                pinned = P._decode_knobs(m, n, k, xd.device, {})  # the policy's decode entry, when one matches
                bn = pinned.get("block_n") or bn
                splits, _ = P._plan_split(m, n, -(-k // 128), bm, bn, xd.device, pinned.get("split_k"))
                if pinned:
                    cfg = f"entry {pinned}"
                elif n * k >= P.DEFAULT_POLICY.tune_min_weight:
                    cfg = f"split_k={splits} num_stages={P._decode_stages(-(-n // bn) * splits, P.sm_count(xd.device))}"
                else:
                    cfg = "fixed"
                try:
                    tcb = time_us(lambda: G.scaled_mm_blockwise(xd, xs, wd, ws), flush="clean")
                except Exception as exc:  # cuBLAS may refuse: the row still reports the Triton kernel
                    tcb = float("nan")
                    print(f"    cuBLAS blockwise M={m}: {str(exc).splitlines()[0]}")
                wgmma = m > 1 and bool(pinned.get("wgmma")) and gw.usable(
                    xd, wd, 64, pinned.get("num_stages") or gw.swap_stages(m, -(-k // 128), splits), gw.GPS,
                    splits, True)
                sliced = (m > 1 and not wgmma
                          and P._sliced_instead(xd, m, splits, bn, pinned.get("num_warps") or 4, pinned))
                res.update({"cublas_block_us": tcb, "cublas_speedup_vs_bf16": res["bf16_us"] / tcb,
                            "split_k": splits, "block_m": bm, "block_n": bn, "tuned_config": cfg, "fp8_host_us": h8,
                            "sliced": sliced, "wgmma": wgmma,
                            "gemv": m == 1 and P.DEFAULT_POLICY.gemv_m1,
                            "gemv_config": P._gemv_knobs(n, k, xd.device) or None})
                return res

            r = case("decode", f"{n}x{k} M={m}", run)
            if r:
                ok = r["fp8_tbs"] >= TARGET_DECODE_TBS and r["speedup_vs_bf16"] >= TARGET_DECODE_SPEEDUP
                ok_graph = (r["fp8_tbs_graph"] >= TARGET_DECODE_TBS
                            and r["speedup_vs_bf16_graph"] >= TARGET_DECODE_SPEEDUP)
                # meets_target: one call after a clean flush; meets_target_graph: the CUDA graph (the acceptance)
                r["meets_target"], r["meets_target_graph"] = ok, ok_graph
                kern = ((f"GEMV entry {r['gemv_config']}" if r["gemv_config"] else "GEMV") if r["gemv"] else
                        f"{'wgmma' if r.get('wgmma') else 'sliced' if r.get('sliced') else 'split'}={r['split_k']} "
                        f"BN={r['block_n']} "
                        f"{r['tuned_config']}")
                say(f"  {n:>5}x{k:<7} {m:>3} {r['bf16_us']:8.1f} {r['bf16_tbs']:5.2f} {r['fp8_us']:7.1f} "
                    f"{r['fp8_tbs']:5.2f} {100 * r['fp8_tbs'] / read_tbs:4.0f}% {r['speedup_vs_bf16']:5.2f}x | "
                    f"{r['bf16_tbs_dirty']:9.2f} {r['fp8_tbs_dirty']:8.2f} {r['speedup_vs_bf16_dirty']:5.2f}x | "
                    f"{r['bf16_tbs_graph']:9.2f} {r['fp8_tbs_graph']:8.2f} {r['speedup_vs_bf16_graph']:5.2f}x | "
                    f"{r['cublas_speedup_vs_bf16']:16.2f}x  {kern} host={r['fp8_host_us']:.0f}us "
                    f"graph {'ok' if ok_graph else 'BELOW'} (one call {'ok' if ok else 'BELOW'})")
        del w16, wd, ws

    say("\n## split-K sweep, fp8 Triton decode kernel, M = 1 (us; heuristic choice marked *)")
    for n, k in DECODE_SHAPES:
        _, _, wd, ws = fp8_block_operands(1, n, k, seed=n)
        xd, xs, _, _ = fp8_block_operands(1, 16, k, seed=1)
        splits_h, _ = P._plan_split(1, n, -(-k // 128), 16, 64, xd.device, None)
        parts = []
        for s in (1, 2, 4, 8, 16):
            r = case("splitk_sweep", f"{n}x{k} M=1 split={s}",
                     lambda s=s: {"us": time_us(lambda: G.fp8_block_gemm_triton(xd, xs, wd, ws, split_k=s)),
                                  "n": n, "k": k, "split_k": s})
            parts.append(f"{s}{'*' if s == splits_h else ''}: {r['us']:.1f}" if r else f"{s}: failed")
        say(f"  {n:>5}x{k:<7} " + "  ".join(parts))
        del wd, ws



def mx_section(say, case, G, copy_tbs: float) -> None:
    """MX / NVFP4 dequant-in-kernel GEMMs at MX_SIZE^3 (TFLOP/s) and M = 1 (weight TB/s)."""
    from engine.kernels import gemm_mx as GM
    say("\n## MX / NVFP4 dequant-in-kernel GEMMs (Triton; bf16 MMA, fp32 accumulation)")
    from engine.formats import quantize

    n = k = MX_SIZE
    g = torch.Generator(device=DEVICE).manual_seed(0)
    wsrc = torch.randn(n, k, device=DEVICE, generator=g)
    xsrc = torch.randn(MX_SIZE, k, device=DEVICE, generator=g)
    for xkind, wspec in [("mxfp8", "mxfp8"), ("bf16", "mxfp8"), ("bf16", "mxfp4"), ("bf16", "nvfp4")]:
        try:
            wp = GM.prepare_mx_weight(quantize(wsrc, wspec))
        except Exception as exc:
            say(f"  prepare {wspec} FAILED {exc}")
            continue
        for m in (MX_SIZE, 1):
            xm = xsrc[:m]
            if xkind == "mxfp8":
                q = quantize(xm, "mxfp8")
                args, kw = (q.data,), {"x_scale": q.scale}
            else:
                args, kw = (xm.to(torch.bfloat16),), {}

            def run(args=args, kw=kw, wp=wp, m=m):
                us = time_us(lambda: GM.mx_linear(*args, wp, **kw))
                return {"m": m, "n": n, "k": k, "us": us, "tflops": 2.0 * m * n * k / (us * 1e-6) / 1e12,
                        "weight_tbs": wp.nbytes / (us * 1e-6) / 1e12}

            r = case("mx", f"{xkind} x {wspec} M={m} N=K={n}", run)
            if r:
                say(f"  {r['case']:44} {r['us']:9.1f} us {r['tflops']:8.1f} TFLOP/s  weight {r['weight_tbs']:.2f} TB/s "
                    f"({100 * r['weight_tbs'] / copy_tbs:.0f}% of copy)")



if __name__ == "__main__":
    sys.exit(main())
