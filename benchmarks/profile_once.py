"""One call each of the two kernels still below issue 4's targets (RMSNorm+quant 16384 x 7168; the decode GEMM
4096x14336 at M = 4), after warm-up, for a profiler (`ncu --target-processes all python benchmarks/profile_once.py`).
Session 13 adds the same GEMM through the whole-K Gluon kernel (`whole_k=True`, 32 rows x 10 stages)."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_gemm import fp8_block_operands  # noqa: E402
from engine.kernels import gemm as G  # noqa: E402
from engine.kernels import quant as Q  # noqa: E402

x = torch.randn(16384, 7168, device="cuda", dtype=torch.bfloat16)
w = torch.rand(7168, device="cuda") + 0.5
xd, xs, _, _ = fp8_block_operands(4, 16, 14336, seed=4)
_, _, wd, ws = fp8_block_operands(1, 4096, 14336, seed=4096)
WHOLE_K = dict(whole_k=True, block_n=32, num_stages=10)
for _ in range(3):
    Q.rmsnorm_quant(x, w, 1e-5)
    G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32)
    G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.float32, **WHOLE_K)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
Q.rmsnorm_quant(x, w, 1e-5)
G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32)
G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.float32, **WHOLE_K)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print("done")
