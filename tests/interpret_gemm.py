"""The Triton decode GEMM kernels of engine/kernels/gemm.py on the CPU under the Triton interpreter (a helper script).

    TRITON_INTERPRET=1 python tests/interpret_gemm.py [check ...]

`tests/test_gemm_interpreter.py` runs it in a subprocess (the interpreter is chosen when the kernels are decorated,
so it needs a fresh process). CI has no GPU, so this is where the kernels' index arithmetic is exercised there:
`_fp8_block_gemm_kernel` (tiles, K splits with a short last split, the fused in-kernel reduce and the separate
reduce kernel, masks for N, M and K off the tile grid, bias, the bf16 rounding epilogue), the knob sets of every
committed `DECODE_CONFIGS` entry, and the M = 1 GEMV kernel. Not here: the Gluon whole-K kernel (no interpreter for
Gluon; its entries run their split-K fallback, as off the H200). The MX dequant-in-kernel GEMM runs under the
interpreter through test_gemm_gpu.py's tests marked `interpreter` (tests/test_gpu_tests_interpreter.py).

Operands carry per-block magnitudes spread over 2**-4 .. 2**4, so a kernel that applies the scale of the wrong
block, or drops or repeats a K group, misses the float64 reference by orders of magnitude more than the
tolerance. The interpreter multiplies FP8 tiles exactly in fp32 (no reduced-precision tensor-core
accumulation), hence a tighter tolerance than the GPU tests' 2e-3. Exit status 0: every check passed
("ok NAME" lines); 3: the interpreter lacks the hook the kernels' tensor loop bounds need (the caller skips);
anything else: a failure.
"""

from __future__ import annotations

import sys
from pathlib import Path

CHECKS = ("split_k_vs_reference", "fused_reduce_is_the_reduce_kernel", "bias_and_bf16_rounding",
          "decode_config_knob_sets", "gemv_m1")
TOL = 1e-5  # interpreter: exact FP8 products, fp32 accumulation


def _blocky(rows: int, cols: int, r: int, c: int, seed: int):
    """Gaussian (rows, cols) times a per-(r x c)-block magnitude 2**U{-4..4}."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    mag = torch.exp2(torch.randint(-4, 5, (-(-rows // r), -(-cols // c)), generator=g).float())
    return x * mag.repeat_interleave(r, 0)[:rows].repeat_interleave(c, 1)[:, :cols]


def _operands(m: int, n: int, k: int, seed: int = 0):
    """e4m3:1x128 activations and e4m3:128x128 weights from the formats library: (x, x_scale, w, w_scale)."""
    from engine.formats import quantize

    xq = quantize(_blocky(m, k, 1, 128, seed), "e4m3:1x128")
    wq = quantize(_blocky(n, k, 128, 128, seed + 1), "e4m3:128x128")
    return xq.data, xq.scale, wq.data, wq.scale


def _rel(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def _same_bits(a, b) -> bool:
    import torch

    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def run(name: str) -> None:
    import torch

    from engine.kernels import gemm as G

    f32 = torch.float32
    if name == "split_k_vs_reference":
        # N off the 32/64/128-row tiles, K with a partial last group (and K % 128 != 0), M in the BM 16 and 32 tiles;
        # 896 = 7 groups: 3 splits of 3, 3, 1 groups
        for m, n, k in ((1, 256, 512), (3, 200, 896), (17, 136, 1000)):
            ops = _operands(m, n, k, seed=m)
            ref = G.fp8_block_linear_reference(*ops, out_dtype=f32)
            for bn in (32, 64, 128):
                for split in (1, 2, 3):
                    out = G.fp8_block_gemm_triton(*ops, out_dtype=f32, split_k=split, block_n=bn, num_warps=4,
                                                  num_stages=3, fused_reduce=True)
                    assert out.shape == (m, n)
                    err = _rel(out, ref)
                    assert err <= TOL, f"M={m} N={n} K={k} block_n={bn} split_k={split}: rel err {err:.2e}"
    elif name == "fused_reduce_is_the_reduce_kernel":  # same fp32 additions in split order: the same bits
        # 16 groups in 2 / 3 / 4 / 6 / 8 / 16 splits and 9 groups in 5 / 9: bursts of 2 / 4 partials per round trip
        # (the kernel's RED, forced here: `reduce_burst` gives this little CPU grid 1) end full or short
        rule = G.reduce_burst
        for k, splits in ((2048, (2, 3, 4, 6, 8, 16)), (1152, (5, 9))):
            ops = _operands(5, 192, k, seed=7)
            for split in splits:
                assert G._plan_split(5, 192, k // 128, 16, 64, ops[0].device, split)[0] == split
                kw = dict(split_k=split, block_n=64, num_warps=4, num_stages=3, sliced=False)
                b = G.fp8_block_gemm_triton(*ops, out_dtype=f32, fused_reduce=False, **kw)
                for red in (4, 2, 1):
                    G.reduce_burst = lambda splits, programs, sms, red=red: red
                    a = G.fp8_block_gemm_triton(*ops, out_dtype=f32, fused_reduce=True, **kw)
                    assert _same_bits(a, b), f"split_k={split} RED={red}: fused and separate reduce differ"
                G.reduce_burst = rule
    elif name == "bias_and_bf16_rounding":
        m, n, k = 4, 200, 640
        ops = _operands(m, n, k, seed=11)
        bias = _blocky(1, n, 1, 8, seed=12)[0]
        ref = G.fp8_block_linear_reference(*ops, bias=bias, out_dtype=f32)
        x, xs, w, ws = ops
        for split, fused in ((1, True), (2, True), (2, False), (3, True)):
            kw = dict(split_k=split, block_n=64, num_warps=4, num_stages=3, fused_reduce=fused)
            out = G.fp8_block_gemm_triton(*ops, bias=bias, out_dtype=f32, **kw)
            assert _rel(out, ref) <= TOL, f"bias, split_k={split} fused={fused}: rel err {_rel(out, ref):.2e}"
            # the epilogue's / reduce's rounding to bf16 values (fp32 carrier) = torch's round-to-nearest-even of
            # the same fp32 output = the kernel's own bf16 output (its store rounds as the GPU's cvt.rn.bf16.f32:
            # interpret_util.faithful_floats)
            rounded = G._launch_fp8(x, xs, xs.stride(), w, ws, ws.stride(), bias, f32, round_bf16=True, **kw)
            assert not _same_bits(rounded, out), "rounding to bf16 values changed nothing"
            assert _same_bits(rounded, out.to(torch.bfloat16).float()), f"split_k={split} fused={fused}: bf16 rounding"
            as_bf16 = G.fp8_block_gemm_triton(*ops, bias=bias, out_dtype=torch.bfloat16, **kw)
            assert torch.equal(as_bf16.float(), rounded), f"split_k={split} fused={fused}: bf16 output"
    elif name == "decode_config_knob_sets":  # every committed entry's knobs (whole_k / wgmma: split-K fallback here)
        seen = set()
        for (_, n, k, bm), knobs in G.DECODE_CONFIGS.items():
            key = (bm, tuple(sorted(knobs.items())))
            if key in seen:
                continue
            seen.add(key)
            m = bm - 1 if bm > 16 else 3  # a row count whose tile is the entry's
            ops = _operands(m, 256, 1408, seed=bm)  # 11 groups: uneven splits for split_k 2 / 4 / 8
            ref = G.fp8_block_linear_reference(*ops, out_dtype=f32)
            out = G.fp8_block_gemm_triton(*ops, out_dtype=f32, **knobs)
            err = _rel(out, ref)
            assert err <= TOL, f"entry knobs {knobs} at BM {bm}: rel err {err:.2e}"
        assert len(seen) >= 5, seen
    elif name == "gemv_m1":
        for n, k, bn, groups in ((256, 1024, 8, 8), (200, 896, 4, 8), (136, 1000, 8, 2)):
            x, xs, w, ws = _operands(1, n, k, seed=n)
            bias = _blocky(1, n, 1, 8, seed=n + 1)[0]
            ref = G.fp8_block_linear_reference(x, xs, w, ws, bias=bias, out_dtype=f32)
            out = torch.empty((1, n), dtype=f32)
            G._launch_gemv(x, xs, xs.stride(), w, ws, ws.stride(), bias, out, False, block_n=bn, groups=groups,
                           num_stages=2, num_warps=2)
            err = _rel(out, ref)
            assert err <= TOL, f"GEMV N={n} K={k} block_n={bn} groups={groups}: rel err {err:.2e}"
    else:
        raise KeyError(name)


def main(names: list[str]) -> int:
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here.parent), str(here)]
    from interpret_util import script_main

    return script_main(names, CHECKS, run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
