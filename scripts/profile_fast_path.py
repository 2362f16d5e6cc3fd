#!/usr/bin/env python
"""Where the fast path's time goes, on the GPU: launch overhead vs kernel time, and a kernel table.

    python scripts/profile_fast_path.py [--n 8192] [--only-operand PRESET]   (the latter: for ncu)
    python scripts/profile_fast_path.py --e2e bf16,mxfp4,nvfp4    (GPU time per kernel of a 1.1B train step)
    python scripts/profile_fast_path.py --bench-linear bf16,bf16_graphs,hf_fp4:nvfp4:graphs   (bench.py's linear step)
    python scripts/profile_fast_path.py --copies bf16_compiled,mxfp4 [--code-dir DIR]   (inductor's stores)

1. Operand quantization of an n x n bf16 tensor: eager (CUDA events around the Python call, so launch
   overhead counts when the GPU is faster than the host) against the replay of a captured CUDA graph
   (GPU time only).
2. torch.profiler over FP4Linear forward + backward (4096 x 4096, 8192 tokens): GPU time per kernel.
3. --e2e: torch.profiler over train steps of bench.py's 1.1B Llama (blocks compiled, default mode):
   GPU time per kernel, and the busy fraction of the step (host-bound when far below 1).
4. --copies: the kernels torch.compile generates around ours in one decoder block, by store count (a kernel
   storing one value into many buffers copies an input of our kernels once per argument slot).
5. --gemm: cuBLAS FP8 GEMM time by scale granularity (tensor, row, 1x128) against BF16, at bench.py's shapes;
   --bf16-gemm [linear|bench-50m|llama-1.1b]: the BF16-form GEMM (fused kernel per tile, torch.mm + epilogue);
   --triton-gemm: a Triton 1x128 FP8 GEMM (exactness per accumulation variant, time);
   --fp8-accuracy: the FP8 GEMMs' worst error against the FP32 accumulation bound, by contraction length.
6. --attention-tiles: the flash kernels' time per tile (rows x keys x warps) at bench.py's attention shape
   (causal, NVFP4 Q/K/V/dS on the tensor cores), forward and backward, against SDPA.
7. --optim: torch.profiler over optimizer steps on bench-50m's model (bench.py's OPTIMIZERS): host and GPU
   time per op, and the host-device synchronisations per step.
8. --model-operands [linear|bench-50m|llama-1.1b]: a recipe's x and dy operand pairs at a model's activation
   shapes (tokens x K, tokens x N), captured, against a device copy by the bytes moved -- per statistics-pass
   tile and program count (operand.STATS_TILE, STATS_PROGRAMS).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch import nn

import hf_fp4
from hf_fp4 import FP4Linear, QuantSpec, preset
from hf_fp4.nn.operands import OperandPlan, operands

# bench.py beside this script, for the modes that time its steps (python -P keeps the script's folder off sys.path)
sys.path.insert(0, str(Path(__file__).resolve().parent))

FP8_CHUNK = 128  # the block-scale width of the 1x128 FP8 GEMMs measured (and dropped) by --gemm, --triton-gemm
CHUNK = tl.constexpr(FP8_CHUNK)


def plan(name, form, h=0, sr=False):
    spec = QuantSpec.preset(name)
    if sr:
        spec = dataclasses.replace(spec, rounding="stochastic")
    return OperandPlan.single(spec, form, h, h > 0)


CASES = {
    "mxfp4": (plan("mxfp4", "fp8"), None), "nvfp4": (plan("nvfp4", "bf16"), None),
    "mxfp8": (plan("mxfp8", "bf16"), None), "int4": (plan("int4", "bf16"), None),
    "mxfp4-dual": (plan("mxfp4", "fp8"), plan("mxfp4", "fp8")),
    "nvfp4-dual": (plan("nvfp4", "bf16"), plan("nvfp4", "bf16")),
    "mxfp4-T": (None, plan("mxfp4", "fp8")), "nvfp4-sr": (plan("nvfp4", "bf16", sr=True), None),
    "ufp4-h16": (plan("ufp4", "bf16", 16), None), "nvfp4-T": (None, plan("nvfp4", "bf16")),
    "ufp4-dualH": (plan("ufp4", "bf16", 16), plan("ufp4", "bf16", 16, sr=True)),
}


def event_ms(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def graph_ms(fn, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return event_ms(g.replay, reps)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--only-operand", default=None)
    p.add_argument("--linear", default="mxfp4,nvfp4")
    p.add_argument("--sweep", action="store_true", help="graph-replay times of the operand kernel per tile")
    p.add_argument("--tiles", default=None,
                   help="--sweep: comma list of RxCxW[R] operand tiles (R: reload), instead of the built-in list")
    p.add_argument("--cases", default="mxfp4,nvfp4,mxfp4-T,nvfp4-T,mxfp4-dual,nvfp4-dual,ufp4-h16,nvfp4-sr,"
                   "ufp4-dualH", help="operand cases of the operand table and --sweep")
    p.add_argument("--cprofile", nargs="?", const="operands", default=None,
                   help="host-side profile: of one operands() call (no value), or 'linear:<preset>' of an eager "
                        "4096x4096 FP4Linear fwd+bwd at 8192 tokens")
    p.add_argument("--e2e", default=None, help="comma list of bench.py impl names or presets")
    p.add_argument("--e2e-model", default="llama-1.1b", choices=("llama-1.1b", "bench-50m"), help="--e2e's model")
    p.add_argument("--bench-linear", default=None,
                   help="comma list of bench.py linear impls: both timings and the kernel table of its step, 4096^2")
    p.add_argument("--copies", default=None,
                   help="comma list of impls: inductor's kernels of one compiled 1.1B block's train step, by stores")
    p.add_argument("--code-dir", default=None, help="--copies: write each impl's generated code here")
    p.add_argument("--gemm", action="store_true",
                   help="FP8 GEMM time by scale granularity (tensor, row, 1x128 block) against BF16, per GEMM shape")
    p.add_argument("--bf16-gemm", nargs="?", const="linear", default=None, choices=tuple(GEMM_SHAPES),
                   help="the BF16-form GEMM: torch.mm + epilogue against the fused Triton kernel per tile and the "
                        "op's route, at the GEMMs of the linear bench (default), bench-50m or the 1.1B Llama")
    p.add_argument("--model-operands", nargs="?", const="bench-50m", default=None, choices=tuple(GEMM_SHAPES),
                   help="the x / dy operand pairs of --presets at a model's activation shapes, per statistics-pass "
                        "tile, against copy bandwidth")
    p.add_argument("--presets", default="nvfp4,ufp4,mxfp4", help="--model-operands' recipes")
    p.add_argument("--stats-default", action="store_true",
                   help="--model-operands with the default statistics pass only (an A/B of two installs)")
    p.add_argument("--triton-gemm", action="store_true", help="a Triton 1x128 FP8 GEMM: exactness and time")
    p.add_argument("--fp8-accuracy", action="store_true",
                   help="FP8 GEMM error against the FP32 accumulation bound, by contraction length")
    p.add_argument("--mutations", action="store_true",
                   help="which arguments torch.compile believes each kernel writes (it copies those inputs)")
    p.add_argument("--optim", default=None,
                   help="comma list of bench.py OPTIMIZERS labels (adamw, fp4_adamw, muon, muon+nvfp4_ns) or 'all': "
                        "one optimizer step each, op table, syncs")
    p.add_argument("--attention-tiles", nargs="?", const="fwd,bwd", default=None, choices=("fwd,bwd", "fwd", "bwd"),
                   help="flash kernels' ms per tile, against SDPA: the forward's tiles, the backward's, or both")
    p.add_argument("--moe", default=None, help="bench.py's MoE layer: comma list of its impl names "
                   "(bf16:grouped_mm, hf_fp4:<preset>, ...): GPU time per kernel and step")
    p.add_argument("--correction-tiles", action="store_true", help="the FP8 GEMMs' exact correction per tile "
                   "(gemm.CORRECTION_TILE): mxfp4's linear step on spread inputs, captured ms against bf16")
    p.add_argument("--moe-tiles", default=None, help="bench.py's MoE layer, captured ms per grouped-GEMM tile "
                   "(hf_fp4.kernels.grouped_gemm.TILE / FP8_TILE) for a comma list of presets")
    args = p.parse_args()
    dev = "cuda"
    # the modes that do one thing and stop: (given?, what it runs)
    modes = [(args.attention_tiles, lambda: attention_tiles(dev, args.attention_tiles.split(","))),
             (args.moe, lambda: profile_moe(dev, args.moe.split(","))),
             (args.correction_tiles, lambda: correction_tiles(dev)),
             (args.moe_tiles, lambda: moe_tiles(dev, args.moe_tiles.split(","))),
             (args.optim, lambda: profile_optim(dev, args.optim.split(","))),
             (args.gemm, lambda: gemm_granularity(dev)),
             (args.bf16_gemm, lambda: bf16_gemm_tiles(dev, args.bf16_gemm)),
             (args.model_operands, lambda: model_operands(
                 dev, args.model_operands, args.presets.split(","),
                 STATS_VARIANTS[:1] if args.stats_default else STATS_VARIANTS)),
             (args.triton_gemm, lambda: triton_blockwise_probe(dev)),
             (args.fp8_accuracy, lambda: fp8_accuracy(dev)),
             (args.mutations, lambda: mutations(dev))]
    for given, run in modes:
        if given:
            run()
            return
    if args.copies:
        for name in args.copies.split(","):
            inductor_stores(name, args.code_dir)
        return
    if args.e2e:
        for name in args.e2e.split(","):
            profile_e2e(name, model_name=args.e2e_model)
        return
    if args.bench_linear:
        profile_bench_linear(dev, args.bench_linear.split(","))
        return
    x = torch.randn(args.n, args.n, device=dev, dtype=torch.bfloat16)
    seeds = torch.tensor([1, 2], device=dev)
    sign = hf_fp4.seeded_signs(16, 0).to(dev)

    def call(plans):
        s = tuple(sign if p is not None and p.hadamard else None for p in plans)
        return lambda: operands(x, plans, seeds, s)

    if args.only_operand:
        call(CASES[args.only_operand])()
        torch.cuda.synchronize()
        return
    if args.sweep:
        tiles = None
        if args.tiles:
            tiles = [tuple(int(v) for v in t.rstrip("R").split("x")) + ((True,) if t.endswith("R") else ())
                     for t in args.tiles.split(",")]
        sweep(x, seeds, sign, args.cases.split(","), tiles)
        return
    if args.cprofile:
        import cProfile
        import pstats
        f = call(CASES["mxfp4-dual"])
        if args.cprofile.startswith("linear:"):
            layer = FP4Linear.from_linear(nn.Linear(4096, 4096, bias=False, device=dev, dtype=torch.bfloat16),
                                          preset(args.cprofile.removeprefix("linear:")).linear, name="p")
            xs = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
            dy = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16)
            f = lambda: layer(xs).backward(dy)  # noqa: E731
        for _ in range(5):
            f()
        torch.cuda.synchronize()
        with cProfile.Profile() as prof:
            for _ in range(50):
                f()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
        return
    copy = event_ms(lambda: x.clone())
    print(f"copy {copy:.4f} ms")
    print("| operand | eager ms | graph ms | graph % of copy bytes/s |")
    for name in args.cases.split(","):  # --cases: the rows of the table
        plans = CASES[name]
        e, g = event_ms(call(plans)), graph_ms(call(plans))
        out = sum({"fp8": 1, "bf16": 2}[p.form] for p in plans if p is not None)
        print(f"| {name} | {e:.4f} | {g:.4f} | {(2 + out) / 4 * copy / g:.0%} |")
    tokens = 8192
    for recipe in filter(None, args.linear.split(",")):  # --linear "": the operand table only
        layer = FP4Linear.from_linear(nn.Linear(4096, 4096, bias=False, device=dev, dtype=torch.bfloat16),
                                      preset(recipe).linear, name="p")
        xs = torch.randn(tokens, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(tokens, 4096, device=dev, dtype=torch.bfloat16)
        step = lambda: layer(xs).backward(dy)  # noqa: E731
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        print(f"linear {recipe}: eager {event_ms(step, 10):.3f} ms per fwd+bwd")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


def gemm_granularity(dev: str, tokens: int = 8192) -> None:
    """The three GEMMs of a linear layer at bench.py's shapes: bf16 torch.mm against torch._scaled_mm with
    tensor-wise, row-wise and 1x128 block scales (graph-replay ms)."""
    print("| K x N | GEMM (M x N x K) | bf16 | fp8 tensor | fp8 row | fp8 1x128 |")
    print("|---|---|---|---|---|---|")
    for k, n in ((4096, 4096), (4096, 14336), (14336, 4096)):
        for role, (m, nn_, kk) in (("fprop", (tokens, n, k)), ("dgrad", (tokens, k, n)), ("wgrad", (n, k, tokens))):
            a = torch.randn(m, kk, device=dev, dtype=torch.bfloat16)
            b = torch.randn(nn_, kk, device=dev, dtype=torch.bfloat16)
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
            one = torch.ones((), device=dev)
            ra, rb = torch.ones(m, 1, device=dev), torch.ones(1, nn_, device=dev)
            ba = torch.ones(kk // FP8_CHUNK, m, device=dev).t()
            bb = torch.ones(kk // FP8_CHUNK, nn_, device=dev)
            runs = {"bf16": lambda: a @ b.t(),
                    "tensor": lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                    "row": lambda: torch._scaled_mm(a8, b8.t(), scale_a=ra, scale_b=rb, out_dtype=torch.bfloat16),
                    "block": lambda: torch._scaled_mm(a8, b8.t(), scale_a=ba, scale_b=bb, out_dtype=torch.bfloat16)}
            cells = []
            for what, fn in runs.items():
                try:
                    cells.append(f"{graph_ms(fn):.3f}")
                except RuntimeError as err:
                    cells.append(f"error: {str(err)[:60]}")
            print(f"| {k}x{n} | {role} {m}x{nn_}x{kk} | " + " | ".join(cells) + " |")


@triton.jit
def _blockwise_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, out_ptr, M, N, K, MA, NB, ld_out,
                      BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr, IMPRECISE: tl.constexpr,
                      OUT_BF16: tl.constexpr):
    """out [M, N] = sum over CHUNK-column chunks of (a_chunk @ b_chunk^T) * scale_a * scale_b: each chunk's
    product from the FP8 tensor cores into a fresh FP32 tile, scaled by its two powers of two (exact) and
    added in FP32.  a [MA, K], b [NB, K] E4M3 (K whole chunks), scales [rows, K / CHUNK] column-major."""
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    per_group = GROUP * n_n
    first = (pid // per_group) * GROUP
    size = tl.minimum(n_m - first, GROUP)
    pm = first + (pid % per_group) % size
    pn = (pid % per_group) // size
    rows = pm * BM + tl.arange(0, BM)
    cols = pn * BN + tl.arange(0, BN)
    ks = tl.arange(0, CHUNK)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]
    b_ptrs = b_ptr + cols[:, None].to(tl.int64) * K + ks[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for c in range(0, K // CHUNK):
        a = tl.load(a_ptrs, mask=rows[:, None] < MA, other=0.0)
        b = tl.load(b_ptrs, mask=cols[:, None] < NB, other=0.0)
        sa = tl.load(sa_ptr + c * MA + rows, mask=rows < MA, other=0.0)
        sb = tl.load(sb_ptr + c * NB + cols, mask=cols < NB, other=0.0)
        part = tl.dot(a, tl.trans(b), max_num_imprecise_acc=IMPRECISE)
        acc += part * sa[:, None] * sb[None, :]
        a_ptrs += CHUNK
        b_ptrs += CHUNK
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    optr = out_ptr + rows[:, None].to(tl.int64) * ld_out + cols[None, :]
    tl.store(optr, acc.to(tl.bfloat16) if OUT_BF16 else acc, mask=mask)


def triton_blockwise(a_data, a_scale, b_data, b_scale, m, n, out_dtype, tile=(128, 128), group=8, imprecise=None,
                     warps=8, stages=3):
    """The FP8 product with 1 x 128 block scales as one Triton kernel (a measured and dropped candidate)."""
    out = torch.empty(m, n, dtype=out_dtype, device=a_data.device)
    bm, bn = tile
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _blockwise_kernel[grid](a_data, b_data, a_scale, b_scale, out, m, n, a_data.shape[1], a_data.shape[0],
                            b_data.shape[0], out.stride(0), BM=bm, BN=bn, GROUP=group, IMPRECISE=imprecise,
                            OUT_BF16=out_dtype == torch.bfloat16, num_warps=warps, num_stages=stages)
    return out


def triton_blockwise_probe(dev: str, tokens: int = 8192) -> None:
    """Candidate Triton 1x128 FP8 GEMM: exact (FP32 accumulation bound) on operands whose chunks lie 2^+-20
    apart and whose values span E4M3's range, per variant; then graph-replay ms at bench.py's shapes
    against cuBLAS row-wise and 1x128."""
    sys.path.insert(0, "tests")
    from exactness import assert_within_accumulation_error

    def operand(rows, k, g):
        codes = torch.tensor([0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, 0], device=dev)
        v = codes[torch.randint(0, 15, (rows, k), device=dev, generator=g)]
        e = torch.randint(-6, 6, (rows, k // 32), device=dev, generator=g).float()
        v = v * torch.exp2(e).repeat_interleave(32, 1)
        scale = torch.exp2(torch.randint(-20, 20, (k // FP8_CHUNK, rows), device=dev, generator=g).float())
        return v.to(torch.float8_e4m3fn), scale.t()

    g = torch.Generator(device=dev).manual_seed(0)
    a, sa = operand(256, 1024, g)
    b, sb = operand(384, 1024, g)
    exact = lambda d, s: d.float() * s.repeat_interleave(FP8_CHUNK, 1)  # noqa: E731
    variants = {"imprecise=None": dict(), "imprecise=0": dict(imprecise=0), "imprecise=32": dict(imprecise=32),
                "imprecise=128": dict(imprecise=128)}
    for name, kw in variants.items():
        for out_dtype in (torch.float32, torch.bfloat16):
            try:
                assert_within_accumulation_error(triton_blockwise(a, sa, b, sb, 256, 384, out_dtype, **kw),
                                                 exact(a, sa), exact(b, sb), name)
                print(f"{name} {out_dtype}: exact")
            except AssertionError as err:
                print(f"{name} {out_dtype}: NOT exact: {str(err)[-90:]}")
    try:
        out = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.float32)
        assert_within_accumulation_error(out, exact(a, sa), exact(b, sb), "cublas 1x128")
        print("cublas 1x128: exact")
    except AssertionError as err:
        print(f"cublas 1x128: NOT exact: {str(err)[-90:]}")
    print("| GEMM (M x N x K) | cublas row | cublas 1x128 | triton variants (tile, warps, stages, imprecise) ... |")
    configs = [((128, 128), 8, 3, None), ((128, 256), 8, 3, None), ((128, 128), 4, 4, None),
               ((128, 256), 8, 3, 32), ((128, 128), 8, 3, 0), ((256, 128), 8, 3, None)]
    for k, n in ((4096, 4096), (4096, 14336), (14336, 4096)):
        for m, nn_, kk in ((tokens, n, k), (tokens, k, n), (n, k, tokens)):
            a, sa = operand(m, kk, g)
            b, sb = operand(nn_, kk, g)
            cells = [graph_ms(lambda: torch._scaled_mm(a, b.t(), scale_a=torch.ones(m, 1, device=dev),
                                                       scale_b=torch.ones(1, nn_, device=dev),
                                                       out_dtype=torch.bfloat16)),
                     graph_ms(lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16))]
            for tile, w, st, imp in configs:
                try:
                    cells.append(graph_ms(lambda: triton_blockwise(a, sa, b, sb, m, nn_, torch.bfloat16, tile=tile,
                                                                   warps=w, stages=st, imprecise=imp)))
                except Exception as err:  # noqa: BLE001
                    print(f"  {tile} {w} {st} {imp}: {type(err).__name__} {str(err)[:80]}")
                    cells.append(float("nan"))
            print(f"| {m}x{nn_}x{kk} | " + " | ".join(f"{c:.3f}" for c in cells) + " |", flush=True)


def fp8_accuracy(dev: str) -> None:
    """How far the FP8 tensor cores' accumulation is from the FP32 bound K * 2^-24 * |a||b| (tests/exactness.py),
    by contraction length: E4M3 operands 512 x K whose values span E4M3's range within each row (4-bit grid
    values times 2^[-9, 6] per 32-block), against float64.  cuBLAS row-scaled (`torch._scaled_mm`, FP32 and
    BF16 output) and Triton's FP8 dot with and without promotion every 32."""
    print("| K | cublas fp32 out | cublas bf16 out | triton default | triton promote 32 |  (worst error / bound)")
    print("|---|---|---|---|---|")
    g = torch.Generator(device=dev).manual_seed(0)
    codes = torch.tensor([0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, 0], device=dev)
    for k in (128, 256, 512, 1024, 2048, 4096, 8192, 16384):
        ops = []
        for _ in range(2):
            v = codes[torch.randint(0, 15, (512, k), device=dev, generator=g)]
            e = torch.randint(-9, 6, (512, k // 32), device=dev, generator=g).float()
            ops.append((v * torch.exp2(e).repeat_interleave(32, 1)).to(torch.float8_e4m3fn))
        a, b = ops
        ad, bd = a.double(), b.double()
        ref = ad @ bd.t()
        bound = k * 2.0**-24 * (ad.abs() @ bd.abs().t())
        one = torch.ones((), device=dev)
        ones_a, ones_b = torch.ones(512, 1, device=dev), torch.ones(1, 512, device=dev)
        scale = torch.ones(k // FP8_CHUNK, 512, device=dev).t()
        outs = {"fp32": torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.float32),
                "bf16": torch._scaled_mm(a, b.t(), scale_a=ones_a, scale_b=ones_b, out_dtype=torch.bfloat16),
                "triton": triton_blockwise(a, scale, b, scale, 512, 512, torch.float32),
                "triton32": triton_blockwise(a, scale, b, scale, 512, 512, torch.float32, imprecise=32)}
        cells = []
        for name, out in outs.items():
            err = (out.double() - ref).abs()
            extra = 2.0**-8 * ref.abs() if name == "bf16" else 0.0  # one rounding to BF16 allowed
            cells.append(f"{float((err / (bound + extra + 1e-300)).max()):.3g}")
        print(f"| {k} | " + " | ".join(cells) + " |", flush=True)


def kernel_table(prof, steps: int, title: str, wall_ms: float, rows: int = 18) -> None:
    """GPU time per kernel and step of a torch.profiler run of `steps` steps, under a heading with the busy fraction
    (kernel time over the step's wall time)."""
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.self_device_time_total for e in events) / 1e3 / steps
    print(f"\n## {title}, {gpu_ms:.3f} ms of kernels ({gpu_ms / wall_ms:.0%} busy)")
    print("| kernel | ms per step | share |")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:rows]:
        ms = e.self_device_time_total / 1e3 / steps
        print(f"| {e.key[:70]} | {ms:.3f} | {ms / gpu_ms:.0%} |")


def profile_bench_linear(dev: str, names: list[str], k: int = 4096, n: int = 4096, tokens: int = 8192,
                         steps: int = 5) -> None:
    """bench.py's linear step (its layers, compile modes and gradient resets) at one shape: its time with each call
    waited for and back to back (bench.timed), then torch.profiler's GPU time per kernel and step -- where a row
    loses against the sum of its kernels (a CUDA-graph tree's input copies, host time, an accumulation)."""
    from bench import linear_impls, linear_step, linear_times

    inputs = [(torch.randn(tokens, k, device=dev, dtype=torch.bfloat16).requires_grad_(),
               torch.randn(tokens, n, device=dev, dtype=torch.bfloat16)) for _ in range(3)]
    for name, layer in linear_impls(k, n, dev, names):
        waited, stream, captured, _ = linear_times(layer, name, inputs)
        graphs = name.endswith("graphs")
        activity = torch.profiler.ProfilerActivity.CUDA if dev == "cuda" else torch.profiler.ProfilerActivity.CPU
        with torch.profiler.profile(activities=[activity]) as prof:
            for i in range(steps):
                if graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                linear_step(layer, *inputs[i % len(inputs)])
            torch.cuda.synchronize() if dev == "cuda" else None
        kernel_table(prof, steps, f"{name} {k}x{n}, {tokens} tokens: {waited:.3f} ms waited, {stream:.3f} ms back "
                     f"to back, {captured} ms captured", waited, rows=14)
        del layer
        torch.cuda.empty_cache() if dev == "cuda" else None


def profile_moe(dev: str, names: list[str], steps: int = 3) -> None:
    """bench.py's MoE layer (issue 16): per impl, its waited time and torch.profiler's GPU time per kernel and step
    -- where the FP4 grouped path loses against Transformers' bf16 grouped_mm (quantization passes, GEMMs)."""
    from bench import moe_steps, timed

    for name, step, shape in moe_steps(dev, False, names):
        wall = timed(step, [()], warmup=2, reps=5)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        kernel_table(prof, steps, f"MoE {name} ({shape}): {wall:.2f} ms waited", wall, rows=24)
        op_table(prof, steps)
        if name.startswith("hf_fp4:"):
            lost_block_census(step)
        torch.cuda.empty_cache()


def op_table(prof, steps: int, rows: int = 24) -> None:
    """GPU time per operator (and input shapes) and step: which torch op or custom op launched the kernels of
    kernel_table -- a generic elementwise kernel there names no op."""
    ops = [e for e in prof.key_averages(group_by_input_shape=True)
           if e.device_type == torch.autograd.DeviceType.CPU and e.self_device_time_total > 0]
    print("| op | input shapes | ms per step (own kernels) | calls per step |")
    for e in sorted(ops, key=lambda e: -e.self_device_time_total)[:rows]:
        print(f"| {e.key[:50]} | {str(e.input_shapes)[:80]} | {e.self_device_time_total / 1e3 / steps:.3f} | "
              f"{e.count / steps:g} |")


def lost_block_census(step) -> None:
    """One more step with the grouped FP8 GEMMs' operands read back (host syncs, untimed): rows flagged (blocks
    lost to E4M3, recomputed exactly from BF16 copies) per GEMM call -- a flagged operand writes its copies."""
    import hf_fp4.kernels.grouped_gemm as gg

    calls = []

    def counting(fn, what):
        def run(a, b, *args, **kw):
            calls.append(f"{what}: a {int(a.flags[:-1].sum())}/{a.flags.numel() - 1} rows, "
                         f"b {int(b.flags[:-1].sum())}/{b.flags.numel() - 1} rows flagged")
            return fn(a, b, *args, **kw)
        return run

    saved = gg.grouped_rows_fp8, gg.grouped_contraction_fp8
    gg.grouped_rows_fp8 = counting(saved[0], "rows")
    gg.grouped_contraction_fp8 = counting(saved[1], "contraction")
    try:
        step()
    finally:
        gg.grouped_rows_fp8, gg.grouped_contraction_fp8 = saved
    print("lost blocks per FP8 GEMM call:", "; ".join(calls) or "no FP8 GEMM")


def correction_tiles(dev: str, k: int = 4096, n: int = 4096, tokens: int = 8192) -> None:
    """bench.py's linear_spread step (every wgrad tile flagged, so the correction recomputes all of it) for mxfp4,
    captured ms per tile of the correction's BF16 GEMM (hf_fp4.kernels.gemm.CORRECTION_TILE), beside bf16 and
    mxfp4 on unspread inputs in the same run: the correction's cost is the spread row minus the unspread one."""
    from hf_fp4.kernels import gemm

    from bench import captured_ms, linear_impls, linear_step, spread_rows

    def inputs(make):
        return (make(torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)).requires_grad_(),
                make(torch.randn(tokens, n, device=dev, dtype=torch.bfloat16)))

    plain, spread = inputs(lambda t: t), inputs(spread_rows)
    (_, bf16), = linear_impls(k, n, dev, ["bf16"])
    base = captured_ms(functools.partial(linear_step, bf16), plain)
    (_, layer), = linear_impls(k, n, dev, ["hf_fp4:mxfp4"])
    unflagged = captured_ms(functools.partial(linear_step, layer), plain)
    print(f"{k}x{n}, {tokens} tokens, captured: bf16 {base:.3f} ms, mxfp4 unspread {unflagged:.3f} ms")
    default = gemm.CORRECTION_TILE
    for tile in ((128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
                 (128, 128, 64, 4, 4)):
        gemm.CORRECTION_TILE = tile
        try:
            ms = captured_ms(functools.partial(linear_step, layer), spread)
            print(f"| {tile} | {ms:.3f} ms | correction ~{ms - unflagged:.3f} ms | {base / ms:.2f}x bf16 |", flush=True)
        except Exception as err:  # noqa: BLE001 - a tile the GPU cannot run (shared memory)
            print(f"| {tile} | {type(err).__name__}: {str(err)[:100]} |", flush=True)
    gemm.CORRECTION_TILE = default


def moe_tiles(dev: str, presets: list[str]) -> None:
    """bench.py's MoE layer (one fwd + bwd captured in a CUDA graph: GPU time alone) per tile of the grouped GEMMs
    -- TILE for the BF16 kernels (NVFP4 / UFP4), FP8_TILE for the FP8 ones (the MX family with +fp8gemm, e.g.
    "mxfp4+fp8gemm": its experts' default BF16 GEMMs are torch._grouped_mm's, which have no tile) -- against
    Transformers' bf16 grouped_mm in the same run."""
    from hf_fp4.kernels import grouped_gemm

    from bench import captured_ms, moe_steps

    (_, step, shape), = moe_steps(dev, False, ["bf16:grouped_mm"])
    base = captured_ms(step, ())
    print(f"MoE {shape}: bf16 grouped_mm {base:.3f} ms captured")
    # each tile compiles the grouped kernels afresh (~20-40 s): a short list
    tiles = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 128, 8, 3),
             (128, 256, 128, 8, 3)]
    default = (grouped_gemm.TILE, grouped_gemm.FP8_TILE)
    for name in presets:
        if name.split("+")[0] in ("mxfp4", "mxfp4_dh", "tib") and "+fp8gemm" not in name:
            print(f"| {name} | its grouped GEMMs are torch._grouped_mm's (no tile): name {name}+fp8gemm |")
            continue
        attr = "FP8_TILE" if "+fp8gemm" in name else "TILE"
        for tile in tiles:
            setattr(grouped_gemm, attr, tile)
            try:
                (_, step, _), = moe_steps(dev, False, [f"hf_fp4:{name}"])
                ms = captured_ms(step, ())
                print(f"| {name} | {attr} {tile} | {ms:.3f} ms | {base / ms:.2f}x bf16 |", flush=True)
            except Exception as err:  # noqa: BLE001 - a tile the GPU cannot run (shared memory)
                print(f"| {name} | {attr} {tile} | {type(err).__name__}: {str(err)[:100]} |", flush=True)
            torch.cuda.empty_cache()
        grouped_gemm.TILE, grouped_gemm.FP8_TILE = default


#: --bf16-gemm's layers, (tokens, [(in_features, out_features), ...]): the linear bench's three, and the distinct
#: linears of bench-50m (q / o, k / v, gate / up, down at 16 x 1024 tokens) and of bench.py's 1.1B Llama (4 x 2048)
GEMM_SHAPES = {"linear": (8192, [(4096, 4096), (4096, 14336), (14336, 4096)]),
               "bench-50m": (16384, [(640, 640), (640, 320), (640, 1728), (1728, 640)]),
               "llama-1.1b": (8192, [(2048, 2048), (2048, 512), (2048, 5632), (5632, 2048)])}


def bf16_gemm_tiles(dev: str, model: str = "linear") -> None:
    """The BF16-form GEMM of each of a model's GEMMs (fprop, dgrad, wgrad of every distinct linear, GEMM_SHAPES),
    captured (GPU time): torch.mm's BF16 output (the bf16 layer's GEMM: the floor), torch.mm's FP32 output +
    scale_output (the epilogue pass), the op as FP4Linear calls it (the fused kernel, or the epilogue path where
    bf16_gemm.long_and_narrow routes it), and the fused Triton kernel (kernels/src/bf16_gemm.py) per tile -- with
    the count of output elements where the fused kernel differs from the epilogue path and the largest difference
    in units of the BF16 output's magnitude."""
    from hf_fp4.kernels import bf16_gemm
    from hf_fp4.kernels.gemm import scale_output
    from hf_fp4.nn.operands import _bf16_gemm_kernels

    # session 26 (H100, the linear bench): 128 x 256 x 64 warp-specialised best in all (9.27 ms), without
    # specialisation 9.66, 128 x 128 tiles 10.06-10.33, 256 x 128 9.89-10.10, BK 128 11.10, 4 stages of 128 x 256 out
    # of shared memory.  The narrower tiles are for bench-50m's 320 / 640 columns (128 x 256 pads 640 to 768)
    tiles = [(128, 256, 64, 8, 3, 8, True), (128, 128, 64, 8, 4, 8, True), (128, 128, 64, 4, 4, 8, True),
             (128, 64, 64, 4, 4, 8, True), (256, 128, 64, 8, 3, 8, True), (128, 256, 64, 8, 3, 8, False)]
    sa, sb = torch.tensor([0.37], device=dev), torch.tensor([1.7e-3], device=dev)
    totals: dict = {}
    tokens, layers = GEMM_SHAPES[model]
    print(f"## {model}: {tokens} tokens, SMs {torch.cuda.get_device_properties(dev).multi_processor_count}")
    print("| GEMM (M, N, K) | bf16 mm | mm fp32 + epilogue | op (route) | "
          + " | ".join(map(str, tiles)) + " |")
    for k, n in layers:
        for label, (mm, nn_, kk) in (("fprop", (tokens, n, k)), ("dgrad", (tokens, k, n)), ("wgrad", (n, k, tokens))):
            a = torch.randn(mm, kk, device=dev, dtype=torch.bfloat16)
            b = torch.randn(nn_, kk, device=dev, dtype=torch.bfloat16)
            ref = scale_output(torch.mm(a, b.t(), out_dtype=torch.float32), sa, sb, torch.bfloat16)
            row = [graph_ms(lambda: torch.mm(a, b.t())),
                   graph_ms(lambda: scale_output(torch.mm(a, b.t(), out_dtype=torch.float32), sa, sb, torch.bfloat16)),
                   graph_ms(lambda: _bf16_gemm_kernels(a, b, sa, sb))]
            cells = [f"{v:.3f}" for v in row]
            cells[2] += " (mm)" if bf16_gemm.long_and_narrow(a, b) else " (fused)"
            for tile in tiles:
                try:
                    out = bf16_gemm.bf16_gemm(a, b, sa, sb, tile=tile)
                    ms = graph_ms(lambda: bf16_gemm.bf16_gemm(a, b, sa, sb, tile=tile))
                    diff = (out.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
                    cells.append(f"{ms:.3f} ({(out != ref).sum().item()} diff, {diff:.1e})")
                    row.append(ms)
                except Exception as err:  # noqa: BLE001 - a tile the GPU cannot run (shared memory)
                    cells.append(f"{type(err).__name__}")
                    row.append(float("inf"))
            for i, v in enumerate(row):
                totals[i] = totals.get(i, 0.0) + v
            print(f"| {label} {mm}x{nn_}x{kk} | " + " | ".join(cells) + " |", flush=True)
            del a, b, ref
            torch.cuda.empty_cache()
    print("| total | " + " | ".join(f"{totals[i]:.3f}" for i in sorted(totals)) + " |")


def profile_e2e(name: str, steps: int = 3, model_name: str = "llama-1.1b") -> None:
    from bench import LLAMA_1B, bench50m_model, build_model, train_step

    impl = _impl(name)
    torch._dynamo.reset()
    if model_name == "bench-50m":  # bench.py's e2e50m part: the model and batch of configs/bench-50m.yaml
        model_cfg, run = bench50m_model()
        arch = {k: v for k, v in model_cfg.items() if k != "model_type"} | {"vocab_size": int(run["vocab_size"])}
        shape = (int(run["batch_size"]), int(run["seq_len"]))
    else:
        arch, shape = LLAMA_1B, (4, 2048)
    model, cfg = build_model(impl, arch, "cuda")
    train, opt = train_step(model, "cuda")
    ids = torch.randint(0, cfg.vocab_size, shape, device="cuda")
    step = functools.partial(train, ids)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    wall = event_ms(step, 5)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernel_table(prof, steps, f"{impl} ({model_name}): step {wall:.1f} ms wall", wall)
    del model, opt
    torch.cuda.empty_cache()


def attention_tiles(dev: str, passes: list[str]) -> None:
    """Forward and backward ms of the flash kernels per tile on B1 H32 T4096 D128 (GQA expanded), causal, NVFP4
    operands as the tensor cores take them, against SDPA's flash backend on the same bf16 inputs (and SDPA's
    default dispatch printed beside it, with its backend: session 27's 'sdpa' line was the default dispatch, its
    backend not recorded)."""
    from bench import sdpa_backend, sdpa_flash

    from hf_fp4.kernels import attention as kernels
    from hf_fp4.nn.attention import tensor_core_operand

    b, h, t, d = 1, 32, 4096, 128
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(b, h, t, d, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4))
    ops = [tensor_core_operand(x, QuantSpec.preset("nvfp4"), 0) for x in (q, k, v)]
    (qh, kh, vh), decodes = (o[0] for o in ops), torch.stack([o[1] for o in ops])
    # the default dispatch (cuDNN's kernels where PyTorch prefers them) and the flash backend (issue 12's yardstick)
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    sdpa_ms = {}
    for label, attend in ((f"sdpa default ({sdpa_backend(q, k, v, is_causal=True)})",
                           nn.functional.scaled_dot_product_attention), ("sdpa flash", sdpa_flash)):
        fwd = graph_ms(lambda attend=attend: attend(q, k, v, is_causal=True))
        out = attend(qq, kk, vv, is_causal=True)
        bwd = event_ms(lambda out=out: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True), 10)
        sdpa_ms[label] = fwd, bwd
        print(f"{label}: fwd {fwd:.3f} ms, bwd {bwd:.3f} ms")
    sdpa_f, sdpa_b = sdpa_ms["sdpa flash"]  # the ratios below are against the flash backend
    spec = QuantSpec.preset("nvfp4")
    o, lse = kernels.flash_forward(qh, kh, vh, None, d ** -0.5, decodes, causal=True, return_lse=True)
    # (rows, keys, warps[, pipeline stages: 3 where not given]); session 21's forward runs the tiles before the
    # causal diagonal unmasked and accumulates P V in the MMA's accumulator, so the larger tiles are worth retiming
    fwd_tiles = ((64, 32, 4), (64, 32, 4, 2), (64, 32, 4, 4), (64, 64, 4), (64, 64, 4, 4), (128, 32, 8),
                 (128, 64, 8), (128, 64, 8, 2), (128, 64, 8, 4), (128, 128, 8), (128, 128, 8, 2))
    for tile in fwd_tiles if "fwd" in passes else ():
        try:
            ms = graph_ms(lambda: kernels.flash_forward(qh, kh, vh, None, d ** -0.5, decodes, tile, causal=True))
            print(f"fwd {tile}: {ms:.3f} ms ({sdpa_f / ms:.2f}x sdpa)", flush=True)
        except Exception as err:  # noqa: BLE001 - a tile the GPU cannot run
            print(f"fwd {tile}: {type(err).__name__} {str(err)[:120]}", flush=True)
    # the backward as fp4_attention runs it (the forward's log-sum-exp: phases 1-3), one tile for every phase, then
    # the dK / dV phase (3) and the dS-amax / dQ phases (1, 2) on tiles of their own (session 28: the dK / dV kernel
    # computes its tile transposed; scripts/ptx_report.py: a 16 B stack at 64 x 32 x 4, none at 64 x 32 x 8)
    # session 29 swept (32, 32, 4), (64, 32, 4[, 2]), (64, 32, 8), (64, 64, 8) for every phase, phase 3 on (64, 32, 8),
    # (64, 64, 8), (32, 64, 4), (128, 32, 8), (64, 64, 4) and phases 1-2 on (64, 64, 4|8), (128, 32|64, 8): phase 3's
    # (32, 64, 4) is now the default (BACKWARD_TILES); around it:
    tiles = [None, {3: (32, 64, 4, 2)}, {3: (32, 64, 8)}, {3: (32, 128, 4)}, {3: (32, 128, 8)}, {3: (64, 64, 4, 2)}]
    tiles += [{1: t, 2: t} for t in ((128, 64, 8), (128, 32, 8), (64, 64, 4))]
    # phase 1 (dS's amax: 68 registers, two programs per SM by its 3-stage shared memory under ncu) on fewer stages
    tiles += [{1: t} for t in ((64, 32, 4, 2), (64, 64, 4, 2), (128, 64, 8, 2))]
    for tile in tiles if "bwd" in passes else ():
        try:
            ms = event_ms(lambda: kernels.flash_backward(qh, kh, vh, o, do, None, d ** -0.5, spec, 3, decodes, tile,
                                                         causal=True, lse=lse), 5)
            print(f"bwd {tile}: {ms:.3f} ms ({sdpa_b / ms:.2f}x sdpa flash)", flush=True)
        except Exception as err:  # noqa: BLE001
            print(f"bwd {tile}: {type(err).__name__} {str(err)[:120]}", flush=True)


def profile_optim(dev: str, labels: list[str], steps: int = 1) -> None:
    """Each optimizer of bench.py's OPTIMIZERS: its step alone (gradients from one backward), wall ms, GPU busy
    ms, synchronisations, and the ops that take the host's and the GPU's time."""
    from bench import OPTIMIZERS, bench50m_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_fp4.optim import build_optimizer, param_groups

    model_cfg, cfg = bench50m_model()
    kwargs = {k: v for k, v in model_cfg.items() if k != "model_type"}
    kwargs["vocab_size"] = int(cfg["vocab_size"])
    for name, options in OPTIMIZERS:
        label = name + ("+" + options["ns_spec"] + "_ns" if options.get("ns_spec") else "")
        if label not in labels and labels != ["all"]:
            continue
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**kwargs)).to(dev)
        opt = build_optimizer(name, param_groups(model, name, 0.1), 1e-3, (0.9, 0.95), dict(options))
        ids = torch.randint(0, kwargs["vocab_size"], (2, 256), device=dev)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()  # the state exists (and the kernels are compiled)
        wall = event_ms(opt.step, 2)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                opt.step()
            torch.cuda.synchronize()
        table = prof.key_averages()
        gpu = sum(e.self_device_time_total for e in table if e.device_type == torch.autograd.DeviceType.CUDA)
        syncs = sum(e.count for e in table if "Synchronize" in e.key or e.key == "aten::_local_scalar_dense")
        print(f"\n## {label}: step {wall:.1f} ms wall, {gpu / 1e3 / steps:.1f} ms of kernels, "
              f"{syncs / steps:.0f} syncs/step")
        print(table.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60), flush=True)
        print(table.table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=60))
        import cProfile
        import pstats

        host = cProfile.Profile()
        host.runcall(opt.step)
        torch.cuda.synchronize()
        pstats.Stats(host).sort_stats("tottime").print_stats(16)  # where the host's time goes
        del model, opt
        torch.cuda.empty_cache()


def _impl(name: str) -> str:
    return name if name in ("bf16", "bf16_compiled") or ":" in name else f"hf_fp4:{name}:compiled"


def inductor_stores(name: str, code_dir: str | None) -> None:
    """The kernels inductor generates for one decoder block's forward + backward, with their store counts:
    a kernel that stores one input into many buffers is copying it for the kernels that read it."""
    import re

    from torch._inductor.utils import run_and_get_code

    from bench import LLAMA_1B, build_model, train_step

    torch._dynamo.reset()
    model, cfg = build_model(_impl(name), {**LLAMA_1B, "num_hidden_layers": 1}, "cuda")
    train, _ = train_step(model, "cuda")
    ids = torch.randint(0, cfg.vocab_size, (4, 2048), device="cuda")
    _, codes = run_and_get_code(train, ids)
    if code_dir:
        Path(code_dir).mkdir(parents=True, exist_ok=True)
        Path(code_dir, f"{name.replace(':', '_')}.py").write_text("\n\n# ----- next graph -----\n".join(codes))
    kernels = []
    for code in codes:
        for m in re.finditer(r"'kernel_name': '(\w+)'.*?'num_store': (\d+)", code):
            kernels.append((m.group(1), int(m.group(2))))
    copies = sum(1 for code in codes for _ in re.finditer(r"\bcopy_\(|clone\(", code))
    print(f"\n## {name}: {len(codes)} graphs, {len(kernels)} inductor kernels, {sum(n for _, n in kernels)} stores, "
          f"{copies} copy_/clone calls in the wrappers")
    for kname, n in sorted(kernels, key=lambda k: -k[1])[:8]:
        print(f"| {kname[:80]} | {n} stores |")


def mutations(dev: str) -> None:
    """torch's TTIR analysis of each kernel launch of an FP8 operand pair + GEMM: the arguments it marks as
    written.  Inputs it marks are copied before every launch under torch.compile."""
    from unittest import mock

    import logging

    from torch._higher_order_ops import triton_kernel_wrap as wrap

    logging.getLogger(wrap.__name__).addHandler(logging.StreamHandler())  # the analysis' own failure report

    from hf_fp4.kernels import gemm as gemm_module
    from hf_fp4.kernels import operand as operand_module
    from hf_fp4.nn.operands import gemm

    launches = []

    def recording(kernel):
        def launcher(grid):
            def launch(*a, **kw):
                names = kernel.arg_names
                launches.append((kernel, {**dict(zip(names, a)), **{k: v for k, v in kw.items() if k in names}}))
                return kernel[grid](*a, **kw)
            return launch
        return type("R", (), {"__getitem__": lambda self, grid: launcher(grid)})()

    t = torch.randn(256, 512, device=dev, dtype=torch.bfloat16)
    with mock.patch.object(operand_module, "wrap_triton", recording), \
            mock.patch.object(gemm_module, "wrap_triton", recording):
        pa = CASES["mxfp4-dual"]
        a, b = operands(t, pa, torch.tensor([1, 2], device=dev))
        gemm(a, a, (pa[0], pa[0]), 256, 256, torch.bfloat16)
    for kernel, kwargs in launches:
        name = kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__
        if hasattr(wrap, "identify_accessed_tensors"):  # torch >= 2.12
            written = sorted(d.name for d in wrap.identify_accessed_tensors(kernel, kwargs, {}).read_writes.writes)
        else:
            written = sorted(wrap.identify_mutated_tensors(kernel, kwargs, {}))
        print(name, "writes:", written, flush=True)


#: --model-operands' statistics-pass variants: (BR, BC, warps) tile, programs the row walk keeps (STATS_PROGRAMS)
STATS_VARIANTS = [(None, None), ((64, 128, 8), 1024), ((64, 128, 8), 2048), ((32, 128, 4), 1024),
                  ((64, 64, 4), 2048), ((128, 128, 8), 512)]


def model_operands(dev: str, model: str, presets: list[str], variants=STATS_VARIANTS) -> None:
    """For each preset and each distinct activation shape of `model` (x: tokens x K, dy: tokens x N), the operand
    pair FP4Linear makes of that tensor (both orientations; stats pass + operand pass), captured, as % of a device
    copy's bandwidth by the bytes moved (t read twice -- statistics and operands -- plus the operands written), per
    statistics-pass variant (`variants`, by default STATS_VARIANTS; None = the defaults).
    bench-50m's NVFP4 step spent 7.5 ms in operand kernels and 2.7 ms in the statistics pass (session 31)."""
    from hf_fp4.kernels import operand as operand_module
    from hf_fp4.nn.operands import LinearPlan

    tokens, shapes = GEMM_SHAPES[model]
    widths = sorted({k for k, _ in shapes} | {n for _, n in shapes})
    seeds = torch.tensor([1, 2], device=dev)
    default = (operand_module.STATS_TILE, operand_module.STATS_PROGRAMS)
    print(f"## {model}: operand pairs of [{tokens}, C] tensors; % of copy bandwidth (bytes: t read twice + written)")
    for name in presets:
        lp = LinearPlan.build(preset(name).linear, "triton")
        for tensor in ("x", "dy"):
            plans = getattr(lp, tensor)
            if all(p is None for p in plans):
                continue
            signs = tuple(hf_fp4.seeded_signs(p.hadamard, 0).to(dev) if p is not None and p.signed else None
                          for p in plans)
            print(f"| {name} {tensor} [tokens, C] | copy ms | " + " | ".join(
                "default" if t is None else f"stats {t[0]}x{t[1]}w{t[2]} / {n}" for t, n in variants) + " |")
            for c in widths:
                t = torch.randn(tokens, c, device=dev, dtype=torch.bfloat16)
                copy = graph_ms(lambda: t.clone())
                ops = operand_module.triton_operands(t, plans, seeds, signs)  # the same outputs for every variant
                moved = 2 * t.numel() * t.element_size() + sum(o.data.numel() * o.data.element_size()
                                                               for o in ops if o is not None)
                row = [f"{tokens}x{c}", f"{copy:.4f}"]
                for tile, programs in variants:
                    operand_module.STATS_TILE, operand_module.STATS_PROGRAMS = (tile or default[0],
                                                                                programs or default[1])
                    operand_module._launch_config.cache_clear()
                    ms = graph_ms(lambda: operand_module.triton_operands(t, plans, seeds, signs))
                    row.append(f"{ms:.4f} ({100 * moved / (2 * t.numel() * t.element_size()) * copy / ms:.0f}%)")
                print("| " + " | ".join(row) + " |", flush=True)
    operand_module.STATS_TILE, operand_module.STATS_PROGRAMS = default
    operand_module._launch_config.cache_clear()


def sweep(x, seeds, sign, cases, tiles=None):
    """Kernel time (CUDA-graph replay) of the operand kernels per tile, and the transpose-copy alternative."""
    from hf_fp4.kernels.operand import triton_operands

    from hf_fp4.kernels import operand as operand_module

    tiles = tiles or [(64, 64, 4), (32, 64, 2), (64, 64, 2), (32, 32, 1), (64, 128, 4), (128, 64, 4),  # 4th: RELOAD
             (32, 64, 2, True), (64, 64, 4, True), (32, 128, 4, True), (64, 128, 8, True), (64, 32, 2, True)]
    copy = graph_ms(lambda: x.clone())
    print(f"copy {copy:.4f} ms (graph)")
    default = operand_module.STATS_TILE
    for stats_tile in ((64, 256, 8), (32, 256, 4), (128, 128, 8), (64, 128, 4), (128, 256, 8)):
        operand_module.STATS_TILE = stats_tile
        operand_module._launch_config.cache_clear()
        row = [f"{n}={graph_ms(lambda: triton_operands(x, CASES[n], seeds, (None, None))):.4f}"
               for n in ("mxfp4-dual", "nvfp4-dual", "mxfp4")]
        print("stats tile", stats_tile, " ".join(row), flush=True)
    operand_module.STATS_TILE = default
    operand_module._launch_config.cache_clear()
    for name in cases:
        plans = CASES[name]
        s = tuple(sign if p is not None and p.hadamard else None for p in plans)
        row = []
        for tile in tiles:
            try:
                ms = graph_ms(lambda: triton_operands(x, plans, seeds, s, tile=tile))
                row.append(f"{tile[0]}x{tile[1]}w{tile[2]}{'R' * (len(tile) > 3)}={ms:.4f}")
            except Exception as err:  # noqa: BLE001 - a tile the compiler cannot fit
                row.append(f"{tile[0]}x{tile[1]}w{tile[2]}{'R' * (len(tile) > 3)}=ERR({type(err).__name__})")
        if plans[0] is None:  # transpose copy, then the row kernel
            ms = graph_ms(lambda: triton_operands(x.t().contiguous(), (plans[1], None), seeds, (s[1], None)))
            row.append(f"copyT+A={ms:.4f}")
        print(name, " ".join(row), flush=True)


if __name__ == "__main__":
    main()
