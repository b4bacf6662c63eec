"""Result JSON files: the source of truth.

One file per run (model x recipe x serving x backend), named `<run_key>.json`,
written atomically (temp file + fsync + rename) the moment the run finishes,
so an interrupted suite loses nothing and `--resume` skips finished runs (those whose recorded
`fingerprint` matches: `evalharness.fingerprint`).

Schema (version 1)::

    {
      "schema_version": 1,
      "kind": "result",                # or "baseline"
      "run_key": "tiny-llama__fp8-block__default__cpu-emulated",
      "suite": {"name", "path", "sha256"},
      "spec": {"model", "recipe", "serving", "backend", "evals", "seed"},
      "provenance": {"git_sha", "created_at", "packages", "hardware", "model_sha256", "data_sha256", "seed"},
      "fingerprint": {"sha256", "parts": {...}},   # what produced it (evalharness.fingerprint)
      "status": "ok" | "error",
      "error": null | {"type", "message", "bad_input", "traceback"},
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
import secrets
from pathlib import Path
from typing import Any, Iterator

from evalharness.errors import OutputError, ResultError

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
    """Write `obj` as JSON to `path` atomically: a reader sees the old file or the new one, never half.

    The file gets the permissions the umask gives a new file (it is created with mode 0o666, which the kernel masks,
    then renamed over `path`). A write that fails (disk full, read-only folder) leaves `path` as it was and raises
    `OutputError` naming the file and the cause."""
    path = Path(path)
    data = json.dumps(_clean(obj), indent=1, sort_keys=False, allow_nan=False)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write {path}: {exc.strerror or exc} (errno {exc.errno}); nothing was half-written "
                          f"and finished results are kept: free space on (or fix the permissions of) {path.parent} "
                          "and run again (`run --resume` continues a suite)") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def remove_stale_temp_files(directory: str | Path) -> list[Path]:
    """Delete the temporary files (`.NAME.PID.RANDOM.tmp`) an interrupted writer left in `directory`; call it only
    while holding the folder's lock (`evalharness.lock`), so that no live writer's file is removed."""
    d = Path(directory)
    stale = [p for p in d.glob(".*.tmp") if p.is_file()] if d.is_dir() else []
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


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
    for name, value in obj["metrics"].items():
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise ResultError(f"{path}: metric '{name}' is {value!r} ({type(value).__name__}), not a number; result "
                              "and baseline files hold numbers (null for NaN/Inf) only: re-run the suite (for a "
                              "baseline: `evalharness baseline update RESULTS_DIR` from a fresh run)")
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


def load_dir(results_dir: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(suite manifest or {}, result documents) of a results dir."""
    d = Path(results_dir)
    manifest = {}
    if (d / "suite.json").exists():
        try:
            manifest = json.loads((d / "suite.json").read_text())
        except json.JSONDecodeError as exc:
            raise ResultError(f"{d / 'suite.json'}: corrupt JSON ({exc})") from None
    docs = [doc for _, doc in iter_results(d)]
    if not docs:
        raise ResultError(f"{d}: no result files (run `evalharness run SUITE --out {d}` first)")
    return manifest, docs
