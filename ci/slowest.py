"""Summarise JUnit XML files (pytest's, or the numerics gate's): print the N slowest tests (default 15) across all
files, then the totals as one closing line ("ci: P passed, F failed, S skipped"); with --markdown, also append a
markdown summary to a file (a GitHub Actions step summary): totals per file and test suite, the failed tests with
their messages, the skip reasons with their counts and the N slowest tests.

    python3 ci/slowest.py [-n N] [--markdown FILE [--title TITLE]] FILE.xml...

A file that is missing or does not parse is named in the output (a step that died before writing its JUnit must
not vanish from the summary); the exit status is 0 either way: the steps that ran the tests carry the verdict.
"""

from __future__ import annotations

import argparse
import html
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

MAX_FAILURES = 30  # failed tests shown in full in the markdown; the rest are counted
MAX_DETAIL = 3000  # characters of one failure's message and traceback
MAX_SKIP_REASONS = 20


@dataclass
class Case:
    """One test case: seconds (setup + call + teardown), id, outcome (passed / failed / skipped), detail (the
    failure's message and text, or the skip reason)."""
    seconds: float
    name: str
    outcome: str
    detail: str = ""


@dataclass
class Suite:
    """One <testsuite> of one file: its cases and its wall time (None when the file does not say)."""
    file: str
    name: str
    cases: list[Case] = field(default_factory=list)
    wall: float | None = None


def _failure_detail(el: ET.Element) -> str:
    """A <failure> / <error>: its tag, message and text (the message left out where the text holds it, as pytest's
    traceback does)."""
    message, text = el.get("message", ""), (el.text or "").strip()
    return f"{el.tag}: " + (text if message in text else f"{message}\n{text}".strip())


def _case(el: ET.Element, stem: str) -> Case:
    """A <testcase>; a failure or an error counts as failed."""
    name = f"{el.get('classname', '')}::{el.get('name', '')} ({stem})"
    bad = [c for c in el if c.tag in ("failure", "error")]
    skipped = el.find("skipped")
    if bad:
        outcome = "failed"
        detail = "\n".join(_failure_detail(c) for c in bad)
    elif skipped is not None:
        outcome, detail = "skipped", skipped.get("message") or (skipped.text or "").strip()
    else:
        outcome, detail = "passed", ""
    return Case(float(el.get("time") or 0.0), name, outcome, detail)


def read_suites(files: list[Path]) -> tuple[list[Suite], list[str]]:
    """The test suites of the JUnit files, and one line per file that is missing or does not parse."""
    suites, problems = [], []
    for f in files:
        if not f.is_file():
            problems.append(f"{f}: no such file (the step did not write its JUnit XML)")
            continue
        try:
            root = ET.parse(f).getroot()
        except ET.ParseError as e:
            problems.append(f"{f}: not valid XML ({e}); the step that wrote it may have been killed")
            continue
        for ts in [root] if root.tag == "testsuite" else root.iter("testsuite"):
            wall = ts.get("time")
            suites.append(Suite(f.stem, ts.get("name", ""), [_case(c, f.stem) for c in ts.iter("testcase")],
                                float(wall) if wall else None))
    return suites, problems


def _counts(cases: list[Case]) -> Counter:
    return Counter(c.outcome for c in cases)


def _cell(text: str) -> str:
    """Text for one markdown table cell."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _fenced(text: str) -> str:
    """A code block that the text cannot close (the fence is longer than any run of backticks in it)."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{text}\n{fence}"


def markdown(suites: list[Suite], problems: list[str], title: str, slowest: int) -> str:
    """The markdown summary: a headline with the totals, a table per file and suite, the unreadable files, the
    failed tests (message and traceback, folded), the skip reasons with counts, the slowest tests."""
    cases = [c for s in suites for c in s.cases]
    n = _counts(cases)
    verdict = "FAILED" if n["failed"] or problems else "passed"
    out = [f"## {_cell(title)}: {verdict}", "",
           f"{n['passed']} passed, {n['failed']} failed, {n['skipped']} skipped"
           + (f"; {len(problems)} JUnit file(s) missing or unreadable" if problems else "") + ".", "",
           "| file | suite | passed | failed | skipped | wall time (s) |", "|---|---|---|---|---|---|"]
    for s in suites:
        c = _counts(s.cases)
        wall = f"{s.wall:.1f}" if s.wall is not None else "-"
        out.append(f"| {_cell(s.file)} | {_cell(s.name)} | {c['passed']} | {c['failed']} | {c['skipped']} | {wall} |")
    out.append("")
    if problems:
        out += ["### Missing or unreadable JUnit files", ""] + [f"- {_cell(p)}" for p in problems] + [""]
    failed = [c for c in cases if c.outcome == "failed"]
    if failed:
        out += [f"### Failed tests ({len(failed)})", ""]
        for c in failed[:MAX_FAILURES]:
            detail = c.detail if len(c.detail) <= MAX_DETAIL else c.detail[:MAX_DETAIL] + "\n[... cut]"
            out += [f"<details><summary>{html.escape(c.name)}</summary>", "", _fenced(detail), "", "</details>", ""]
        if len(failed) > MAX_FAILURES:
            out += [f"... and {len(failed) - MAX_FAILURES} more failed test(s); the JUnit files have them all.", ""]
    reasons = Counter(c.detail or "(no reason given)" for c in cases if c.outcome == "skipped")
    if reasons:
        out += ["### Skip reasons", "", "| tests | reason |", "|---|---|"]
        out += [f"| {k} | {_cell(r)} |" for r, k in reasons.most_common(MAX_SKIP_REASONS)]
        if len(reasons) > MAX_SKIP_REASONS:
            out.append(f"| {sum(k for _, k in reasons.most_common()[MAX_SKIP_REASONS:])} | (other reasons) |")
        out.append("")
    if slowest > 0 and cases:
        rows = sorted(cases, key=lambda c: c.seconds, reverse=True)[:slowest]
        out += [f"### {len(rows)} slowest tests", "", "| seconds | test |", "|---|---|"]
        out += [f"| {c.seconds:.2f} | {_cell(c.name)} |" for c in rows] + [""]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=15, help="how many of the slowest tests to list (0: none)")
    ap.add_argument("--markdown", type=Path, metavar="FILE",
                    help="append a markdown summary to FILE (e.g. \"$GITHUB_STEP_SUMMARY\")")
    ap.add_argument("--title", default="Test results", help="the markdown summary's heading")
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args(argv)
    suites, problems = read_suites(args.files)
    cases = [c for s in suites for c in s.cases]
    for p in problems:
        print(f"ci/slowest.py: {p}", file=sys.stderr)
    if args.n > 0:
        rows = sorted(cases, key=lambda c: c.seconds, reverse=True)[:args.n]
        print(f"{len(rows)} slowest tests (setup + call + teardown):")
        for c in rows:
            print(f"{c.seconds:8.2f}s  {c.name}")
    if args.markdown is not None:
        with open(args.markdown, "a", encoding="utf-8") as fh:
            fh.write(markdown(suites, problems, args.title, args.n))
    count = _counts(cases)
    print(f"ci: {count['passed']} passed, {count['failed']} failed, {count['skipped']} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
