"""Which kernel and knobs a GEMM call runs (engine/kernels/decode_plan.py): the decode policy's measured configs
(`engine/kernels/configs/<device>.json`) -- every entry is one the kernels accept, the dispatch runs what an entry
says, entries loaded from a JSON file (`benchmarks/bench_e2e.py --decode-configs`) are validated with errors naming
the file and entry -- and the policy's rules for calls without one (split rule, stages, whole-K, sliced, wgmma), scored
on the committed H200 sweeps.

Markers: none (CPU: kernels stood in by recorders); `gpu` + `interpreter` (an entry dispatched, on the GPU and on CPU
tensors under TRITON_INTERPRET=1); `interpreter` alone (every committed entry's knob set at the interpreter's
tolerance); `gpu` (each entry for this GPU on its real shape).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.kernels import gemm as G
from engine.kernels import decode_plan as P
from engine.kernels import gemm_fp8 as GF
from engine.kernels import splitk as SK
from engine.kernels import gemm_wgmma as GW
from tests.engine.kernels.gemm.common import TOL, TOL_INTERPRETER, Launch, block_operands, rel
from tests.engine.kernels.gemm.common import zero_operands as _operands
from tests.support import decode_rules as E

GEMM_TOL = TOL[torch.float32]


@pytest.mark.parametrize("key", sorted(P.DEFAULT_POLICY.decode_configs))
def test_every_table_entry_is_runnable(key):
    """Only known knobs; a whole-K entry plans for the largest M of its tile (BM rows) with its default stages; a
    split-K entry's block_n divides the 128-row scale blocks and its split count leaves no split empty."""
    _, n, k, bm = key
    knobs = P.DEFAULT_POLICY.decode_configs[key]
    assert set(knobs) <= set(P.DECODE_KNOBS)
    assert all(P._KNOB_VALUES[name][0](v) for name, v in knobs.items())  # what an entry file may hold, too
    bn = knobs.get("block_n") or P._tiles(bm)[1]
    if knobs.get("whole_k"):
        gps = knobs["whole_k"] if knobs["whole_k"] in (2, 4) else GW.GPS
        stages = knobs.get("num_stages") or GW.default_stages(bn, gps)
        assert GW.plan_error(bm, n, k, bn, stages, gps) is None
    elif knobs.get("wgmma"):  # the swapped wgmma kernel at the smallest and largest M of the tile
        gps = knobs["wgmma"] if knobs["wgmma"] in (2, 4) else GW.GPS
        assert bn == 64 and GW.split_plan(-(-k // 128), knobs["split_k"], gps)[0] == knobs["split_k"]
        for m in (2, bm):
            stages = knobs.get("num_stages") or GW.swap_stages(m, -(-k // 128), knobs["split_k"], gps)
            assert GW.plan_error(m, n, k, bn, stages, gps, knobs["split_k"], True) is None
    else:
        assert bn in (16, 32, 64, 128) and knobs["split_k"] >= 1
        splits, per = P._plan_split(bm, n, -(-k // 128), bm, bn, torch.device("cpu"), knobs["split_k"])
        assert splits == knobs["split_k"] and (splits - 1) * per < -(-k // 128)


def _h200(monkeypatch):
    """Dispatch as if the tensors lived on the H200 the table was measured on."""
    monkeypatch.setattr(P, "_device_name", lambda *a: "NVIDIA H200")


def test_batch64_entries_dispatch(monkeypatch):
    """M = 40 (tile BM 64) on the Llama-3-8B shapes: 4096x4096 runs the whole-K kernel with 64 rows x 4 groups per
    stage, 28672x4096 one split of 128-row tiles; M = 8 (BM 16) on 4096x4096 four splits of 64 rows, fused reduce."""
    _h200(monkeypatch)
    launched = []
    monkeypatch.setattr(GW, "usable", lambda *a: True)
    monkeypatch.setattr(GW, "launch", lambda *a, **kw: launched.append(a[-3:]))
    x, xs, w, ws = _operands(m=40, n=4096, k=4096)
    GF._launch_fp8(x, xs, xs.stride(), w, ws, ws.stride(), None, torch.float32, None)
    assert launched == [(64, GW.default_stages(64, 4), 4)]

    split = Launch()
    monkeypatch.setattr(GF, "_fp8_block_gemm_kernel", split)
    x, xs, w, ws = _operands(m=40, n=28672, k=4096)
    GF._launch_fp8(x, xs, xs.stride(), w, ws, ws.stride(), None, torch.float32, None)
    grid, _, meta = split.calls[-1]
    assert grid == (28672 // 128, 1, 1) and meta["BN"] == 128 and meta["num_stages"] == 3
    x, xs, w, ws = _operands(m=8, n=4096, k=4096)
    GF._launch_fp8(x, xs, xs.stride(), w, ws, ws.stride(), None, torch.float32, None)
    grid, _, meta = split.calls[-1]
    assert grid == (4096 // 64, 1, 4) and meta["BN"] == 64 and meta["num_stages"] == 4 and meta["FUSED_REDUCE"] is True
    assert len(launched) == 1


def test_loaded_entries_replace_the_table_for_the_run(tmp_path, monkeypatch):
    """A file's entries, added to a policy (`with_configs`), replace a measured one with the same key for the run;
    the default policy keeps the shipped entry."""
    rows = [dict(device="NVIDIA H200", n=4096, k=4096, bm=64, knobs=dict(split_k=2, block_n=64, num_warps=8)),
            dict(device="Other GPU", n=512, k=1024, bm=16, knobs=dict(whole_k=2))]
    path = tmp_path / "entries.json"
    path.write_text(json.dumps(rows))
    got = P.load_decode_configs(str(path))
    assert got == {("NVIDIA H200", 4096, 4096, 64): dict(split_k=2, block_n=64, num_warps=8),
                   ("Other GPU", 512, 1024, 16): dict(whole_k=2)}
    policy = P.DEFAULT_POLICY.with_configs(got)
    assert policy.decode_configs[("NVIDIA H200", 4096, 4096, 64)] == dict(split_k=2, block_n=64, num_warps=8)
    assert P.DEFAULT_POLICY.decode_configs[("NVIDIA H200", 4096, 4096, 64)] == dict(whole_k=4, block_n=64)
    _h200(monkeypatch)
    cpu = torch.device("cpu")
    assert P._decode_knobs(33, 4096, 4096, cpu, {}, policy) == dict(split_k=2, block_n=64, num_warps=8)
    assert P._decode_knobs(33, 4096, 4096, cpu, dict(split_k=1), policy) == dict(split_k=1)
    assert P._decode_knobs(33, 4096, 4096, cpu, {}) == dict(whole_k=4, block_n=64)


@pytest.mark.parametrize("text, needle", [
    (None, "cannot read"),
    ("[{", "not JSON"),
    ('{"n": 1}', "JSON list"),
    ('[{"device": "g", "n": 1, "k": 2, "bm": 16}]', "entry 0: expected the keys"),
    ('[{"device": "g", "n": 1, "k": 2, "bm": 16, "knobs": {}, "x": 1}]', "entry 0: expected the keys"),
    ('[{"device": "g", "n": -1, "k": 2, "bm": 16, "knobs": {"split_k": 2}}]', "positive integers"),
    ('[{"device": "g", "n": 1, "k": 2, "bm": 48, "knobs": {"split_k": 2}}]', "bm=48"),
    ('[{"device": "g", "n": 1, "k": 2, "bm": 16, "knobs": {"split_k": 2}}, '
     '{"device": "g", "n": 1, "k": 2, "bm": 16, "knobs": {"splitk": 2}}]', "entry 1: unknown knob(s) ['splitk']"),
    ('[{"device": "g", "n": 1, "k": 2, "bm": 16, "knobs": {}}]', "(none given)"),
    ('[{"device": "g", "n": true, "k": 2, "bm": 16, "knobs": {"split_k": 2}}]', "positive integers"),
    ('[{"device": "g", "n": 1, "k": 2, "bm": 16, "knobs": {"block_n": 48}}]', "entry 0: block_n=48; use 16, 32, 64"),
    ('[{"device": "g", "n": 1, "k": 2, "bm": 16, "knobs": {"whole_k": 3}}]', "whole_k=3; use true, 2 or 4"),
    ('[{"device": "g", "n": 1, "k": 2, "bm": 16, "knobs": {"split_k": 0}}]', "split_k=0; use a positive integer"),
    ('[{"device": "g", "n": 1, "k": 2, "bm": 16, "knobs": {"fused_reduce": 1}}]', "fused_reduce=1; use true or false"),
    ('[{"device": "g", "n": 1, "k": 2, "bm": 16, "knobs": {"sliced": true}}]', "sliced=True; use false, 2, 4 or 8"),
    ('[{"device": "g", "n": 1, "k": 2, "bm": 16, "knobs": {"sliced": 3}}]', "sliced=3; use false, 2, 4 or 8"),
])
def test_bad_entry_files_are_refused_by_name(tmp_path, monkeypatch, text, needle):
    """Each malformed file is refused with its path and what is wrong (entry index, key, value)."""
    path = tmp_path / "bad.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError) as err:
        P.load_decode_configs(str(path))
    assert str(path) in str(err.value) and needle in str(err.value)


@pytest.mark.parametrize("tiles, steps, splits", [(32, 16, 4), (64, 32, 2), (96, 32, 2), (128, 32, 1), (224, 56, 1),
                                                  (16, 32, 8), (2, 16, 4), (1, 512, 16), (64, 8, 2)])
def test_split_rule_fills_the_sms_once(monkeypatch, tiles, steps, splits):
    """The heuristic splits K until the programs about fill 132 SMs (0.9 per SM), keeping >= 4 steps per split and
    at most 16 splits. The MX kernel by its own sweep: 2 per SM and at least 2 splits at BM 16, 1.5 per SM at BM 32."""
    assert P._split_k(tiles, steps, 132, P.DEFAULT_POLICY.split_fill) == splits
    assert P.mx_split_k(64, 32, 132, 16) == 8 and P.mx_split_k(96, 32, 132, 16) == 4  # 4096 / 6144 rows
    assert P.mx_split_k(448, 32, 132, 16) == 2  # 28672 rows: 2 per SM alone gives one split, 7-13% slower
    assert P.mx_split_k(448, 7, 132, 16) == 1  # ... but not below 4 chunks per split
    assert P.mx_split_k(64, 112, 132, 32) == 4 and P.mx_split_k(448, 32, 132, 32) == 1  # BM 32: 1.5 per SM
    assert P.mx_split_k(64, 112, 132, 64) == 4  # BM 64 takes BM 32's rule
    monkeypatch.setattr(P, "sm_count", lambda device: 132)
    monkeypatch.setattr(GF, "sm_count", lambda device: 132)
    assert P._plan_split(12, 64 * tiles, steps, 16, 64, torch.device("cpu"), None)[0] == splits


def test_heuristic_whole_k_only_for_64_row_tiles_on_cuda(monkeypatch):
    """33-64 rows on CUDA: whole-K, 64-row weight tiles from N = 4096, 32 below; fewer rows, the CPU, or the switch
    off: nothing (the split rule)."""
    cuda = torch.device("cuda")
    assert P._heuristic_whole_k(33, 4096, cuda) == dict(whole_k=4, block_n=64)
    assert P._heuristic_whole_k(64, 2048, cuda) == dict(whole_k=4, block_n=32)
    assert P._heuristic_whole_k(32, 4096, cuda) == {} and P._heuristic_whole_k(65, 4096, cuda) == {}
    assert P._heuristic_whole_k(48, 4096, torch.device("cpu")) == {}
    assert P._heuristic_whole_k(48, 4096, cuda, dataclasses.replace(P.DEFAULT_POLICY, whole_k_at_bm64=False)) == {}


@pytest.mark.parametrize("opt_out", [{}, {"sliced": False}, {"wgmma": False}, {"sliced": False, "wgmma": False}])
@pytest.mark.parametrize("usable", [True, False])
def test_heuristic_whole_k_dispatch_and_fallback(monkeypatch, usable, opt_out):
    """Without knobs or entry, a 48-row call runs the heuristic's whole-K kernel; where it cannot run, the split rule
    (not one split, as for an explicit whole_k). Opting out of the sliced or wgmma kernels changes neither."""
    monkeypatch.setattr(P, "_heuristic_whole_k", lambda m, n, d, policy=None: dict(whole_k=4, block_n=64) if m > 32 else {})
    monkeypatch.setattr(GW, "usable", lambda *a: usable)
    monkeypatch.setattr(P, "sm_count", lambda device: 132)
    monkeypatch.setattr(GF, "sm_count", lambda device: 132)
    monkeypatch.setattr(SK, "_reduce", lambda *a, **kw: None)  # off CUDA the partials' reduce is a second kernel
    launched, split = [], Launch()
    monkeypatch.setattr(GW, "launch", lambda *a, **kw: launched.append(a[-3:]))
    monkeypatch.setattr(GF, "_fp8_block_gemm_kernel", split)
    x, xs, w, ws = _operands(m=48, n=512, k=4096)
    GF._launch_fp8(x, xs, xs.stride(), w, ws, ws.stride(), None, torch.float32, None, **opt_out)
    if usable:
        assert launched == [(64, GW.default_stages(64, 4), 4)] and not split.calls
    else:
        grid, _, meta = split.calls[0]
        want = P._plan_split(48, 512, 32, 64, 64, x.device, None)[0]
        assert not launched and want > 1 and grid == (512 // 64, 1, want) and meta["BN"] == 64


@pytest.mark.parametrize("m", [2, 4, 8, 9, 16, 17, 32])
@pytest.mark.parametrize("nk", [(1536, 8960), (2048, 14336), (3584, 18944), (4096, 4096), (4096, 7168), (5120, 13824),
                                (6144, 4096), (8192, 28672), (10240, 8192), (28672, 4096), (151936, 2048),
                                (4096, 65536), (200, 1024)])
def test_wgmma_plan_keeps_its_rule(m, nk):
    """The wgmma rule's plan on 132 SMs: a plan the kernel accepts; one split (the fewest the scale table allows) from
    WGMMA_RULE_WIDE x SMs weight tiles; below that, up to WGMMA_RULE_MAX_SPLITS splits: at 8 activation rows the most
    whose programs stay within WGMMA_RULE_FILL8 per SM, above 8 the fewest that fill the SMs' last wave best, each
    keeping >= WGMMA_RULE_MIN_GROUPS8 / WGMMA_RULE_MIN_GROUPS groups per split; the deepest pipeline (2 groups per
    stage at 8 rows, else 4) exactly where every program has an SM to itself."""
    n, k = nk
    plan = P.wgmma_plan(m, n, k, 132)
    splits, gps, stages = plan
    tiles, kb = -(-n // 64), -(-k // 128)
    rows = GW.x_rows(m, True)
    fewest = -(-kb // GW.MAX_GROUPS)  # these shapes' fewest splits the 128-group scale table allows
    assert GW.split_plan(kb, splits, gps)[0] == splits
    assert GW.plan_error(m, n, k, 64, stages or GW.swap_stages(m, kb, splits, gps), gps, splits, True) is None
    if tiles >= P.DEFAULT_POLICY.wgmma_wide * 132:
        assert splits == fewest
    else:
        assert splits == fewest or splits <= P.DEFAULT_POLICY.wgmma_max_splits
        ok = [s for s in range(fewest, max(fewest, P.DEFAULT_POLICY.wgmma_max_splits) + 1)
              if GW.split_plan(kb, s, 2)[0] == s and (s == 1 or -(-kb // s) >= 4)]
        if rows == 8:
            ok = [s for s in ok if s == fewest or kb / s >= P.DEFAULT_POLICY.wgmma_min_groups8]
            assert splits in ok and (splits == fewest or tiles * splits <= P.DEFAULT_POLICY.wgmma_fill8 * 132)
            assert all(tiles * s > P.DEFAULT_POLICY.wgmma_fill8 * 132 for s in ok if s > splits)
        else:
            ok = [s for s in ok if s == fewest or kb / s >= P.DEFAULT_POLICY.wgmma_min_groups]
            fill = lambda s: tiles * s / (132 * -(-tiles * s // 132))
            assert splits in ok and all(fill(s) < fill(splits) - 1e-9 if s < splits else fill(s) <= fill(splits) + 1e-9
                                        for s in ok)
    if tiles * splits <= 132:
        assert stages is not None and gps == (2 if rows == 8 else 4) or stages is not None and gps == 2
        per = GW.split_plan(kb, splits, gps)[1]
        deeper = stages + 1
        assert deeper > P.DEFAULT_POLICY.wgmma_max_stages or deeper > -(-per // gps) or \
            GW.plan_error(m, n, k, 64, deeper, gps, splits, True) is not None
    else:
        assert (gps, stages) == (2, None)


def test_wgmma_plan_examples(monkeypatch):
    """Worked examples of the rule (132 SMs): wide weights one split; 64 tiles at 8 rows 4 splits (2 per SM), at 16
    rows 2 (one full wave; 4 fill two as well) with 4 groups x 5 stages, but one split where two would leave 16 groups
    each; 80 tiles 3 splits (240 programs: 91% of two waves) where K has the groups; a K whose scale table needs 2
    splits gets them; no plan for M = 1, above 32 rows, or a K the kernel's TMA cannot read. A changed constant
    changes the (memoized) plan."""
    assert P.wgmma_plan(4, 8192, 4096, 132) == (1, 2, 8)
    assert P.wgmma_plan(16, 28672, 4096, 132) == (1, 2, None)
    assert P.wgmma_plan(4, 4096, 7168, 132) == (4, 2, None)
    assert P.wgmma_plan(16, 4096, 7168, 132) == (2, 4, 5)
    assert P.wgmma_plan(16, 4096, 4096, 132)[0] == 1 and P.wgmma_plan(4, 4096, 4096, 132)[0] == 3
    assert P.wgmma_plan(4, 3072, 2048, 132)[0] == 1  # 16 groups: two splits would leave 8 each
    assert P.wgmma_plan(32, 8192, 28672, 132) == (2, 2, None)
    assert P.wgmma_plan(16, 5120, 13824, 132) == (3, 2, None) and P.wgmma_plan(16, 5120, 5120, 132)[0] == 1
    assert P.wave_fill(240, 132) == pytest.approx(240 / 264) and P.wave_fill(128, 132) == P.wave_fill(256, 132)
    assert P.wgmma_plan(1, 4096, 4096, 132) is None and P.wgmma_plan(33, 4096, 4096, 132) is None
    assert P.wgmma_plan(8, 200, 1000, 132) is None  # K % 16
    fill8 = dataclasses.replace(P.DEFAULT_POLICY, wgmma_fill8=1.0)  # the memo is keyed by the rule's constants too
    assert P.wgmma_plan(4, 4096, 7168, 132, fill8)[0] == 2 and P.wgmma_plan(4, 4096, 7168, 132)[0] == 4


def test_heuristic_wgmma_only_on_sm90_cuda(monkeypatch):
    """The rule's knobs on an sm_90 CUDA device while the policy's wgmma_rule; nothing on the CPU, on other GPUs, with the switch
    off, or without a plan (M = 1 / above 32 rows)."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(P, "sm_count", lambda device: 132)
    monkeypatch.setattr(GF, "sm_count", lambda device: 132)
    monkeypatch.setattr(P, "_sm90", lambda index: True)
    assert P._heuristic_wgmma(16, 4096, 7168, cuda) == dict(wgmma=4, split_k=2, block_n=64, num_stages=5)
    assert P._heuristic_wgmma(16, 28672, 4096, cuda) == dict(wgmma=2, split_k=1, block_n=64)
    assert P._heuristic_wgmma(1, 4096, 7168, cuda) == {} and P._heuristic_wgmma(40, 4096, 7168, cuda) == {}
    assert P._heuristic_wgmma(16, 4096, 7168, torch.device("cpu")) == {}
    assert P._heuristic_wgmma(16, 4096, 7168, cuda, dataclasses.replace(P.DEFAULT_POLICY, wgmma_rule=False)) == {}
    monkeypatch.setattr(P, "_sm90", lambda index: False)
    assert P._heuristic_wgmma(16, 4096, 7168, cuda) == {}


@pytest.mark.parametrize("opt_out", [{}, {"sliced": False}, {"wgmma": False}])
@pytest.mark.parametrize("usable", [True, False])
def test_heuristic_wgmma_dispatch_and_fallback(monkeypatch, usable, opt_out):
    """Without knobs or entry, a 12-row call runs the rule's wgmma plan (splits, groups per stage, stages); where the
    kernel cannot run, or with wgmma=False, the split rule's own split-K call (its split count, not the plan's)."""
    plan = dict(wgmma=4, split_k=3, block_n=64, num_stages=5)
    monkeypatch.setattr(P, "_heuristic_wgmma", lambda m, n, k, d, policy=None: dict(plan) if m <= 32 else {})
    monkeypatch.setattr(GW, "usable", lambda *a: usable)
    monkeypatch.setattr(P, "sm_count", lambda device: 132)
    monkeypatch.setattr(GF, "sm_count", lambda device: 132)
    monkeypatch.setattr(SK, "_reduce", lambda *a, **kw: None)
    launched, split = [], Launch()
    monkeypatch.setattr(GW, "launch", lambda *a, **kw: launched.append((a[-3:], kw.get("splits"), kw.get("swap"))))
    monkeypatch.setattr(GF, "_fp8_block_gemm_kernel", split)
    monkeypatch.setattr(GF, "_launch_sliced", lambda *a, **kw: split.calls.append(("sliced", a, kw)))
    x, xs, w, ws = _operands(m=12, n=512, k=4096)
    GF._launch_fp8(x, xs, xs.stride(), w, ws, ws.stride(), None, torch.float32, None, **opt_out)
    if usable and not opt_out.get("wgmma") is False:
        assert launched == [((64, 5, 4), 3, True)] and not split.calls
    else:
        want = P._plan_split(12, 512, 32, 16, 64, x.device, None)[0]
        assert not launched and want != 3
        grid, _, meta = split.calls[0]
        assert grid == (512 // 64, 1, want) and meta["BN"] == 64


def test_the_wgmma_rule_scores_as_measured_on_the_committed_sweeps():
    """The wgmma rule on its four H200 sweeps (2026-11-30, tests/data/decode_sweeps/): the rule's pick is within 3% of
    the best variant and at least 10% faster than the split-K heuristic (geometric means), at worst 12% slower than it;
    a rule whose picks the sweeps did not time fails here."""
    for path in E.WGMMA_SWEEPS:
        sms, rows = E.read_sweep(path)
        assert sms == 132 and len(rows) >= 36
        s = E.score_wgmma(sms, rows, path)
        assert s["best"]["all"] < 1.03 and s["prod"]["all"] < 0.9 and s["worst"]["prod"][0] < 1.12
    with pytest.raises(ValueError, match="no time for the rule's pick"):
        E.score_wgmma(132, {(4096, 7168, 16, 16): {"prod": 1.0, "w1g2n5": 1.0}}, Path("sweep.txt"))


def test_the_heuristic_scores_as_measured_on_the_committed_sweep():
    """The split rule on its H200 sweep (2026-11-30, tests/data/decode_sweeps/): the rule in the code picks within 6% of
    the best variant (geometric mean over 63 points, each tile height within 6%) and beats the old 2-per-SM rule;
    changing SPLIT_FILL or the whole-K switch without a new sweep fails here."""
    sms, rows = E.read_sweep(E.SPLIT_SWEEP)
    assert sms == 132 and len(rows) == 63
    now = E.score_splits(sms, rows, P.DEFAULT_POLICY.split_fill, P.DEFAULT_POLICY.whole_k_at_bm64)
    old = E.score_splits(sms, rows, 2.0, False)
    assert all(g < 1.06 for g in now["geo"].values()) and now["worst"][0] < 1.4
    assert old["geo"]["all"] > 1.2 > now["geo"]["all"] * 1.1


@pytest.mark.parametrize("reader,cases", [
    ("read_sweep", [("## decode\n  4096x4096 M=4 something\n", "other.txt: no '<n> SMs' header"),
                                       ("## split rule ... 132 SMs\n", "no sweep rows")]),
    ("read_stage_sweep", [
        ("## split rule ... 132 SMs\n  4096x4096 M=4 BM=16 s2: | st3=1 st4=2 st6=3 |\n",
         "other.txt: no '## decode pipeline depth"),
        ("## decode pipeline depth: us per call, 132 SMs\n", "no probe rows"),
        ("## decode pipeline depth: us per call, 132 SMs\n  4096x 4096 M= 4 BM=16 s2: x | st3= 1.0 |\n",
         "lacks the st3 / st4 / st6 columns")])])
def test_rule_evals_refuse_other_files(tmp_path, reader, cases):
    """A file that is not the sweep a rule evaluator reads is refused by name, saying what is missing."""
    read = getattr(E, reader)
    bad = tmp_path / "other.txt"
    for text, needle in cases:
        bad.write_text(text)
        with pytest.raises(ValueError, match=needle):
            read(bad)


@pytest.mark.parametrize("programs,stages", [(1, 6), (132, 6), (133, 4), (264, 4), (265, 3), (2004, 3)])
def test_decode_stages_by_programs_per_sm(programs, stages):
    """The pipeline depth of decode calls without an entry: 6 stages up to one program per SM, 4 up to two, then 3."""
    assert P._decode_stages(programs, 132) == stages


def test_decode_stage_choice_defaults_to_the_rule():
    assert P._decode_stages(10, 0) == 3  # no SM count: treated as one SM


def test_the_stage_rule_scores_as_measured_on_the_committed_sweeps():
    """The stage rule on its H200 sweeps (2026-11-30, tests/data/decode_sweeps/), timed as a decode step runs: the rule
    in the code picks within 1% of the best fixed depth (geometric mean) on the 48 points it was fitted on and within 3%
    on 36 held-out ones, and beats the autotuner it replaced on both; changing DECODE_STAGES without a new sweep fails
    here."""
    fit, check = (E.score_stages(*E.read_stage_sweep(path), P.DEFAULT_POLICY.decode_stages) for path in E.STAGE_SWEEPS)
    assert fit["points"] == 48 and check["points"] == 36
    assert fit["rule"][0] < 1.01 and fit["rule"][1] < 1.06 and check["rule"][0] < 1.03
    assert fit["rule"][0] < fit["auto"][0] and check["rule"][0] < check["auto"][0]
    assert fit["rule"][1] < fit["auto"][1] and check["rule"][1] < check["auto"][1]
    always4 = E.score_stages(*E.read_stage_sweep(E.STAGE_SWEEPS[0]), ((float("inf"), 4),))
    assert always4["rule"][0] > 1.04  # the best single depth is not as good: the rule's thresholds matter


def test_the_mx_split_rule_scores_as_measured_on_the_committed_sweep():
    """The MX split rule on its H200 sweep of the MX GEMM (2026-11-30; bf16 x MXFP4 / NVFP4, MXFP8 x MXFP8, CUDA
    graphs): MX_SPLIT_RULE picks within 1% of the best split count per pair (geometric mean) and beats both fills it
    replaced (2 and 4 programs per SM) over the three pairs and at the worst point; on the later sweeps it was not
    fitted on (BM 64; held-out shapes) it holds the scores its comment records; changing it without a new sweep fails
    here."""
    import math

    sections = E.read_sections(E.MX_SWEEP)
    assert len(sections) == 3 and all(len(rows) == 24 for _, rows in sections.values())
    now = [E.score_splits(sms, rows, P.mx_split_k, False) for sms, rows in sections.values()]
    assert all(s["geo"]["all"] < 1.01 for s in now)

    def overall(scores):
        return math.prod(s["geo"]["all"] for s in scores) ** (1 / len(scores))

    for fill in (2.0, 4.0):
        old = [E.score_splits(sms, rows, fill, False) for sms, rows in sections.values()]
        assert overall(now) < overall(old) - 0.01
        assert max(s["worst"][0] for s in now) < max(s["worst"][0] for s in old) - 0.05
    # the sweeps the rule was not fitted on: BM 64 within 2.5% (4 per SM: 21-22% off), and the four held-out shapes
    # within 8.5% per pair, as its comment records (4 per SM does better there)
    bm64_sweep, held_sweep = E.MX_CHECK
    bm64 = [E.score_splits(sms, rows, P.mx_split_k, False) for sms, rows in E.read_sections(bm64_sweep).values()]
    assert all(set(s["geo"]) == {64, "all"} and s["geo"]["all"] < 1.025 for s in bm64)
    four64 = [E.score_splits(sms, rows, 4.0, False) for sms, rows in E.read_sections(bm64_sweep).values()]
    assert overall(four64) > overall(bm64) + 0.15
    held = [E.score_splits(sms, rows, P.mx_split_k, False) for sms, rows in E.read_sections(held_sweep).values()]
    assert all(s["geo"]["all"] < 1.085 for s in held) and max(s["worst"][0] for s in held) < 1.22


def test_sliced_auto_rule_and_knob(monkeypatch):
    """Split-K calls run as the sliced kernel on CUDA only with 2 / 4 splits of 64-row tiles, 4 warps, and M <= 16 /
    splits (the slices' activation columns within the split-K kernel's 16); sliced=False or a policy with sliced_auto
    off keep split-K. sliced=False alone still takes the shape's decode entry; an entry file may say "sliced": false
    or a slice count."""
    cuda, cpu = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)
    assert P._sliced_instead(cuda, 4, 4, 64, 4, {}) and P._sliced_instead(cuda, 8, 2, 64, 4, {})
    assert P._sliced_instead(cuda, 1, 4, 64, 4, {"fused_reduce": True})
    for x, m, splits, bn, warps, cfg in ((cpu, 4, 4, 64, 4, {}), (cuda, 5, 4, 64, 4, {}), (cuda, 16, 2, 64, 4, {}),
                                         (cuda, 2, 8, 64, 4, {}), (cuda, 4, 1, 64, 4, {}), (cuda, 4, 4, 32, 4, {}),
                                         (cuda, 4, 4, 64, 8, {}), (cuda, 4, 4, 64, 4, {"sliced": False})):
        assert not P._sliced_instead(x, m, splits, bn, warps, cfg), (m, splits, bn, warps, cfg)
    assert not P._sliced_instead(cuda, 4, 4, 64, 4, {}, dataclasses.replace(P.DEFAULT_POLICY, sliced_auto=False))
    key = ("NVIDIA H200", 4096, 14336, 16)
    monkeypatch.setattr(P, "_device_name", lambda *a: "NVIDIA H200")
    got = P._decode_knobs(4, 4096, 14336, torch.device("cpu"), dict(sliced=False))
    assert got == dict(P.DEFAULT_POLICY.decode_configs[key], sliced=False)
    assert P._decode_knobs(4, 4096, 14336, torch.device("cpu"), dict(sliced=4)) == dict(sliced=4)


def test_entry_files_take_the_sliced_knob(tmp_path, monkeypatch):
    """An entry file may pin a shape to split-K ("sliced": false) or to the sliced kernel (a slice count)."""
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps([dict(device="g", n=4096, k=4096, bm=16, knobs=dict(split_k=4, sliced=False)),
                                dict(device="g", n=6144, k=4096, bm=16, knobs=dict(sliced=4, block_n=32))]))
    got = P.load_decode_configs(str(path))
    assert got == {("g", 4096, 4096, 16): dict(split_k=4, sliced=False),
                   ("g", 6144, 4096, 16): dict(sliced=4, block_n=32)}
    assert P.DEFAULT_POLICY.with_configs(got).decode_configs[("g", 6144, 4096, 16)] == dict(sliced=4, block_n=32)


def test_wgmma_knob_dispatch(monkeypatch):
    """wgmma=True: one launch of the swapped wgmma kernel (64-row weight tiles) with the given or the rule's split
    count and `swap_stages` (or the given stages), no split-K launch; not usable here: the split-K kernel with the same
    split count; block_n other than 64 is refused by name. A decode entry with the knob dispatches the same
    way, and wgmma=False alone keeps the entry's split count on the split-K kernel."""
    launched, split = [], Launch()
    monkeypatch.setattr(GW, "usable", lambda *a: True)
    monkeypatch.setattr(GW, "launch", lambda *a, **kw: launched.append((a[-3:], kw)))
    monkeypatch.setattr(GF, "_fp8_block_gemm_kernel", split)
    monkeypatch.setattr(SK, "_splitk_reduce_kernel", Launch())
    x, xs, w, ws = _operands(m=4)  # N 256, K 1024: 8 groups
    GF._launch_fp8(x, xs, xs.stride(), w, ws, ws.stride(), None, torch.float32, 2, wgmma=True)
    GF._launch_fp8(x, xs, xs.stride(), w, ws, ws.stride(), None, torch.float32, 4, wgmma=4, num_stages=3)
    assert launched == [((64, GW.swap_stages(4, 8, 2), GW.GPS), dict(splits=2, swap=True, pdl=True)),
                        ((64, 3, 4), dict(splits=4, swap=True, pdl=True))] and split.calls == []
    assert GW.swap_stages(4, 8, 2) == 2  # 4 groups per split: no more stages than it has stages of 2 groups
    with pytest.raises(ValueError, match="block_n=32"):
        GF._launch_fp8(x, xs, xs.stride(), w, ws, ws.stride(), None, torch.float32, 2, wgmma=True, block_n=32)
    monkeypatch.setattr(GW, "usable", lambda *a: False)
    GF._launch_fp8(x, xs, xs.stride(), w, ws, ws.stride(), None, torch.float32, 2, wgmma=True)
    assert len(launched) == 2 and len(split.calls) == 1 and split.calls[0][0][2] == 2
    monkeypatch.setattr(GW, "usable", lambda *a: True)
    key = (P._device_name(x.device.type, x.device.index), w.shape[0], x.shape[1], 16)
    policy = P.DEFAULT_POLICY.with_configs({key: dict(wgmma=True, split_k=2, block_n=64)})
    GF._launch_fp8(x, xs, xs.stride(), w, ws, ws.stride(), None, torch.float32, None, policy=policy)
    assert len(launched) == 3 and launched[-1][1]["splits"] == 2
    GF._launch_fp8(x, xs, xs.stride(), w, ws, ws.stride(), None, torch.float32, None, wgmma=False, policy=policy)
    assert len(launched) == 3 and len(split.calls) == 2 and split.calls[-1][0][2] == 2


@pytest.mark.parametrize("m", [1, 4, 8, 9, 16, 17, 32, 64])
@pytest.mark.parametrize("kb, splits", [(32, 1), (32, 2), (32, 4), (112, 4), (128, 1), (8, 4)])
def test_swap_stages_keep_two_programs_per_sm(m, kb, splits):
    """The default pipeline keeps a program within SWAP_SMEM_BYTES, so that two fit on one H200 SM (unless 2 stages
    alone exceed it), is the deepest that does, and has no more stages than the split has stages of groups."""
    st = GW.swap_stages(m, kb, splits)
    per = GW.split_plan(kb, splits)[1]
    smem = lambda s: GW.smem_bytes(64, s, per, GW.GPS, GW.x_rows(m, True))
    assert 2 <= st <= max(2, -(-per // GW.GPS))
    assert smem(st) <= GW.SWAP_SMEM_BYTES or st == 2
    assert smem(st + 1) > GW.SWAP_SMEM_BYTES or st >= -(-per // GW.GPS)
    assert 2 * (smem(st) + 1024) <= 228 * 1024 or st == 2


def test_entry_files_take_the_wgmma_knob(tmp_path, monkeypatch):
    """An entry file may select the wgmma kernel (true or 2 / 4 groups per stage) or keep a shape off it (false)."""
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps([dict(device="g", n=4096, k=4096, bm=16, knobs=dict(split_k=2, wgmma=4)),
                                dict(device="g", n=6144, k=4096, bm=16, knobs=dict(split_k=4, wgmma=False))]))
    assert P.load_decode_configs(str(path)) == {("g", 4096, 4096, 16): dict(split_k=2, wgmma=4),
                                                ("g", 6144, 4096, 16): dict(split_k=4, wgmma=False)}
    path.write_text(json.dumps([dict(device="g", n=4096, k=4096, bm=16, knobs=dict(wgmma=3))]))
    with pytest.raises(ValueError, match="wgmma=3"):
        P.load_decode_configs(str(path))


# ------------------------------------------------------------------ entries run
@pytest.mark.gpu
@pytest.mark.interpreter
def test_decode_configs_entry_is_dispatched(monkeypatch):
    """fp8_block_linear runs the policy's decode entry for (device, N, K, BM) exactly as the explicit knobs do."""
    xd, xs, wd, ws = block_operands(3, 256, 640, seed=20)
    dev = xd.device
    key = (P._device_name(dev.type, dev.index), 256, 640, 16)
    cfg = dict(split_k=3, block_n=32, num_warps=4, num_stages=2, fused_reduce=True)
    policy = P.DEFAULT_POLICY.with_configs({key: cfg})
    tuned = G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32, policy=policy)
    explicit = G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.float32, **cfg)
    assert torch.equal(tuned, explicit)
    default = G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32)
    assert rel(default, tuned) < GEMM_TOL


def _measured_entries():
    """The decode entries measured on this GPU ([] without CUDA: collection must not touch a device)."""
    if not torch.cuda.is_available():
        return []
    name = P._device_name("cuda", torch.cuda.current_device())
    return sorted(key for key in P.DEFAULT_POLICY.decode_configs if key[0] == name)


@pytest.mark.gpu
@pytest.mark.parametrize("key", _measured_entries())
def test_measured_decode_configs_entry_on_its_shape(key):
    """Each committed entry for this GPU, on its real (N, K), at the largest and a small M of its tile: within the
    GEMM tolerance of the fp32 reference, and the dispatch's bits equal the explicit knobs' (whole-K entries
    included)."""
    _, n, k, bm = key
    for m in sorted({bm, bm // 2 + 1}):
        xd, xs, wd, ws = block_operands(m, n, k, seed=m + n)
        got = G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32)
        ref = G.fp8_block_linear_reference(xd, xs, wd, ws, out_dtype=torch.float32)
        assert torch.isfinite(got).all() and rel(got, ref) < GEMM_TOL, (key, m)
        explicit = G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.float32, **P.DEFAULT_POLICY.decode_configs[key])
        assert torch.equal(got, explicit), (key, m)


@pytest.mark.interpreter
def test_every_committed_knob_set_runs_exactly():
    """The knobs of every committed decode entry (each distinct set once, at a row count whose tile is the
    entry's; whole-K / wgmma entries run their split-K fallback here, as off the H200; num_stages / num_warps, which
    change nothing under the interpreter, left out of what makes a set distinct) on 136 x 1408 (11 groups: uneven
    splits for split_k 2 / 4 / 8; N off every tile), within 1e-5 of the float64 reference."""
    seen = set()
    for (_, n, k, bm), knobs in P.DEFAULT_POLICY.decode_configs.items():
        key = (bm, tuple(sorted((name, v) for name, v in knobs.items() if name not in ("num_stages", "num_warps"))))
        if key in seen:
            continue
        seen.add(key)
        m = bm - 1 if bm > 16 else 3
        ops = block_operands(m, 136, 1408, seed=bm)
        ref = G.fp8_block_linear_reference(*ops, out_dtype=torch.float32)
        out = G.fp8_block_gemm_triton(*ops, out_dtype=torch.float32, **knobs)
        assert rel(out, ref) <= TOL_INTERPRETER, f"entry knobs {knobs} at BM {bm}: rel err {rel(out, ref):.2e}"
    assert len(seen) >= 5, seen
