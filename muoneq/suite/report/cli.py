"""``muoneq report <sweep file or study folder>``: tables, heatmaps and plots of a study."""

from __future__ import annotations

import argparse
from pathlib import Path

from muoneq.suite.report.build import nothing_to_report, write_report
from muoneq.suite.report.records import load_study_data
from muoneq.suite.sweeps.tensorboard_view import command as tensorboard_command
from muoneq.suite.sweeps.tensorboard_view import study_runs, write_view


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="muoneq report",
        description="Write the tables (Markdown, LaTeX) with paired differences over seeds "
                    "(95% intervals) and token-efficiency speedups, heatmaps, robustness, sweep "
                    "plots and learning curves of a study to <study>/report/ and TensorBoard.",
    )
    p.add_argument("target", type=Path,
                   help="a sweep file (sweeps/x.yaml, or the name x of a sweep muoneq ships: "
                        "its report section is used) or a study folder (runs/x)")
    p.add_argument("--storage", default=None, help="the study's storage, if not the default "
                   "journal file (e.g. postgresql://user@host/db)")
    p.add_argument("--runs-dir", type=Path, default=Path("runs"),
                   help="where studies live when TARGET is a sweep file (default ./runs)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default "
                   "<study>/report)")
    p.add_argument("--no-tensorboard", action="store_true", help="skip TensorBoard images")
    p.add_argument("--skip-empty", action="store_true",
                   help="a study without a finished run, or whose runs all diverged, is "
                        "skipped with one line (exit 0) instead of an error (`make report` "
                        "over every study)")
    args = p.parse_args(argv)
    data = load_study_data(args.target, storage=args.storage, runs_dir=args.runs_dir)
    why = nothing_to_report(data)
    if why is not None and args.skip_empty:
        print(f"muoneq report: skipped study {data.spec.study} ({data.study_dir}): it {why}")
        return 0
    report = write_report(data, args.out, tensorboard=not args.no_tensorboard)
    if not args.no_tensorboard:  # the runs by short names, with the report's figures
        write_view(data.study_dir, study_runs(data.spec, data.trials))
    print(report.markdown)
    print(f"\nwritten to {report.out_dir}/ ({len(report.files)} files); "
          f"TensorBoard: {tensorboard_command(data.study_dir)}")
    return 0
