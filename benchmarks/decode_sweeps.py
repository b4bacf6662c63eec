"""Re-run, on a GPU, the sweeps the decode GEMM rules and configs were fitted on (`engine.kernels.decode_plan`).

    python benchmarks/decode_sweeps.py --only split_rule[,decode_stages,...] [--out DIR]

Every point is timed per call in a CUDA graph of 64 back-to-back calls that rotate through copies of the weight
(>= 150 MB in all, three times the H200's L2; `common.graph_us`), bf16 out, as a decode step runs them. The rows are
the format `tests/support/decode_rules.py` reads, so the committed sweeps (tests/data/decode_sweeps/<hw>-<date>/,
named `probe_<sweep>.txt`) can be replaced by a new run and the rule tests re-scored on it:

* split_rule: the split-K kernel with 1-16 splits and the whole-K kernel (32 / 64 rows, 2 / 4 groups per stage) on
  21 shapes at M = 12 / 24 / 48 -- `split_fill`, `whole_k_at_bm64`;
* decode_stages, decode_stages_check: the split-K kernel at the split rule's count with 3 / 4 / 6 stages and the stage
  rule's pick, on 16 fitted / 12 held-out shapes at M = 4 / 16 / 24 -- `decode_stages`;
* wgmma_split, wgmma_split_check, _check2, _check3: the swapped Gluon wgmma kernel over 1-8 splits, 2 / 4 groups per
  stage and two pipeline depths against the dispatch without the wgmma rule (`prod`) and with it (`rule`), on 57
  shapes at M = 4 / 16 / 32 -- the `wgmma_*` constants;
* mx_split, mx_split64, mx_split_check: the MX GEMM (bf16 x MXFP4 / NVFP4, MXFP8 x MXFP8) with 1-16 splits on 6
  fitted shapes at M = 1-32, at M = 48 / 64, and on 4 held-out shapes -- `mx_split_rule`;
* configs: every decode and GEMV entry of this GPU's configs file against the policy without that entry (the
  measurement each entry's note records).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from types import MappingProxyType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_gemm import fp8_block_operands  # noqa: E402
from benchmarks.common import DEVICE, Report, copy_ceiling, fingerprint, graph_us  # noqa: E402

ROTATE_BYTES = 150_000_000  # weight bytes the graph rotates through: no call finds its weight in L2
BF16 = torch.bfloat16
SPLIT_GRID = tuple((n, k) for n in (2048, 4096, 6144, 8192, 14336, 28672) for k in (2048, 4096, 7168, 14336)
                   if n * k <= 120_000_000)
STAGE_GRID = tuple((n, k) for n, k in SPLIT_GRID if n * k >= 1 << 24)
# Held out from the stage rule: Qwen2-7B, 5120-wide attention / MLP, Llama-3-70B qkv / down, two narrow shapes, the
# lm_heads of Llama-3-8B and Qwen3-30B-A3B.
STAGE_CHECK = ((37888, 3584), (3584, 18944), (5120, 5120), (27648, 5120), (5120, 13824), (10240, 8192),
               (8192, 28672), (3072, 8192), (2560, 9728), (12288, 4096), (128256, 4096), (151936, 2048))
# Held out from the wgmma rule's earlier forms: Mistral-Nemo-12B, Qwen3-8B / 14B, Gemma-2-9B, Qwen2.5-1.5B / 3B / 7B,
# Llama-3.2-3B; then Llama-3-70B over 8 GPUs, Phi-3-mini, Gemma-2-2B, Qwen2.5-32B, Qwen3-4B, DeepSeek-V2-Lite.
WGMMA_CHECK2 = ((5120, 14336), (28672, 5120), (6144, 5120), (5120, 4096), (24576, 4096), (4096, 12288), (5120, 17408),
                (7168, 5120), (3584, 14336), (8192, 3584), (3584, 4096), (1536, 8960), (2048, 11008), (5120, 3072),
                (3072, 3072), (4608, 3584), (3584, 3584))
WGMMA_CHECK3 = ((1280, 8192), (7168, 8192), (9216, 3072), (16384, 3072), (2304, 9216), (5120, 27648), (6144, 2560),
                (19456, 2560), (3072, 2048), (2048, 2048), (2560, 2560), (4096, 2304))
MX_SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (8192, 8192), (2048, 14336))
MX_CHECK = ((13824, 5120), (5120, 13824), (18944, 3584), (3584, 18944))  # Qwen2.5-14B and Qwen2-7B MLPs


def _weights(n: int, k: int) -> list:
    """Distinct random FP8 block weights (data, scale) of N x K, enough of them to fill ROTATE_BYTES (>= 3)."""
    return [fp8_block_operands(1, n, k, seed=n + i)[2:] for i in range(max(3, -(-ROTATE_BYTES // (n * k))))]


def _points(shapes, ms):
    """(N, K, M, weight copies, FP8 activations, their scales) of every shape x M, one shape's weights at a time."""
    for n, k in shapes:
        wts = _weights(n, k)
        for m in ms:
            xd, xs, _, _ = fp8_block_operands(m, 16, k, seed=m)
            yield n, k, m, wts, xd, xs
        wts = None
        torch.cuda.empty_cache()


def _graph(wts: list, call) -> float:
    """us per call of call(w_data, w_scale) in a CUDA graph rotating through the weight copies."""
    return graph_us([lambda w=w: call(*w) for w in wts])


def _row(rep: Report, n: int, k: int, m: int, bm: int, head: str, row: list[tuple[float, str]], nbytes: int) -> None:
    best = min(row)
    cells = " ".join(f"{name}={t:7.2f}" for t, name in row)
    rep.say(f"  {n:5d}x{k:5d} M={m:2d} BM={bm}: {head}, best {best[1]} {best[0]:7.2f} us "
            f"({nbytes / best[0] / 1e6:4.2f} TB/s) | {cells}")


def split_rule(rep: Report, sms: int) -> None:
    from engine.kernels import decode_plan as P
    from engine.kernels import gemm as G
    from engine.kernels import gemm_wgmma as GW

    rep.say(f"\n## split rule: us per call in a CUDA graph (64 calls over weight copies), {sms} SMs")
    for n, k, m, wts, xd, xs in _points(SPLIT_GRID, (12, 24, 48)):
        bm, bn, _, _ = P._tiles(m)
        steps = -(-k // 128)
        row = [(_graph(wts, lambda wd, ws, s=s: G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=BF16, split_k=s,
                                                                        sliced=False)), f"s{s}")
               for s in (1, 2, 4, 8, 16) if steps // s >= 2]
        row += [(_graph(wts, lambda wd, ws, wbn=wbn, gps=gps: G.fp8_block_gemm_triton(
                    xd, xs, wd, ws, out_dtype=BF16, whole_k=gps, block_n=wbn)), f"wk{wbn}x{gps}")
                for wbn in (32, 64) for gps in (2, 4)
                if GW.plan_error(m, n, k, wbn, GW.default_stages(wbn, gps), gps) is None]
        heur = P._plan_split(m, n, steps, bm, bn, xd.device, None)[0]
        _row(rep, n, k, m, bm, f"heuristic s{heur}", row, n * k)


def decode_stages(rep: Report, sms: int, shapes=STAGE_GRID) -> None:
    from engine.kernels import decode_plan as P
    from engine.kernels import gemm as G

    rep.say(f"\n## decode pipeline depth: us per call in a CUDA graph (64 calls over weight copies), {sms} SMs")
    for n, k, m, wts, xd, xs in _points(shapes, (4, 16, 24)):
        bm, bn, warps, _ = P._tiles(m)
        split = P._plan_split(m, n, -(-k // 128), bm, bn, xd.device, None)[0]
        times = {"rule": _graph(wts, lambda wd, ws: G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=BF16,
                                                                            split_k=split, sliced=False))}
        for st in (3, 4, 6):
            times[f"st{st}"] = _graph(wts, lambda wd, ws, st=st: G.fp8_block_gemm_triton(
                xd, xs, wd, ws, out_dtype=BF16, split_k=split, num_warps=warps, num_stages=st, sliced=False))
        best = min(times[f"st{st}"] for st in (3, 4, 6))
        cells = " ".join(f"{name}={t:6.2f}" for name, t in times.items())
        rep.say(f"  {n:5d}x{k:5d} M={m:2d} BM={bm} s{split}: rule {P._decode_stages(-(-n // bn) * split, sms)} | "
                f"{cells} | best {n * k / best / 1e6:4.2f} TB/s")


def _wgmma_variants(m: int, n: int, k: int, sms: int) -> list[tuple[int, int, int]]:
    """(splits, groups per stage, stages) worth timing: 1-8 splits (distinct partitions; above one split >= 4 groups
    per split and <= 6 programs per SM), 2 or 4 groups per stage, at `swap_stages`' depth and, where every program
    has an SM to itself, also at the deepest pipeline that fits."""
    from engine.kernels import gemm_wgmma as GW

    kb = -(-k // 128)
    seen, out = set(), []
    for sp in (1, 2, 3, 4, 6, 8):
        for gps in (2, 4):
            s_eff, per = GW.split_plan(kb, sp, gps)
            progs = -(-n // 64) * s_eff
            if (s_eff, per, gps) in seen or (s_eff > 1 and (per < 4 or progs > 6 * sms)):
                continue
            seen.add((s_eff, per, gps))
            depths = [GW.swap_stages(m, kb, s_eff, gps)]
            if progs <= sms:
                depths.append(max((st for st in range(depths[0], 9) if st <= -(-per // gps) and
                                   GW.plan_error(m, n, k, 64, st, gps, s_eff, True) is None), default=depths[0]))
            out += [(s_eff, gps, st) for st in sorted(set(depths))
                    if GW.plan_error(m, n, k, 64, st, gps, s_eff, True) is None]
    return out


def wgmma_split(rep: Report, sms: int, shapes=STAGE_GRID) -> None:
    from engine.kernels import decode_plan as P
    from engine.kernels import gemm as G

    without = dataclasses.replace(P.DEFAULT_POLICY, wgmma_rule=False)
    rep.say(f"\n## wgmma split rule: us per call in a CUDA graph (64 calls over weight copies), {sms} SMs")
    for n, k, m, wts, xd, xs in _points(shapes, (4, 16, 32)):
        row = [(_graph(wts, lambda wd, ws, p=p: G.fp8_block_linear(xd, xs, wd, ws, out_dtype=BF16, policy=p)), name)
               for name, p in (("prod", without), ("rule", P.DEFAULT_POLICY))]
        for s, gps, st in _wgmma_variants(m, n, k, sms):
            cfg = dict(wgmma=gps, split_k=s, block_n=64, num_stages=st)
            t = rep.case(f"{n}x{k} M={m} {cfg}", lambda cfg=cfg: _graph(
                wts, lambda wd, ws: G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=BF16, **cfg)))
            if t is not None:
                row.append((t, f"w{s}g{gps}n{st}"))
        _row(rep, n, k, m, P._tiles(m)[0], f"heuristic prod {row[0][0]:7.2f} us", row, n * k + wts[0][1].numel() * 4)


def mx_split(rep: Report, sms: int, ms=(1, 4, 16, 32), shapes=MX_SHAPES) -> None:
    from engine.formats import quantize
    from engine.kernels import decode_plan as P
    from engine.kernels import gemm_mx as GM

    for xkind, wspec in (("bf16", "mxfp4"), ("bf16", "nvfp4"), ("mxfp8", "mxfp8")):
        rep.say(f"\n## split rule, MX GEMM {xkind} x {wspec}: us per call in a CUDA graph (64 calls over weight "
                f"copies), {sms} SMs")
        for n, k in shapes:
            g = torch.Generator(device=DEVICE).manual_seed(n + k)
            wps = [GM.prepare_mx_weight(quantize(torch.randn(n, k, device=DEVICE, generator=g), wspec))]
            wps += [GM.prepare_mx_weight(quantize(torch.randn(n, k, device=DEVICE, generator=g), wspec))
                    for _ in range(max(3, -(-ROTATE_BYTES // wps[0].nbytes)) - 1)]
            for m in ms:
                xsrc = torch.randn(m, k, device=DEVICE, generator=g)
                q = quantize(xsrc, "mxfp8") if xkind == "mxfp8" else None
                args, kw = ((q.data,), {"x_scale": q.scale}) if q is not None else ((xsrc.to(BF16),), {})
                bm, bn, _, _ = P._tiles(m)
                steps = -(-k // 128)
                row = [(graph_us([lambda wp=wp, s=s: GM.mx_linear(*args, wp, split_k=s, **kw) for wp in wps]), f"s{s}")
                       for s in (1, 2, 4, 8, 16) if steps // s >= 2]
                heur = P._plan_split(m, n, steps, bm, bn, xsrc.device, None, mx=True)[0]
                _row(rep, n, k, m, bm, f"heuristic s{heur}", row, wps[0].nbytes)


def configs(rep: Report, sms: int) -> None:
    from engine.kernels import decode_plan as P
    from engine.kernels import gemm as G

    name = torch.cuda.get_device_name()
    pol = P.DEFAULT_POLICY
    rep.say(f"\n## {name} configs: us per call in a CUDA graph (64 calls over weight copies), entry vs the policy "
            f"without it, {sms} SMs")
    ms_by_bm = {16: (4, 16), 32: (24, 32), 64: (64,)}
    entries = [(key, (m,)) for key in pol.decode_configs if key[0] == name for m in ms_by_bm[key[3]]]
    entries += [(key, (1,)) for key in pol.gemv_configs if key[0] == name]
    for key, (m,) in entries:
        gemv = len(key) == 3
        table = "gemv_configs" if gemv else "decode_configs"
        without = dataclasses.replace(pol, **{table: MappingProxyType(
            {k: v for k, v in getattr(pol, table).items() if k != key})})
        n, k = key[1], key[2]
        wts = _weights(n, k)
        xd, xs, _, _ = fp8_block_operands(m, 16, k, seed=m)
        t = {label: _graph(wts, lambda wd, ws, p=p: G.fp8_block_linear(xd, xs, wd, ws, out_dtype=BF16, policy=p))
             for label, p in (("entry", pol), ("without", without))}
        knobs = dict(getattr(pol, table)[key])
        rep.say(f"  {n:6d}x{k:5d} M={m:2d} {'gemv' if gemv else f'BM={key[3]}'} {json.dumps(knobs)}: entry "
                f"{t['entry']:7.2f} us vs {t['without']:7.2f} us without ({t['without'] / t['entry']:.3f}x)")


SWEEPS = {"split_rule": split_rule, "decode_stages": decode_stages,
          "decode_stages_check": lambda rep, sms: decode_stages(rep, sms, STAGE_CHECK),
          "wgmma_split": wgmma_split,
          "wgmma_split_check": lambda rep, sms: wgmma_split(rep, sms, STAGE_CHECK),
          "wgmma_split_check2": lambda rep, sms: wgmma_split(rep, sms, WGMMA_CHECK2),
          "wgmma_split_check3": lambda rep, sms: wgmma_split(rep, sms, WGMMA_CHECK3),
          "mx_split": mx_split, "mx_split64": lambda rep, sms: mx_split(rep, sms, ms=(48, 64)),
          "mx_split_check": lambda rep, sms: mx_split(rep, sms, ms=(4, 16, 32), shapes=MX_CHECK),
          "configs": configs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", required=True, help=f"comma-separated sweeps of {', '.join(SWEEPS)}")
    ap.add_argument("--out", default=None, help="folder for probe_<sweep>.txt (default: $OUT; else print only)")
    args = ap.parse_args(argv)
    only = args.only.split(",")
    if set(only) - set(SWEEPS):
        ap.error(f"--only: unknown sweep(s) {sorted(set(only) - set(SWEEPS))}; choose from {', '.join(SWEEPS)}")
    if not torch.cuda.is_available():
        ap.error("the sweeps time kernels on a CUDA GPU; none is visible")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fp = fingerprint()
    for sweep in only:
        rep = Report()
        rep.say(json.dumps(fp))
        rep.say(f"HBM copy ceiling: {copy_ceiling()['tbs']:.2f} TB/s")
        SWEEPS[sweep](rep, sms)
        rep.write(f"probe_{sweep}", {"fingerprint": fp, "errors": rep.records}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
