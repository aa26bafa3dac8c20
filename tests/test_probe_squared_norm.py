"""The probe's ``squared_norm`` (proof/reference.py) against fp64 brute force: sizes around its 65,536-entry rows
(none whole, one, one and a bit, several plus a tail), non-contiguous and expanded gradients, half precision
whose squares would overflow, and non-finite entries anywhere (the caller's only finiteness check)."""

from __future__ import annotations

import pytest
import torch

from dptext.privacy.proof.reference import NORM_CHUNK, squared_norm

SIZES = (0, 1, 7, NORM_CHUNK - 1, NORM_CHUNK, NORM_CHUNK + 1, 3 * NORM_CHUNK + 5)


def brute_force(gradient: torch.Tensor) -> float:
    return float(gradient.double().pow(2).sum())


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_squared_norm_is_the_fp64_sum_of_squares_at_every_size(size, dtype):
    gradient = torch.randn(size, generator=torch.Generator().manual_seed(size), dtype=torch.float64).to(dtype)
    got = squared_norm(gradient)
    assert got.dtype == torch.float64 and got.shape == (1,)
    assert float(got) == pytest.approx(brute_force(gradient), rel=1e-12 if dtype == torch.float64 else 1e-6, abs=0)


@pytest.mark.parametrize("make", [lambda: torch.randn(300, 700).t(),  # a transposed (non-contiguous) gradient
                                  lambda: torch.randn(1, NORM_CHUNK + 9).expand(3, -1),  # stride 0
                                  lambda: torch.randn(5, 2 * NORM_CHUNK)[:, 3::2]])  # strided, odd row length
def test_squared_norm_of_a_non_contiguous_gradient(make):
    gradient = make()
    assert not gradient.is_contiguous()
    assert float(squared_norm(gradient)) == pytest.approx(brute_force(gradient), rel=1e-6)


def test_squared_norm_of_half_precision_whose_squares_overflow_is_finite():
    # each row's norm (≈ 5e4) is a float16, its sum of squares (≈ 2.6e9) is not: it must not become inf
    gradient = torch.full((NORM_CHUNK + 3,), 200.0, dtype=torch.float16)
    assert float(squared_norm(gradient)) == pytest.approx(brute_force(gradient), rel=2e-3)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", [0, NORM_CHUNK - 1, NORM_CHUNK + 1])  # a whole row, its last entry, the tail
def test_a_non_finite_entry_makes_the_squared_norm_non_finite(bad, where):
    gradient = torch.randn(NORM_CHUNK + 2, generator=torch.Generator().manual_seed(0))
    gradient[where] = bad
    assert not bool(torch.isfinite(squared_norm(gradient)).all())
