"""Benchmark of checkpoint loading: time and peak host / GPU memory against one fp32 copy of the weights.

Usage::

    python benchmarks/bench_loading.py                # Llama, hidden 1024, 8 layers, vocab 32000 (~620 MB fp32)
    python benchmarks/bench_loading.py --layers 2     # smaller (smoke test)
    OUT=/tmp/o python benchmarks/bench_loading.py     # also writes $OUT/bench_loading.{json,txt}

The script writes a random-weight Llama checkpoint in bf16, split over several
safetensors shards with a ``model.safetensors.index.json`` (config from
transformers' ``LlamaConfig``, tensors written with safetensors), then measures
each case in a fresh child process (so every peak is that case's own):

* ``empty``: the imports every case makes, nothing else: the interpreter baseline;
* ``load``: ``engine.loading.load_model`` alone (tensor by tensor, bf16 -> fp32);
* ``harness``: load + engine ``Transformer`` + FP32 ``ReferenceLM`` on the CPU, as
  ``evalharness run`` sets a model up (the two share one fp32 copy);
* ``naive``: the same through a whole-file path: ``safetensors.torch.load_file``
  per shard into one dict, a fp32 copy of that dict, the ``Transformer``, and the
  reference through ``from_pretrained`` (its own copy);
* with CUDA: ``harness-cuda`` (weights moved to the GPU once, engine and reference
  share them) and ``harness-cuda-refcpu`` (reference on the host, engine on the GPU).

Peak host memory is the child's ``ru_maxrss``; peak GPU memory is
``torch.cuda.max_memory_allocated``. Each peak is printed as a multiple of one
fp32 weight copy after subtracting the interpreter baseline, against the target
"peak near one weight copy": at most 1.5x (for the GPU cases: the host target
applies to what stays on the host, the GPU peak is reported).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TARGET = 1.5  # peak host memory above the baseline, in fp32 weight copies


# ------------------------------------------------------------------ checkpoint

def write_checkpoint(path: Path, hidden: int, layers: int, vocab: int, shards: int, seed: int = 0) -> dict:
    """A random bf16 Llama checkpoint in `shards` safetensors files + index; returns its sizes."""
    import torch
    import transformers
    from safetensors.torch import save_file

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                      num_key_value_heads=max(1, hidden // 256), max_position_embeddings=2048,
                                      tie_word_embeddings=False)
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    with torch.device("meta"):  # names and shapes only
        shapes = {k: tuple(v.shape) for k, v in transformers.AutoModelForCausalLM.from_config(config).state_dict().items()}
    names = list(shapes)
    total = sum(torch.Size(s).numel() for s in shapes.values())
    per_shard, groups, cur, acc = total / shards, [], [], 0
    for n in names:  # contiguous groups of about total/shards parameters
        cur.append(n)
        acc += torch.Size(shapes[n]).numel()
        if acc >= per_shard * (len(groups) + 1) and len(groups) < shards - 1:
            groups.append(cur)
            cur = []
    groups.append(cur)
    g = torch.Generator().manual_seed(seed)
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for n in group:
            shape = shapes[n]
            if len(shape) == 1:
                t = 1.0 + 0.1 * torch.randn(shape, generator=g)
            else:
                t = torch.randn(shape, generator=g) / shape[-1] ** 0.5
            tensors[n] = t.to(torch.bfloat16)
            weight_map[n] = fname
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        del tensors
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total * 2}, "weight_map": weight_map}, indent=1))
    return {"params": total, "fp32_bytes": total * 4, "bf16_bytes": total * 2, "shards": len(groups)}


# ------------------------------------------------------------------ children

def _imports():
    """What every case imports (the baseline child stops here)."""
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401  (the lazily imported modeling code is not weights)

    import engine.loading  # noqa: F401
    import engine.model  # noqa: F401
    import evalharness.reference  # noqa: F401


def _status_kib(field: str) -> int | None:
    """A `VmRSS` / `VmHWM` line of /proc/self/status in KiB (None off Linux)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0: clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def child(case: str, folder: str) -> dict:
    """Run one case in this (fresh) process; returns its timings and peaks.

    `peak_rss_bytes` is ru_maxrss (includes whatever transient peak the imports had);
    `work_peak_bytes` is the peak RSS reached after the imports minus the RSS right after
    them (VmHWM reset through /proc/self/clear_refs), i.e. what the case itself added.
    """
    _imports()
    import gc

    import torch

    gc.collect()
    rss0 = _status_kib("VmRSS")
    reset = _reset_peak()

    from engine.config import ModelConfig
    from engine.loading import load_model
    from engine.model import Transformer
    from evalharness.reference import ReferenceLM

    out: dict = {"case": case}
    keep = []  # hold everything built until the peak is read
    t0 = time.perf_counter()
    if case == "load":
        keep.append(load_model(folder))
        out["load_s"] = time.perf_counter() - t0
    elif case.startswith("harness"):
        loaded = load_model(folder)
        out["load_s"] = time.perf_counter() - t0
        dev = "cuda" if case.startswith("harness-cuda") else "cpu"
        ref_dev = "cpu" if case.endswith("refcpu") else dev
        if ref_dev == dev != "cpu":
            loaded.to(dev)  # as evalharness.runner does: one device copy shared by both
        keep.append(ReferenceLM(loaded, device=ref_dev))
        keep.append(Transformer(loaded.cfg, loaded.weights).to(dev))
        keep.append(loaded)
    elif case == "naive":
        import transformers
        from safetensors.torch import load_file

        raw: dict = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            raw.update(load_file(str(f)))  # whole file into memory
        weights = {k: v.float() for k, v in raw.items()}  # the dict copy, fp32
        cfg = ModelConfig.from_hf(json.loads((Path(folder) / "config.json").read_text()))
        out["load_s"] = time.perf_counter() - t0
        keep += [raw, weights, Transformer(cfg, weights)]
        keep.append(transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                      attn_implementation="eager"))
    elif case != "empty":
        raise ValueError(f"unknown case {case}")
    out["total_s"] = time.perf_counter() - t0
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    hwm = _status_kib("VmHWM")
    if reset and rss0 is not None and hwm is not None:
        out["rss_after_imports_bytes"] = rss0 * 1024
        out["work_peak_bytes"] = (hwm - rss0) * 1024
    if torch.cuda.is_available():
        out["gpu_peak_bytes"] = torch.cuda.max_memory_allocated()
    return out


def run_child(case: str, folder: Path, timeout: float) -> dict:
    """`child(case)` in a fresh interpreter; {'case', 'error'} when it fails."""
    cmd = [sys.executable, __file__, "--child", case, "--dir", str(folder)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(REPO))
    except subprocess.TimeoutExpired:
        return {"case": case, "error": f"timed out after {timeout:.0f}s"}
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        return {"case": case, "error": f"exit {res.returncode}: {' | '.join(tail)}"}
    return json.loads(lines[-1])


# ------------------------------------------------------------------ report

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--dir", help="checkpoint folder (default: a temporary one, removed at the end)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per child case")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.dir)))
        return 0

    import torch

    from benchmarks.common import Report, fingerprint

    cuda = torch.cuda.is_available()
    tmp = None
    if args.dir:
        folder = Path(args.dir)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="bench_loading_")
        folder = Path(tmp.name) / "ckpt"
    rep = Report()
    say = rep.say
    fp = fingerprint("cuda" if cuda else "cpu")
    say(f"# bench_loading  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    say("fingerprint: " + json.dumps(fp, sort_keys=True))
    try:
        say(f"load average at start: {'%.1f %.1f %.1f' % os.getloadavg()} (times inflate on a shared machine)")
    except OSError:
        pass
    t0 = time.perf_counter()
    sizes = write_checkpoint(folder, args.hidden, args.layers, args.vocab, args.shards)
    say(f"checkpoint: Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; {sizes['params'] / 1e6:.1f}M "
        f"params in {sizes['shards']} bf16 shards + index ({sizes['bf16_bytes'] / 2**20:.0f} MiB on disk), "
        f"written in {time.perf_counter() - t0:.1f}s")
    one = sizes["fp32_bytes"]
    say(f"one fp32 weight copy: {one} bytes ({one / 2**20:.1f} MiB)   target: host peak - baseline <= {TARGET}x of it")
    say("")

    cases = ["empty", "load", "harness", "naive"] + (["harness-cuda", "harness-cuda-refcpu"] if cuda else [])
    results = {}
    for case in cases:
        r = run_child(case, folder, args.timeout)
        results[case] = r
        if "error" in r:
            say(f"{case:<20} FAILED: {r['error']}")
    base = results.get("empty", {}).get("peak_rss_bytes")
    if base is None:
        say("baseline child failed: peaks are reported without subtracting it")
        base = 0
    after = results.get("empty", {}).get("rss_after_imports_bytes")
    say(f"interpreter baseline (empty child, imports only): peak {base / 2**20:.0f} MiB (ru_maxrss)"
        + (f", {after / 2**20:.0f} MiB resident after the imports" if after else ""))
    say("columns: 'ru_maxrss - base' = the case's ru_maxrss minus the empty child's; 'work peak' = peak RSS "
        "after the imports minus the RSS right after them (VmHWM reset), the tighter measure; x = / one fp32 copy")
    say("")
    hdr = (f"{'case':<20} {'load s':>7} {'total s':>8} {'ru_maxrss MiB':>14} {'- base':>7} {'x':>5} "
           f"{'work peak MiB':>14} {'x':>5}  target <= {TARGET}x")
    if cuda:
        hdr += f"  {'GPU peak MiB':>12} {'x':>5}"
    say(hdr)
    summary = {}
    for case in cases[1:]:
        r = results[case]
        if "error" in r:
            continue
        above = r["peak_rss_bytes"] - base
        work = r.get("work_peak_bytes")
        ratio = (work if work is not None else above) / one  # the target is judged on the tighter measure
        ok = ratio <= TARGET and above / one <= TARGET
        verdict = ("met" if ok else "MISSED") if case != "naive" else "(comparison)"
        work_s = f"{work / 2**20:>14.0f} {work / one:>5.2f}" if work is not None else f"{'n/a':>14} {'':>5}"
        row = (f"{case:<20} {r.get('load_s', 0):>7.2f} {r['total_s']:>8.2f} {r['peak_rss_bytes'] / 2**20:>14.0f} "
               f"{above / 2**20:>7.0f} {above / one:>5.2f} {work_s}  {verdict}")
        if cuda:
            g = r.get("gpu_peak_bytes", 0)
            row += f"  {g / 2**20:>12.0f} {g / one:>5.2f}"
        say(row)
        summary[case] = {**r, "above_baseline_bytes": above, "x_fp32_copy": ratio,
                         "target_met": ok if case != "naive" else None}
    if "harness" in summary and "naive" in summary:
        h, n = summary["harness"], summary["naive"]
        say("")
        say(f"achieved: the harness setup (load + engine + FP32 reference) peaks at {h['x_fp32_copy']:.2f}x one fp32 "
            f"copy above the baseline (target <= {TARGET}x: {'met' if h['target_met'] else 'MISSED'}); the whole-file "
            f"path peaks at {n['x_fp32_copy']:.2f}x ({n['x_fp32_copy'] / max(h['x_fp32_copy'], 1e-9):.1f}x more)")
    doc = {"fingerprint": fp, "checkpoint": {**sizes, "hidden": args.hidden, "layers": args.layers,
                                             "vocab": args.vocab}, "target_x": TARGET,
           "baseline_rss_bytes": base, "cases": summary,
           "failed": {c: r["error"] for c, r in results.items() if "error" in r}}
    rep.write("bench_loading", doc)
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
