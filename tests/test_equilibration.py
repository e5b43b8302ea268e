"""DiagPre (eq. (4)) against explicit diagonal matrices."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from muoneq import diag_pre
from tests.helpers.reference import diag_pre_ref


@settings(max_examples=30, deadline=None)
@given(
    m=st.integers(1, 9), n=st.integers(1, 9), seed=st.integers(0, 2**16),
    mode=st.sampled_from(["none", "R", "C", "RC"]), eps=st.sampled_from([0.0, 1e-8, 1e-2]),
)
def test_matches_explicit_diagonal_scaling(m, n, seed, mode, eps):
    M = np.random.default_rng(seed).standard_normal((m, n))
    ours = diag_pre(torch.from_numpy(M), mode, eps).numpy()
    np.testing.assert_allclose(ours, diag_pre_ref(M, mode, eps), rtol=1e-12, atol=1e-14)


def test_row_mode_makes_every_row_unit_norm():
    scales = torch.logspace(-3, 3, 7, dtype=torch.float64)[:, None]
    M = torch.randn(7, 5, dtype=torch.float64) * scales
    out = diag_pre(M, "R", 0.0)
    torch.testing.assert_close(out.norm(dim=1), torch.ones(7, dtype=torch.float64))
    out = diag_pre(M, "C", 0.0)
    torch.testing.assert_close(out.norm(dim=0), torch.ones(5, dtype=torch.float64))


def test_rc_uses_both_scales_from_the_same_matrix():
    M = torch.tensor([[3.0, 4.0], [0.0, 2.0]], dtype=torch.float64)
    # row sums of squares 25, 4; column sums 9, 20
    expected = torch.tensor([[3 / (5 * 3), 4 / (5 * 20**0.5)], [0.0, 2 / (2 * 20**0.5)]],
                            dtype=torch.float64)
    torch.testing.assert_close(diag_pre(M, "RC", 0.0), expected)


def test_low_precision_input_keeps_its_dtype_and_is_reduced_in_float32():
    M = torch.randn(16, 8, dtype=torch.bfloat16) * 1e3
    out = diag_pre(M, "R", 1e-8)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float().norm(dim=1), torch.ones(16), rtol=2e-2, atol=0)


def test_batched_matrices_are_normalized_independently():
    M = torch.randn(3, 4, 6, dtype=torch.float64)
    out = diag_pre(M, "RC", 1e-8)
    for i in range(3):
        torch.testing.assert_close(out[i], diag_pre(M[i], "RC", 1e-8))


def test_unknown_mode():
    with pytest.raises(ValueError, match="mode"):
        diag_pre(torch.ones(2, 2), "rowcolumn")
