"""Compare two result directories of the same suite run on different backends (e.g. cpu-emulated vs cuda-emulated).

For every model x recipe present in both, prints the headline metrics side by
side and the largest relative difference over all metrics, plus both
hardware fingerprints. The emulation is bit-exact per quantizer, so any
difference comes from GEMM / reduction order (and the reference's own
CPU-vs-GPU noise), which is what this measures.

    python benchmarks/crosscheck_backends.py RESULTS_A RESULTS_B
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

HEADLINE = ("ppl_kld.ppl_ref", "ppl_kld.kld_mean", "ppl_kld.top1_agree", "layer_error.logits.rel_l2")


def load(d: Path) -> dict[tuple[str, str, str], dict]:
    """Results keyed by (model, recipe, serving), backend-independent."""
    out = {}
    for p in sorted(d.glob("*__*.json")):
        doc = json.loads(p.read_text())
        model, recipe, serving, _backend = doc["run_key"].split("__")
        out[(model, recipe, serving)] = doc
    return out


def main() -> None:
    """Print the comparison table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results_a", type=Path)
    ap.add_argument("results_b", type=Path)
    args = ap.parse_args()
    a_dir, b_dir = args.results_a, args.results_b
    a, b = load(a_dir), load(b_dir)
    first = next(iter(a.values()))
    second = next(iter(b.values()))
    print(f"A = {a_dir} ({first['spec']['backend']}): {json.dumps(first['provenance']['hardware'])}")
    print(f"B = {b_dir} ({second['spec']['backend']}): {json.dumps(second['provenance']['hardware'])}")
    print(f"{'model/recipe':34} " + " ".join(f"{h.split('.')[-1] + ' A':>14} {h.split('.')[-1] + ' B':>14}"
                                             for h in HEADLINE) + "   max_rel_diff (metric)")
    for key in sorted(set(a) & set(b)):
        ma, mb = a[key]["metrics"], b[key]["metrics"]
        worst, worst_name = 0.0, ""
        for name in set(ma) & set(mb):
            x, y = ma[name], mb[name]
            if not isinstance(x, (int, float)) or not isinstance(y, (int, float)) or name.endswith("_s"):
                continue
            rel = abs(x - y) / max(abs(x), abs(y), 1e-12)
            if rel > worst and not math.isclose(x, y, abs_tol=1e-9):
                worst, worst_name = rel, name
        cells = " ".join(f"{ma.get(h, float('nan')):>14.6g} {mb.get(h, float('nan')):>14.6g}" for h in HEADLINE)
        print(f"{key[0] + '/' + key[1]:34} {cells}   {worst:.3g} ({worst_name})")
        ta, tb = a[key]["timing"].get("total_s"), b[key]["timing"].get("total_s")
        print(f"{'':34} time A {ta}s, B {tb}s")


if __name__ == "__main__":
    main()
