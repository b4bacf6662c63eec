"""Suite YAML: the run matrix (models x recipes x serving configs) and the evals to run.

Example (see `suites/smoke.yaml`)::

    name: smoke
    backend: cpu-emulated            # or cuda-emulated | cuda-native, or a list of them (one run each)
    reference_device: auto           # where the FP32 reference runs: auto (= the engine's device) | cpu | cuda
    seed: 0
    corpus: builtin:tiny-llama       # default corpus for models without their own
    models:
      - name: tiny-llama
        path: builtin:tiny-llama     # HF dir | HF id | llama2c:FILE | builtin:NAME
      - name: stories260k
        path: llama2c:${data_dir}/models/stories260k/stories260K.bin
        tokenizer: llama2c:${data_dir}/models/stories260k/tok512.bin
        corpus: ${data_dir}/text/wikitext2/wiki.test.raw
    recipes: [fp32, bf16, fp8-tensor, fp8-block]   # names or recipe YAML paths
    serving:                         # batch_size, prefill_chunk (null = whole window),
      - {name: default, batch_size: 4}   # attn_block (64|128|256) and small_m (native kernels),
                                         # kv_block_size (64), cuda_graphs (true) of generation
      - {name: tp2, batch_size: 4, tp: 2, ep: 2}   # tensor / expert parallel degree (default 1; torchrun)
    evals:
      layer_error: {windows: 2, seq_len: 128}
      ppl_kld: {seq_len: 128, max_windows: 16}
    gate:
      alpha: 0.05
      rules: [...]                   # see evalharness.gate

`${data_dir}` expands to the data dir (`--data-dir`, else `$EVALHARNESS_DATA_DIR`,
else the suite's `data_dir`); a model that needs it is skipped, with a message,
when there is none. Relative paths are resolved against the suite file's folder.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
import re
from pathlib import Path
from typing import Any

import yaml

from engine.errors import EngineError, RecipeError
from engine.loading import parse_source
from engine.recipe import Recipe, load_recipe
from evalharness.data import BUILTIN_DIR
from evalharness.errors import DataError, SuiteError
from evalharness.results import run_key
from evalharness.suite_schema import ServingEntry, SuiteFile, check_suite

DATA_DIR_ENV = "EVALHARNESS_DATA_DIR"


def _evals_under(evals: dict[str, Any], serving: str) -> dict[str, dict[str, Any]]:
    """The evals that run under serving config `serving` (those whose `serving` list names it, or has none),
    each without the `serving` key."""
    out = {}
    for k, v in evals.items():
        cfg = dict(v or {})
        only = cfg.pop("serving", None)
        if only is None or serving in only:
            out[k] = cfg
    return out


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One cell of the matrix: everything needed to run it, fully resolved."""

    suite_name: str
    model: dict[str, Any]
    recipe: Recipe
    serving: dict[str, Any]
    backend: str
    evals: dict[str, dict[str, Any]]
    seed: int

    @property
    def key(self) -> str:
        """The run key (file name of the result, key of its baseline)."""
        return run_key(self.model["name"], self.recipe.name, self.serving["name"], self.backend)

    def to_dict(self) -> dict[str, Any]:
        """The `spec` section of a result file."""
        return {"model": dict(self.model), "recipe": self.recipe.to_dict(), "serving": dict(self.serving),
                "backend": self.backend, "evals": copy.deepcopy(self.evals), "seed": self.seed}


@dataclasses.dataclass
class Suite:
    """A parsed suite file plus the data dir it was expanded with."""

    path: Path
    raw: dict[str, Any]
    data_dir: Path | None
    runs: list[RunSpec]
    skipped: list[str]
    reference_device: str = "auto"  # one of suite_schema.REFERENCE_DEVICES; resolved per model by the runner

    @property
    def name(self) -> str:
        """Suite name."""
        return str(self.raw["name"])

    @property
    def sha256(self) -> str:
        """Hash of the suite file's bytes."""
        return hashlib.sha256(self.path.read_bytes()).hexdigest()

    def manifest(self) -> dict[str, Any]:
        """What `suite.json` in the results dir records (the gate reads its rules from here)."""
        return {"schema_version": 1, "kind": "suite", "name": self.name, "path": str(self.path),
                "sha256": self.sha256, "data_dir": str(self.data_dir) if self.data_dir else None,
                "gate": self.raw.get("gate", {}), "run_keys": [r.key for r in self.runs], "skipped": self.skipped}


def _yaml_error(path: Path, exc: yaml.YAMLError) -> SuiteError:
    """A SuiteError naming the file and line of a YAML syntax error."""
    mark = getattr(exc, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
    return SuiteError(f"{where}: malformed YAML: {getattr(exc, 'problem', None) or exc}")


def _parse_value(text: str) -> Any:
    """A --set value: YAML scalar/list syntax (`4`, `true`, `[a, b]`), else the raw string."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict[str, Any], sets: list[str], where: str = "--set") -> dict[str, Any]:
    """Apply `--set KEY=VALUE` overrides. `model=` and `recipe=` replace that whole axis;
    other keys are dotted paths into the suite (e.g. `evals.ppl_kld.max_windows=4`)."""
    raw = copy.deepcopy(raw)
    for item in sets:
        if "=" not in item:
            raise SuiteError(f"{where}: '{item}' must look like KEY=VALUE")
        key, value = item.split("=", 1)
        key = key.strip()
        if key == "model":  # named after the source: its file stem / folder name, `builtin-NAME` for a built-in
            try:
                src = parse_source(value)
            except EngineError as exc:
                raise SuiteError(f"{where}: model={value}: {exc}") from None
            name = src.text if src.kind == "builtin" else src.default_name
            raw["models"] = [{"name": re.sub(r"[^A-Za-z0-9_.\-]+", "-", name) or "model", "path": value}]
        elif key == "recipe":
            raw["recipes"] = [v.strip() for v in value.split(",") if v.strip()]
        elif key in ("tokenizer", "corpus") and len(raw.get("models", [])) == 1:
            raw["models"][0][key] = value
        else:
            node = raw
            parts = key.split(".")
            for p in parts[:-1]:
                if not isinstance(node.get(p), dict):
                    node[p] = {}
                node = node[p]
            node[parts[-1]] = _parse_value(value)
    return raw


def resolve_data_dir(cli_value: str | None, suite_value: str | None) -> Path | None:
    """--data-dir, else $EVALHARNESS_DATA_DIR, else the suite's `data_dir`; must exist when given."""
    for origin, value in (("--data-dir", cli_value), (f"${DATA_DIR_ENV}", os.environ.get(DATA_DIR_ENV)),
                          ("suite data_dir", suite_value)):
        if value:
            p = Path(value).expanduser()
            if not p.is_dir():
                raise DataError(f"data dir not found: {p} (from {origin}); point it at the shared data folder "
                                "(e.g. ../shared/data) or leave it unset to run only the built-in models")
            return p.resolve()
    return None


def _relative(path: str, base: Path) -> str:
    """A relative path that exists under the suite's folder (and not under the working directory) made absolute."""
    p = Path(path).expanduser()
    if not p.is_absolute() and not p.exists() and (base / p).exists():
        return str((base / p).resolve())
    return path


def _expand_source(value: str, data_dir: Path | None, base: Path) -> str | None:
    """A model's `path`: ${data_dir} expanded, parsed by the engine's grammar (`engine.loading.parse_source`; an
    unknown built-in is an error here), a relative file or folder resolved against the suite's folder; None when
    it needs the data dir and there is none."""
    if "${data_dir}" in value:
        if data_dir is None:
            return None
        value = value.replace("${data_dir}", str(data_dir))
    src = parse_source(value, builtin_dir=BUILTIN_DIR)
    return src.text if src.kind == "builtin" else src.with_path(_relative(src.path, base)).text


def _expand(value: Any, data_dir: Path | None, base: Path) -> Any:
    """A tokenizer or corpus: ${data_dir} expanded and a relative path resolved against the suite folder (behind a
    `llama2c:` prefix too); None if it needs the data dir and there is none."""
    if not isinstance(value, str):
        return value
    if "${data_dir}" in value:
        if data_dir is None:
            return None
        value = value.replace("${data_dir}", str(data_dir))
    prefix = ""
    for pre in ("llama2c:",):
        if value.startswith(pre):
            prefix, value = pre, value[len(pre):]
    if value.startswith("builtin:"):
        return prefix + value
    return prefix + _relative(value, base)


def load_suite(path: str | Path, sets: list[str] | None = None, data_dir: str | None = None,
               backend: str | None = None) -> Suite:
    """Parse, validate and expand a suite file into RunSpecs."""
    path = Path(path)
    if not path.exists():
        raise SuiteError(f"suite file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise _yaml_error(path, exc) from None
    if raw is None:
        raise SuiteError(f"{path}: the suite file is empty")
    if not isinstance(raw, dict):
        raise SuiteError(f"{path}: a suite is a mapping of keys {list(SuiteFile.model_fields)}, got "
                         f"{type(raw).__name__}")
    raw = apply_overrides(raw, sets or [])
    where = f"{path} (after --set)" if sets else str(path)
    checked = check_suite({**raw, "backend": backend} if backend else raw, where)
    ddir = resolve_data_dir(data_dir, checked.data_dir)
    base = path.parent.resolve()
    backends = checked.backend if isinstance(checked.backend, list) else [checked.backend]
    seed = checked.seed
    models = checked.models
    recipes = checked.recipes
    evals = dict(raw["evals"])  # as written (each eval fills in its defaults when it runs)

    resolved_recipes = []
    for ref in recipes:
        try:
            resolved_recipes.append(load_recipe(str(ref), base_dir=base))
        except RecipeError as exc:
            raise SuiteError(f"{path}: recipes: {exc}") from None
    names = [r.name for r in resolved_recipes]
    if len(set(names)) != len(names):
        raise SuiteError(f"{path}: two recipes share a name {names}; give each recipe YAML a distinct 'name'")

    servings = []
    for i, s in enumerate(checked.serving or [ServingEntry(name="default")]):
        entry_s: dict[str, Any] = {"name": str(s.name if s.name is not None else f"serving{i}"),
                                   "batch_size": s.batch_size}
        for k, field in ServingEntry.model_fields.items():  # only non-default knobs are recorded (stable run keys)
            if k not in ("name", "batch_size") and getattr(s, k) != field.default:
                entry_s[k] = getattr(s, k)
        from evalharness.distributed import check_degrees  # tp / ep: one model-parallel group per run

        check_degrees(entry_s, evals, f"{path}: serving[{i}]")
        servings.append(entry_s)

    names = [s["name"] for s in servings]
    for k, v in evals.items():
        unknown = [n for n in (v or {}).get("serving") or [] if n not in names]
        if unknown:
            raise SuiteError(f"{path}: evals.{k}.serving names {unknown}, not serving configs of this suite "
                             f"({', '.join(names)}); use their names")
    for n in names:
        if not _evals_under(evals, n):
            raise SuiteError(f"{path}: serving config '{n}' runs no eval (every eval's `serving` list leaves it "
                             "out); drop it or name it in an eval's `serving`")
    runs, skipped = [], []
    seen = set()
    for i, m in enumerate(models):
        name = str(m.name or Path(m.path).name)
        if name in seen:
            raise SuiteError(f"{path}: two models are named '{name}'")
        seen.add(name)
        entry = {"name": name}
        needs_data = False
        for k in ("path", "tokenizer", "corpus"):
            v = getattr(m, k) if getattr(m, k) is not None else (checked.corpus if k == "corpus" else None)
            if v is None:
                continue
            try:
                ev = _expand_source(v, ddir, base) if k == "path" else _expand(str(v), ddir, base)
            except EngineError as exc:
                raise SuiteError(f"{path}: models[{i}].path: {exc}") from None
            if ev is None:
                needs_data = True
            entry[k] = ev
        if needs_data:
            skipped.append(f"model '{name}' needs the data dir (pass --data-dir or set ${DATA_DIR_ENV})")
            continue
        if "corpus" not in entry:
            raise SuiteError(f"{path}: models[{i}] ('{name}') has no corpus and the suite sets no default 'corpus'")
        for r in resolved_recipes:
            for s in servings:
                for b in backends:
                    runs.append(RunSpec(suite_name=str(checked.name), model=entry, recipe=r, serving=s, backend=b,
                                        evals=_evals_under(evals, s["name"]), seed=seed))
    if not runs:
        raise SuiteError(f"{path}: nothing to run: {'; '.join(skipped) or 'empty matrix'}")
    return Suite(path=path.resolve(), raw=raw, data_dir=ddir, runs=runs, skipped=skipped,
                 reference_device=checked.reference_device)
