"""Every Triton kernel variant of the operand, SharQ and attention kernels compiles for Hopper (sm_90) -- on the CPU,
through Triton's own compiler (tests/hopper_compile.py, in a subprocess without TRITON_INTERPRET).  The
interpreter accepts programs the compiler rejects (a loop-carried variable changing type, say), so without
this a GPU session would find them first.  What the kernels compute is tested elsewhere (under the
interpreter here, on the GPU by scripts/gpu_check.sh)."""
import os
import subprocess
import sys
from pathlib import Path

from hf_fp4.train.corpus import usable_cores


def test_the_kernels_compile_for_hopper():
    """The variants in one shard per CPU core (at most 4), side by side: the compiles are single-threaded."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    shards = max(1, min(4, usable_cores()))
    script = str(Path(__file__).with_name("hopper_compile.py"))
    procs = [subprocess.Popen([sys.executable, script, str(i), str(shards)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(shards)]
    lines = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        shard_lines = out.splitlines()
        assert proc.returncode == 0 and shard_lines and shard_lines[-1] == "failures 0", \
            "\n".join(l for l in shard_lines if l.startswith("FAIL")) or err[-3000:]
        lines += shard_lines
    assert sum(line.startswith("ok ") for line in lines) >= 30  # every variant was built
    # enable_fp_fusion=False is honoured: some kernel launched with it has FMAs that fusion on would add (the FMAs
    # left with it off are the kernels' own tl.fma calls; hopper_compile.py checks there are no more than fused)
    assert sum(int(line.split()[1]) for line in lines if line.startswith("contracted ")) > 0
