"""The bound every fast GEMM is held to: the float64 product of its quantized operands, within FP32
accumulation error (and one rounding to the output dtype)."""
import torch


def assert_within_accumulation_error(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, what="") -> None:
    """out ~ a @ b^T: |out - ref| <= K * 2^-24 * (|a| @ |b|^T) elementwise (a rigorous bound on FP32 sums
    of exact products, in any order), plus one rounding of ref to out's dtype (2^-8 relative for BF16).
    The bound is per element, so a missing contribution of a small row or block is caught; a NaN or an
    infinity passes only where the float64 product has the same."""
    a, b = a.double().cpu(), b.double().cpu()
    ref = a @ b.t()
    bound = a.shape[1] * 2.0**-24 * (a.abs() @ b.abs().t())
    if out.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * ref.abs()
    elif out.dtype == torch.float16:
        bound = bound + 2.0**-11 * ref.abs()
    got = out.double().cpu()
    err = (got - ref).abs()
    same = (got == ref) | (got.isnan() & ref.isnan())  # infinities and NaNs only where the product has them
    bad = ~same & ~(err <= bound + 1e-300)  # written so that a NaN error is bad
    assert not bad.any(), f"{what}: {int(bad.sum())} element(s) beyond FP32 accumulation error, worst " \
                          f"{float((err / (bound + 1e-300)).max()):.3g}x the bound at {bad.nonzero()[0].tolist()}"
