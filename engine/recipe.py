"""Precision recipes: which number format each numeric *site* of the model uses.

A recipe is frozen, validated data. Named recipes live as YAML files in
`engine/recipes/`; a user recipe is a YAML file that may `extends:` a named
recipe (or another file) and override single sites::

    # my-recipe.yaml
    name: fp8-block-e4m3-residual
    extends: fp8-block
    residual: e4m3:tensor          # site key: format spec
    overrides:                      # optional, per module (fnmatch glob on module path)
      "layers.0.*": {linear.weight: bf16, linear.input: bf16}

Sites (what each key controls)
------------------------------
======================  ==========================================================
``embed``               storage of the token-embedding table
``lm_head``             LM-head weight storage (the logits GEMM runs in fp32)
``linear.weight``       weights of every projection GEMM (q/k/v/o, gate/up/down)
``linear.input``        activations entering those GEMMs (the fused norm/act quant)
``linear.output``       rounding of the GEMM output (bf16 output of FP8 GEMMs)
``moe.weight``          routed-expert weights (inherits ``linear.weight`` if unset)
``moe.input``           activations into the expert GEMMs (inherits ``linear.input``)
``attn.q``              query as read by the attention kernel
``kv.k`` / ``kv.v``     KV-cache storage; ``<fmt>:head`` = one scale per KV head
``attn.softmax``        precision of QK^T scores and softmax (fp32 or bf16)
``attn.out``            attention output (FP8 attention output feeds o_proj directly)
``residual``            storage of the residual stream after every add
``norm``                RMSNorm compute precision
``router``              MoE router GEMM (its input and gate weights; fp32 by default)
======================  ==========================================================

plus ``accumulate`` (``fp32``, ``tcN``, ``tcN:promoteK``): the GEMM accumulator model.

Format specs are the strings of `engine.formats.parse_spec` (``fp32``, ``bf16``,
``e4m3:tensor``, ``e4m3:1x128``, ``e4m3:128x128``, ``e5m2:tensor``, ``mxfp8``,
``nvfp4`` ...). A value of ``inherit`` means "use the parent site" (only for the
``moe.*`` sites).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import yaml

from engine.errors import RecipeError

RECIPE_DIR = Path(__file__).parent / "recipes"

SITES: tuple[str, ...] = (
    "embed",
    "lm_head",
    "linear.weight",
    "linear.input",
    "linear.output",
    "moe.weight",
    "moe.input",
    "attn.q",
    "kv.k",
    "kv.v",
    "attn.softmax",
    "attn.out",
    "residual",
    "norm",
    "router",
)

# A site that may say `inherit` and the site it then takes its spec from.
INHERITS: Mapping[str, str] = MappingProxyType({"moe.weight": "linear.weight", "moe.input": "linear.input"})

# Sites whose value must be a plain high-precision float type (compute precision, not storage).
# `router` is not one: its GEMM (inputs and gate weights) may be put in a quantized format, which is
# the planted "router in E4M3" bug the gate selftest must catch.
COMPUTE_SITES = ("attn.softmax", "norm")
HIGH_PRECISION = ("fp32", "bf16", "fp16")

RECIPE_KEYS = ("name", "description", "extends", "accumulate", "overrides", "scales")


def _validate_spec(site: str, spec: str, where: str) -> str:
    """Check one site's format spec string; return its canonical form."""
    if not isinstance(spec, str):
        raise RecipeError(f"{where}: site '{site}' must be a format string like 'e4m3:1x128', got {spec!r}")
    spec = spec.strip()
    if spec == "inherit":
        if site not in INHERITS:
            raise RecipeError(f"{where}: site '{site}' cannot 'inherit'; only {sorted(INHERITS)} can")
        return spec
    if site in COMPUTE_SITES:
        if spec not in HIGH_PRECISION:
            raise RecipeError(
                f"{where}: site '{site}' is a compute precision and must be one of {HIGH_PRECISION}, got '{spec}'"
            )
        return spec
    base = spec
    if site in ("kv.k", "kv.v") and spec.endswith(":head"):
        base = spec[: -len(":head")] + ":tensor"  # validated as the per-tensor form of that format
    from engine.formats import parse_spec  # local import: formats is the single source of truth

    try:
        parsed = parse_spec(base)
    except ValueError as exc:
        raise RecipeError(f"{where}: site '{site}': {exc}") from None
    return spec if base != spec else str(parsed)


def _validate_accumulate(acc: str, where: str) -> str:
    """Check an accumulator model string (`fp32`, `tc14`, `tc14:promote128`)."""
    from engine.formats.accumulate import parse_accumulate

    try:
        parse_accumulate(acc)
    except ValueError as exc:
        raise RecipeError(f"{where}: accumulate: {exc}") from None
    return acc


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A frozen, validated precision recipe.

    `sites` maps every key of `SITES` to a spec string; `overrides` is a tuple of
    (module glob, {site: spec}) applied in order, last match winning.
    """

    name: str
    sites: Mapping[str, str]
    accumulate: str = "fp32"
    description: str = ""
    overrides: tuple[tuple[str, Mapping[str, str]], ...] = ()
    scales: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)
    source: str = "<memory>"

    def __post_init__(self) -> None:
        where = f"recipe '{self.name}' ({self.source})"
        missing = [s for s in SITES if s not in self.sites]
        if missing:
            raise RecipeError(f"{where}: sites without a format: {missing}")
        unknown = [s for s in self.sites if s not in SITES]
        if unknown:
            raise RecipeError(f"{where}: unknown site(s) {unknown}; valid sites: {list(SITES)}")
        sites = {s: _validate_spec(s, self.sites[s], where) for s in SITES}
        object.__setattr__(self, "sites", MappingProxyType(sites))
        object.__setattr__(self, "accumulate", _validate_accumulate(self.accumulate, where))
        ovs = []
        for pattern, mapping in self.overrides:
            bad = [s for s in mapping if s not in SITES]
            if bad:
                raise RecipeError(f"{where}: overrides['{pattern}']: unknown site(s) {bad}; valid: {list(SITES)}")
            ovs.append((pattern, MappingProxyType({s: _validate_spec(s, v, where) for s, v in mapping.items()})))
        object.__setattr__(self, "overrides", tuple(ovs))
        scales = {}
        for site, table in dict(self.scales).items():
            if site not in SITES:
                raise RecipeError(f"{where}: scales: unknown site '{site}'; valid sites: {list(SITES)}")
            if not isinstance(table, Mapping):
                raise RecipeError(f"{where}: scales.{site} must map module globs to positive floats")
            checked = {}
            for pattern, value in table.items():
                try:
                    v = float(value)
                except (TypeError, ValueError):
                    v = float("nan")
                if not v > 0 or v == float("inf"):
                    raise RecipeError(f"{where}: scales.{site}['{pattern}'] must be a positive finite float, got {value!r}")
                checked[str(pattern)] = v
            scales[site] = MappingProxyType(checked)
        object.__setattr__(self, "scales", MappingProxyType(scales))

    def spec(self, site: str, module: str | None = None) -> str:
        """The format spec of `site` for the module at path `module` (e.g. 'layers.3.attn.q_proj')."""
        value = self.sites[site]
        if module is not None:
            for pattern, mapping in self.overrides:
                if site in mapping and fnmatch.fnmatchcase(module, pattern):
                    value = mapping[site]
        if value == "inherit":
            return self.spec(INHERITS[site], module)
        return value

    def static_scale(self, site: str, module: str) -> float | None:
        """The calibrated static scale of (site, module), or None for a dynamic (per-call) scale.

        Static scales come from `engine.calibrate` (one shared scale per stage of
        consecutive layers) and apply to per-tensor specs; the last matching glob wins.
        """
        table = self.scales.get(site)
        if not table:
            return None
        found = None
        for pattern, value in table.items():
            if fnmatch.fnmatchcase(module, pattern):
                found = value
        return found

    def to_dict(self) -> dict[str, Any]:
        """A plain, JSON/YAML-serialisable form (fully resolved: no `extends`)."""
        out: dict[str, Any] = {"name": self.name, "description": self.description, "accumulate": self.accumulate}
        out.update(dict(self.sites))
        if self.overrides:
            out["overrides"] = {p: dict(m) for p, m in self.overrides}
        if self.scales:
            out["scales"] = {site: dict(t) for site, t in self.scales.items()}
        return out

    def derive(self, name: str, **sites: str) -> "Recipe":
        """A copy with some sites replaced (keyword names use '_' for '.', e.g. linear_weight='bf16')."""
        new = dict(self.sites)
        acc = self.accumulate
        for key, value in sites.items():
            site = key.replace("_", ".") if key.replace("_", ".") in SITES else key
            if key == "accumulate":
                acc = value
                continue
            if site not in SITES:
                raise RecipeError(f"derive({name!r}): unknown site '{key}'")
            new[site] = value
        return Recipe(name=name, sites=new, accumulate=acc, description=self.description,
                      overrides=self.overrides, scales=self.scales, source=f"derived from {self.name}")

    def with_overrides(self, name: str, extra: Mapping[str, Mapping[str, str]]) -> "Recipe":
        """A copy with extra per-module overrides appended (they win over earlier ones)."""
        ovs = tuple(self.overrides) + tuple((p, dict(m)) for p, m in extra.items())
        return Recipe(name=name, sites=dict(self.sites), accumulate=self.accumulate,
                      description=self.description, overrides=ovs, scales=self.scales,
                      source=f"derived from {self.name}")

    def with_scales(self, name: str, scales: Mapping[str, Mapping[str, float]]) -> "Recipe":
        """A copy with static scales (site -> module glob -> scale) added."""
        merged = {site: dict(t) for site, t in self.scales.items()}
        for site, table in scales.items():
            merged.setdefault(site, {}).update(table)
        return Recipe(name=name, sites=dict(self.sites), accumulate=self.accumulate, description=self.description,
                      overrides=self.overrides, scales=merged, source=f"derived from {self.name}")


def storage_bits(spec: str) -> float:
    """Bits per element a site's format costs in memory, scales included (e.g. e4m3:1x128 -> 8.25)."""
    from engine.formats import parse_spec

    if spec == "fp32":
        return 32.0
    if spec in ("bf16", "fp16"):
        return 16.0
    p = parse_spec(spec.replace(":head", ":tensor"))
    elem = {"e4m3": 8, "e5m2": 8, "e2m1": 4, "int8": 8}.get(p.elem, 8)
    group = (p.tile[0] * p.tile[1]) if p.tile else 0
    scale_bits = {"fp32": 32, "e8m0": 8, "e4m3": 8}.get(p.scale_fmt or "fp32", 32)
    return elem + (scale_bits / group if group else 0.0)


def named_recipes() -> list[str]:
    """Names of the recipes shipped in `engine/recipes/`."""
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def _read_yaml(path: Path) -> dict[str, Any]:
    """Read a recipe YAML file (safe_load) into a mapping, with errors naming the file."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise RecipeError(f"cannot read recipe file {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: malformed YAML: {exc}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe must be a YAML mapping of keys to values, got {type(data).__name__}")
    return data


def _resolve(ref: str, base_dir: Path | None, chain: tuple[str, ...]) -> tuple[dict[str, Any], str]:
    """Resolve a recipe reference (name or path) into a flat raw dict with `extends` applied."""
    path = Path(ref)
    if base_dir is not None and not path.is_absolute() and ref.endswith((".yaml", ".yml")):
        candidate = base_dir / path
        if candidate.exists():
            path = candidate
    if ref.endswith((".yaml", ".yml")) or path.exists() and path.is_file():
        if not path.exists():
            raise RecipeError(f"recipe file not found: {ref} (give a named recipe {named_recipes()} or a YAML path)")
    else:
        path = RECIPE_DIR / f"{ref}.yaml"
        if not path.exists():
            raise RecipeError(f"unknown recipe '{ref}'; named recipes: {named_recipes()}, or give a path to a YAML file")
    key = str(path.resolve())
    if key in chain:
        raise RecipeError(f"cyclic 'extends' in recipes: {' -> '.join(chain + (key,))}")
    raw = _read_yaml(path)
    allowed = set(RECIPE_KEYS) | set(SITES)
    unknown = [k for k in raw if k not in allowed]
    if unknown:
        raise RecipeError(
            f"{path}: unknown key(s) {unknown}; allowed keys are {list(RECIPE_KEYS)} and the sites {list(SITES)}"
        )
    merged: dict[str, Any] = {}
    if "extends" in raw:
        try:
            parent, _ = _resolve(str(raw["extends"]), path.parent, chain + (key,))
        except RecipeError as exc:
            if "cyclic" in str(exc):
                raise
            raise RecipeError(f"{path}: extends: {exc}") from None
        merged.update(parent)
        merged.pop("name", None)
        merged.pop("description", None)
    for k, v in raw.items():
        if k == "extends":
            continue
        if k == "overrides":
            if not isinstance(v, dict):
                raise RecipeError(f"{path}: 'overrides' must map module globs to {{site: format}} mappings")
            merged["overrides"] = dict(merged.get("overrides", {}), **v)
        elif k == "scales":
            if not isinstance(v, dict):
                raise RecipeError(f"{path}: 'scales' must map sites to {{module glob: scale}} mappings")
            merged["scales"] = dict(merged.get("scales", {}), **v)
        else:
            merged[k] = v
    merged.setdefault("name", path.stem)
    return merged, str(path)


def load_recipe(ref: str | Recipe, base_dir: str | Path | None = None) -> Recipe:
    """Load a named recipe or a recipe YAML file (resolving `extends`) into a `Recipe`."""
    if isinstance(ref, Recipe):
        return ref
    raw, source = _resolve(str(ref), Path(base_dir) if base_dir else None, ())
    sites = {s: raw[s] for s in SITES if s in raw}
    overrides = raw.get("overrides", {}) or {}
    for pattern, mapping in overrides.items():
        if not isinstance(mapping, dict):
            raise RecipeError(f"{source}: overrides['{pattern}'] must be a mapping of site to format")
    return Recipe(
        name=str(raw["name"]),
        sites=sites,
        accumulate=str(raw.get("accumulate", "fp32")),
        description=str(raw.get("description", "")),
        overrides=tuple((str(p), dict(m)) for p, m in overrides.items()),
        scales=raw.get("scales", {}) or {},
        source=source,
    )
