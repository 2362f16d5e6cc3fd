#!/usr/bin/env bash
# A study on a lent GPU machine whose calls last minutes: the study runs detached (setsid) from an installed
# copy, so it outlives a call while the machine stays warm; each call waits up to WAIT seconds, then copies the
# runs' metrics (no weights) to $OUT/study.tgz.  Unpack that into benchmarks/study-<name>/ here and commit:
# finished runs are skipped by the next start (their result.json travels with the repository).
# Here, once:  python -c "from hf_fp4.files import cache_dir; from hf_fp4.train.data import builtin_corpus; from hf_fp4.train.corpus import fetch_debs
#   builtin_corpus(); fetch_debs(cache_dir() / 'archives')"
#   mkdir -p .carry && tar cJf .carry/hf_fp4-cache.tar.xz -C ~/.cache/hf_fp4 corpus archives
#   .venv/bin/pip wheel -q --no-deps -w .carry .
# Device, carry [".carry"]:
#   STUDY=configs/study/fp4-recipes-large.yaml WAIT=500 bash scripts/device_study.sh start   [PARALLEL=n] [ONLY=label,...]
#   (PARALLEL defaults to 1: on 2026-12-01 three runs sharing the H200 by time-slicing (one of them an MX run in
#   its since-fixed slow correction) trained bf16 at 239k and
#   nvfp4 at 150k tokens/s each -- bf16 alone benchmarks at ~812k: together they were slower than in turn)
#   WAIT=580 bash scripts/device_study.sh watch          (next calls, each within the machine's idle window)
#   bash scripts/device_study.sh stop                     (the study and its runs; unfinished runs resume next start
#   on the same machine, from their last checkpoint)
#   STUDY=... bash scripts/device_study.sh prep   [ONLY=...]  at the start of a call whose work is GPU-bound: the
#   ~2 minutes of corpus tokenisation run on the machine's CPUs (niced, detached); start waits for it.  Not beside
#   host-bound timings: in session 20 it slowed bench.py's eager and graph-tree linear rows (eager nvfp4 at 4096^2
#   2.84 ms against 2.19 in session 19); the captured rows and the e2e part with CUDA graphs are GPU-bound
#   After a benchmark in the same call (session 19: gpu_check.sh bench, then start with WAIT=$((585-SECONDS))),
#   carry [".whl", ".carry"] with .whl holding only torchao's and hf_fp4's wheels: the full .whl (23 MB) and
#   .carry (55 MB) exceed the 64 MiB a call carries.  Alone on the GPU each run of fp4-recipes-large trains at
#   430-465k tokens/s (~5 minutes), after ~2 minutes of corpus preparation per machine.
# Back here (the venv's python on PATH): bash scripts/device_study.sh unpack <files_at>/study.tgz configs/study/<name>.yaml
#   (finished runs -> benchmarks/study-<name>/runs/, unfinished ones -> interrupted/, logs without progress bars,
#    then table.md, results.json and the plots)
set -uo pipefail
what=${1:-watch}
ROOT=${STUDY_ROOT:-/root/hf_fp4_study}
OUT=${OUT:-/tmp/out}
export HF_FP4_CACHE=$ROOT/cache PYTHONPATH=$ROOT/site PYTHONUNBUFFERED=1
if [ "$what" = unpack ]; then
  tgz=${2:?study.tgz}; study=${3:?configs/study/<name>.yaml}
  name=$(python -c "import yaml; print(yaml.safe_load(open('$study'))['name'])")
  dest=benchmarks/study-$name tmp=$(mktemp -d)
  tar xzf "$tgz" -C "$tmp"
  for run in "$tmp"/runs/*/; do
    r=$(basename "$run")
    if [ -f "$run/result.json" ]; then mkdir -p "$dest/runs"; rm -rf "$dest/runs/$r"; cp -r "$run" "$dest/runs/$r"
    else mkdir -p "$dest/interrupted"; rm -rf "$dest/interrupted/$r"; cp -r "$run" "$dest/interrupted/$r"; fi
  done
  mkdir -p "$dest/logs"
  for log in "$tmp"/logs/*.log; do  # about 25 progress lines and the last (a run of session 35's code and
    # later writes one every 30 s -- all kept; earlier runs wrote one per step: every n-th)
    n=$(tr '\r' '\n' < "$log" | grep -c '^train: ')
    every=$(( n / 25 > 1 ? n / 25 : 1 ))
    tr '\r' '\n' < "$log" | awk -v every="$every" '/^train: /{last=$0; if (++i % every == 0) print; next} {print}
      END{if (i % every) print last}' > "$dest/logs/$(basename "$log")"
  done
  # the study process's own log (which runs started and finished), beside study.tgz in the call's files
  # (a second unpack on the same day gets its own file: the day's earlier log is never overwritten)
  day_log="$dest/logs/study-$(date -u +%F).log"; n=2
  while [ -e "$day_log" ]; do day_log="$dest/logs/study-$(date -u +%F)-$n.log"; n=$((n + 1)); done
  [ -f "$(dirname "$tgz")/study.log" ] && cp "$(dirname "$tgz")/study.log" "$day_log"
  rm -rf "$tmp"
  exec python -m hf_fp4 study "$study" --summary-only
fi
mkdir -p "$OUT" "$ROOT"
# the study process, matched from the start of its command line: the call's own shell holds this script's whole
# command, and an unanchored "prepare-only" matched it (session 20: start waited on itself until the call's limit)
STUDY_PROCESS="^python3 -P -m hf_fp4 study"
PREP_PROCESS="$STUDY_PROCESS .*--prepare-only"
if [ "$what" = stop ]; then  # the study and its runs under $ROOT (session 35: `pkill -f "hf_fp4 study"` matched the
  # call's own shell, whose command line holds that text, and ended the call at once; these patterns are anchored, and
  # name $ROOT: the study's --out and its runs' --config lie there)
  ours="$STUDY_PROCESS .*--out $ROOT/"
  pkill -f "$ours"
  pkill -f "^[^ ]*python3? -m hf_fp4 pretrain --config $ROOT/"
  sleep 3
  pgrep -f "$ours" > /dev/null && echo "the study is still running" || echo "study stopped"
  exit 0
fi
if [ "$what" = prep ] || [ "$what" = start ]; then
  STUDY=${STUDY:?STUDY=configs/study/<name>.yaml}
  name=$(python3 -c "import yaml,sys; print(yaml.safe_load(open('$STUDY'))['name'])")
  # each study in a folder of its own: two studies on one machine share run names (nvfp4-s0), and session 25's
  # second study there unpacked the first one's logs as its own
  mkdir -p "$HF_FP4_CACHE" "$ROOT/study-$name"
  if [ ! -f "$ROOT/installed" ]; then
    tar xJf .carry/hf_fp4-cache.tar.xz -C "$HF_FP4_CACHE"
    python3 -m pip install -q --no-index --no-deps --target "$ROOT/site" .carry/hf_fp4-*.whl
    touch "$ROOT/installed"
  fi
  cp -r configs "$ROOT/"
  # the finished runs (skipped there), not the logs: the logs that come back are this machine's alone, so that
  # unpack never filters a committed log twice (session 19 lost the progress lines of four that way)
  [ -d "benchmarks/study-$name/runs" ] && cp -r "benchmarks/study-$name/runs" "$ROOT/study-$name/"
  echo "$name" > "$ROOT/name"
fi
if [ "$what" = prep ]; then  # the corpus on the CPUs (niced) while a benchmark has the GPU; start waits for it
  (cd "$ROOT" && setsid nohup nice -n 10 python3 -P -m hf_fp4 study "$STUDY" --out "$ROOT/study-$name" --prepare-only \
     ${ONLY:+--only "$ONLY"} > "$ROOT/prep.log" 2>&1 < /dev/null &)
  exit 0
fi
# WAIT counts from here, the wait for a running prep included (session 33: counted after it, a call's WAIT of
# LIMIT - 25 s ran past the call's limit and no file came back)
deadline=$((SECONDS + ${WAIT:-540}))
if [ "$what" = start ]; then
  while [ $SECONDS -lt $deadline ] && pgrep -f "$PREP_PROCESS" > /dev/null; do sleep 5; done
  [ -f "$ROOT/prep.log" ] && tail -3 "$ROOT/prep.log"
  if pgrep -f "$PREP_PROCESS" > /dev/null; then
    echo "the corpus preparation is still running at WAIT: start again in the next call"
  else
    date -u +"%F %T start" > "$ROOT/study.log"
    (cd "$ROOT" && setsid nohup python3 -P -m hf_fp4 study "$STUDY" --out "$ROOT/study-$name" --parallel "${PARALLEL:-1}" \
       ${ONLY:+--only "$ONLY"} >> "$ROOT/study.log" 2>&1 < /dev/null &)
  fi
fi
while [ $SECONDS -lt $deadline ] && pgrep -f "$STUDY_PROCESS" > /dev/null; do sleep 10; done
# the study of the last start or prep on this machine, or NAME=<study name> (two studies under one STUDY_ROOT)
cd "$ROOT/study-${NAME:-$(cat "$ROOT/name" 2>/dev/null)}" 2>/dev/null && tar czf "$OUT/study.tgz" --ignore-failed-read \
  $(ls -d runs/*/metrics.jsonl runs/*/run_info.json runs/*/result.json runs/*/train_config.yaml logs 2>/dev/null)
cp "$ROOT/study.log" "$OUT/" 2>/dev/null
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader > "$OUT/gpu.txt"
# what the runs' processes are doing (session 32: five runs sat 15 minutes before touching the GPU -- CPU-bound
# LoRA-SVD splits under thread oversubscription -- and only the GPU's 0% said so)
ps -eo pid,pcpu,nlwp,etime,args --sort=-pcpu | grep -E "hf_fp4 (study|pretrain)" | grep -v grep | head -12 > "$OUT/ps.txt"
pgrep -f "$STUDY_PROCESS" > /dev/null && echo "study still running" || echo "study process ended"
tail -20 "$ROOT/study.log"
