"""Write one suite file per model of a suite, next to it (`.<suite>-<model>.yaml`), and print their paths.

Each keeps the suite's every other field, so its runs have the run keys and fingerprints of the whole suite's runs
of that model: the per-model suites can run side by side (each into its own results folder; a folder takes one
writer) and their result files, gathered into one folder, are what `evalharness run <suite> --resume` skips.
`benchmarks/run_device.sh nightly` runs the nightly's models this way on one GPU (its runs are host-bound).

  python benchmarks/split_suite.py suites/nightly.yaml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml


def split(path: Path) -> list[Path]:
    """The per-model suite files of the suite at `path` (written next to it)."""
    raw = yaml.safe_load(path.read_text())
    models = raw.get("models") if isinstance(raw, dict) else None
    if not isinstance(models, list) or not all(isinstance(m, dict) and "name" in m for m in models):
        raise SystemExit(f"{path}: 'models' must be a list of entries with a 'name'")
    out = []
    for m in models:
        target = path.parent / f".{path.stem}-{m['name']}.yaml"
        target.write_text(yaml.safe_dump({**raw, "models": [m]}, sort_keys=False))
        out.append(target)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("suite", type=Path)
    args = ap.parse_args(argv)
    print("\n".join(str(p) for p in split(args.suite)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
