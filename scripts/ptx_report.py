#!/usr/bin/env python
"""What the operand, stats, grouped-GEMM and attention-backward kernels compile to for Hopper, read on the CPU (no
device time): per variant, the
tile, the TTGIR layout conversions (each a round trip through shared memory), the shared memory, the barriers,
the registers and stack of the sm_90 cubin, its SASS instructions per tile element a thread holds (a static count:
a loop body once, so an upper bound on straight-line kernels' issue work and a lower one where a program walks
several tiles), its correctly rounded divisions (FCHK: each a ~10-instruction sequence), and the width of every
global / shared load and store in the PTX.

    python scripts/ptx_report.py [--out DIR] [--only SUBSTRING ...]   (without TRITON_INTERPRET)

The launch is specialised as the GPU's JIT specialises a contiguous 8192 x 8192 call (the column stride a
constant 1, pointers and sizes divisible by 16), so the access widths are the ones the GPU runs.  The GPU image
runs Triton 3.6: put a Triton 3.6 install first on PYTHONPATH to read its code (the numbers differ from 3.9's).
Measured here on 2026-12-04 with Triton 3.6, once B's rotation runs across row tiles (kernels/src/operand.py:
_stats_across, _emit_across): the stats pass of NVFP4's x / dy (tensor amax both ways, RHT-16 on the wgrad
orientation) went from 6 conversions, 16 KiB of shared memory and 128 registers to none, 2 KiB and 75; the operand
pass of NVFP4's x from 5 conversions and 11 barriers to 1 and 1; mxfp4_dh's x (H-32) from 21 conversions, 41
barriers and an 8-byte stack to 11, 25 and none.
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hopper_compile import (GROUPED_OPERAND_CASES, OPERAND_CASES, backward_cases,  # noqa: E402
                            compile_for_hopper, divisible_args, group_stats_kernel_args, grouped_gemm_cases,
                            operand_kernel_args, operand_plan, resources, stats_kernel_args)

from hf_fp4.kernels import operand as K  # noqa: E402

#: Pairs beyond hopper_compile's: x of ufp4 (RHT-16 both ways), NVFP4's wgrad operand alone.
EXTRA_CASES = {
    "ufp4-both-bf16-rht16": (operand_plan("ufp4", "bf16", 16, True), operand_plan("ufp4", "bf16", 16, True, True)),
    "nvfp4-cols-bf16-rht16": (None, operand_plan("nvfp4", "bf16", 16, True)),
}


def accesses(ptx: str) -> dict[str, int]:
    count = collections.Counter()
    for kind, space, mods in re.findall(r"\b(ld|st)\.(global|shared)((?:\.\w+)*)", ptx):
        vec, width = re.search(r"\.v(\d)", mods), re.search(r"\.[bufs](\d+)", mods)
        count[f"{kind}.{space}.v{vec.group(1) if vec else 1}.{width.group(1) if width else '?'}"] += 1
    return dict(sorted(count.items()))


def sass_mix(cubin: bytes) -> collections.Counter:
    """Opcode counts of a cubin's SASS (static: a loop body once), from the nvdisasm that Triton bundles."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
        out = subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True).stdout
    return collections.Counter(m.group(1).split(".")[0] for m in re.finditer(
        r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", out, re.M))


def variants():
    for label, (a, b) in {**OPERAND_CASES, **EXTRA_CASES}.items():
        yield f"operand {label}", K._operand_kernel, *operand_kernel_args(a, b)
        if any(p is not None and p.stat for p in (a, b)):
            yield f"stats {label}", K._stats_kernel, *stats_kernel_args(a, b)
    for label, (a, b) in GROUPED_OPERAND_CASES.items():  # rows in groups (the grouped expert GEMMs)
        yield f"grouped-operand {label}", K._operand_kernel, *operand_kernel_args(a, b, grouped=True)
        if any(p is not None and p.stat for p in (a, b)):
            yield f"grouped-stats {label}", K._group_stats_kernel, *group_stats_kernel_args(a, b)
    for label, kernel, types, constexprs, warps, divisible in grouped_gemm_cases():
        yield label, kernel, types, constexprs, warps, divisible
    # the flash-attention backward's dS-amax, dQ and dK / dV phases on the tensor cores, per tile (flash_backward
    # takes a tile per phase): a stack frame is spilled registers.  Specialised as bench.py's attention call: causal
    # without a keep mask, pointers and the sizes and strides that are multiples of 16 known so (session 29: without
    # that, the report read scalar 16-bit loads and their address arithmetic, which the GPU does not run)
    for label, kernel, types, constexprs, _ in backward_cases():
        if "-tc1" in label and constexprs["PHASE"] > 0:
            divisible = divisible_args(kernel, types, constexprs, ATTENTION_SIZES)
            for rows, keys, warps in ATTENTION_TILES:
                yield (f"{label} {rows}x{keys}", kernel, types,
                       {**constexprs, "BM": rows, "BN": keys, "HAS_KEEP": False}, warps, divisible)


#: (queries, keys, warps) of the backward phases' tiles the report compiles (phase 3 computes its tile transposed:
#: keys are S^T's rows, and fewer than 64 take mma.sync rather than wgmma -- HMMA against HGMMA in the SASS mix)
ATTENTION_TILES = ((64, 32, 4), (32, 64, 4), (64, 64, 4), (64, 64, 8), (128, 64, 8))
#: the attention backward's integer arguments that are multiples of 16 at bench.py's shape (B1 H32 GQA 8 T4096)
ATTENTION_SIZES = ("H", "TQ", "TK", "TQ_ROWS", "TK_ROWS", "KP_Q", "KP_K", "sm_b", "sm_h", "sm_q", "sm_k")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="also write each variant's PTX and TTGIR here")
    parser.add_argument("--only", nargs="*", default=None, help="variants whose label holds one of these")
    args = parser.parse_args()
    print(f"Triton {triton.__version__}, sm_90")
    print("| variant | tile (rows x cols, warps) | conversions | shared B | barriers | registers | stack | SASS / element "
          "| divisions | accesses |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, kernel, types, constexprs, warps, divisible in variants():
        if args.only and not any(o in label for o in args.only):
            continue
        compiled = compile_for_hopper(kernel, types, constexprs, warps, divisible)
        ptx, ttgir = compiled.asm["ptx"], compiled.asm["ttgir"]
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / f"{label.replace(' ', '-')}.ptx").write_text(ptx)
            (Path(args.out) / f"{label.replace(' ', '-')}.ttgir").write_text(ttgir)
        regs, stack = resources(compiled.asm["cubin"])
        # a program's tile: BM x BN where a kernel has one (the GEMMs, the attention backward), else the block's
        rows, cols = ((constexprs["BM"], constexprs["BN"]) if "BM" in constexprs
                      else (constexprs["BR"], constexprs["BC"]))
        mix = sass_mix(compiled.asm["cubin"])
        per_element = sum(mix.values()) / (rows * cols / (warps * 32))  # static count over a tile's elements a thread
        print(f"| {label} | {rows}x{cols}, {warps} | {ttgir.count('ttg.convert_layout')} | "
              f"{compiled.metadata.shared} | {len(re.findall('bar.sync', ptx))} | {regs} | {stack} | "
              f"{per_element:.1f} | {mix['FCHK']} | {', '.join(f'{k} {v}' for k, v in accesses(ptx).items())} |",
              flush=True)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("ptx_report.py compiles for sm_90: run it without TRITON_INTERPRET")
    main()
