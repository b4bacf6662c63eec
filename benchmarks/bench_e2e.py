"""End-to-end decode on the GPU: the engine's cuda-native FP8 and bf16 paths vs transformers bf16, same run.

    python benchmarks/bench_e2e.py [--layers 32] [--batches 1,8,64] [--steps 16] [--moe]

A Llama-3-8B-shaped model (hidden 4096, 32 layers, 32 heads / 8 KV heads,
FFN 14336, vocab 128256) with random weights, built directly on the GPU; with
`--moe`, a Qwen3-30B-A3B-shaped MoE (48 layers, 128 experts, top-8, FFN 768;
use `--layers` to shorten it). For each engine and batch size: prefill a
128-token prompt, then time `steps` decode steps (CUDA events: the median of
steps each followed by a host synchronization, so a step's launch time counts;
and "pipe", the mean over steps issued back to back, as a serving loop whose
host enqueues the next step while the GPU runs this one) and report tokens/s,
the bytes one step must read (weights in their storage format -- of the
embedding table only the rows looked up, of a MoE's routed experts only those
the batch is expected to pick -- + the KV cache so far) and the fraction of
the HBM copy bandwidth measured in the same run that this implies (the
roofline). Memory ("weights+KV memory"): the prepared weights' whole storage
bytes and the KV cache bytes of each path. transformers (bf16, eager, its own
KV cache) runs the same shapes in the same process as the outside reference
point. `--profile` adds each configuration's top kernels and its critical
path (`critical_path`); `--pdl both` also times the runtime without
programmatic dependent launch (rows tagged -nopdl). `--decode-configs FILE` adds measured decode-GEMM
configs (a JSON list of {device, n, k, bm, knobs}) to the decode policy the engine is built with, to try them in a
whole decode step before committing them to engine/kernels/configs/.

Prints the hardware fingerprint; writes `$OUT/bench_e2e.{json,txt}` when OUT is set.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Report, copy_ceiling, fingerprint  # noqa: E402

LLAMA3_8B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
# A dense model whose decode GEMMs have no decode config entry (they run the sm_90 wgmma rule): Qwen2.5-7B's shapes
# (qkv 4608x3584 with bias, o 3584x3584, gate+up 37888x3584, down 3584x18944, lm_head 152064x3584).
QWEN25_7B = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
             "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
             "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
             "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
# --model: (label, HF config (None: QWEN3_MOE), result file stem)
MODELS = {"llama3-8b": ("Llama-3-8B", LLAMA3_8B, "bench_e2e"),
          "qwen2.5-7b": ("Qwen2.5-7B", QWEN25_7B, "bench_e2e_qwen"),
          "qwen3-30b-a3b": ("Qwen3-30B-A3B", None, "bench_e2e_moe")}
QWEN3_MOE = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
             "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
             "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
             "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
             "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
             "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def random_weights(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 weights on the GPU for every tensor the config expects (std 1/sqrt(fan_in); norms ~1)."""
    from engine.weights import expected_shapes

    g = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        if len(shape) >= 2:
            out[name] = torch.randn(shape, device="cuda", generator=g) / shape[-1] ** 0.5
        else:
            out[name] = 1.0 + 0.1 * torch.randn(shape, device="cuda", generator=g)
    return out


def _tensor_bytes(engine, name: str, w) -> int:
    """Storage bytes of one prepared weight: a cuda-native `NativeWeight` (GEMM weights, the head, the embedding
    table) as stored; a plain tensor (emulated backends hold fp32 values) at its recipe format's width."""
    from engine.recipe import storage_bits

    if hasattr(w, "storage_bytes"):  # a cuda-native prepared weight
        return w.storage_bytes()
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        site = "embed" if name.startswith("model.") else "lm_head"
        return int(w.numel() * storage_bits(engine.recipe.spec(site, site)) / 8)
    return w.numel() * w.element_size()


def weight_bytes(engine) -> int:
    """Storage bytes of the engine's prepared GEMM weights + embeddings/head in their recipe format (the footprint)."""
    return sum(_tensor_bytes(engine, name, w) for name, w in engine.weights.items())


def step_weight_bytes(engine, cfg, batch: int) -> float:
    """Weight bytes one decode step of `batch` tokens must read (the roofline's numerator): every tensor, except
    that the embedding table contributes only the `batch` rows looked up, and each routed expert only with the
    probability that at least one of the batch's tokens picks it (1 - (1 - k/E)^batch, uniform routing: random
    weights route near-uniformly)."""
    moe = cfg.moe
    touched = 1.0 - (1.0 - moe.top_k / moe.num_experts) ** batch if moe is not None else 1.0
    total = 0.0
    for name, w in engine.weights.items():
        b = _tensor_bytes(engine, name, w)
        if name == "model.embed_tokens.weight":
            b = b * min(batch, cfg.vocab_size) / cfg.vocab_size
        elif ".mlp.experts." in name:
            b = b * touched
        total += b
    return total


def kv_bytes_per_token(cfg, recipe) -> float:
    """KV cache bytes per token (all layers) in the recipe's K/V storage formats."""
    from engine.recipe import storage_bits

    return cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (storage_bits(recipe.spec("kv.k")) +
                                                                storage_bits(recipe.spec("kv.v"))) / 8


def time_decode(step, prefill, steps: int) -> tuple[float, float]:
    """Seconds per decode step after one prefill (CUDA events): (median over `steps` steps each followed by a
    host synchronization -- the host's launch time of every step is on the clock --, mean over `steps` steps
    issued back to back -- a serving loop whose host enqueues the next step while the GPU runs this one)."""
    prefill()
    step()  # warm-up: first-call kernel compilation
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(steps):
        step()
    b.record()
    torch.cuda.synchronize()
    return statistics.median(times), a.elapsed_time(b) / 1e3 / steps


def profile_steps(step, label: str, n: int = 3) -> str:
    """Kernel-level profile of `n` decode steps: the top kernels by GPU time per step, the summed kernel time
    per step and the kernel count per step (what a step spends its time on; gaps = launch / host overhead)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        dev_us = getattr(ev, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(ev, "self_cuda_time_total", 0.0)
        if dev_us > 0:
            rows.append((dev_us / n, ev.count / n, ev.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    count = sum(r[1] for r in rows)
    lines = [f"profile {label}: {total / 1e3:.2f} ms of kernels per step over {count:.0f} kernel launches per step"]
    lines += [f"  {us / 1e3:8.3f} ms {us / max(total, 1e-9):6.1%} {c:7.1f}x  {k[:110]}" for us, c, k in rows[:25]]
    try:
        lines += critical_path(prof, n)
    except Exception as exc:  # noqa: BLE001 -- a diagnostic must not cost the timing row
        lines.append(f"critical path: unavailable ({type(exc).__name__}: {exc})")
    return "\n".join(lines)


def critical_path(prof, n: int) -> list[str]:
    """Wall time per step attributed to kernels: each kernel is charged from the latest end of the kernels
    before it to its own end (its launch gap plus the part of its run that nothing else overlapped). The
    charges sum to the GPU span of the steps; unlike summed kernel durations this stays meaningful when
    kernels overlap (programmatic dependent launch, where a kernel starts while its predecessor runs)."""
    from torch.autograd import DeviceType

    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    if not kernels:
        return []
    charge: dict[str, list[float]] = {}
    last = kernels[0].time_range.start
    for e in kernels:
        c = charge.setdefault(e.name, [0.0, 0])
        c[0] += max(0.0, e.time_range.end - last)
        c[1] += 1
        last = max(last, e.time_range.end)
    span = (last - kernels[0].time_range.start) / n
    top = sorted(charge.items(), key=lambda kv: -kv[1][0])[:12]
    out = [f"critical path {span / 1e3:.2f} ms per step (launch gaps charged to the kernel after them):"]
    out += [f"  {c[0] / n / 1e3:8.3f} ms {c[0] / n / max(span, 1e-9):6.1%} {c[1] / n:7.1f}x  {k[:110]}"
            for k, c in top]
    return out


def bench_engine(model, recipe: str, batch: int, prompt: int, steps: int, runtime: bool = False,
                 profile: bool = False, small_m: int | None = None, pdl: bool = True, policy=None) -> dict:
    """Decode timing of the engine's cuda-native path for one recipe and batch size.

    runtime=False: `Transformer.forward` over the contiguous KV cache, eager (one Python pass per step);
    runtime=True: `engine.runtime.PagedRuntime` (paged KV in the recipe's format, CUDA-graph decode).
    pdl=False: the engine's kernels launch without programmatic dependent launch (`KernelOptions(pdl=False)`,
    engine.kernels.pdl); rows tagged "-nopdl". policy: the engine's decode policy
    (engine.kernels.decode_plan.DecodePolicy; None: the default).
    """
    from engine.api import Engine
    from engine.kernels.options import KernelOptions
    from engine.model import KVCache

    pdl_tag = "" if pdl else "-nopdl"
    opts = dict({"small_m": small_m} if small_m is not None else {}, **({"decode_policy": policy} if policy else {}))
    eng = Engine(model, recipe, backend="cuda-native", options=KernelOptions(pdl=pdl), **opts)
    cfg = model.cfg
    toks = torch.randint(0, cfg.vocab_size, (batch, prompt), device="cuda")
    state, rt = {}, None
    if runtime:
        from engine.runtime import PagedRuntime
        from engine.serving import ServingConfig

        rt = PagedRuntime(eng, ServingConfig(kv_block_size=64, max_batch=batch, max_tokens=prompt + steps + 8,
                                             cuda_graphs=True))
        ids = torch.arange(batch, device="cuda")

        def prefill():
            for i in range(batch):
                rt.prefill(i, toks[i].tolist())
            state["start"] = torch.full((batch,), prompt, device="cuda")

        def step():
            rt._decode(toks[:, -1:], ids, state["start"])
    else:
        def prefill():
            # room for the warm-up, the synced and back-to-back timed steps and the profile's 1 + 3 steps
            state["cache"] = KVCache.empty(cfg, batch, prompt + 2 * steps + 8, torch.device("cuda"))
            model.forward(eng.nx, eng.weights, toks, state["cache"])

        def step():
            model.forward(eng.nx, eng.weights, toks[:, -1:], state["cache"])

    with torch.no_grad():
        t, t_pipe = time_decode(step, prefill, steps)
        mode = f"{'runtime' if runtime else 'native'}{pdl_tag}"
        prof_text = profile_steps(step, f"{mode}/{recipe} batch {batch}") if profile else None
    wb = weight_bytes(eng)
    kvb = kv_bytes_per_token(cfg, eng.recipe) * batch * (prompt + steps // 2)
    tag = "" if small_m is None else f"@m{small_m}"
    out = {"engine": f"{mode}{tag}/{recipe}", "batch": batch, "step_s": t, "step_pipelined_s": t_pipe,
           "tok_s": batch / t,
           "weight_bytes": wb, "kv_bytes": kvb, "memory_bytes": wb + kvb,
           "bytes_per_step": step_weight_bytes(eng, cfg, batch) + kvb,
           "coverage": {k: v for k, v in eng.nx.coverage_summary().items() if k.endswith("native_frac")},
           "profile": prof_text}
    eng = state = rt = None  # release the engine (and its runtime) before the next configuration
    gc.collect()
    torch.cuda.empty_cache()
    return out


def bench_transformers(hf_cfg: dict, batch: int, prompt: int, steps: int) -> dict:
    """Decode timing of transformers bf16 (eager attention, its dynamic KV cache), same shapes."""
    import transformers

    cfg = transformers.AutoConfig.for_model(**hf_cfg)
    cfg._attn_implementation = "eager"
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    toks = torch.randint(0, hf_cfg["vocab_size"], (batch, prompt), device="cuda")
    state = {}

    def prefill():
        out = model(toks, use_cache=True)
        state["pkv"] = out.past_key_values

    def step():
        out = model(toks[:, -1:], past_key_values=state["pkv"], use_cache=True)
        state["pkv"] = out.past_key_values

    with torch.no_grad():
        t, t_pipe = time_decode(step, prefill, steps)
    wb = sum(p.numel() * p.element_size() for p in model.parameters())
    e, k = hf_cfg.get("num_experts"), hf_cfg.get("num_experts_per_tok")
    touched = 1.0 - (1.0 - k / e) ** batch if e else 1.0
    step_wb = 0.0  # as step_weight_bytes: embedding rows looked up, routed experts by the chance they are picked
    for name, p in model.named_parameters():
        b = p.numel() * p.element_size()
        if "embed_tokens" in name:
            b = b * batch / hf_cfg["vocab_size"]
        elif ".experts." in name:
            b = b * touched
        step_wb += b
    kvb = hf_cfg["num_hidden_layers"] * hf_cfg["num_key_value_heads"] * (
        hf_cfg.get("head_dim") or hf_cfg["hidden_size"] // hf_cfg["num_attention_heads"]) * 2 * 2 * batch * (
        prompt + steps // 2)
    model = state = None  # release the model before the next batch
    gc.collect()
    torch.cuda.empty_cache()
    return {"engine": "transformers/bf16", "batch": batch, "step_s": t, "step_pipelined_s": t_pipe,
            "tok_s": batch / t,
            "weight_bytes": wb, "kv_bytes": kvb, "memory_bytes": wb + kvb, "bytes_per_step": step_wb + kvb}


def main() -> None:
    """Run the matrix and print achieved vs the measured roofline."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=None, help="override the layer count (default: the real model's)")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--recipes", default="bf16,fp8-block")
    ap.add_argument("--model", choices=sorted(MODELS), default="llama3-8b",
                    help="the model whose shapes (random weights) are timed")
    ap.add_argument("--moe", action="store_true", help="the Qwen3-30B-A3B-shaped MoE (= --model qwen3-30b-a3b)")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--runtime", action="store_true", help="also time the paged runtime with CUDA-graph decode")
    ap.add_argument("--runtime-only", action="store_true",
                    help="time only the paged runtime (implies --runtime; skips the much slower Engine.forward rows)")
    ap.add_argument("--profile", action="store_true", help="print each configuration's top kernels per decode step")
    ap.add_argument("--small-m", type=int, default=None,
                    help="cuda-native small_m (token count up to which GEMMs run the Triton decode kernel, above: "
                         "cuBLAS); rows are tagged @mN")
    ap.add_argument("--pdl", choices=("on", "off", "both"), default="on",
                    help="programmatic dependent launch of the Triton kernels (engine.kernels.pdl); 'both' also "
                         "times the paged runtime without it (rows tagged -nopdl)")
    ap.add_argument("--decode-configs", default=None,
                    help="a JSON list of decode entries ({device, n, k, bm, knobs}) added to the engine's decode "
                         "policy for this run (engine.kernels.decode_plan.load_decode_configs)")
    args = ap.parse_args()
    from engine.kernels import decode_plan as P

    added = P.load_decode_configs(args.decode_configs) if args.decode_configs else {}
    policy = P.DEFAULT_POLICY.with_configs(added) if added else None
    from engine.config import ModelConfig
    from engine.model import Transformer

    torch.backends.cuda.matmul.allow_tf32 = False
    if args.moe:
        args.model = "qwen3-30b-a3b"
    label, shape, out_name = MODELS[args.model]
    hf_cfg = dict(shape or QWEN3_MOE)
    if args.layers:
        hf_cfg["num_hidden_layers"] = args.layers
    cfg = ModelConfig.from_hf(hf_cfg, where="bench_e2e")
    rep = Report()
    say = rep.say
    fp = fingerprint()
    say(f"hardware: {json.dumps(fp)}")
    bw = copy_ceiling()["tbs"] * 1e12  # bytes/s
    say(f"HBM copy ceiling (1 GiB clone, read + write, measured now): {bw / 1e12:.2f} TB/s")
    for key, knobs in added.items():
        say(f"decode entry added from {args.decode_configs}: {key} -> {knobs}")
    say(f"model: {label}-shaped, {cfg.num_layers} layers, random weights")
    t0 = time.time()
    model = Transformer(cfg, random_weights(cfg))
    say(f"built fp32 master weights on the GPU in {time.time() - t0:.1f}s")
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for recipe in args.recipes.split(","):
            modes = [] if args.runtime_only else [(False, args.pdl != "off")]
            if args.runtime or args.runtime_only:
                modes += [(True, True), (True, False)] if args.pdl == "both" else [(True, args.pdl == "on")]
            for runtime, pdl in modes:
                try:
                    rows.append(bench_engine(model, recipe, batch, args.prompt, args.steps, runtime, args.profile,
                                             args.small_m, pdl, policy))
                    if rows[-1]["profile"]:
                        say(rows[-1]["profile"])
                except Exception as exc:  # one failing configuration must not hide the others
                    say(f"{'runtime' if runtime else 'native'}/{recipe} batch {batch}: FAILED "
                        f"{type(exc).__name__}: {exc}")
    del model
    gc.collect()
    torch.cuda.empty_cache()
    if not args.no_transformers:
        for batch in [int(b) for b in args.batches.split(",")]:
            try:
                rows.append(bench_transformers(hf_cfg, batch, args.prompt, args.steps))
            except Exception as exc:
                say(f"transformers batch {batch}: FAILED {type(exc).__name__}: {exc}")
    say("ms/step: each step host-synchronized (its launch time counted); pipe: steps issued back to back")
    say(f"{'engine':22s} {'batch':>5s} {'ms/step':>9s} {'tok/s':>9s} {'GB/step':>8s} {'roofline':>8s} "
        f"{'pipe ms':>8s} {'pipe roof':>9s}  notes")
    by = {(r['engine'], r['batch']): r for r in rows}
    for r in rows:
        r["roofline_frac"] = r["bytes_per_step"] / r["step_s"] / bw
        r["roofline_pipelined_frac"] = r["bytes_per_step"] / r["step_pipelined_s"] / bw
        note = ""
        mode = r["engine"].split("/")[0]
        bf = by.get((f"{mode}/bf16", r["batch"])) if mode != "transformers" else None
        if not r["engine"].endswith("/bf16") and bf:
            note = f"{bf['step_s'] / r['step_s']:.2f}x vs {mode} bf16; weights+KV memory {r['memory_bytes'] / bf['memory_bytes']:.2f}x"
        if "coverage" in r:
            note += f" native {r['coverage']}"
        say(f"{r['engine']:22s} {r['batch']:5d} {r['step_s'] * 1e3:9.2f} {r['tok_s']:9.1f} "
            f"{r['bytes_per_step'] / 1e9:8.2f} {r['roofline_frac']:8.1%} {r['step_pipelined_s'] * 1e3:8.2f} "
            f"{r['roofline_pipelined_frac']:9.1%}  {note}")
    rep.write(out_name, {"hardware": fp, "copy_bw": bw, "rows": rows})


if __name__ == "__main__":
    main()
