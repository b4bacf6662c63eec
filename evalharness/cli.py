"""The `evalharness` command line.

    evalharness run SUITE.yaml [--out DIR] [--data-dir DIR] [--device auto|cpu|cuda] [--resume] [--set KEY=VALUE]...
                               [--tracking-uri URI] [--experiment NAME] [--no-tracking]
                               (data parallel: `torchrun --nproc-per-node N -m evalharness.cli run ...`)
    evalharness gate RESULTS_DIR [--baselines DIR] [--junit FILE] [--summary FILE] [--allow-missing]
    evalharness baseline update RESULTS_DIR [--baselines DIR] [--dry-run]
    evalharness log RESULTS_DIR [--tracking-uri URI] [--experiment NAME] [--force]
    evalharness recipes [NAME_OR_PATH]
    evalharness selftest [--mutations] [--suite SUITE.yaml] [--out DIR] [--only ID,...] [--models NAME,...] [--set KEY=VALUE]...
    evalharness report RESULTS_DIR [--out DIR] [--history DIR...]
    evalharness trend RESULTS_DIR... [--out DIR] [--metric GLOB]...

Exit codes: 0 success / gate pass, 1 regression (gate FAIL) or a run that
crashed, 2 bad input (malformed suite, missing checkpoint or data, corrupt
or other-schema baseline, a missing baseline or one of another run, a
results folder another process writes to, a disk that cannot take the
results), 130 interrupted (Ctrl-C), 143 terminated (SIGTERM): both keep
every finished result and close the mlflow runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from evalharness.errors import BAD_INPUT

DEFAULT_BASELINES = Path(__file__).resolve().parent.parent / "baselines"


def _parser() -> argparse.ArgumentParser:
    """Build the argument parser."""
    p = argparse.ArgumentParser(prog="evalharness", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run a suite (engine vs FP32 reference) and write one result JSON per run")
    r.add_argument("suite", help="suite YAML file (e.g. suites/smoke.yaml)")
    r.add_argument("--out", default="results", help="results directory (default: ./results)")
    r.add_argument("--data-dir", default=None, help="shared data folder (default: $EVALHARNESS_DATA_DIR)")
    r.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"],
                   help="override the suite's backend device (default: the suite's backend)")
    r.add_argument("--backend", default=None, choices=["cpu-emulated", "cuda-emulated", "cuda-native"],
                   help="run every RunSpec on this backend (overrides the suite's backend and --device)")
    r.add_argument("--resume", action="store_true", help="skip runs whose result file is already finished")
    r.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a suite field; model=PATH_OR_HF_ID and recipe=NAME_OR_YAML replace that axis")
    # -- mlflow tracking (evalharness.tracking): a view of the results, never required for them
    r.add_argument("--tracking-uri", default=None,
                   help="mlflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///<out>/mlflow.db)")
    r.add_argument("--experiment", default=None, help="mlflow experiment (default: evalharness-<suite>)")
    r.add_argument("--no-tracking", action="store_true", help="do not log results to mlflow")

    lg = sub.add_parser("log", help="log a results dir to mlflow (idempotent: already logged files are kept)")
    lg.add_argument("results", help="results directory written by `run`")
    lg.add_argument("--tracking-uri", default=None,
                    help="mlflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///<results>/mlflow.db)")
    lg.add_argument("--experiment", default=None, help="mlflow experiment (default: evalharness-<suite>)")
    lg.add_argument("--force", action="store_true", help="replace runs already logged from the same files")
    # -- end mlflow tracking

    g = sub.add_parser("gate", help="compare results against baselines; exit 1 on regression")
    g.add_argument("results", help="results directory written by `run`")
    g.add_argument("--baselines", default=str(DEFAULT_BASELINES), help="baselines directory (default: repo baselines/)")
    g.add_argument("--junit", default=None, help="write JUnit XML here")
    g.add_argument("--summary", default=None, help="write a markdown summary here")
    g.add_argument("--suite", default=None, help="take gate rules from this suite YAML instead of the results' suite.json")
    g.add_argument("--allow-missing", action="store_true", help="runs without a baseline WARN instead of exit 2")
    g.add_argument("--verbose", "-v", action="store_true", help="also list PASS verdicts")

    b = sub.add_parser("baseline", help="manage baselines")
    bsub = b.add_subparsers(dest="baseline_command", required=True)
    bu = bsub.add_parser("update", help="promote results to baselines (prints the diff first)")
    bu.add_argument("results")
    bu.add_argument("--baselines", default=str(DEFAULT_BASELINES))
    bu.add_argument("--dry-run", action="store_true", help="print the diff, write nothing")
    bu.add_argument("--force", action="store_true",
                    help="also promote results with non-finite (NaN/Inf) metrics (refused otherwise)")

    for name, helptext in (("sensitivity", "rank sites / layers / module kinds by their effect on KLD (one at a time)"),
                           ("bisect", "smallest set of units whose fallback to a good recipe fixes a failing one")):
        a = sub.add_parser(name, help=helptext)
        a.add_argument("suite", help="suite YAML (gives the model, corpus and backend)")
        a.add_argument("--model", default=None, help="model name in the suite (default: the first)")
        a.add_argument("--by", default="site", choices=["site", "layer", "module"], help="unit of analysis")
        a.add_argument("--windows", type=int, default=16, help="evaluation windows")
        a.add_argument("--seq-len", type=int, default=128)
        a.add_argument("--out", default="results", help="directory for the analysis JSON (and recipe YAML)")
        a.add_argument("--data-dir", default=None)
        a.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"])
        a.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
        if name == "sensitivity":
            a.add_argument("--low", default="fp8-block", help="low-precision recipe")
            a.add_argument("--high", default="fp32", help="high-precision recipe")
            a.add_argument("--budget", type=int, default=None, help="recommend a recipe with at most N units high")
        else:
            a.add_argument("--candidate", required=True, help="the failing recipe (name or YAML)")
            a.add_argument("--good", required=True, help="the good (baseline) recipe its fallbacks come from")
            a.add_argument("--threshold", type=float, default=None,
                           help="KLD to get under (default: KLD(good) * (1 + --rel-tol))")
            a.add_argument("--rel-tol", type=float, default=0.25)

    rc = sub.add_parser("recipes", help="list named recipes, or show one resolved")
    rc.add_argument("recipe", nargs="?", help="a named recipe or a recipe YAML path")
    _add_issue8_parsers(sub)
    return p


# -- selftest / report / trend (evalharness.selftest, evalharness.results_report, evalharness.trend)
def _add_issue8_parsers(sub) -> None:
    """The `selftest`, `report` and `trend` subcommands."""
    st = sub.add_parser("selftest", help="planted regressions must FAIL the gate, null variants must not")
    st.add_argument("--suite", default=str(DEFAULT_BASELINES.parent / "suites" / "smoke.yaml"),
                    help="suite whose gate rules are tested (default: suites/smoke.yaml)")
    st.add_argument("--out", default="selftest", help="working / report directory (default: ./selftest)")
    st.add_argument("--catalog", default=None, help="catalog YAML (default: suites/selftest/catalog.yaml)")
    st.add_argument("--only", default=None, help="comma-separated catalog ids to run")
    st.add_argument("--models", default=None, help="comma-separated suite model names to use (default: all)")
    st.add_argument("--data-dir", default=None, help="shared data folder (default: $EVALHARNESS_DATA_DIR)")
    st.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="suite overrides for every run (e.g. evals.ppl_kld.max_windows=8)")
    st.add_argument("--strict", action="store_true",
                    help="exit 1 unless every planted regression is caught (also those below the noise floor)")
    st.add_argument("--mutations", action="store_true",
                    help="plant the faults of suites/selftest/mutations.yaml (or --catalog) in the emulation, one "
                         "at a time, and report per fault: caught or missed, by which metric and rule, its effect "
                         "in noise floors and the windows an end-to-end rule needs (docs/guide/mutations.md)")
    rp = sub.add_parser("report", help="markdown report + PNG plots of a results dir")
    rp.add_argument("results", help="results directory written by `run`")
    rp.add_argument("--out", default=None, help="report directory (default: RESULTS/report)")
    rp.add_argument("--history", nargs="*", default=None, help="dated results dirs for the trend section")
    tr = sub.add_parser("trend", help="time series of the gated metrics across dated results dirs")
    tr.add_argument("results", nargs="+", help="results directories (dated, e.g. nightly/2026-11-28)")
    tr.add_argument("--out", default="trend", help="output directory (default: ./trend)")
    tr.add_argument("--metric", action="append", default=None, metavar="GLOB",
                    help="metrics to trend (default: the gated metrics)")


def _cmd_selftest(args) -> int:
    """`selftest`: 0 when every applicable planted regression is caught and no null fails, else 1."""
    from evalharness.selftest import CATALOG, run_selftest, table

    split = lambda v: [x.strip() for x in v.split(",") if x.strip()] if v else None  # noqa: E731
    if args.mutations:
        from evalharness.mutations import MUTATIONS
        from evalharness.selftest_mutations import run_mutations, table as mutation_table

        report = run_mutations(args.out, catalog=args.catalog or MUTATIONS, suite=args.suite, sets=args.sets,
                               data_dir=args.data_dir, only=split(args.only), models=split(args.models))
        print(mutation_table(report))
        print(f"wrote {Path(args.out) / 'mutations.json'} and {Path(args.out) / 'mutations.md'}")
        return 0 if report["passed_strict" if args.strict else "passed"] else 1
    report = run_selftest(args.suite, args.out, sets=args.sets, data_dir=args.data_dir,
                          catalog=args.catalog or CATALOG, only=split(args.only), models=split(args.models))
    print(table(report))
    print(f"wrote {Path(args.out) / 'selftest.json'} and {Path(args.out) / 'selftest.md'}")
    return 0 if report["passed_strict" if args.strict else "passed"] else 1


def _cmd_report(args) -> int:
    """`report`: write report.md and the plots."""
    from evalharness.results_report import build_report

    path = build_report(args.results, args.out or str(Path(args.results) / "report"), history=args.history)
    print(f"wrote {path} (+ plots in {path.parent})")
    return 0


def _cmd_trend(args) -> int:
    """`trend`: write trend.md, trend.json and one PNG per metric."""
    from evalharness.trend import build_trend

    data = build_trend(args.results, args.out, metrics=args.metric)
    print("\n".join(data["summary_lines"]))
    print(f"wrote {Path(args.out) / 'trend.md'} ({len(data['metrics'])} metric(s) over {data['n_dirs']} dir(s))")
    return 0
# -- end selftest / report / trend


def _cmd_run(args) -> int:
    """`run`: expand the suite, run it, print the table; 0 ok, 1 a run crashed, 2 bad input."""
    from evalharness.report import results_table
    from evalharness.results import load_result
    from evalharness.runner import resolve_backend, run_suite
    from evalharness.suite import load_suite

    suite0 = load_suite(args.suite, sets=args.sets, data_dir=args.data_dir)
    backends = sorted({r.backend for r in suite0.runs})
    backend = args.backend or (resolve_backend(backends[0], args.device) if args.device else None)
    suite = suite0 if backend is None else load_suite(args.suite, sets=args.sets, data_dir=args.data_dir,
                                                       backend=backend)
    backend = backend or ", ".join(backends)
    from evalharness.gate import validate_rules  # fail fast on bad gate rules, naming the suite file

    validate_rules(suite.raw.get("gate"), str(suite.path))
    from evalharness import distributed  # under torchrun: RunSpecs spread over the ranks, rank 0 writes

    dp = distributed.init_from_env("cuda" if any(r.backend.startswith("cuda") for r in suite.runs) else "cpu")
    lead = dp is None or dp.rank == 0
    try:
        if lead:
            ranks = f" over {dp.world} processes" if dp is not None else ""
            print(f"suite '{suite.name}': {len(suite.runs)} run(s) on {backend}{ranks} -> {args.out}", file=sys.stderr)
        on_result, tracker = None, None
        if not args.no_tracking and lead:  # mlflow is a view: a failure warns once and the run goes on
            from evalharness.tracking import make_result_logger

            on_result, tracker = make_result_logger(args.out, args.tracking_uri, args.experiment)
        try:
            from evalharness.progress import Progress

            progress = Progress()  # bars on a terminal; else one line per finished eval and run
            outcomes = run_suite(suite, args.out, resume=args.resume, on_result=on_result, log=progress,
                                 progress=progress)
        except BaseException as exc:  # Ctrl-C / SIGTERM: KILLED; anything else (a full disk): FAILED
            if tracker is not None:
                tracker.close("KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
            raise
    finally:
        distributed.shutdown()
    if tracker is not None:
        tracker.close("FINISHED")
        if tracker.summary():
            print(tracker.summary(), file=sys.stderr)
    if lead:
        docs = [load_result(o.path) for o in outcomes]
        print(results_table(docs))
    if any(o.bad_input for o in outcomes):
        return 2
    return 1 if any(o.status == "error" for o in outcomes) else 0


def _cmd_gate(args) -> int:
    """`gate`: verdicts with evidence, JUnit and summary; exit per `gate.exit_code`."""
    from evalharness.gate import exit_code, gate_results
    from evalharness.report import verdict_table, write_junit, write_summary

    gate_cfg = None
    if args.suite:
        import yaml

        try:
            raw = yaml.safe_load(Path(args.suite).read_text()) or {}
        except yaml.YAMLError as exc:
            from evalharness.suite import _yaml_error

            raise _yaml_error(Path(args.suite), exc) from None
        gate_cfg = raw.get("gate", {}) if isinstance(raw, dict) else None
    verdicts, missing = gate_results(args.results, args.baselines, gate_cfg, allow_missing=args.allow_missing,
                                     where=args.suite)
    code = exit_code(verdicts, missing)
    print(verdict_table(verdicts, show_pass=args.verbose))
    for m in missing:
        print(f"BASELINE  {m}")
    if args.junit:
        write_junit(args.junit, verdicts, missing)
    if args.summary:
        write_summary(args.summary, verdicts, missing, code)
    print({0: "gate: PASS", 1: "gate: FAIL (regression)",
           2: "gate: ERROR (missing or mismatched baselines)"}[code])
    return code


def _cmd_baseline(args) -> int:
    """`baseline update`."""
    from evalharness.baselines import update_baselines

    written = update_baselines(args.results, args.baselines, dry_run=args.dry_run, force=args.force)
    print(f"{len(written)} baseline file(s) written" if not args.dry_run else "dry run: nothing written")
    return 0


def _cmd_analysis(args) -> int:
    """`sensitivity` / `bisect`: write the analysis JSON (and the recommended / fixed recipe as YAML)."""
    import yaml

    from engine.recipe import load_recipe
    from evalharness.results import run_key, write_json_atomic
    from evalharness.sensitivity import analysis_doc, bisect, make_units, prepare_scorer, sensitivity

    scorer, info = prepare_scorer(args.suite, args.sets, args.data_dir, args.model, args.windows, args.seq_len,
                                  args.device)
    out = Path(args.out)
    dev = "cuda" if info["backend"].startswith("cuda") else "cpu"
    log = lambda s: print(s, file=sys.stderr)  # noqa: E731
    if args.command == "sensitivity":
        low, high = load_recipe(args.low), load_recipe(args.high)
        units = make_units(args.by, low, high, scorer.model.cfg.num_layers)
        print(f"sensitivity of {info['model']['name']}: {low.name} vs {high.name}, {len(units)} {args.by} units",
              file=sys.stderr)
        body = sensitivity(scorer, low, high, units, budget=args.budget, log=log)
        key = run_key(info["model"]["name"], f"sensitivity-{low.name}-vs-{high.name}-by-{args.by}", "default",
                      info["backend"])
        path = write_json_atomic(out / f"{key}.json", analysis_doc("sensitivity", key, info, body, dev))
        print(f"{'unit':30} {'only-low dKLD':>14} {'only-high gain':>15} {'95% CI':>22}")
        for r in body["ranking"]:
            g = r["only_high_gain"]
            print(f"{r['unit']:30} {r['only_low_cost']['mean']:14.4g} {g['mean']:15.4g} "
                  f"[{g['lo']:9.3g}, {g['hi']:9.3g}]")
        if "recommended" in body:
            rec = body["recommended"]
            rpath = out / f"{key}.recommended.yaml"
            rpath.write_text(yaml.safe_dump(rec["recipe"], sort_keys=False))
            print(f"recommended (budget {rec['budget']}): high precision for {rec['units']} -> KLD "
                  f"{rec['kld']['mean']:.4g} (all-low {body['all_low_kld']['mean']:.4g}); recipe: {rpath}")
    else:
        cand, good = load_recipe(args.candidate), load_recipe(args.good)
        units = make_units(args.by, cand, good, scorer.model.cfg.num_layers)
        threshold = args.threshold
        if threshold is None:
            k_good = sum(scorer.window_kld(good)) / info["windows"]
            threshold = k_good * (1 + args.rel_tol)
        print(f"bisect {cand.name} against {good.name} by {args.by}: threshold KLD {threshold:.4g}", file=sys.stderr)
        body = bisect(scorer, cand, good, units, threshold, log=log)
        key = run_key(info["model"]["name"], f"bisect-{cand.name}-vs-{good.name}-by-{args.by}", "default",
                      info["backend"])
        path = write_json_atomic(out / f"{key}.json", analysis_doc("bisect", key, info, body, dev))
        for step in body["steps"]:
            print(f"  fallback {step['units'] or '(none)'} -> KLD {step['kld']['mean']:.4g}")
        if body.get("found"):
            c = body["cost"]
            print(f"fix: {body['units']} brings KLD {body['candidate_kld']['mean']:.4g} -> "
                  f"{body['fixed_kld']['mean']:.4g} (<= {threshold:.4g}); modeled cost: "
                  f"{c['delta_weight_bytes']:+.0f} weight bytes, {c['delta_kv_bytes_per_token']:+.0f} KV bytes/token")
        elif body.get("already_passing"):
            print("the candidate already passes the threshold: nothing to bisect")
        else:
            print(f"no fix found: even {body['units']} leaves KLD above the threshold")
    print(f"wrote {path}")
    return 0


def _cmd_log(args) -> int:
    """`log`: (re-)log every result of a results dir to mlflow; 0 ok, 1 tracking failed, 2 bad input."""
    from evalharness.tracking import Tracker, TrackingError

    from evalharness.errors import ResultError
    from evalharness.lock import results_lock

    if not Path(args.results).is_dir():
        raise ResultError(f"results directory not found: {args.results} (run `evalharness run SUITE --out "
                          f"{args.results}` first)")
    tracker = Tracker(args.results, args.tracking_uri, args.experiment)
    try:
        with results_lock(args.results):  # not while a run writes into the same folder (and its mlflow store)
            logged = tracker.log_dir(force=args.force)
    except TrackingError as exc:
        print(f"error: mlflow logging failed: {exc}", file=sys.stderr)
        return 1
    for item in logged:
        print(f"{item.action:9}  {item.run_key}  run {item.run_id}  (parent {item.parent_id})")
    print(f"{len(logged)} result(s) in experiment '{tracker.experiment_name}' at {tracker.uri}")
    print(tracker.ui_hint())
    return 0


def _cmd_recipes(args) -> int:
    """`recipes`: list, or print one resolved recipe as JSON."""
    from engine.recipe import load_recipe, named_recipes

    if args.recipe:
        print(json.dumps(load_recipe(args.recipe).to_dict(), indent=2))
    else:
        for name in named_recipes():
            print(f"{name:16} {load_recipe(name).description.strip()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; bad input prints `error: ...` and returns 2."""
    args = _parser().parse_args(argv)
    handlers = {"run": _cmd_run, "gate": _cmd_gate, "baseline": _cmd_baseline, "recipes": _cmd_recipes,
                "sensitivity": _cmd_analysis, "bisect": _cmd_analysis}
    handlers["log"] = _cmd_log
    handlers.update({"selftest": _cmd_selftest, "report": _cmd_report, "trend": _cmd_trend})
    restore = _handle_sigterm()
    try:
        return handlers[args.command](args)
    except BAD_INPUT as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Terminated:
        print("terminated (SIGTERM): finished runs are saved and the mlflow runs closed; re-run with --resume to "
              "continue", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("interrupted: finished runs are saved; re-run with --resume to continue", file=sys.stderr)
        return 130
    finally:
        restore()


class Terminated(KeyboardInterrupt):
    """SIGTERM (a CI timeout, `kill`, a scheduler), raised where the program is, so that it ends as Ctrl-C does:
    finished results kept, the temporary file of a result being written removed, mlflow runs closed."""


def _handle_sigterm():
    """Make SIGTERM raise `Terminated` until the returned function restores the previous handler. Off the main
    thread (where Python cannot install signal handlers) nothing changes."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def terminate(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    return lambda: signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
