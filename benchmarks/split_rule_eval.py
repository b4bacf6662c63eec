"""Score the decode GEMM heuristic against a measured split-rule sweep (no GPU needed).

    python benchmarks/split_rule_eval.py [benchmarks/results/h200-2026-11-30/probe_split_rule.txt]
    python benchmarks/split_rule_eval.py --mx [benchmarks/results/h200-2026-11-30/probe_mx_split.txt]
    python benchmarks/split_rule_eval.py --wgmma [sweep ...]   (default: the four H200 wgmma sweeps of 2026-11-30)

The sweep (`probe_kernels.py --only split_rule`) timed, per (N, K, M), the split-K kernel with 1-16 splits and the
whole-K kernel in CUDA graphs. For each point this prints nothing; per tile height (BM) it prints the geometric
mean of (time of the rule's pick / time of the best variant) and the worst point, for the rule in
`engine.kernels.decode_plan` (`_split_k` with the policy's `split_fill`, `_heuristic_whole_k`) and for the simpler rule it is compared
with (K splits until 2 programs per SM, no whole-K). The SM count is the sweep's (its header line).

`--wgmma` scores the sm_90 wgmma rule (`engine.kernels.decode_plan.wgmma_plan`) against `probe_kernels.py --only
wgmma_split` sweeps: per point its pick's time over the best variant's and over the production dispatch's (`prod`,
the split-K heuristic where the H200 has no entry); a pick the sweep did not time is an error.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.kernels import decode_plan as P  # noqa: E402
from engine.kernels import gemm_wgmma as GW  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "h200-2026-11-30"  # H200 sweeps of 2026-11-30
DEFAULT = RESULTS / "probe_split_rule.txt"
# The MX GEMM's sweep (`probe_kernels.py --only mx_split`: bf16 x MXFP4 / NVFP4, MXFP8 x MXFP8), scored against
# MX_SPLIT_RULE: `python benchmarks/split_rule_eval.py --mx`.
MX_DEFAULT = RESULTS / "probe_mx_split.txt"
# The MX split rule on data it was not fitted on: BM 64 (M = 48 / 64, the fitted shapes) and four held-out shapes.
MX_CHECK = (RESULTS / "probe_mx_split64.txt", RESULTS / "probe_mx_split_check.txt")
ROW = re.compile(r"\s+(\d+)x\s*(\d+) M=\s*(\d+) BM=(\d+): .*\| (.*)")


def read_sweep(path: Path) -> tuple[int, dict[tuple[int, int, int, int], dict[str, float]]]:
    """(SM count, {(N, K, M, BM): {variant: us}}) from a split-rule probe's output."""
    return _parse(path.read_text(), path)


def read_sections(path: Path) -> dict[str, tuple[int, dict]]:
    """{section title: (SM count, rows)} of a probe output with one '## ' section per sweep (`--only mx_split`)."""
    text = path.read_text()
    parts = re.split(r"^(?=## )", text, flags=re.M)
    sections = {p.splitlines()[0][3:]: _parse(p, path) for p in parts if p.startswith("## ")}
    if not sections:
        raise ValueError(f"{path}: no '## ' sections; is this an MX split sweep (benchmarks/results/*/probe_mx_split*.txt)?")
    return sections


def _parse(text: str, path: Path) -> tuple[int, dict]:
    sms = re.search(r"(\d+) SMs", text)
    if sms is None:
        raise ValueError(f"{path}: no '<n> SMs' header; is this a split-rule sweep (benchmarks/results/*/)?")
    rows = {}
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            n, k, mm, bm = map(int, m.groups()[:4])
            rows[(n, k, mm, bm)] = {a: float(b) for a, b in re.findall(r"(\w+)=\s*([\d.]+)", m.group(5))}
    if not rows:
        raise ValueError(f"{path}: no sweep rows found")
    return int(sms.group(1)), rows


def pick(n: int, k: int, m: int, sms: int, fill, whole_k: bool) -> str:
    """The variant a heuristic runs for (N, K, M): 'wk<block_n>x<groups>' or 's<splits>'. fill: programs per SM for
    `_split_k`, or a split rule (tiles, steps, SMs, BM) -> splits (`P.mx_split_k`)."""
    if whole_k:
        wk = P._heuristic_whole_k(m, n, torch.device("cuda"))
        if wk:
            return f"wk{wk['block_n']}x{wk['whole_k']}"
    bm, bn, _, _ = P._tiles(m)
    tiles = -(-n // bn) * -(-m // bm)
    steps = -(-k // 128)
    return f"s{fill(tiles, steps, sms, bm) if callable(fill) else P._split_k(tiles, steps, sms, fill)}"


def score(sms: int, rows: dict, fill, whole_k: bool) -> dict:
    """Per BM and overall: geometric mean of pick / best, and the worst point."""
    ratios: dict = {}
    worst = (0.0, None)
    for (n, k, m, bm), times in rows.items():
        r = times[pick(n, k, m, sms, fill, whole_k)] / min(times.values())
        ratios.setdefault(bm, []).append(r)
        ratios.setdefault("all", []).append(r)
        worst = max(worst, (r, (n, k, m)))
    geo = {key: math.exp(sum(map(math.log, v)) / len(v)) for key, v in ratios.items()}
    return {"geo": geo, "worst": worst}


WGMMA_DEFAULT = tuple(RESULTS / name
                      for name in ("probe_wgmma_split.txt", "probe_wgmma_split_check.txt",
                                   "probe_wgmma_split_check2.txt", "probe_wgmma_split_check3.txt"))


def wgmma_pick(n: int, k: int, m: int, sms: int) -> str:
    """The variant name `w<splits>g<groups per stage>n<stages>` the wgmma rule runs for (N, K, M), or 'prod' where it
    has no plan."""
    plan = P.wgmma_plan(m, n, k, sms)
    if plan is None:
        return "prod"
    splits, gps, stages = plan
    return f"w{splits}g{gps}n{stages or GW.swap_stages(m, -(-k // 128), splits, gps)}"


def score_wgmma(sms: int, rows: dict, path: Path) -> dict:
    """Per BM and overall: geometric means of pick / best and pick / prod, and the worst point of each."""
    best: dict = {}
    prod: dict = {}
    worst = {"best": (0.0, None), "prod": (0.0, None)}
    for (n, k, m, bm), times in rows.items():
        name = wgmma_pick(n, k, m, sms)
        if name not in times or "prod" not in times:
            raise ValueError(f"{path}: {n}x{k} M={m} has no time for the rule's pick {name} (or no prod); "
                             "re-run `probe_kernels.py --only wgmma_split` with this rule")
        for key, ref, acc in (("best", min(times.values()), best), ("prod", times["prod"], prod)):
            r = times[name] / ref
            acc.setdefault(bm, []).append(r)
            acc.setdefault("all", []).append(r)
            worst[key] = max(worst[key], (r, (n, k, m, name)))
    geo = lambda d: {key: math.exp(sum(map(math.log, v)) / len(v)) for key, v in d.items()}
    return {"best": geo(best), "prod": geo(prod), "worst": worst}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "--wgmma":
        for path in ([Path(a) for a in args[1:]] or WGMMA_DEFAULT):
            sms, rows = read_sweep(path)
            s = score_wgmma(sms, rows, path)
            print(f"{path.name}: {len(rows)} points, {sms} SMs; the wgmma rule's pick, geometric mean")
            for key in ("best", "prod"):
                per = "  ".join(f"BM {bm} {g:.3f}" for bm, g in sorted((b, g) for b, g in s[key].items() if b != "all"))
                print(f"  / {key:4s} all {s[key]['all']:.3f}  {per}  worst {s['worst'][key][0]:.3f} at "
                      f"{s['worst'][key][1]}")
        return 0
    if args and args[0] == "--mx":
        path = Path(args[1]) if len(args) > 1 else MX_DEFAULT
        for title, (sms, rows) in read_sections(path).items():
            print(f"{title}: {len(rows)} points, {sms} SMs; pick / best split, geometric mean")
            for name, fill in (("fill 2: 2 programs per SM", 2.0), ("fill 4: 4 programs per SM", 4.0),
                               (f"in the code: mx_split_rule {P.DEFAULT_POLICY.mx_split_rule}", P.mx_split_k)):
                s = score(sms, rows, fill, False)
                per = "  ".join(f"BM {bm} {g:.3f}"
                                for bm, g in sorted((b, g) for b, g in s["geo"].items() if b != "all"))
                print(f"  {name:48s} all {s['geo']['all']:.3f}  {per}  worst {s['worst'][0]:.2f} at {s['worst'][1]}")
        return 0
    sms, rows = read_sweep(Path(args[0]) if args else DEFAULT)
    print(f"{len(rows)} points, {sms} SMs; pick / best variant, geometric mean")
    for name, fill, wk in (("2 programs per SM, no whole-K", 2.0, False),
                           (f"in the code: {P.DEFAULT_POLICY.split_fill} per SM, whole-K at BM 64 {P.DEFAULT_POLICY.whole_k_at_bm64}",
                            P.DEFAULT_POLICY.split_fill, P.DEFAULT_POLICY.whole_k_at_bm64)):
        s = score(sms, rows, fill, wk)
        per = "  ".join(f"BM {bm} {g:.3f}" for bm, g in sorted((b, g) for b, g in s["geo"].items() if b != "all"))
        print(f"  {name:48s} all {s['geo']['all']:.3f}  {per}  worst {s['worst'][0]:.2f} at {s['worst'][1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
