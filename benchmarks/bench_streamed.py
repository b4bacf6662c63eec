"""Layer-streamed evaluation of a large MoE shape on one device: layer_error + ppl_kld, fp8-block vs FP32.

Writes a random-weight checkpoint of Qwen3-30B-A3B's shape (hidden 2048, 128 experts top-8, GQA 32/4 heads; as many
of its 48 layers as the disk holds in bf16, `--layers` to choose) with transformers' config class and parameter
names, one safetensors shard per layer, the weights drawn on the device one layer at a time (never all in memory).
Then runs the harness's streamed path (`engine.streaming`, `evalharness.streamed`) on it and reports wall time per
eval, peak device memory (against the model's FP32 size), checkpoint bytes streamed, and the projected time of a
DeepSeek-V3-sized model (671B parameters, 61 layers) from the measured seconds per streamed parameter.

    # needs: gpu
    python3 benchmarks/bench_streamed.py --device cuda --out /tmp/streamed --json benchmarks/results/streamed-h200.json
    python3 benchmarks/bench_streamed.py --device cpu --tiny --out /tmp/streamed-tiny   # self-check, seconds

The projection assumes a pass's time scales with the parameters streamed (read, upcast, quantized and run per
layer); activations and attention grow with the windows, not the model, so it is a stated estimate, not a
measurement.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fingerprint  # noqa: E402

QWEN3_30B_A3B = dict(hidden_size=2048, num_hidden_layers=48, num_experts=128, num_experts_per_tok=8,
                     moe_intermediate_size=768, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6, norm_topk_prob=True,
                     tie_word_embeddings=False)
TINY = dict(QWEN3_30B_A3B, hidden_size=64, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=512, max_position_embeddings=512)
DSV3_PARAMS, DSV3_LAYERS = 671e9, 61


def write_checkpoint(out: Path, shape: dict, layers: int, device: str, seed: int = 0) -> dict:
    """A random bf16 checkpoint of `shape` with `layers` layers in `out` (config.json via transformers, one shard per
    stage, an index); weights N(0, 0.02) drawn on `device` one shard at a time. Returns sizes."""
    import transformers
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = transformers.Qwen3MoeConfig(**dict(shape, num_hidden_layers=layers))
    config.save_pretrained(out)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    groups: dict[str, dict[str, tuple]] = {}
    for name, t in model.state_dict().items():
        key = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        groups.setdefault(key, {})[name] = tuple(t.shape)
    g = torch.Generator(device=device).manual_seed(seed)
    index, total = {}, 0
    for key, shapes in groups.items():
        tensors = {}
        for name, shp in shapes.items():
            if "norm" in name:
                t = torch.ones(shp, device=device, dtype=torch.bfloat16)
            else:
                t = (torch.randn(shp, device=device, generator=g) * 0.02).to(torch.bfloat16)
            tensors[name] = t.cpu()
            total += t.numel()
        fname = f"model-{key}.safetensors"
        save_file(tensors, str(out / fname))
        index.update({n: fname for n in tensors})
        del tensors
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return {"params": total, "bf16_bytes": 2 * total}


def layers_for_disk(out: Path, shape: dict, want: int) -> int:
    """How many layers fit on the disk of `out` in bf16 (80% of the free space, after the embedding and head)."""
    d, e, inter = shape["hidden_size"], shape["num_experts"], shape["moe_intermediate_size"]
    h, kv, hd = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    layer = 2 * (3 * e * d * inter + 2 * d * h * hd + 2 * d * kv * hd + e * d)
    rest = 2 * 2 * shape["vocab_size"] * d
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free * 0.8 - rest
    return max(1, min(want, int(free // layer)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="a tiny shape of the same architecture (CPU self-check)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: 48, as many as the disk holds)")
    ap.add_argument("--out", default="/tmp/bench_streamed", help="folder for the checkpoint (deleted unless --keep)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--backend", default=None, help="engine backend (default: cuda-native on cuda, cpu-emulated)")
    ap.add_argument("--json", default=None, help="write the figures to this JSON file")
    args = ap.parse_args()

    from engine.streaming import LayerStore, StreamedEngine
    from evalharness.evals import EvalContext, run_eval
    from evalharness.streamed_reference import StreamedReference

    shape = TINY if args.tiny else QWEN3_30B_A3B
    out = Path(args.out)
    layers = args.layers or layers_for_disk(out, shape, shape["num_hidden_layers"])
    t0 = time.perf_counter()
    sizes = write_checkpoint(out, shape, layers, args.device)
    write_s = time.perf_counter() - t0
    backend = args.backend or ("cuda-native" if args.device == "cuda" else "cpu-emulated")
    g = torch.Generator().manual_seed(1)
    corpus = out / "tokens.json"
    n_tok = (args.windows + 1) * args.seq_len * 2
    corpus.write_text(json.dumps({"vocab_size": shape["vocab_size"],
                                  "tokens": torch.randint(0, shape["vocab_size"], (n_tok,), generator=g).tolist()}))
    store = LayerStore.open(str(out))
    engine = StreamedEngine(store, "fp8-block", backend=backend)
    reference = StreamedReference(store, device=args.device)
    ctx = EvalContext(engine=engine, reference=reference, tokenizer=None, corpus=str(corpus),
                      vocab_size=shape["vocab_size"], batch_size=args.batch_size, seed=0, cache={}, model_sha="bench")
    cuda = args.device == "cuda"
    fig: dict = {"shape": "tiny" if args.tiny else "Qwen3-30B-A3B", "layers": layers, "params": sizes["params"],
                 "fp32_bytes": 4 * sizes["params"], "checkpoint_bf16_bytes": sizes["bf16_bytes"],
                 "write_s": round(write_s, 1), "backend": backend, "windows": args.windows, "seq_len": args.seq_len,
                 "batch_size": args.batch_size, "hardware": fingerprint(args.device), "date": time.strftime("%Y-%m-%d")}
    evals = {"layer_error": {"windows": args.windows, "seq_len": args.seq_len, "layer_local": True},
             "ppl_kld": {"seq_len": args.seq_len, "max_windows": args.windows}}
    for name, cfg in evals.items():
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        read0 = store.bytes_read
        t = time.perf_counter()
        metrics, _ = run_eval(name, ctx, cfg)
        if cuda:
            torch.cuda.synchronize()
        secs = time.perf_counter() - t
        streamed = store.bytes_read - read0
        passes = streamed / max(sizes["bf16_bytes"], 1)
        fig[name] = {"s": round(secs, 2), "bytes_streamed": streamed, "passes": round(passes, 2),
                     "streamed_GBps": round(streamed / secs / 1e9, 3),
                     "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None,
                     "s_per_1e9_params_per_pass": round(secs / max(passes, 1e-9) / (sizes["params"] / 1e9), 3),
                     "metrics": {k: metrics[k] for k in ("max_rel_l2", "kld_mean", "ppl_ratio", "top1_agree")
                                 if k in metrics}}
        fig[name]["projected_dsv3_s"] = round(fig[name]["s_per_1e9_params_per_pass"] * passes * DSV3_PARAMS / 1e9, 1)
        peak = fig[name]["peak_device_bytes"]
        print(f"{name}: {secs:.1f} s, {streamed / 1e9:.2f} GB streamed ({passes:.2f} passes, "
              f"{fig[name]['streamed_GBps']} GB/s), peak device memory "
              f"{'n/a' if peak is None else f'{peak / 2**30:.2f} GiB'} (model fp32: {4 * sizes['params'] / 2**30:.2f} "
              f"GiB); projected DeepSeek-V3 (671B): {fig[name]['projected_dsv3_s'] / 3600:.2f} h")
    print(json.dumps(fig, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1) + "\n")
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
