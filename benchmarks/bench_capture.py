"""Cost of the harness's instrumentation on the GPU, and reference-pass sharing across a recipe matrix.

    python benchmarks/bench_capture.py [--model zoo/zoo-moe] [--data-dir DIR] [--no-matrix]
    python benchmarks/bench_capture.py --batch 2 --seq 256 --no-matrix   # a quick CPU check

1. Capture overhead: engine forward with every canonical tap streamed into
   the per-tap error accumulators (what `layer_error` does) vs the same
   forward with no tap callback, same batch; target <= 1.5x.
2. A 4-recipe matrix (fp32, bf16, fp8-tensor, fp8-block) of `ppl_kld` on one
   model through the real runner: the result files' counters must show one
   reference pass, the other recipes served from the cache; wall time per
   eval from the results' timing.

Prints the hardware fingerprint; writes `$OUT/bench_capture.{json,txt}` when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import Report, fingerprint, wall_s  # noqa: E402


def main() -> None:
    """Measure and print."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO / "zoo" / "zoo-moe"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--no-matrix", action="store_true", help="only the capture overhead (part 1)")
    args = ap.parse_args()
    from engine.api import Engine
    from engine.loading import load_model
    from engine.model import Transformer
    from evalharness.evals.errorstats import ErrorAccumulator, _triton_fold
    from evalharness.reference import ReferenceLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rep = Report()
    say = rep.say
    say(f"hardware: {json.dumps(fingerprint(device))}")
    stats_path = "Triton fold (2 launches/tap)" if device == "cuda" and _triton_fold() else "torch fold_reference"
    say(f"per-tap statistics: {stats_path}")
    loaded = load_model(args.model)
    model = Transformer(loaded.cfg, loaded.weights).to(device)
    ref = ReferenceLM(loaded, device=device)
    x = torch.randint(0, loaded.cfg.vocab_size, (args.batch, args.seq), device=device)
    ref_taps: dict[str, torch.Tensor] = {}
    ref.logits(x, tap=lambda n, t: ref_taps.__setitem__(n, t.detach() if n.endswith(".moe.topk") else t.float()))
    result: dict = {"model": args.model, "batch": args.batch, "seq": args.seq}
    for recipe in ("bf16", "fp8-block"):
        eng = Engine(model, recipe, backend="cuda-emulated" if device == "cuda" else "cpu-emulated")
        acc: dict[str, ErrorAccumulator] = {}

        def sink(name: str, t: torch.Tensor) -> None:
            if name.endswith(".moe.topk") or name not in ref_taps:
                return
            acc.setdefault(name, ErrorAccumulator()).update(t, ref_taps[name])

        off = wall_s(lambda: eng.logits(x), args.reps)
        on = wall_s(lambda: eng.logits(x, tap=sink), args.reps)
        say(f"{recipe}: forward {off * 1e3:.1f} ms, with {len(acc)} taps captured {on * 1e3:.1f} ms: "
            f"overhead {on / off:.2f}x (target <= 1.5x)")
        result[f"{recipe}.capture_off_s"], result[f"{recipe}.capture_on_s"] = off, on
        result[f"{recipe}.overhead"] = on / off

    if args.no_matrix:
        rep.write("bench_capture", result)
        return
    if args.data_dir:
        corpus = Path(args.data_dir) / "text" / "simplebooks92" / "test.txt"
    else:
        corpus = Path(args.model) / "heldout_sample.json"
    from evalharness.runner import run_suite
    from evalharness.suite import load_suite

    with tempfile.TemporaryDirectory() as tmp:
        suite_path = Path(tmp) / "matrix.yaml"
        suite_path.write_text(json.dumps({
            "name": "matrix4", "backend": "cuda-emulated" if device == "cuda" else "cpu-emulated",
            "models": [{"name": Path(args.model).name, "path": str(Path(args.model).resolve()),
                        "corpus": str(corpus)}],
            "recipes": ["fp32", "bf16", "fp8-tensor", "fp8-block"], "serving": [{"name": "default", "batch_size": 8}],
            "evals": {"ppl_kld": {"seq_len": 512, "max_windows": 64}}}))
        t0 = time.time()
        outcomes = run_suite(load_suite(suite_path), Path(tmp) / "out", log=lambda s: None)
        wall = time.time() - t0
        docs = [json.loads(o.path.read_text()) for o in outcomes]
    passes = max(d.get("counters", {}).get("reference_passes", 0) for d in docs)
    hits = max(d.get("counters", {}).get("reference_cache_hits", 0) for d in docs)
    say(f"4-recipe ppl_kld matrix: {wall:.1f}s wall, reference passes {passes}, cache hits {hits} "
        f"(target: 1 pass); per-run ppl_kld seconds "
        f"{[round(d.get('timing', {}).get('ppl_kld_s', float('nan')), 2) for d in docs]}")
    result.update({"matrix_wall_s": wall, "reference_passes": passes, "reference_cache_hits": hits,
                   "statuses": [d["status"] for d in docs]})
    rep.write("bench_capture", result)

if __name__ == "__main__":
    main()
