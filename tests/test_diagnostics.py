"""Spectral diagnostics against float64 NumPy references (paper Section 3)."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch

from muoneq import diag_pre, newton_schulz
from muoneq.diagnostics import (
    condition_number,
    error_decomposition,
    kappa_i,
    ns_lower_bound,
    polar_factor,
    singular_value_entropy,
    spectrum,
    stable_rank,
    theorem_applies,
)
from muoneq.newton_schulz import POLAR_EXPRESS, TAYLOR, newton_schulz_iterates
from muoneq.suite.spectra.ns_geometry_study import (
    StudyConfig,
    rotation_invariant,
    run_study,
    scale_imbalanced,
    write_outputs,
)
from tests.helpers.reference import QUINTIC, diag_pre_ref, ns_ref, polar_ref

RNG = np.random.default_rng(0)


def known_spectrum(m: int, n: int, sigma: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A = U diag(σ) Vᵀ with random orthonormal U (m×k), V (n×k); returns (A, U, V)."""
    k = len(sigma)
    U, _ = np.linalg.qr(RNG.standard_normal((m, k)))
    V, _ = np.linalg.qr(RNG.standard_normal((n, k)))
    return (U * sigma) @ V.T, U, V


@pytest.mark.parametrize("m,n", [(12, 20), (20, 12)])
def test_metrics_match_numpy_on_known_spectra(m, n):
    sigma = np.sort(RNG.uniform(0.05, 3.0, min(m, n)))[::-1]
    A, U, V = known_spectrum(m, n, sigma)
    t = torch.from_numpy(A)
    ref = np.linalg.svd(A, compute_uv=False)
    np.testing.assert_allclose(ref, sigma, rtol=1e-12)
    spec = spectrum(t)
    np.testing.assert_allclose(spec.sigma.numpy(), ref, rtol=1e-12)
    assert int(spec.rank) == min(m, n)
    assert stable_rank(t).item() == pytest.approx((sigma**2).sum() / sigma[0] ** 2, rel=1e-12)
    assert condition_number(t).item() == pytest.approx(sigma[0] / sigma[-1], rel=1e-10)
    np.testing.assert_allclose(kappa_i(t).numpy(), sigma[0] / sigma, rtol=1e-10)
    p = sigma**2 / (sigma**2).sum()
    assert singular_value_entropy(t).item() == pytest.approx(-(p * np.log(p)).sum(), rel=1e-12)
    # The polar factor of U·diag(σ)·Vᵀ is U·Vᵀ; numpy's SVD gives the same.
    np.testing.assert_allclose(polar_factor(t).numpy(), U @ V.T, atol=1e-12)
    np.testing.assert_allclose(polar_factor(t).numpy(), polar_ref(A), atol=1e-12)


def test_rank_tolerance_and_rank_deficient_matrices():
    sigma = np.array([2.0, 1.0, 0.5, 0.0, 0.0])
    A, U, V = known_spectrum(9, 7, sigma)
    t = torch.from_numpy(A)
    spec = spectrum(t)
    assert int(spec.rank) == 3  # the two zero singular values are rounding noise ~1e-16
    assert condition_number(t).item() == pytest.approx(4.0, rel=1e-10)
    assert torch.isinf(kappa_i(t)[3:]).all()
    np.testing.assert_allclose(polar_factor(t).numpy(), U[:, :3] @ V[:, :3].T, atol=1e-12)
    # A looser tolerance drops σ = 0.5 (0.5/2 = 0.25 < 0.3).
    assert int(spectrum(t, rtol=0.3).rank) == 2
    assert condition_number(t, rtol=0.3).item() == pytest.approx(2.0, rel=1e-10)
    p = sigma[:3] ** 2 / (sigma**2).sum()
    assert singular_value_entropy(t).item() == pytest.approx(-(p * np.log(p)).sum(), rel=1e-10)


def test_batched_metrics_equal_per_matrix_and_zero_matrix_is_nan():
    A = torch.randn(3, 8, 5, dtype=torch.float64)
    A[1] = 0
    spec = spectrum(A)
    for i in (0, 2):
        single = spectrum(A[i])
        torch.testing.assert_close(spec.sigma[i], single.sigma)
        assert spec.condition_number[i] == single.condition_number
        torch.testing.assert_close(polar_factor(A)[i], polar_factor(A[i]))
    assert int(spec.rank[1]) == 0
    assert math.isnan(spec.stable_rank[1]) and math.isnan(spec.condition_number[1])
    assert spec.entropy[1] == 0
    assert torch.count_nonzero(polar_factor(A)[1]) == 0


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="expected a matrix"):
        stable_rank(torch.ones(4))
    with pytest.raises(ValueError, match="rtol"):
        spectrum(torch.ones(3, 3), rtol=-1.0)
    with pytest.raises(ValueError, match="M: expected one matrix"):
        error_decomposition(torch.ones(2, 3, 4))
    with pytest.raises(ValueError, match="mode"):
        error_decomposition(torch.ones(3, 4), modes=("row", "diag"))


@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (3, 6, 10), (2, 2, 10, 6)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("coefficients", ["quintic", "polar_express"])
def test_iterates_end_at_newton_schulz_bit_for_bit(shape, dtype, coefficients):
    G = torch.randn(shape)
    iterates = list(newton_schulz_iterates(G, 5, coefficients, dtype))
    assert len(iterates) == 6 and all(X.shape == G.shape for X in iterates)
    assert torch.equal(iterates[0], newton_schulz(G, 0, coefficients, dtype))
    assert torch.equal(iterates[3], newton_schulz(G, 3, coefficients, dtype))
    assert torch.equal(iterates[-1], newton_schulz(G, 5, coefficients, dtype))


def test_error_curve_follows_the_scalar_map_of_theorem_3_1():
    """X_k = U diag(s^(k)) Vᵀ with s ← φ(s): ‖X_k − Orth(G)‖_F² = Σ (s_i^(k) − 1)²."""
    sigma = np.geomspace(1.0, 1e-3, 16)
    A, _, _ = known_spectrum(16, 40, sigma)
    d = error_decomposition(torch.from_numpy(A), modes="none", steps=8)["none"]
    s = sigma / np.linalg.norm(sigma)
    expected = []
    for _ in range(9):
        expected.append(np.sqrt(((s - 1) ** 2).sum()))
        a, b, c = QUINTIC
        s = a * s + b * s**3 + c * s**5
    np.testing.assert_allclose(d.finite_step_curve, expected, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(d.relative_curve, np.array(expected) / 4.0, rtol=1e-9, atol=1e-12)


def test_theorem_hypothesis():
    for abc in (QUINTIC, TAYLOR, *POLAR_EXPRESS):
        assert theorem_applies(*abc)
    assert not theorem_applies(1.0, -0.5, 0.0)  # a must exceed 1
    assert not theorem_applies(2.0, 0.5, -1.0)  # q(t) > a near t = 0
    assert not theorem_applies(2.0, -3.0, 0.5)  # q(1) < 0
    assert not theorem_applies(1.5, -5.0, 4.0)  # q(1) = 0.5 > 0 but q(0.625) < 0
    assert theorem_applies(2.0, -4.0, 2.5)  # vertex t* = 0.8 inside (0, 1) with q = 0.4 > 0
    with pytest.raises(ValueError, match="coefficients"):
        ns_lower_bound(spectrum(torch.randn(4, 6)), 2, (2.0, 0.5, -1.0))


@pytest.mark.parametrize("coefficients,steps", [("quintic", 10), ("taylor", 10),
                                                 ("polar_express", 5)])
@pytest.mark.parametrize("family", ["rotation", "scale"])
def test_theorem_bound_lies_below_the_measured_error(coefficients, steps, family):
    g = torch.Generator().manual_seed(3)
    M = (rotation_invariant(24, 48, 1e3, g) if family == "rotation"
         else scale_imbalanced(48, 24, 100.0, g))
    for d in error_decomposition(M, steps=steps, coefficients=coefficients).values():
        measured, bound = np.array(d.relative_curve), np.array(d.bound_curve)
        assert (bound <= measured + 1e-12).all(), (d.mode, measured, bound)
        assert bound[0] == pytest.approx(measured[0], rel=1e-12)  # every s_i^(0) < 1: equality
        assert bound[1] > 0.1  # not vacuous on a spread spectrum
        if coefficients != "polar_express":  # tight while every s_i ≪ 1 (φ(s) ≈ a·s)
            assert measured[1] - bound[1] < 0.05


def test_decomposition_triangle_inequality_and_numpy_reference():
    g = torch.Generator().manual_seed(1)
    M = scale_imbalanced(20, 32, 100.0, g)
    result = error_decomposition(M, steps=5, eps=1e-8)
    assert list(result) == ["none", "R", "C", "RC"]
    orth_m = polar_ref(M.numpy())
    for mode, d in result.items():
        for fin, tot in zip(d.finite_step_curve, d.total_curve, strict=True):
            assert tot <= fin + d.bias + 1e-12
        S = diag_pre_ref(M.numpy(), mode, 1e-8)
        X5 = ns_ref(S, (QUINTIC,) * 5)
        assert d.finite_step_error == pytest.approx(np.linalg.norm(X5 - polar_ref(S)), rel=1e-9)
        assert d.bias == pytest.approx(np.linalg.norm(polar_ref(S) - orth_m), rel=1e-9, abs=1e-12)
        assert d.total_error == pytest.approx(np.linalg.norm(X5 - orth_m), rel=1e-9)
        assert d.condition_number == pytest.approx(np.linalg.cond(S), rel=1e-9)
    assert result["none"].bias < 1e-12


def test_decomposition_in_bfloat16_measures_the_optimizers_rounding():
    M = torch.randn(16, 24, dtype=torch.float64)
    d = error_decomposition(M, modes="R", ns_dtype="bfloat16")["R"]
    X5 = newton_schulz(diag_pre(M, "R"), 5, "quintic", torch.bfloat16).double()
    assert d.finite_step_error == pytest.approx((X5 - polar_factor(diag_pre(M, "R"))).norm().item())


def test_row_normalization_makes_every_row_norm_one():
    M = scale_imbalanced(30, 50, 1e3, torch.Generator().manual_seed(2))
    torch.testing.assert_close(diag_pre(M, "R", eps=0).norm(dim=1), torch.ones(30, dtype=M.dtype))
    torch.testing.assert_close(diag_pre(M, "C", eps=0).norm(dim=0), torch.ones(50, dtype=M.dtype))


@pytest.mark.parametrize("seed", range(3))
def test_two_sided_normalization_gives_the_smallest_condition_number(seed):
    """Scale-imbalanced D₁GD₂: κ(RC) < κ(R), κ(C) < κ(none) (the picture of Figure fig1)."""
    M = scale_imbalanced(64, 96, 1e3, torch.Generator().manual_seed(seed))
    kappa = {mode: condition_number(diag_pre(M, mode, 0.0)).item() for mode in
             ("none", "R", "C", "RC")}
    assert kappa["RC"] < min(kappa["R"], kappa["C"])
    assert max(kappa["R"], kappa["C"]) < kappa["none"]


def test_normalization_barely_changes_rotation_invariant_spectra():
    M = rotation_invariant(128, 256, 100.0, torch.Generator().manual_seed(4))
    result = error_decomposition(M, steps=5)
    for mode in ("R", "C", "RC"):
        assert result[mode].condition_number == pytest.approx(100.0, rel=0.2)
        assert result[mode].relative_error == pytest.approx(result["none"].relative_error,
                                                            abs=0.01)


def _case(row: dict) -> tuple:
    return row["family"], int(row["m"]), int(row["seed"]), row["mode"]


@pytest.mark.slow
def test_study_writes_resumes_and_refuses_a_different_configuration(tmp_path):
    config = StudyConfig(sizes=((12, 20), (20, 12)), kappas=(10.0,), scale_ranges=(100.0,),
                         seeds=2, steps=4, report_step=3)
    out = tmp_path / "study"
    logs: list[str] = []
    result = run_study(config, out, log=logs.append)
    assert len(result.summary) == 2 * 2 * 2 * 4  # families × sizes × seeds × modes
    assert len(result.curves) == len(result.summary) * 5
    first = {_case(r): float(r["ns_rel_error"]) for r in result.summary}

    # Simulate a crash half-way through the last matrix: its summary rows are cut short.
    path = out / "summary.csv"
    rows = list(csv.DictReader(path.open()))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=rows[0].keys())
        writer.writeheader()
        writer.writerows(rows[:-2])
        f.write("scale,100.0,20,12,1,RC,12,3.")  # a line cut short by the kill
    logs.clear()
    again = run_study(config, out, log=logs.append)
    assert "7 matrices done, 1 to go" in logs[0] and len(logs) == 2
    assert len(again.summary) == len(result.summary)
    assert len(list(csv.DictReader((out / "curves.csv").open()))) == len(result.curves)
    assert {_case(r): float(r["ns_rel_error"]) for r in again.summary} == pytest.approx(first)

    with pytest.raises(ValueError, match="steps"):
        run_study(StudyConfig(**{**config.__dict__, "steps": 6}), out, log=logs.append)
    paths = write_outputs(again, config, out)
    assert {p.name for p in paths} == {"fig1_rotation.png", "fig1_scale.png",
                                       "decomposition_rotation.png", "decomposition_scale.png",
                                       "theorem_bound.png"}
    assert all(p.stat().st_size > 10_000 for p in paths)
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert "| scale | 100 | RC |" in (out / "summary.md").read_text()


def test_cli_reports_bad_arguments(tmp_path, capsys):
    from muoneq.suite.cli import main

    with pytest.raises(SystemExit):
        main(["spectra", "--sizes", "12by20"])
    assert main(["spectra", "--kappas", "0.5", "--out", str(tmp_path)]) == 2
    assert "kappas" in capsys.readouterr().err


def test_figures_keep_titles_inside_and_legends_off_the_data():
    """What the eye checks, as numbers: every title lies inside the figure, legends sit below
    the panels (none on an axes), and linear axes carry plain tick labels."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from muoneq.suite.spectra import figures

    modes, spreads, sizes = ("none", "R", "C", "RC"), (10.0, 1000.0), ((8, 8), (8, 32))
    curves = {(s, m, n, mo): [1.0 - 0.1 * k for k in range(6)]
              for s in spreads for m, n in sizes for mo in modes}
    stats = {"condition_number": 30.0, "ns_error": 1.0, "bias": 0.5, "stable_rank": 30.0,
             "entropy": 2.0}
    summary = dict.fromkeys(curves, stats)
    made = [
        figures.study_fig1(curves, summary, "scale", spreads, sizes, modes, 5),
        figures.study_decomposition(summary, "rotation", spreads, sizes, modes, 5),
        figures.study_bound([("a", {m: [1.0, 0.5] for m in modes},
                              {m: [0.9, 0.4] for m in modes})], modes),
        figures.training_curves({m: [[1.0, 0.5, 0.2]] * 3 for m in modes},
                                "step 12345 (100% of training), 148 matrices"),
    ]
    for fig in made:
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        renderer = canvas.get_renderer()
        box = fig.bbox
        title = fig._suptitle.get_window_extent(renderer)
        assert box.x0 <= title.x0 and title.x1 <= box.x1 and title.y1 <= box.y1, title
        assert all(ax.get_legend() is None for ax in fig.axes) and len(fig.legends) == 1
        legend = fig.legends[0].get_window_extent(renderer)  # not cut at the edges
        assert box.x0 <= legend.x0 and legend.x1 <= box.x1 and box.y0 <= legend.y0, legend
    stable_rank_axis = made[1].axes[2 * len(sizes)]  # third row: stable rank
    assert stable_rank_axis.get_ylabel() == "stable rank sr(S(M))"
    assert stable_rank_axis.get_yscale() == "linear"
