#!/usr/bin/env bash
# One batched GPU run: fingerprint, GPU tests, kernel benchmarks, end-to-end decode, GPU suites.
# Usage on the device machine (repo root; .carry/ built here by benchmarks/device_carry.sh, device tool
# carry [".carry"]; its data.tar.xz is unpacked into /tmp/evalharness-data first, outside the tree that each
# call replaces):
#   OUT=/some/dir bash benchmarks/run_device.sh [tests] [bench] [e2e] [suites] [capture] [tasks] [nightly] [harness]
#                                                 [mutations] [parallel] [pack]
# Each part writes its log under $OUT; a failing part never stops the next one. Without OUT the files go to
# benchmarks/results/<hw>-<date>/ (e.g. h200-2026-11-30, h200x2-2026-11-29), the layout of benchmarks/results/:
# copy what a run measured there, with a README.md naming the command of each file.
set -u
hw() {  # "h200" for one NVIDIA H200, "h200x2" for two; "gpu" when nvidia-smi does not answer
  local names n
  names=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null) || { echo gpu; return; }
  n=$(printf '%s\n' "$names" | grep -c .)
  printf '%s%s\n' "$(printf '%s\n' "$names" | head -1 | awk '{print tolower($NF)}')" "$([ "$n" -gt 1 ] && echo "x$n")"
}
export OUT=${OUT:-benchmarks/results/$(hw)-$(date -u +%F)}
mkdir -p "$OUT"
site_packages() {  # the carried packages (benchmarks/device_carry.sh) unpacked into /tmp/site (lm-eval and
  # its datasets for the evals, pydantic for evalharness itself), once per machine
  [ -d /tmp/site ] && return 0
  python3 -c "import tarfile; tarfile.open('.carry/site.tar.xz').extractall('/tmp', filter='data')" ||
    { echo "site: unpacking .carry/site.tar.xz failed (build it with benchmarks/device_carry.sh)"; return 1; }
}
export PYTHONPATH=$PWD
if [ -f .carry/site.tar.xz ]; then site_packages && export PYTHONPATH=/tmp/site:$PWD; fi
parts=${*:-tests bench e2e suites}
DATA=/tmp/evalharness-data
if [ -f .carry/data.tar.xz ] && [ ! -f $DATA/README.md ]; then  # once per machine (parts may run side by side, and
  # on into the next call: nightly); python's tarfile: no dependence on an xz binary there
  python3 -c "import tarfile; tarfile.open('.carry/data.tar.xz').extractall('$DATA', filter='data')" ||
    echo "data: unpacking .carry/data.tar.xz failed"
fi
# the data dir only when it came along (a run without the carry uses the built-in models; a dangling
# EVALHARNESS_DATA_DIR is an error by design)
if [ -d $DATA ]; then export EVALHARNESS_DATA_DIR=$DATA; else unset EVALHARNESS_DATA_DIR; fi
# The `tasks` part's sizes (issue 6: every eval of suites/evals.yaml, at device sizes, on both CUDA backends).
# Full task sets where they are small (arc_challenge 1172, piqa 1838, winogrande 1267 documents); the large
# ones limited (hellaswag 1000 of 10042, arc_easy 1000 of 2376, lambada_standard 1000 of 5153, mmlu 20 of each
# subject: 1140 of 14042) and GSM8K to 8 of 1319 (5-shot, 32 new tokens). One recipe (fp8-block) on
# cuda-emulated and cuda-native: per model one reference pass and two engine passes per eval. Estimated
# 4-5 minutes on an H200 (from ~30 ms per engine forward / decode step of these models there and ~1.5 ms of
# lm-eval + tokenizer work per document); the results' timing says where it went (evals_timing.txt).
EVALS_DEVICE_SETS=(
  --set recipe=fp8-block --set "backend=[cuda-emulated, cuda-native]"
  --set evals.layer_error.windows=16 --set evals.ppl_kld.max_windows=256
  --set evals.tasks.batch_size=128 --set evals.tasks.num_fewshot=null --set evals.tasks.max_gen_toks=32
  --set "evals.tasks.limit={hellaswag: 1000, arc_easy: 1000, lambada_standard: 1000, gsm8k: 8, mmlu: 20}"
  --set evals.longctx.new_tokens=256 --set "evals.longctx.prompt_lens=[256]" --set evals.longctx.prompts_per_len=1
  --set evals.longctx.passkey_lens=null --set "evals.longctx.passkey_depths=[0.0, 0.5, 1.0]"
  --set evals.longctx.passkey_trials=1
  --set evals.longctx.kld_docs=8 --set evals.longctx.kld_seq_len=null --set evals.longctx.kld_buckets=8
)
run() {  # run NAME TIMEOUT CMD...: time-limited, output to $OUT/NAME.log, status line on stdout
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: rc=$? in $(( $(date +%s) - t0 ))s"; tail -3 "$OUT/$name.log"
}
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python -c "import json; from evalharness.provenance import hardware_fingerprint as f; print(json.dumps(f('cuda'), indent=1))" > "$OUT/fingerprint.json" 2>&1
for part in $parts; do
  case $part in
    tests)  # every test marked gpu (TESTS: other pytest paths / -k selections; TESTS_TIMEOUT: seconds). One line
      # per test as it finishes (-v): a run stopped by its time limit still names what passed and what failed.
      read -ra tests <<< "${TESTS:-tests/}"
      run gpu_tests "${TESTS_TIMEOUT:-900}" python -m pytest -v -p no:cacheprovider -o addopts="" -rfEs -m gpu \
        --durations=20 "${tests[@]}" ;;
    tests-engine)  # the engine-level GPU tests only (whole models, runtime, formats; the kernels' tests left out)
      run gpu_tests_engine 240 python -m pytest -q -p no:cacheprovider -o addopts="" -rs -s -m gpu \
        tests/engine --ignore=tests/engine/kernels ;;
    parallel)  # >= 2 GPUs: the TP/EP tests (gloo and NCCL; cuda-emulated and cuda-native, the latter writing
      # $OUT/parallel_native.json), suites/parallel.yaml under torchrun + NCCL on each cuda backend, then
      # benchmarks/bench_parallel.py on a real MoE shape
      run parallel_tests 300 python -m pytest -q -p no:cacheprovider -o addopts="" -rs -s tests/engine/test_parallel.py
      run parallel_native_tests 300 python -m pytest -q -p no:cacheprovider -o addopts="" -rs -s \
        tests/engine/test_parallel_native.py
      run suite_parallel 300 python -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 \
        --master-port 29533 -m evalharness.cli run suites/parallel.yaml --device cuda --out "$OUT/parallel" --no-tracking
      run suite_parallel_native 300 python -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 \
        --master-port 29534 -m evalharness.cli run suites/parallel.yaml --backend cuda-native \
        --out "$OUT/parallel-native" --no-tracking
      # a random-weight Qwen3-30B-A3B-shaped MoE (PARALLEL_LAYERS of its 48 layers) at TP=2 / EP=2 / both vs TP=1
      run bench_parallel 400 python -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 \
        --master-port 29535 benchmarks/bench_parallel.py --layers "${PARALLEL_LAYERS:-8}" --out "$OUT" ;;
    bench)
      run bench_quant_kernels 120 python benchmarks/bench_quant_kernels.py --out "$OUT/bench_quant_kernels.txt"
      run bench_gemm 150 python benchmarks/bench_gemm.py
      run bench_attention 120 python benchmarks/bench_attention.py
      run bench_moe 120 python benchmarks/bench_moe.py ;;
    e2e)
      run bench_e2e 300 python benchmarks/bench_e2e.py --batches 1,8,64 --steps 16 --runtime --profile --pdl both
      run bench_e2e_moe 150 python benchmarks/bench_e2e.py --moe --layers 8 --batches 1,8 --steps 6 --no-transformers
      run bench_capture 120 python benchmarks/bench_capture.py --data-dir $DATA ;;
    suites)
      run suite_gpu 400 python -m evalharness.cli run suites/gpu.yaml --out "$OUT/gpu" --no-tracking
      run suite_invariance 240 python -m evalharness.cli run suites/invariance-gpu.yaml --out "$OUT/invariance" --no-tracking ;;
    capture)  # the per-tap statistics on the GPU: Triton fold vs its torch reference, then capture on vs off
      run errorstats_gpu 120 python -m pytest -q -p no:cacheprovider -o addopts="" -rs -m gpu -k errorstats tests/
      run bench_capture 150 python benchmarks/bench_capture.py --data-dir $DATA ;;
    tasks)  # lm-eval tasks, long context, per-layer error, PPL/KLD (suites/evals.yaml) with the carried wheels.
      # EVALS_EXTRA: more --set options, appended; EVALS_TIMEOUT: seconds (default 420). A CPU dry run of this
      # part in an environment with lm-eval installed (no .carry/site.tar.xz):
      #   EVALS_EXTRA="--set backend=cpu-emulated --set evals.tasks.limit=2 ..." OUT=/tmp/x bash benchmarks/run_device.sh tasks
      read -ra extra <<< "${EVALS_EXTRA:-}"
      (
        python -c "import importlib.metadata as m, lm_eval; print(lm_eval.__file__, {p: m.version(p) for p in ('lm_eval',
          'datasets', 'pyarrow', 'fsspec', 'huggingface_hub', 'pandas', 'transformers', 'tokenizers', 'torch')})" \
          >> "$OUT/evals_pip.log" 2>&1
        run evals "${EVALS_TIMEOUT:-420}" python -m evalharness.cli run suites/evals.yaml --no-tracking --out "$OUT/evals" \
          "${EVALS_DEVICE_SETS[@]}" "${extra[@]}"
        python benchmarks/timing_table.py "$OUT/evals" > "$OUT/evals_timing.txt" 2>&1; cat "$OUT/evals_timing.txt"
      ) ;;
    nightly)  # suites/nightly.yaml on cuda-native, resumable across calls and sessions. The models run side by side
      # in parts (benchmarks/split_suite.py deals a model's recipes, and with --serving-apart its serving configs,
      # over them, with the whole suite's run keys and fingerprints; the runs are host-bound, so they share the GPU;
      # NIGHTLY_SPLIT: its options, default 3 parts a model and 4 for zoo-moe), each in its own folder. The parts run
      # detached (setsid) in /tmp/nightly-parts, outside the tree that a call replaces: a run longer than one call
      # goes on into the next call while the machine is warm (a call within the device tool's idle release of the
      # last). A call starts the parts with runs left (--pending) unless parts are still running from an earlier
      # call, waits up to NIGHTLY_TIMEOUT seconds (default 540) for them, and returns what finished (the device tool
      # returns at most 8 files; the parts' logs are one file): nightly_new.tgz, the full results new to the carry
      # (gather them in one folder here), and nightly_resume.tgz, every finished run's stub (status and
      # fingerprint, what --resume reads; benchmarks/gather_parts.py): put it at .carry/nightly_partial.tgz for
      # the next call. NIGHTLY_RUN_LIMIT: seconds a part may run in all (default 3000). The reference cache is not
      # kept (recomputed once per part). Once every run has a result and no part runs, the whole suite's --resume
      # writes its manifest (suite.json, in nightly_new.tgz; NIGHTLY_MANIFEST_TIMEOUT, default 300). A CPU dry run
      # of the mechanics: NIGHTLY_SUITE=suites/smoke.yaml NIGHTLY_DEVICE=cpu NIGHTLY_SPLIT= OUT=/tmp/x bash ... nightly
      work=/tmp/nightly-parts nsuite=${NIGHTLY_SUITE:-suites/nightly.yaml} ndevice=${NIGHTLY_DEVICE:-cuda}
      mkdir -p "$OUT/nightly" "$work"
      [ -f .carry/nightly_partial.tgz ] && tar xzf .carry/nightly_partial.tgz -C "$OUT"
      running() { local f; for f in "$work"/*.pid; do [ -e "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null && return 0; done; return 1; }
      # a new process session for each part (setsid, else python's os.setsid where util-linux is absent); a simple
      # command sent to the background, so that $! is the part's own pid
      if command -v setsid > /dev/null; then detach=(setsid)
      else detach=(python3 -c 'import os, sys; os.setsid(); os.execvp(sys.argv[1], sys.argv[1:])'); fi
      python benchmarks/gather_parts.py "$OUT/nightly" "$work"/*/ > "$OUT/nightly_new.txt"  # finished since the last call
      if ! running; then
        split=${NIGHTLY_SPLIT---shards 3 --shards-for zoo-moe=4}
        # only the parts with runs left (--pending: the runner's own resume check against the results so far)
        for suite in $(python benchmarks/split_suite.py "$nsuite" $split --pending "$OUT/nightly"); do
          part=$(basename "$suite" .yaml); part=${part#.}
          rm -f "$work/$part.rc" && mkdir -p "$work/$part" && cp "$OUT"/nightly/*__*.json "$work/$part/" 2>/dev/null
          OMP_NUM_THREADS=1 "${detach[@]}" bash -c 't0=$(date +%s); timeout "$1" python -m evalharness.cli run "$2" --device "$4" \
            --resume --no-tracking --out "$3"; echo "rc=$? in $(( $(date +%s) - t0 ))s" > "$3.rc"' _ \
            "${NIGHTLY_RUN_LIMIT:-3000}" "$suite" "$work/$part" "$ndevice" > "$work/$part.log" 2>&1 < /dev/null &
          echo $! > "$work/$part.pid"
        done
      fi
      end=$(( $(date +%s) + ${NIGHTLY_TIMEOUT:-540} ))
      while running && [ "$(date +%s)" -lt $end ]; do sleep 5; done
      python benchmarks/gather_parts.py "$OUT/nightly" "$work"/*/ >> "$OUT/nightly_new.txt"
      for f in "$work"/*.log; do
        [ -e "$f" ] || continue
        echo "${f##*/}: $(cat "${f%.log}.rc" 2>/dev/null || echo running)"; tail -3 "$f"
        echo "== ${f##*/}" >> "$OUT/nightly_parts.log"; cat "$f" >> "$OUT/nightly_parts.log"
      done
      if ! running && python -c "import pathlib, sys; from evalharness.suite import load_suite
sys.exit(any(not pathlib.Path(sys.argv[1], r.key + '.json').exists() for r in load_suite(sys.argv[2]).runs))" \
          "$OUT/nightly" "$nsuite"; then  # every run has its result: the whole suite (skips them all, writes its manifest)
        run nightly "${NIGHTLY_MANIFEST_TIMEOUT:-300}" python -m evalharness.cli run "$nsuite" --device "$ndevice" --resume --no-tracking \
          --out "$OUT/nightly" && echo suite.json >> "$OUT/nightly_new.txt"
      fi
      python benchmarks/timing_table.py "$OUT/nightly" > "$OUT/nightly_timing.txt" 2>&1
      tar czf "$OUT/nightly_new.tgz" -C "$OUT/nightly" -T "$OUT/nightly_new.txt" && rm "$OUT/nightly_new.txt"
      python benchmarks/gather_parts.py "$OUT/nightly" --stubs "$OUT/stub/nightly" &&
        tar czf "$OUT/nightly_resume.tgz" -C "$OUT/stub" nightly && rm -rf "$OUT/nightly" "$OUT/stub" ;;
    mutations)  # the native-kernel mutations of suites/selftest/mutations.yaml (device: gpu) with their nulls
      run mutations_gpu 560 python -m evalharness.cli selftest --mutations --out "$OUT/mutations-gpu" \
        --only gpu-quant-rtz,gpu-attn-split-k-dropped,gpu-gemm-scale-layout-k128-mod4,gpu-mx-e8m0-off-by-one,gpu-paged-decode-page-off-by-one,gpu-cuda-graph-stale-buffer
      run kernel_mutation_tests 120 python -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/test_kernel_mutations.py ;;
    harness)  # benchmarks/bench_harness.py: the nightly's evaluations on a Llama-3-8B-shaped checkpoint (HARNESS_ARGS)
      read -ra hargs <<< "${HARNESS_ARGS:-}"
      (
        run bench_harness "${HARNESS_TIMEOUT:-570}" python benchmarks/bench_harness.py --data-dir $DATA \
          --work /tmp/bench_harness "${hargs[@]}"
      ) ;;
    pack)  # the device tool brings back a handful of files: pack everything into one archive
      (cd "$OUT" && tar czf ../device_results.tgz . && rm -rf ./* && mv ../device_results.tgz .) ;;
  esac
done
