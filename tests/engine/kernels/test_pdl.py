"""Programmatic dependent launch (engine.kernels.pdl): when it applies, and that it never changes bits.

CPU: `launch_opts` asks for PDL only on a CUDA device with the backend's `KernelOptions.pdl` on.
GPU (skipped without CUDA): a chain of dependent PDL launches (each kernel reads what the one before
wrote) gives exactly the bits of plain launches, the M = 1 GEMV's L2 prefetch changes nothing, and a
CUDA-graph decode of zoo-llama with PDL equals one without it, logits bit for bit, at batch 1 (the GEMV)
and batch 4 (the split-K MMA kernel).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kernels import pdl

REPO = Path(__file__).resolve().parents[3]
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_launch_opts_only_on_cuda_and_when_enabled():
    cpu = torch.zeros(1)
    assert pdl.launch_opts(cpu) == {"PDL": False}  # never on the CPU interpreter
    assert pdl.launch_opts(cpu, False) == {"PDL": False}
    if torch.cuda.is_available():
        dev = torch.zeros(1, device="cuda")
        assert pdl.launch_opts(dev, False) == {"PDL": False}
        want = {"PDL": True, "launch_pdl": True} if torch.cuda.get_device_capability()[0] >= 9 else {"PDL": False}
        assert pdl.launch_opts(dev) == want


def _chain(x: torch.Tensor, w: torch.Tensor, norm_w: torch.Tensor, n: int, on: bool) -> list[torch.Tensor]:
    """n rounds of fused RMSNorm -> quant -> FP8 GEMV -> act_quant -> SwiGLU, each launch reading the previous one's
    output (a missing wait would read stale or half-written data); `on`: KernelOptions.pdl."""
    from engine.kernels.gemm import fp8_block_linear
    from engine.kernels.options import KernelOptions
    from engine.kernels.quant import act_quant, rmsnorm_quant, swiglu_quant

    o = KernelOptions(pdl=on)
    outs = []
    h = x
    for _ in range(n):
        d, s = rmsnorm_quant(h, norm_w, 1e-5, options=o)
        y = fp8_block_linear(d, s, w.data, w.scale, out_dtype=torch.float32, options=o)  # (1, 2K)
        g, u = y[:, : x.shape[1]].contiguous(), y[:, x.shape[1]:].contiguous()
        d2, s2 = swiglu_quant(g, u, options=o)
        _, s3 = act_quant(g, options=o)
        h = (d2.float() * s2.repeat_interleave(128, dim=1)[:, : x.shape[1]] + s3.sum()).contiguous()
        outs.append(h)
    return outs


@GPU
@pytest.mark.gpu
def test_pdl_chain_gives_the_same_bits():
    from engine.formats import quantize

    g = torch.Generator(device="cpu").manual_seed(0)
    k = 4096
    x = torch.randn(1, k, generator=g).cuda()
    w = quantize(torch.randn(2 * k, k, generator=g).cuda() * 0.02, "e4m3:128x128")
    nw = (torch.rand(k, generator=g) + 0.5).cuda()
    ref = _chain(x, w, nw, 40, False)
    got = _chain(x, w, nw, 40, True)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert torch.isfinite(ref[-1]).all() and ref[-1].abs().max() > 0


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 4])
def test_pdl_graph_decode_equals_plain_launches(batch):
    from engine.api import Engine
    from engine.kernels.options import KernelOptions
    from engine.loading import load_model
    from engine.model import Transformer
    from engine.runtime import PagedRuntime
    from engine.serving import ServingConfig

    loaded = load_model(str(REPO / "zoo" / "zoo-llama"))
    model = Transformer(loaded.cfg, loaded.weights).to("cuda")
    prompts = [[1, 5, 9, 33, 2, 7], [1, 100, 3], [1, 4, 4, 4, 4, 8], [1, 17]][:batch]
    runs = []
    for on in (False, True):  # the graph captures the launches with (or without) the attribute
        eng = Engine(model, "fp8-block", backend="cuda-native", options=KernelOptions(pdl=on))
        assert eng.kernel_settings()["options"]["pdl"] is on
        rt = PagedRuntime(eng, ServingConfig(kv_block_size=16, max_batch=4, max_tokens=64, cuda_graphs=True))
        runs.append(rt.generate(prompts, 12, return_logits=True))
    (a_out, a_logits), (b_out, b_logits) = runs
    assert a_out == b_out
    assert all(torch.equal(x, y) for x, y in zip(a_logits, b_logits))
