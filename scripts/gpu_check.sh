#!/usr/bin/env bash
# GPU suite + benchmark on the device machine (no registry there): run from the repository root.
# Before the call, here:  bash ../shared/tools/gpu-wheels.sh .whl  (once; datasets, lm-eval, torchao) and
#                          .venv/bin/pip wheel -q --no-deps -w .whl .   (after every change)
# then carry .whl. Usage: bash scripts/gpu_check.sh [tests|bench|all]   (BENCH_ARGS="--parts quant,linear ...";
# the bench results come back as $OUT/bench.tgz; BENCH_TIMEOUT, SAVE_CACHE=0, JOBS, TESTS as below)
set -uo pipefail
what=${1:-all}
status=0
SITE=${SITE:-/tmp/hf_fp4_site}
OUT=${OUT:-/tmp/out}
mkdir -p "$SITE" "$OUT"
python3 -m pip install -q --no-index --no-deps --upgrade --target "$SITE" .whl/*.whl 2>&1 | grep -v WARNING || true
export PYTHONPATH="$SITE"
# Triton's compile cache travels between sessions (the suite's compiles cost most of its device time): carry
# .carry/triton-cache.tar.xz (or its .part-* pieces) in; it comes back as $OUT/triton-cache.tar.xz[.part-*] --
# put those under .carry/ for the next call (keyed by kernel source and options: a changed kernel recompiles).
export TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
cached=$(ls .carry/triton-cache.tar.xz.part-* 2>/dev/null || ls .carry/triton-cache.tar.xz 2>/dev/null || true)
if [ -n "$cached" ]; then
  cat $cached | tar xJf - -C /tmp && echo "triton cache: $(ls "$TRITON_CACHE_DIR" | wc -l) entries"
fi
logs=""
jobs=${JOBS:-8}
collect_logs() {  # the shards' logs as one file, also when a timeout stops them (the EXIT trap)
  [ -n "$logs" ] || return 0
  for i in $(seq 0 $((jobs - 1))); do echo "== shard $i"; cat "$logs/gpu_tests_$i.log" 2>/dev/null; done \
    > "$OUT/gpu_tests.log"
}
save_cache() {  # SAVE_CACHE=0: not (a call whose kernels are all cached already)
  collect_logs
  [ "${SAVE_CACHE:-1}" = 1 ] || return 0
  # xz on every core (single-threaded xz of the cache ran into the call's 600 s limit in session 9, not timed)
  tar -I "xz -T0 -6" -cf /tmp/triton-cache.tar.xz -C /tmp triton-cache
  if [ "$(stat -c %s /tmp/triton-cache.tar.xz)" -gt 15000000 ]; then  # the device returns files of 16 MiB at most
    split -b 15000000 -d /tmp/triton-cache.tar.xz "$OUT/triton-cache.tar.xz.part-"
  else
    cp /tmp/triton-cache.tar.xz "$OUT/"
  fi
}
trap save_cache EXIT
# a timeout stops the shards and still saves the logs and the cache
trap 'pkill -TERM -f "pytest -v -p no:cacheprovider" 2>/dev/null; exit 124' TERM INT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  # -P: keep the repository root off sys.path, so the installed hf_fp4 (with hf_fp4.kernels) is used.
  # The kernel tests are dominated by Triton compiles (CPU): JOBS shards of the test ids run side by side.
  files=${TESTS:-tests/test_kernels.py tests/test_linear.py tests/test_formats.py tests/test_quantize.py \
    tests/test_hadamard.py tests/test_sharq.py tests/test_attention.py tests/test_experts.py tests/test_optim.py \
    tests/test_scale_boundaries.py tests/test_fp4_gather.py tests/test_grouping.py}
  logs=$(mktemp -d)  # the shards' files stay here: the device returns 8 files at most
  python3 -P -m pytest -q -p no:cacheprovider --collect-only $files 2>/dev/null | grep "::" > "$logs/test_ids.txt"
  for i in $(seq 0 $((jobs - 1))); do
    awk -v n="$jobs" -v i="$i" 'NR % n == i' "$logs/test_ids.txt" > "$logs/shard_$i.txt"
    (tr '\n' '\0' < "$logs/shard_$i.txt" | xargs -0 python3 -P -m pytest -v -p no:cacheprovider --tb=short -rf \
      > "$logs/gpu_tests_$i.log" 2>&1) &
  done
  wait
  collect_logs
  grep -h "^FAILED\|^ERROR" "$OUT/gpu_tests.log"; grep -h "passed\|failed" "$logs"/gpu_tests_*.log
  ! grep -q "^FAILED\|^ERROR" "$OUT/gpu_tests.log" || status=1
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  # one results file per part and its table: kept in a folder that comes back as one archive (8 files at most);
  # BENCH_TIMEOUT bounds the run so that the archive is written inside the call's limit
  results=$(mktemp -d)
  timeout "${BENCH_TIMEOUT:-400}" python3 -P scripts/bench.py --out "$results" ${BENCH_ARGS:-} > "$results/bench.log" 2>&1
  tar czf "$OUT/bench.tgz" -C "$results" .
  grep -v "^\[" "$results/bench.log" | tail -80
fi
exit $status
