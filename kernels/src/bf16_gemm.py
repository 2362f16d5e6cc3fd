"""The BF16-form GEMM (NVFP4, UFP4: operands v * UE4M3 block scale, exact in BF16) with its tensor scales fused.

    out = BF16((a @ b^T) * (s_a * s_b))      a [M, K], b [N, K] BF16 (K contiguous), s_a, s_b FP32 [1] on the device

FP32 accumulation on the BF16 tensor cores, the two FP32 tensor decode scales multiplied into the accumulator and
one rounding to BF16 -- the roundings of `scale_output(torch.mm(a, b.t(), out_dtype=float32), s_a, s_b)`
(kernels/src/gemm.py), without its FP32 output: cuBLAS writes 4 bytes per output element there and the epilogue
reads them back (3x the bytes of a BF16 output; on a 4096 x 14336 layer's fwd + bwd 2.1 GB against 0.42 GB).

A persistent kernel (one program per SM walks the output tiles in grouped order, as Triton's persistent-matmul
tutorial does) over TMA tensor descriptors built on the host, so the launch takes no allocator and replays under
CUDA graphs.  In Triton's interpreter the same kernel runs with FP32 dots (the interpreter multiplies BF16 dot
operands as their raw bits).  The scales stay on the device: no host synchronisation.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .gemm import _kernel_device, default_programs
from .launch import launcher
from .numerics import bf16_bits

#: Whether FP4Linear's BF16-form GEMMs (hf_fp4/nn/operands.py: gemm) run here (BF16 outputs of operands that fit);
#: False: torch.mm's FP32 output and gemm.scale_output, the same roundings.
ENABLED = True

#: (BM, BN, BK, warps, stages, group, warp specialisation): `scripts/profile_fast_path.py --bf16-gemm` (H100,
#: 2026-12-06, the linear bench's nine GEMMs captured: 9.27 ms in all with this tile, 9.66 without warp
#: specialisation, 10.06-11.10 with 128 x 128 tiles or BK 128; torch.mm with FP32 output + the epilogue pass 10.44,
#: torch.mm's plain BF16 output 9.06; benchmarks/gpu/bf16gemm-tiles-2026-12-06-session26.txt).  Set this module
#: attribute to change it.
TILE = (128, 256, 64, 8, 3, 8, True)

#: The tile of an output whose N the default tile's BN would pad by more than NARROW_PAD of N (bench-50m's 640 and
#: 320 columns: 768 and 512 with BN 256).  `profile_fast_path.py --bf16-gemm bench-50m` (H100, session 31,
#: captured): all six fprop / dgrad GEMMs with N 320 or 640 ran faster on 128 x 128 (0.033 vs 0.035 ms at
#: 16384 x 640 x 640, 0.022 vs 0.029 at 16384 x 320 x 640, 0.062-0.063 vs 0.069-0.070 at K or N 1728), the two with
#: N 1728 (3.7% padding) as fast or slower (0.074-0.076 vs 0.073); bit-identical outputs (the K loop is the same).
NARROW_TILE = (128, 128, 64, 8, 4, 8, True)
NARROW_PAD = 0.1


def default_tile(n: int) -> tuple[int, ...]:
    """TILE, or NARROW_TILE where TILE's BN pads an output of n columns by more than NARROW_PAD of n."""
    bn = TILE[1]
    return NARROW_TILE if triton.cdiv(n, bn) * bn - n > NARROW_PAD * n else TILE


#: The contraction length from which an output of fewer TILE tiles than half the GPU's SMs goes to torch.mm's FP32
#: output and the epilogue pass instead (`long_and_narrow`).  The persistent kernel gives each output tile to one
#: program, which walks the whole contraction: with fewer tiles than SMs the GPU runs at tiles / SMs of its rate for
#: K / BK steps, while cuBLAS splits K (half: the 1.1B Llama's 2048 x 2048 wgrad has 128 tiles for 132 SMs, one
#: nearly full wave, and stays here).  Profiled on bench-50m (H100, `profile_fast_path.py --e2e nvfp4 --e2e-model
#: bench-50m`, session 30): the fused kernel took 17.4 ms of a 42.9 ms step, its wgrads (640 x 640 x 16384: 15
#: tiles, 320 x 640: 9, 1728 x 640: 42 -- for 132 SMs) the most of it.  From this length on torch.mm's FP32 output
#: (8 bytes per output element written and read back) costs little beside the 2 K flops per element.
LONG_K = 1024


@triton.jit
def _tile_coords(tile, n_m, n_n, GROUP: tl.constexpr):
    """Output tile `tile`'s (row tile, column tile), GROUP row tiles per column sweep (L2 reuse of b's tiles)."""
    per_group = GROUP * n_n
    first_m = (tile // per_group) * GROUP
    rows_in_group = tl.minimum(n_m - first_m, GROUP)
    return first_m + (tile % per_group) % rows_in_group, (tile % per_group) // rows_in_group


@triton.jit
def _bf16_gemm_kernel(a_desc, b_desc, out_desc, a_scale, b_scale, M, N, K,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                      WARP_SPECIALIZE: tl.constexpr, INTERPRETED: tl.constexpr):
    """Each program walks output tiles tl.num_programs(0) apart: the K loop over TMA loads of a's and b's tiles
    (zero past the edges), then the scaled accumulator rounded to BF16 (by hand: the interpreter truncates) and
    stored through TMA (clipped at the edges).  Warp specialisation splits the loads from the MMAs."""
    n_m, n_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    s = tl.load(a_scale) * tl.load(b_scale)
    for tile in tl.range(tl.program_id(0), n_m * n_n, tl.num_programs(0), flatten=WARP_SPECIALIZE,
                         warp_specialize=WARP_SPECIALIZE):
        tm, tn = _tile_coords(tile, n_m, n_n, GROUP)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            x = a_desc.load([tm * BM, k0])
            y = b_desc.load([tn * BN, k0])
            if INTERPRETED:
                acc = tl.dot(x.to(tl.float32), tl.trans(y.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(y), acc)
        out_desc.store([tm * BM, tn * BN], bf16_bits(acc * s).to(tl.bfloat16, bitcast=True))


def fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the kernel takes a and b's layout: BF16 matrices on CUDA (or in the interpreter), rows of unit stride,
    row strides of whole 16 bytes (TMA's alignment), and an output row of whole 16 bytes (N % 8 == 0).  Traceable
    by dynamo (no storage offsets or addresses): aligned() is the launch's own check of the addresses."""
    return b.dim() == 2 and b.shape[0] % 8 == 0 and all(
        t.dtype == torch.bfloat16 and t.dim() == 2 and t.stride(1) == 1 and t.stride(0) % 8 == 0
        and _kernel_device(t) for t in (a, b))


def long_and_narrow(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a @ b^T contracts over at least LONG_K and has fewer output tiles (TILE) than half the kernel's
    persistent programs (one per SM): a small weight's wgrad (its rows x columns, summed over the tokens), which
    torch.mm's split-K runs faster (see LONG_K)."""
    bm, bn = TILE[:2]
    tiles = triton.cdiv(a.shape[0], bm) * triton.cdiv(b.shape[0], bn)
    return a.shape[1] >= LONG_K and 2 * tiles < default_programs(a)


def aligned(*tensors: torch.Tensor) -> bool:
    """Whether every tensor starts on a 16-byte boundary (TMA's; the caching allocator aligns its blocks further,
    so only a view starting inside a row misses it)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def bf16_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
              tile: tuple[int, ...] | None = None, programs: int | None = None) -> torch.Tensor:
    """BF16((a @ b^T) * (a_scale * b_scale)) for a [M, K], b [N, K] (see the module docstring); fits(a, b) and
    aligned(a, b) must hold.  tile: (BM, BN, BK, warps, stages, group, warp specialisation), default_tile(N) by
    default; programs: one per SM by default."""
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"operand widths differ: {a.shape[1]} vs {b.shape[1]}")
    if not fits(a, b) or not aligned(a, b):
        raise ValueError("bf16_gemm takes BF16 operands with unit column stride and 16-byte aligned rows, N % 8 == 0")
    (m, k), n = a.shape, b.shape[0]
    bm, bn, bk, warps, stages, group, specialize = tile or default_tile(b.shape[0])
    out = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    interpreted = not a.is_cuda
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(b, [bn, bk])
    out_desc = TensorDescriptor.from_tensor(out, [bm, bn])
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    programs = min(tiles, programs or default_programs(out))
    launcher(_bf16_gemm_kernel)[(programs,)](
        a_desc, b_desc, out_desc, a_scale, b_scale, m, n, k, BM=bm, BN=bn, BK=bk, GROUP=group,
        WARP_SPECIALIZE=specialize and not interpreted, INTERPRETED=interpreted, num_warps=warps,
        num_stages=1 if interpreted else stages)
    return out
