"""Write one suite file per model of a suite (and per shard of its recipes), next to it, and print their paths.

Each part keeps the suite's every other field, so its runs have the run keys and fingerprints of the whole suite's
runs of that model and those recipes: the parts can run side by side (each into its own results folder; a folder
takes one writer) and their result files, gathered into one folder, are what `evalharness run <suite> --resume`
skips. `--shards N` deals each model's recipes round-robin into N parts (`.<suite>-<model>-<i>.yaml`; without it
`.<suite>-<model>.yaml`); each part computes its model's reference once. `--serving-apart` splits each part
further into one part per serving config (`...-<serving>.yaml`): with `--shards` as large as the recipes list, one
run a part. `--pending DIR` writes only the parts with a run that `--resume` into DIR would not skip (no finished
result of its fingerprint there), `--max-parts N` the first N of those, `--only-serving NAME` those of one serving
config. `benchmarks/run_device.sh nightly` runs the nightly this way on one GPU (its runs are host-bound).

  python benchmarks/split_suite.py suites/nightly.yaml --shards 3
  python benchmarks/split_suite.py suites/nightly.yaml --shards-for zoo-moe=10 --serving-apart --pending out/nightly
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml


def split(path: Path, shards: int = 1, shards_for: dict[str, int] | None = None, serving_apart: bool = False,
          pending: Path | None = None, max_parts: int | None = None, only_serving: str | None = None,
          data_dir: str | None = None) -> list[Path]:
    """The per-model (per-shard, per-serving) suite files of the suite at `path`, written next to it; `shards_for`
    gives some models their own number of parts; `pending`/`max_parts` keep the parts with runs left to do,
    `only_serving` the parts of that serving config (with `serving_apart`); `data_dir` is the suite's ${data_dir}
    for `pending`'s check (else $EVALHARNESS_DATA_DIR)."""
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
    serving = raw.get("serving")
    if serving_apart and not (isinstance(serving, list) and all(isinstance(s, dict) and "name" in s for s in serving)):
        raise SystemExit(f"{path}: --serving-apart needs a 'serving' list of entries with a 'name'")
    if only_serving is not None and not (serving_apart and any(s["name"] == only_serving for s in serving)):
        raise SystemExit(f"{path}: --only-serving {only_serving} needs --serving-apart and a serving config of that "
                         f"name")
    out = []
    for m in models:
        shards = counts[m["name"]]
        for i in range(shards):
            part = {**raw, "models": [m]} if shards == 1 else {**raw, "models": [m], "recipes": recipes[i::shards]}
            stem = f".{path.stem}-{m['name']}" + (f"-{i}" if shards > 1 else "")
            for s in [s for s in serving if only_serving in (None, s["name"])] if serving_apart else [None]:
                target = path.parent / (stem + (f"-{s['name']}" if s else "") + ".yaml")
                target.write_text(yaml.safe_dump(_one_serving(part, s) if s else part, sort_keys=False))
                if pending is None or _runs_left(target, pending, data_dir):
                    out.append(target)
                else:
                    target.unlink()
    if max_parts is not None:
        for target in out[max_parts:]:
            target.unlink()
        out = out[:max_parts]
    return out


def _one_serving(part: dict, serving: dict) -> dict:
    """`part` with the serving config `serving` alone; an eval limited to other serving configs (`evals.X.serving`)
    is left out, as the whole suite leaves it out of this config's runs."""
    evals = {name: cfg for name, cfg in (part.get("evals") or {}).items()
             if not (isinstance(cfg, dict) and isinstance(cfg.get("serving"), list))
             or serving["name"] in cfg["serving"]}
    return {**part, "serving": [serving], "evals": evals}


def _runs_left(part: Path, results: Path, data_dir: str | None) -> bool:
    """Whether the suite file `part` has a run that `--resume` into `results` would run: the runner's own resume plan
    (`evalharness.runner._resume_plan`: a finished result of the run's fingerprint is skipped)."""
    from evalharness.runner import _resume_plan
    from evalharness.suite import load_suite

    suite = load_suite(part, data_dir=data_dir)
    skip, _ = _resume_plan(suite, results, lambda _line: None)
    return any(r.key not in skip for r in suite.runs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("suite", type=Path)
    ap.add_argument("--shards", type=int, default=1, help="parts per model, its recipes dealt round-robin")
    ap.add_argument("--shards-for", action="append", default=[], metavar="MODEL=N",
                    help="parts for one model (repeatable), overriding --shards")
    ap.add_argument("--serving-apart", action="store_true", help="one part per serving config as well")
    ap.add_argument("--pending", type=Path, default=None, metavar="DIR",
                    help="only the parts with runs that --resume into DIR would run")
    ap.add_argument("--max-parts", type=int, default=None, metavar="N", help="at most N parts (the first ones)")
    ap.add_argument("--only-serving", default=None, metavar="NAME", help="only the parts of this serving config")
    args = ap.parse_args(argv)
    try:
        shards_for = {k: int(v) for k, v in (a.split("=", 1) for a in args.shards_for)}
    except ValueError:
        ap.error(f"--shards-for takes MODEL=N, got {args.shards_for}")
    parts = split(args.suite, args.shards, shards_for, args.serving_apart, args.pending, args.max_parts,
                  args.only_serving)
    print("\n".join(str(p) for p in parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
