"""Runs a suite: for each model, load the weights once, build the FP32 reference once,
then for each recipe x serving config build the engine, run the evals, and write
the result file atomically as soon as that run finishes."""

from __future__ import annotations

import dataclasses
import sys
import time
import traceback
from itertools import groupby
from pathlib import Path
from typing import Any, Callable

import torch

from engine.api import Engine
from engine.loading import LoadedModel, load_model
from engine.model import Transformer
from evalharness import provenance
from evalharness.data import builtin_path
from evalharness.errors import BAD_INPUT
from evalharness.evals import EvalContext, run_eval
from evalharness.reference import ReferenceLM
from evalharness.results import SCHEMA_VERSION, is_finished, write_json_atomic
from evalharness.suite import RunSpec, Suite


@dataclasses.dataclass
class RunOutcome:
    """What happened to one RunSpec."""

    key: str
    status: str  # ok | error | skipped (resumed)
    path: Path
    metrics: dict[str, Any]
    error: str | None = None
    bad_input: bool = False


def resolve_backend(suite_backend: str, device: str | None) -> str:
    """`--device` overrides the suite's backend: cpu -> cpu-emulated, cuda -> cuda-emulated, auto -> best available."""
    if device in (None, ""):
        return suite_backend
    if device == "auto":
        return "cuda-emulated" if torch.cuda.is_available() else "cpu-emulated"
    if device == "cpu":
        return "cpu-emulated"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            from evalharness.errors import HarnessError

            raise HarnessError("--device cuda: no CUDA GPU is visible on this machine (use --device cpu or auto)")
        return "cuda-emulated"
    from evalharness.errors import HarnessError

    raise HarnessError(f"--device must be auto, cpu or cuda, got '{device}'")


def _model_source(model: dict[str, Any]) -> str:
    """The loader's source string for a suite model entry (`builtin:NAME` -> its folder)."""
    path = model["path"]
    if path.startswith("builtin:"):
        return str(builtin_path(path.removeprefix("builtin:")))
    return path


def _load_tokenizer(model: dict[str, Any], loaded: LoadedModel):
    """The model's tokenizer (suite `tokenizer`, else found in the model folder), checked against its vocab."""
    from engine.tokenizer import check_compatible, load_tokenizer

    spec = model.get("tokenizer")
    if spec is None and loaded.directory is None:
        return None
    try:
        tok = load_tokenizer(spec, loaded.directory)
    except FileNotFoundError:
        if spec is not None:
            raise
        return None  # a model folder without tokenizer files: token corpora only
    check_compatible(tok, loaded.cfg.vocab_size, where=f"model '{model['name']}' ({model['path']})")
    return tok


def _result_doc(spec: RunSpec, suite: Suite, status: str, metrics: dict, samples: dict, timing: dict,
                error: dict | None, model_sha: str | None, data_sha: dict, device: str,
                counters: dict[str, int]) -> dict[str, Any]:
    """Assemble a result document (see evalharness.results for the schema)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "result",
        "run_key": spec.key,
        "suite": {"name": suite.name, "path": str(suite.path), "sha256": suite.sha256},
        "spec": spec.to_dict(),
        "provenance": {
            "git_sha": provenance.git_sha(), "created_at": provenance.now_iso(),
            "packages": provenance.package_versions(), "hardware": provenance.hardware_fingerprint(device),
            "model_sha256": model_sha, "data_sha256": data_sha, "seed": spec.seed,
        },
        "status": status,
        "error": error,
        "metrics": metrics,
        "samples": samples,
        "counters": counters,
        "timing": timing,
    }


def _notify(on_result: Callable[[Path, dict], None] | None, path: Path, doc: dict[str, Any], log) -> None:
    """Hand a just-written result to the `on_result` hook (mlflow logging); a failing hook only warns:
    the result is already on disk and the suite goes on."""
    if on_result is None:
        return
    try:
        on_result(path, doc)
    except Exception as exc:  # tracking is a view: it must never lose or block a result
        log(f"warning: logging {path.name} failed ({type(exc).__name__}: {exc}); the result is on disk")


def run_suite(suite: Suite, out_dir: str | Path, resume: bool = False,
              log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
              on_result: Callable[[Path, dict], None] | None = None) -> list[RunOutcome]:
    """Run every RunSpec of `suite` into `out_dir`; never loses a finished result.
    `on_result(path, doc)` is called after each result file is written (e.g. mlflow logging)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "suite.json", suite.manifest())
    for msg in suite.skipped:
        log(f"skipped: {msg}")
    outcomes: list[RunOutcome] = []
    total = len(suite.runs)
    done = 0
    for _, group in groupby(suite.runs, key=lambda r: r.model["name"]):
        runs = list(group)
        pending = []
        for spec in runs:
            path = out / f"{spec.key}.json"
            if resume and is_finished(path):
                done += 1
                log(f"[{done}/{total}] {spec.key}: already finished (resume), skipped")
                outcomes.append(RunOutcome(spec.key, "skipped", path, {}))
            else:
                pending.append(spec)
        if pending:
            outcomes.extend(_run_model_group(suite, pending, out, log, done, total, on_result))
            done += len(pending)
    return outcomes


def _run_model_group(suite: Suite, runs: list[RunSpec], out: Path, log, done: int, total: int,
                     on_result: Callable[[Path, dict], None] | None = None) -> list[RunOutcome]:
    """Load one model (and its reference) once, then run each of its RunSpecs."""
    model = runs[0].model
    device = "cuda" if runs[0].backend.startswith("cuda") else "cpu"
    outcomes = []
    t0 = time.time()
    try:
        torch.manual_seed(runs[0].seed)
        loaded = load_model(_model_source(model))
        tokenizer = _load_tokenizer(model, loaded)
        reference = ReferenceLM(loaded, device=device)
        base_model = Transformer(loaded.cfg, loaded.weights, where=loaded.source).to(device)
    except BAD_INPUT as exc:
        msg = f"model '{model['name']}': {exc}"
        log(f"error: {msg}")
        for spec in runs:
            path = out / f"{spec.key}.json"
            doc = _result_doc(spec, suite, "error", {}, {}, {}, {"type": type(exc).__name__, "message": msg},
                              None, {}, device, {})
            write_json_atomic(path, doc)
            _notify(on_result, path, doc, log)
            outcomes.append(RunOutcome(spec.key, "error", path, {}, msg, bad_input=True))
        return outcomes
    log(f"loaded model '{model['name']}' ({loaded.cfg.num_layers} layers, vocab {loaded.cfg.vocab_size}) "
        f"and its FP32 reference in {time.time() - t0:.1f}s")
    cache: dict[str, Any] = {}
    counters: dict[str, int] = {}
    bos_id = getattr(tokenizer, "bos_id", None) if tokenizer is not None else loaded.cfg.bos_token_id
    for i, spec in enumerate(runs):
        path = out / f"{spec.key}.json"
        t_run = time.time()
        metrics: dict[str, Any] = {}
        samples: dict[str, Any] = {}
        timing: dict[str, float] = {}
        data_sha: dict[str, str] = {}
        error = None
        try:
            engine = Engine(base_model, spec.recipe, backend=spec.backend)
            ctx = EvalContext(engine=engine, reference=reference, tokenizer=tokenizer, corpus=model["corpus"],
                              vocab_size=loaded.cfg.vocab_size, batch_size=spec.serving["batch_size"],
                              seed=spec.seed, cache=cache, counters=counters, bos_id=bos_id,
                              ref_cache_dir=str(out / "ref_cache"), model_sha=loaded.sha256,
                              data_dir=str(suite.data_dir) if suite.data_dir else None)  # for the tasks eval
            for name, cfg in spec.evals.items():
                te = time.time()
                torch.manual_seed(spec.seed)
                m, s = run_eval(name, ctx, cfg)
                timing[f"{name}_s"] = round(time.time() - te, 3)
                metrics.update({f"{name}.{k}": v for k, v in m.items()})
                if s:
                    samples[name] = s
            data_sha = dict(ctx.data_hashes)
            status = "ok"
        except BAD_INPUT as exc:
            status, error = "error", {"type": type(exc).__name__, "message": str(exc), "bad_input": True}
        except Exception as exc:  # a crashing eval must not take the suite down; record it
            status = "error"
            error = {"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc(limit=8)}
        timing["total_s"] = round(time.time() - t_run, 3)
        doc = _result_doc(spec, suite, status, metrics, samples, timing, error, loaded.sha256, data_sha, device,
                          dict(counters))
        write_json_atomic(path, doc)
        n = done + i + 1
        if status == "ok":
            log(f"[{n}/{total}] {spec.key}: ok in {timing['total_s']:.1f}s")
        else:
            log(f"[{n}/{total}] {spec.key}: ERROR {error['type']}: {error['message']}")
        _notify(on_result, path, doc, log)
        outcomes.append(RunOutcome(spec.key, status, path, metrics, error["message"] if error else None,
                                   bad_input=bool(error and error.get("bad_input"))))
    return outcomes
