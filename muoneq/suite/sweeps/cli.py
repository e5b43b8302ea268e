"""``muoneq sweep SWEEP.yaml``: run (or continue) the study a sweep file describes."""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
from pathlib import Path

import optuna

from muoneq.suite.cli import program
from muoneq.suite.errors import Interrupted
from muoneq.suite.folders import suite_folder
from muoneq.suite.runtime.metrics import METRICS_FILE
from muoneq.suite.sweeps import miniature
from muoneq.suite.sweeps.driver import Driver, DriverOptions
from muoneq.suite.sweeps.eta import study_estimate
from muoneq.suite.sweeps.launch import describe_start, trial_command, warm_module
from muoneq.suite.sweeps.ledger import DriverId, Ledger, published_plan
from muoneq.suite.sweeps.plan import describe_plan
from muoneq.suite.sweeps.spec import Point, SweepError, format_value, load_sweep
from muoneq.suite.sweeps.storage import storage_label
from muoneq.suite.sweeps.study import existing_study
from muoneq.suite.sweeps.tensorboard_view import command as tensorboard_command
from muoneq.suite.sweeps.validate import point_check, preflight, search_points


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="muoneq sweep",
        description="Run an Optuna study of trial processes; re-running the same command "
                    "continues it (finished runs are never repeated).",
    )
    shipped = ", ".join(sorted(f.stem for f in suite_folder("sweeps").glob("*.yaml")))
    p.add_argument("sweep", type=Path,
                   help=f"a sweep file (e.g. sweeps/ablation-cifar10.yaml) or the name of one "
                        f"muoneq ships: {shipped}")
    p.add_argument("--storage", default=None,
                   help="journal:<file>, sqlite:///<file>, postgresql://user@host:port/db "
                        "(default: journal file runs/<study>/optuna.journal)")
    p.add_argument("--workers", type=int, default=1,
                   help="trials at once on this machine (default 1)")
    p.add_argument("--devices", default=None,
                   help="comma-separated accelerator ids split between workers "
                        "(default: the visible ones)")
    p.add_argument("--runs-dir", type=Path, default=Path("runs"),
                   help="folder holding runs/<study>/ (default ./runs)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the sweep file, e.g. --set seeds=[0] "
                        "--set launch.nproc=4 (repeatable)")
    p.add_argument("--override", dest="train_overrides", action="append", default=[],
                   metavar="KEY=VALUE",
                   help="extra training override for every run, e.g. trainer.max_epochs=10 "
                        "(part of the study's identity; repeatable)")
    p.add_argument("--poll", type=float, default=5.0,
                   help="seconds between looks for work while other workers hold the last runs")
    p.add_argument("--mini", action="store_true",
                   help="the study in miniature, <study>-mini: its sweep file's mini: section "
                        "(a tiny model on a CPU, local data prepared first, fewer values on the "
                        "same axes; docs/reproduce.md)")
    p.add_argument("--report", action="store_true",
                   help="once every run is done, write the study's report (muoneq report on "
                        "the study this command ran, whatever its --set, --mini or --runs-dir; "
                        "the make targets pass it)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true",
                      help="list the runs and the first command, run nothing")
    mode.add_argument("--status", action="store_true", help="print the study's counts and exit")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    spec = load_sweep(args.sweep, args.sets, mini=args.mini)
    if args.mini:
        miniature.prepare(spec, args.runs_dir / spec.study)
    spec.overrides = list(spec.overrides) + list(args.train_overrides)
    devices = args.devices.split(",") if args.devices else None
    options = DriverOptions(storage=args.storage, workers=args.workers, devices=devices,
                            runs_dir=args.runs_dir, poll_s=args.poll)
    try:
        if args.dry_run:
            return _dry_run(spec, options)
        if args.status:
            return _status(spec, options)
        driver = Driver(spec, options)
    except SweepError:
        raise
    except ValueError as err:  # e.g. a malformed --storage URL
        raise SweepError(str(err)) from None
    except KeyboardInterrupt:  # Ctrl-C before the driver handles signals (Driver.run)
        raise Interrupted("sweep interrupted (Ctrl-C) while checking the study, before any "
                          "trial started; run the same command to start it") from None
    where = storage_label(args.storage, driver.study_dir)
    logging.info("study %s on %s, %d worker(s), runs in %s", spec.study, where, args.workers,
                 driver.study_dir)
    logging.info("curves as they come, each run by a short name: %s",
                 tensorboard_command(driver.study_dir))
    s = driver.run()
    again = f"{program()} sweep {shlex.join(argv)}"
    print(f"study {spec.study}: {s.done}/{s.total} runs done"
          + (f", {len(s.exhausted)} failed for good (a config error, or out of retries; see "
             f"their trial.log): {s.exhausted}" if s.exhausted else "")
          + (f", {s.pending} to go" if s.pending else ""))
    if s.interrupted:
        print(f"stopped by {signal.Signals(s.stopped_by).name}; continue with: {again}")
    elif s.pending:
        print(f"continue with: {again}")
    report = ["report", str(driver.study_dir)]
    if args.report and s.exit_code == 0 and not s.pending:
        # through the command line, as a user would: the report reads the sweeps, which never
        # import the report
        from muoneq.suite.cli import main as command

        return command([*report, *(["--storage", args.storage] if args.storage else [])])
    if s.done:
        print(f"report: {program()} {shlex.join(report)}"
              + (f" --storage {where}" if args.storage else ""))
    return s.exit_code


def _status(spec, options: DriverOptions) -> int:
    """The study's counts and plan; creates nothing (a study not started is said so)."""
    study_dir = options.runs_dir / spec.study
    where = storage_label(options.storage, study_dir)
    found = existing_study(spec, options.storage, study_dir)
    if found is None:
        print(f"study {spec.study} ({where}): not started; `muoneq sweep` without --status "
              "starts it")
        return 0
    logging.getLogger("muoneq.suite.sweeps").setLevel(logging.WARNING)  # the plan is printed below
    check = point_check(spec, study_dir) if spec.bracket is not None else None
    ledger = Ledger(*found, spec, DriverId.new(study_dir), study_dir, check)
    (s, eta), plan = study_estimate(ledger, workers=1), ledger.plan
    grows = plan is not None and not plan.finished
    print(f"study {spec.study} ({where}): {s.done}/{s.total} runs done, "
          f"{len(s.exhausted)} out of retries, {s.pending} to go"
          + (" (the plan adds more as results come in)" if grows else ""))
    if eta is not None:  # at the trials running now, or one at a time
        print(f"  {eta.describe()}")
    for line in plan.lines() if plan is not None else []:
        print(f"  {line}")
    return 0


def _dry_run(spec, options: DriverOptions) -> int:
    study_dir = options.runs_dir / spec.study
    composed = preflight(spec, options.storage, study_dir)
    seeds = len(spec.seeds)
    if spec.kind == "tpe":
        print(f"study {spec.study}: TPE over {', '.join(spec.search.params)}, "
              f"{spec.search.n_trials} configurations × {seeds} seeds")
    elif spec.kind == "coordinate":
        s = spec.search
        print(f"study {spec.study}: coordinate descent over {', '.join(s.params)} from "
              f"{Point(tuple(s.start.items())).key}, up to {s.max_cycles} cycles, threshold "
              f"{s.threshold} (each point × {seeds} seeds; the path decides the points)")
        for name, p in s.params.items():
            print(f"  {name}: {', '.join(format_value(v) for v in p.values)}")
    else:
        points = spec.points()
        print(f"study {spec.study}: {len(points)} points × {seeds} seeds = "
              f"{len(points) * seeds} runs")
        for p in points:
            print(f"  {p.key}")
        b = spec.bracket
        if b is not None:
            print(f"bracketing {', '.join(b.axes)}: up to {b.max_extensions} more values per "
                  "family and axis, each × seeds, while a family's best sits on an edge")
    said = published_plan(spec, options.storage, study_dir)
    if said is not None:
        print("the study so far (it exists):")
        for line in describe_plan(said):
            print(f"  {line}")
    first = next(iter(search_points(spec))) if spec.search is not None else spec.points()[0]
    argv, _, _ = trial_command(spec, first, spec.seeds[0], first.run_dir(study_dir,
                                                                         spec.seeds[0]))
    print("first command:", shlex.join(argv))
    print(describe_start(*warm_module(spec)))
    print(f"checked: {composed} training configs compose and type-check as `muoneq train`"
          + {"tpe": " (the search's bounds)", "coordinate": " (every axis value at the start)",
             "grid": " (every value of every axis, once in each config shape)"}[spec.kind]
          + f"; objective {spec.objective.metric} and the report's metrics are numbers their "
            f"{METRICS_FILE} holds on this machine"
          if composed else "not checked: launch.command does not run `muoneq train`")
    return 0
