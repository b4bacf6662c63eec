"""Content fingerprints: what produced a result, so that `--resume` re-runs what changed and the gate compares
like with like.

Every result records ``fingerprint``::

    {"sha256": "<hash of the parts>",
     "parts": {"recipe": ..., "evals.<eval>": ..., "model": ..., "tokenizer": ..., "corpus": ...,
               "backend": ..., "serving": ..., "seed": ..., "reference_device": ..., "harness": ...}}

* ``recipe``: the resolved recipe, every site (its description left out);
* ``evals.<eval>``: each eval's settings with the defaults filled in;
* ``model``: sha256 of the checkpoint files (config.json and safetensors, or the llama2.c file);
* ``tokenizer``: sha256 of the tokenizer files (``none`` without a tokenizer, ``bytes`` for the byte tokenizer);
* ``corpus``: sha256 of the corpus file (``hf:`` corpora are named, not hashed);
* ``backend``, ``serving`` (the serving config), ``seed``, ``reference_device`` (the suite's setting);
* ``harness``: the evalharness version and a sha256 of the engine's and the harness's source files.

`resume_check` compares a finished result's fingerprint with the one its run would have now: any difference
re-runs it, and the message names the parts that changed.

The gate (`baseline_mismatch`) compares a result with its baseline on what the comparison is *of*: the run key, the
checkpoint, tokenizer, corpus and token windows, and the eval settings. A difference there is bad input; a
difference only in settings that change how many samples are taken (`SAMPLE_COUNT_SETTINGS`) is a WARN. The
recipe, serving config, seed and harness version may differ: they are what a gate judges (a candidate recipe under
a baseline's run key, a batch-size change, a code change).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from evalharness.data import BUILTIN_DIR, builtin_path
from evalharness.errors import ResultError

if TYPE_CHECKING:
    from engine.loading import ModelSource

# Settings that only change how many samples an eval takes (windows, documents, trials): a baseline with other
# values is compared with a WARN that says so.
SAMPLE_COUNT_SETTINGS: dict[str, tuple[str, ...]] = {
    "layer_error": ("windows",),
    "ppl_kld": ("max_windows", "max_tokens"),
    "tasks": ("limit",),
    "longctx": ("prompts_per_len", "passkey_trials", "kld_docs", "max_tokens"),
    "invariance": ("windows", "reruns"),
    "switching": ("windows", "reps"),
    "threeway": ("windows",),
}
# Settings that say where files are or how work is batched, not what is measured: not compared by the gate.
LOCATION_SETTINGS: dict[str, tuple[str, ...]] = {"tasks": ("data_dir", "include_paths", "batch_size")}
# Files of a tokenizer folder (HF): their bytes define the tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tokenizer.bin",
                   "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt")


def _digest(obj: Any) -> str:
    """Short sha256 (16 hex digits) of a JSON-able object, key order ignored."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read 1 MiB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@lru_cache(maxsize=1)
def code_sha256() -> str:
    """sha256 over the engine's and the harness's source files (*.py, *.yaml), by relative path: any code change,
    committed or not, changes it."""
    import engine

    h = hashlib.sha256()
    for pkg in (Path(engine.__file__).parent, Path(__file__).parent):
        for p in sorted(q for ext in ("*.py", "*.yaml") for q in pkg.rglob(ext) if "__pycache__" not in q.parts):
            h.update(f"{pkg.name}/{p.relative_to(pkg).as_posix()}\0".encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def harness_version() -> str:
    """The evalharness version and the sha256 of its (and the engine's) sources."""
    from evalharness import __version__

    return f"{__version__}+{code_sha256()[:16]}"


def model_source(model: dict[str, Any]) -> ModelSource:
    """A suite model entry's source, parsed by the engine's grammar (`engine.loading.parse_source`), a
    `builtin:NAME` resolved to its folder in the package."""
    from engine.loading import parse_source

    return parse_source(model["path"], builtin_dir=BUILTIN_DIR)


def _folder_sha256(folder: Path, names: tuple[str, ...]) -> str | None:
    """sha256 over the named files present in `folder` (name and bytes), None when there is none."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and (p.name in names or p.suffix == ".tiktoken"))
    if not files:
        return None
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}\0{file_sha256(p)}\n".encode())
    return h.hexdigest()


def tokenizer_sha256(model: dict[str, Any], model_dir: str | None) -> str:
    """The tokenizer's content hash: 'bytes', the hash of its file(s), or 'none' (no tokenizer: token corpora)."""
    spec = model.get("tokenizer")
    if spec == "bytes":
        return "bytes"
    if spec in (None, "", "auto"):
        if model_dir is None:
            return "none"
        return _folder_sha256(Path(model_dir), TOKENIZER_FILES) or "none"
    path = Path(spec.split(":", 1)[1] if spec.startswith(("llama2c:", "hf:")) else spec).expanduser()
    if not path.exists() and model_dir and not path.is_absolute() and (Path(model_dir) / path).exists():
        path = Path(model_dir) / path
    if path.is_dir():
        return _folder_sha256(path, TOKENIZER_FILES) or "none"
    return file_sha256(path)


def corpus_sha256(ref: str) -> str:
    """The corpus's content hash (`hf:` datasets by name: their content is not hashed)."""
    if ref.startswith("hf:"):
        return ref
    if ref.startswith("builtin:"):
        return file_sha256(builtin_path(ref.removeprefix("builtin:")) / "corpus.json")
    return file_sha256(Path(ref).expanduser())


@dataclasses.dataclass(frozen=True)
class Inputs:
    """Content hashes of a model's inputs (None: could not be read; the run then reports why)."""

    model: str | None
    tokenizer: str | None
    corpus: str | None


def model_inputs(model: dict[str, Any], model_sha: str | None = None, model_dir: str | None = None) -> Inputs:
    """The content hashes of a suite model entry's checkpoint, tokenizer and corpus. `model_sha` / `model_dir`
    come from an already loaded model; without them the checkpoint files are hashed here (for `--resume`, before
    anything is loaded). A part that cannot be read is None."""
    from engine.loading import checkpoint_sha256, resolve_model_dir

    source = model_source(model)

    def attempt(fn):
        try:
            return fn()
        except Exception:  # unreadable: the run itself will fail on it, with a message that names the file
            return None

    if model_sha is None:
        model_sha = attempt(lambda: checkpoint_sha256(source))
    if model_dir is None and source.kind != "llama2c":
        model_dir = attempt(lambda: str(resolve_model_dir(source.path)))
    return Inputs(model=model_sha, tokenizer=attempt(lambda: tokenizer_sha256(model, model_dir)),
                  corpus=attempt(lambda: corpus_sha256(model["corpus"])))


def eval_settings(name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """An eval's settings with the defaults filled in (as the eval runs them)."""
    from evalharness.evals import validate_eval_config

    return validate_eval_config(name, dict(cfg or {}))


def run_fingerprint(spec, inputs: Inputs, reference_device: str) -> dict[str, Any]:
    """The fingerprint of a RunSpec (see the module docstring) with its inputs' content hashes."""
    recipe = {k: v for k, v in spec.recipe.to_dict().items() if k != "description"}
    parts: dict[str, Any] = {"recipe": _digest(recipe)}
    for name, cfg in spec.evals.items():
        parts[f"evals.{name}"] = _digest(eval_settings(name, cfg))
    parts.update({"model": inputs.model, "tokenizer": inputs.tokenizer, "corpus": inputs.corpus,
                  "backend": spec.backend, "serving": _digest(spec.serving), "seed": spec.seed,
                  "reference_device": reference_device, "harness": harness_version()})
    return {"sha256": hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest(), "parts": parts}


def changed_parts(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The names of the parts in which two fingerprints differ (a part missing on one side differs)."""
    a, b = old.get("parts") or {}, new.get("parts") or {}
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def resume_check(path: Path, fingerprint: dict[str, Any]) -> tuple[bool, str]:
    """(skip, why) for `--resume`: skip a run whose file holds a successful result of the same fingerprint;
    otherwise `why` says what makes it run again."""
    from evalharness.results import load_result

    if not path.exists():
        return False, ""
    try:
        doc = load_result(path)
    except ResultError as exc:
        return False, f"its result file is unreadable ({exc})"
    if doc.get("status") != "ok" or doc.get("kind", "result") != "result":
        return False, f"its result is status '{doc.get('status')}'"
    old = doc.get("fingerprint")
    if not isinstance(old, dict) or "parts" not in old:
        return False, "its result has no fingerprint (written by an older harness)"
    if old.get("sha256") == fingerprint["sha256"]:
        return True, ""
    what = ", ".join(changed_parts(old, fingerprint)) or "its fingerprint"
    return False, f"{what} changed since its result was written"


# ---------------------------------------------------------------- the gate: like with like

def _windows(doc: dict[str, Any]) -> dict[str, str]:
    """The token-window hashes of a result, keyed by their settings ('seq128|strideNone|n32|bos0'), corpus path
    left out (it differs between machines)."""
    data = (doc.get("provenance") or {}).get("data_sha256") or {}
    return {k.split("|", 1)[1]: v for k, v in data.items() if "|seq" in k and isinstance(v, str)}


def baseline_mismatch(cur: dict[str, Any], base: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(errors, warnings) of comparing result `cur` with baseline `base` (module docstring): errors when the
    baseline measured something else, warnings when only the sample counts differ."""
    errors: list[str] = []
    warnings: list[str] = []
    if base.get("run_key") != cur.get("run_key"):
        errors.append(f"it is the baseline of run '{base.get('run_key')}', not of '{cur.get('run_key')}'")
    cs, bs = cur.get("spec") or {}, base.get("spec") or {}
    if cs.get("backend") != bs.get("backend"):
        errors.append(f"backend {cs.get('backend')!r} (baseline {bs.get('backend')!r})")
    cm, bm = ((d.get("provenance") or {}).get("model_sha256") for d in (cur, base))
    if cm and bm and cm != bm:
        errors.append(f"another checkpoint (model sha256 {cm[:12]}, baseline {bm[:12]})")
    cp, bp = ((d.get("fingerprint") or {}).get("parts") or {} for d in (cur, base))
    for part in ("tokenizer", "corpus"):
        if cp.get(part) and bp.get(part) and cp[part] != bp[part]:
            errors.append(f"another {part} (sha256 {str(cp[part])[:12]}, baseline {str(bp[part])[:12]})")
    ce, be = cs.get("evals") or {}, bs.get("evals") or {}
    same_settings = True
    for name in sorted(set(ce) | set(be)):
        if name not in be or name not in ce:
            side = "baseline" if name not in be else "result"
            warnings.append(f"the {side} has no {name} eval: its metrics are not compared")
            continue
        try:
            a, b = eval_settings(name, ce[name]), eval_settings(name, be[name])
        except ValueError as exc:
            errors.append(f"evals.{name} settings are invalid ({exc})")
            continue
        diff = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)
                and k not in LOCATION_SETTINGS.get(name, ())]
        counts = [k for k in diff if k in SAMPLE_COUNT_SETTINGS.get(name, ())]
        other = [k for k in diff if k not in counts]
        show = lambda keys: ", ".join(f"{k}={a.get(k)!r} (baseline {b.get(k)!r})" for k in keys)  # noqa: E731
        if other:
            errors.append(f"other evals.{name} settings: {show(other)}")
        if counts:
            warnings.append(f"evals.{name} takes another number of samples than the baseline: {show(counts)}; "
                            "the values are compared, paired tests need equal samples")
        same_settings = same_settings and not diff
    cw, bw = _windows(cur), _windows(base)
    if same_settings and not errors:
        differ = sorted(k for k in set(cw) & set(bw) if cw[k] != bw[k])
        if differ:
            errors.append(f"the token windows differ ({', '.join(differ)}): another corpus or tokenizer, or a "
                          "change in how text is tokenized")
    return errors, warnings
