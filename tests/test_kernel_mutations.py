"""The native-kernel mutations (`device: gpu` entries of suites/selftest/mutations.yaml, evalharness/kernel_mutations.py).

* Plain CPU: every entry's snippets occur exactly once in today's source (a kernel refactor fails here first); a
  missing snippet is an error naming the entry and the snippet, and plants nothing; a Python launcher's mutation
  changes what it hands cuBLAS and is undone, also after an error; the CUDA-graph fault replays the stale buffer.
* Compiled Triton (no GPU needed: Triton compiles for sm_90 on the CPU; skipped under TRITON_INTERPRET=1): while a
  mutation is planted, the engine kernels that call the mutated helper hash differently and compile to other PTX;
  after it, to the original again.
* Interpreter (marker `interpreter`, ``TRITON_INTERPRET=1 python3 -m pytest -q -m interpreter tests/test_kernel_mutations.py``):
  each mutated kernel's output differs from the original's on a small tensor, and the original is back afterwards.
* GPU (marker `gpu`, skipped without CUDA): the stale CUDA-graph token buffer changes a paged runtime's greedy tokens.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from evalharness.errors import SuiteError
from evalharness.kernel_mutations import Edit, apply_edits, function_source, mutated, resolve_function
from evalharness.mutations import load_mutations, patched
from tests.support.interpret import INTERPRET

GPU = [m for m in load_mutations() if m.device == "gpu"]
BY_ID = {m.id: m for m in load_mutations()}


def _edits_by_target(m):
    out: dict[str, list[Edit]] = {}
    for e in m.mutate:
        out.setdefault(e.target or m.target, []).append(e)
    return out


# ------------------------------------------------------------------ plain CPU
def test_gpu_entries_are_concrete():
    """Six native-kernel faults, each planted by source edits or a fault factory (none only names a point)."""
    assert len(GPU) == 6
    assert all(bool(m.mutate) != (m.fault is not None) for m in GPU)
    assert all(m.suite.startswith("suites/selftest/mutations-gpu") for m in GPU)


@pytest.mark.parametrize("m", [m for m in GPU if m.mutate], ids=lambda m: m.id)
def test_find_snippets_occur_once_in_todays_source(m):
    for target, edits in _edits_by_target(m).items():
        src = function_source(target)
        for e in edits:
            assert src.count(e.find) == 1, f"{m.id}: {e.find!r} occurs {src.count(e.find)} times in {target}"
        assert apply_edits(m.id, target, src, edits) != src


def test_missing_snippet_names_entry_and_snippet_and_plants_nothing():
    import engine.kernels.gemm as G

    code = G.scaled_mm_blockwise.__code__
    edits = (Edit("kb4 = _round_up(kb, 4)", "kb4 = kb"), Edit("no such line", "x"))
    with pytest.raises(SuiteError, match=r"mutation m1: engine\.kernels\.gemm:scaled_mm_blockwise: the snippet "
                                         r"'no such line' occurs 0 times"):
        with mutated("m1", "engine.kernels.gemm:scaled_mm_blockwise", edits):
            pass
    assert G.scaled_mm_blockwise.__code__ is code


def _cublas_scale_reads(monkeypatch):
    """Run scaled_mm_blockwise on the CPU with a stand-in for F.scaled_mm that returns nothing but records the weight
    scale grid as cuBLAS reads it: element (g, j) of the (K/128 padded, N/128) view at stride (1, padded)."""
    import engine.kernels.gemm as G

    seen = []

    class Scaling:
        BlockWise1x128 = BlockWise128x128 = None

    def fake(xp, wt, sa, _a, sb_t, _b, output_dtype):
        seen.append(sb_t.t().contiguous())  # (N/128, padded K/128): row j = the scales cuBLAS applies to block j
        return torch.zeros(xp.shape[0], wt.shape[1], dtype=output_dtype)

    monkeypatch.setattr(G, "_SCALED_MM", fake)
    monkeypatch.setattr(G, "_SCALING", Scaling)
    n, k = 384, 640  # 3 weight-row blocks, K/128 = 5 (5 % 4 != 0)
    x = torch.zeros(4, k).to(torch.float8_e4m3fn)
    w = torch.zeros(n, k).to(torch.float8_e4m3fn)
    ws = torch.arange(1, 16, dtype=torch.float32).reshape(3, 5)
    return lambda: (G.scaled_mm_blockwise(x, torch.ones(4, 5), w, ws), seen.pop()[:, :5])[1], ws


def test_scale_layout_launcher_mutation(monkeypatch):
    """gpu-gemm-scale-layout-k128-mod4: the launcher hands cuBLAS the unpadded weight scales in the padded layout
    (block rows >= 1 read shifted scales); the original launcher is back after the run and after an error."""
    import engine.kernels.gemm as G

    run, ws = _cublas_scale_reads(monkeypatch)
    m = BY_ID["gpu-gemm-scale-layout-k128-mod4"]
    assert torch.equal(run(), ws)
    code = G.scaled_mm_blockwise.__code__
    with patched(m):
        assert G.scaled_mm_blockwise.__code__ is not code
        bad = run()
    assert torch.equal(bad[0], ws[0]) and not torch.equal(bad[1:], ws[1:])
    assert G.scaled_mm_blockwise.__code__ is code and torch.equal(run(), ws)
    with pytest.raises(RuntimeError, match="boom"):
        with patched(m):
            raise RuntimeError("boom")
    assert G.scaled_mm_blockwise.__code__ is code


def test_graph_stale_tokens_fault_replays_the_buffer():
    """gpu-cuda-graph-stale-buffer: once a batch size's graph exists, the step gets the buffer's stale tokens; the
    capturing step and eager runtimes get their own."""
    from engine.runtime import PagedRuntime

    m = BY_ID["gpu-cuda-graph-stale-buffer"]
    got = []
    stale = torch.tensor([[7], [8]])

    class Rt:
        graphs, _graphs = True, {}

    orig = PagedRuntime._decode
    try:
        PagedRuntime._decode = lambda self, tokens, seq_ids, start: got.append(tokens.clone())
        with patched(m):
            rt = Rt()
            PagedRuntime._decode(rt, torch.tensor([[1], [2]]), None, None)  # no graph yet: captures on these
            rt._graphs = {2: (None, stale)}
            PagedRuntime._decode(rt, torch.tensor([[3], [4]]), None, None)
            rt.graphs = False
            PagedRuntime._decode(rt, torch.tensor([[5], [6]]), None, None)
    finally:
        PagedRuntime._decode = orig
    assert [t.flatten().tolist() for t in got] == [[1, 2], [7, 8], [5, 6]]


# ------------------------------------------------------------------ compiled Triton (sm_90, on the CPU)
def _ptxas() -> bool:
    import os

    import triton

    return shutil.which("ptxas") is not None or os.path.exists(
        os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))


compiled = pytest.mark.skipif(INTERPRET or not _ptxas(),
                              reason="compiled Triton only (not under TRITON_INTERPRET=1; needs Triton's ptxas)")

# engine kernels that reach each mutated helper: (kernel, pointer dtypes by name, constexprs)
_CALLERS = {
    "gpu-quant-rtz": [("engine.kernels.quant:_act_quant_kernel", {"out_ptr": "*fp8e4nv"},
                       dict(BM=32, GB=1, FAST=fast, PDL=False, MX=False)) for fast in (False, True)],
    "gpu-attn-split-k-dropped": [("engine.kernels.paged_kv:_decode_reduce_kernel", {},
                                  dict(S_P=4, DV=32, DV_P=32, OUT_MODE=0, STORE_HP=False, PDL=False))],
    "gpu-mx-e8m0-off-by-one": [("engine.kernels.gemm_mx:_mx_gemm_kernel",
                                {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "ws_ptr": "*u8", "cnt_ptr": "*i32"},
                                dict(BM=16, BN=64, X_SCALED=True, W_FP4=False, W_SB=32, W_E8M0=True, HAS_TS=False,
                                     USE_PART=False, HAS_BIAS=False, ROW_SCALES=True,
                                     FP4_PTX=False, FUSED_REDUCE=False, RED=1))],
    "gpu-paged-decode-page-off-by-one": [
        ("engine.kernels.paged_kv:_paged_decode_kernel",
         {"q_ptr": "*bf16", "kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv", "bt_ptr": "*i32", "seq_ptr": "*i32",
          "slen_ptr": "*i32", "qpos_ptr": "*i32", "qk_scale": "fp32"},
         dict(PAGE=16, DQ=32, DV=32, DQ_P=32, DV_P=32, BM=16, BN=bn, HAS_QS=False, HAS_SCALES=True, V_GROUPS=1,
              HAS_WINDOW=False, COMPUTE=torch.float16, PV_DTYPE=torch.bfloat16, FP32_QK=False,
              PAGE_TILE=bn <= 16, QK_F16=True, V_ON_P=True, PV_F16=True, DIRECT=False, OUT_MODE=0,
              STORE_HP=False, PDL=False)) for bn in (16, 64)],
}


def _ptx(target: str, ptrs: dict, constexprs: dict) -> str:
    """The sm_90 PTX of engine kernel `target` with these constexprs (pointers fp32 unless `ptrs` says, other
    arguments i32 unless `ptrs` says)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = resolve_function(target)
    sig = {}
    cexp = {}
    for p in kernel.params:
        if p.name in constexprs:
            sig[p.name] = "constexpr"
            v = constexprs[p.name]
            cexp[p.name] = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}.get(v, v)
        else:
            sig[p.name] = ptrs.get(p.name, "*fp32" if p.name.endswith("_ptr") else "i32")
    return triton.compile(ASTSource(kernel, sig, constexprs=cexp), target=GPUTarget("cuda", 90, 32)).asm["ptx"]


@compiled
def test_planted_helper_changes_the_callers_hash_and_is_undone():
    """The quant kernels' hash (Triton's cache key, memoized per JIT function) changes with the planted helper and
    returns to the original's after the block, also after an error."""
    k = resolve_function("engine.kernels.quant:_act_quant_kernel")
    before = k.cache_key
    m = BY_ID["gpu-quant-rtz"]
    with patched(m):
        assert k.cache_key != before
    assert k.cache_key == before
    with pytest.raises(RuntimeError):
        with patched(m):
            raise RuntimeError("boom")
    assert k.cache_key == before and "rtne" in resolve_function(m.target).src


@compiled
@pytest.mark.slow  # 1-6 s each with an empty Triton cache: two sm_90 compiles per calling kernel
@pytest.mark.parametrize("mid", sorted(_CALLERS))
def test_mutated_kernels_compile_for_sm90_to_other_code(mid):
    for target, ptrs, cexp in _CALLERS[mid]:
        clean = _ptx(target, ptrs, cexp)
        with patched(BY_ID[mid]):
            bad = _ptx(target, ptrs, cexp)
        assert bad != clean, f"{mid}: {target} compiled to the same PTX with the mutation planted"
        assert _ptx(target, ptrs, cexp) == clean


# ------------------------------------------------------------------ interpreter (CPU tensors)
@pytest.mark.interpreter
def test_interpreted_quant_rtz_is_the_cpu_rtz_fault():
    """gpu-quant-rtz: the act_quant kernel's E4M3 bits change, and equal the formats library's under the CPU fault
    q-round-toward-zero (the same fault, kernel and emulation), subnormals included; the original is back."""
    from engine.formats import quantize
    from engine.kernels import quant as Q

    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4, 256, generator=g) * 3, torch.full((1, 256), 1e-3),
                   torch.tensor([[448.0] + [3e-3] * 255])])
    d0, s0 = Q.act_quant(x)
    with patched(BY_ID["gpu-quant-rtz"]):
        d1, s1 = Q.act_quant(x)
    with patched(BY_ID["q-round-toward-zero"]):
        q = quantize(x, "e4m3:1x128")
    bits = lambda t: t.view(torch.uint8)  # noqa: E731
    assert not torch.equal(bits(d1), bits(d0)) and torch.equal(s1, s0)
    assert torch.equal(bits(d1), bits(q.data))
    d2, _ = Q.act_quant(x)
    assert torch.equal(bits(d2), bits(d0))


@pytest.mark.interpreter
def test_interpreted_mx_e8m0_off_by_one_doubles_the_gemm():
    from engine.formats import quantize
    from engine.kernels import gemm_mx as GM

    g = torch.Generator().manual_seed(1)
    wp = GM.prepare_mx_weight(quantize(torch.randn(64, 128, generator=g), "mxfp8"))
    x = quantize(torch.randn(2, 128, generator=g), "mxfp8")
    clean = GM.mx_linear(x, wp, out_dtype=torch.float32)
    with patched(BY_ID["gpu-mx-e8m0-off-by-one"]):
        bad = GM.mx_linear(x, wp, out_dtype=torch.float32)
    assert torch.equal(bad, 2 * clean)
    assert torch.equal(GM.mx_linear(x, wp, out_dtype=torch.float32), clean)


def _paged_case():
    from engine.kernels.paged_kv import PagedKVCache

    g = torch.Generator().manual_seed(2)
    cache = PagedKVCache(1, 16, 16, 2, 32, max_seqs=2, max_blocks_per_seq=8, device="cpu")
    for s, n in enumerate((70, 40)):
        cache.allocate(s, n)
        cache.write(0, [s], [0], torch.randn(1, 2, n, 32, generator=g), torch.randn(1, 2, n, 32, generator=g))
    return cache, torch.randn(2, 4, 1, 32, generator=g)


@pytest.mark.interpreter
@pytest.mark.parametrize("mid, block_n, splits", [("gpu-paged-decode-page-off-by-one", 16, 1),
                                                  ("gpu-paged-decode-page-off-by-one", 64, 2),
                                                  ("gpu-attn-split-k-dropped", 16, 3)])
def test_interpreted_paged_decode_mutations(mid, block_n, splits):
    """The page table off by one (one-page tiles and multi-page tiles), the split merge without its last split:
    the paged decode attention's output changes; the original is back afterwards."""
    from engine.kernels.paged_kv import paged_decode_attention

    cache, q = _paged_case()
    run = lambda: paged_decode_attention(q, cache, 0, block_n=block_n, num_splits=splits)  # noqa: E731
    clean = run()
    with patched(BY_ID[mid]):
        bad = run()
    assert bad.shape == clean.shape and not torch.equal(bad, clean)
    assert torch.equal(run(), clean)


# ------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_stale_graph_buffer_changes_greedy_tokens():
    """On CUDA: zoo-llama served with CUDA graphs (fp8-kv pages) gives other greedy tokens with the stale buffer."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from engine.api import Engine
    from engine.loading import load_model
    from engine.model import Transformer
    from engine.runtime import PagedRuntime
    from engine.serving import ServingConfig
    from evalharness.mutations import REPO

    loaded = load_model(str(REPO / "zoo" / "zoo-llama"))
    eng = Engine(Transformer(loaded.cfg, loaded.weights).to("cuda"), "fp8-kv", backend="cuda-native")
    prompts = [[1, 5, 9, 33, 2, 7], [1, 100, 3], [1, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 8], [1, 17]]
    cfg = ServingConfig(kv_block_size=16, max_batch=4, max_tokens=64, cuda_graphs=True)
    clean = PagedRuntime(eng, cfg).generate(prompts, 12)
    with patched(BY_ID["gpu-cuda-graph-stale-buffer"]):
        bad = PagedRuntime(eng, cfg).generate(prompts, 12)
    assert bad != clean
    assert PagedRuntime(eng, cfg).generate(prompts, 12) == clean
