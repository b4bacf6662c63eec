"""Tensor and expert parallelism of the engine on a real MoE shape: TP=2, EP=2 and both against TP=1.

    torchrun --nproc-per-node 2 benchmarks/bench_parallel.py [--model qwen3-30b-a3b] [--layers 8]
        [--recipe fp8-block] [--backend cuda-native] [--batch 8] [--prompt 128] [--steps 32] [--work DIR]

1. Checkpoint: rank 0 writes a random-weight HF checkpoint of the shape (`bench_harness.build_checkpoint`:
   transformers' own init in bf16, `save_pretrained`); every rank loads it.
2. Per layout (tp, ep) of (1, 2), (2, 1), (2, 2), each against TP=1 (the same recipe and backend on one device, the
   ceiling of the comparison, measured in the same run):
   * logits of `windows` x `seq_len` random tokens: KLD mean / max (float64), top-1 agreement, bitwise equality;
   * greedy decoding of `batch` requests (`prompt` random tokens, `steps` new ones) through the serving runtime
     (`Engine.generate_batch`: paged KV of each rank's heads): token agreement with TP=1, the decode step's wall
     time ((time of `steps` new tokens - time of 1) / (steps - 1), so prefill is left out) next to TP=1's, and the
     bytes each rank sent per decode step in the expert-parallel exchange (`ParallelContext.wire_bytes`).
3. Rank 0 prints the table and writes bench_parallel.{txt,json} under $OUT (or --out), with the fingerprint.

On CPU (`--device cpu`: gloo, the emulation) with `--model tiny-moe` it checks itself in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_e2e import QWEN3_MOE  # noqa: E402
from benchmarks.bench_harness import build_checkpoint  # noqa: E402
from benchmarks.common import fingerprint  # noqa: E402
from evalharness.evals.tokenstats import kl_from_logprobs  # noqa: E402

# A small Qwen3-MoE shape for the CPU self-check.
TINY_MOE = {**QWEN3_MOE, "vocab_size": 4096, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8,
            "num_experts_per_tok": 2, "max_position_embeddings": 1024}
MODELS = {"qwen3-30b-a3b": QWEN3_MOE, "tiny-moe": TINY_MOE}
LAYOUTS = ((1, 2), (2, 1), (2, 2))


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Logits a (TP=1) vs b (batch, t, vocab) on their device: KLD(a || b) mean / max, top-1 agreement, bitwise."""
    la, lb = torch.log_softmax(a.double(), -1), torch.log_softmax(b.double(), -1)
    kld = kl_from_logprobs(la, lb)
    return {"kld_mean": float(kld.mean()), "kld_max": float(kld.max()),
            "top1": float((a.argmax(-1) == b.argmax(-1)).double().mean()), "bitwise": bool(torch.equal(a, b))}


def decode(engine, requests, batch: int, cuda: bool) -> tuple[list[list[int]], float, float]:
    """(tokens of `requests`, seconds per decode step, expert-parallel bytes this rank sent per decode step):
    `generate_batch` with every request's budget, then with one new token, the difference over the extra steps."""
    from engine.generation import GenerationRequest
    from engine.serving import ServingConfig

    serving = ServingConfig(max_batch=batch, cuda_graphs=cuda and engine.parallel.size == 1)
    ctx = engine.nx.parallel

    def timed(reqs):
        if ctx is not None:
            ctx.wire_bytes = 0
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = engine.generate_batch(reqs, serving)
        if cuda:
            torch.cuda.synchronize()
        return out, time.perf_counter() - t0, ctx.wire_bytes if ctx is not None else 0

    timed(requests)  # warm-up: compilation, graph capture, the runtime's pages
    gens, t_all, b_all = timed(requests)
    _, t_one, b_one = timed([GenerationRequest(r.prompt, 1) for r in requests])
    steps = requests[0].max_new_tokens - 1
    return [g.tokens for g in gens], (t_all - t_one) / steps, (b_all - b_one) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the checkpoint")
    ap.add_argument("--recipe", default="fp8-block")
    ap.add_argument("--backend", default=None, help="default: cuda-native on cuda, cpu-emulated on cpu")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--work", default="/tmp/bench_parallel", help="scratch folder (the checkpoint)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="where bench_parallel.{txt,json} go")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the decode step is timed over the steps after the first)")

    from engine.api import Engine
    from engine.generation import GenerationRequest
    from engine.loading import load_model
    from engine.model import Transformer
    from engine.parallel import ParallelConfig

    cuda = args.device == "cuda"
    backend = args.backend or ("cuda-native" if cuda else "cpu-emulated")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit(f"bench_parallel runs on 2 ranks (torchrun --nproc-per-node 2), got {world}")
    ckpt = Path(args.work) / f"{args.model}-{args.layers}l"
    built_s = 0.0
    if rank == 0 and not (ckpt / "config.json").exists():
        built_s = build_checkpoint(MODELS[args.model], args.layers, ckpt, args.device)
    dist.barrier()
    loaded = load_model(str(ckpt))
    model = Transformer(loaded.cfg, loaded.weights)
    g = torch.Generator().manual_seed(0)
    vocab = loaded.cfg.vocab_size
    tokens = torch.randint(3, vocab, (args.windows, args.seq_len), generator=g)
    prompts = torch.randint(3, vocab, (args.batch, args.prompt), generator=g)
    requests = [GenerationRequest(tuple(p.tolist()), args.steps) for p in prompts]

    base = Engine(model, args.recipe, backend=backend)
    ref_logits = base.logits(tokens)
    ref_tokens, ref_step_s, _ = decode(base, requests, args.batch, cuda)
    del base
    rows = []
    for tp, ep in LAYOUTS:
        eng = Engine(model, args.recipe, backend=backend, parallel=ParallelConfig(tp=tp, ep=ep))
        row = {"tp": tp, "ep": ep, **compare(ref_logits, eng.logits(tokens))}
        got, step_s, wire = decode(eng, requests, args.batch, cuda)
        row.update(token_agreement=sum(a == b for x, y in zip(got, ref_tokens) for a, b in zip(x, y))
                   / sum(map(len, ref_tokens)), step_ms=step_s * 1e3, tp1_step_ms=ref_step_s * 1e3,
                   ep_bytes_per_step_rank=wire, kv_heads_per_rank=eng._runtime.kv.kv_heads)
        rows.append(row)
        del eng
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        title = (f"{args.model}, {args.layers} layers, {args.recipe} on {backend}, 2 ranks; logits {args.windows} x "
                 f"{args.seq_len} tokens; decode {args.batch} requests x {args.steps} new tokens after {args.prompt}")
        lines = [title, f"{'tp':>3} {'ep':>3} {'KLD mean':>10} {'KLD max':>10} {'top-1':>7} {'bitwise':>8} "
                        f"{'tokens =':>9} {'step ms':>8} {'TP=1 ms':>8} {'EP B/step/rank':>15} {'KV heads':>9}"]
        for r in rows:
            lines.append(f"{r['tp']:>3} {r['ep']:>3} {r['kld_mean']:>10.3g} {r['kld_max']:>10.3g} {r['top1']:>7.4f} "
                         f"{str(r['bitwise']):>8} {r['token_agreement']:>9.3f} {r['step_ms']:>8.2f} "
                         f"{r['tp1_step_ms']:>8.2f} {r['ep_bytes_per_step_rank']:>15.0f} {r['kv_heads_per_rank']:>9}")
        fp = fingerprint(args.device)
        lines.append(f"fingerprint: {json.dumps(fp)}")
        print("\n".join(lines))
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "bench_parallel.txt").write_text("\n".join(lines) + "\n")
            (out / "bench_parallel.json").write_text(json.dumps(
                {"args": vars(args), "backend": backend, "checkpoint_s": built_s, "fingerprint": fp, "rows": rows},
                indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
