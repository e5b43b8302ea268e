"""Matplotlib figures of the spectral diagnostics, in the style of the paper's Figures 1, 2 and
7.

All functions return a ``matplotlib.figure.Figure`` built without pyplot's global state (Agg
canvas), so they are safe in training processes and headless machines; the caller saves it or
hands it to TensorBoard's ``add_figure``.
"""

from __future__ import annotations

import statistics

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

MODE_STYLE = {
    "none": dict(color="0.35", label="none (direct)"),
    "R": dict(color="tab:blue", label="R (row)"),
    "C": dict(color="tab:orange", label="C (column)"),
    "RC": dict(color="tab:green", label="RC (row+column)"),
}
SPREAD_LINES = ("-", "--", ":", "-.")
FAMILY_TITLE = {
    "rotation": "rotation-invariant spectra U·diag(σ)·Vᵀ, spread = κ",
    "scale": "scale-imbalanced D₁·G·D₂, spread = scale range ρ",
}


def new_figure(rows: int, cols: int, width: float = 4.0, height: float = 3.2):
    fig = Figure(figsize=(width * cols, height * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    return fig, axes


def _bars(ax, groups, modes, values, *, log: bool, ylabel: str) -> None:
    """Grouped bars: one group per entry of ``groups``, one bar per mode."""
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        xs = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(groups))]
        ys = [values.get((g, mode), float("nan")) for g in groups]
        ax.bar(xs, ys, width, color=MODE_STYLE[mode]["color"], label=MODE_STYLE[mode]["label"])
    ax.set_xticks(range(len(groups)), [f"{g:g}" for g in groups])
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)


def _legend_below(fig, handles, columns: int = 4) -> None:
    """One legend for the whole figure, below the panels (it never covers data), in up to
    ``columns`` columns."""
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), columns),
               fontsize=8, frameon=False)


def _mode_handles(modes) -> list[Line2D]:
    return [Line2D([], [], color=MODE_STYLE[m]["color"], label=MODE_STYLE[m]["label"])
            for m in modes]


def study_fig1(curves: dict, summary: dict, family: str, spreads, sizes, modes, report_step):
    """The paper's Figure 1 for one family: top, relative error to ``Orth(S(M))``
    over NS steps (colour = normalization, line style = spread); bottom, condition number of
    ``S(M)`` (none = raw).

    ``curves[(spread, m, n, mode)]`` is the seed-mean curve; ``summary[(spread, m, n, mode)]``
    the seed-mean summary stats.
    """
    fig, axes = new_figure(2, len(sizes))
    for col, (m, n) in enumerate(sizes):
        top, bottom = axes[0, col], axes[1, col]
        for s, spread in enumerate(spreads):
            for mode in modes:
                ys = curves.get((spread, m, n, mode))
                if ys is not None:
                    top.plot(range(len(ys)), ys, SPREAD_LINES[s % len(SPREAD_LINES)],
                             color=MODE_STYLE[mode]["color"], lw=1.6)
        top.axvline(report_step, color="0.8", lw=0.8, zorder=0)
        top.set_title(f"{m}×{n}")
        top.set_xlabel("Newton–Schulz step k")
        top.set_ylabel("‖X_k − Orth(S(M))‖_F / √r")
        top.set_ylim(0, 1.02)
        top.grid(alpha=0.3)
        kappa = {(sp, mo): summary[(sp, m, n, mo)]["condition_number"]
                 for sp in spreads for mo in modes if (sp, m, n, mo) in summary}
        _bars(bottom, list(spreads), modes, kappa, log=True, ylabel="κ(S(M))")
        bottom.set_xlabel("spread")
    _legend_below(fig, _mode_handles(modes) + [
        Line2D([], [], color="k", ls=SPREAD_LINES[i % len(SPREAD_LINES)], label=f"spread {s:g}")
        for i, s in enumerate(spreads)])
    fig.suptitle(f"Finite-step NS error and condition number (as the paper's Figure 1)\n"
                 f"{FAMILY_TITLE[family]}", fontsize=11)
    return fig


def study_decomposition(summary: dict, family: str, spreads, sizes, modes, report_step):
    """Eq. (5) per size: finite-step error, preconditioning bias, stable rank
    and entropy (all on linear axes)."""
    rows = (
        ("ns_error", f"‖NS{report_step}(S(M)) − Orth(S(M))‖_F", False),
        ("bias", "‖Orth(S(M)) − Orth(M)‖_F", False),
        ("stable_rank", "stable rank sr(S(M))", False),
        ("entropy", "entropy H(p) of S(M)", False),
    )
    fig, axes = new_figure(len(rows), len(sizes), height=2.8)
    for col, (m, n) in enumerate(sizes):
        for row, (key, label, log) in enumerate(rows):
            values = {(sp, mo): summary[(sp, m, n, mo)][key]
                      for sp in spreads for mo in modes if (sp, m, n, mo) in summary}
            _bars(axes[row, col], list(spreads), modes, values, log=log, ylabel=label)
        axes[0, col].set_title(f"{m}×{n}")
        axes[-1, col].set_xlabel("spread")
    _legend_below(fig, _mode_handles(modes))
    fig.suptitle(f"Error decomposition of eq. (5) and spectral metrics\n"
                 f"{FAMILY_TITLE[family]}", fontsize=11)
    return fig


def study_bound(panels: list[tuple[str, dict, dict]], modes, cols: int = 2):
    """Measured relative error (solid) beside the lower bound of the paper's Theorem 3.1
    (dashed), per panel.

    ``panels`` holds ``(title, curves[mode], bounds[mode])``; they fill a grid ``cols`` wide.
    """
    rows = -(-len(panels) // cols)
    fig, axes = new_figure(rows, cols, width=4.6, height=3.2)
    for ax, (title, curves, bounds) in zip(axes.flat, panels, strict=False):
        for mode in modes:
            if mode in curves:
                style = MODE_STYLE[mode]
                ax.plot(curves[mode], "-", color=style["color"])
                ax.plot(bounds[mode], "--", color=style["color"], lw=1.0)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("Newton–Schulz step k")
        ax.set_ylabel("‖X_k − Orth(S(M))‖_F / √r")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    _legend_below(fig, _mode_handles(modes) + [
        Line2D([], [], color="k", label="measured"),
        Line2D([], [], color="k", ls="--", lw=1.0, label="lower bound of Theorem 3.1")])
    fig.suptitle("Measured finite-step error (solid) above the lower bound of the paper's "
                 "Theorem 3.1 (dashed)", fontsize=11)
    return fig


def _quartiles(xs) -> tuple[float, float]:
    """First and third quartiles (both equal to the value for a single module)."""
    if len(xs) < 2:
        return xs[0], xs[0]
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q3


def training_curves(curves: dict[str, list[list[float]]], subtitle: str):
    """The paper's Figure 2 at one training step: module-wise median with the 25–75%
    band (top) and the mean (bottom) of the relative NS error over steps, one colour per
    normalization. ``subtitle`` (the step, the matrices) is the title's second line."""
    # 4.6 inches: TensorBoard shows the image 350 pixels wide, 10-point text 10.6 pixels tall
    fig, axes = new_figure(2, 1, width=4.6, height=2.9)
    for mode, per_module in curves.items():
        style = MODE_STYLE[mode]
        steps = range(len(per_module[0]))
        columns = list(zip(*per_module, strict=True))
        median = [statistics.median(c) for c in columns]
        low, high = zip(*(_quartiles(c) for c in columns), strict=True)
        axes[0, 0].plot(steps, median, color=style["color"], label=style["label"])
        axes[0, 0].fill_between(steps, low, high, color=style["color"], alpha=0.15)
        axes[1, 0].plot(steps, [statistics.fmean(c) for c in columns], color=style["color"])
    axes[0, 0].set_ylabel("median rel. error\n(band: 25–75%)")
    axes[1, 0].set_ylabel("mean rel. error")
    axes[1, 0].set_xlabel("Newton–Schulz step k")
    for ax in axes[:, 0]:
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    _legend_below(fig, _mode_handles(list(curves)), columns=2)
    fig.suptitle(f"NS error of the pre-NS momentum (as the paper's Figure 2)\n{subtitle}",
                 fontsize=10)
    return fig
