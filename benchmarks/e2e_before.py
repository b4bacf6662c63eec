"""`bench_e2e.py` with earlier kernel settings patched in: the "before" side of an end-to-end A/B, in its own
process (module flags are read at call time).

    python benchmarks/e2e_before.py PRESET [bench_e2e.py arguments]

Presets (each undoes one change of the decode path, everything else as in the code):
  split-fill-2    the decode GEMM heuristic that splits K until 2 programs per SM and has no whole-K kernel at BM 64
                  (`SPLIT_FILL = 2.0`, `WHOLE_K_AT_BM64 = False`)
  mx-gather       the MX GEMM with one gathered scale load per element, E2M1 by `_e2m1_to_f32`, the split-K reduce
                  kernel and 4 programs per SM, and no MXFP8 activation kernels (MXFP8 quantization, RMSNorm and
                  SwiGLU emulated)
  no-sliced       decode GEMMs with 2 / 4 K splits and M <= 16 / splits on the split-K kernel and its fused reduce, not
                  the sliced kernel (`SLICED_AUTO` off; the same bits)
  bm16-split-k    split-K / sliced BM-16 DECODE_CONFIGS entries on the H200 for the four shapes whose entries now run
                  the Gluon wgmma kernel (4096x14336, 6144x4096, 7168x16384, 28672x4096)
  bm32-split-k    the fused reduce loading one partial per round trip (`REDUCE_BURST = 1`) and split-K BM-32
                  DECODE_CONFIGS entries on the H200 (none for 7168x16384)
  no-wgmma-rule   decode GEMMs without an entry on the split-K heuristic, not the sm_90 wgmma rule (`WGMMA_RULE` off)
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.kernels import gemm, quant  # noqa: E402


def _split_fill_2() -> None:
    gemm.SPLIT_FILL = 2.0
    gemm.WHOLE_K_AT_BM64 = False


def _mx_gather() -> None:
    gemm.MX_ROW_SCALES = gemm.MX_FP4_PTX = gemm.MX_FUSED_REDUCE = False
    gemm.MX_SPLIT_RULE = {16: (4.0, 1), 32: (4.0, 1)}
    quant.QUANT_FORMATS = ("e4m3:1x128",)  # the native backend quantizes only what the kernels write


def _no_sliced() -> None:
    gemm.SLICED_AUTO = False


def _bm16_split_k() -> None:
    old = dict(num_warps=4, fused_reduce=True, block_n=64)
    gemm.DECODE_CONFIGS.update({
        ("NVIDIA H200", 4096, 14336, 16): dict(old, split_k=4, num_stages=5),
        ("NVIDIA H200", 6144, 4096, 16): dict(old, split_k=4, num_stages=3),
        ("NVIDIA H200", 7168, 16384, 16): dict(old, split_k=4, num_stages=3),
        ("NVIDIA H200", 28672, 4096, 16): dict(old, split_k=1, num_stages=3),
    })


def _bm32_split_k() -> None:
    gemm.REDUCE_BURST = 1
    old = dict(fused_reduce=True, block_n=64)
    gemm.DECODE_CONFIGS.pop(("NVIDIA H200", 7168, 16384, 32), None)
    gemm.DECODE_CONFIGS.update({
        ("NVIDIA H200", 28672, 4096, 32): dict(old, split_k=1, num_warps=4, num_stages=3),
        ("NVIDIA H200", 6144, 4096, 32): dict(old, split_k=4, num_warps=8, num_stages=3),
        ("NVIDIA H200", 4096, 4096, 32): dict(old, split_k=2, num_warps=8, num_stages=4),
        ("NVIDIA H200", 4096, 14336, 32): dict(old, split_k=4, block_n=128, num_warps=8, num_stages=4),
    })


def _no_wgmma_rule() -> None:
    gemm.WGMMA_RULE = False


PRESETS = {"split-fill-2": _split_fill_2, "mx-gather": _mx_gather, "no-sliced": _no_sliced,
           "bm16-split-k": _bm16_split_k, "bm32-split-k": _bm32_split_k, "no-wgmma-rule": _no_wgmma_rule}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in PRESETS:
        sys.exit(f"usage: e2e_before.py PRESET [bench_e2e.py arguments]; PRESET one of {sorted(PRESETS)}")
    preset = sys.argv.pop(1)
    PRESETS[preset]()
    print(f"kernel settings of preset {preset} (benchmarks/e2e_before.py)", flush=True)
    runpy.run_path(str(Path(__file__).resolve().parent / "bench_e2e.py"), run_name="__main__")
