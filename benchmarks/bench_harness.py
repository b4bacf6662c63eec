"""Evaluations at the scale of a real model: every evaluation of `evalharness run`, timed next to its floor.

    python benchmarks/bench_harness.py [--model llama3-8b|qwen3-30b-a3b] [--layers N] [--data-dir DIR]
                                       [--suite suites/nightly.yaml] [--recipes fp8-block,bf16] [--work DIR]

1. Checkpoint: a random-weight HF checkpoint of the model's shape, built by transformers on the GPU in bf16 and written
   with `save_pretrained` (config.json + safetensors shards), as a user's checkpoint is, with zoo-llama's BPE
   tokenizer beside it (4096 pieces trained on SimpleBooks: English-like tokens per word).
2. Floors, measured on that checkpoint in this process: one forward token (engine per recipe, FP32 reference; at
   8 windows x 512 tokens), one decode step of the engine's serving runtime (CUDA graphs, paged KV) and of the
   reference (transformers with its KV cache) at batch 1 and at the suite's batch; and the evaluations' batched
   generation (`evalharness.generation.generate_many`, 512-token prompts, 128 new tokens each) at those batches,
   its new tokens/s against the runtime's own (batch / decode step). `--units-only` stops here.
3. Runs: the suite's evaluations (default: suites/nightly.yaml's, every setting as written) through
   `evalharness.runner.run_suite`, the code path of `evalharness run`, on cuda-native: each recipe x the suite's
   serving configs, the reference computed once and cached. Each result records per evaluation its wall time, the
   part spent on reference passes (`timing['<eval>.reference_s']`) and the work each side did (`counters`: tokens
   through forward passes, prompt tokens prefilled, decode steps and the rows they carried).
4. Table: per run and evaluation, the engine side's time, its floor (its counted work x the unit times of step 2:
   the bare passes it needs, none of the metric code, data preparation or lm-eval) and time / floor; the reference
   side (paid once per model) likewise; tokens/s; peak GPU memory (both models resident); and the projected time
   of the suite's whole matrix for this model (the reference once, then every recipe x serving config, each recipe
   taking the measured time of the closest measured run: same serving config, fp8-block for FP8 recipes, bf16 for
   the others).

Writes bench_harness.{json,txt} under $OUT (or --out); prints the hardware fingerprint.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_e2e import LLAMA3_8B, QWEN3_MOE  # noqa: E402
from benchmarks.common import fingerprint, wall_s  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# A small Llama shape to check the benchmark itself (`--model tiny --device cpu --suite suites/evals.yaml`).
TINY = {**LLAMA3_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 4096, "max_position_embeddings": 1024}
MODELS = {"llama3-8b": ("Llama-3-8B", LLAMA3_8B), "qwen3-30b-a3b": ("Qwen3-30B-A3B", QWEN3_MOE),
          "tiny": ("Tiny-Llama", TINY)}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
EVAL_ORDER = ("layer_error", "ppl_kld", "tasks", "longctx")
GEN_NEW_TOKENS = 128  # new tokens per request of the generation-throughput measurement (512-token prompts)


def build_checkpoint(shape: dict, layers: int, path: Path, device: str, seed: int = 0) -> float:
    """Write a random-weight checkpoint (transformers' own init, bf16) of `shape` with `layers` layers; seconds."""
    import transformers

    t0 = time.perf_counter()
    cfg = transformers.AutoConfig.for_model(**{**shape, "num_hidden_layers": layers, "bos_token_id": 0,
                                                "eos_token_id": 1, "pad_token_id": 2})
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path, max_shard_size="4GB")
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    for name in TOKENIZER_FILES:
        shutil.copy(REPO / "zoo" / "zoo-llama" / name, path / name)
    return time.perf_counter() - t0


def unit_costs(loaded, recipes: list[str], batches: list[int], device: str) -> dict:
    """Seconds per forward token and per decode step (by batch) of each recipe's engine and of the reference."""
    from engine.api import Engine
    from engine.model import Transformer
    from engine.runtime import PagedRuntime
    from evalharness.reference import ReferenceLM

    vocab = loaded.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4096, (8, 512), generator=g)
    prompts = [torch.randint(0, 4096, (512,), generator=g).tolist() for _ in range(max(batches))]
    out: dict = {"vocab": vocab, "forward_tokens": x.numel(), "engine": {}}
    ref = ReferenceLM(loaded, device=device)
    out["reference"] = {"forward_s_per_token": wall_s(lambda r=ref: r.logits(x)) / x.numel(),
                        "decode_s": {b: ref_decode_step(ref, prompts[:b]) for b in batches}}
    model = Transformer(loaded.cfg, loaded.weights).to(device)
    cuda = device == "cuda"
    for recipe in recipes:
        eng = Engine(model, recipe, backend="cuda-native" if cuda else "cpu-emulated")
        fwd = wall_s(lambda e=eng: e.logits(x)) / x.numel()
        dec = {}
        for b in batches:
            rt = PagedRuntime(eng, dataclasses.replace(suite_serving(b, cuda), max_tokens=1024))
            for slot in range(b):
                rt.prefill(slot, prompts[slot])
            ids = torch.arange(b, device=device)
            start = torch.full((b,), 512, dtype=torch.long, device=device)
            tok = torch.ones((b, 1), dtype=torch.long, device=device)
            dec[b] = wall_s(lambda r=rt: [r._decode(tok, ids, start) for _ in range(32)]) / 32
            del rt
        gen = {b: generation_throughput(eng, prompts[:b], GEN_NEW_TOKENS, fwd, dec[b], cuda) for b in batches}
        out["engine"][recipe] = {"forward_s_per_token": fwd, "decode_s": dec, "generation": gen}
        del eng
        gc.collect()
    out["peak_gib_units"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    del ref, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def suite_serving(batch: int, cuda: bool):
    """How a suite's run serves at `batch` (`evalharness.runner.serving_config` of an entry that sets only its batch
    size: 64-token pages, CUDA graphs on CUDA)."""
    from evalharness.runner import serving_config

    return serving_config({"batch_size": batch}, cuda)


def generation_throughput(eng, prompts: list[list[int]], new_tokens: int, forward_s_per_token: float,
                          decode_s: float, cuda: bool) -> dict:
    """The evaluations' batched generation against the serving runtime's own decode steps, at one batch: every prompt
    submitted at once through `evalharness.generation.generate_many` (what longctx and lm-eval's generate_until call,
    with per-step statistics as longctx asks), served with the suite's paging and CUDA graphs; new tokens per second
    against the runtime's batch / decode step. `ratio` counts the prompts' prefill in the generation's time;
    `ratio_decode` takes out the prefill's floor (prompt tokens x the forward time per token)."""
    from engine.generation import GenerationRequest
    from evalharness.generation import generate_many

    b = len(prompts)
    eng.serving = suite_serving(b, cuda)
    reqs = [GenerationRequest(tuple(p), new_tokens) for p in prompts]
    made: list[int] = []

    def run():
        made[:] = [len(g.tokens) for g in generate_many(eng, reqs, b, step_stats=True)]

    secs = wall_s(run, reps=2)
    tokens = sum(made)
    prefill_floor = sum(len(p) for p in prompts) * forward_s_per_token
    tps, runtime_tps = tokens / secs, b / decode_s
    decode_secs = secs - prefill_floor
    return {"batch": b, "new_tokens": tokens, "s": secs, "prefill_floor_s": prefill_floor, "tokens_per_s": tps,
            "runtime_tokens_per_s": runtime_tps, "ratio": tps / runtime_tps,
            "ratio_decode": tokens / decode_secs / runtime_tps if decode_secs > 0 else None}


@torch.no_grad()
def ref_decode_step(ref, prompts: list[list[int]]) -> float:
    """Seconds of one transformers decode step (KV cache) at batch len(prompts) after a 512-token prefill."""
    from transformers import DynamicCache

    ids = torch.tensor(prompts, device=ref.device)
    cache = DynamicCache()
    ref.model(input_ids=ids, logits_to_keep=1, **ref._cache_kwargs(cache))
    nxt = torch.ones((len(prompts), 1), dtype=torch.long, device=ref.device)

    def steps():
        for _ in range(8):
            ref.model(input_ids=nxt, **ref._cache_kwargs(cache))

    return wall_s(steps, reps=2) / 8


def floor_seconds(work: dict[str, int], unit: dict) -> float:
    """The bare passes of counted work: forward + prefill tokens x the per-token time, decode steps at the batch
    they carried (linear between the measured batch sizes; steps x step time at batch 1 plus the extra rows)."""
    dec = {int(b): s for b, s in unit["decode_s"].items()}
    b_lo, b_hi = min(dec), max(dec)
    slope = (dec[b_hi] - dec[b_lo]) / (b_hi - b_lo) if b_hi > b_lo else 0.0
    steps, rows = work.get("decode_steps", 0), work.get("decode_rows", 0)
    tokens = work.get("forward_tokens", 0) + work.get("prefill_tokens", 0)
    return tokens * unit["forward_s_per_token"] + steps * dec[b_lo] + max(0, rows - steps * b_lo) * slope


def eval_work(doc: dict, name: str, side: str) -> dict[str, int]:
    """The counted work of one eval of a result, for one side (engine / reference)."""
    prefix = f"{name}.{side}."
    return {k[len(prefix):]: v for k, v in doc.get("counters", {}).items() if k.startswith(prefix)}


def write_suite(path: Path, base: dict, ckpt: Path, label: str, recipes: list[str], backend: str,
                serving: list[str] | None) -> None:
    """The benchmark's suite: the base suite's evals, serving (those named in `serving`; all when None) and gate,
    on the checkpoint. An eval that runs under named serving configs only (`serving`) keeps those of the chosen
    ones, and is left out when none is chosen."""
    configs = [c for c in base["serving"] if serving is None or c["name"] in serving]
    names = {c["name"] for c in configs}
    evals = {}
    for k, v in base["evals"].items():
        v = dict(v or {})
        if v.get("serving") is not None:
            v["serving"] = [n for n in v["serving"] if n in names]
            if not v["serving"]:
                continue
        evals[k] = v
    suite = {"name": "bench-harness", "description": f"{label} random weights: the evaluations of "
             f"{base['name']} timed", "backend": backend, "seed": 0,
             "models": [{"name": label.lower(), "path": str(ckpt),
                         "corpus": "${data_dir}/text/wikitext2/wiki.test.raw"}],
             "recipes": recipes, "serving": configs, "evals": evals, "gate": base["gate"]}
    path.write_text(yaml.safe_dump(suite, sort_keys=False))


def table(docs: list[dict], units: dict, base: dict) -> tuple[list[str], dict]:
    """The report lines and the summary: per run and eval its time and floor (engine work, plus the reference work
    done in that run: cached reference passes in the first run only, layer_error's in every run) and their
    ratio; the reference passes; the projected matrix."""
    lines, rows = [], []
    lines.append(f"{'run':44s} {'eval':12s} {'time_s':>8s} {'floor_s':>8s} {'x floor':>8s} {'of which':>9s} "
                 f"{'ref floor':>9s} {'eng tok/s':>10s}")
    lines.append(f"{'':44s} {'':12s} {'':>8s} {'':>8s} {'':>8s} {'cached ref':>9s}")
    ref_total = ref_floor_total = 0.0
    run_times: dict[str, float] = {}
    fmt = lambda v, w=8: f"{v:{w}.2f}" if v is not None else f"{'-':>{w}s}"  # noqa: E731
    for doc in docs:
        if doc["status"] != "ok":
            lines.append(f"{doc['run_key']:44s} ERROR {doc['error']['message'][:200]}")
            continue
        unit = units["engine"][doc["spec"]["recipe"]["name"]]
        run_total = 0.0
        for name in EVAL_ORDER:
            if f"{name}_s" not in doc["timing"]:
                continue
            total = doc["timing"][f"{name}_s"]
            ref_s = doc["timing"].get(f"{name}.reference_s", 0.0)  # cached reference passes (first run only)
            work, rw = eval_work(doc, name, "engine"), eval_work(doc, name, "reference")
            eng_floor, ref_floor = floor_seconds(work, unit), floor_seconds(rw, units["reference"])
            floor = eng_floor + ref_floor
            tokens = sum(work.get(k, 0) for k in ("forward_tokens", "prefill_tokens", "decode_rows"))
            row = {"run": doc["run_key"], "eval": name, "time_s": total, "floor_s": floor,
                   "ratio": total / floor if floor else None, "cached_reference_s": ref_s,
                   "engine_floor_s": eng_floor, "reference_floor_s": ref_floor, "engine_tokens": tokens,
                   "engine_tokens_per_s": tokens / (total - ref_s) if total > ref_s else None,
                   "engine_work": work, "reference_work": rw}
            rows.append(row)
            ref_total += ref_s
            if ref_s > 0:
                ref_floor_total += ref_floor
            run_total += total - ref_s
            lines.append(f"{doc['run_key']:44s} {name:12s} {total:8.2f} {floor:8.2f} {fmt(row['ratio'])} "
                         f"{ref_s:9.2f} {ref_floor:9.2f} {fmt(row['engine_tokens_per_s'], 10)}")
        run_times[doc["run_key"]] = run_total
    # Projection: the reference once, every recipe x serving config of the base suite at a measured run's time.
    by_serving: dict[str, dict[str, float]] = {}
    for doc in docs:
        if doc["status"] == "ok":
            by_serving.setdefault(doc["spec"]["serving"]["name"], {})[doc["spec"]["recipe"]["name"]] = \
                run_times[doc["run_key"]]
    projected, detail = ref_total, []
    for s in base["serving"]:
        measured = by_serving.get(s["name"], {})
        for r in base["recipes"]:
            low = "fp8" in r or "fp4" in r
            proxy = r if r in measured else ("fp8-block" if low and "fp8-block" in measured
                                             else "bf16" if "bf16" in measured else next(iter(measured), None))
            if proxy is None:
                continue
            projected += measured[proxy]
            detail.append(f"{r}@{s['name']}={measured[proxy]:.0f}s" + ("" if proxy == r else f" (as {proxy})"))
    lines.append("")
    lines.append(f"cached reference passes: {ref_total:.1f} s (floor {ref_floor_total:.1f} s), once per model")
    lines.append(f"projected {base['name']} matrix for this model ({len(detail)} runs): {projected / 60:.1f} min = "
                 f"reference {ref_total:.0f} s + " + ", ".join(detail))
    return lines, {"rows": rows, "reference_s": ref_total, "reference_floor_s": ref_floor_total,
                   "run_engine_s": run_times, "projected_s": projected, "projection": detail}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's all)")
    ap.add_argument("--suite", default=str(REPO / "suites" / "nightly.yaml"), help="whose evals and serving to time")
    ap.add_argument("--recipes", default="fp8-block,bf16", help="recipes to run (comma separated)")
    ap.add_argument("--serving", default=None, help="serving configs of the suite to run (comma separated names; "
                    "default all)")
    ap.add_argument("--data-dir", default=os.environ.get("EVALHARNESS_DATA_DIR"), help="the shared data folder")
    ap.add_argument("--work", default="/tmp/bench_harness", help="scratch folder (checkpoint, results)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="where bench_harness.{json,txt} go")
    ap.add_argument("--units-only", action="store_true",
                    help="the floors and the generation throughput only (no suite runs): bench_harness*_units.*")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: the emulation, to check this script itself (with --model tiny and a small --suite)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_harness: needs a CUDA GPU (or --device cpu --model tiny to check the script)")
    if not args.data_dir:
        sys.exit("bench_harness: needs the shared data (--data-dir or $EVALHARNESS_DATA_DIR)")
    from evalharness.runner import run_suite
    from evalharness.suite import load_suite

    label, shape = MODELS[args.model]
    stem = "bench_harness" if args.model == "llama3-8b" else f"bench_harness_{args.model}"
    layers = args.layers or shape["num_hidden_layers"]
    recipes = [r for r in args.recipes.split(",") if r]
    base = yaml.safe_load(Path(args.suite).read_text())
    batches = sorted({1} | {int(s["batch_size"]) for s in base["serving"]})
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    ckpt = work / "checkpoint"
    backend = "cuda-native" if args.device == "cuda" else "cpu-emulated"
    out_lines = [f"bench_harness: {label} ({layers} layers), random weights, {backend}; evals of {args.suite}",
                 json.dumps(fingerprint(args.device))]
    print("\n".join(out_lines), flush=True)
    build_s = build_checkpoint(shape, layers, ckpt, args.device)
    ckpt_gib = sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) / 2**30
    out_lines.append(f"checkpoint: {ckpt_gib:.1f} GiB bf16 safetensors written in {build_s:.0f} s")
    print(out_lines[-1], flush=True)
    import evalharness.runner as runner
    from engine.loading import load_model

    t0 = time.perf_counter()
    loaded = load_model(str(ckpt))
    loaded.to(args.device)
    load_s = time.perf_counter() - t0
    units = unit_costs(loaded, recipes, batches, args.device)
    # The suite below takes this loaded checkpoint instead of reading it again (its load time is the one above).
    runner.load_model = lambda source: loaded if Path(source) == ckpt else load_model(source)
    out_lines.append(f"load: {load_s:.0f} s (safetensors -> fp32 on the {args.device}); unit times: "
                     + json.dumps({"reference": units["reference"], "engine": units["engine"]}))
    print(out_lines[-1], flush=True)
    for recipe, unit in units["engine"].items():
        for b, g in unit["generation"].items():
            out_lines.append(
                f"generation {recipe} batch {b}: {g['new_tokens']} new tokens in {g['s']:.2f} s = "
                f"{g['tokens_per_s']:.0f} tok/s vs the runtime's {g['runtime_tokens_per_s']:.0f} tok/s: "
                f"{g['ratio']:.2f}x with the prompts' prefill, "
                + (f"{g['ratio_decode']:.2f}x without its floor ({g['prefill_floor_s']:.2f} s)"
                   if g["ratio_decode"] is not None else "the prefill floor exceeds the time"))
            print(out_lines[-1], flush=True)
    if args.units_only:
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / f"{stem}_units.txt").write_text("\n".join(out_lines) + "\n")
            (Path(args.out) / f"{stem}_units.json").write_text(json.dumps(
                {"model": label, "layers": layers, "fingerprint": fingerprint(args.device), "units": units},
                indent=1, default=str))
        return
    suite_path = work / "suite.yaml"
    write_suite(suite_path, base, ckpt, label, recipes, backend, args.serving.split(",") if args.serving else None)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    suite = load_suite(suite_path, data_dir=args.data_dir)
    finished: list[dict] = []

    def on_result(path: Path, doc: dict) -> None:
        """Each run as it finishes: its timing, work and status into OUT (a run cut short keeps what finished)."""
        finished.append(doc)
        print("\n".join(table(finished, units, base)[0]), flush=True)
        if args.out:
            keep = {k: doc.get(k) for k in ("run_key", "status", "error", "timing", "counters", "spec")}
            with open(Path(args.out) / "bench_harness_runs.jsonl", "a") as f:
                f.write(json.dumps(keep, default=str) + "\n")

    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    run_suite(suite, work / "results", log=lambda s: print(s, flush=True), on_result=on_result)
    wall = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan")
    docs = [json.loads((work / "results" / f"{s.key}.json").read_text()) for s in suite.runs]
    lines, summary = table(docs, units, base)
    out_lines += lines
    out_lines.append(f"suite wall time {wall:.0f} s ({len(docs)} runs); peak GPU memory {peak:.1f} GiB "
                     f"(FP32 reference and engine resident together; FP32 weights {ckpt_gib * 2:.1f} GiB)")
    print("\n".join(out_lines[-len(lines) - 1:]), flush=True)
    out = {"model": label, "layers": layers, "suite": args.suite, "recipes": recipes,
           "fingerprint": fingerprint(args.device), "checkpoint_gib": ckpt_gib, "build_s": build_s,
           "load_s": load_s, "units": units, "suite_wall_s": wall, "peak_gpu_gib": peak, **summary,
           "timing": {d["run_key"]: d["timing"] for d in docs}}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"{stem}.json").write_text(json.dumps(out, indent=1, default=str))
        (Path(args.out) / f"{stem}.txt").write_text("\n".join(out_lines) + "\n")


if __name__ == "__main__":
    main()
