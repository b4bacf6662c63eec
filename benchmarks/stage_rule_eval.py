"""Score the split-K kernel's decode pipeline-depth rule (`engine.kernels.decode_plan._decode_stages`, or other thresholds)
against `probe_kernels.py --only decode_stages[,decode_stages_check]` output: per point the time of the depth the rule
picks over the best of the fixed 3 / 4 / 6 stages, as geometric mean and worst, next to the autotuner's column.

    python benchmarks/stage_rule_eval.py [FILE ...] [--limits 1.0:6,2.0:4,inf:3]

Default files: the H200 sweep of 2026-11-30 that the rule was fitted on, and its held-out shapes (the check)."""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.kernels import decode_plan as P  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "h200-2026-11-30"
DEFAULT = (RESULTS / "probe_decode_stages.txt", RESULTS / "probe_decode_stages_check.txt")
_HEADER = re.compile(r"^## decode pipeline depth: .*?(\d+) SMs")
_ROW = re.compile(r"^\s+(\d+)x\s*(\d+) M=\s*(\d+) BM=(\d+) s(\d+):.*\|(.*)\|")


def read_probe(path: Path) -> tuple[int, list[dict]]:
    """(SM count, rows) of one probe output; a row: n, k, m, bm, splits and the timed columns (us)."""
    text = Path(path).read_text()
    sms, rows = None, []
    for line in text.splitlines():
        h = _HEADER.match(line)
        if h:
            sms = int(h.group(1))
            continue
        r = _ROW.match(line)
        if r and sms is not None:
            n, k, m, bm, s = map(int, r.groups()[:5])
            times = {key: float(v) for key, v in re.findall(r"(\w+)=\s*([\d.]+)", r.group(6))}
            if not {"st3", "st4", "st6"} <= times.keys():
                raise ValueError(f"{path}: row {line.strip()!r} lacks the st3 / st4 / st6 columns")
            rows.append(dict(n=n, k=k, m=m, bm=bm, splits=s, times=times))
    if sms is None:
        raise ValueError(f"{path}: no '## decode pipeline depth: ... <n> SMs' header; not a decode_stages probe output")
    if not rows:
        raise ValueError(f"{path}: no probe rows under its header")
    return sms, rows


def score(sms: int, rows: list[dict], limits, block_n: int = 64) -> dict:
    """{'rule': (geomean, worst), 'auto': (geomean, worst) or None} over the rows, against the best fixed depth."""
    rule, auto = [], []
    for row in rows:
        t = row["times"]
        best = min(t["st3"], t["st4"], t["st6"])
        programs = -(-row["n"] // block_n) * row["splits"]
        rule.append(t[f"st{P._decode_stages(programs, sms, limits)}"] / best)
        if "auto" in t:
            auto.append(t["auto"] / best)

    def summary(rs):
        return (statistics.geometric_mean(rs), max(rs)) if rs else None

    return {"rule": summary(rule), "auto": summary(auto), "points": len(rows)}


def _limits(text: str):
    out = []
    for part in text.split(","):
        limit, stages = part.split(":")
        out.append((math.inf if limit == "inf" else float(limit), int(stages)))
    return tuple(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", type=Path, default=list(DEFAULT))
    ap.add_argument("--limits", type=_limits, default=None,
                    help="thresholds 'load:stages,...' (default: DecodePolicy.decode_stages)")
    args = ap.parse_args(argv)
    if args.limits is None:
        args.limits = P.DEFAULT_POLICY.decode_stages
    print(f"rule {args.limits}")
    for path in args.files:
        sms, rows = read_probe(path)
        res = score(sms, rows, args.limits)
        auto = "" if res["auto"] is None else f"; autotuner {res['auto'][0]:.3f}x, worst {res['auto'][1]:.3f}x"
        print(f"{path.name}: {res['points']} points, {sms} SMs: rule {res['rule'][0]:.3f}x the best fixed depth "
              f"(geometric mean), worst {res['rule'][1]:.3f}x{auto}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
