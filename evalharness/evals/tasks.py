"""Downstream tasks through lm-eval's evaluator, engine vs FP32 reference on the same documents.

The tasks are lm-eval's own definitions (prompts, few-shot sampling, filters, metrics, groups), their datasets
read from the shared data folder (:mod:`evalharness.taskdata`), offline. Both models are wrapped in
:class:`evalharness.lm_adapter.HarnessLM` and run through ``lm_eval.evaluator.evaluate`` with
``log_samples=True``, one configured name at a time, on the same documents (same limit, few-shot count and seed;
prompt hashes are checked). The reference's per-document results are computed once per model and task
configuration and reused by every recipe (``EvalContext.reference_cached``).

A name is an lm-eval task, group (``mmlu``: its 57 subject tasks in four subgroups) or tag, or a task of the
user's ``include_paths`` (which override lm-eval's of the same name). Downloads are disabled
(``HF_DATASETS_OFFLINE=1``, ``HF_HUB_OFFLINE=1``): a task whose dataset the data folder does not stand in for
must find its data in local files or the local HF cache.

Per leaf task and per group (metrics ``tasks.<name>.<stat>``; a group pools the documents of its tasks, which is
lm-eval's aggregate for groups that weight by size, as ``mmlu`` does): ``acc_ref`` / ``acc_eng`` with Wilson
intervals, ``delta`` = acc_eng - acc_ref with a paired-bootstrap interval, exact McNemar ``mcnemar_p``, flip
rates ``flip_c2w`` (reference right, engine wrong) and ``flip_w2c`` with intervals, ``mde`` (smallest |delta|
McNemar detects at alpha 0.05 / power 0.8 with this n, at the conservative discordance 0.5), ``n``,
``discordance``, ``pred_agree`` (same predicted choice / same filtered answer), the task's other 0/1 metrics as
``<metric>_ref`` / ``<metric>_eng`` (``acc_norm``) and, for log-likelihood tasks, ``ll_absdiff_mean`` (mean
|log-likelihood difference| per scored choice, a continuous and much more sensitive signal than accuracy).
"Correct" is the first of ``acc``, ``exact_match``, ``acc_norm``, ``em`` the task reports, under its first
filter (GSM8K: ``strict-match``). Samples: ``<name>.correct_ref`` / ``<name>.correct_eng`` (0/1 per document, in
doc order; a group's in the order of its tasks) for paired gate tests, ``<task>.ll_absdiff`` when available.

On a layer-streamed model (`evalharness.streamed`; docs/guide/big-models.md) the log-likelihood tasks run as
resident ones do, bit for bit (each model's requests of a task in layer-major passes). A name whose tasks
generate (``generate_until``: GSM8K) is not run there: the other names are, their metrics and samples are kept,
and the eval ends with `evalharness.errors.PartlyRunError` naming each name not run, the memory generation needs
and the multi-GPU route; the runner keeps the metrics and makes the run an error result (bad input), so a gate
FAILs it with that message instead of passing a run that silently lacks a task (drop the name for that model, or
run it resident or on more GPUs).

Timing (the result's ``timing``): ``tasks.<name>.eng_s`` (the engine's pass over the configured name) and
``tasks.<name>.ref_s`` (the reference's, in the run that computed it; later recipes reuse it), wall seconds
including lm-eval's own request building and scoring.

Settings: ``tasks`` (names; default :data:`DEFAULT_TASKS`), ``limit`` (documents per task: an int, or ``{name:
n}``; a group's applies to each of its tasks; default all), ``num_fewshot`` (an int or ``{name: n}``; default each
task's own), ``batch_size`` (sequences per forward; default the serving config's), ``max_gen_toks`` (generation
budget of generative tasks; default the task's), ``include_paths`` (extra task folders), ``data_dir`` (default
the run's ``--data-dir``, else ``$EVALHARNESS_DATA_DIR``).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from evalharness import stats
from evalharness.errors import DataError, PartlyRunError
from evalharness.evals import EvalContext
from evalharness.evals.lm_templates import compiled_templates

DEFAULT_TASKS = ("hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande", "lambada_standard", "gsm8k", "mmlu")
# Which per-sample metric is "correct", in order of preference.
CORRECTNESS_METRICS = ("acc", "exact_match", "acc_norm", "em")
_TASKS: dict[tuple, Any] = {}


def _offline() -> None:
    """Forbid downloads by lm-eval / datasets / huggingface_hub for this process."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets

    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        if hasattr(datasets.config, name):
            setattr(datasets.config, name, True)


@contextlib.contextmanager
def _quiet_lm_eval(level: int = logging.ERROR):
    """Silence lm-eval's per-task chatter (warnings about custom datasets, few-shot overrides)."""
    logger = logging.getLogger("lm_eval")
    old = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(old)


def resolve_data_dir(cfg: dict[str, Any], ctx: EvalContext) -> str | None:
    """The data dir for local tasks: the eval setting, else the run's (--data-dir), else $EVALHARNESS_DATA_DIR."""
    value = cfg.get("data_dir") or getattr(ctx, "data_dir", None) or os.environ.get("EVALHARNESS_DATA_DIR")
    return str(Path(value).expanduser().resolve()) if value else None


def task_manager(names: list[str], include_paths: list[str], data_dir: str | None):
    """lm-eval's TaskManager for `names`, datasets from the data dir (:func:`evalharness.taskdata.task_manager`)."""
    from evalharness.taskdata import task_manager as build

    return build(names, include_paths, data_dir)


def _per_task(cfg: dict[str, Any], name: str, task: str, minimum: int) -> int | None:
    """Setting `name` for `task`: one int for all tasks or a {task: int} mapping (missing/None = task default)."""
    value = cfg.get(name)
    if isinstance(value, dict):
        value = value.get(task)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < minimum):
        raise DataError(f"tasks eval: {name} for '{task}' must be an integer >= {minimum}, got {value!r}")
    return value


def _pick(sample: dict[str, Any]) -> str:
    """The per-sample correctness metric of a logged lm-eval sample."""
    for name in CORRECTNESS_METRICS:
        if name in sample and isinstance(sample[name], (int, float, bool)):
            return name
    names = [k for k in sample.get("metrics", [])]
    raise DataError(f"tasks eval: no 0/1 correctness metric among the task's metrics {names}; "
                    f"the harness needs one of {list(CORRECTNESS_METRICS)}")


def _prediction(sample: dict[str, Any]) -> Any:
    """What the model answered: the argmax choice (multiple choice), whether the target is the greedy
    continuation (a single log-likelihood request), else the filtered response text."""
    resps = sample.get("filtered_resps") or []
    if resps and all(isinstance(r, (list, tuple)) and len(r) == 2 and isinstance(r[0], (int, float)) for r in resps):
        if len(resps) == 1:
            return bool(resps[0][1])
        lls = [float(r[0]) for r in resps]
        return max(range(len(lls)), key=lambda i: lls[i])
    return json.dumps(resps, default=str)


def _lls(sample: dict[str, Any]) -> list[float] | None:
    """Per-request log-likelihoods of a log-likelihood sample, else None."""
    out = []
    for r in sample.get("filtered_resps") or []:
        if isinstance(r, (list, tuple)) and len(r) == 2 and isinstance(r[0], (int, float)):
            out.append(float(r[0]))
        else:
            return None
    return out or None


@contextlib.contextmanager
def _no_datasets_progress():
    """`datasets`' progress bars off for the block (restored after)."""
    import datasets

    was_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_on:
            datasets.enable_progress_bars()


def _load_error(task: str, exc: BaseException) -> DataError:
    """A load failure as an error that names the task and what the data dir serves."""
    from evalharness.taskdata import registry

    return DataError(f"tasks eval: cannot load '{task}' offline: {type(exc).__name__}: {exc}. The data dir stands in "
                     f"for {', '.join(registry().served())}; any other dataset must be in local files or the local "
                     "HF cache (a group or tag fails when one of its tasks does: e.g. lm-eval's 'lambada' tag holds "
                     "lambada_openai, whose data is not in the shared folder; use 'lambada_standard')")


def _load_task(tm, task: str) -> tuple[dict[str, Any], dict[str, tuple]]:
    """lm-eval's task dict for `task` (a task, group or tag), built once per task manager and process, and each
    leaf task's own few-shot count and generation settings.

    Building a task materializes its whole few-shot pool (10k HellaSwag documents: seconds); ``evaluate`` rebuilds
    the requests on every call and the harness resets few-shot count, seed and generation budget each time, so the
    task objects are safely reused by every model run.
    """
    key = (id(tm), task)
    if key not in _TASKS:
        try:
            with _no_datasets_progress():  # `datasets` draws a bar per map of a task's documents
                loaded = tm.load([task])
        except DataError:
            raise
        except Exception as exc:  # lm-eval and datasets raise many kinds (hub, file, schema, config errors)
            raise _load_error(task, exc) from None
        if not loaded["tasks"]:
            raise DataError(f"tasks eval: '{task}' holds no tasks")
        defaults = {name: (t.get_config("num_fewshot"), copy.deepcopy(t.get_config("generation_kwargs")))
                    for name, t in loaded["tasks"].items()}
        for t in loaded["tasks"].values():
            _process_docs_once(t)
        _TASKS[key] = (loaded, defaults)
    return _TASKS[key]


def _process_docs_once(tobj) -> None:
    """A task's `process_docs` (e.g. HellaSwag's text clean-up of its 10,042 documents, ~0.5 s) applied once per
    split for the life of the shared task object: lm-eval applies it on every access of the evaluation documents,
    three times per model pass. The function is a pure map of the split (lm-eval's contract for process_docs), so
    the documents are the same."""
    config = getattr(tobj, "config", None)
    fn = getattr(config, "process_docs", None)
    if fn is None or getattr(fn, "_evalharness_once", False):
        return
    done: dict[int, tuple[Any, Any]] = {}  # id(split dataset) -> (the split, its processed documents)

    def once(dataset):
        hit = done.get(id(dataset))
        if hit is None or hit[0] is not dataset:
            hit = done[id(dataset)] = (dataset, fn(dataset))
        return hit[1]

    once._evalharness_once = True
    config.process_docs = once


def _first_filter(tobj) -> str:
    """The name of the task's first filter (lm-eval's 'none' when it has none)."""
    filters = tobj.get_config("filter_list")
    return filters[0]["name"] if filters else "none"


def _configure(name: str, tobj, defaults: tuple, fewshot: int | None, seed: int, max_gen_toks: int | None) -> None:
    """Reset what earlier runs may have changed on a shared task object, then apply this run's settings."""
    default_shots, default_gen = defaults
    shots = fewshot if fewshot is not None else (default_shots or 0)
    if shots > 0:
        pool = tobj.fewshot_docs()
        if pool is not None and len(pool) == 0:
            raise DataError(f"tasks eval: '{name}' has no few-shot examples in the data dir (its few-shot split is "
                            "not in the shared data folder); run it with num_fewshot: 0")
    tobj.set_config(key="num_fewshot", value=shots)
    tobj.set_fewshot_seed(seed=seed)
    if tobj.get_config("output_type") == "generate_until":
        gen = copy.deepcopy(default_gen) or {}
        if max_gen_toks is not None:
            gen["max_gen_toks"] = max_gen_toks
        tobj.set_config(key="generation_kwargs", value=gen)


def _leaf_result(name: str, tobj, logged: list[dict[str, Any]]) -> dict[str, Any]:
    """One leaf task's per-document results (first filter, doc order)."""
    if not logged:
        raise DataError(f"tasks eval: task '{name}' produced no samples")
    filt = _first_filter(tobj)
    logged = sorted((s for s in logged if s["filter"] == filt), key=lambda s: s["doc_id"])
    if not logged:
        raise DataError(f"tasks eval: task '{name}' logged no samples under its first filter '{filt}'")
    metric = _pick(logged[0])
    others = [m for m in CORRECTNESS_METRICS if m != metric and isinstance(logged[0].get(m), (int, float, bool))]
    meta = tobj.get_config("metadata") or {}
    return {
        "task": name, "metric": metric, "filter": filt,
        "version": meta.get("version"), "num_fewshot": tobj.get_config("num_fewshot"),
        "doc_ids": [int(s["doc_id"]) for s in logged],
        "prompt_hashes": [s["prompt_hash"] for s in logged],
        "correct": [float(s[metric]) for s in logged],
        "extra": {m: [float(s[m]) for s in logged] for m in others},
        "pred": [_prediction(s) for s in logged],
        "lls": [_lls(s) for s in logged],
    }


def evaluate_task(lm, tm, task: str, limit: int | None, fewshot: int | None, seed: int,
                  max_gen_toks: int | None, bars: bool = False) -> dict[str, Any]:
    """Run one configured name (a task, group or tag) through lm-eval for one model; `bars`: lm-eval's own
    progress bars (request building) on stderr, else they are swallowed (off a terminal: no bar lines in logs).

    Returns ``{"name", "leaves": {task: per-document results}, "groups": {group: [its leaf tasks, in order]},
    "group_versions"}``.
    """
    from lm_eval.evaluator import evaluate

    with _quiet_lm_eval(), compiled_templates():
        loaded, defaults = _load_task(tm, task)
        for name, tobj in loaded["tasks"].items():
            _configure(name, tobj, defaults[name], fewshot, seed, max_gen_toks)
        with contextlib.nullcontext() if bars else contextlib.redirect_stderr(io.StringIO()):
            res = evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=0, log_samples=True)
    leaves = {name: _leaf_result(name, tobj, res["samples"].get(name) or [])
              for name, tobj in loaded["tasks"].items()}
    groups = {gname: [t.task_name for t in g.get_all_tasks()] for gname, g in (loaded.get("groups") or {}).items()}
    versions = {gname: g.version for gname, g in (loaded.get("groups") or {}).items()}
    return {"name": task, "leaves": leaves, "groups": groups, "group_versions": versions}


def _pooled(name: str, leaves: list[dict[str, Any]], version: Any) -> dict[str, Any] | None:
    """A group's documents as one task: its leaves' per-document results concatenated, in the leaves' order; None
    when its tasks score different things (e.g. acc and exact_match), which do not pool."""
    metrics = {leaf["metric"] for leaf in leaves}
    if len(metrics) != 1:
        return None
    extra_names = set.intersection(*(set(leaf["extra"]) for leaf in leaves))
    return {
        "task": name, "metric": metrics.pop(), "version": version,
        "doc_ids": [d for leaf in leaves for d in leaf["doc_ids"]],
        "prompt_hashes": [h for leaf in leaves for h in leaf["prompt_hashes"]],
        "correct": [c for leaf in leaves for c in leaf["correct"]],
        "extra": {m: [v for leaf in leaves for v in leaf["extra"][m]] for m in sorted(extra_names)},
        "pred": [p for leaf in leaves for p in leaf["pred"]],
        "lls": [x for leaf in leaves for x in leaf["lls"]],
    }


def units(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every leaf task and every group of an :func:`evaluate_task` result, as per-document results (a group whose
    tasks score different things has its tasks' statistics only)."""
    out = list(result["leaves"].values())
    for gname, members in result["groups"].items():
        pooled = _pooled(gname, [result["leaves"][m] for m in members], result["group_versions"].get(gname))
        if pooled is not None:
            out.append(pooled)
    return out


def _check_paired(ref: dict[str, Any], eng: dict[str, Any]) -> None:
    """Both models must have answered the same documents with the same prompts."""
    if ref["doc_ids"] != eng["doc_ids"] or ref["prompt_hashes"] != eng["prompt_hashes"]:
        raise RuntimeError(f"tasks eval: '{ref['task']}': the reference and the engine saw different documents or "
                           "prompts (check that limit / num_fewshot / seed are equal); paired statistics need the same")


def paired_task_metrics(ref: dict[str, Any], eng: dict[str, Any], alpha: float = 0.05,
                        n_boot: int = 2000, seed: int = 0) -> tuple[dict[str, float], dict[str, list]]:
    """Accuracy of both models with intervals, paired delta, McNemar, flips and MDE; per-sample arrays."""
    x, y = ref["correct"], eng["correct"]
    n = len(x)
    k_ref, k_eng = int(sum(x)), int(sum(y))
    ar, ae = stats.binomial_ci(k_ref, n, alpha=alpha), stats.binomial_ci(k_eng, n, alpha=alpha)
    boot = stats.paired_bootstrap_delta(x, y, n_boot=n_boot, alpha=alpha, seed=seed)
    mc = stats.mcnemar_exact(x, y)
    flips = stats.flip_rates(x, y, alpha=alpha)
    c2w, w2c = flips["correct_to_wrong"], flips["wrong_to_correct"]
    m = {
        "n": float(n),
        "acc_ref": ar["p"], "acc_ref_lo": ar["lo"], "acc_ref_hi": ar["hi"],
        "acc_eng": ae["p"], "acc_eng_lo": ae["lo"], "acc_eng_hi": ae["hi"],
        "delta": boot["delta"], "delta_lo": boot["lo"], "delta_hi": boot["hi"],
        "mcnemar_p": mc["p_value"],
        "flip_c2w": c2w["rate"], "flip_c2w_lo": c2w["lo"], "flip_c2w_hi": c2w["hi"],
        "flip_w2c": w2c["rate"], "flip_w2c_lo": w2c["lo"], "flip_w2c_hi": w2c["hi"],
        "discordance": stats.discordance_rate(x, y),
        "mde": stats.mde_paired_proportions(n, alpha=alpha, power=0.8),
        "pred_agree": sum(a == b for a, b in zip(ref["pred"], eng["pred"])) / n,
    }
    for name in sorted(set(ref.get("extra") or {}) & set(eng.get("extra") or {})):
        m[f"{name}_ref"] = sum(ref["extra"][name]) / n
        m[f"{name}_eng"] = sum(eng["extra"][name]) / n
    if ref.get("version") is not None:
        try:
            m["version"] = float(ref["version"])
        except (TypeError, ValueError):
            pass
    s: dict[str, list] = {"correct_ref": [int(v) for v in x], "correct_eng": [int(v) for v in y]}
    if all(a is not None and b is not None and len(a) == len(b) for a, b in zip(ref["lls"], eng["lls"])):
        diffs = [sum(abs(p - q) for p, q in zip(a, b)) / len(a) for a, b in zip(ref["lls"], eng["lls"])]
        m["ll_absdiff_mean"] = sum(diffs) / n
        m["ll_absdiff_max"] = max(diffs)
        s["ll_absdiff"] = diffs
    return m, s


def run_tasks(ctx: EvalContext, cfg: dict[str, Any]) -> tuple[dict[str, float], dict[str, list]]:
    """The `tasks` eval: every configured name for the engine and the (cached) reference; paired statistics per
    leaf task and per group."""
    try:
        from evalharness.lm_adapter import HarnessLM
    except ImportError as exc:
        raise DataError(f"tasks eval: lm-eval is not installed ({exc}); pip install 'evalharness[eval]'") from None

    if ctx.tokenizer is None:
        raise DataError("tasks eval: the model has no tokenizer (text tasks need one); set 'tokenizer' in the "
                        "suite's model entry or drop the tasks eval for this model")
    _offline()
    names = list(cfg.get("tasks") or DEFAULT_TASKS)
    include = [str(p) for p in (cfg.get("include_paths") or [])]
    data_dir = resolve_data_dir(cfg, ctx)
    tm = task_manager(names, include, data_dir)
    batch_size = cfg.get("batch_size") or ctx.batch_size
    max_gen = cfg.get("max_gen_toks")
    engine_lm = HarnessLM(ctx.engine, ctx.tokenizer, batch_size=batch_size, name="engine",
                          progress=ctx.progress)
    metrics: dict[str, float] = {}
    samples: dict[str, list] = {}
    not_run: list[str] = []
    ref_lms: list = []  # the reference's adapters of the tasks it ran in this call (not cached before)
    for task in ctx.progress.bar(names, total=len(names), desc="tasks", unit="task"):
        fewshot = _per_task(cfg, "num_fewshot", task, 0)
        limit = _per_task(cfg, "limit", task, 1)
        refusal = _streamed_refusal(ctx, tm, task)
        if refusal is not None:  # generation on a layer-streamed model: this task is not run, the others are
            not_run.append(refusal)
            continue
        # Everything that changes the reference's answers; the data files are hashed in by path + size + mtime.
        key = ("tasks_ref", task, limit, fewshot, ctx.seed, max_gen, data_dir, tuple(include), _dir_stamp(data_dir),
               engine_lm.max_length)

        def compute(task=task, fewshot=fewshot, limit=limit):
            """The reference's per-document results for this task (once per model)."""
            t0 = time.perf_counter()
            ref_lm = HarnessLM(ctx.reference, ctx.tokenizer, batch_size=batch_size, name="reference",
                               progress=ctx.progress)
            ref_lms.append(ref_lm)
            out = evaluate_task(ref_lm, tm, task, limit, fewshot, ctx.seed, max_gen, bars=ctx.progress.tty)
            ctx.timing[f"tasks.{task}.ref_s"] = time.perf_counter() - t0
            return out

        ref = ctx.reference_cached(key, compute)
        t0 = time.perf_counter()
        eng = evaluate_task(engine_lm, tm, task, limit, fewshot, ctx.seed, max_gen, bars=ctx.progress.tty)
        ctx.timing[f"tasks.{task}.eng_s"] = time.perf_counter() - t0
        ref_units, eng_units = units(ref), units(eng)
        for r, e in zip(ref_units, eng_units):
            _check_paired(r, e)
            m, s = paired_task_metrics(r, e, seed=ctx.seed)
            if r["task"] in ref["groups"]:
                s.pop("ll_absdiff", None)  # per document, already under each of the group's tasks
            else:
                digest = hashlib.sha256(json.dumps(r["prompt_hashes"]).encode()).hexdigest()
                ctx.data_hashes[f"tasks:{r['task']}|n{len(r['doc_ids'])}|fewshot{r['num_fewshot']}"] = digest
            metrics.update({f"{r['task']}.{k}": v for k, v in m.items()})
            samples.update({f"{r['task']}.{k}": v for k, v in s.items()})
    for k, v in engine_lm.counters.items():
        ctx.counters[f"tasks_engine_{k}"] = ctx.counters.get(f"tasks_engine_{k}", 0) + v
    for lm in [engine_lm, *ref_lms]:  # layer-streamed passes: the checkpoint bytes read count as the run's
        for k, v in lm.stream_counters.items():
            ctx.counters[k] = ctx.counters.get(k, 0) + v
    if not_run:
        raise PartlyRunError("; ".join(not_run), metrics, samples)
    return metrics, samples


def _streamed_refusal(ctx: EvalContext, tm, task: str) -> str | None:
    """Why `task` cannot run here (its tasks generate and a model runs layer-streamed: every decode step reads
    every layer), else None."""
    from evalharness.streamed import is_streamed

    side = next((m for m in (ctx.engine, ctx.reference) if is_streamed(m)), None)
    if side is None:
        return None
    with _quiet_lm_eval():
        loaded, _ = _load_task(tm, task)
    generating = [name for name, tobj in loaded["tasks"].items()
                  if tobj.get_config("output_type") == "generate_until"]
    if not generating:
        return None
    return str(side.generation_error(f"tasks eval: '{task}' was not run (generate_until: {', '.join(generating)})"))


def _dir_stamp(data_dir: str | None) -> str:
    """A cheap fingerprint of the task data folder (sizes and mtimes of its files)."""
    if not data_dir or not (Path(data_dir) / "tasks").is_dir():
        return ""
    h = hashlib.sha256()
    for p in sorted((Path(data_dir) / "tasks").rglob("*")):
        if p.is_file():
            st = p.stat()
            h.update(f"{p}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]
