"""Hadamard transforms and mean-bias removal, applied along the contraction (last) dimension.

H_n is Sylvester's Hadamard matrix scaled by 1/sqrt(n) (orthonormal, n a power of two, 16..256).
With a sign vector s, the rotation is R = diag(s) H_n, still orthonormal, so rotating both GEMM
operands blockwise along the contraction dimension leaves the product unchanged:
(A R)(B R)^T = A R R^T B^T = A B^T.  It spreads an outlier over its block before quantization.

Sign policies (RESEARCH.md, "Hadamard transforms"): none (deterministic Sylvester, AMD's study),
a random vector fixed for the run (NVIDIA/TE, torchao), or one redrawn per call.
"""
from __future__ import annotations

import functools
import math

import torch

from .formats import flush_subnormals

HADAMARD_SIZES = (16, 32, 64, 128, 256)


@functools.lru_cache(maxsize=None)
def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_matrix(n: int, signs: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """diag(signs) @ H_n / sqrt(n) (orthonormal)."""
    if n not in HADAMARD_SIZES:
        raise ValueError(f"Hadamard size {n} not supported; valid sizes: {HADAMARD_SIZES}")
    h = _sylvester(n) / math.sqrt(n)
    if signs is not None:
        if signs.shape != (n,):
            raise ValueError(f"sign vector must have shape ({n},), got {tuple(signs.shape)}")
        h = signs.to(torch.float64).cpu()[:, None] * h
    return h.to(dtype=dtype, device=device)


def random_signs(n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """A random +-1 vector of length n (FP32) from `generator` (CPU)."""
    bits = torch.randint(0, 2, (n,), generator=generator, device="cpu")  # also under a meta default device
    return (bits * 2 - 1).float()


def seeded_signs(n: int, seed: int) -> torch.Tensor:
    """The sign vector of a seed: the same seed always gives the same vector."""
    return random_signs(n, torch.Generator().manual_seed(seed))


def padded_width(k: int, hadamard: int, block: int) -> int:
    """The reference's padded contraction length: K rounded up to the Hadamard size, then to the block."""
    k += -k % (hadamard or 1)
    return k + -k % block


def apply_hadamard(x: torch.Tensor, n: int, signs: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate x ([..., K]) blockwise along its last dim by diag(signs) H_n, in FP32.

    Computed as a fast Walsh-Hadamard transform with a fixed order of operations, which the Triton
    kernels repeat exactly: multiply by the signs (exact), then butterfly stages of stride 1, 2, ...,
    n/2, each mapping a pair (a, b) with a at the lower index to (a + b, a - b), then one multiply by
    FP32(1/sqrt(n)).  Mathematically this is x @ diag(signs) @ hadamard_matrix(n).
    K is zero-padded to a multiple of n (exact for GEMMs: both operands get the same padding).
    """
    if n not in HADAMARD_SIZES:
        raise ValueError(f"Hadamard size {n} not supported; valid sizes: {HADAMARD_SIZES}")
    k = x.shape[-1]
    pad = -k % n
    xf = flush_subnormals(x.float())
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    lead = xf.shape[:-1]
    blocks = xf.reshape(-1, n)
    if signs is not None:
        blocks = blocks * signs.to(device=x.device, dtype=torch.float32)
    stride = 1
    while stride < n:
        pairs = blocks.reshape(-1, n // (2 * stride), 2, stride)
        a, b = pairs[:, :, 0, :], pairs[:, :, 1, :]
        blocks = torch.stack([a + b, a - b], dim=2).reshape(-1, n)
        stride *= 2
    blocks = flush_subnormals(blocks * torch.tensor(1.0 / math.sqrt(n), dtype=torch.float32))
    return blocks.reshape(*lead, k + pad)


def remove_mean_bias(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Subtract the per-feature mean over tokens: x [..., K] -> (x - mu, mu[K]).

    The rank-one term 1 mu^T is added back in high precision by the GEMM (e.g. fprop adds
    mu @ W^T to every output row), so the product is unchanged while block scales shrink.
    """
    flat = x.reshape(-1, x.shape[-1])
    mu = flat.float().mean(dim=0)
    return (flat.float() - mu).reshape(x.shape).to(x.dtype), mu
