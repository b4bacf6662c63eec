"""Numerics mutations: named, switchable faults planted at one dispatch point of the engine, for the duration of a run.

A mutation is a catalog entry (`suites/selftest/mutations.yaml`) naming a *target* -- one attribute of one engine
module, ``module:attr`` or ``module:Class.method`` -- and a *fault*, a factory in `FAULTS` that takes the original
function and returns the faulty one. `patched(mutation)` swaps it in and restores the original on exit (also on an
error), so nothing outside the ``with`` block sees the fault: no production flag, no environment variable.

A target ``module:name.attr`` whose ``name`` is a module (``engine.numerics:F.linear``, ``engine.numerics:torch.softmax``)
replaces only that module's binding of ``name`` with a proxy that forwards every other attribute, so the fault stays
inside the one engine module that calls it (the FP32 reference, which also calls ``torch.softmax``, is untouched).

Faults mutate only what the engine computes in fp32 and leave float64 inputs alone: the op-local conformance probes
(`Numerics.local`) compute their ideal in float64 through the same names and must still see the ideal.

An entry may instead carry `mutate:`, a list of source edits ``{find, replace[, target]}``: the target function --
a Triton kernel or helper, a launcher, a method -- is recompiled from its own source with each snippet replaced, for
the duration of the run (`evalharness.kernel_mutations`). The native-kernel entries (`device: gpu`) are planted this
way, or through a fault factory where the fault is in Python (the CUDA-graph replay).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import types
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from evalharness.errors import SuiteError
from evalharness.kernel_mutations import Edit, mutated, parse_edits

REPO = Path(__file__).resolve().parent.parent
MUTATIONS = REPO / "suites" / "selftest" / "mutations.yaml"
KEYS = ("id", "target", "fault", "mutate", "baseline", "suite", "requires", "device", "what")
DEVICES = ("cpu", "gpu")


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One catalog entry: the fault `fault` planted at `target`, run under `suite` and gated against `baseline`."""

    id: str
    target: str
    baseline: str
    what: str
    fault: str | None = None  # key of FAULTS: a factory of the faulty function
    mutate: tuple[Edit, ...] = ()  # or source edits of the target (and of the edits' own targets)
    suite: str = "suites/smoke.yaml"
    requires: str | None = None  # moe: only models with routed experts
    device: str = "cpu"  # gpu: a native-kernel fault, run where CUDA is


def load_mutations(path: str | Path = MUTATIONS) -> list[Mutation]:
    """Parse and validate the mutation catalog; errors name the file, the entry and the key."""
    from evalharness.selftest import read_catalog

    path = Path(path)
    raw = read_catalog(path, "mutation catalog")
    items = raw.get("mutations") if isinstance(raw, dict) else None
    if not isinstance(items, list):
        raise SuiteError(f"{path}: the catalog must be a mapping with a list 'mutations'")
    out, seen = [], set()
    for i, item in enumerate(items):
        where = f"{path}: mutations[{i}]"
        if not isinstance(item, dict):
            raise SuiteError(f"{where} must be a mapping")
        bad = [k for k in item if k not in KEYS]
        if bad:
            raise SuiteError(f"{where}: unknown key(s) {bad}; allowed: {list(KEYS)}")
        for key in ("id", "target", "baseline", "what"):
            if not isinstance(item.get(key), str) or not item[key]:
                raise SuiteError(f"{where}: '{key}' is required (a string)")
        if item["id"] in seen:
            raise SuiteError(f"{where}: duplicate id '{item['id']}'")
        seen.add(item["id"])
        fields = {k: item[k] for k in KEYS if k in item}
        if "mutate" in fields:
            fields["mutate"] = parse_edits(fields["mutate"], where)
        m = Mutation(**fields)
        if m.device not in DEVICES:
            raise SuiteError(f"{where}: device must be one of {list(DEVICES)}, got {m.device!r}")
        if m.requires not in (None, "moe"):
            raise SuiteError(f"{where}: requires must be 'moe' or absent, got {m.requires!r}")
        if (m.fault is None) == (not m.mutate):
            raise SuiteError(f"{where}: give exactly one of 'fault' (a key of evalharness.mutations.FAULTS) and "
                             "'mutate' (source edits)")
        if m.fault is not None and m.fault not in FAULTS:
            raise SuiteError(f"{where}: fault {m.fault!r} is not one of evalharness.mutations.FAULTS "
                             f"({sorted(FAULTS)})")
        if ":" not in m.target:
            raise SuiteError(f"{where}: target must be 'module:attr[.attr]', got {m.target!r}")
        out.append(m)
    return out


# ------------------------------------------------------------------ the fixture
class _ModuleProxy(types.ModuleType):
    """A stand-in for a module inside one engine module: `overrides` first, every other attribute forwarded."""

    def __init__(self, module: types.ModuleType, overrides: dict[str, Any]):
        super().__init__(module.__name__)
        self._module, self._overrides = module, overrides

    def __getattr__(self, name: str) -> Any:
        overrides = self.__dict__.get("_overrides", {})
        return overrides[name] if name in overrides else getattr(self.__dict__["_module"], name)


def _resolve(target: str) -> tuple[Any, str, Any]:
    """(owner object, attribute name, original value) of `module:attr[.attr]`; a module in the middle of the
    path is replaced by a proxy in its owner (see the module docstring)."""
    mod_name, _, path = target.partition(":")
    try:
        owner: Any = importlib.import_module(mod_name)
    except ImportError as exc:
        raise SuiteError(f"mutation target {target!r}: cannot import {mod_name!r} ({exc})") from None
    parts = path.split(".")
    for p in parts[:-1]:
        if not hasattr(owner, p):
            raise SuiteError(f"mutation target {target!r}: {owner!r} has no attribute {p!r}")
        owner = getattr(owner, p)
    if not hasattr(owner, parts[-1]):
        raise SuiteError(f"mutation target {target!r}: {owner!r} has no attribute {parts[-1]!r}")
    return owner, parts[-1], getattr(owner, parts[-1])


@contextlib.contextmanager
def patched(m: Mutation) -> Iterator[Callable]:
    """Plant mutation `m` for the duration of the block; yields the faulty function (for `mutate` entries the
    list of mutated functions). Restores on exit, also when the block raises."""
    if m.mutate:
        with mutated(m.id, m.target, m.mutate) as fns:
            yield fns
        return
    mod_name, _, path = m.target.partition(":")
    head, _, rest = path.partition(".")
    module = importlib.import_module(mod_name)
    if rest and isinstance(getattr(module, head, None), types.ModuleType):
        inner = getattr(module, head)
        original = getattr(inner, rest)
        fault = FAULTS[m.fault](original)
        setattr(module, head, _ModuleProxy(inner, {rest: fault}))
        try:
            yield fault
        finally:
            setattr(module, head, inner)
        return
    owner, name, original = _resolve(m.target)
    fault = FAULTS[m.fault](original)
    setattr(owner, name, fault)
    try:
        yield fault
    finally:
        setattr(owner, name, original)


# ------------------------------------------------------------------ faults
def _fp32(x: torch.Tensor) -> bool:
    """Only fp32 computations are mutated (float64 is the local probes' ideal)."""
    return x.dtype == torch.float32


def _element_fault(orig, applies, change):
    """A fault of `round_with_overflow` (the element rounding of every float format): the original's (values,
    overflow), then, for formats where `applies(format)`, values replaced by `change(x, values, overflow, format)`."""
    from engine.formats import get_format

    def fault(x, fmt, *, rounding="rne", generator=None, saturate=True):
        vals, overflow = orig(x, fmt, rounding=rounding, generator=generator, saturate=saturate)
        f = get_format(fmt)
        return (change(x, vals, overflow, f) if applies(f) else vals), overflow
    return fault


def _float_with_zero(f) -> bool:
    """A float format that holds zero (where rounding toward zero and subnormals mean something)."""
    return not f.is_integer and f.has_zero


def _round_toward_zero(orig):
    """Element rounding toward zero instead of to nearest even (float formats with a zero)."""
    from engine.formats._bits import exp2i, floor_log2

    def change(x, vals, overflow, f):
        xf = x.to(torch.float32)
        a = xf.abs()
        q = exp2i(torch.clamp(floor_log2(torch.where(torch.isfinite(a), a, torch.zeros_like(a))), min=f.emin)
                  - f.mbits)
        mag = torch.minimum(torch.floor(a / q) * q, torch.full_like(a, f.max_normal))
        rtz = torch.where(xf < 0, -mag, mag)
        return torch.where(torch.isfinite(xf) & ~overflow, rtz, vals)
    return _element_fault(orig, _float_with_zero, change)


def _saturate_wraps(orig):
    """An overflowing element wraps to the opposite sign's largest value instead of saturating."""
    return _element_fault(orig, lambda f: f.signed,
                          lambda x, vals, overflow, f: torch.where(overflow, -torch.sign(x.float()) * f.max_normal,
                                                                   vals))


def _flush_subnormals(orig):
    """Elements below the format's smallest normal flush to zero (no subnormals)."""
    return _element_fault(orig, _float_with_zero,
                          lambda x, vals, overflow, f: torch.where(vals.abs() < f.min_normal,
                                                                   torch.zeros_like(vals), vals))


def _amax_wrong_group(orig):
    """Each group's scale computed from the neighbouring group's amax (row groups shifted by one, else columns)."""
    def fault(x2, spec):
        g = orig(x2, spec)  # (row groups, column groups)
        if g.shape[0] > 1:
            return g.roll(1, dims=0)
        return g.roll(1, dims=1) if g.dim() == 2 and g.shape[1] > 1 else g
    return fault


def _e8m0_exponent_plus_one(orig):
    """The E8M0 shared exponent one too large (ceil instead of floor): every MX block loses its top binade."""
    def fault(amax, emax_elem):
        return orig(amax, emax_elem - 1)
    return fault


def _scale_wrong_block(orig):
    """Dequantization applies each 1xN block scale to the next block along K (the scale layout off by one)."""
    from engine.formats import grouping as G

    def fault(self):
        sp = self.spec
        if sp.granularity != "tile" or sp.tile is None or sp.tile[0] != 1:
            return orig(self)
        m, k = self._mk()
        g = self.group_scale_grid()  # (rows, K blocks)
        if g.shape[1] < 2:
            return orig(self)
        return G.expand_grid(g.roll(1, dims=1), sp, m, k).reshape(self.shape)
    return fault


def _blocked_linear(a2: torch.Tensor, w: torch.Tensor, block: int, combine) -> torch.Tensor:
    """Sum of per-K-block fp32 partial GEMMs a2 (M, K) @ w (N, K).T, combined by `combine(acc, part, j, nblocks)`."""
    k = a2.shape[1]
    starts = list(range(0, k, block))
    acc = None
    for j, s in enumerate(starts):
        part = a2[:, s:s + block] @ w[:, s:s + block].T  # (M, N)
        acc = combine(acc, part, j, len(starts))
    return acc


def _linear_faulty(orig, combine, block: int):
    """An F.linear whose fp32 GEMMs accumulate their K blocks through `combine`."""
    def fault(x, w, bias=None):
        if not (_fp32(x) and _fp32(w)) or x.shape[-1] <= block:
            return orig(x, w, bias)
        lead = x.shape[:-1]
        y = _blocked_linear(x.reshape(-1, x.shape[-1]), w, block, combine).reshape(*lead, w.shape[0])
        return y if bias is None else y + bias
    return fault


def _accum_bf16(orig):
    """GEMM partial sums over K blocks of 32 accumulated in a bf16 register (fp32 within a block)."""
    def combine(acc, part, j, n):
        total = part if acc is None else acc.float() + part
        return total.to(torch.bfloat16) if j < n - 1 else total.to(torch.bfloat16).float()
    return _linear_faulty(orig, combine, 32)


def _drop_split(orig):
    """Split-K with 64-wide K splits: the last split's partial is never added (for every GEMM with K > 64)."""
    def combine(acc, part, j, n):
        if j == n - 1:
            return acc
        return part if acc is None else acc + part
    return _linear_faulty(orig, combine, 64)


def _softmax_bf16(orig):
    """Attention scores and probabilities in bf16 although the recipe says fp32."""
    def fault(x, dim=None, dtype=None):
        if not _fp32(x):
            return orig(x, dim=dim, dtype=dtype)
        return orig(x.to(torch.bfloat16), dim=dim).float().to(torch.bfloat16).float()
    return fault


def _k_scale_per_tensor(orig):
    """The K cache quantized with one scale for all heads where the recipe asks for one per head."""
    def fault(self, x, site, module, spec=None):
        if site == "kv.k" and spec is not None and spec.endswith(":token"):
            spec = spec[: -len(":token")] + ":tensor"
        return orig(self, x, site, module, spec)
    return fault


def _tie_break_high(orig):
    """Top-k routing ties broken toward the higher expert index (the experts' order reversed)."""
    def fault(logits, cfg, correction_bias=None):
        e = logits.shape[-1]
        bias = None if correction_bias is None else correction_bias.flip(-1)
        weights, ids = orig(logits.flip(-1), cfg, bias)
        return weights, (e - 1) - ids
    return fault


def _drop_expert(orig):
    """The last non-empty expert segment's output is dropped (zeros): one expert never contributes."""
    def fault(self, xs, counts, experts, module):
        y = orig(self, xs, counts, experts, module)
        ends = torch.tensor(list(counts)).cumsum(0).tolist()
        live = [e for e, c in enumerate(counts) if c]
        if live:
            e = live[-1]
            y = y.clone()
            y[ends[e] - counts[e]:ends[e]] = 0
        return y
    return fault


def _unsorted_combine(orig):
    """The combine applies the routing weights in the tokens' order, not the expert-sorted order of the outputs."""
    def fault(ids, num_experts):
        plan = orig(ids, num_experts)
        return plan._replace(order=torch.arange(plan.order.numel(), device=plan.order.device))
    return fault


def _page_table_off_by_one(orig):
    """Logical page i >= 1 of a sequence read from the physical page of i + 1 (the block table off by one)."""
    def fault(self, layer, seq_id, length=None, dequantize=True):
        n = len(self._pages[seq_id])  # the read takes its pages from the device block table's row
        if n < 3:
            return orig(self, layer, seq_id, length, dequantize)
        row = self.block_tables[seq_id, :n].clone()
        self.block_tables[seq_id, :n] = torch.cat([row[:1], row[2:], row[1:2]])
        try:
            return orig(self, layer, seq_id, length, dequantize)
        finally:
            self.block_tables[seq_id, :n] = row
    return fault


def _stale_prefix_page(orig):
    """A prefix-cache hit copies every reused page but the last: that page keeps its stale earlier contents."""
    def fault(self, src, dst, num_tokens):
        bs = self.block_size
        if num_tokens > bs:
            orig(self, src, dst, num_tokens - bs)
            self.seq_lens[dst] = num_tokens
            self._host_len[dst] = num_tokens
        # a single reused page: nothing copied at all, only the length set
        else:
            self.seq_lens[dst] = num_tokens
            self._host_len[dst] = num_tokens
    return fault


def _chunk_boundary(orig):
    """Chunked prefill: each later chunk attends to its own first key/value in place of the previous chunk's
    last one (the boundary position off by one)."""
    def fault(self, layer, k, v):
        s = self.length
        ks, vs = orig(self, layer, k, v)
        if s == 0:
            return ks, vs
        ks, vs = ks.clone(), vs.clone()
        ks[:, :, s - 1], vs[:, :, s - 1] = ks[:, :, s], vs[:, :, s]
        return ks, vs
    return fault


def _graph_stale_tokens(orig):
    """A CUDA-graph decode replay whose static token buffer is not refreshed: once a batch size's graph is captured,
    each step replays on what the buffer holds (the previous step's tokens) instead of this step's. The step that
    captures, and eager steps, are untouched."""
    def fault(self, tokens, seq_ids, start):
        graphs = getattr(self, "_graphs", {})
        if self.graphs and tokens.shape[0] in graphs:
            tokens = graphs[tokens.shape[0]][1].clone()  # the buffer's stale contents, copied back unchanged
        return orig(self, tokens, seq_ids, start)
    return fault


FAULTS: dict[str, Callable[[Callable], Callable]] = {
    "round-toward-zero": _round_toward_zero,
    "saturate-wraps": _saturate_wraps,
    "flush-subnormals": _flush_subnormals,
    "amax-wrong-group": _amax_wrong_group,
    "e8m0-exponent-plus-one": _e8m0_exponent_plus_one,
    "scale-wrong-block": _scale_wrong_block,
    "accum-bf16": _accum_bf16,
    "drop-split": _drop_split,
    "softmax-bf16": _softmax_bf16,
    "k-scale-per-tensor": _k_scale_per_tensor,
    "tie-break-high": _tie_break_high,
    "drop-expert": _drop_expert,
    "unsorted-combine": _unsorted_combine,
    "page-table-off-by-one": _page_table_off_by_one,
    "stale-prefix-page": _stale_prefix_page,
    "chunk-boundary": _chunk_boundary,
    "graph-stale-tokens": _graph_stale_tokens,
}
