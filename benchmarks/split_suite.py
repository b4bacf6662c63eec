"""Write one suite file per model of a suite (and per shard of its recipes), next to it, and print their paths.

Each part keeps the suite's every other field, so its runs have the run keys and fingerprints of the whole suite's
runs of that model and those recipes: the parts can run side by side (each into its own results folder; a folder
takes one writer) and their result files, gathered into one folder, are what `evalharness run <suite> --resume`
skips. `--shards N` deals each model's recipes round-robin into N parts (`.<suite>-<model>-<i>.yaml`; without it
`.<suite>-<model>.yaml`); each part computes its model's reference once. `benchmarks/run_device.sh nightly` runs
the nightly this way on one GPU (its runs are host-bound).

  python benchmarks/split_suite.py suites/nightly.yaml --shards 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml


def split(path: Path, shards: int = 1, shards_for: dict[str, int] | None = None) -> list[Path]:
    """The per-model (per-shard) suite files of the suite at `path`, written next to it; `shards_for` gives some
    models their own number of parts."""
    raw = yaml.safe_load(path.read_text())
    models = raw.get("models") if isinstance(raw, dict) else None
    if not isinstance(models, list) or not all(isinstance(m, dict) and "name" in m for m in models):
        raise SystemExit(f"{path}: 'models' must be a list of entries with a 'name'")
    recipes = raw.get("recipes")
    counts = {m["name"]: (shards_for or {}).get(m["name"], shards) for m in models}
    if unknown := sorted(set(shards_for or {}) - set(counts)):
        raise SystemExit(f"{path}: --shards-for names models the suite does not have: {', '.join(unknown)}")
    for n in set(counts.values()):
        if n < 1 or (n > 1 and not (isinstance(recipes, list) and len(recipes) >= n)):
            raise SystemExit(f"{path}: --shards {n} needs a 'recipes' list of at least {n} entries")
    out = []
    for m in models:
        shards = counts[m["name"]]
        for i in range(shards):
            part = {**raw, "models": [m]} if shards == 1 else {**raw, "models": [m], "recipes": recipes[i::shards]}
            target = path.parent / (f".{path.stem}-{m['name']}" + (f"-{i}" if shards > 1 else "") + ".yaml")
            target.write_text(yaml.safe_dump(part, sort_keys=False))
            out.append(target)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("suite", type=Path)
    ap.add_argument("--shards", type=int, default=1, help="parts per model, its recipes dealt round-robin")
    ap.add_argument("--shards-for", action="append", default=[], metavar="MODEL=N",
                    help="parts for one model (repeatable), overriding --shards")
    args = ap.parse_args(argv)
    try:
        shards_for = {k: int(v) for k, v in (a.split("=", 1) for a in args.shards_for)}
    except ValueError:
        ap.error(f"--shards-for takes MODEL=N, got {args.shards_for}")
    print("\n".join(str(p) for p in split(args.suite, args.shards, shards_for)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
