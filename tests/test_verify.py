"""The build's check (verify.py) on plain tensors: where its line between float rounding and a
wrong translation lies."""

from __future__ import annotations

import pytest
import torch

from lazygrad import verify


def _small_difference_of_large_terms() -> tuple[torch.Tensor, torch.Tensor]:
    """(exact in float64, torch's float32 result): sums of +-1e3 terms that nearly cancel, so
    float32's rounding is large against the result's own magnitude."""
    generator = torch.Generator().manual_seed(0)
    large = torch.randn(64, 2048, generator=generator, dtype=torch.float64) * 1e3
    small = torch.randn(64, 2048, generator=generator, dtype=torch.float64) * 0.05
    terms = torch.cat([large, small - large], -1)
    terms = terms[:, torch.randperm(4096, generator=generator)]
    return terms.sum(-1), terms.float().sum(-1)


def test_a_difference_within_torchs_own_rounding_passes():
    exact, wanted = _small_difference_of_large_terms()
    actual = (exact + 2 * (wanted.double() - exact).flip(0)).float()  # another rounding, 2x
    fixed = verify.tolerance(torch.float32)
    error = (actual - wanted).abs().max().item()
    assert error > fixed[0] * wanted.abs().max().item() + fixed[1]  # over the fixed tolerance
    verify._compare([actual], [wanted], "gradient", lambda: [exact])


def test_a_wrong_result_fails_even_when_rounding_is_large():
    exact, wanted = _small_difference_of_large_terms()
    actual = wanted.clone()
    actual[3] += 0.05 * wanted.abs().max()
    with pytest.raises(verify.VerificationError, match="own float rounding"):
        verify._compare([actual], [wanted], "gradient", lambda: [exact])


def test_without_a_float64_reference_the_fixed_tolerance_decides():
    exact, wanted = _small_difference_of_large_terms()
    actual = (exact + 2 * (wanted.double() - exact).flip(0)).float()
    with pytest.raises(verify.VerificationError):
        verify._compare([actual], [wanted], "gradient", lambda: None)
