"""The `evalharness` command line.

    evalharness run SUITE.yaml [--out DIR] [--data-dir DIR] [--device auto|cpu|cuda] [--resume] [--set KEY=VALUE]...
    evalharness gate RESULTS_DIR [--baselines DIR] [--junit FILE] [--summary FILE] [--allow-missing]
    evalharness baseline update RESULTS_DIR [--baselines DIR] [--dry-run]
    evalharness recipes [NAME_OR_PATH]

Exit codes: 0 success / gate pass, 1 regression (gate FAIL) or a run that
crashed, 2 bad input (malformed suite, missing checkpoint or data, corrupt
or other-schema baseline, missing baseline).
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
    r.add_argument("--resume", action="store_true", help="skip runs whose result file is already finished")
    r.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a suite field; model=PATH_OR_HF_ID and recipe=NAME_OR_YAML replace that axis")

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

    rc = sub.add_parser("recipes", help="list named recipes, or show one resolved")
    rc.add_argument("recipe", nargs="?", help="a named recipe or a recipe YAML path")
    return p


def _cmd_run(args) -> int:
    """`run`: expand the suite, run it, print the table; 0 ok, 1 a run crashed, 2 bad input."""
    from evalharness.report import results_table
    from evalharness.results import load_result
    from evalharness.runner import resolve_backend, run_suite
    from evalharness.suite import load_suite

    suite0 = load_suite(args.suite, sets=args.sets, data_dir=args.data_dir)
    backend = resolve_backend(suite0.runs[0].backend, args.device)
    suite = suite0 if backend == suite0.runs[0].backend else load_suite(
        args.suite, sets=args.sets, data_dir=args.data_dir, backend=backend)
    print(f"suite '{suite.name}': {len(suite.runs)} run(s) on {backend} -> {args.out}", file=sys.stderr)
    outcomes = run_suite(suite, args.out, resume=args.resume)
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

        gate_cfg = (yaml.safe_load(Path(args.suite).read_text()) or {}).get("gate", {})
    verdicts, missing = gate_results(args.results, args.baselines, gate_cfg, allow_missing=args.allow_missing)
    code = exit_code(verdicts, missing)
    print(verdict_table(verdicts, show_pass=args.verbose))
    for m in missing:
        print(f"MISSING  {m}")
    if args.junit:
        write_junit(args.junit, verdicts, missing)
    if args.summary:
        write_summary(args.summary, verdicts, missing, code)
    print({0: "gate: PASS", 1: "gate: FAIL (regression)", 2: "gate: ERROR (missing baselines)"}[code])
    return code


def _cmd_baseline(args) -> int:
    """`baseline update`."""
    from evalharness.baselines import update_baselines

    written = update_baselines(args.results, args.baselines, dry_run=args.dry_run)
    print(f"{len(written)} baseline file(s) written" if not args.dry_run else "dry run: nothing written")
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
    handlers = {"run": _cmd_run, "gate": _cmd_gate, "baseline": _cmd_baseline, "recipes": _cmd_recipes}
    try:
        return handlers[args.command](args)
    except BAD_INPUT as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: finished runs are saved; re-run with --resume to continue", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
