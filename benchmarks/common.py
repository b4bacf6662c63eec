"""What every benchmark shares: its timing, the ceilings it measures in the same run, the hardware fingerprint and
its report (printed lines, JSON records, `$OUT/<name>.{txt,json}`).

Timing (docs/design/performance.md, "How kernels are timed"):

* `time_us`: one call between CUDA events, after a warm-up (which also compiles and autotunes). Before every rep L2
  (50 MB on the H200) is evicted by touching FLUSH_BYTES -- written (`flush="dirty"`, as `triton.testing.do_bench`
  does: the call then pays the write-back of the modified lines) or read (`"clean"`, the state a decode step's GEMM
  finds) --, then the GPU sleeps longer than the call's host time, so that the whole call is queued before the start
  event and the events time GPU work only. The median of the reps.
* `graph_us`: n back-to-back calls captured in one CUDA graph (cycling through several callables, e.g. one per copy of
  a weight, so that no call finds its weights in L2); the median per-call time over the replays. Launch gaps count
  and PDL overlaps kernels, as in a captured decode step.
* `wall_s`: median wall seconds of a whole piece of work (a model forward, an evaluation), the GPU synchronized.

Ceilings: `copy_ceiling` (HBM copy, a 1 GiB clone, read + write), `read_ceiling` (HBM read, 1 GiB, clean L2) and
`matmul_ceilings` (cuBLAS bf16 and FP8 GEMMs of a shape), each timed by `time_us` in the benchmark's own process.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

DEVICE = "cuda"
FLUSH_BYTES = 256 * 2**20  # written or read before every timed rep: evicts L2 (50 MB on the H200)
GRAPH_ROTATE_BYTES = 320 * 2**20  # weight copies cycled through by the CUDA-graph timing of decode GEMMs
COPY_BYTES = 2**30  # buffer of the HBM ceilings
FLUSHES = ("clean", "dirty")
MATMULS = ("bf16", "fp8_tensor", "fp8_rowwise")

_flush: Optional[torch.Tensor] = None
_sleep_cycles_per_us: Optional[float] = None


# ------------------------------------------------------------------------------------------------ timing
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


def evict_l2(flush: str) -> None:
    """Push the previous rep's lines out of L2 before a timed call: "dirty" writes FLUSH_BYTES (L2 is left full of
    modified lines whose write-back the timed call pays), "clean" reads them (an amax; clean lines drop for free)."""
    global _flush
    if flush not in FLUSHES:
        raise ValueError(f"flush={flush!r}: use one of {FLUSHES}")
    if _flush is None:
        _flush = torch.zeros(FLUSH_BYTES // 4, dtype=torch.int32, device=DEVICE)
    if flush == "dirty":
        _flush.zero_()
    else:
        _flush.amax()


def host_us(fn: Callable[[], Any], n: int = 7) -> float:
    """Median CPU microseconds of one fn() call without synchronizing (Python + launch overhead)."""
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(ts)


def time_us(fn: Callable[[], Any], reps: int = 25, warmup: int = 5, flush: str = "dirty") -> float:
    """Median GPU microseconds of one fn() call (CUDA events; L2 evicted as `evict_l2(flush)` before each rep and the
    host held back by a GPU sleep; see the module docstring)."""
    for _ in range(warmup):
        fn()
    evict_l2(flush)  # the first clean flush also writes back what allocating the flush buffer left dirty
    torch.cuda.synchronize()
    sleep_us = min(5000.0, max(100.0, 2.0 * host_us(fn, 3)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        evict_l2(flush)
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


def sync() -> None:
    """Wait for the GPU, if there is one."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wall_s(fn: Callable[[], Any], reps: int = 3) -> float:
    """Median wall seconds of fn() over `reps` calls after one warm-up call, the GPU synchronized around each."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ------------------------------------------------------------------------------------------------ ceilings
def copy_ceiling(nbytes: int = COPY_BYTES, reps: int = 20) -> dict[str, float]:
    """HBM copy bandwidth: a clone of nbytes, read + write, timed by `time_us`: {"us", "tbs"}."""
    big = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=DEVICE)
    us = time_us(lambda: big.clone(), reps=reps)
    return {"us": us, "tbs": 2 * nbytes / (us * 1e-6) / 1e12}


try:  # the read ceiling's kernel; the benchmarks need a GPU, importing this module does not
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


def read_ceiling(nbytes: int = COPY_BYTES) -> dict[str, float]:
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


def fp8_operand(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """Random E4M3 values spanning the format: randn * 100 clamped to +-448 before the cast (a float8_e4m3fn cast of
    |x| > 464 gives NaN on torch 2.11)."""
    x = torch.randn(rows, cols, device=DEVICE, generator=generator) * 100
    return x.clamp(-448, 448).to(torch.float8_e4m3fn)


def matmul_ceilings(m: int, n: int, k: int, kinds: Sequence[str] = MATMULS, seed: int = 0) -> dict[str, dict]:
    """cuBLAS GEMMs of (m, k) x (n, k)^T in this run, by `time_us`: "bf16" torch.mm, "fp8_tensor" / "fp8_rowwise"
    torch._scaled_mm with one scale / per-row and per-column scales (bf16 out). {kind: {"us", "tflops"}}, or
    {kind: {"error"}} for one that failed."""
    bad = sorted(set(kinds) - set(MATMULS))
    if bad:
        raise ValueError(f"matmul_ceilings: unknown kind(s) {bad}; use {MATMULS}")
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    a, b = fp8_operand(m, k, g), fp8_operand(n, k, g)
    one = torch.ones((), device=DEVICE)
    sa, sb = torch.rand(m, 1, device=DEVICE, generator=g) + 0.5, torch.rand(1, n, device=DEVICE, generator=g) + 0.5
    calls = {"bf16": lambda a16=a.to(torch.bfloat16), b16=b.to(torch.bfloat16): torch.mm(a16, b16.t()),
             "fp8_tensor": lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
             "fp8_rowwise": lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)}
    out = {}
    for kind in kinds:
        try:
            us = time_us(calls[kind])
            out[kind] = {"us": us, "tflops": 2.0 * m * n * k / (us * 1e-6) / 1e12}
        except Exception as exc:  # a ceiling the build lacks is reported, the benchmark goes on
            out[kind] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    return out


# ------------------------------------------------------------------------------------------------ fingerprint, report
def fingerprint(device: str = DEVICE) -> dict[str, Any]:
    """The hardware fingerprint every result carries (`evalharness.provenance.hardware_fingerprint`): GPU, compute
    capability, driver, CUDA, torch and Triton versions, CPU and platform."""
    from evalharness.provenance import hardware_fingerprint

    return hardware_fingerprint(device)


def finite(obj: Any) -> Any:
    """NaN / Inf floats -> None, tuple keys -> strings, recursively (strict JSON)."""
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        return None
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


class Report:
    """A benchmark's printed lines and JSON records; `case` runs one case so that its failure is printed and recorded
    while the others go on; `write` puts `<name>.txt` and `<name>.json` into $OUT (or a given folder)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.records: list[dict[str, Any]] = []

    def say(self, s: str = "") -> None:
        """Print and keep a line."""
        print(s, flush=True)
        self.lines.append(s)

    def case(self, name: str, fn: Callable[[], Any], **fields: Any) -> Any:
        """fn()'s result; on an exception the error is printed and recorded (with `fields`) and None returned."""
        try:
            return fn()
        except Exception as exc:  # one failing case must not abort the others
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            self.say(f"  {name}: FAILED {msg}")
            traceback.print_exc(limit=3)
            self.records.append({**fields, "case": name, "error": msg})
            return None

    def write(self, name: str, payload: dict[str, Any], out: Optional[str] = None) -> Optional[Path]:
        """Write `<name>.txt` (the lines) and `<name>.json` (payload, strict JSON) into `out` (default $OUT); nothing
        when neither is set. Returns the folder."""
        out = out or os.environ.get("OUT")
        if not out:
            return None
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.txt").write_text("\n".join(self.lines) + "\n")
        (folder / f"{name}.json").write_text(json.dumps(finite(payload), indent=1, default=str) + "\n")
        print(f"wrote {folder}/{name}.json and {name}.txt", flush=True)
        return folder
