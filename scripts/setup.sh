#!/usr/bin/env bash
# Create .venv (idempotent): the pinned CPU torch first, so nothing pulls a multi-GB CUDA build,
# then hf_fp4 in editable mode with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q "torch==${HF_FP4_TORCH:-2.13.0}"
fi
# setuptools' advice banners about editable installs (UserWarnings of the build backend) are not for our users
PYTHONWARNINGS="ignore::UserWarning" .venv/bin/pip install -q -e ".[test,plot,tensorboard,eval]"
