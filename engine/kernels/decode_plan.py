"""Which kernel and launch configuration an FP8 or MX GEMM call gets: the decode plan.

Measured configs are data: `DECODE_CONFIGS` ((device, N, K, tile height BM) -> knobs of
`engine.kernels.gemm.fp8_block_gemm_triton`) and `GEMV_CONFIGS` ((device, N, K) -> knobs of the M = 1 GEMV). Shapes
without an entry take the rules below: the split rule (`_split_k` at `SPLIT_FILL`; `mx_split_k` for the MX kernel),
the stage rule (`_decode_stages`), the whole-K kernel at BM 64 and the swapped wgmma kernel at M 2-32 on sm_90
(`wgmma_plan`), the sliced kernel for 2 / 4 splits at small M (`_sliced_instead`). Every choice is a function of the
shape, the device and the SM count only, so a (shape, device) always gets the same kernel and the same bits. The
comment above each rule states it and the measurement it was fitted on.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import triton

from engine.kernels import gemm_wgmma as gw
from engine.kernels import sm_count
from engine.kernels.splitk import GROUP, _bad, _cdiv


# Decode (M <= 64) calls without knobs or a DECODE_CONFIGS entry on weights of >= TUNE_MIN_WEIGHT elements: the
# pipeline depth (it does not change the summation order) comes from DECODE_STAGE_CHOICE; smaller weights use the
# fixed _tiles config.
TUNE_MIN_WEIGHT = 1 << 24
# "rule": `_decode_stages`, by programs per SM; "autotune": `_fp8_block_gemm_tuned`, timed by do_bench on repeated
# calls, which picks by how a call runs with its weight's last copy in L2, not as a decode step runs it. Timed as a
# decode step runs them (H200, 2026-11-30, CUDA graph over weight copies, M = 4 / 16 / 24, scored by
# `benchmarks/stage_rule_eval.py`) against the best of 3 / 4 / 6 stages per point: on the 16 fitted shapes
# (N 2048-28672 x K 2048-14336) the rule is 1.004x the best (worst 1.05x), the autotuner 1.052x (worst 1.35x); on
# 12 held-out shapes (Qwen2-7B, 5120-wide, Llama-3-70B, lm_heads) the rule 1.023x (worst 1.21x), the autotuner 1.036x.
DECODE_STAGE_CHOICE = "rule"
# (programs per SM up to, stages): deep pipelines while at most one program per SM streams, shallower as more
# programs share an SM's shared memory and issue slots.
DECODE_STAGES = ((1.0, 6), (2.0, 4), (float("inf"), 3))


def _decode_stages(programs: int, sms: int, limits=None) -> int:
    """Pipeline depth of a decode call of the split-K kernel launching `programs` programs on `sms` SMs, by `limits`
    ((programs per SM up to, stages), ...; default DECODE_STAGES)."""
    load = programs / max(1, sms)
    return next(stages for limit, stages in (limits or DECODE_STAGES) if load <= limit)


# Split-K partials summed by the last split of each tile (same bits as the reduce kernel, one launch
# fewer per GEMM: a decode step has ~6 per layer) unless a call or a DECODE_CONFIGS entry says otherwise.
FUSED_REDUCE_DEFAULT = True


# M = 1 without explicit knobs runs `_fp8_gemv_kernel` (CUDA cores, whole rows per program, no split-K): on the
# H200 it beat the split-K MMA kernel on every Llama-3-8B decode shape (2026-11-29: 4096x4096 11.2 vs 13.8 us,
# 4096x14336 24.2 vs 26.7 us). Its bits differ from the
# M >= 2 kernel's (summation order), as cuBLAS's above `small_m` do.
GEMV_M1 = True
# Bytes of each weight row the GEMV prefetches into L2 at its start, before its PDL wait (engine.kernels.pdl).
# Off: on the H200 (2026-11-29), back to back in a CUDA graph with PDL, 1 KB vs none: 4096x14336 2.48 vs 3.57 TB/s,
# 28672x4096 3.85 vs 3.94, 7168x16384 3.88 vs 3.47; Llama-3-8B decode, pipelined, batch 1 2.91 vs 2.89 ms, batch 8
# 3.51 vs 3.45 ms. Prefetches of 4 KB and more were slower still.
GEMV_PREFETCH_BYTES = 0

# Measured decode configs, as data: (device name, N, K, BM) -> knobs of `fp8_block_gemm_triton`
# (split_k, block_n, num_warps, num_stages, fused_reduce). `fp8_block_linear` uses an entry when one
# matches, else the heuristic (`_tiles`, `_split_k`, `_decode_stages`).
# `benchmarks/tune_kernels.py` prints entries to paste here. The split count changes the fp32
# summation order, so an entry fixes the bits of that (shape, device) like the heuristic does.
DECODE_CONFIGS: dict[tuple[str, int, int, int], dict[str, Any]] = {
    # BM 16 (M 2-16) on the big decode shapes: the Gluon wgmma kernel (activation rows on the wgmma's N side; `wgmma`
    # knob), its split count measured per shape and its pipeline by `gemm_wgmma.swap_stages` unless pinned. H200,
    # 2026-11-30, us per call in a CUDA graph over weight copies, M = 4 / 8 / 16, this entry vs the split-K kernel:
    #   4096x14336 (4 splits: the split-K kernel's K partition, the same bits): 16.9 / 17.3 / 17.9 vs 17.5 / 18.6 / 19.1;
    #   6144x4096 (2 splits):  8.4 / 8.6 / 9.5 vs 8.9 / 9.6 / 9.9;
    #   7168x16384 (1 split, 4 stages, the fastest at every M): 30.0 / 30.2 / 30.8 vs 30.5 / 31.7 / 32.2;
    #   28672x4096 (1 split): 28.3 / 28.6 / 29.3 vs 29.7 / 29.9 / 30.0.
    # 4096x4096 stays on split-K: the wgmma kernel was 1-7% slower at M = 2 / 4.
    ("NVIDIA H200", 4096, 14336, 16): dict(wgmma=True, split_k=4, block_n=64),
    ("NVIDIA H200", 6144, 4096, 16): dict(wgmma=True, split_k=2, block_n=64),
    # Llama-3-8B decode at batch 8 / 64, swept as a decode step runs them (H200, 2026-11-30, CUDA graph of 64 calls
    # over weight copies; us per call, entry vs heuristic). 4096x4096 at BM 16 wants 4 splits, not the heuristic's 8
    # (7.7 vs 11.0 us):
    ("NVIDIA H200", 4096, 4096, 16): dict(split_k=4, block_n=64, num_warps=4, num_stages=4, fused_reduce=True),
    # At BM 64 split-K partials cost up to a quarter of the weight's bytes (splits x 64 rows x N x 4 B, written and
    # read back) and the whole-K kernel's 64 activation rows are all real: it wins where N is small. 28672x4096
    # takes 128-row tiles and no split. Batch-64 runtime step 6.00 -> 4.71 ms with these six entries.
    ("NVIDIA H200", 6144, 4096, 64): dict(whole_k=4, block_n=64),  # 11.4 vs 21.0
    ("NVIDIA H200", 4096, 4096, 64): dict(whole_k=4, block_n=64),  # 9.7 vs 18.6
    ("NVIDIA H200", 28672, 4096, 64): dict(split_k=1, block_n=128, num_warps=4, num_stages=3,
                                           fused_reduce=True),  # 39.4 vs 48.2
    ("NVIDIA H200", 4096, 14336, 64): dict(whole_k=2, block_n=32),  # 25.3 vs 34.5
    # 7168x16384 at BM 16: the wgmma kernel, one split, 4 stages (30.0-30.8 us in the graph, against 31.7 / 32.6 us
    # for the best split-K config and 2.59 / 2.62 TB/s for the split rule's 2 splits).
    ("NVIDIA H200", 7168, 16384, 16): dict(wgmma=True, split_k=1, block_n=64, num_stages=4),
    # 28672x4096 (gate+up) at BM 16: the wgmma kernel, one split (28.3-29.3 us in the graph). Left to the autotuner
    # (timed on repeated calls, L2 warm) the split-K kernel's stages flip between runs, and one pick that was faster
    # per call (3.54 -> 3.72 TB/s) was slower in a CUDA graph over weight copies (3.87 -> 3.21 TB/s at M = 4).
    ("NVIDIA H200", 28672, 4096, 16): dict(wgmma=True, split_k=1, block_n=64),
    # BM 32 (M 17-32) on the big decode shapes: the Gluon wgmma kernel too (its activation rows: 32), split count and
    # stages from a sweep at M = 24 / 32 (H200, 2026-11-30, us per call in a CUDA graph over weight copies, each timed
    # twice), against the best split-K configs:
    #   28672x4096 (1 split, 4 stages: swap_stages' default): 32.0 / 32.2 vs 33.0 / 33.6;
    #   4096x14336 (2 splits, 6 stages): 20.0 / 20.0 vs 21.8 / 21.8;
    #   7168x16384 (1 split, 4 stages): 32.9 / 33.1 vs 37.7 / 38.3;
    #   6144x4096 (1 split, 4 groups x 3 stages): 8.7 / 8.8 vs 11.0;
    #   4096x4096 (1 split, 4 groups x 3 stages): 8.1 / 8.2 vs 8.9 / 9.0.
    # With one program per SM (at most 132), the deeper pipelines past swap_stages' 112 KB are pinned.
    ("NVIDIA H200", 28672, 4096, 32): dict(wgmma=True, split_k=1, block_n=64),
    ("NVIDIA H200", 4096, 14336, 32): dict(wgmma=True, split_k=2, block_n=64, num_stages=6),
    ("NVIDIA H200", 7168, 16384, 32): dict(wgmma=True, split_k=1, block_n=64, num_stages=4),
    ("NVIDIA H200", 6144, 4096, 32): dict(wgmma=4, split_k=1, block_n=64, num_stages=3),
    ("NVIDIA H200", 4096, 4096, 32): dict(wgmma=4, split_k=1, block_n=64, num_stages=3),
    # Llama-3-8B's lm_head at batch 2-16: the stage rule's 3 stages (15 programs per SM) run 132.1 / 140.2 us per call
    # at M = 4 / 16 in a CUDA graph, 4 stages 124.8 / 130.8, the best of 3 / 4 / 6 at both (H200, 2026-11-30). One
    # split as the heuristic: same bits.
    ("NVIDIA H200", 128256, 4096, 16): dict(split_k=1, block_n=64, num_warps=4, num_stages=4, fused_reduce=True),
}
DECODE_KNOBS = ("split_k", "block_n", "num_warps", "num_stages", "fused_reduce", "cluster", "whole_k", "sliced",
               "wgmma")
# The heuristic for shapes without an entry (H200, 2026-11-30: 21 shapes N 2048-28672 x K 2048-14336 at M = 12 / 24 /
# 48, each call timed as a decode step runs it, in a CUDA graph over weight copies). K splits until the programs
# about fill the SMs (SPLIT_FILL per SM; 2 per SM costs more in partials and reduces than the extra programs gain):
# geometric mean 1.05x the best split count at BM 16 and 32, against 1.12x / 1.20x for 2 per SM. At BM 64 (M 33-64)
# the whole-K kernel instead (64-row tiles from N = 4096, 32 below; 4 groups per stage): 1.04x the best of every
# variant tried, against 1.44x for the split rule (up to 2x slower). Off the sm_90 whole-K kernel (other GPUs, rows
# TMA cannot read) BM 64 takes the split rule.
SPLIT_FILL = 0.9
WHOLE_K_AT_BM64 = True
# The decode rule on sm_90 for shapes without an entry, M 2-32 (BM 16 / 32): the swapped Gluon wgmma kernel (the
# H200's Llama-3-8B entries above), its split count, groups per stage and stages from `wgmma_plan`. Measured on four
# H200 sweeps (2026-11-30: 57 shapes N 1280-151936 x K 2048-28672 at M = 4 / 16 / 32, split counts 1-8 with 2 / 4
# groups per stage, us per call in a CUDA graph over weight copies; `benchmarks/split_rule_eval.py --wgmma` scores
# it): per sweep 1.013-1.026x the best variant and 0.85-0.88x the split-K heuristic's time (geometric means); the
# sweep held out from the rule's first form scored it 1.041x / 0.873x.
# - Weights of at least WGMMA_RULE_WIDE x SMs 64-row tiles take one split (the fewest the scale table allows): 6144- to
#   151936-row weights ran up to 34% faster than with the split-K heuristic.
# - Narrower ones, at most WGMMA_RULE_MAX_SPLITS splits: with 8 activation rows (M <= 8) K splits until the programs
#   fill WGMMA_RULE_FILL8 per SM, each split keeping >= WGMMA_RULE_MIN_GROUPS8 128-groups (2048x2048, 3072x2048: one
#   split 16-32% faster than four); with 16 / 32 rows the split count whose programs fill the SMs' last wave best
#   (fewest on a tie: 64 tiles take 2 splits, not 4; 80 tiles 3), each keeping >= WGMMA_RULE_MIN_GROUPS (4096x4096:
#   one split 3-9% faster than two).
# - Stages: where every program has an SM to itself, the deepest pipeline (<= WGMMA_RULE_MAX_STAGES) with 2 groups per
#   stage at 8 rows, 4 at 16 / 32; else `gemm_wgmma.swap_stages` with 2.
# Known misses, slower than the split-K heuristic: 19456x2560 by 3-11% (304 tiles: 1.15 waves of two programs per SM),
# 4096x4096 at M = 4 by 11% (the H200 has an entry), 1280x8192 at M = 16 / 32 by 3-4%. WGMMA_RULE = False: the split-K
# heuristic (`_split_k`).
WGMMA_RULE = True
WGMMA_RULE_WIDE = 0.7
WGMMA_RULE_FILL8 = 2.0
WGMMA_RULE_MAX_SPLITS = 4
WGMMA_RULE_MIN_GROUPS = 20
WGMMA_RULE_MIN_GROUPS8 = 10
WGMMA_RULE_MAX_STAGES = 8
# The MX kernel's split rule by tile height BM: (programs per SM to fill, at least this many splits), measured as a
# decode step runs it (H200, 2026-11-30, CUDA graph over weight copies, `probe_kernels.py --only mx_split`: 6 shapes
# x M = 1 / 4 / 16 / 32 x 1-16 splits; `split_rule_eval.py --mx`), pick / best split, geometric mean per pair:
# this rule 1.003x (bf16 x MXFP4), 1.000x (bf16 x NVFP4), 1.000x (MXFP8 x MXFP8), worst point 1.013x.
# - BM 16: 2 per SM, but 2 splits where that gives one (28672x4096, 448 tiles: one split 7-13% slower than two);
#   without the floor 1.017 / 1.016 / 1.008x, worst 1.13x; 4 per SM 1.004 / 1.011 / 1.038x, worst 1.18x (6144x4096
#   wants 4 splits, not 8);
# - BM 32: 1.5 per SM, 1.000x for all three (2 per SM 1.08-1.13x, 4: 1.15-1.18x): with twice the activation rows a
#   program does more work per weight byte, and fewer, longer splits win.
# - BM 64 (M 33-64) takes BM 32's rule: 1.021 / 1.020 / 1.016x at M = 48 / 64, worst 1.14x (6144x4096); 4 per SM
#   1.21-1.22x.
# - Held-out shapes (Qwen2.5-14B's and Qwen2-7B's MLPs at M = 4 / 16 / 32): 1.075 / 1.080 / 1.034x, worst 1.21x
#   (5120x13824 at BM 16 wants 8 splits, gets 4); 4 per SM 1.015 / 1.014 / 1.027x there. The BM-16 fill is fitted to
#   the Llama-3-8B shapes; 4-6 per SM at BM 16 would score 1.017-1.020x overall against this rule's 1.021x and cost
#   the Llama-3-8B shapes 1.7%.
MX_SPLIT_RULE = {16: (2.0, 2), 32: (1.5, 1)}


def mx_split_k(tiles: int, steps: int, sms: int, bm: int) -> int:
    """K splits of the MX kernel for `tiles` output tiles of height bm and `steps` 128-column chunks on `sms` SMs:
    `_split_k` at the fill of `MX_SPLIT_RULE` (heights it lacks take the largest listed one's), raised to the rule's
    floor where each split keeps >= 4 chunks."""
    fill, floor = MX_SPLIT_RULE.get(bm, MX_SPLIT_RULE[max(MX_SPLIT_RULE)])
    s = _split_k(tiles, steps, sms, fill)
    return max(s, floor) if steps // floor >= 4 else s
# Measured M = 1 GEMV configs, as data: (device name, N, K) -> knobs of `_launch_gemv` (block_n, groups, num_stages,
# num_warps); other shapes use its defaults. Same output bits as the defaults in every sweep. H200 (2026-11-29), one
# call after a clean L2 flush: 4096x14336 19.3 us vs 19.7-19.9 with the defaults in two sweeps; 28672x4096 33.2 vs
# 34.6 in one sweep, even in bench_gemm.
GEMV_CONFIGS: dict[tuple[str, int, int], dict[str, Any]] = {
    ("NVIDIA H200", 4096, 14336): dict(block_n=4, groups=8, num_stages=3, num_warps=2),
    ("NVIDIA H200", 28672, 4096): dict(block_n=4, groups=8, num_stages=3, num_warps=2),
}


def _tiles(m: int) -> tuple[int, int, int, int]:
    """(BM, BN, num_warps, num_stages) by M: decode tiles (BM the next power of two >= M, >= 16:
    the MMA's N side) up to M = 64, large square tiles above."""
    if m <= 64:
        return max(16, triton.next_power_of_2(m)), 64, 4, 4
    return 128, 128, 8, 3


def _split_k(tiles: int, steps: int, sms: int, fill: float = 2.0) -> int:
    """K splits: the smallest power of two that gives >= fill programs per SM, keeping >= 4 K steps
    per split and at most 16 splits (a deterministic function of the shape and the SM count)."""
    s = 1
    while tiles * s < fill * sms and steps // (2 * s) >= 4 and s < 16:
        s *= 2
    return s


def _plan_split(m: int, n: int, steps: int, bm: int, bn: int, device: torch.device,
                split_k: Optional[int], mx: bool = False) -> tuple[int, int]:
    """(splits, K steps per split), with no empty split; the heuristic for split_k None (decode M only): the FP8
    kernel's (`_split_k` at `SPLIT_FILL`), or with `mx` the MX kernel's (`mx_split_k`)."""
    if split_k is None:
        tiles, sms = _cdiv(n, bn) * _cdiv(m, bm), sm_count(device)
        if m > 64:
            split_k = 1
        else:
            split_k = mx_split_k(tiles, steps, sms, bm) if mx else _split_k(tiles, steps, sms, SPLIT_FILL)
    per = _cdiv(steps, max(1, min(split_k, steps)))
    return _cdiv(steps, per), per


@functools.lru_cache(maxsize=None)
def _device_name(device_type: str, index: Optional[int]) -> str:
    """The CUDA device name keying `DECODE_CONFIGS` ("" on CPU)."""
    return torch.cuda.get_device_name(index if index is not None else 0) if device_type == "cuda" else ""


def _opt_outs(knobs: dict[str, Any]) -> dict[str, Any]:
    """The knobs that only keep a call off a kernel (sliced=False, wgmma=False): they leave entries and heuristics
    in force."""
    return {key: v for key, v in knobs.items() if key in ("sliced", "wgmma") and v is False}


def _decode_knobs(m: int, n: int, k: int, device: torch.device, knobs: dict[str, Any]) -> dict[str, Any]:
    """Explicit knobs, else a `DECODE_CONFIGS` entry for (device, N, K, BM) (M <= 64 only; with sliced=False and / or
    wgmma=False when those are the only knobs given), else {}."""
    given = {key: v for key, v in knobs.items() if v is not None}
    if m > 64 or given != _opt_outs(given):
        return given
    entry = DECODE_CONFIGS.get((_device_name(device.type, device.index), n, k, _tiles(m)[0]), {})
    return dict(entry, **given)  # sliced / wgmma=False alone keep the entry: its split-K call, not those kernels


def _positive_int(v: Any) -> bool:
    """An int > 0 (a JSON true is not one)."""
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


# The values each DECODE_KNOBS key takes in an entry file: (check, what to write in the error).
_KNOB_VALUES: dict[str, tuple[Any, str]] = {
    "split_k": (_positive_int, "a positive integer"),
    "block_n": (lambda v: v in (16, 32, 64, 128) and not isinstance(v, bool), "16, 32, 64 or 128"),
    "num_warps": (lambda v: v in (1, 2, 4, 8, 16) and not isinstance(v, bool), "1, 2, 4, 8 or 16"),
    "num_stages": (_positive_int, "a positive integer"),
    "fused_reduce": (lambda v: isinstance(v, bool), "true or false"),
    "cluster": (lambda v: isinstance(v, bool), "true or false"),
    "whole_k": (lambda v: v is True or (v in (2, 4) and not isinstance(v, bool)), "true, 2 or 4"),
    "sliced": (lambda v: v is False or (v in (2, 4, 8) and not isinstance(v, bool)), "false, 2, 4 or 8"),
    "wgmma": (lambda v: isinstance(v, bool) or v in (2, 4), "true, false, 2 or 4"),
}


def load_decode_configs(path: str, apply: bool = True) -> dict[tuple[str, int, int, int], dict[str, Any]]:
    """`DECODE_CONFIGS` entries from a JSON file -- a list of {"device", "n", "k", "bm", "knobs"} objects, as
    `benchmarks/probe_kernels.py --only decode_graph` writes them -- validated, and added to (or replacing entries
    of) `DECODE_CONFIGS` when apply. For trying measured configs in a whole decode step before pasting them into
    the table; returns the entries read."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            rows = json.load(f)
    except OSError as exc:
        raise _bad(f"decode configs {path}: cannot read it ({exc.strerror or exc})") from exc
    except json.JSONDecodeError as exc:
        raise _bad(f"decode configs {path}: not JSON (line {exc.lineno}: {exc.msg})") from exc
    if not isinstance(rows, list):
        raise _bad(f"decode configs {path}: expected a JSON list of entries, got {type(rows).__name__}")
    out: dict[tuple[str, int, int, int], dict[str, Any]] = {}
    for i, row in enumerate(rows):
        where = f"decode configs {path}, entry {i}"
        if not isinstance(row, dict) or set(row) != {"device", "n", "k", "bm", "knobs"}:
            got = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise _bad(f"{where}: expected the keys device, n, k, bm, knobs; got {got}")
        if not isinstance(row["device"], str) or not all(_positive_int(row[a]) for a in "nk"):
            raise _bad(f"{where}: device must be a GPU name string, n and k positive integers")
        if row["bm"] not in (16, 32, 64):
            raise _bad(f"{where}: bm={row['bm']!r}; decode tiles have BM 16, 32 or 64 (see _tiles)")
        knobs = row["knobs"]
        bad = sorted(set(knobs) - set(DECODE_KNOBS)) if isinstance(knobs, dict) else ["<not an object>"]
        if bad or not knobs:
            raise _bad(f"{where}: unknown knob(s) {bad or '(none given)'}; use {', '.join(DECODE_KNOBS)}")
        for name, value in knobs.items():
            ok, allowed = _KNOB_VALUES[name]
            if not ok(value):
                raise _bad(f"{where}: {name}={value!r}; use {allowed}")
        out[(row["device"], row["n"], row["k"], row["bm"])] = dict(knobs)
    if apply:
        DECODE_CONFIGS.update(out)
    return out


def _heuristic_whole_k(m: int, n: int, device: torch.device) -> dict[str, Any]:
    """The whole-K knobs the heuristic picks for a call without knobs or entry: 33-64 rows (tile BM 64) on CUDA
    while `WHOLE_K_AT_BM64`, 64-row weight tiles from N = 4096 and 32 below, 4 groups per stage (see SPLIT_FILL);
    else {}. Where the kernel cannot run, the caller takes the split rule instead."""
    if WHOLE_K_AT_BM64 and device.type == "cuda" and m <= 64 and _tiles(m)[0] == 64:
        return dict(whole_k=4, block_n=64 if n >= 4096 else 32)
    return {}


def wgmma_plan(m: int, n: int, k: int, sms: int) -> Optional[tuple[int, int, Optional[int]]]:
    """(K splits, groups per stage, stages or None for `gemm_wgmma.swap_stages`' default) of the swapped wgmma kernel
    for an M x N x K decode call on `sms` SMs, by the rule at WGMMA_RULE; None where it has no plan (M outside 2-32, or
    no configuration fits). Memoized per activation-row class (8 / 16 / 32 rows) and rule constants: a call costs a
    dict lookup, not the ~25 us of planning."""
    rows = gw.x_rows(m, True)
    if m < 2 or rows > 32:
        return None
    return _wgmma_plan(rows, n, k, sms, (WGMMA_RULE_WIDE, WGMMA_RULE_FILL8, WGMMA_RULE_MAX_SPLITS,
                                         WGMMA_RULE_MIN_GROUPS, WGMMA_RULE_MIN_GROUPS8, WGMMA_RULE_MAX_STAGES))


@functools.lru_cache(maxsize=4096)
def _wgmma_plan(rows: int, n: int, k: int, sms: int, rule: tuple) -> Optional[tuple[int, int, Optional[int]]]:
    """`wgmma_plan` for `rows` activation rows (the kernel's tile for every M it rounds up to rows) under the rule
    constants `rule`."""
    wide, fill8, max_splits, min_groups, min_groups8, max_stages = rule
    tiles, kb = _cdiv(n, 64), _cdiv(k, GROUP)

    def exact(s: int, gps: int = 2) -> bool:  # s splits as asked, each within the scale table, none trivially short
        got, per = gw.split_plan(kb, s, gps)
        return got == s and per <= gw.MAX_GROUPS and (s == 1 or per >= 4)

    fewest = next((s for s in range(1, kb + 1) if exact(s)), None)
    if fewest is None:
        return None
    splits = fewest
    if tiles < wide * sms:
        tried = [s for s in range(fewest, max(fewest, max_splits) + 1) if exact(s)]
        if rows == 8:
            splits = max((s for s in tried if tiles * s <= fill8 * sms and (s == fewest or kb / s >= min_groups8)),
                         default=fewest)
        else:
            tried = [s for s in tried if s == fewest or kb / s >= min_groups]
            splits = min(tried, key=lambda s: (-round(wave_fill(tiles * s, sms), 9), s))
    gps, stages = 2, None
    if tiles * splits <= sms:  # one program per SM: the deepest pipeline that fits
        for g in ((2,) if rows == 8 else (4, 2)):
            s_eff, per = gw.split_plan(kb, splits, g)
            deep = [st for st in range(2, max_stages + 1) if st <= _cdiv(per, g)
                    and gw.plan_error(rows, n, k, 64, st, g, s_eff, True) is None]
            if deep:
                gps, stages, splits = g, max(deep), s_eff
                break
    if gw.plan_error(rows, n, k, 64, stages or gw.swap_stages(rows, kb, splits, gps), gps, splits, True) is not None:
        return None
    return splits, gps, stages


def wave_fill(programs: int, sms: int) -> float:
    """How full the SMs' waves of `programs` one-per-SM programs are: programs / (SMs x waves)."""
    return programs / (sms * _cdiv(programs, sms))


@functools.lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    """Compute capability 9.0 exactly (the wgmma kernels' target)."""
    return torch.cuda.get_device_capability(index) == (9, 0)


def _heuristic_wgmma(m: int, n: int, k: int, device: torch.device) -> dict[str, Any]:
    """The wgmma knobs the rule picks for a call without knobs or entry (`wgmma_plan`, while WGMMA_RULE, on an sm_90
    CUDA device); else {}. Where the kernel cannot run the call, the caller takes the split rule instead."""
    if not (WGMMA_RULE and device.type == "cuda" and
            _sm90(device.index if device.index is not None else torch.cuda.current_device())):
        return {}
    plan = wgmma_plan(m, n, k, sm_count(device))
    if plan is None:
        return {}
    splits, gps, stages = plan
    return dict(wgmma=gps, split_k=splits, block_n=64, **({} if stages is None else {"num_stages": stages}))


SLICES = (2, 4, 8)  # K slices the sliced kernel can hold side by side
# Split-K decode calls with 2 or 4 splits and M <= 16 / splits run as the sliced kernel, same bits (`_sliced_instead`).
# H200, 4096x14336 / 7168x16384 / 4096x4096 / 6144x4096 at M = 2 and 4, each with its DECODE_CONFIGS entry's 4 splits
# and stages (2026-11-30), us per call in a CUDA graph over
# weight copies, sliced vs split-K with its fused reduce: 17.4-17.7 vs 18.3-18.6, 30.8-31.0 vs 31.6-32.0, 6.7-6.8 vs
# 7.3-7.7, 8.8-8.9 vs 9.4-9.7; one call after a clean L2 flush 20.4-20.5 vs 20.6-21.3 on 4096x14336. At M = 8 (4
# slices of 8 columns: twice the split-K kernel's MMA columns) it loses on 4096x14336 (19.2 vs 18.8) and 6144x4096, and
# at M = 16 by 15-30%. 8 splits (M <= 2) are left out: their graph times swung between 16.6 and 25 us.
SLICED_AUTO = True
SLICED_AUTO_SPLITS = (2, 4)


def _sliced_instead(x: torch.Tensor, m: int, splits: int, bn: int, warps: int, cfg: dict[str, Any]) -> bool:
    """Whether a split-K decode call runs as the sliced kernel instead (`SLICED_AUTO`): on CUDA, 2 or 4 splits of
    64-row tiles with 4 warps (the split-K MMA whose bits the sliced kernel reproduces), no cluster asked for, and
    M <= 16 / splits, so that the slices' activation columns (splits x next_pow2(M)) fit the split-K kernel's 16;
    never with sliced=False."""
    return (SLICED_AUTO and x.is_cuda and splits in SLICED_AUTO_SPLITS and bn == 64 and warps == 4
            and cfg.get("sliced") is not False and not cfg.get("cluster") and triton.next_power_of_2(m) * splits <= 16)
