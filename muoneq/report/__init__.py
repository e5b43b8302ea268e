"""Reports of sweep studies (``muoneq report``): tables in Markdown and LaTeX with mean ± std
over seeds, paired differences against baselines with 95% intervals (``paired``), token-efficiency
speedups (``speedup``), heatmaps and the robustness number, K / learning-rate sweep plots,
learning curves. What a report holds is the ``report:`` section of the sweep file
(:mod:`muoneq.report.schema`).

Public API::

    from muoneq.report import load_study_data, write_report
    report = write_report(load_study_data("sweeps/ablation-cifar10.yaml"))
"""

#: Names loaded on first use (PEP 562): the sweep file's schema imports
#: :mod:`muoneq.report.schema` alone, without the modules that read studies.
_LAZY = {
    "Report": "muoneq.report.build", "write_report": "muoneq.report.build",
    "StudyData": "muoneq.report.records", "load_study_data": "muoneq.report.records",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'muoneq.report' has no attribute {name!r}")


__all__ = ["Report", "StudyData", "load_study_data", "write_report"]
