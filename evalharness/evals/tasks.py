"""Downstream tasks through lm-eval's evaluator, engine vs FP32 reference on the same samples.

Both models are wrapped in :class:`evalharness.lm_adapter.HarnessLM` and run
through ``lm_eval.evaluator.evaluate`` with ``log_samples=True``, one task at a
time, on the same documents (same limit, few-shot seed and prompts; prompt
hashes are checked). The reference's per-sample results are computed once per
model and task configuration and reused by every recipe
(``EvalContext.reference_cached``).

Task configs: ``suites/tasks/`` (hellaswag, arc_easy, arc_challenge, piqa,
winogrande, lambada, gsm8k) read the shared data folder offline through
``custom_dataset`` loaders; the data dir reaches them as task metadata. Any
other lm-eval task works by name (lm-eval's own task index is only scanned
when a name is not found in the local folders, since scanning it takes
seconds), and ``include_paths`` adds user task folders. Downloads are
disabled (``HF_DATASETS_OFFLINE=1``, ``HF_HUB_OFFLINE=1``): a built-in task
whose data is not in the local HF cache fails with the loader's error.

Per task (metrics ``tasks.<task>.<stat>``): ``acc_ref`` / ``acc_eng`` with
Wilson intervals, ``delta`` = acc_eng - acc_ref with a paired-bootstrap
interval, exact McNemar ``mcnemar_p``, flip rates ``flip_c2w`` (reference
right, engine wrong) and ``flip_w2c`` with intervals, ``mde`` (smallest
|delta| McNemar detects at alpha 0.05 / power 0.8 with this n, at the
conservative discordance 0.5), ``n``, ``discordance``, ``pred_agree`` (same
predicted choice / same generated answer) and, for log-likelihood tasks,
``ll_absdiff_mean`` (mean |log-likelihood difference| per scored choice, a
continuous and much more sensitive signal than accuracy). Samples:
``<task>.correct_ref`` / ``<task>.correct_eng`` (0/1 per document, in doc
order) for paired gate tests, ``<task>.ll_absdiff`` when available.

Timing (the result's ``timing``): ``tasks.<task>.eng_s`` (the engine's pass over the task) and
``tasks.<task>.ref_s`` (the reference's, in the run that computed it; later recipes reuse it), wall
seconds including lm-eval's own request building and scoring.

Settings: ``tasks`` (names; default the seven above), ``limit`` (documents
per task: an int, or ``{task: n}``; default all), ``num_fewshot`` (an int or
``{task: n}``; default each task's own), ``batch_size`` (sequences per
forward; default the serving config's), ``max_gen_toks`` (generation budget
of generative tasks; default the task's), ``include_paths`` (extra task
folders), ``data_dir`` (default the run's ``--data-dir``, else
``$EVALHARNESS_DATA_DIR``).
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
from evalharness.errors import DataError
from evalharness.evals import EvalContext

BUILTIN_TASK_DIR = Path(__file__).resolve().parents[2] / "suites" / "tasks"
DEFAULT_TASKS = ("hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande", "lambada", "gsm8k")
# Which per-sample metric is "correct", in order of preference.
CORRECTNESS_METRICS = ("acc", "exact_match", "acc_norm", "em")
_TASK_MANAGERS: dict[tuple, Any] = {}
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
    """A (cached) lm-eval TaskManager that knows every name in `names`.

    The local folders come first; lm-eval's built-in index (slow to scan) is
    added only when a name is missing. Local tasks override built-ins of the
    same name.
    """
    from lm_eval.tasks import TaskManager

    paths = [str(BUILTIN_TASK_DIR)] if BUILTIN_TASK_DIR.is_dir() else []
    for p in include_paths:
        if not Path(p).expanduser().is_dir():
            raise DataError(f"tasks eval: include_paths entry '{p}' is not a folder")
        paths.append(str(Path(p).expanduser().resolve()))
    meta = {"data_dir": data_dir} if data_dir else {}
    for defaults in (False, True):
        key = (tuple(paths), defaults, data_dir)
        if key not in _TASK_MANAGERS:
            with _quiet_lm_eval():
                _TASK_MANAGERS[key] = TaskManager(include_path=paths or None, include_defaults=defaults,
                                                  metadata=meta)
        tm = _TASK_MANAGERS[key]
        missing = [n for n in names if n not in tm.all_tasks]
        if not missing:
            return tm
    raise DataError(f"tasks eval: unknown task(s) {missing}; local tasks: "
                    f"{sorted(n for n in _TASK_MANAGERS[(tuple(paths), False, data_dir)].all_tasks)}")


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


def _load_task(tm, task: str) -> dict[str, Any]:
    """lm-eval's task dict for `task`, built once per task manager and process.

    Building a task materializes its whole few-shot pool (10k HellaSwag
    documents: seconds); ``evaluate`` rebuilds the requests on every call and
    the harness resets few-shot count, seed and generation budget each time, so
    the task objects are safely reused by every model run.
    """
    key = (id(tm), task)
    if key not in _TASKS:
        try:
            loaded = tm.load([task])
        except (FileNotFoundError, ValueError, KeyError, ConnectionError, OSError) as exc:
            raise DataError(f"tasks eval: cannot load task '{task}' offline: {exc}") from None
        leaves = loaded["tasks"]
        if len(leaves) != 1:
            raise DataError(f"tasks eval: '{task}' is a group or tag of {len(leaves)} tasks "
                            f"({sorted(leaves)[:8]}...); list its tasks individually")
        (tobj,) = leaves.values()
        defaults = (tobj.get_config("num_fewshot"), copy.deepcopy(tobj.get_config("generation_kwargs")))
        _TASKS[key] = (loaded, defaults)
    return _TASKS[key]


def evaluate_task(lm, tm, task: str, limit: int | None, fewshot: int | None, seed: int,
                  max_gen_toks: int | None) -> dict[str, Any]:
    """Run one task through lm-eval for one model; per-document results in doc order."""
    from lm_eval.evaluator import evaluate

    with _quiet_lm_eval():
        loaded, (default_shots, default_gen) = _load_task(tm, task)
        (name, tobj), = loaded["tasks"].items()
        # Reset what earlier runs may have changed on the shared task object, then apply this run's settings.
        tobj.set_config(key="num_fewshot", value=fewshot if fewshot is not None else (default_shots or 0))
        tobj.set_fewshot_seed(seed=seed)
        if tobj.get_config("output_type") == "generate_until":
            gen = copy.deepcopy(default_gen) or {}
            if max_gen_toks is not None:
                gen["max_gen_toks"] = max_gen_toks
            tobj.set_config(key="generation_kwargs", value=gen)
        with contextlib.redirect_stderr(io.StringIO()):  # lm-eval's per-task progress bars
            res = evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=0, log_samples=True)
    logged = res["samples"][name]
    if not logged:
        raise DataError(f"tasks eval: task '{task}' produced no samples")
    filt = logged[0]["filter"]
    logged = sorted((s for s in logged if s["filter"] == filt), key=lambda s: s["doc_id"])
    metric = _pick(logged[0])
    meta = tobj.get_config("metadata") or {}
    return {
        "task": name, "metric": metric, "filter": filt,
        "version": meta.get("version"), "num_fewshot": tobj.get_config("num_fewshot"),
        "doc_ids": [int(s["doc_id"]) for s in logged],
        "prompt_hashes": [s["prompt_hash"] for s in logged],
        "correct": [float(s[metric]) for s in logged],
        "pred": [_prediction(s) for s in logged],
        "lls": [_lls(s) for s in logged],
    }


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
    """The `tasks` eval: every configured task for the engine and the (cached) reference, paired statistics."""
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
    engine_lm = HarnessLM(ctx.engine, ctx.tokenizer, batch_size=batch_size, name="engine")
    metrics: dict[str, float] = {}
    samples: dict[str, list] = {}
    for task in names:
        fewshot = _per_task(cfg, "num_fewshot", task, 0)
        limit = _per_task(cfg, "limit", task, 1)
        # Everything that changes the reference's answers; the data files are hashed in by path + size + mtime.
        key = ("tasks_ref", task, limit, fewshot, ctx.seed, max_gen, data_dir, tuple(include), _dir_stamp(data_dir),
               engine_lm.max_length)

        def compute(task=task, fewshot=fewshot, limit=limit):
            """The reference's per-document results for this task (once per model)."""
            t0 = time.perf_counter()
            ref_lm = HarnessLM(ctx.reference, ctx.tokenizer, batch_size=batch_size, name="reference")
            out = evaluate_task(ref_lm, tm, task, limit, fewshot, ctx.seed, max_gen)
            ctx.timing[f"tasks.{task}.ref_s"] = time.perf_counter() - t0
            return out

        ref = ctx.reference_cached(key, compute)
        t0 = time.perf_counter()
        eng = evaluate_task(engine_lm, tm, task, limit, fewshot, ctx.seed, max_gen)
        ctx.timing[f"tasks.{task}.eng_s"] = time.perf_counter() - t0
        _check_paired(ref, eng)
        m, s = paired_task_metrics(ref, eng, seed=ctx.seed)
        metrics.update({f"{ref['task']}.{k}": v for k, v in m.items()})
        samples.update({f"{ref['task']}.{k}": v for k, v in s.items()})
        digest = hashlib.sha256(json.dumps(ref["prompt_hashes"]).encode()).hexdigest()
        ctx.data_hashes[f"tasks:{ref['task']}|n{len(ref['doc_ids'])}|fewshot{ref['num_fewshot']}"] = digest
    for k, v in engine_lm.counters.items():
        ctx.counters[f"tasks_engine_{k}"] = ctx.counters.get(f"tasks_engine_{k}", 0) + v
    return metrics, samples


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
