"""Result JSON files: the source of truth.

One file per run (model x recipe x serving x backend), named `<run_key>.json`,
written atomically (temp file + fsync + rename) the moment the run finishes,
so an interrupted suite loses nothing and `--resume` skips finished runs.

Schema (version 1)::

    {
      "schema_version": 1,
      "kind": "result",                # or "baseline"
      "run_key": "tiny-llama__fp8-block__default__cpu-emulated",
      "suite": {"name", "path", "sha256"},
      "spec": {"model", "recipe", "serving", "backend", "evals", "seed"},
      "provenance": {"git_sha", "created_at", "packages", "hardware", "model_sha256", "data_sha256", "seed"},
      "status": "ok" | "error",
      "error": null | {"type", "message"},
      "metrics": {"<eval>.<metric>": float|null, "<eval>.<tap>.<stat>": float|null, ...},
      "samples": {"<eval>": {"<array name>": [floats]}},   # per-sample data for paired tests
      "timing": {"total_s": float, "<eval>_s": float, "<eval>.<part>_s": float}
    }

`timing` holds wall seconds: the whole run, each eval, and the parts an eval
times itself (e.g. ``tasks.<task>.ref_s`` / ``tasks.<task>.eng_s``: one task
of the reference, present only in the run that computed it, and of the engine).

Non-finite metric values are stored as null (JSON has no NaN) and the eval
reports them separately (e.g. `ppl_kld.nonfinite_frac`).
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Iterator

from evalharness.errors import ResultError

SCHEMA_VERSION = 1
_KEY_SAFE = re.compile(r"[^A-Za-z0-9_.\-]+")


def run_key(model: str, recipe: str, serving: str, backend: str) -> str:
    """The stable identifier of a run; baselines and mlflow history key on it."""
    return "__".join(_KEY_SAFE.sub("-", part) for part in (model, recipe, serving, backend))


def clean_number(x: Any) -> Any:
    """Floats that are NaN/Inf become None; numpy/torch scalars become Python numbers."""
    if hasattr(x, "item") and not isinstance(x, (list, dict)):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _clean(obj: Any) -> Any:
    """Recursively make `obj` strict-JSON-serialisable (no NaN/Inf)."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return clean_number(obj)


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    """Write `obj` as JSON to `path` atomically: a reader sees the old file or the new one, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(_clean(obj), indent=1, sort_keys=False, allow_nan=False)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load_result(path: str | Path, kind: str | None = None) -> dict[str, Any]:
    """Read and validate a result/baseline file; clear errors for corrupt files or other schemas."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        raise ResultError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ResultError(f"{path}: corrupt JSON ({exc}); delete it and re-run (or restore it from git)") from None
    if not isinstance(obj, dict):
        raise ResultError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    version = obj.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ResultError(
            f"{path}: schema_version {version!r} but this harness reads version {SCHEMA_VERSION}; "
            "re-run the suite (for baselines: `evalharness baseline update RESULTS_DIR` from a fresh run)"
        )
    for key in ("run_key", "status", "metrics"):
        if key not in obj:
            raise ResultError(f"{path}: required key '{key}' is missing; the file is not a result of this harness")
    if not isinstance(obj["metrics"], dict):
        raise ResultError(f"{path}: 'metrics' must be an object of name -> number")
    if kind is not None and obj.get("kind", "result") != kind:
        raise ResultError(f"{path}: expected a {kind} file, found kind '{obj.get('kind')}'")
    return obj


def iter_results(results_dir: str | Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every result file in a directory (sorted by name), validated; skips suite.json and temp files."""
    d = Path(results_dir)
    if not d.is_dir():
        raise ResultError(f"results directory not found: {d} (run `evalharness run SUITE --out {d}` first)")
    for p in sorted(d.glob("*.json")):
        if p.name in ("suite.json",) or p.name.startswith("."):
            continue
        yield p, load_result(p)


def is_finished(path: Path) -> bool:
    """True when `path` holds a valid, successful result (used by --resume; errored runs are retried)."""
    try:
        obj = load_result(path)
    except ResultError:
        return False
    return obj.get("status") == "ok" and obj.get("kind", "result") == "result"
