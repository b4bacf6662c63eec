"""The MX GEMM of engine/kernels/gemm_mx.py (`mx_linear`: MXFP8 x MXFP8, bf16 / fp32 x MXFP8 / MXFP4 / NVFP4, dequantized
inside the Triton kernel) against its float64 reference, its scale / E2M1 decoders on every code, the weight repacking,
and the machine code of its decode loop.

Markers: `gpu` (skipped without CUDA); `gpu` + `interpreter` also run on CPU tensors under TRITON_INTERPRET=1 with the
smaller cases of `by_device` (every activation x weight pairing, decode / prefill tiles, splits). The PTX E2M1 decode
(`_e2m1_bytes_to_bf16`, inline PTX) runs on the GPU only; the SASS guard compiles for sm_90 on the CPU (Triton's
bundled ptxas / nvdisasm) and runs in the plain CPU suite. Tolerances: tests/engine/kernels/gemm/common.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.kernels.gemm.common import DEV, TOL, TOL_MX_EXACT_FP32, TOL_MX_ROUNDED_X, blocky, rel
from tests.support.interpret import INTERPRET, by_device


@pytest.fixture(scope="module")
def G():
    """The kernel module (needs Triton)."""
    pytest.importorskip("triton")
    from engine.kernels import gemm_mx

    return gemm_mx


# ------------------------------------------------------------------ MX / NVFP4
try:  # a module-level kernel: the interpreter resolves the helpers it calls from the module's globals
    import triton
    import triton.language as tl

    from engine.kernels.gemm_mx import _e2m1_bytes_to_bf16, _e2m1_nibble_to_f32, _e2m1_to_f32, _e4m3_to_f32, _e8m0_to_f32

    @triton.jit
    def _decode_scale_codes(c_ptr, e8_ptr, e4_ptr):
        c = tl.load(c_ptr + tl.arange(0, 256))
        tl.store(e8_ptr + tl.arange(0, 256), _e8m0_to_f32(c))
        tl.store(e4_ptr + tl.arange(0, 256), _e4m3_to_f32(c))

    @triton.jit
    def _decode_fp4_bytes(b_ptr, lo_ptr, hi_ptr, lo_old_ptr, hi_old_ptr, lo_ptx_ptr, hi_ptx_ptr, PTX: tl.constexpr):
        b = tl.load(b_ptr + tl.arange(0, 256))
        tl.store(lo_ptr + tl.arange(0, 256), _e2m1_nibble_to_f32(b, 0))
        tl.store(hi_ptr + tl.arange(0, 256), _e2m1_nibble_to_f32(b, 4))
        tl.store(lo_old_ptr + tl.arange(0, 256), _e2m1_to_f32(b & 15))
        tl.store(hi_old_ptr + tl.arange(0, 256), _e2m1_to_f32(b >> 4))
        if PTX:  # inline PTX: not under the interpreter
            lo, hi = _e2m1_bytes_to_bf16(b.to(tl.uint8))
            tl.store(lo_ptx_ptr + tl.arange(0, 256), lo.to(tl.float32))
            tl.store(hi_ptx_ptr + tl.arange(0, 256), hi.to(tl.float32))
except ImportError:  # no Triton: the GPU tests skip
    _decode_scale_codes = _decode_fp4_bytes = None


@pytest.mark.gpu
@pytest.mark.interpreter
def test_mx_scale_code_decoders_are_exact(G):
    """The MX kernel's scale decoders on every code: `_e8m0_to_f32` = 2**(code - 127) (code 0: 2**-127, 255: NaN) and
    `_e4m3_to_f32` = torch's E4M3 value, signed zeros, subnormals and NaN included."""
    codes = torch.arange(256, dtype=torch.int32, device=DEV)
    e8, e4 = (torch.empty(256, device=DEV) for _ in range(2))
    _decode_scale_codes[(1,)](codes, e8, e4)
    want8 = torch.exp2(codes.double() - 127).float()
    want8[255] = float("nan")
    want4 = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()
    for got, want in ((e8, want8), (e4, want4)):
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan)
        assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


@pytest.mark.gpu
@pytest.mark.interpreter
def test_mx_fp4_decoders_are_exact(G):
    """The MX kernel's E2M1 decoders on every packed byte, low and high nibble: the fp32 bits of the formats library's
    E2M1 values (-0 for code 8; 0.5, code 1, through the subnormal 2**-127 times 2**126 in `_e2m1_nibble_to_f32`). On
    the GPU also the PRMT table decode to bf16 (`_e2m1_bytes_to_bf16`, inline PTX)."""
    from engine.formats import decode_codes

    ptx = not INTERPRET
    b = torch.arange(256, dtype=torch.int32, device=DEV)
    outs = [torch.empty(256, device=DEV) for _ in range(6)]
    _decode_fp4_bytes[(1,)](b, *outs, PTX=ptx)
    want = [decode_codes((b & 15).to(torch.uint8), "e2m1").float(),
            decode_codes((b >> 4).to(torch.uint8), "e2m1").float()]
    assert torch.signbit(want[0][8]) and want[1][0x18] == 0.5  # -0 and a subnormal-path code are in the table
    for got, ref in zip(outs[:6 if ptx else 4], want * 3):
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("pair", [("mxfp8", "mxfp8"), ("bf16", "nvfp4"), ("bf16", "mxfp4"), ("fp32", "mxfp8")])
@pytest.mark.parametrize("m, split", by_device([(5, 1), (5, 3), (70, 1)], [(5, 3), (70, 1)]))
def test_mx_row_scales_give_the_gather_path_bits(G, pair, m, split):
    """The per-row scale loads (`KernelOptions.mx_row_scales`) and, on the GPU, the PTX E2M1 decode with bf16 scaling
    (`mx_fp4_ptx`)
    change how the operands are made, and the fused split-K reduce how partials are summed, not a bit of the output:
    the same fp32 bits as one gathered scale load per element and the reduce kernel, decode and prefill tiles, with
    a split, with a bias (NVFP4: and its tensor scale), blocks at the bottom of the float range included."""
    from engine.formats import quantize
    from engine.kernels.options import KernelOptions

    xkind, wspec = pair
    n, k = by_device((136, 608), (72, 352))  # K % 128 != 0: a partial last chunk
    w = blocky(n, k, 1, 32, seed=m)
    w[:, 32:64] *= 2.0 ** -30  # tiny blocks
    w[:8, 96:160] *= 2.0 ** -124  # blocks at the bottom of the range: products below fp32's / bf16's normal minimum
    wp = G.prepare_mx_weight(quantize(w, wspec))
    args, kw = _mx_x(xkind, m, k, seed=m + 7)
    outs = []
    bias = torch.randn(n, device=DEV)
    variants = ((False, False, False), (True, False, False), (True, True, False), (True, True, True))
    for rows, ptx, fused in by_device(variants, variants[:2] + variants[3:]):  # the PTX decode: CUDA only
        opts = KernelOptions(mx_row_scales=rows, mx_fp4_ptx=ptx)  # the PTX decode on the GPU only (mx_linear's gate)
        outs.append(G.mx_linear(*args, wp, bias=bias, out_dtype=torch.float32, split_k=split, fused_reduce=fused,
                                options=opts, **kw))
    assert torch.isfinite(outs[0]).all() and outs[0].abs().sum() > 0
    for out in outs[1:]:
        assert torch.equal(outs[0].view(torch.int32), out.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("spec", ["mxfp8", "mxfp4", "nvfp4"])
def test_prepared_mx_weight_dequantizes_bit_exactly(G, spec):
    """Repacking (FP4 nibbles, 1-byte scale codes, K padding) loses nothing: same fp32 bits as QTensor.dequantize."""
    from engine.formats import quantize

    wq = quantize(blocky(72, 200, 1, 32, seed=2), spec)
    wp = G.prepare_mx_weight(wq)
    assert wp.data.shape[1] == (128 if spec != "mxfp8" else 256)
    assert torch.equal(G.dequantize_mx_weight(wp).view(torch.int32), wq.dequantize().view(torch.int32))


def _mx_x(kind: str, m: int, k: int, seed: int):
    """Activation argument(s) for mx_linear: an mxfp8 QTensor, (data, scale), or a bf16 / fp32 tensor."""
    from engine.formats import quantize

    x = blocky(m, k, 1, 32, seed)
    if kind == "mxfp8":
        return (quantize(x, "mxfp8"),), {}
    if kind == "mxfp8_raw":
        q = quantize(x, "mxfp8")
        return (q.data,), {"x_scale": q.scale}
    return (x.to(torch.bfloat16 if kind == "bf16" else torch.float32),), {}


def _check_mx(G, wspec: str, xkind: str, m: int, dtypes) -> None:
    """mx_linear vs mx_linear_reference at N=200, K=352 (the interpreter: 72, 160; K % 128 != 0, N % 64 != 0) with a
    bias."""
    from engine.formats import quantize

    n, k = by_device((200, 352), (72, 160))
    wq = quantize(blocky(n, k, 1, 32, seed=m + 1), wspec)
    wp = G.prepare_mx_weight(wq)
    args, kw = _mx_x(xkind, m, k, seed=m)
    bias = torch.randn(n, device=DEV)
    ref = G.mx_linear_reference(*args, wp, bias=bias, out_dtype=torch.float32, **kw)
    for dt in dtypes:
        tol = TOL[dt] if dt != torch.float32 else TOL_MX_ROUNDED_X if xkind == "fp32" else TOL_MX_EXACT_FP32
        out = G.mx_linear(*args, wp, bias=bias, out_dtype=dt, **kw)
        assert out.shape == (m, n) and out.dtype == dt
        err = rel(out, ref)
        assert err <= tol, f"{xkind} x {wspec} M={m} {dt}: rel err {err:.3e} > {tol}"


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("wspec", ["mxfp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("xkind", by_device(["mxfp8", "mxfp8_raw", "bf16", "fp32"], ["mxfp8", "bf16", "fp32"]))
@pytest.mark.parametrize("m", by_device([1, 65], [1]))
def test_mx_linear(G, wspec, xkind, m):
    """Every (activation, weight) pairing of the dequant-in-kernel GEMM, decode and prefill tiles, fp32 out. (The
    interpreter: decode tiles; `test_mx_linear_m_sweep` has its prefill tiles. mxfp8_raw, data and scales passed
    apart, differs from mxfp8 on the host only.)"""
    _check_mx(G, wspec, xkind, m, (torch.float32,))


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("pair", [("mxfp8", "mxfp8"), ("bf16", "nvfp4"), ("bf16", "mxfp4")])
@pytest.mark.parametrize("m", by_device([2, 3, 5, 63, 64, 200], [33, 200]))
def test_mx_linear_m_sweep(G, pair, m):
    """Other M (partial row tiles), bf16 output."""
    xkind, wspec = pair
    _check_mx(G, wspec, xkind, m, (torch.bfloat16,))


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("wspec", ["mxfp4", "nvfp4"])
def test_mx_linear_split_k_and_adversarial(G, wspec):
    """Forced split-K (the NVFP4 tensor scale then lives in the reduction), zero rows exact, a huge
    weight block next to tiny ones, and a QTensor weight prepared on the fly."""
    from engine.formats import quantize

    n, k = 96, by_device(1024, 512)
    w = blocky(n, k, 1, 32, seed=4)
    w[:, 64:96] *= 2.0 ** 20
    wq = quantize(w, wspec)
    x = blocky(3, k, 1, 32, seed=6).to(torch.bfloat16)
    x[1] = 0
    ref = G.mx_linear_reference(x, wq, out_dtype=torch.float32)
    outs = [G.mx_linear(x, wq, out_dtype=torch.float32, split_k=s) for s in (1, 4)]
    for out in outs:
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert rel(out, ref) <= TOL_MX_EXACT_FP32
    assert rel(outs[0], outs[1]) <= 1e-5


# ------------------------------------------------------------------ machine code of the decode loop
# The K loop's instruction count per 128-column chunk and warp, which the kernel's speed follows: 787-1379 with one
# gathered scale load per element and the `_e2m1_to_f32` decode, 447-500 with the row scale tiles and the PRMT E2M1
# decode (2.5-10x faster on the H200, 2026-11-30). Measured with Triton 3.6: mxfp4 447, nvfp4 500, mxfp8 472 -- the
# bounds leave about 15% headroom for compiler drift.
BOUNDS = {"mxfp4": 520, "nvfp4": 580, "mxfp8": 550}


@pytest.fixture(scope="module")
def sass():
    """tests/support/sass_loop.py, when the Triton wheel ships ptxas and nvdisasm."""
    from tests.support import sass_loop as S

    if S.triton_tool("ptxas") is None or S.triton_tool("nvdisasm") is None:
        pytest.skip("the Triton wheel ships no ptxas / nvdisasm here")
    return S


@pytest.mark.parametrize("kind", sorted(BOUNDS))
def test_mx_decode_loop_stays_lean(sass, kind):
    """The K loop at the decode tile holds <= BOUNDS[kind] instructions, its 8 HGMMAs (4 per 64-column half) among
    them; FP4 weights are decoded by the PRMT table (no fp32 multiply per element: bf16x2 HMUL2 only)."""
    body = sass.mx_loop(kind)
    ops = [sass.opcode(t) for t in body]
    assert len(body) <= BOUNDS[kind], f"{kind}: {len(body)} instructions in the K loop"
    assert ops.count("HGMMA") == 8
    if kind != "mxfp8":
        assert ops.count("HMUL2") == 32 and ops.count("FMUL") <= 16, (ops.count("HMUL2"), ops.count("FMUL"))


def test_the_guard_sees_the_old_loop(sass):
    """Negative control: the earlier path (one gathered scale load per element, `_e2m1_to_f32`; still the kernel's
    ROW_SCALES=False variant) compiled the same way is far over the bound, so the bound measures what it claims."""
    body = sass.mx_loop("mxfp4", ROW_SCALES=False, FP4_PTX=False, FUSED_REDUCE=False)
    assert len(body) > 2 * BOUNDS["mxfp4"], len(body)
