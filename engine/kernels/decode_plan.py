"""Which kernel and launch configuration an FP8 or MX GEMM call gets: the decode plan.

Measured configs are data, one JSON file per device under `engine/kernels/configs/` (package data): decode entries
keyed by (N, K, tile height BM) -> knobs of `engine.kernels.gemm.fp8_block_gemm_triton`, and M = 1 GEMV entries
keyed by (N, K) -> knobs of the GEMV launch; each entry carries a one-line note of its measurement, the file names
the evidence. Shapes without an entry take the rules of `DecodePolicy`: the split rule (`_split_k` at `split_fill`;
`mx_split_k` for the MX kernel), the stage rule (`_decode_stages`), the whole-K kernel at BM 64 and the swapped wgmma
kernel at M 2-32 on sm_90 (`wgmma_plan`), the sliced kernel for 2 / 4 splits at small M (`_sliced_instead`). Every
choice is a function of the shape, the device, the SM count and the policy, so a (shape, device, policy) always gets
the same kernel and the same bits. The backend hands its policy down (`NativeNumerics(decode_policy=...)`); an A/B
measurement builds another one with `dataclasses.replace`, nothing patches this module. Where each rule was fitted
and how it scored: docs/design/performance.md ("Decode GEMMs") and the sweeps under benchmarks/results/.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from importlib import resources
from types import MappingProxyType
from typing import Any, Mapping, Optional

import torch
import triton

from engine.kernels import gemm_wgmma as gw
from engine.kernels import sm_count
from engine.kernels.splitk import GROUP, _bad, _cdiv


DECODE_KNOBS = ("split_k", "block_n", "num_warps", "num_stages", "fused_reduce", "whole_k", "sliced", "wgmma")
GEMV_KNOBS = ("block_n", "groups", "num_stages", "num_warps")
SLICES = (2, 4, 8)  # K slices the sliced kernel can hold side by side

DecodeKey = tuple  # (device name, N, K, BM)
GemvKey = tuple  # (device name, N, K)


def _positive_int(v: Any) -> bool:
    """An int > 0 (a JSON true is not one)."""
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


# The values each DECODE_KNOBS key takes in an entry: (check, what to write in the error).
_KNOB_VALUES: dict[str, tuple[Any, str]] = {
    "split_k": (_positive_int, "a positive integer"),
    "block_n": (lambda v: v in (16, 32, 64, 128) and not isinstance(v, bool), "16, 32, 64 or 128"),
    "num_warps": (lambda v: v in (1, 2, 4, 8, 16) and not isinstance(v, bool), "1, 2, 4, 8 or 16"),
    "num_stages": (_positive_int, "a positive integer"),
    "fused_reduce": (lambda v: isinstance(v, bool), "true or false"),
    "whole_k": (lambda v: v is True or (v in (2, 4) and not isinstance(v, bool)), "true, 2 or 4"),
    "sliced": (lambda v: v is False or (v in (2, 4, 8) and not isinstance(v, bool)), "false, 2, 4 or 8"),
    "wgmma": (lambda v: isinstance(v, bool) or v in (2, 4), "true, false, 2 or 4"),
}
_GEMV_VALUES: dict[str, tuple[Any, str]] = {
    "block_n": (lambda v: v in (1, 2, 4, 8, 16, 32, 64, 128) and not isinstance(v, bool), "a power of two <= 128"),
    "groups": (lambda v: v in (1, 2, 4, 8, 16) and not isinstance(v, bool), "1, 2, 4, 8 or 16"),
    "num_stages": (_positive_int, "a positive integer"),
    "num_warps": (lambda v: v in (1, 2, 4, 8, 16) and not isinstance(v, bool), "1, 2, 4, 8 or 16"),
}


def _check_knobs(knobs: Any, names: tuple, values: dict, where: str) -> dict[str, Any]:
    """knobs (a JSON object of `names` keys with `values`) as a dict; errors name `where` and what to write."""
    bad = sorted(set(knobs) - set(names)) if isinstance(knobs, dict) else ["<not an object>"]
    if bad or not knobs:
        raise _bad(f"{where}: unknown knob(s) {bad or '(none given)'}; use {', '.join(names)}")
    for name, value in knobs.items():
        ok, allowed = values[name]
        if not ok(value):
            raise _bad(f"{where}: {name}={value!r}; use {allowed}")
    return dict(knobs)


def _decode_row(row: Any, device: Optional[str], where: str) -> tuple[DecodeKey, dict[str, Any]]:
    """One decode entry {"n", "k", "bm", "knobs"} (+ "device" unless the file gives it, + an optional "note")."""
    need = {"n", "k", "bm", "knobs"} | ({"device"} if device is None else set())
    if not isinstance(row, dict) or not need <= set(row) <= need | {"note"}:
        got = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise _bad(f"{where}: expected the keys {', '.join(sorted(need))} (and an optional note); got {got}")
    dev = row["device"] if device is None else device
    if not isinstance(dev, str) or not all(_positive_int(row[a]) for a in "nk"):
        raise _bad(f"{where}: device must be a GPU name string, n and k positive integers")
    if row["bm"] not in (16, 32, 64):
        raise _bad(f"{where}: bm={row['bm']!r}; decode tiles have BM 16, 32 or 64 (see _tiles)")
    return (dev, row["n"], row["k"], row["bm"]), _check_knobs(row["knobs"], DECODE_KNOBS, _KNOB_VALUES, where)


def _read_json(path: Any, what: str) -> Any:
    """A JSON file's content; errors name the file."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise _bad(f"{what} {path}: cannot read it ({exc.strerror or exc})") from exc
    except json.JSONDecodeError as exc:
        raise _bad(f"{what} {path}: not JSON (line {exc.lineno}: {exc.msg})") from exc


def load_device_configs(path: Any) -> tuple[dict[DecodeKey, dict[str, Any]], dict[GemvKey, dict[str, Any]]]:
    """One device's measured configs, validated: a JSON object {"device", "evidence", "decode": [{"n", "k", "bm",
    "knobs", "note"}], "gemv": [{"n", "k", "knobs", "note"}]} -> (decode entries, GEMV entries)."""
    doc = _read_json(path, "kernel configs")
    if not isinstance(doc, dict) or not {"device", "decode", "gemv"} <= set(doc) <= {"device", "evidence", "decode",
                                                                                      "gemv"}:
        raise _bad(f"kernel configs {path}: expected an object with device, evidence, decode and gemv")
    dev = doc["device"]
    if not isinstance(dev, str) or not dev:
        raise _bad(f"kernel configs {path}: device must be the GPU's name (torch.cuda.get_device_name)")
    decode = dict(_decode_row(row, dev, f"kernel configs {path}, decode entry {i}")
                  for i, row in enumerate(doc["decode"]))
    gemv = {}
    for i, row in enumerate(doc["gemv"]):
        where = f"kernel configs {path}, gemv entry {i}"
        if not isinstance(row, dict) or not {"n", "k", "knobs"} <= set(row) <= {"n", "k", "knobs", "note"} or \
                not all(_positive_int(row[a]) for a in "nk"):
            raise _bad(f"{where}: expected positive integers n, k, a knobs object and an optional note")
        gemv[(dev, row["n"], row["k"])] = _check_knobs(row["knobs"], GEMV_KNOBS, _GEMV_VALUES, where)
    return decode, gemv


def config_file_name(device_name: str) -> str:
    """The file name of a device's configs: its name in lower case, runs of other characters as '-' ("NVIDIA H200"
    -> "nvidia-h200.json")."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") + ".json"


@functools.lru_cache(maxsize=1)
def shipped_configs() -> tuple[Mapping[DecodeKey, Mapping[str, Any]], Mapping[GemvKey, Mapping[str, Any]]]:
    """Every device's configs shipped in `engine/kernels/configs/` (read once), as read-only mappings."""
    decode: dict = {}
    gemv: dict = {}
    for entry in sorted(resources.files("engine.kernels").joinpath("configs").iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            d, g = load_device_configs(entry)
            device = next(iter(d or g), (None,))[0]
            if device is not None and entry.name != config_file_name(device):
                raise _bad(f"kernel configs {entry}: {device}'s configs belong in {config_file_name(device)}")
            decode.update(d)
            gemv.update(g)
    return (MappingProxyType({k: MappingProxyType(v) for k, v in decode.items()}),
            MappingProxyType({k: MappingProxyType(v) for k, v in gemv.items()}))


def load_decode_configs(path: str) -> dict[DecodeKey, dict[str, Any]]:
    """Decode entries from a JSON list of {"device", "n", "k", "bm", "knobs"} objects (as the tuning benchmarks write
    them), validated; for trying measured configs in a whole decode step: `DecodePolicy.with_configs` on the result."""
    import pathlib

    rows = _read_json(pathlib.Path(path), "decode configs")
    if not isinstance(rows, list):
        raise _bad(f"decode configs {path}: expected a JSON list of entries, got {type(rows).__name__}")
    return dict(_decode_row(row, None, f"decode configs {path}, entry {i}") for i, row in enumerate(rows))


def _default_decode() -> Mapping[DecodeKey, Mapping[str, Any]]:
    return shipped_configs()[0]


def _default_gemv() -> Mapping[GemvKey, Mapping[str, Any]]:
    return shipped_configs()[1]


@dataclasses.dataclass(frozen=True)
class DecodePolicy:
    """Which kernel and configuration the FP8 / MX GEMMs pick: the measured entries and the rules for shapes without
    one. Frozen; the native backend holds one (default: `DEFAULT_POLICY`) and hands it to every GEMM call. Each field
    is a rule of the dispatch; what it was fitted on: docs/design/performance.md, "Decode GEMMs".

    decode_configs / gemv_configs: (device, N, K, BM) / (device, N, K) -> knobs (default: the shipped JSON files).
    gemv_m1: M = 1 without knobs runs the CUDA-core GEMV (else the split-K MMA kernel).
    fused_reduce: split-K partials summed by the last split of each tile on CUDA, unless a call or entry says.
    split_fill: the split rule's programs per SM (`_split_k`). decode_stages: ((programs per SM up to, stages), ...)
    for split-K decode calls on weights of >= tune_min_weight elements without knobs (`_decode_stages`).
    whole_k_at_bm64: M 33-64 without entry runs the whole-K Gluon kernel on CUDA (`_heuristic_whole_k`).
    wgmma_rule, wgmma_*: M 2-32 without entry runs the swapped Gluon kernel on sm_90 as `wgmma_plan` plans it.
    mx_split_rule: ((BM, programs per SM, split floor), ...) of `mx_split_k`.
    sliced_auto, sliced_auto_splits: split-K calls with these split counts at M <= 16 / splits run the sliced kernel.
    """

    decode_configs: Mapping[DecodeKey, Mapping[str, Any]] = dataclasses.field(default_factory=_default_decode)
    gemv_configs: Mapping[GemvKey, Mapping[str, Any]] = dataclasses.field(default_factory=_default_gemv)
    gemv_m1: bool = True
    fused_reduce: bool = True
    split_fill: float = 0.9
    tune_min_weight: int = 1 << 24
    decode_stages: tuple[tuple[float, int], ...] = ((1.0, 6), (2.0, 4), (math.inf, 3))
    whole_k_at_bm64: bool = True
    wgmma_rule: bool = True
    wgmma_wide: float = 0.7
    wgmma_fill8: float = 2.0
    wgmma_max_splits: int = 4
    wgmma_min_groups: int = 20
    wgmma_min_groups8: int = 10
    wgmma_max_stages: int = 8
    mx_split_rule: tuple[tuple[int, float, int], ...] = ((16, 2.0, 2), (32, 1.5, 1))
    sliced_auto: bool = True
    sliced_auto_splits: tuple[int, ...] = (2, 4)

    def __post_init__(self):
        if not self.split_fill > 0 or not self.decode_stages or self.decode_stages[-1][0] != math.inf:
            raise _bad(f"DecodePolicy: split_fill must be > 0 and decode_stages end with (inf, stages); got "
                       f"{self.split_fill}, {self.decode_stages}")
        if not self.mx_split_rule or any(bm not in (16, 32, 64) for bm, _, _ in self.mx_split_rule):
            raise _bad(f"DecodePolicy: mx_split_rule needs (BM 16 / 32 / 64, fill, floor) rows; got {self.mx_split_rule}")
        if not set(self.sliced_auto_splits) <= set(SLICES):
            raise _bad(f"DecodePolicy: sliced_auto_splits {self.sliced_auto_splits}; use split counts of {SLICES}")
        for key, knobs in self.decode_configs.items():
            _check_knobs(dict(knobs), DECODE_KNOBS, _KNOB_VALUES, f"DecodePolicy.decode_configs[{key}]")
        for key, knobs in self.gemv_configs.items():
            _check_knobs(dict(knobs), GEMV_KNOBS, _GEMV_VALUES, f"DecodePolicy.gemv_configs[{key}]")

    def with_configs(self, decode: Mapping[DecodeKey, Mapping[str, Any]]) -> "DecodePolicy":
        """This policy with decode entries added or replaced (e.g. from `load_decode_configs`)."""
        return dataclasses.replace(self, decode_configs=MappingProxyType({**self.decode_configs, **decode}))

    def wgmma_rule_constants(self) -> tuple:
        """The constants of the wgmma rule, as `_wgmma_plan` memoizes on them."""
        return (self.wgmma_wide, self.wgmma_fill8, self.wgmma_max_splits, self.wgmma_min_groups,
                self.wgmma_min_groups8, self.wgmma_max_stages)

    def summary(self) -> dict[str, Any]:
        """JSON-ready: the rule fields as they are, the tables as their entry counts (for provenance)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("decode_configs", "gemv_configs")}
        out["decode_stages"] = [[lim if math.isfinite(lim) else "inf", st] for lim, st in self.decode_stages]
        out["decode_configs"] = len(self.decode_configs)
        out["gemv_configs"] = len(self.gemv_configs)
        out["default_tables"] = (self.decode_configs == dict(_default_decode())
                                 and self.gemv_configs == dict(_default_gemv()))
        return json.loads(json.dumps(out))


DEFAULT_POLICY = DecodePolicy()


def _decode_stages(programs: int, sms: int, limits=None) -> int:
    """Pipeline depth of a decode call of the split-K kernel launching `programs` programs on `sms` SMs, by `limits`
    ((programs per SM up to, stages), ...; default DEFAULT_POLICY.decode_stages)."""
    load = programs / max(1, sms)
    return next(stages for limit, stages in (limits or DEFAULT_POLICY.decode_stages) if load <= limit)


def mx_split_k(tiles: int, steps: int, sms: int, bm: int, rule: Optional[tuple] = None) -> int:
    """K splits of the MX kernel for `tiles` output tiles of height bm and `steps` 128-column chunks on `sms` SMs:
    `_split_k` at the fill of `rule` ((BM, fill, floor), ...; default DEFAULT_POLICY.mx_split_rule; heights it lacks
    take the largest listed one's), raised to the rule's floor where each split keeps >= 4 chunks."""
    table = {b: (f, fl) for b, f, fl in (rule or DEFAULT_POLICY.mx_split_rule)}
    fill, floor = table.get(bm, table[max(table)])
    s = _split_k(tiles, steps, sms, fill)
    return max(s, floor) if steps // floor >= 4 else s


def _tiles(m: int) -> tuple[int, int, int, int]:
    """(BM, BN, num_warps, num_stages) by M: decode tiles (BM the next power of two >= M, >= 16:
    the MMA's N side) up to M = 64, large square tiles above."""
    if m <= 64:
        return max(16, triton.next_power_of_2(m)), 64, 4, 4
    return 128, 128, 8, 3


def _split_k(tiles: int, steps: int, sms: int, fill: float = 2.0) -> int:
    """K splits: the smallest power of two that gives >= fill programs per SM, keeping >= 4 K steps
    per split and at most 16 splits (a deterministic function of the shape and the SM count)."""
    s = 1
    while tiles * s < fill * sms and steps // (2 * s) >= 4 and s < 16:
        s *= 2
    return s


def _plan_split(m: int, n: int, steps: int, bm: int, bn: int, device: torch.device,
                split_k: Optional[int], mx: bool = False, policy: Optional[DecodePolicy] = None) -> tuple[int, int]:
    """(splits, K steps per split), with no empty split; the heuristic for split_k None (decode M only): the FP8
    kernel's (`_split_k` at the policy's `split_fill`), or with `mx` the MX kernel's (`mx_split_k`)."""
    if split_k is None:
        policy = policy or DEFAULT_POLICY
        tiles, sms = _cdiv(n, bn) * _cdiv(m, bm), sm_count(device)
        if m > 64:
            split_k = 1
        elif mx:
            split_k = mx_split_k(tiles, steps, sms, bm, policy.mx_split_rule)
        else:
            split_k = _split_k(tiles, steps, sms, policy.split_fill)
    per = _cdiv(steps, max(1, min(split_k, steps)))
    return _cdiv(steps, per), per


@functools.lru_cache(maxsize=None)
def _device_name(device_type: str, index: Optional[int]) -> str:
    """The CUDA device name keying the configs ("" on CPU)."""
    return torch.cuda.get_device_name(index if index is not None else 0) if device_type == "cuda" else ""


def _opt_outs(knobs: dict[str, Any]) -> dict[str, Any]:
    """The knobs that only keep a call off a kernel (sliced=False, wgmma=False): they leave entries and heuristics
    in force."""
    return {key: v for key, v in knobs.items() if key in ("sliced", "wgmma") and v is False}


def _decode_knobs(m: int, n: int, k: int, device: torch.device, knobs: dict[str, Any],
                  policy: Optional[DecodePolicy] = None) -> dict[str, Any]:
    """Explicit knobs, else the policy's decode entry for (device, N, K, BM) (M <= 64 only; with sliced=False and / or
    wgmma=False when those are the only knobs given), else {}."""
    given = {key: v for key, v in knobs.items() if v is not None}
    if m > 64 or given != _opt_outs(given):
        return given
    configs = (policy or DEFAULT_POLICY).decode_configs
    entry = configs.get((_device_name(device.type, device.index), n, k, _tiles(m)[0]), {})
    return dict(entry, **given)  # sliced / wgmma=False alone keep the entry: its split-K call, not those kernels


def _gemv_knobs(n: int, k: int, device: torch.device, policy: Optional[DecodePolicy] = None) -> dict[str, Any]:
    """The policy's GEMV entry for (device, N, K), else {} (the launch's defaults)."""
    return dict((policy or DEFAULT_POLICY).gemv_configs.get((_device_name(device.type, device.index), n, k), {}))


def _heuristic_whole_k(m: int, n: int, device: torch.device, policy: Optional[DecodePolicy] = None) -> dict[str, Any]:
    """The whole-K knobs the heuristic picks for a call without knobs or entry: 33-64 rows (tile BM 64) on CUDA
    while the policy's `whole_k_at_bm64`, 64-row weight tiles from N = 4096 and 32 below, 4 groups per stage; else
    {}. Where the kernel cannot run, the caller takes the split rule instead."""
    if (policy or DEFAULT_POLICY).whole_k_at_bm64 and device.type == "cuda" and m <= 64 and _tiles(m)[0] == 64:
        return dict(whole_k=4, block_n=64 if n >= 4096 else 32)
    return {}


def wgmma_plan(m: int, n: int, k: int, sms: int,
               policy: Optional[DecodePolicy] = None) -> Optional[tuple[int, int, Optional[int]]]:
    """(K splits, groups per stage, stages or None for `gemm_wgmma.swap_stages`' default) of the swapped wgmma kernel
    for an M x N x K decode call on `sms` SMs, by the policy's wgmma rule; None where it has no plan (M outside 2-32,
    or no configuration fits). Memoized per activation-row class (8 / 16 / 32 rows) and rule constants: a call costs
    a dict lookup instead of a replan (docs/design/performance.md#decode-gemms-m--64)."""
    rows = gw.x_rows(m, True)
    if m < 2 or rows > 32:
        return None
    return _wgmma_plan(rows, n, k, sms, (policy or DEFAULT_POLICY).wgmma_rule_constants())


@functools.lru_cache(maxsize=4096)
def _wgmma_plan(rows: int, n: int, k: int, sms: int, rule: tuple) -> Optional[tuple[int, int, Optional[int]]]:
    """`wgmma_plan` for `rows` activation rows (the kernel's tile for every M it rounds up to rows) under the rule
    constants `rule`."""
    wide, fill8, max_splits, min_groups, min_groups8, max_stages = rule
    tiles, kb = _cdiv(n, 64), _cdiv(k, GROUP)

    def exact(s: int, gps: int = 2) -> bool:  # s splits as asked, each within the scale table, none trivially short
        got, per = gw.split_plan(kb, s, gps)
        return got == s and per <= gw.MAX_GROUPS and (s == 1 or per >= 4)

    fewest = next((s for s in range(1, kb + 1) if exact(s)), None)
    if fewest is None:
        return None
    splits = fewest
    if tiles < wide * sms:
        tried = [s for s in range(fewest, max(fewest, max_splits) + 1) if exact(s)]
        if rows == 8:
            splits = max((s for s in tried if tiles * s <= fill8 * sms and (s == fewest or kb / s >= min_groups8)),
                         default=fewest)
        else:
            tried = [s for s in tried if s == fewest or kb / s >= min_groups]
            splits = min(tried, key=lambda s: (-round(wave_fill(tiles * s, sms), 9), s))
    gps, stages = 2, None
    if tiles * splits <= sms:  # one program per SM: the deepest pipeline that fits
        for g in ((2,) if rows == 8 else (4, 2)):
            s_eff, per = gw.split_plan(kb, splits, g)
            deep = [st for st in range(2, max_stages + 1) if st <= _cdiv(per, g)
                    and gw.plan_error(rows, n, k, 64, st, g, s_eff, True) is None]
            if deep:
                gps, stages, splits = g, max(deep), s_eff
                break
    if gw.plan_error(rows, n, k, 64, stages or gw.swap_stages(rows, kb, splits, gps), gps, splits, True) is not None:
        return None
    return splits, gps, stages


def wave_fill(programs: int, sms: int) -> float:
    """How full the SMs' waves of `programs` one-per-SM programs are: programs / (SMs x waves)."""
    return programs / (sms * _cdiv(programs, sms))


@functools.lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    """Compute capability 9.0 exactly (the wgmma kernels' target)."""
    return torch.cuda.get_device_capability(index) == (9, 0)


def _heuristic_wgmma(m: int, n: int, k: int, device: torch.device,
                     policy: Optional[DecodePolicy] = None) -> dict[str, Any]:
    """The wgmma knobs the rule picks for a call without knobs or entry (`wgmma_plan`, while the policy's
    `wgmma_rule`, on an sm_90 CUDA device); else {}. Where the kernel cannot run the call, the caller takes the split
    rule instead."""
    policy = policy or DEFAULT_POLICY
    if not (policy.wgmma_rule and device.type == "cuda" and
            _sm90(device.index if device.index is not None else torch.cuda.current_device())):
        return {}
    plan = wgmma_plan(m, n, k, sm_count(device), policy)
    if plan is None:
        return {}
    splits, gps, stages = plan
    return dict(wgmma=gps, split_k=splits, block_n=64, **({} if stages is None else {"num_stages": stages}))


def _sliced_instead(x: torch.Tensor, m: int, splits: int, bn: int, warps: int, cfg: dict[str, Any],
                    policy: Optional[DecodePolicy] = None) -> bool:
    """Whether a split-K decode call runs as the sliced kernel instead (the policy's `sliced_auto`): on CUDA, a split
    count of `sliced_auto_splits` (2 / 4) of 64-row tiles with 4 warps (the split-K MMA whose bits the sliced kernel
    reproduces), and M <= 16 / splits, so that the slices' activation columns (splits x next_pow2(M)) fit the split-K
    kernel's 16; never with sliced=False."""
    policy = policy or DEFAULT_POLICY
    return (policy.sliced_auto and x.is_cuda and splits in policy.sliced_auto_splits and bn == 64 and warps == 4
            and cfg.get("sliced") is not False and triton.next_power_of_2(m) * splits <= 16)
