#!/usr/bin/env python
"""Registers and spills of the flash-attention backward kernels per tile, compiled for sm_90a here (no GPU needed):
Triton compiles the kernel to PTX for an H100/H200 target and its bundled ptxas reports the register use.

    python scripts/kernel_registers.py [--tiles 64x32x4,64x32x8,64x64x8] [--phases 1,2,3]

A proxy to read before timing on the device: a kernel that spills (stack frame, spill stores) at a tile runs slower
there.  The Triton here may be newer than the GPU image's (its counts differ a little); compare tiles and variants
side by side in one run.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

import triton.backends.nvidia as nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler import compile as triton_compile

from hf_fp4 import QuantSpec
from hf_fp4.kernels import attention
from hf_fp4.kernels.numerics import grid_constants
from hf_fp4.kernels.quant import SCALE_CODES

# the backward kernels' pointer arguments (BF16 operands on the tensor cores' path); every other argument is an int
POINTERS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "dec_ptr": "*fp32", "do_ptr": "*bf16",
            "delta_ptr": "*fp32", "lse_ptr": "*fp32", "stat_ptr": "*fp32", "keep_ptr": "*i8", "dq_ptr": "*fp32",
            "dk_ptr": "*fp32", "dv_ptr": "*fp32", "dbg_ptr": "*fp32", "scale": "fp32"}
KERNELS = {1: ("dS amax", attention._dq_kernel), 2: ("dQ", attention._dq_kernel), 3: ("dK/dV", attention._dkdv_kernel)}


def ptxas_report(phase: int, rows: int, keys: int, warps: int, stages: int = 3, spec: str = "nvfp4") -> str:
    """ptxas -v's registers and spills of one backward phase at one tile (causal, no mask, D 128, the spec's dS)."""
    ds = QuantSpec.preset(spec)
    grid = grid_constants(ds.grid)
    grid.pop("EMIN", None)
    grid.pop("MBITS", None)
    br, bc = ds.block
    consts = dict(BM=rows, BN=keys, D=128, HAS_KEEP=False, CAUSAL=True, PHASE=phase, QUANT=True, SQUARE=br == bc,
                  BR=br, BC=bc, **grid, SCALE=SCALE_CODES[ds.scale], SR=False, DEBUG=False, TC=True,
                  INTERPRETED=False)
    kernel = KERNELS[phase][1]
    signature = {n: "constexpr" if n in consts else POINTERS.get(n, "i32") for n in kernel.arg_names}
    compiled = triton_compile(ASTSource(kernel, signature, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages, enable_fp_fusion=False))
    bin_dir = os.path.join(os.path.dirname(nvidia.__file__), "bin")
    # the newest bundled ptxas reads the PTX version Triton writes
    ptxas = next(os.path.join(bin_dir, p) for p in ("ptxas-blackwell", "ptxas") if os.path.exists(os.path.join(bin_dir, p)))
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.devnull], capture_output=True, text=True)
    lines = [line.split("info    : ")[-1].strip() for line in out.stderr.splitlines()
             if "registers" in line or "spill" in line]
    return " | ".join(lines) or out.stderr.strip()[-300:]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tiles", default="64x32x4,64x32x8,64x64x8,32x64x4,128x32x8", help="rows x keys x warps, comma list")
    p.add_argument("--phases", default="1,2,3", help="1 dS amax, 2 dQ, 3 dK/dV")
    p.add_argument("--spec", default="nvfp4", help="dS's preset (nvfp4: 1x16 blocks; nvfp4_2d: 16x16 tiles)")
    args = p.parse_args()
    for phase in (int(x) for x in args.phases.split(",")):
        for tile in args.tiles.split(","):
            rows, keys, warps = (int(v) for v in tile.split("x"))
            print(f"{KERNELS[phase][0]} {tile}: {ptxas_report(phase, rows, keys, warps, spec=args.spec)}", flush=True)


if __name__ == "__main__":
    main()
