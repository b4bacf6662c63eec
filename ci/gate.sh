#!/usr/bin/env bash
# The CI numerics gate: run the smoke suite, gate it against the committed
# baselines, write JUnit XML and a markdown summary, exit with the gate's code.
#
#   ci/gate.sh [OUT_DIR]            (default OUT_DIR: gate-out)
#
# Writes OUT_DIR/results/ (one result JSON per run + suite.json),
# OUT_DIR/junit.xml, OUT_DIR/summary.md and OUT_DIR/gate.log; appends the
# summary and the JUnit results in markdown (ci/slowest.py) to
# $GITHUB_STEP_SUMMARY when that is set (GitHub Actions).
# Exit: 0 pass, 1 regression (gate FAIL, or a run that crashed), 2 bad input
# (malformed suite, missing checkpoint or data, missing / corrupt baseline).
#
# Environment (all optional):
#   SUITE=suites/smoke.yaml     the suite to run
#   BASELINES=baselines         the baselines dir (baselines/<suite>/<run_key>.json)
#   EVALHARNESS_DATA_DIR=...    shared data dir (adds the data-dir models, e.g. stories260K)
#   GATE_DEVICE=cpu|cuda|auto   backend device (default: the suite's backend)
#   GATE_ARGS="--set k=v ..."   extra arguments for `evalharness run`
#   EVALHARNESS="python3 -m evalharness.cli"   how to invoke the CLI
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

OUT="${1:-${GATE_OUT:-gate-out}}"
SUITE="${SUITE:-suites/smoke.yaml}"
BASELINES="${BASELINES:-baselines}"
read -r -a CLI <<< "${EVALHARNESS:-python3 -m evalharness.cli}"
read -r -a EXTRA <<< "${GATE_ARGS:-}"
DEVICE_ARGS=()
if [ -n "${GATE_DEVICE:-}" ]; then DEVICE_ARGS=(--device "$GATE_DEVICE"); fi

mkdir -p "$OUT"
rm -rf "$OUT/results"
echo "== numerics gate: ${SUITE} -> ${OUT}/results (baselines: ${BASELINES})" | tee "$OUT/gate.log"

"${CLI[@]}" run "$SUITE" --out "$OUT/results" "${DEVICE_ARGS[@]}" "${EXTRA[@]}" 2>&1 | tee -a "$OUT/gate.log"
run_code=${PIPESTATUS[0]}
echo "== run exit code: ${run_code}" | tee -a "$OUT/gate.log"

if [ ! -f "$OUT/results/suite.json" ]; then
  # Nothing to gate (the suite itself was bad input): still leave a summary behind.
  { echo "# Numerics gate: ERROR (bad input)"; echo; echo '```'; tail -n 20 "$OUT/gate.log"; echo '```'; } > "$OUT/summary.md"
  code=2
else
  "${CLI[@]}" gate "$OUT/results" --baselines "$BASELINES" --junit "$OUT/junit.xml" --summary "$OUT/summary.md" \
    2>&1 | tee -a "$OUT/gate.log"
  code=${PIPESTATUS[0]}
  # A run that hit bad input (e.g. a missing checkpoint) never reads as a pass.
  if [ "$code" -eq 0 ] && [ "$run_code" -eq 2 ]; then code=2; fi
fi

if [ -n "${GITHUB_STEP_SUMMARY:-}" ]; then
  # The gate's summary, then its JUnit results (ci/slowest.py; a JUnit file that is missing is named there).
  if [ -f "$OUT/summary.md" ]; then cat "$OUT/summary.md" >> "$GITHUB_STEP_SUMMARY"; fi
  python3 ci/slowest.py -n 0 --markdown "$GITHUB_STEP_SUMMARY" --title "Numerics gate: JUnit results" \
    "$OUT/junit.xml" >> "$OUT/gate.log" 2>&1
fi
echo "== gate exit code: ${code} (0 pass, 1 regression, 2 bad input)" | tee -a "$OUT/gate.log"
exit "$code"
