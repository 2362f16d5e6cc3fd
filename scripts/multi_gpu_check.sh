#!/usr/bin/env bash
# Issue 17 / 18 on a lent multi-GPU machine (nvidia-h200-x2 / -x4 / -x8; no registry there), from the repository
# root.  Before the call, here: rm -f .whl/hf_fp4-*.whl && .venv/bin/pip wheel -q --no-deps -w .whl .  (torchao's
# wheel in .whl too: bash ../shared/tools/gpu-wheels.sh .whl), then carry .whl.  Each stage fits one 10-minute call:
#   STAGE=losses RECIPES="bf16 nvfp4" bash scripts/multi_gpu_check.sh   1 GPU vs DDP vs FSDP2 (vs FSDP2 + FP4
#       all-gather) through accelerate launch scripts/pretrain.py: the loss of every step side by side
#   STAGE=resume RECIPE=nvfp4 bash scripts/multi_gpu_check.sh           FSDP2: an uninterrupted run, and one killed
#       (SIGKILL) after step KILL_AT then --resume'd: the two loss trajectories must be equal bit for bit
#   STAGE=bench GPUS="1 2" bash scripts/multi_gpu_check.sh              scripts/bench_fsdp.py per GPU count
#   STAGE=tests bash scripts/multi_gpu_check.sh                         the GPU tests that need two GPUs (a layer on
#       cuda:1 while cuda:0 is current)
# Results come back as $OUT/multi_gpu.tgz (metrics, logs, benchmarks/multi-gpu-<date>.{json,md}).
# NVLink multicast stays off in every process (the machines' KINDS.md).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 TQDM_DISABLE=1
SITE=${SITE:-/tmp/hf_fp4_site}
OUT=${OUT:-/tmp/out}
WORK=${WORK:-/tmp/multi_gpu}
mkdir -p "$SITE" "$OUT" "$WORK"
python3 -m pip install -q --no-index --no-deps --upgrade --target "$SITE" .whl/*.whl 2>&1 | grep -v WARNING || true
export PYTHONPATH="$SITE"
N=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$WORK/device.txt"
# A local corpus (no registry, no hub): the interpreter's own standard library as text.
STDLIB=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
FILES=$(find "$STDLIB" -maxdepth 2 -name "*.py" -size +8k | sort | head -400 | python3 -c \
  "import sys, json; print(json.dumps([l.strip() for l in sys.stdin]))")
COMMON=(--config configs/bench-50m.yaml "dataset={files: $FILES}" vocab_size=8192 max_steps=${STEPS:-30}
        eval_every=10 eval_batches=2 checkpoint_every=10 "trackers=[]" compile=false)
GLOBAL_BATCH=${GLOBAL_BATCH:-32}

launch() {  # launch <accelerate config> <processes> <output dir> [overrides...]
  local cfg=$1 n=$2 dir=$3; shift 3
  python3 -P -m accelerate.commands.launch --config_file "configs/accelerate/$cfg.yaml" --num_processes "$n" \
    --main_process_port $((29500 + RANDOM % 1000)) scripts/pretrain.py "${COMMON[@]}" \
    batch_size=$((GLOBAL_BATCH / n)) output_dir="$dir" "$@" > "$dir.log" 2>&1
}

compare() {  # compare <reference run> <runs...>: the largest relative loss difference per run, and the first steps
  python3 - "$@" <<'EOF'
import json, sys
from pathlib import Path
def losses(d):
    return {r["step"]: r["loss"] for r in map(json.loads, Path(d, "metrics.jsonl").read_text().splitlines()) if "loss" in r}
ref = losses(sys.argv[1])
for run in sys.argv[2:]:
    try:
        got = losses(run)
    except FileNotFoundError:
        print(f"{run}: no metrics (see {run}.log)"); continue
    common = sorted(set(ref) & set(got))
    rel = max(abs(got[s] - ref[s]) / abs(ref[s]) for s in common)
    same = sum(got[s] == ref[s] for s in common)
    print(f"{run}: {len(common)} steps, {same} bit-equal, max relative loss difference {rel:.2e}; "
          f"first: {[(ref[s], got[s]) for s in common[:3]]}")
EOF
}

case "${STAGE:-losses}" in
losses)
  for r in ${RECIPES:-bf16 nvfp4 mxfp4_dh ufp4}; do
    launch single_gpu 1 "$WORK/$r-1gpu" recipe=$r
    launch ddp "$N" "$WORK/$r-ddp" recipe=$r
    launch fsdp2 "$N" "$WORK/$r-fsdp2" recipe=$r
    runs=("$WORK/$r-ddp" "$WORK/$r-fsdp2")
    if [ "$r" != bf16 ]; then
      launch fsdp2 "$N" "$WORK/$r-fsdp2-fp4ag" recipe=$r fp4_all_gather=true
      runs+=("$WORK/$r-fsdp2-fp4ag")
    fi
    echo "== $r: against 1 GPU, global batch $GLOBAL_BATCH"
    compare "$WORK/$r-1gpu" "${runs[@]}" | tee -a "$WORK/losses.txt"
    [ "$r" != bf16 ] && compare "$WORK/$r-fsdp2" "$WORK/$r-fsdp2-fp4ag" | sed 's/^/fp4 all-gather vs bf16 all-gather: /' \
      | tee -a "$WORK/losses.txt"
  done ;;
resume)
  r=${RECIPE:-nvfp4}
  launch fsdp2 "$N" "$WORK/resume-full" recipe=$r ${FP4AG:+fp4_all_gather=true}
  launch fsdp2 "$N" "$WORK/resume-cut" recipe=$r ${FP4AG:+fp4_all_gather=true} &
  pid=$!
  until [ "$(grep -c '"loss"' "$WORK/resume-cut/metrics.jsonl" 2>/dev/null || echo 0)" -ge "${KILL_AT:-25}" ] \
      || ! kill -0 $pid 2>/dev/null; do sleep 1; done
  pkill -KILL -f "output_dir=$WORK/resume-cut" ; wait $pid
  echo "killed after $(grep -c '"loss"' "$WORK/resume-cut/metrics.jsonl") steps" | tee "$WORK/resume.txt"
  launch fsdp2 "$N" "$WORK/resume-cut" recipe=$r ${FP4AG:+fp4_all_gather=true} --resume
  compare "$WORK/resume-full" "$WORK/resume-cut" | tee -a "$WORK/resume.txt" ;;
bench)
  for n in ${GPUS:-1 $N}; do
    timeout "${BENCH_TIMEOUT:-500}" python3 -P -m torch.distributed.run --nproc_per_node "$n" scripts/bench_fsdp.py \
      --model "${MODELS:-bench-50m,llama-1b}" --out "$WORK/benchmarks" --impls "${IMPLS:-bf16,hf_fp4:nvfp4,\
hf_fp4:nvfp4+fp4ag,hf_fp4:mxfp4_dh,hf_fp4:mxfp4_dh+fp4ag,hf_fp4:ufp4,hf_fp4:ufp4+fp4ag,torchao_fp8_tensorwise,\
torchao_fp8_tensorwise+fp8ag}" > "$WORK/bench-$n.log" 2>&1
    tail -3 "$WORK/bench-$n.log"
  done
  cat "$WORK"/benchmarks/*.md ;;
tests)
  python3 -P -m pytest -q -p no:cacheprovider tests/test_kernels.py -k second_gpu 2>&1 | tee "$WORK/tests.txt" ;;
esac
cd "$WORK" && tar czf "$OUT/multi_gpu.tgz" --ignore-failed-read device.txt *.txt *.log benchmarks */metrics.jsonl \
  2>/dev/null
