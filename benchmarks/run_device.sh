#!/usr/bin/env bash
# One batched GPU session: fingerprint, GPU tests, kernel benchmarks, end-to-end decode, GPU suites.
# Usage on the device machine (repo root; data carried in .carry/data):
#   OUT=/some/dir bash benchmarks/run_device.sh [tests] [bench] [e2e] [suites]
# Each part writes its log under $OUT; a failing part never stops the next one.
set -u
OUT=${OUT:-benchmarks/results/device-$(date +%F)}
mkdir -p "$OUT"
export PYTHONPATH=$PWD EVALHARNESS_DATA_DIR=$PWD/.carry/data
parts=${*:-tests bench e2e suites}
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
    tests)
      run gpu_tests 300 python -m pytest -q -p no:cacheprovider -o addopts="" -rs -s \
        tests/test_kernels_gpu.py tests/test_gemm_gpu.py tests/test_attention_gpu.py tests/test_moe_gpu.py \
        tests/test_native_gpu.py tests/formats/test_formats_gpu.py tests/test_runtime_gpu.py ;;
    tests-engine)  # the engine-level GPU tests only (kernels have their own files)
      run gpu_tests_engine 240 python -m pytest -q -p no:cacheprovider -o addopts="" -rs -s \
        tests/test_native_gpu.py tests/test_runtime_gpu.py tests/test_moe_gpu.py tests/formats/test_formats_gpu.py ;;
    bench)
      run bench_quant 120 python benchmarks/bench_quant_kernels.py --out "$OUT/bench_quant.txt"
      run bench_gemm 150 python benchmarks/bench_gemm.py
      run bench_attention 120 python benchmarks/bench_attention.py
      run bench_moe 120 python benchmarks/bench_moe.py ;;
    e2e)
      run bench_e2e 300 python benchmarks/bench_e2e.py --batches 1,8,64 --steps 8 --runtime
      run bench_e2e_moe 150 python benchmarks/bench_e2e.py --moe --layers 8 --batches 1,8 --steps 6 --no-transformers
      run bench_capture 120 python benchmarks/bench_capture.py --data-dir .carry/data ;;
    suites)
      run suite_gpu 400 python -m evalharness.cli run suites/gpu.yaml --out "$OUT/gpu" --no-tracking
      run suite_invariance 240 python -m evalharness.cli run suites/invariance-gpu.yaml --out "$OUT/invariance" --no-tracking ;;
    pack)  # the device tool brings back a handful of files: pack everything into one archive
      (cd "$OUT" && tar czf ../device_results.tgz . && rm -rf ./* && mv ../device_results.tgz .) ;;
  esac
done
