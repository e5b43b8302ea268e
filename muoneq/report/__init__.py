"""Reports of sweep studies (``muoneq report``): tables in Markdown and LaTeX with mean ± std
over seeds, paired differences against baselines with 95% intervals (``paired``), token-efficiency
speedups (``speedup``), heatmaps and the robustness number, K / learning-rate sweep plots,
learning curves.

Public API::

    from muoneq.report import load_study_data, write_report
    report = write_report(load_study_data("sweeps/ablation-cifar10.yaml"))
"""

from muoneq.report.build import Report, write_report
from muoneq.report.records import StudyData, load_study_data

__all__ = ["Report", "StudyData", "load_study_data", "write_report"]
