"""Hadamard transforms and mean-bias removal."""
import pytest
import torch

from hf_fp4 import apply_hadamard, hadamard_matrix, remove_mean_bias, seeded_signs


@pytest.mark.parametrize("n", [16, 32, 64, 128, 256])
def test_hadamard_is_orthonormal(n):
    h = hadamard_matrix(n, dtype=torch.float64)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.allclose(h.abs(), torch.full_like(h, n ** -0.5), atol=1e-15, rtol=0)
    hs = hadamard_matrix(n, seeded_signs(n, 7), dtype=torch.float64)
    assert torch.allclose(hs @ hs.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)


@pytest.mark.parametrize("n,signed", [(16, False), (32, True), (64, True)])
def test_blockwise_rotation_preserves_products(n, signed):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(24, 200, generator=g), torch.randn(40, 200, generator=g)  # K=200: padded
    signs = seeded_signs(n, 3) if signed else None
    prod = apply_hadamard(a, n, signs) @ apply_hadamard(b, n, signs).T
    assert torch.allclose(prod, a @ b.T, atol=1e-4, rtol=1e-4)


def test_rotation_spreads_an_outlier():
    x = torch.zeros(1, 32)
    x[0, 5] = 32.0
    y = apply_hadamard(x, 32)
    assert torch.allclose(y.abs(), torch.full_like(y, 32 / 32 ** 0.5))


def test_seeded_signs_reproduce():
    assert torch.equal(seeded_signs(16, 11), seeded_signs(16, 11))
    assert not torch.equal(seeded_signs(64, 11), seeded_signs(64, 12))
    assert set(seeded_signs(64, 1).unique().tolist()) == {-1.0, 1.0}


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="16, 32"):
        hadamard_matrix(24)


def test_mean_bias_removal_returns_the_rank_one_term():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 50, 64, generator=g) + torch.linspace(-3, 3, 64)
    centred, mu = remove_mean_bias(x)
    assert torch.allclose(centred.reshape(-1, 64).mean(0), torch.zeros(64), atol=1e-5)
    w = torch.randn(16, 64, generator=g)
    assert torch.allclose(centred @ w.T + mu @ w.T, x @ w.T, atol=1e-4)


@pytest.mark.parametrize("n", [16, 32, 256])
def test_butterfly_equals_the_matrix_product(n):
    x = torch.randn(8, 3 * n, generator=torch.Generator().manual_seed(2), dtype=torch.float64).float()
    signs = seeded_signs(n, 5)
    dense = (x.double().reshape(8, 3, n) @ hadamard_matrix(n, signs, torch.float64)).reshape(8, 3 * n)
    assert torch.allclose(apply_hadamard(x, n, signs).double(), dense, atol=1e-5, rtol=0)
