"""The `cuda-native` backend under tensor / expert parallelism: every piece that does not need CUDA, on the CPU.

* Weight shards as codes + scales (`engine.backends.native_parallel.slice_qtensor`): bit-exact with the slice of
  the whole tensor's dequantization for every weight format, refused when the slice cuts a scale group; the
  TP=2 sharding plan of zoo-llama / zoo-moe under fp8-block, with which shards stay native (2 gloo ranks).
* Row-parallel finish (`Numerics.gemm_output`, which `NativeNumerics.linear` calls with the native GEMM's fp32
  partial): an fp32 partial of the local K-slice, all-reduced, then bias and rounding, equals the emulation's
  row-parallel `linear` bit for bit; rounding before the reduce would not (2 gloo ranks).
* EP exchange: the plan (copies sorted by destination, counts, receive order) and, over 2 gloo ranks, the rows
  the receiving rank's `run_dispatched` gets: the sender's E4M3 codes and 1x128 scales, bit for bit, in
  (expert, source)-major order; the EP=2 MoE output equals the single-process one bit for bit.
* The native EP helpers (`run_dispatched_native`, `combine_dispatched_native`: grouped FP8 GEMMs and the combine
  kernel) on a simulated 2-rank exchange vs `grouped_fp8_moe` on all tokens: bit-identical (marker `gpu` +
  `interpreter`: the GPU, or the CPU under TRITON_INTERPRET=1).
* TP=2 / EP=2 vs TP=1 on cuda-native over NCCL: `test_nccl_native_tp_ep_match_tp1`, needs 2 GPUs (not run yet).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from engine.formats import quantize
from engine.parallel import ParallelContext, _unwire, _wire, exchange_plan, receive_order
from tests.conftest import REPO
from tests.engine.test_parallel import _compare, _free_port

ZOO = REPO / "zoo"
WEIGHT_SPECS = ["e4m3:128x128", "e4m3:1x128", "e4m3:tensor", "e4m3:channel", "mxfp8", "mxfp4", "nvfp4", "bf16"]


# ---------------------------------------------------------------- weight shards (in process)
@pytest.mark.parametrize("spec", WEIGHT_SPECS)
@pytest.mark.parametrize("dim, start, length", [(0, 0, 128), (0, 128, 192), (0, 64, 64), (0, 344, 40),
                                                (1, 128, 128), (1, 32, 64), (1, 64, 64), (1, 100, 60)])
def test_slice_qtensor_is_the_slice_of_the_whole(spec, dim, start, length):
    """A shard cut as codes + scales dequantizes to exactly the slice of the whole tensor's values; a slice that
    starts inside a scale group and leaves it has no such form (None)."""
    from engine.backends.native_parallel import slice_qtensor
    from engine.formats import parse_spec
    from engine.formats.grouping import group_shape

    g = torch.Generator().manual_seed(0)
    w = torch.randn(384, 256, generator=g) * torch.logspace(-2, 2, 256)  # (N, K), outlier columns
    q = quantize(w, spec)
    got = slice_qtensor(q, dim, start, length)
    p = parse_spec(spec)
    edge = 1 if p.is_passthrough or p.granularity in ("tensor", "channel") else group_shape(p, 384, 256)[dim]
    cuts = start % edge != 0 and start // edge != (start + length - 1) // edge
    if cuts:
        assert got is None
        return
    want = q.dequantize().narrow(dim, start, length)
    assert got is not None and got.data.dtype == q.data.dtype and tuple(got.shape) == tuple(want.shape)
    assert torch.equal(got.dequantize(), want)


@pytest.mark.parametrize("spec", ["mxfp8", "mxfp4", "nvfp4", "e4m3:128x128", "bf16"])
def test_native_weight_shard_keeps_its_kernel_form(spec):
    """`slice_native_weight`: the shard of a prepared weight is a `NativeWeight` of the same format; an MX / NVFP4
    shard's kernel form (the repack) holds the shard's values; a float weight stays in its dtype."""
    pytest.importorskip("triton")
    from engine.backends.native import NativeWeight
    from engine.backends.native_parallel import slice_native_weight
    from engine.kernels import gemm_mx

    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    if spec == "bf16":
        nw = NativeWeight(spec, w.shape, kernel=w.to(torch.bfloat16))
    else:
        q = quantize(w, spec)
        nw = NativeWeight(spec, w.shape, q=q, kernel=gemm_mx.prepare_weight(q))
    for dim in (0, 1):
        s = slice_native_weight(nw, dim, 128, 128, gemm_mx.prepare_weight)
        assert s.spec == spec and tuple(s.shape) == ((128, 256) if dim == 0 else (256, 128))
        assert torch.equal(s.dequantize(), nw.dequantize().narrow(dim, 128, 128))
        if nw.kernel is not None and s.q is not None:
            assert torch.equal(gemm_mx.dequantize_mx_weight(s.kernel), s.dequantize())
    assert slice_native_weight(nw, 1, 100, 60, gemm_mx.prepare_weight) is None or spec == "bf16"


# ---------------------------------------------------------------- EP wire and exchange plan (in process)
@pytest.mark.parametrize("spec", ["e4m3:1x128", "mxfp8"])
def test_wire_carries_the_codes_and_scales_the_grouped_gemm_reads(spec):
    """The dispatched rows of an activation QTensor arrive as its element codes (bit for bit, float8 dtype) and its
    per-row scales in the QTensor's own (rows, groups) layout: what the native grouped GEMM reads, unrequantized."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(2)) * 10
    q = quantize(x, spec)
    rows = torch.tensor([63, 0, 7, 7, 31])
    data, scales = ParallelContext._wire_rows(q, rows)
    data2 = _unwire(_wire(data), data.dtype, data.shape[1])
    scales2 = _unwire(_wire(scales), torch.float32, scales.shape[1])
    assert data2.dtype == q.data.dtype
    assert torch.equal(data2.view(torch.uint8), q.data[rows].view(torch.uint8))
    assert torch.equal(scales2, q.scale.reshape(64, -1)[rows])


@pytest.mark.parametrize("size", [2, 4])
def test_exchange_plan_sorts_copies_by_destination(size):
    """Each rank's copies go out sorted by expert, hence by destination rank, with per-(rank, expert) counts; the
    receiving side's permutation turns (source, expert)-major blocks into (expert, source)-major segments."""
    e, k, n = 8, 3, 37
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])  # (tokens, k), distinct per token
    per = e // size
    sends = [exchange_plan(ids, r, size, e) for r in range(size)]
    assert [p.lo for p in sends] + [sends[-1].hi] == [n * i // size for i in range(size + 1)]
    for p in sends:
        flat = ids[p.lo:p.hi].reshape(-1)[p.plan.order]  # expert of each sorted copy
        assert torch.all(flat[1:] >= flat[:-1])  # by expert ...
        dest = (flat // per).tolist()
        assert dest == sorted(dest)  # ... so by destination rank
        assert p.send == [dest.count(j) for j in range(size)] and sum(p.send) == (p.hi - p.lo) * k
        assert p.counts == [[int((flat == j * per + i).sum()) for i in range(per)] for j in range(size)]
    for r in range(size):
        recv_counts = [sends[src].counts[r] for src in range(size)]  # what the counts all-to-all delivers
        recv, perm, local = receive_order(recv_counts, r, e)
        arrived = [(src, r * per + i) for src in range(size) for i in range(per) for _ in range(recv_counts[src][i])]
        assert recv == [sum(c) for c in recv_counts] and sorted(perm) == list(range(len(arrived)))
        ordered = [arrived[j] for j in perm]
        assert ordered == sorted(ordered, key=lambda t: (t[1], t[0]))  # expert-major, then source
        assert sum(local) == len(arrived) and all(c == 0 for x, c in enumerate(local) if x // per != r)


# ---------------------------------------------------------------- 2 gloo ranks
def _worker(rank: int, port: int, tmp: str) -> None:
    """One of 2 gloo ranks: sharding plans, the row-parallel finish, the EP rows; rank 0 writes tmp/native.json."""
    import torch.distributed as dist

    from engine.backends.native import NativeWeight
    from engine.backends.native_parallel import slice_native_weight
    from engine.config import ModelConfig
    from engine.kernels import gemm_mx
    from engine.loading import load_model
    from engine.numerics import Numerics
    from engine.parallel import ParallelConfig
    from engine.recipe import load_recipe
    from engine.weights import module_path, weight_site

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out: dict = {}
    try:
        recipe = load_recipe("fp8-block")
        for name in ("zoo-llama", "zoo-moe"):  # which fp8-block shards stay native at tp=2, and their values
            loaded = load_model(str(ZOO / name))
            ctx = ParallelContext(ParallelConfig(tp=2), loaded.cfg)
            plan = {}
            for wname, w in loaded.weights.items():
                site = weight_site(wname)
                rng = ctx.shard_range(wname, tuple(w.shape))
                if rng is None or site not in ("linear.weight", "moe.weight"):
                    continue
                spec = recipe.spec(site, module_path(wname))
                nw = NativeWeight(spec, w.shape, q=quantize(w.float(), spec))
                cut = slice_native_weight(nw, *rng, gemm_mx.prepare_weight)
                emulated = nw.dequantize().narrow(*rng)
                plan[wname] = [list(rng), cut is not None, cut is not None and torch.equal(cut.dequantize(), emulated)]
            out[f"{name}.plan.rank{rank}"] = plan

        # row-parallel finish: an fp32 partial of the local K-slice through gemm_output == the emulation's linear
        cfg = ModelConfig.from_hf(json.loads((ZOO / "zoo-llama" / "config.json").read_text()))
        ctx = ParallelContext(ParallelConfig(tp=2), cfg)
        nx = Numerics(recipe)
        nx.parallel = ctx
        g = torch.Generator().manual_seed(4)
        w = torch.randn(256, 256, generator=g) / 16  # o_proj (d, heads*hd)
        x = torch.randn(3, 5, 256, generator=g)  # (batch, t, heads*hd): the attention output
        bias = torch.randn(256, generator=g)
        name, module = "model.layers.0.self_attn.o_proj.weight", "layers.0.attn.o_proj"
        w_local = ctx.shard_weight(name, nx.prepare_weight(w, "linear.weight", module), nx.slice_prepared)
        x_local = x[..., rank * 128:(rank + 1) * 128]
        emulated = nx.linear(x_local, w_local, bias, module)
        xq = nx.quant(x_local, "linear.input", module)  # the local K-slice's own 1x128 quantization
        partial = torch.nn.functional.linear(xq.dequantize().reshape(-1, 128), w_local)  # fp32, no bias, unrounded
        finished = nx.gemm_output(partial, bias, module, x.shape[:-1])
        early = nx.round(partial, "linear.output", module)  # what a GEMM rounding its own output would reduce
        dist.all_reduce(early)
        early = nx.round(early + bias, "linear.output", module).reshape(3, 5, 256)
        one = Numerics(recipe).linear(x, nx.prepare_weight(w, "linear.weight", module), bias, module)
        out[f"row_parallel.rank{rank}"] = {
            "is_row_parallel": ctx.is_row_parallel(module), "equal": torch.equal(finished, emulated),
            "early_equal": torch.equal(early, emulated), "vs_tp1_max": float((finished - one).abs().max()),
            "tp1_scale": float(one.abs().max())}

        # EP rows: what run_dispatched receives, and the EP=2 output vs one process
        out.update(_ep_rows(rank, recipe))
        gathered = [None, None]
        dist.all_gather_object(gathered, out)  # every entry names its rank
        for part in gathered:
            out.update(part)
    finally:
        if rank == 0:
            (Path(tmp) / "native.json").write_text(json.dumps(out, indent=1))
        dist.destroy_process_group()


def _ep_rows(rank: int, recipe) -> dict:
    """ParallelContext.moe over the 2 ranks with a Numerics that records what `run_dispatched` receives."""
    import dataclasses

    from engine.config import ModelConfig
    from engine.numerics import Numerics
    from engine.parallel import ParallelConfig
    from engine.routing import dispatch_plan

    class Recording(Numerics):
        def run_dispatched(self, xq, data, scales, counts, experts, module):
            self.seen = (data, scales, list(counts))
            return super().run_dispatched(xq, data, scales, counts, experts, module)

    cfg = ModelConfig.from_hf(json.loads((ZOO / "zoo-moe" / "config.json").read_text()))
    n_exp, d, inter, k = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size, 2
    g = torch.Generator().manual_seed(5)  # the same inputs on both ranks
    x = torch.randn(29, d, generator=g) * 3
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:k] for _ in range(29)])  # (tokens, k)
    weights = torch.softmax(torch.randn(29, k, generator=g), -1)
    raw = [tuple(torch.randn(*s, generator=g) / s[1] ** 0.5 for s in ((inter, d), (inter, d), (d, inter)))
           for _ in range(n_exp)]
    nx1 = Numerics(recipe)
    module = "layers.1.mlp"
    experts = [tuple(nx1.prepare_weight(t, "moe.weight", f"{module}.experts.{e}.{p}")
                     for t, p in zip(ex, ("gate_proj", "up_proj", "down_proj"))) for e, ex in enumerate(raw)]
    xq = nx1.quant(x, "moe.input", module + ".experts")
    plan = dispatch_plan(ids, n_exp)  # the single-process path of Numerics.moe after routing
    y = nx1.run_experts(xq.dequantize().index_select(0, plan.token), plan.counts, experts, module)
    one = torch.zeros(29, d).index_add_(0, plan.token, y * weights.reshape(-1)[plan.order, None])

    ctx = ParallelContext(ParallelConfig(ep=2), dataclasses.replace(cfg))
    nx = Recording(recipe)
    nx.parallel = ctx
    held = [ex if ctx.owner(e) == rank else None for e, ex in enumerate(experts)]
    two = ctx.moe(nx, xq, weights, ids, held, module)
    data, scales, counts = nx.seen
    # expected arrivals: for each of my experts, each source's copies in its sorted order
    want = [int(t) + p.lo for e in range(rank * 4, rank * 4 + 4) for p in (exchange_plan(ids, s, 2, n_exp)
            for s in range(2)) for t, c in zip(p.plan.token, ids[p.lo:p.hi].reshape(-1)[p.plan.order]) if c == e]
    want_t = torch.tensor(want, dtype=torch.int64)
    return {f"ep.rank{rank}": {
        "codes_dtype": str(data.dtype), "codes_equal": torch.equal(data.view(torch.uint8),
                                                                   xq.data[want_t].view(torch.uint8)),
        "scales_equal": torch.equal(scales, xq.scale.reshape(29, -1)[want_t]),
        "counts": counts, "bitwise_vs_ep1": torch.equal(two, one), "wire_bytes": ctx.wire_bytes}}


@pytest.fixture(scope="module")
def native_results(tmp_path_factory) -> dict:
    """One spawn of 2 gloo ranks; rank 0's JSON."""
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("parallel_native")
    mp.spawn(_worker, args=(_free_port(), str(tmp)), nprocs=2, join=True)
    return json.loads((tmp / "native.json").read_text())


def test_zoo_tp2_shards_stay_native_where_the_tiles_allow(native_results):
    """zoo-llama / zoo-moe at tp=2 under fp8-block: every shard cut as codes + scales holds exactly the emulation's
    values; the ones whose slice cuts a 128x128 tile (intermediate 688 = 2 x 344; MLA q_b 384 = 2 x 192) are
    named, and their GEMMs run emulated."""
    r = native_results
    for name in ("zoo-llama", "zoo-moe"):
        for rank in (0, 1):
            plan = r[f"{name}.plan.rank{rank}"]
            assert plan and all(exact for _, native, exact in plan.values() if native)
    llama0, llama1 = r["zoo-llama.plan.rank0"], r["zoo-llama.plan.rank1"]
    assert llama0["model.layers.0.self_attn.o_proj.weight"] == [[1, 0, 128], True, True]
    assert llama1["model.layers.0.self_attn.k_proj.weight"] == [[0, 64, 64], True, True]  # inside one tile
    assert llama0["model.layers.0.mlp.gate_proj.weight"][1] is True  # rows 0:344 start on a tile
    assert llama1["model.layers.0.mlp.gate_proj.weight"] == [[0, 344, 344], False, False]  # 344 cuts a tile
    assert llama1["model.layers.0.mlp.down_proj.weight"] == [[1, 344, 344], False, False]
    moe1 = r["zoo-moe.plan.rank1"]
    assert moe1["model.layers.1.self_attn.q_b_proj.weight"][1] is False  # 8 x 48 rows: 192 cuts a tile
    assert moe1["model.layers.1.self_attn.kv_b_proj.weight"][1] is True
    assert moe1["model.layers.1.mlp.shared_experts.down_proj.weight"] == [[1, 64, 64], True, True]
    assert not any(".experts." in n and ".shared_experts." not in n for n in moe1)  # routed experts: whole


def test_row_parallel_partials_are_reduced_before_bias_and_rounding(native_results):
    """The native row-parallel path's finish: the local K-slice's fp32 partial (no bias, unrounded) through
    `Numerics.gemm_output` is bit-identical to the emulation's row-parallel linear; bias + bf16 rounding per rank
    before the reduce is not; the TP=2 result stays within bf16 rounding of TP=1."""
    for rank in (0, 1):
        m = native_results[f"row_parallel.rank{rank}"]
        assert m["is_row_parallel"] and m["equal"] and not m["early_equal"]
        assert m["vs_tp1_max"] <= 2 ** -7 * m["tp1_scale"]


def test_ep_rows_arrive_as_codes_and_scales(native_results):
    """Over 2 gloo ranks, `run_dispatched` receives the sender's E4M3 codes and 1x128 scales bit for bit, expert-
    then source-major, with per-expert counts only for its experts; EP=2 == one process bit for bit."""
    total = 0
    for rank in (0, 1):
        m = native_results[f"ep.rank{rank}"]
        assert m["codes_dtype"] == "torch.float8_e4m3fn" and m["codes_equal"] and m["scales_equal"]
        assert all(c == 0 for e, c in enumerate(m["counts"]) if e // 4 != rank)
        assert m["bitwise_vs_ep1"]
        total += m["wire_bytes"]
    assert total > 0


# ---------------------------------------------------------------- native EP helpers (GPU, or the interpreter)
@pytest.mark.gpu
@pytest.mark.interpreter
def test_native_ep_helpers_match_the_single_process_moe():
    """A 2-rank exchange simulated in process (exchange_plan / receive_order, the wire's bit views) through
    `run_dispatched_native` (grouped FP8 GEMMs of each rank's experts, k = 1) and `combine_dispatched_native`
    (the combine kernel): the same bits as `grouped_fp8_moe` on all tokens."""
    pytest.importorskip("triton")
    from engine.backends.native_parallel import combine_dispatched_native, run_dispatched_native
    from engine.kernels.moe import ExpertWeights, grouped_fp8_moe, stack_expert_weights
    from tests.support.interpret import GPU_TEST_DEVICE as dev

    e, k, n, d, inter, size = 4, 2, 24, 256, 128, 2
    g = torch.Generator().manual_seed(6)
    xq = quantize(torch.randn(n, d, generator=g).to(dev), "e4m3:1x128")
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).to(dev)
    weights = torch.softmax(torch.randn(n, k, generator=g), -1).to(dev)
    stacks = [stack_expert_weights([quantize((torch.randn(*s, generator=g) / s[1] ** 0.5).to(dev), "e4m3:128x128")
                                    for _ in range(e)]) for s in ((inter, d), (inter, d), (d, inter))]
    one = grouped_fp8_moe(xq.data, xq.scale, *stacks, weights, ids, mode="block")
    per = e // size
    sends = [exchange_plan(ids, r, size, e) for r in range(size)]
    wire = [ParallelContext._wire_rows(xq, p.lo + p.plan.token) for p in sends]  # (codes, scales) sorted by expert
    outs = [[None] * size for _ in range(size)]  # outs[src][dst]: rows src sent to dst, computed by dst
    for r in range(size):
        recv_counts = [sends[s].counts[r] for s in range(size)]
        _, perm, counts = receive_order(recv_counts, r, e)
        blocks = [(sum(sends[s].send[:r]), sends[s].send[r]) for s in range(size)]
        data = torch.cat([wire[s][0].view(torch.uint8)[a:a + b] for s, (a, b) in enumerate(blocks)]).view(xq.data.dtype)
        scales = torch.cat([wire[s][1][a:a + b] for s, (a, b) in enumerate(blocks)])
        perm_t = torch.tensor(perm, dtype=torch.int64, device=dev)
        mine = [ExpertWeights(w.data[r * per:(r + 1) * per], w.scale[r * per:(r + 1) * per]) for w in stacks]
        y = run_dispatched_native(data.view(torch.uint8)[perm_t].view(data.dtype), scales[perm_t], counts,
                                  list(range(r * per, (r + 1) * per)), tuple(mine), torch.bfloat16)
        back = torch.empty_like(y).index_copy_(0, perm_t, y)
        s0 = 0
        for s, (_, b) in enumerate(blocks):
            outs[s][r] = back[s0:s0 + b]
            s0 += b
    two = torch.cat([combine_dispatched_native(torch.cat(outs[s]).bfloat16().float(), weights[p.lo:p.hi],
                                               ids[p.lo:p.hi], e) for s, p in enumerate(sends)])
    assert one.abs().max() > 0 and torch.equal(two, one)


# ---------------------------------------------------------------- NCCL, cuda-native (>= 2 GPUs)
def _nccl_native_worker(rank: int, port: int, out_dir: str) -> None:
    """One of 2 NCCL ranks: cuda-native TP=2 / EP=2 / both vs TP=1 on zoo-moe and zoo-llama under fp8-block (and
    bf16 for zoo-llama): logits comparisons, greedy decodes, decode step time, EP bytes per step; rank 0 writes
    out_dir/parallel_native.json."""
    import time

    import torch.distributed as dist

    from engine.api import Engine
    from engine.loading import load_model
    from engine.model import Transformer
    from engine.generation import GenerationRequest
    from engine.parallel import ParallelConfig
    from engine.serving import ServingConfig

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out: dict = {}
    try:
        for name, recipes, degrees in (("zoo-moe", ("fp8-block",), ((1, 2), (2, 1), (2, 2))),
                                       ("zoo-llama", ("fp8-block", "bf16"), ((2, 1),))):
            loaded = load_model(str(ZOO / name))
            model = Transformer(loaded.cfg, loaded.weights)
            text = torch.tensor(json.loads((ZOO / name / "heldout_sample.json").read_text())["tokens"][:4 * 128])
            text = text.view(4, 128)
            prompt = text[0, :16].tolist()
            for recipe in recipes:
                base = Engine(model, recipe, backend="cuda-native")
                ref, greedy = base.logits(text).cpu(), base.generate(prompt, 16)
                reqs = [GenerationRequest(tuple(text[i, :n].tolist()), 16) for i, n in enumerate((5, 16, 40, 90))]
                served = [g.tokens for g in base.generate_batch(reqs, ServingConfig(max_batch=4))]
                out[f"{name}.{recipe}.tp1ep1.coverage"] = base.native_coverage()
                for tp, ep in degrees:
                    eng = Engine(model, recipe, backend="cuda-native", parallel=ParallelConfig(tp=tp, ep=ep))
                    key = f"{name}.{recipe}.tp{tp}ep{ep}"
                    out[key] = _compare(ref, eng.logits(text).cpu())
                    eng.nx.parallel.wire_bytes = 0
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    decoded = eng.generate(prompt, 16)
                    torch.cuda.synchronize()
                    out[key]["decode_step_ms"] = (time.perf_counter() - t0) * 1e3 / 16
                    out[key]["ep_wire_bytes_per_step_rank"] = eng.nx.parallel.wire_bytes / 16
                    out[key]["greedy_equal"] = decoded == greedy
                    # the paged runtime on both ranks (FP8 pages of this rank's KV heads): 4 requests at batch 4
                    t0 = time.perf_counter()
                    got = [g.tokens for g in eng.generate_batch(reqs, ServingConfig(max_batch=4))]
                    torch.cuda.synchronize()
                    out[key]["served_s"] = time.perf_counter() - t0
                    out[key]["served_token_agreement"] = sum(a == b for x, y in zip(got, served)
                                                             for a, b in zip(x, y)) / sum(map(len, served))
                    out[key]["served_kv_heads"] = eng._runtime.kv.kv_heads
                    out[key]["coverage"] = eng.native_coverage()
    finally:
        if rank == 0:
            Path(out_dir, "parallel_native.json").write_text(json.dumps(out, indent=1))
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs >= 2 CUDA GPUs (NCCL); the gloo tests above cover the CUDA-free pieces")
def test_nccl_native_tp_ep_match_tp1(tmp_path):
    """cuda-native over NCCL: EP=2 bit-identical to EP=1 on zoo-moe (the codes travel, the combine kernel sums in
    the single-process order); TP=2 (and TP=2+EP=2) within the fp8-block recipe's own error of TP=1 with greedy
    decoding equal; the MoE and the aligned GEMM shards ran native."""
    import torch.multiprocessing as mp

    out_dir = os.environ.get("OUT", str(tmp_path))
    mp.spawn(_nccl_native_worker, args=(_free_port(), out_dir), nprocs=2, join=True)
    r = json.loads(Path(out_dir, "parallel_native.json").read_text())
    for key, m in r.items():
        if not key.endswith("coverage"):
            print(f"\n{key}: KLD mean {m['kld_mean']:.3g} max {m['kld_max']:.3g} top1 {m['top1']:.3f} bitwise "
                  f"{m['bitwise']} greedy {m['greedy_equal']} decode {m['decode_step_ms']:.2f} ms/step, EP "
                  f"{m['ep_wire_bytes_per_step_rank']:.0f} B/step/rank; served 4 requests in {m['served_s']:.2f} s, "
                  f"token agreement {m['served_token_agreement']:.3f}, {m['served_kv_heads']} KV heads a rank")
    ep2 = r["zoo-moe.fp8-block.tp1ep2"]
    assert ep2["bitwise"] and ep2["greedy_equal"] and ep2["served_token_agreement"] == 1.0, ep2
    assert r["zoo-llama.bf16.tp2ep1"]["served_kv_heads"] == 2  # 4 KV heads, 2 a rank
    assert ep2["coverage"].get("moe:native", 0) > 0 and ep2["ep_wire_bytes_per_step_rank"] > 0
    for key in ("zoo-moe.fp8-block.tp2ep1", "zoo-moe.fp8-block.tp2ep2", "zoo-llama.fp8-block.tp2ep1",
                "zoo-llama.bf16.tp2ep1"):
        m = r[key]
        assert m["top1"] >= 0.9 and m["kld_mean"] < 0.05, (key, m)
        assert m["coverage"].get("linear:native", 0) > 0 and m["coverage"].get("shard:native", 0) > 0, key
    assert r["zoo-llama.bf16.tp2ep1"]["greedy_equal"]
