"""One call of each kernel picked, after warm-up, for a profiler:

    ncu --target-processes all --profile-from-start off --set full python benchmarks/profile_once.py [--only ...]

Kernels (--only, comma-separated; default rms,gemm,wholek): `rms` RMSNorm+quant 16384 x 7168; `gemm` the decode GEMM
4096x14336 at M = 4 (its one-call timing is the decode GEMM's slowest cell; the sliced kernel); `splitk` the same call
on the split-K kernel and its fused reduce (sliced=False); `wholek` the same GEMM through the whole-K Gluon kernel (32
rows x 10 stages); `mx` the MX dequant-in-kernel GEMM at 4096x14336, M = 4, bf16 x MXFP4, bf16 x NVFP4 and MXFP8 x
MXFP8."""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_gemm import fp8_block_operands  # noqa: E402
from engine.kernels import gemm as G  # noqa: E402
from engine.kernels import gemm_mx as GM  # noqa: E402
from engine.kernels import quant as Q  # noqa: E402


def _calls(only: set[str]) -> list:
    """The picked kernels as zero-argument calls, operands built."""
    calls = []
    if "rms" in only:
        x = torch.randn(16384, 7168, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(7168, device="cuda") + 0.5
        calls.append(lambda: Q.rmsnorm_quant(x, w, 1e-5))
    if only & {"gemm", "wholek", "splitk"}:
        xd, xs, _, _ = fp8_block_operands(4, 16, 14336, seed=4)
        _, _, wd, ws = fp8_block_operands(1, 4096, 14336, seed=4096)
        if "gemm" in only:
            calls.append(lambda: G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32))
        if "splitk" in only:
            calls.append(lambda: G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.float32, sliced=False))
        if "wholek" in only:
            calls.append(lambda: G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.float32, whole_k=True,
                                                         block_n=32, num_stages=10))
    if "mx" in only:
        from engine.formats import quantize

        src = torch.randn(4, 14336, device="cuda")
        xb = src.to(torch.bfloat16)
        for xkind, wspec in (("bf16", "mxfp4"), ("bf16", "nvfp4"), ("mxfp8", "mxfp8")):
            wp = GM.prepare_mx_weight(quantize(torch.randn(4096, 14336, device="cuda"), wspec))
            if xkind == "mxfp8":
                q = quantize(src, "mxfp8")
                calls.append(lambda wp=wp, q=q: GM.mx_linear(q.data, wp, x_scale=q.scale))
            else:
                calls.append(lambda wp=wp: GM.mx_linear(xb, wp))
    return calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="rms,gemm,wholek")
    only = set(ap.parse_args(argv).only.split(","))
    unknown = only - {"rms", "gemm", "wholek", "splitk", "mx"}
    if unknown:
        ap.error(f"--only: unknown {sorted(unknown)}")
    calls = _calls(only)
    for _ in range(3):
        for call in calls:
            call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
