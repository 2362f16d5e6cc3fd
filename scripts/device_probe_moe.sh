#!/usr/bin/env bash
# One device call that probes the compiled NVFP4 / UFP4 MoE divergence (issue 16; benchmarks/study-moe-probe):
# everything side by side, logs under $OUT.  Carry [".carry"] (hf_fp4's wheel and the corpus cache, as for
# scripts/device_study.sh); back here unpack study.tgz with device_study.sh unpack ... configs/study/moe-probe.yaml.
#   bash scripts/device_probe_moe.sh
#   1. the probe runs inductor (with the experts state placed eagerly since session 24) / aot_eager / no SR /
#      no Hadamard (compiled) and no SR (eager), 40 steps each, detached;
#   2. scripts/probe_moe_compile.py: step 5 replayed eagerly and compiled on the same weights and batch;
#   3. the GPU tests of the routing layout and one experts layer compiled vs eager, and of unwritten-memory reads;
#   4. compute-sanitizer's initcheck on the study-size grouped layer (reads of uninitialised device memory).
# Ran in session 25 (H100): step 2 found the cause, inductor's searchsorted on a slice (pytorch/pytorch#182343),
# fixed in hf_fp4/nn/grouping.py; kept as the record of that call (its runs are finished, so a rerun skips them).
set -uo pipefail
OUT=${OUT:-/tmp/out}
export STUDY_ROOT=${STUDY_ROOT:-/root/hf_fp4_probe} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
STUDY=configs/study/moe-probe.yaml PARALLEL=5 WAIT=1 \
  ONLY=${ONLY:-nvfp4-inductor-placed,nvfp4-aot-eager,nvfp4-nosr-inductor,nvfp4-noh-inductor,nvfp4-nosr-eager} \
  bash scripts/device_study.sh start > "$OUT/study-start.log" 2>&1
export PYTHONPATH=$STUDY_ROOT/site HF_FP4_CACHE=$STUDY_ROOT/cache
timeout "${PROBE_TIMEOUT:-420}" python3 -P scripts/probe_moe_compile.py configs/study/moe-probe.yaml nvfp4 --step 5 \
  > "$OUT/probe.log" 2>&1 &
timeout 420 python3 -P -m pytest -q -p no:cacheprovider tests/test_experts.py \
  -k "layout_compiled or compiled_experts_layer or never_reads" > "$OUT/tests.log" 2>&1 &
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$sanitizer" ]; then
  timeout 300 "$sanitizer" --tool initcheck --print-limit 20 python3 -P -m pytest -q -p no:cacheprovider \
    tests/test_experts.py -k "studys_size_equal_the_loop and nvfp4" > "$OUT/initcheck.log" 2>&1 &
else
  echo "no compute-sanitizer on this machine" > "$OUT/initcheck.log"
fi
wait
WAIT=$((${CALL_LIMIT:-570} - SECONDS)) bash scripts/device_study.sh watch > "$OUT/study-watch.log" 2>&1
tail -n 40 "$OUT/probe.log"; tail -n 5 "$OUT/tests.log"; grep -E "ERROR SUMMARY|Uninitialized" "$OUT/initcheck.log" | head
tail -n 12 "$OUT/study-watch.log"
