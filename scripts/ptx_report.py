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
import dataclasses
import inspect
import re
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hf_fp4 import QuantSpec
from hf_fp4.kernels import operand as K
from hf_fp4.numerics.operand_plan import OperandPlan

SIZES = ("R", "C", "s_r", "a_rows", "a_cols", "b_rows", "b_cols", "a_kp", "b_kp")


def plan(name: str, form: str, hadamard: int = 0, signed: bool = False, sr: bool = False) -> OperandPlan:
    spec = QuantSpec.preset(name)
    if sr:
        spec = dataclasses.replace(spec, rounding="stochastic")
    return OperandPlan(spec, hadamard, signed, form, max(16, spec.block[1], hadamard))


CASES = {
    "mxfp4-rows-fp8": (plan("mxfp4", "fp8"), None),
    "mxfp4-both-fp8": (plan("mxfp4", "fp8"), plan("mxfp4", "fp8")),
    "nvfp4-rows-bf16": (plan("nvfp4", "bf16"), None),
    "nvfp4-cols-bf16": (None, plan("nvfp4", "bf16")),
    "nvfp4-both-bf16-sr-rht16": (plan("nvfp4", "bf16"), plan("nvfp4", "bf16", 16, True, True)),
}


def pointer_types(a: OperandPlan | None, b: OperandPlan | None) -> dict[str, str]:
    types = {"t_ptr": "*bf16", "mu_ptr": "*fp32"}
    for prefix, p in (("a_", a), ("b_", b)):
        fp8 = p is not None and p.form == "fp8"
        types.update({prefix + "out": "*u8" if fp8 else "*bf16", prefix + "stat": "*fp32",
                      prefix + "scale": "*fp32", prefix + "seed": "*i64", prefix + "signs": "*fp32",
                      prefix + "side": "*u8", prefix + "eb": "*i8", prefix + "flags": "*i8"})
    return types


def compile_variant(a, b):
    (br, bc, warps, *reload), _, consts, _ = K._launch_config((a, b), None)
    constexprs = dict(BR=br, BC=bc, HAS_MU=False, EVEN=True, INTERPRETED=False, RELOAD=bool(reload and reload[0]),
                      s_c=1, **consts)
    params = list(inspect.signature(K._operand_kernel.fn).parameters)
    types = pointer_types(a, b)
    signature = {p: "constexpr" if p in constexprs else types.get(p, "i32") for p in params}
    divisible = {(params.index(p),): [["tt.divisibility", 16]] for p in params
                 if p not in constexprs and (signature[p].startswith("*") or p in SIZES)}
    src = ASTSource(K._operand_kernel, signature, {(params.index(p),): v for p, v in constexprs.items()}, divisible)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}), (br, bc, warps)


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
    for label, (a, b) in CASES.items():
        compiled, (br, bc, warps) = compile_variant(a, b)
        ptx = compiled.asm["ptx"]
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / f"{label}.ptx").write_text(ptx)
        print(f"| {label} | {br}x{bc}, {warps} | {compiled.metadata.shared} | {len(re.findall('bar.sync', ptx))} | "
              f"{', '.join(f'{k} {v}' for k, v in accesses(ptx).items())} |")


if __name__ == "__main__":
    main()
