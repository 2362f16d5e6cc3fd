"""The bound every fast GEMM is held to: the float64 product of its quantized operands, within FP32
accumulation error (and one rounding to the output dtype).

Hopper's FP8 tensor cores do not meet it on operands whose values span E4M3's range within a row: their MMA
adds each step's products with about 14 bits of alignment (DeepSeek-V3 report, section 3.3.2; measured:
benchmarks/results-2026-12-02.md).  `FP8_MMA_BITS` is the bound the FP8 GEMMs are held to there (the same
rigorous form with a 14-bit unit): still an elementwise bound, so a lost row or block of comparable size fails.
"""
import torch

#: the accumulator precision the FP32 bound assumes, and the one Hopper's FP8 MMA gives (see above)
FP32_BITS, FP8_MMA_BITS = 24, 14


def assert_within_accumulation_error(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, what="",
                                     bits: int = FP32_BITS) -> None:
    """out ~ a @ b^T: |out - ref| <= K * 2^-bits * (|a| @ |b|^T) elementwise (a rigorous bound on sums of exact
    products in any order with a bits-bit accumulator: FP32's 24 by default), plus one rounding of ref to
    out's dtype (2^-8 relative for BF16).
    The bound is per element, so a missing contribution of a small row or block is caught; a NaN or an
    infinity passes only where the float64 product has the same."""
    a, b = a.double().cpu(), b.double().cpu()
    ref = a @ b.t()
    bound = a.shape[1] * 2.0**-bits * (a.abs() @ b.abs().t())
    if out.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * ref.abs()
    elif out.dtype == torch.float16:
        bound = bound + 2.0**-11 * ref.abs()
    got = out.double().cpu()
    err = (got - ref).abs()
    same = (got == ref) | (got.isnan() & ref.isnan())  # infinities and NaNs only where the product has them
    bad = ~same & ~(err <= bound + 1e-300)  # written so that a NaN error is bad
    assert not bad.any(), f"{what}: {int(bad.sum())} element(s) beyond {bits}-bit accumulation error, worst " \
                          f"{float((err / (bound + 1e-300)).max()):.3g}x the bound at {bad.nonzero()[0].tolist()}"
