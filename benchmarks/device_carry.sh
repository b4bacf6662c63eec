#!/usr/bin/env bash
# (Re)builds the git-ignored folder .carry/ that one device run takes along (device tool: carry [".carry"]):
#
#   .carry/site.tar.xz   the Python packages the device image lacks and a run imports (lm-eval, datasets, dill,
#                        multiprocess; pydantic and its three), installed here for CPython 3.12 on x86-64 Linux at
#                        exactly the versions installed here, as one xz tarball of the `site/` folder (xz over the
#                        installed files is 35% smaller than the wheels); lm-eval with only the bundled task folders
#                        the harness indexes (lm_eval_folders of evalharness/taskdata/datasets.yaml: hellaswag, arc,
#                        piqa, winogrande, lambada, gsm8k, mmlu). benchmarks/run_device.sh unpacks it into /tmp/site.
#   .carry/data.tar.xz   the shared data the device parts read (task files, stories260K, WikiText-2 and
#                        SimpleBooks-92 test), xz -9; benchmarks/run_device.sh unpacks it into
#                        /tmp/evalharness-data
#
# Usage (repo root or anywhere):  bash benchmarks/device_carry.sh [DATA_DIR]   (default ../shared/data)
# Needs pip with access to the package index (sdist-only packages are built into wheels here). Fails, naming
# the sizes, when the tracked + untracked tree plus .carry/ exceeds the device tool's 64 MiB.
# `bash benchmarks/device_carry.sh --check` re-runs only the last steps: the size check, then an unpack of the
# site tarball as the device does and an import of lm_eval.evaluator & co. from there. Run it again right before
# the device call: other files may have grown.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
LIMIT=$((64 * 1024 * 1024))
PY=${PYTHON:-python3}

# Packages the device image lacks (KINDS.md "Python packages already there") that a run imports: what a tasks run
# imports from lm-eval's requirements (checked with sys.modules after a run: lm_eval, datasets, dill, multiprocess),
# and pydantic (evalharness's schemas) with its requirements. lm-eval's other declared requirements are not
# imported by the harness and are left out (the install is --no-deps).
PACKAGES=(lm_eval datasets dill multiprocess pydantic pydantic_core annotated_types typing_inspection)
# Data files the device parts read, relative to the data dir (evalharness/taskdata/datasets.yaml, suites/*.yaml);
# MMLU's 114 files are added from the data dir below.
DATA_FILES=(README.md SHA256SUMS
  models/stories260k/stories260K.bin models/stories260k/tok512.bin
  text/wikitext2/wiki.test.raw text/simplebooks92/test.txt
  tasks/hellaswag/hellaswag_val_full.txt
  tasks/arc/ARC-Easy-Train.jsonl tasks/arc/ARC-Easy-Dev.jsonl tasks/arc/ARC-Easy-Test.jsonl
  tasks/arc/ARC-Challenge-Train.jsonl tasks/arc/ARC-Challenge-Dev.jsonl tasks/arc/ARC-Challenge-Test.jsonl
  tasks/piqa/dev.jsonl tasks/piqa/dev-labels.lst tasks/winogrande/dev.jsonl
  tasks/lambada/lambada_test_plain_text.txt tasks/lambada/lambada_development_plain_text.txt
  tasks/gsm8k/train.jsonl tasks/gsm8k/test.jsonl)

tree_bytes() {  # bytes of what the device tool sends besides the carry: tracked + untracked-not-ignored files
  { git ls-files -z; git ls-files -z --others --exclude-standard; } |
    "$PY" -c 'import os, sys; print(sum(os.lstat(p).st_size for p in sys.stdin.read().split("\0") if p and os.path.lexists(p)))'
}

check() {  # unpack the site tarball as the device does and import what a run imports, from there
  local target
  target=$(mktemp -d)
  tar -C "$target" -xJf .carry/site.tar.xz
  # pydantic_core is compiled for CPython 3.12: on another Python the local pydantic is imported instead
  [ -n "$(ls "$target"/site/pydantic_core/_pydantic_core.cpython-312-x86_64-linux-gnu.so 2>/dev/null)" ] ||
    { echo "device_carry: FAIL: site.tar.xz has no CPython 3.12 pydantic_core" >&2; exit 1; }
  "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' ||
    rm -rf "$target"/site/pydantic "$target"/site/pydantic_core "$target"/site/pydantic-*.dist-info \
           "$target"/site/pydantic_core-*.dist-info
  PYTHONPATH="$target/site:$REPO" "$PY" - "$target/site" <<'EOF'
import sys
target = sys.argv[1]
import lm_eval.evaluator, lm_eval.tasks, datasets, dill, multiprocess  # noqa: E401,F401
import evalharness.lm_adapter, evalharness.evals.tasks  # noqa: E401,F401
from evalharness.taskdata.manager import lm_eval_task_folders
from evalharness.taskdata.registry import registry
for mod in (lm_eval, datasets, dill, multiprocess):
    assert mod.__file__.startswith(target), f"{mod.__name__} imported from {mod.__file__}, not from {target}"
kept = lm_eval_task_folders()
assert len(kept) == len(registry().lm_eval_folders), f"lm-eval task folders carried: {kept}"
print(f"check: lm_eval {lm_eval.__version__ if hasattr(lm_eval, '__version__') else ''} datasets "
      f"{datasets.__version__} import from {target}")
EOF
  rm -rf "$target"
}

sizes() {  # what travels against the device tool's limit; fails loudly when over
  local tree carry
  tree=$(tree_bytes)
  carry=$(du -sb .carry | cut -f1)
  echo "carry: packages $(( $(stat -c %s .carry/site.tar.xz) / 1024 )) KiB, data $(( $(stat -c %s .carry/data.tar.xz) / 1024 ))" \
       "KiB, all of .carry $((carry / 1024)) KiB; tree $((tree / 1024)) KiB; total $(((tree + carry) / 1024)) KiB" \
       "of $((LIMIT / 1024)) KiB"
  if [ $((tree + carry)) -gt $LIMIT ]; then
    echo "device_carry: FAIL: tree + .carry = $((tree + carry)) bytes > 64 MiB ($LIMIT): the device tool refuses the run" >&2
    exit 1
  fi
}

if [ "${1:-}" = "--check" ]; then sizes; check; exit 0; fi
DATA=${1:-../shared/data}
[ -d "$DATA" ] || { echo "device_carry: data dir $DATA not found (pass the shared data folder)" >&2; exit 2; }

rm -rf .carry/whl .carry/site.tar.xz .carry/data .carry/data.tar.xz
mkdir -p .carry
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# 1. Wheels, pinned to the versions installed here.
pins=()
for p in "${PACKAGES[@]}"; do
  v=$("$PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$p") ||
    { echo "device_carry: $p is not installed here; pip install it first (pins come from this environment)" >&2; exit 2; }
  pins+=("$p==$v")
done
echo "pins: ${pins[*]}"
platform=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
          --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
          --platform any)
for pin in "${pins[@]}"; do
  # A wheel for py3.12 if the index has one; else the sdist, built into a (pure-python) wheel here.
  if ! "$PY" -m pip download -q --no-deps "${platform[@]}" -d "$work/dl" "$pin" 2>"$work/err"; then
    "$PY" -m pip wheel -q --no-deps -w "$work/dl" "$pin" ||
      { cat "$work/err" >&2; echo "device_carry: no wheel for $pin" >&2; exit 2; }
  fi
done
"$PY" - "$work"/dl/*.whl <<'EOF'
import os, sys
from packaging.utils import parse_wheel_filename
for path in sys.argv[1:]:  # every wheel must install on CPython 3.12, x86-64 Linux
    tags = parse_wheel_filename(os.path.basename(path))[3]
    if not any(t.interpreter in ("py3", "py312", "cp312") and (t.platform == "any" or t.platform.endswith("x86_64"))
               and t.abi in ("none", "abi3", "cp312") for t in tags):
        sys.exit(f"device_carry: {os.path.basename(path)} is not a wheel for CPython 3.12 on x86-64 Linux")
EOF

# 2. lm-eval without the bundled task folders the harness does not index (most of its 78 MB installed): every
#    module stays, and the folders of evalharness/taskdata/datasets.yaml (lm_eval_folders).
lmw=$(ls "$work"/dl/lm_eval-*.whl)
mkdir -p "$work/whl"
"$PY" - "$lmw" "$work/whl" evalharness/taskdata/datasets.yaml <<'EOF'
import base64, hashlib, os, re, sys, zipfile
import yaml
src, dest, registry = sys.argv[1:4]
keep = set(yaml.safe_load(open(registry))["lm_eval_folders"])
task_dir = re.compile(r"^lm_eval/tasks/([^/]+)/")  # lm_eval/tasks/<folder>/...; lm_eval/tasks/*.py stay
with zipfile.ZipFile(src) as zin:
    names = [n for n in zin.namelist() if not (m := task_dir.match(n)) or m.group(1) in keep]
    record = next(n for n in names if n.endswith(".dist-info/RECORD"))
    out = os.path.join(dest, os.path.basename(src))
    rows = []
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for n in names:
            if n == record:
                continue
            data = zin.read(n)
            zout.writestr(zin.getinfo(n), data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append(f"{n},sha256={digest},{len(data)}")
        rows.append(f"{record},,")
        zout.writestr(zin.getinfo(record), "\n".join(rows) + "\n")
dropped = len(zin.namelist()) - len(names)
print(f"lm_eval: {os.path.getsize(src) / 1e6:.1f} MB -> {os.path.getsize(out) / 1e6:.1f} MB ({dropped} task files left out)")
EOF
find "$work/dl" -name '*.whl' ! -name 'lm_eval-*' -exec cp {} "$work/whl/" \;
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" "${platform[@]}" \
  "$work"/whl/*.whl
tar -C "$work" -cf - site | xz -9e -T1 > .carry/site.tar.xz

# 3. The data, one xz tarball (paths relative to the data dir).
mapfile -t mmlu < <(cd "$DATA" && ls tasks/mmlu/dev/*_dev.csv tasks/mmlu/test/*_test.csv)
[ "${#mmlu[@]}" -eq 114 ] || { echo "device_carry: $DATA/tasks/mmlu holds ${#mmlu[@]} files, not 57 x (dev, test)" >&2; exit 2; }
DATA_FILES+=("${mmlu[@]}")
for f in "${DATA_FILES[@]}"; do
  [ -f "$DATA/$f" ] || { echo "device_carry: $DATA/$f is missing" >&2; exit 2; }
done
tar -C "$DATA" -cf - "${DATA_FILES[@]}" | xz -9 -T1 > .carry/data.tar.xz

# 4. Sizes against the device tool's limit, then an install + import check.
sizes
check
