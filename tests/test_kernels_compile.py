"""Every Triton kernel variant of the operand, SharQ and attention kernels compiles for Hopper (sm_90) -- on the CPU,
through Triton's own compiler (tests/hopper_compile.py, in a subprocess without TRITON_INTERPRET).  The
interpreter accepts programs the compiler rejects (a loop-carried variable changing type, say), so without
this a GPU session would find them first.  What the kernels compute is tested elsewhere (under the
interpreter here, on the GPU by scripts/gpu_check.sh)."""
import os
import subprocess
import sys
from pathlib import Path


def test_the_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("hopper_compile.py"))], env=env,
                         capture_output=True, text=True, timeout=900)
    lines = run.stdout.splitlines()
    assert run.returncode == 0 and lines[-1] == "failures 0", "\n".join(l for l in lines if l.startswith("FAIL"))
    assert sum(line.startswith("ok ") for line in lines) >= 30  # every variant was built
