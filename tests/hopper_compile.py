"""Compile the Triton kernel variants the GPU runs for Hopper (sm_90) on this machine, with Triton's own compiler
(PTX and a cubin through the bundled ptxas) -- not its interpreter, so run it without TRITON_INTERPRET:

    python tests/hopper_compile.py [SHARD SHARDS]   # one line per variant, "ok" or "FAIL ...", then the failure count

tests/test_kernels_compile.py runs it in a subprocess."""
import dataclasses
import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hf_fp4 import QuantSpec
from hf_fp4.kernels import attention, bf16_gemm, gemm, grouped_gemm, operand, optim, sharq
from hf_fp4.kernels.numerics import grid_constants
from hf_fp4.kernels.quant import SCALE_CODES
from hf_fp4.numerics.operand_plan import OperandPlan


#: Kernels launched with enable_fp_fusion=False (kernels/src/attention.py: every product and sum rounded on its own).
UNFUSED = (attention._flash_forward_kernel, attention._lse_kernel, attention._dq_kernel, attention._dkdv_kernel,
           optim._fp4_adamw_kernel)


def compile_for_hopper(kernel, types: dict, constexprs: dict, num_warps: int = 4, divisible=(), fp_fusion=None):
    """sm_90 PTX and cubin; `divisible`: the arguments the GPU's JIT would mark divisible by 16 (pointers and
    sizes of an aligned launch), so that the code is the one the GPU runs; fp_fusion: as launched (off for
    UNFUSED) unless given."""
    params = list(inspect.signature(kernel.fn).parameters)
    signature = {p: ("constexpr" if p in constexprs else types.get(p, "i32")) for p in params}
    values = {(params.index(p),): v for p, v in constexprs.items()}
    attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in divisible}
    return triton.compile(ASTSource(kernel, signature, values, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps,
                                   "enable_fp_fusion": kernel not in UNFUSED if fp_fusion is None else fp_fusion})


def operand_plan(name: str, form: str, hadamard: int = 0, signed: bool = False, sr: bool = False) -> OperandPlan:
    spec = QuantSpec.preset(name)
    if sr:
        spec = dataclasses.replace(spec, rounding="stochastic")
    return OperandPlan.single(spec, form, hadamard, signed)


#: The operand kernel's main variants (x of an MX recipe both ways, NVFP4 rows / columns / both with SR + RHT).
OPERAND_CASES = {
    "mxfp4-rows-fp8": (operand_plan("mxfp4", "fp8"), None),
    "mxfp4-both-fp8": (operand_plan("mxfp4", "fp8"), operand_plan("mxfp4", "fp8")),
    "mxfp4-both-bf16": (operand_plan("mxfp4", "bf16"), operand_plan("mxfp4", "bf16")),
    "nvfp4-rows-bf16": (operand_plan("nvfp4", "bf16"), None),
    "nvfp4-cols-bf16": (None, operand_plan("nvfp4", "bf16")),
    "nvfp4-both-bf16-sr-rht16": (operand_plan("nvfp4", "bf16"), operand_plan("nvfp4", "bf16", 16, True, True)),
    # B across row tiles (operand._emit_across / _stats_across): nvfp4's x, mxfp4_dh's x
    "nvfp4-both-bf16-rht16": (operand_plan("nvfp4", "bf16"), operand_plan("nvfp4", "bf16", 16, True)),
    "mxfp4-both-fp8-h32": (operand_plan("mxfp4", "fp8"), operand_plan("mxfp4", "fp8", 32)),
    # NVFP4's weight pair: 16 x 16 blocks, both orientations from one quantization (fprop and dgrad)
    "nvfp4_2d-both-bf16": (operand_plan("nvfp4_2d", "bf16"), operand_plan("nvfp4_2d", "bf16")),
}
#: Operand variants known to keep a stack frame (spilled registers) with Triton 3.6 and 3.9: the grouped H-64
#: rotation of a 64 x 64 tile at 255 registers (144 / 192 bytes).  Every other operand variant has none.
STACK_KNOWN = ("grouped-operand-nvfp4-cols-bf16-sr-h64",)
SIZES = ("R", "C", "s_r", "a_rows", "a_cols", "b_rows", "b_cols", "a_kp", "b_kp")


def divisible_args(kernel, types: dict, constexprs: dict, sizes=SIZES) -> list[str]:
    """The arguments the GPU's JIT marks divisible by 16 at an aligned launch: the pointers and the named sizes."""
    return [p for p in inspect.signature(kernel.fn).parameters
            if p not in constexprs and (types.get(p, "").startswith("*") or p in sizes)]


def operand_kernel_args(a: OperandPlan | None, b: OperandPlan | None, grouped: bool = False):
    """(types, constexprs, warps, divisible) of the operand kernel for a contiguous, 16-aligned launch (the
    column stride a constant 1, as the JIT specialises it); grouped: rows in groups (the grouped expert GEMMs)."""
    (br, bc, warps, *reload), _, consts, _ = operand._launch_config((a, b), None)
    constexprs = dict(BR=br, BC=bc, HAS_MU=False, EVEN=True, INTERPRETED=False, RELOAD=bool(reload and reload[0]),
                      GROUPED=grouped, s_c=1, **consts)
    types = {"t_ptr": "*bf16", "mu_ptr": "*fp32", "grp_ids": "*i32", "grp_starts": "*i32", "grp_kp": "*i32"}
    for prefix, p in (("a_", a), ("b_", b)):
        fp8 = p is not None and p.form == "fp8"
        types.update({prefix + "out": "*u8" if fp8 else "*bf16", prefix + "stat": "*fp32",
                      prefix + "scale": "*fp32", prefix + "seed": "*i64", prefix + "signs": "*fp32",
                      prefix + "side": "*u8", prefix + "eb": "*i8", prefix + "flags": "*i8"})
    divisible = divisible_args(operand._operand_kernel, types, constexprs)
    return types, constexprs, warps, divisible


def quant_constants(name: str) -> dict:
    spec = QuantSpec.preset(name)
    grid = {k: v for k, v in grid_constants(spec.grid).items() if k not in ("EMIN", "MBITS")}
    return dict(QUANT=True, SQUARE=spec.block[0] == spec.block[1], BR=spec.block[0], BC=spec.block[1], **grid,
                SCALE=SCALE_CODES[spec.scale], SR=spec.rounding.value == "stochastic")


def backward_cases():
    for tc in (True, False):
        t = "*bf16" if tc else "*fp32"
        types = {"q_ptr": t, "k_ptr": t, "v_ptr": t, "do_ptr": t, "keep_ptr": "*i8", "scale": "fp32",
                 "seed_ptr": "*i64", **{p: "*fp32" for p in ("dec_ptr", "delta_ptr", "lse_ptr", "stat_ptr", "dq_ptr",
                                                             "dk_ptr", "dv_ptr", "dbg_ptr")}}
        for name in ("nvfp4", "nvfp4_2d", "mxfp4"):
            bm, bn, warps = attention.BACKWARD_TILE if tc else attention.IEEE_TILE
            consts = dict(BM=bm, BN=bn, D=128, HAS_KEEP=True, CAUSAL=True, DEBUG=False, TC=tc, INTERPRETED=False,
                          **quant_constants(name))
            for phase, kernel in ((0, attention._lse_kernel), (1, attention._dq_kernel), (2, attention._dq_kernel),
                                  (3, attention._dkdv_kernel)):
                if phase == 1 and consts["SCALE"] != 2:
                    continue
                yield f"bwd{phase}-{name}-tc{int(tc)}", kernel, types, {**consts, "PHASE": phase}, warps


def stats_kernel_args(a: OperandPlan | None, b: OperandPlan | None, steps: int = 8):
    """(types, constexprs, warps, divisible) of the stats pass for a contiguous, 16-aligned launch."""
    _, (br, bc, warps), _, flags = operand._launch_config((a, b), None)
    constexprs = dict(BR=br, BC=bc, STEPS=steps, HAS_MU=False, EVEN=True, s_c=1, **flags)
    types = {"t_ptr": "*bf16", **{p: "*fp32" for p in ("mu_ptr", "a_stat", "a_signs", "b_stat", "b_signs")}}
    divisible = divisible_args(operand._stats_kernel, types, constexprs)
    return types, constexprs, warps, divisible


#: Grouped operand pairs (the grouped expert GEMMs): NVFP4's x / dy (SR + RHT-16 on the wgrad orientation), its
#: 16 x 16 weight pair, UFP4's dy (SR, RHT-16 both ways), and a B of H-64 on whole tiles (_emit's groups along the
#: contraction, SR).
GROUPED_OPERAND_CASES = {
    "nvfp4-both-bf16-sr-rht16": OPERAND_CASES["nvfp4-both-bf16-sr-rht16"],
    "nvfp4_2d-both-bf16": (operand_plan("nvfp4_2d", "bf16"), operand_plan("nvfp4_2d", "bf16")),
    "ufp4-both-bf16-sr-rht16": (operand_plan("ufp4", "bf16", 16, True, True),
                                operand_plan("ufp4", "bf16", 16, True, True)),
    "nvfp4-cols-bf16-sr-h64": (None, operand_plan("nvfp4", "bf16", 64, False, True)),
    # the MX family's FP8 form: B's reference exponents and row scales per (row, group)
    "mxfp4-both-fp8": OPERAND_CASES["mxfp4-both-fp8"],
    "mxfp4-both-fp8-h32": OPERAND_CASES["mxfp4-both-fp8-h32"],
    "mxfp4_2d_up-both-fp8-sr": (operand_plan("mxfp4_2d_up", "fp8", sr=True),
                                operand_plan("mxfp4_2d_up", "fp8", sr=True)),
}


def group_stats_kernel_args(a: OperandPlan | None, b: OperandPlan | None):
    """(types, constexprs, warps, divisible) of the grouped stats pass."""
    _, (br, bc, warps), _, flags = operand._launch_config((a, b), None)
    constexprs = dict(BR=br, BC=bc, EVEN=True, CH=operand.GROUP_ROWS, s_c=1,
                      **{k: v for k, v in flags.items() if k != "ACROSS"}, ACROSS=operand.group_stats_across(a, b))
    types = {"t_ptr": "*bf16", "ids_ptr": "*i32", **{p: "*fp32" for p in ("a_stat", "a_signs", "b_stat", "b_signs")}}
    divisible = divisible_args(operand._group_stats_kernel, types, constexprs)
    return types, constexprs, warps, divisible


def grouped_gemm_cases():
    """The grouped GEMM kernels: BF16 operands with per-expert tensor scales, and FP8 operands (MXFP4's blocks)."""
    sizes = ("lda", "ldb", "ld_out", "N", "K", "M", "b_step", "bs_step", "as_step", "bf_step")
    for fp8 in (False, True):
        bm, bn, bk, warps, _ = grouped_gemm.FP8_TILE if fp8 else grouped_gemm.TILE
        consts = dict(BM=bm, BN=bn, BK=bk, FP8=fp8, SCALED=not fp8, OUT_BF16=True, INTERPRETED=False)
        types = {"out_ptr": "*bf16", "ends_ptr": "*i32", **{f"{p}{s}": t for p in ("a", "b") for s, t in (
            ("", "*fp8e4nv" if fp8 else "*bf16"), ("_scale", "*fp32"), ("_flags", "*i8"), ("_x", "*bf16"))}}
        for label, kernel in (("rows", grouped_gemm._grouped_rows_kernel),
                              ("contraction", grouped_gemm._grouped_contraction_kernel)):
            divisible = divisible_args(kernel, types, consts, sizes)
            yield f"grouped-gemm-{label}{'-fp8' if fp8 else ''}", kernel, types, consts, warps, divisible


def fp8_correction_cases():
    """The FP8 GEMMs' exact correction (kernels/src/gemm.py): the exact BF16 copies -- per-row scales (FP4Linear's
    GEMMs, the grouped fprop), per (row, expert) with the experts along the columns (the grouped dgrad's W^T) or in
    segments (the grouped wgrad) -- and FP4Linear's GEMM of the flagged tiles over them."""
    copy_types = {"ends_ptr": "*i32", **{f"{p}{s}": t for p in ("a", "b") for s, t in (
        ("_ptr", "*fp8e4nv"), ("_side", "*fp8e4nv"), ("_eb", "*i8"), ("_scale", "*fp32"), ("_flags", "*i8"),
        ("_out", "*bf16"))}}
    br, bk, warps = gemm.COPY_TILE
    params = inspect.signature(gemm._exact_copy_kernel.fn).parameters
    for a_groups, b_groups in ((0, 0), (0, 1), (2, 2)):
        consts = dict(BR=br, BK=bk, A_BLC=32, A_SHIFT=6, A_GROUPS=a_groups, B_BLC=32, B_SHIFT=6, B_GROUPS=b_groups)
        divisible = [p for p in params if p not in consts and (p in copy_types or p in ("CA", "CB"))]
        yield f"fp8-exact-copy-{a_groups}{b_groups}", gemm._exact_copy_kernel, copy_types, consts, warps, divisible
    for out in ("*bf16", "*fp32"):
        types = {"out_ptr": out, "a_x": "*bf16", "b_x": "*bf16", "a_flags": "*i8", "b_flags": "*i8"}
        params = inspect.signature(gemm._correction_kernel.fn).parameters
        consts = dict(BM=128, BN=128, BK=64, OUT_BF16=out == "*bf16", INTERPRETED=False)
        divisible = [p for p in params if p not in consts and (p in types or p in ("ld_out", "K"))]
        yield f"fp8-correction-{out[1:]}", gemm._correction_kernel, types, consts, 8, divisible


def bf16_gemm_cases():
    """The BF16-form GEMM with the tensor scales fused (kernels/src/bf16_gemm.py), its TMA descriptors as the host
    builds them, with and without warp specialisation."""
    bm, bn, bk, warps, stages, group, _ = bf16_gemm.TILE
    types = {"a_desc": f"tensordesc<bf16[{bm},{bk}]>", "b_desc": f"tensordesc<bf16[{bn},{bk}]>",
             "out_desc": f"tensordesc<bf16[{bm},{bn}]>", "a_scale": "*fp32", "b_scale": "*fp32"}
    for specialize in (False, True):
        consts = dict(BM=bm, BN=bn, BK=bk, GROUP=group, WARP_SPECIALIZE=specialize, INTERPRETED=False)
        yield f"bf16-gemm-ws{int(specialize)}", bf16_gemm._bf16_gemm_kernel, types, consts, warps, ("M", "N", "K")


def fp4_adamw_cases():
    """FP4AdamW's step (kernels/src/optim.py), both passes, an NVFP4 and an MXFP4 state, FP32 and BF16 parameters."""
    bm, bk, warps = optim.TILE
    for name, p_type in (("nvfp4", "*fp32"), ("mxfp4", "*bf16")):
        spec = QuantSpec.preset(name)
        types = {"tiles_ptr": "*i32", "ptrs_ptr": "*i64", "sizes_ptr": "*i64", "values_ptr": "*fp32",
                 "factors_ptr": "*fp32", "stat_ptr": "*fp32",
                 **{k: "fp32" for k in ("b1", "one_minus_b1", "b2", "one_minus_b2", "c1", "c2", "eps", "decay", "lr")}}
        for pass_ in (0, 1):
            consts = dict(BM=bm, BK=bk, BR=spec.block[0], BC=spec.block[1], **grid_constants(spec.grid),
                          SCALE=SCALE_CODES[spec.scale], STEP=0.5, SQRT_V=True, P_BF16=p_type == "*bf16", PASS=pass_)
            yield f"fp4-adamw-{name}-pass{pass_}", optim._fp4_adamw_kernel, types, consts, warps


def cases():
    yield from fp4_adamw_cases()
    for label, (a, b) in OPERAND_CASES.items():
        types, constexprs, warps, divisible = operand_kernel_args(a, b)
        yield f"operand-{label}", operand._operand_kernel, types, constexprs, warps, divisible
        if any(p is not None and p.stat for p in (a, b)):
            yield f"stats-{label}", operand._stats_kernel, *stats_kernel_args(a, b)
    for label, (a, b) in GROUPED_OPERAND_CASES.items():
        types, constexprs, warps, divisible = operand_kernel_args(a, b, grouped=True)
        yield f"grouped-operand-{label}", operand._operand_kernel, types, constexprs, warps, divisible
        if any(p is not None and p.stat for p in (a, b)):
            yield f"grouped-stats-{label}", operand._group_stats_kernel, *group_stats_kernel_args(a, b)
    yield from grouped_gemm_cases()
    yield from bf16_gemm_cases()
    yield ("scale-output", gemm._scale_cast_kernel, {"src_ptr": "*fp32", "dst_ptr": "*bf16", "a_scale_ptr": "*fp32",
           "b_scale_ptr": "*fp32"}, dict(BLOCK=gemm.SCALE_CAST_BLOCK, EVEN=True), 8)
    yield from fp8_correction_cases()
    for tc, t in ((True, "*bf16"), (False, "*fp32")):
        # the tensor cores' path as fp4_attention runs it: O stored in BF16 by the kernel
        types = {"q_ptr": t, "k_ptr": t, "v_ptr": t, "dec_ptr": "*fp32", "keep_ptr": "*i8", "o_ptr": t,
                 "lse_ptr": "*fp32", "scale": "fp32"}
        bm, bn, warps = attention.FORWARD_TILE if tc else attention.IEEE_TILE
        for causal in (False, True):
            yield f"fwd-tc{int(tc)}-causal{int(causal)}", attention._flash_forward_kernel, types, dict(
                BM=bm, BN=bn, D=128, HAS_KEEP=not causal, CAUSAL=causal, TC=tc, LSE=True, INTERPRETED=False), warps
    yield from backward_cases()
    for name in ("nvfp4", "mxfp4"):
        spec = QuantSpec.preset(name)
        for phase in (0, 1, 2):
            for parts in (True, False):
                out = "*bf16" if parts else "*fp32"
                types = {"x_ptr": "*bf16", "sp_ptr": out, "res_ptr": out, "stat_ptr": "*fp32", "bad_ptr": "*i32"}
                consts = dict(BM=32, BK=64, BC=spec.block[1], **grid_constants(spec.grid),
                              SCALE=SCALE_CODES[spec.scale], PHASE=phase, PARTS=parts)
                yield f"sharq-{name}-{phase}-parts{int(parts)}", sharq._sharq_kernel, types, consts


def resources(cubin: bytes) -> tuple[str, str]:
    """(registers, stack bytes) of a cubin, from the cuobjdump that Triton bundles."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
    return (regs.group(1) if regs else "?"), (stack.group(1) if stack else "?")


def main(shard: int = 0, shards: int = 1) -> int:
    """Compile every variant (or every shards-th one from the shard-th: the test runs shards side by side)."""
    failures = contracted = 0
    for i, (label, kernel, types, constexprs, *launch) in enumerate(cases()):
        if i % shards != shard:
            continue
        try:
            compiled = compile_for_hopper(kernel, types, constexprs, *launch)
            assert ".target sm_90" in compiled.asm["ptx"]
            if kernel in UNFUSED and constexprs.get("TC"):  # no contracted multiply-add (the IEEE path's FP32
                # dots are FMAs themselves): every product and sum rounded as the reference rounds it.  The kernels'
                # own tl.fma calls stay (dS's dP dec_v - D, numerics.div_qmax / rcp_rn), so the check is that the
                # same kernel with fusion on has as many or more, and that some kernel has more: the launch option
                # is honoured (it is all or nothing: one compile flag)
                fused = compile_for_hopper(kernel, types, constexprs, *launch, fp_fusion=True)
                unfused_fmas, fused_fmas = (c.asm["ptx"].count("fma.rn.f32") for c in (compiled, fused))
                assert unfused_fmas <= fused_fmas, f"FMAs with FP fusion off {unfused_fmas}, on {fused_fmas}"
                contracted += fused_fmas > unfused_fmas
            if label.startswith(("operand-", "grouped-operand-")) and label not in STACK_KNOWN:
                # no local memory: with Triton 3.9 the register transpose of the 2D weight pair compiled to a
                # 3.5 KiB stack and 6x the instructions (session 32; such pairs now reload the tile transposed)
                _, stack = resources(compiled.asm["cubin"])
                assert stack == "0", f"a {stack}-byte stack frame (spilled registers or a local array)"
            print("ok", label, flush=True)
        except Exception as err:  # noqa: BLE001  (report every variant)
            failures += 1
            print("FAIL", label, type(err).__name__, str(err)[-400:].replace("\n", " | "), flush=True)
    print("contracted", contracted)  # the test sums the shards' counts: some kernel must contract more when fused
    print("failures", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:3])))
