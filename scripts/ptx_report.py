#!/usr/bin/env python
"""What the operand kernel compiles to for Hopper, read on the CPU (no device time): per variant, the tile, the
shared memory, the barriers and the width of every global / shared load and store in the PTX.

    TRITON_DEFAULT_FP_FUSION=1 python scripts/ptx_report.py [--out DIR]   (without TRITON_INTERPRET)

The launch is specialised as the GPU's JIT specialises a contiguous 8192 x 8192 call (the column stride a
constant 1, pointers and sizes divisible by 16), so the access widths are the ones the GPU runs.  Measured
here on 2026-12-02 (Triton 3.9): every variant loads and stores global memory 16 bytes per access
(ld/st.global.v4.32); the dual-orientation FP8 variant (x: fprop and wgrad operands) spends 37 barriers and
byte-wide shared-memory stores on its layout conversions -- where to point ncu first.
"""
import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hopper_compile import OPERAND_CASES, compile_for_hopper, operand_kernel_args  # noqa: E402

from hf_fp4.kernels import operand as K  # noqa: E402


def accesses(ptx: str) -> dict[str, int]:
    count = collections.Counter()
    for kind, space, mods in re.findall(r"\b(ld|st)\.(global|shared)((?:\.\w+)*)", ptx):
        vec, width = re.search(r"\.v(\d)", mods), re.search(r"\.[bufs](\d+)", mods)
        count[f"{kind}.{space}.v{vec.group(1) if vec else 1}.{width.group(1) if width else '?'}"] += 1
    return dict(sorted(count.items()))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="also write each variant's PTX here")
    args = parser.parse_args()
    print("| variant | tile (rows x cols, warps) | shared B | barriers | accesses |")
    print("|---|---|---|---|---|")
    for label, (a, b) in OPERAND_CASES.items():
        types, constexprs, warps, divisible = operand_kernel_args(a, b)
        compiled = compile_for_hopper(K._operand_kernel, types, constexprs, warps, divisible)
        br, bc = constexprs["BR"], constexprs["BC"]
        ptx = compiled.asm["ptx"]
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / f"{label}.ptx").write_text(ptx)
        print(f"| {label} | {br}x{bc}, {warps} | {compiled.metadata.shared} | {len(re.findall('bar.sync', ptx))} | "
              f"{', '.join(f'{k} {v}' for k, v in accesses(ptx).items())} |")


if __name__ == "__main__":
    main()
