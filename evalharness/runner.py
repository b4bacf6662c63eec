"""Runs a suite: for each model, load the weights once, build the FP32 reference once,
then for each recipe x serving config build the engine, run the evals, and write
the result file atomically as soon as that run finishes.

Memory of one model group (docs/guide/models-and-data.md, "Memory"): the loader's fp32 weights (one
copy, shared by the engine's master weights and, on the same device, by the
reference), plus one recipe's prepared weights at a time. The suite's
`reference_device` (auto | cpu | cuda) puts the reference elsewhere than the
engine, e.g. on the host when it does not fit on the GPU next to the engine."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
import traceback
from itertools import groupby
from pathlib import Path
from typing import Any, Callable

import torch

from engine.api import Engine, ParallelConfig
from engine.loading import LoadedModel, load_model
from engine.model import Transformer
from engine.serving import ServingConfig
from evalharness import distributed, fingerprint, provenance
from evalharness.errors import BAD_INPUT, BusyError, PartlyRunError, SuiteError
from evalharness.evals import EvalContext, run_eval
from evalharness.fingerprint import Inputs, model_inputs, model_source, run_fingerprint
from evalharness.lock import results_lock
from evalharness.memory_plan import plan_for_runs
from evalharness.progress import Progress, no_bars
from evalharness.reference import ReferenceLM
from evalharness.results import SCHEMA_VERSION, remove_stale_temp_files, write_json_atomic
from evalharness.streamed import open_streamed, streamed_engine
from evalharness.suite_schema import RUNTIME_KNOBS, ServingEntry
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


class DeviceLost(Exception):
    """A run crashed with a sticky CUDA error (e.g. an illegal memory access): every later CUDA call of this
    process fails the same way, so the suite stops; carries the outcomes written so far."""

    def __init__(self, message: str, outcomes: list[RunOutcome]):
        super().__init__(message)
        self.outcomes = outcomes


def _cuda_lost(device: str) -> bool:
    """After a crash on `device`: whether its CUDA context is unusable (a sticky error that every later call
    raises again); False off CUDA and when a synchronize and a tiny kernel still work."""
    if device != "cuda":
        return False
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
        return False
    except Exception:
        return True


def resolve_backend(suite_backend: str, device: str | None) -> str:
    """`--device` overrides the suite's backend device: cpu -> cpu-emulated; cuda -> the suite's cuda backend
    (cuda-emulated or cuda-native), else cuda-emulated; auto -> cuda when available."""
    if device in (None, ""):
        return suite_backend
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return "cpu-emulated"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            from evalharness.errors import HarnessError

            raise HarnessError("--device cuda: no CUDA GPU is visible on this machine (use --device cpu or auto)")
        return suite_backend if suite_backend.startswith("cuda") else "cuda-emulated"
    from evalharness.errors import HarnessError

    raise HarnessError(f"--device must be auto, cpu or cuda, got '{device}'")


def resolve_reference_device(setting: str, engine_device: str) -> str:
    """The device the FP32 reference runs on: `auto` -> the engine's device, else `cpu` / `cuda` as asked."""
    from evalharness.errors import SuiteError
    from evalharness.suite_schema import REFERENCE_DEVICES

    if setting not in REFERENCE_DEVICES:
        raise SuiteError(f"reference_device must be one of {list(REFERENCE_DEVICES)}, got {setting!r}")
    if setting == "auto":
        return engine_device
    if setting == "cuda" and not torch.cuda.is_available():
        raise SuiteError("reference_device: cuda, but no CUDA GPU is visible on this machine (use cpu or auto)")
    return setting


def check_device(suite: Suite) -> None:
    """A suite whose runs need a CUDA GPU fails up front, on a machine without one, with what to run instead: the
    same suite on the cpu-emulated backend (`--device cpu`), or its CPU sibling suite when there is one."""
    backends = sorted({r.backend for r in suite.runs if r.backend.startswith("cuda")})
    if not backends or torch.cuda.is_available():
        return
    why = (f"torch {torch.__version__} is built without CUDA" if torch.version.cuda is None
           else f"torch {torch.__version__} sees no CUDA GPU")
    twin = suite.path.with_name(suite.path.name.replace("-gpu", "")) if "-gpu" in suite.path.stem else None
    instead = "`--device cpu` runs it on the cpu-emulated backend"
    if twin is not None and twin.exists():
        instead = f"the CPU suite is {twin}, or {instead}"
    raise SuiteError(f"{suite.path}: suite '{suite.name}' runs on {', '.join(backends)} and needs a CUDA GPU, but "
                     f"{why} on this machine. Run it on a GPU machine; on this one, {instead}")


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
                counters: dict[str, int], reference_device: str | None, inputs: Inputs) -> dict[str, Any]:
    """Assemble a result document (see evalharness.results for the schema)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "result",
        "run_key": spec.key,
        "suite": {"name": suite.name, "path": str(suite.path), "sha256": suite.sha256},
        "spec": spec.to_dict(),
        "fingerprint": run_fingerprint(spec, inputs, suite.reference_device),
        "provenance": {
            "git_sha": provenance.git_sha(), "created_at": provenance.now_iso(),
            "packages": provenance.package_versions(), "hardware": provenance.hardware_fingerprint(device),
            "model_sha256": model_sha, "data_sha256": data_sha, "seed": spec.seed,
            "reference_device": reference_device,
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
              on_result: Callable[[Path, dict], None] | None = None,
              progress: Progress | None = None) -> list[RunOutcome]:
    """Run every RunSpec of `suite` into `out_dir`; never loses a finished result.

    `log` gets one line per finished eval of a run and per finished run (`[n/total] <run key>: ...`), plus the
    loading and resume lines; `progress` (`evalharness.progress.Progress`) draws the bars over the runs, the evals
    of a run and the work inside each eval on a terminal, and gives each run's line the suite's ETA (default:
    no bars).

    `on_result(path, doc)` is called after each result file is written (e.g. mlflow logging). The folder is
    locked for the call (`evalharness.lock`: a second writer gets a BusyError naming this one). With `resume`, a
    run whose result file holds a successful result of the same fingerprint (`evalharness.fingerprint`) is skipped;
    one whose inputs changed is run again, and the log says what changed. Under torchrun the RunSpecs are spread
    over the ranks and rank 0 writes every file (`evalharness.distributed`); a RunSpec needing more ranks than
    there are is a SuiteError. A suite that needs a GPU fails up front on a machine without one."""
    out = Path(out_dir)
    progress = progress if progress is not None else no_bars()
    check_device(suite)
    dp = distributed.current()
    distributed.check_world(suite.runs, dp.world if dp is not None else 1)
    if dp is not None:
        return _run_suite_parallel(suite, out, resume, log, on_result, dp, progress)
    with results_lock(out):
        remove_stale_temp_files(out)
        write_json_atomic(out / "suite.json", suite.manifest())
        for msg in suite.skipped:
            log(f"skipped: {msg}")
        total = len(suite.runs)
        skip, inputs = _resume_plan(suite, out, log) if resume else (set(), {})
        with progress.runs(total, finished=len(skip)):
            return _run_serial(suite, out, log, on_result, progress, skip, inputs)


def _run_serial(suite: Suite, out: Path, log: Callable[[str], None], on_result: Callable[[Path, dict], None] | None,
                progress: Progress, skip: set[str], inputs: dict[str, Inputs]) -> list[RunOutcome]:
    """The body of `run_suite` in one process, with the results folder locked: the runs of each model in turn."""
    outcomes: list[RunOutcome] = []
    total = len(suite.runs)
    done = 0
    for name, group in groupby(suite.runs, key=lambda r: r.model["name"]):
        runs = list(group)
        pending = []
        for spec in runs:
            if spec.key in skip:
                done += 1
                log(f"[{done}/{total}] {spec.key}: already finished (resume), skipped")
                outcomes.append(RunOutcome(spec.key, "skipped", out / f"{spec.key}.json", {}))
            else:
                pending.append(spec)
        if pending:
            try:
                outcomes.extend(_run_model_group(suite, pending, out, log, done, total, on_result,
                                                 inputs=inputs.get(name), progress=progress))
            except DeviceLost as lost:
                outcomes.extend(lost.outcomes)
                left = total - done - len(lost.outcomes)
                log(f"stopped: {lost}. {left} run(s) did not run (no result file); finished results are kept. "
                    f"Fix the cause (the error result's traceback), then run again with --resume.")
                return outcomes
            done += len(pending)
    return outcomes


def _resume_plan(suite: Suite, out: Path, log: Callable[[str], None]) -> tuple[set[str], dict[str, Inputs]]:
    """For `--resume`: the run keys to skip (their result is finished and of the same fingerprint), and the
    content hashes of the models fingerprinted on the way (so that they are not hashed twice). Each run that must
    run again is logged with the reason (its result errored, or what changed since it was written); a last line
    counts them."""
    skip: set[str] = set()
    inputs: dict[str, Inputs] = {}
    again = new = 0
    for spec in suite.runs:
        path = out / f"{spec.key}.json"
        if not path.exists():
            new += 1
            continue
        name = spec.model["name"]
        if name not in inputs:
            inputs[name] = model_inputs(spec.model)
        done, why = fingerprint.resume_check(path, run_fingerprint(spec, inputs[name], suite.reference_device))
        if done:
            skip.add(spec.key)
        else:
            again += 1
            log(f"resume: {spec.key}: {why}: running it again")
    log(f"resume: {len(skip)} run(s) finished, {again} to run again, {new} not run yet")
    return skip, inputs


def _run_suite_parallel(suite: Suite, out: Path, resume: bool, log: Callable[[str], None],
                        on_result: Callable[[Path, dict], None] | None,
                        dp: distributed.DataParallel, progress: Progress) -> list[RunOutcome]:
    """`run_suite` over a torchrun world: each rank runs its share of the RunSpecs (`distributed.schedule`),
    rank 0 writes its results as they finish and the others' when they are gathered at the end."""
    lead = dp.rank == 0
    with contextlib.ExitStack() as stack:
        busy = None
        if lead:  # rank 0 writes every file: it holds the folder's lock, and every rank stops when it cannot
            try:
                stack.enter_context(results_lock(out))
            except BusyError as exc:
                busy = str(exc)
        busy = dp.broadcast(busy)
        if busy:
            raise BusyError(busy)
        return _run_parallel_locked(suite, out, resume, log, on_result, dp, progress)


def _run_parallel_locked(suite: Suite, out: Path, resume: bool, log: Callable[[str], None],
                         on_result: Callable[[Path, dict], None] | None,
                         dp: distributed.DataParallel, progress: Progress) -> list[RunOutcome]:
    """The body of `_run_suite_parallel`, with rank 0 holding the results folder's lock."""
    lead = dp.rank == 0
    if lead:
        remove_stale_temp_files(out)
        write_json_atomic(out / "suite.json", suite.manifest())
        for msg in suite.skipped:
            log(f"skipped: {msg}")
    skip = _resume_plan(suite, out, log)[0] if resume and lead else set()
    finished = set(dp.broadcast([i for i, s in enumerate(suite.runs) if s.key in skip] if lead else None))
    pending = [i for i in range(len(suite.runs)) if i not in finished]
    placement = distributed.schedule([suite.runs[i] for i in pending], dp.world)
    dp.make_groups(placement)
    ranks_of = dict(zip(pending, placement))
    mine = [i for i in pending if dp.rank in ranks_of[i]]
    index = {suite.runs[i].key: i for i in mine}
    say = log if lead else (lambda s: log(f"[rank {dp.rank}] {s}"))
    say(f"rank {dp.rank} of {dp.world}: {len(mine)} of {len(pending)} run(s) here")
    led: dict[int, tuple[dict, RunOutcome]] = {}  # runs this rank leads (first rank of their group)
    docs: dict[int, dict] = {}

    def sink(spec: RunSpec, path: Path, doc: dict) -> None:
        i = index[spec.key]
        if ranks_of[i][0] != dp.rank:
            return  # a model-parallel peer: the group's first rank reports the run
        if lead:
            write_json_atomic(path, doc)
            _notify(on_result, path, doc, log)
        docs[i] = doc

    def place(spec: RunSpec):
        ranks = ranks_of[index[spec.key]]
        return dp.groups.get(ranks) if len(ranks) > 1 else None

    done = 0
    for _, group in groupby(mine, key=lambda i: suite.runs[i].model["name"]):
        ids = list(group)
        outs = _run_model_group(suite, [suite.runs[i] for i in ids], out, say, done, len(mine), None, sink=sink,
                                place=place, ref_cache=lead, progress=progress if lead else no_bars())
        done += len(ids)
        led.update({i: (docs[i], o) for i, o in zip(ids, outs) if i in docs})
    gathered = dp.gather({i: (None if lead else doc, o) for i, (doc, o) in led.items()})
    outcomes: list[RunOutcome] | None = None
    if lead:
        for part in gathered[1:]:
            for i, (doc, _) in part.items():
                path = out / f"{suite.runs[i].key}.json"
                write_json_atomic(path, doc)
                _notify(on_result, path, doc, log)
        reported = {i: o for part in gathered for i, (_, o) in part.items()}
        outcomes = [reported[i] if i in reported else
                    RunOutcome(s.key, "skipped", out / f"{s.key}.json", {}) for i, s in enumerate(suite.runs)]
        for i in sorted(finished):
            log(f"{suite.runs[i].key}: already finished (resume), skipped")
    return dp.broadcast(outcomes)


def _run_model_group(suite: Suite, runs: list[RunSpec], out: Path, log, done: int, total: int,
                     on_result: Callable[[Path, dict], None] | None = None, sink=None, place=None,
                     ref_cache: bool = True, inputs: Inputs | None = None,
                     progress: Progress | None = None) -> list[RunOutcome]:
    """Load one model (and its reference) once, then run each of its RunSpecs.

    Any failure while loading the model, its tokenizer or its reference becomes an error result for each of its
    runs (bad input: `bad_input: true`, so that `run` exits 2; anything else with its traceback: exit 1), and the
    suite goes on with the next model. An eval that runs only in part (`evalharness.errors.PartlyRunError`: a
    generating task on a layer-streamed model) keeps its metrics and samples, the run's other evals run, and the run
    is an error result (bad input) naming what did not run.

    `sink(spec, path, doc)` takes each result document (default: write it, then `on_result`);
    `place(spec)` gives the process group of a model-parallel RunSpec (default: none);
    `ref_cache=False` keeps the reference cache off disk (non-zero ranks write nothing);
    `inputs`: the model's content hashes when `--resume` computed them already;
    `progress`: the bars, and the suite's ETA in each run's line (`run_suite`).
    """
    progress = progress if progress is not None else no_bars()
    if sink is None:
        def sink(spec: RunSpec, path: Path, doc: dict) -> None:
            write_json_atomic(path, doc)
            _notify(on_result, path, doc, log)
    model = runs[0].model
    device = "cuda" if runs[0].backend.startswith("cuda") else "cpu"
    outcomes = []
    t0 = time.time()
    ref_device = None
    try:
        ref_device = resolve_reference_device(suite.reference_device, device)
        torch.manual_seed(runs[0].seed)
        plan = plan_for_runs(suite, runs, device, log)  # before loading: a model that cannot fit fails here
        if plan.mode == "streamed":  # weights read one layer at a time (evalharness.streamed)
            loaded, base_model, reference = open_streamed(model_source(model), device, ref_device, plan)
            tokenizer = _load_tokenizer(model, loaded)
        else:
            loaded = load_model(model_source(model))
            tokenizer = _load_tokenizer(model, loaded)
            if ref_device == device != "cpu":
                loaded.to(device)  # one device copy, shared by the reference and the engine's master weights
            # the engine's model first: it checks every tensor against the config (name, shape, finite values) and
            # names the first bad one; the reference then shares the same tensors
            base_model = Transformer(loaded.cfg, loaded.weights, where=loaded.source).to(device)
            reference = ReferenceLM(loaded, device=ref_device)
    except Exception as exc:  # bad input (exit 2) or a crash (exit 1): an error result per run, the suite goes on
        bad = isinstance(exc, BAD_INPUT)
        msg = f"model '{model['name']}': {exc}"
        log(f"error: {msg}")
        error = {"type": type(exc).__name__, "message": msg, "bad_input": bad}
        if not bad:
            error["traceback"] = traceback.format_exc(limit=8)
        inputs = inputs or model_inputs(model)
        for i, spec in enumerate(runs):
            path = out / f"{spec.key}.json"
            doc = _result_doc(spec, suite, "error", {}, {}, {}, error, None, {}, device, {}, ref_device, inputs)
            sink(spec, path, doc)
            log(f"[{done + i + 1}/{total}] {spec.key}: ERROR {error['type']} (model '{model['name']}' did not load)"
                + _meter(progress))
            outcomes.append(RunOutcome(spec.key, "error", path, {}, msg, bad_input=bad))
            if i == 0 and _cuda_lost(device):  # one error result, not one per run for a context that is gone
                raise DeviceLost(f"the CUDA context is unusable after loading model '{model['name']}' failed "
                                 f"({error['type']})", outcomes)
        return outcomes
    if inputs is None or inputs.model != loaded.sha256:
        inputs = model_inputs(model, model_sha=loaded.sha256, model_dir=loaded.directory)
    log(f"loaded model '{model['name']}' ({loaded.cfg.num_layers} layers, vocab {loaded.cfg.vocab_size}, "
        f"{loaded.weight_bytes / 2**20:.0f} MiB fp32) and its FP32 reference (on {ref_device}) "
        f"in {time.time() - t0:.1f}s")
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
        work: dict[str, int] = {}  # tokens / decode steps each eval cost the engine and the reference
        error = None
        ctx = kernels = None
        not_run: list[str] = []  # evals that ran only in part (evalharness.errors.PartlyRunError)
        stack = contextlib.ExitStack()  # the run's bar over its evals
        try:
            engine_for = _engine_factory(base_model, spec, place(spec) if place is not None else None)
            own = distributed.serving_parallel(spec.serving)
            engine = engine_for(own.tp, own.ep)
            kernels = engine.kernel_settings()  # what chose the kernels: the result's provenance.kernels
            engine.default_prefill_chunk = spec.serving.get("prefill_chunk")
            ctx = EvalContext(engine=engine, reference=reference, tokenizer=tokenizer, corpus=model["corpus"],
                              vocab_size=loaded.cfg.vocab_size, batch_size=spec.serving["batch_size"],
                              seed=spec.seed, cache=cache, counters=counters, bos_id=bos_id,
                              ref_cache_dir=str(out / "ref_cache") if ref_cache else None, model_sha=loaded.sha256,
                              engine_for=engine_for, parallel=(own.tp, own.ep),
                              data_dir=str(suite.data_dir) if suite.data_dir else None,  # for the tasks eval
                              progress=progress)
            bar = stack.enter_context(progress.evals(spec.key, list(spec.evals)))
            for j, (name, cfg) in enumerate(spec.evals.items(), 1):
                te = time.time()
                torch.manual_seed(spec.seed)
                before = {side: dict(getattr(obj, "work", {})) for side, obj in (("engine", engine),
                                                                                ("reference", reference))}
                ref_before = ctx.timing.get("reference_s", 0.0)
                try:
                    m, s = run_eval(name, ctx, cfg)
                except PartlyRunError as part:  # what ran is kept; the run ends as an error naming the rest
                    m, s = part.metrics, part.samples
                    not_run.append(f"{name}: {part}")
                timing[f"{name}_s"] = round(time.time() - te, 3)
                timing[f"{name}.reference_s"] = round(ctx.timing.get("reference_s", 0.0) - ref_before, 3)
                for side, obj in (("engine", engine), ("reference", reference)):  # work of this eval, per side
                    for k, v in getattr(obj, "work", {}).items():
                        if v != before[side].get(k, 0):
                            work[f"{name}.{side}.{k}"] = v - before[side].get(k, 0)
                metrics.update({f"{name}.{k}": v for k, v in m.items()})
                if s:
                    samples[name] = s
                bar.update(1)
                log(f"[{done + i + 1}/{total}] {spec.key}: {name} done in {timing[f'{name}_s']:.1f}s "
                    f"({j}/{len(spec.evals)} evals)")
            data_sha = dict(ctx.data_hashes)
            coverage = getattr(engine, "native_coverage", None)  # an optional engine method (engine.api.Engine)
            metrics.update({f"native.{k}": v for k, v in (coverage() if coverage else {}).items()})
            status = "ok"
            if not_run:
                raise PartlyRunError("; ".join(not_run), {}, {})
        except BAD_INPUT as exc:
            status, error = "error", {"type": type(exc).__name__, "message": str(exc), "bad_input": True}
        except Exception as exc:  # a crashing eval must not take the suite down; record it
            status = "error"
            error = {"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc(limit=8)}
        finally:
            stack.close()
        if ctx is not None:  # the evals' own part timings (kept for a failed run too: where did the time go)
            timing.update({k: round(v, 3) for k, v in ctx.timing.items() if k != "reference_s"})
        timing["total_s"] = round(time.time() - t_run, 3)
        engine = ctx = engine_for = None  # drop this recipe's prepared weights before the next one is built
        doc = _result_doc(spec, suite, status, metrics, samples, timing, error, loaded.sha256, data_sha, device,
                          {**counters, **work}, ref_device, inputs)
        doc["provenance"]["kernels"] = kernels
        sink(spec, path, doc)
        n = done + i + 1
        if status == "ok":
            log(f"[{n}/{total}] {spec.key}: ok in {timing['total_s']:.1f}s" + _meter(progress))
        else:
            log(f"[{n}/{total}] {spec.key}: ERROR {error['type']}: {error['message']}" + _meter(progress))
        outcomes.append(RunOutcome(spec.key, status, path, metrics, error["message"] if error else None,
                                   bad_input=bool(error and error.get("bad_input"))))
        if status == "error" and _cuda_lost(device):
            raise DeviceLost(f"the CUDA context is unusable after {spec.key} crashed ({error['type']})", outcomes)
    return outcomes


def _meter(progress: Progress) -> str:
    """Count a finished run on the suite's bar; ` (<runs done>, elapsed, eta, rate)` for its line, or ''."""
    meter = progress.run_done()
    return f" ({meter})" if meter else ""


def serving_config(serving: dict[str, Any], cuda: bool) -> ServingConfig:
    """How the engine serves the run's generation requests: the serving entry's batch size and every other
    `ServingConfig` knob it sets (`suite_schema.RUNTIME_KNOBS`, the suite's defaults for the rest; CUDA graphs on
    CUDA only; `max_tokens` is sized per call)."""
    knobs = {k: serving.get(k, ServingEntry.model_fields[k].default) for k in RUNTIME_KNOBS}
    knobs["cuda_graphs"] = cuda and knobs["cuda_graphs"]
    return ServingConfig(max_batch=serving["batch_size"], **knobs)


def _engine_factory(base_model: Transformer, spec: RunSpec, group) -> Callable[[int, int], Engine]:
    """`engine_for(tp, ep)`: the RunSpec's engine at that parallel degree (built once each), on `group`."""
    engines: dict[tuple[int, int], Engine] = {}
    options = {k: spec.serving[k] for k in ("attn_block", "small_m") if k in spec.serving}

    def engine_for(tp: int, ep: int) -> Engine:
        if (tp, ep) not in engines:
            if not isinstance(base_model, Transformer):  # a LayerStore: the run is layer-streamed
                eng = streamed_engine(base_model, spec, options)
            else:
                eng = Engine(base_model, spec.recipe, backend=spec.backend, parallel=ParallelConfig(tp=tp, ep=ep),
                             group=group, **options)
            eng.serving = serving_config(spec.serving, eng.device.type == "cuda")
            engines[(tp, ep)] = eng
        return engines[(tp, ep)]

    return engine_for
