"""Scores of the decode GEMM rules (`engine.kernels.decode_plan.DecodePolicy`) on the H200 sweeps they were fitted on.

The sweeps are text under tests/data/decode_sweeps/h200-2026-11-30/ (`benchmarks/decode_sweeps.py` re-runs them on
a GPU): per (N, K, M) every variant's time per call in a CUDA graph over weight copies. A rule is scored by the time
of the variant it picks over the best variant's, as a geometric mean per tile height (BM) and overall, and its worst
point. The rules themselves are the production ones, read from `decode_plan`; nothing here runs a kernel.

* split rule (`_split_k` at the policy's `split_fill`, the whole-K kernel at BM 64; `mx_split_k` for the MX GEMM):
  `read_sweep` / `read_sections` and `score_splits`;
* wgmma rule (`wgmma_plan`): `score_wgmma`, also against the production dispatch without it (`prod`);
* stage rule (`_decode_stages`): `read_stage_sweep` and `score_stages`, against the best fixed depth.
"""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path

import torch

from engine.kernels import decode_plan as P
from engine.kernels import gemm_wgmma as GW

SWEEPS = Path(__file__).resolve().parents[1] / "data" / "decode_sweeps" / "h200-2026-11-30"
SPLIT_SWEEP = SWEEPS / "probe_split_rule.txt"
MX_SWEEP = SWEEPS / "probe_mx_split.txt"
# The MX split rule on data it was not fitted on: BM 64 (M = 48 / 64, the fitted shapes) and four held-out shapes.
MX_CHECK = (SWEEPS / "probe_mx_split64.txt", SWEEPS / "probe_mx_split_check.txt")
WGMMA_SWEEPS = tuple(SWEEPS / name for name in ("probe_wgmma_split.txt", "probe_wgmma_split_check.txt",
                                                 "probe_wgmma_split_check2.txt", "probe_wgmma_split_check3.txt"))
# The stage rule's sweep, and its held-out shapes.
STAGE_SWEEPS = (SWEEPS / "probe_decode_stages.txt", SWEEPS / "probe_decode_stages_check.txt")

_ROW = re.compile(r"\s+(\d+)x\s*(\d+) M=\s*(\d+) BM=(\d+): .*\| (.*)")
_STAGE_HEADER = re.compile(r"^## decode pipeline depth: .*?(\d+) SMs")
_STAGE_ROW = re.compile(r"^\s+(\d+)x\s*(\d+) M=\s*(\d+) BM=(\d+) s(\d+):.*\|(.*)\|")
_CELL = re.compile(r"(\w+)=\s*([\d.]+)")


def _geomeans(ratios: dict) -> dict:
    return {key: math.exp(sum(map(math.log, v)) / len(v)) for key, v in ratios.items()}


# ------------------------------------------------------------------------------------------------ split rules
def read_sweep(path: Path) -> tuple[int, dict[tuple[int, int, int, int], dict[str, float]]]:
    """(SM count, {(N, K, M, BM): {variant: us}}) of a split-rule or wgmma-rule sweep."""
    return _parse(path.read_text(), path)


def read_sections(path: Path) -> dict[str, tuple[int, dict]]:
    """{section title: (SM count, rows)} of a sweep with one '## ' section per operand pair (the MX split sweeps)."""
    parts = re.split(r"^(?=## )", path.read_text(), flags=re.M)
    sections = {p.splitlines()[0][3:]: _parse(p, path) for p in parts if p.startswith("## ")}
    if not sections:
        raise ValueError(f"{path}: no '## ' sections; is this an MX split sweep (probe_mx_split*.txt)?")
    return sections


def _parse(text: str, path: Path) -> tuple[int, dict]:
    sms = re.search(r"(\d+) SMs", text)
    if sms is None:
        raise ValueError(f"{path}: no '<n> SMs' header; is this a split-rule sweep (tests/data/decode_sweeps/)?")
    rows = {}
    for line in text.splitlines():
        m = _ROW.match(line)
        if m:
            n, k, mm, bm = map(int, m.groups()[:4])
            rows[(n, k, mm, bm)] = {a: float(b) for a, b in _CELL.findall(m.group(5))}
    if not rows:
        raise ValueError(f"{path}: no sweep rows found")
    return int(sms.group(1)), rows


def pick(n: int, k: int, m: int, sms: int, fill, whole_k: bool) -> str:
    """The variant a split rule runs for (N, K, M): 'wk<block_n>x<groups>' or 's<splits>'. fill: programs per SM for
    `_split_k`, or a split rule (tiles, steps, SMs, BM) -> splits (`P.mx_split_k`)."""
    if whole_k:
        wk = P._heuristic_whole_k(m, n, torch.device("cuda"))
        if wk:
            return f"wk{wk['block_n']}x{wk['whole_k']}"
    bm, bn, _, _ = P._tiles(m)
    tiles = -(-n // bn) * -(-m // bm)
    steps = -(-k // 128)
    return f"s{fill(tiles, steps, sms, bm) if callable(fill) else P._split_k(tiles, steps, sms, fill)}"


def score_splits(sms: int, rows: dict, fill, whole_k: bool) -> dict:
    """{'geo': {BM or 'all': geometric mean of pick / best}, 'worst': (ratio, (N, K, M))}."""
    ratios: dict = {}
    worst = (0.0, None)
    for (n, k, m, bm), times in rows.items():
        r = times[pick(n, k, m, sms, fill, whole_k)] / min(times.values())
        ratios.setdefault(bm, []).append(r)
        ratios.setdefault("all", []).append(r)
        worst = max(worst, (r, (n, k, m)))
    return {"geo": _geomeans(ratios), "worst": worst}


def wgmma_pick(n: int, k: int, m: int, sms: int) -> str:
    """The variant `w<splits>g<groups per stage>n<stages>` the wgmma rule runs for (N, K, M), or 'prod' where it has
    no plan."""
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
                             "re-run `benchmarks/decode_sweeps.py --only wgmma_split` with this rule")
        for key, ref, acc in (("best", min(times.values()), best), ("prod", times["prod"], prod)):
            r = times[name] / ref
            acc.setdefault(bm, []).append(r)
            acc.setdefault("all", []).append(r)
            worst[key] = max(worst[key], (r, (n, k, m, name)))
    return {"best": _geomeans(best), "prod": _geomeans(prod), "worst": worst}


# ------------------------------------------------------------------------------------------------ stage rule
def read_stage_sweep(path: Path) -> tuple[int, list[dict]]:
    """(SM count, rows) of a pipeline-depth sweep; a row: n, k, m, bm, splits and the timed columns (us)."""
    sms, rows = None, []
    for line in Path(path).read_text().splitlines():
        h = _STAGE_HEADER.match(line)
        if h:
            sms = int(h.group(1))
            continue
        r = _STAGE_ROW.match(line)
        if r and sms is not None:
            n, k, m, bm, s = map(int, r.groups()[:5])
            times = {key: float(v) for key, v in _CELL.findall(r.group(6))}
            if not {"st3", "st4", "st6"} <= times.keys():
                raise ValueError(f"{path}: row {line.strip()!r} lacks the st3 / st4 / st6 columns")
            rows.append(dict(n=n, k=k, m=m, bm=bm, splits=s, times=times))
    if sms is None:
        raise ValueError(f"{path}: no '## decode pipeline depth: ... <n> SMs' header; not a decode_stages sweep")
    if not rows:
        raise ValueError(f"{path}: no probe rows under its header")
    return sms, rows


def score_stages(sms: int, rows: list[dict], limits, block_n: int = 64) -> dict:
    """{'rule': (geomean, worst), 'auto': (geomean, worst) or None, 'points'} against the best fixed depth."""
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
