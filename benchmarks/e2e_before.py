"""`bench_e2e.py` with the kernels' settings of an earlier session: the before side of an end-to-end A/B, in its own
process (module flags are read at call time).

    python benchmarks/e2e_before.py PRESET [bench_e2e.py arguments]

Presets:
  split-rule-s13  the decode GEMM heuristic of sessions 3-13 (K splits until 2 programs per SM, no whole-K kernel at
                  BM 64; session 14's A/B, whose results name this script's old name, e2e_old_split_rule.py)
  mx-s16          the MX GEMM of session 16 (one gathered scale load per element, E2M1 by `_e2m1_to_f32`, the
                  split-K reduce kernel, 4 programs per SM) and no MXFP8 activation kernels (MXFP8 quantization,
                  RMSNorm and SwiGLU emulated): session 17's A/B
  split-k-s17     decode GEMMs with 2 / 4 K splits and M <= 16 / splits on the split-K kernel and its fused reduce, not
                  the sliced kernel (`SLICED_AUTO` off; the same bits): session 18's A/B
  sliced-s18      the H200's BM-16 DECODE_CONFIGS entries of session 18 (split-K / sliced kernels) for the four shapes
                  session 19 moved to the Gluon wgmma kernel: session 19's A/B
  s19             session 19's kernels: the fused reduce loading one partial per round trip (REDUCE_BURST 1) and the
                  split-K BM-32 DECODE_CONFIGS entries (no 7168x16384 one): session 20's A/B
  s20             session 20's kernels: decode GEMMs without an entry on the split-K heuristic, not the sm_90 wgmma
                  rule (`WGMMA_RULE` off): session 21's A/B
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.kernels import gemm, quant  # noqa: E402


def _split_rule_s13() -> None:
    gemm.SPLIT_FILL = 2.0
    gemm.WHOLE_K_AT_BM64 = False


def _mx_s16() -> None:
    gemm.MX_ROW_SCALES = gemm.MX_FP4_PTX = gemm.MX_FUSED_REDUCE = False
    gemm.MX_SPLIT_RULE = {16: (4.0, 1), 32: (4.0, 1)}
    quant.QUANT_FORMATS = ("e4m3:1x128",)  # the native backend quantizes only what the kernels write


def _split_k_s17() -> None:
    gemm.SLICED_AUTO = False


def _sliced_s18() -> None:
    old = dict(num_warps=4, fused_reduce=True, block_n=64)
    gemm.DECODE_CONFIGS.update({
        ("NVIDIA H200", 4096, 14336, 16): dict(old, split_k=4, num_stages=5),
        ("NVIDIA H200", 6144, 4096, 16): dict(old, split_k=4, num_stages=3),
        ("NVIDIA H200", 7168, 16384, 16): dict(old, split_k=4, num_stages=3),
        ("NVIDIA H200", 28672, 4096, 16): dict(old, split_k=1, num_stages=3),
    })


def _s19() -> None:
    gemm.REDUCE_BURST = 1
    old = dict(fused_reduce=True, block_n=64)
    gemm.DECODE_CONFIGS.pop(("NVIDIA H200", 7168, 16384, 32), None)
    gemm.DECODE_CONFIGS.update({
        ("NVIDIA H200", 28672, 4096, 32): dict(old, split_k=1, num_warps=4, num_stages=3),
        ("NVIDIA H200", 6144, 4096, 32): dict(old, split_k=4, num_warps=8, num_stages=3),
        ("NVIDIA H200", 4096, 4096, 32): dict(old, split_k=2, num_warps=8, num_stages=4),
        ("NVIDIA H200", 4096, 14336, 32): dict(old, split_k=4, block_n=128, num_warps=8, num_stages=4),
    })


def _s20() -> None:
    gemm.WGMMA_RULE = False


PRESETS = {"split-rule-s13": _split_rule_s13, "mx-s16": _mx_s16, "split-k-s17": _split_k_s17,
           "sliced-s18": _sliced_s18, "s19": _s19, "s20": _s20}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in PRESETS:
        sys.exit(f"usage: e2e_before.py PRESET [bench_e2e.py arguments]; PRESET one of {sorted(PRESETS)}")
    preset = sys.argv.pop(1)
    PRESETS[preset]()
    print(f"kernel settings of preset {preset} (benchmarks/e2e_before.py)", flush=True)
    runpy.run_path(str(Path(__file__).resolve().parent / "bench_e2e.py"), run_name="__main__")
