"""Reports of sweep studies (``muoneq report``): tables in Markdown and LaTeX with mean ± std
over seeds, paired differences against baselines with 95% intervals (``paired``), token-efficiency
speedups (``speedup``), heatmaps and the robustness number, K / learning-rate sweep plots,
learning curves, and Optuna's own views of the study (``optuna_views``). What a report holds is
the ``report:`` section of the sweep file (:mod:`muoneq.suite.sweeps.report_spec`); the report reads
the study through :mod:`muoneq.suite.sweeps` (which never imports the report).

Public API::

    from muoneq.suite.report import load_study_data, write_report
    report = write_report(load_study_data("sweeps/ablation-cifar10.yaml"))
"""

from muoneq.suite.report.build import Report, write_report
from muoneq.suite.report.records import StudyData, load_study_data

__all__ = ["Report", "StudyData", "load_study_data", "write_report"]
