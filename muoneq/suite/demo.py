"""``make demo`` (``muoneq demo``): a miniature of the paper's ablation, offline on a CPU.

End to end in minutes on two cores, its trials forked from a warm server
(:mod:`muoneq.suite.sweeps.warm`); ``make miniatures`` records its time and table
(``benchmarks/results/miniatures.md``).

1. **Real text that ships with Python**: the English documentation topics every Python
   installation carries (``pydoc_data.topics``, ~465 kB, one document per topic), tokenized to
   UTF-8 bytes (vocabulary 257) into token shards by ``muoneq data`` (16k validation tokens).
2. **The ablation as an Optuna study** (embedded journal storage, two trials at once, one core
   each): a tiny LLaMA (``experiment=llama_tiny_shakespeare`` on this data, 100 steps of
   16 × 128 tokens, validated every 5 steps on 8k tokens) trained with Muon-Nes and MuonEq-Nes
   R, C and RC over learning rates {2e-2, 4e-2, 8e-2} at momentum 0.75, and AdamW over
   {1e-3, 3e-3, 1e-2}; three seeds each (a seed fixes the initial weights and the batches, so
   the runs of one seed are paired): 45 runs, more if an optimizer's best lr sits on an edge
   of its grid (bracketing adds the next value). Re-running continues where it stopped.
3. **The report**: the table (validation perplexity and s/step, mean ± std over seeds, each
   optimizer at its best lr, MuonEq deltas against Muon-Nes), the paired differences against
   Muon-Nes and AdamW with 95% intervals, the token-efficiency speedups, whether each
   optimizer's best lr is bracketed, learning curves, all also in TensorBoard.

Each run is a process forked from a server that imported the runtime once, then 100 steps
and 20 validations (``make bench-trial`` times every phase of one): within a budget of minutes
three paired seeds (the t quantile is 12.7 with two) leave room for 15 points, so the paper's
lr × momentum heatmap (``make heatmap-gpt2``) is not part of the demo.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from pathlib import Path

import optuna

DEMO_STUDY = "demo"
#: learning rates of the Muon family and of AdamW (bracketing extends a grid whose best is on
#: an edge; the report's bracketing table says what it added)
MUON_LRS, ADAMW_LRS = [2e-2, 4e-2, 8e-2], [1e-3, 3e-3, 1e-2]
#: the momentum of the Muon family: the best of {0.6, 0.75, 0.9} for Muon-Nes and R at this
#: size when the demo had a momentum axis (150 steps, two seeds)
MOMENTUM = 0.75


def demo_sweep(data_dir: Path) -> dict:
    """The demo's sweep file (also written to ``runs/demo/sweep.yaml`` by the driver)."""
    return {
        "study": DEMO_STUDY,
        "description": "Miniature ablation: tiny LLaMA on Python's pydoc topics (bytes), CPU",
        "experiment": "llama_tiny_shakespeare",
        "overrides": [
            f"task.data.dir={data_dir}", "task.data.tokenizer=byte",
            "task.data.micro_batch_size=16", "task.data.val_tokens=8192",
            # 20 validations: enough points to interpolate the speedups' crossings
            "task.val_every_n_steps=5", "trainer.max_steps=100", "trainer.progress=quiet",
            # the training loss every 5 steps too: 20 points on its curve, not the recipe's 4
            "trainer.log_every_n_steps=5",
            # the study reads its runs' metrics: no best.ckpt, which would be written again at
            # nearly every validation (the best value is still recorded)
            "trainer.save_best=false",
        ],
        "seeds": [0, 1, 2],
        "grid": [
            {"optimizer": ["muon_nes"], "optimizer.lr": MUON_LRS,
             "optimizer.momentum": [MOMENTUM]},
            {"optimizer": ["muoneq_nes"], "optimizer.mode": ["R", "C", "RC"],
             "optimizer.lr": MUON_LRS, "optimizer.momentum": [MOMENTUM]},
            {"optimizer": ["adamw"], "optimizer.lr": ADAMW_LRS},
        ],
        "objective": {"metric": "val/ppl", "direction": "minimize"},
        # Each optimizer's best lr must be interior: a best value on an edge gets the next
        # value beyond it, up to two (no run is added when it is interior).
        "bracket": {"axes": ["optimizer.lr"], "max_extensions": 2},
        # One core per trial: two trials share two cores without oversubscribing them.
        "launch": {"env": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}},
        "report": {
            "tables": [{"name": "ablation", "select": ["optimizer.lr", "optimizer.momentum"],
                        "metrics": [{"key": "val/ppl", "label": "Val. perplexity"},
                                    {"key": "step_time_s", "label": "s/step", "digits": 3}],
                        "speedup": {"tag": "val/loss"}}],
            # the one-glance answer: each method's perplexity against the lr, seeds as a band
            "lines": [{"name": "lr", "x": "optimizer.lr", "metrics": ["val/ppl"], "logx": True}],
            "curves": {"tags": ["val/ppl", "train/loss"],
                       "select": ["optimizer.lr", "optimizer.momentum"]},
        },
    }


def prepare_text(data_dir: Path) -> None:
    """Shards of the pydoc topics (skipped when already there): the language task's data for
    miniatures (:mod:`muoneq_tasks.language.mini`, reached through the task registry)."""
    from muoneq.suite.runtime.tasks import get_task

    get_task("language").mini_data(data_dir)


def next_steps(study_dir: Path, runs_dir: Path) -> list[tuple[str, str]]:
    """Where to look next, ``(command or file, what it shows)``: commands that run as printed
    from the current folder (this environment's scripts by path unless it is activated:
    :func:`muoneq.suite.cli.program`)."""
    from muoneq.suite.cli import program
    from muoneq.suite.sweeps.tensorboard_view import command

    runs = [] if runs_dir == Path("runs") else ["--runs-dir", str(runs_dir)]
    status = shlex.join(["sweep", str(study_dir / "sweep.yaml"), *runs, "--status"])
    return [(str(study_dir / "report" / "report.md"),
             "tables, bracketing, speedups, learning curves"),
            (command(study_dir),
             "every run's curves by a short name, the HParams view and the report's figures "
             "(over 40 runs: type seed0 in the runs filter)"),
            (f"{program()} {status}", "the study's counts"),
            (f"{program()} sweep ablation-cifar10 --workers 4",
             "a full-scale study of the paper (GPUs; `make help` in a checkout lists them)")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="muoneq demo", description="A miniature of the paper's ablation, offline on a CPU "
        "(make demo): a tiny LLaMA trained by Muon-Nes, MuonEq-Nes R, C, RC and AdamW at three "
        "learning rates and three seeds each, the report, and where to look next; re-running "
        "continues where it stopped.")
    p.add_argument("--runs-dir", type=Path, default=Path("runs"),
                   help="folder that holds the study, <runs-dir>/demo/ (default ./runs)")
    p.add_argument("--workers", type=int, default=2, help="trials at once (default 2)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    from muoneq.suite.cli import program
    from muoneq.suite.report import load_study_data, write_report
    from muoneq.suite.sweeps import Driver, DriverOptions
    from muoneq.suite.sweeps.spec import SweepError, spec_from_dict

    study_dir = args.runs_dir / DEMO_STUDY
    data_dir = study_dir / "data"
    prepare_text(data_dir)
    spec = spec_from_dict(demo_sweep(data_dir), source="muoneq demo")
    n_runs = len(spec.points()) * len(spec.seeds)
    print(f"demo: {n_runs} training runs (more if bracketing extends a grid), {args.workers} at "
          f"a time, in {study_dir}/ (interrupt and re-run to continue)", flush=True)
    try:
        driver = Driver(spec, DriverOptions(workers=args.workers, runs_dir=args.runs_dir))
    except SweepError as err:  # its way out names the sweep's --set, which the demo lacks
        raise SweepError(
            f"{study_dir} holds a demo run with other settings (an older muoneq?), which this "
            f"demo would reuse; delete it (rm -r {study_dir}) or pass --runs-dir OTHER_FOLDER",
            details=[str(err), *err.details]) from None
    summary = driver.run()
    if summary.interrupted or summary.pending:
        again = "make demo" if os.environ.get("MAKELEVEL") else " ".join(
            [program(), "demo", shlex.join(sys.argv[1:] if argv is None else argv)]).rstrip()
        print(f"demo: {summary.done}/{summary.total} runs done; continue with: {again}")
        return summary.exit_code
    report = write_report(load_study_data(study_dir))
    print("\n" + (report.out_dir / "table_ablation.md").read_text())
    plan = report.out_dir / "plan.md"
    if plan.exists():
        print(plan.read_text())
    rows = next_steps(study_dir, args.runs_dir)
    width = max(len(command) for command, _ in rows)
    print("Where to look next:", *(f"  {command:<{width}}  {what}" for command, what in rows),
          sep="\n")
    if summary.exhausted:
        print(f"demo: runs that failed every retry: {summary.exhausted}", file=sys.stderr)
    return summary.exit_code


if __name__ == "__main__":
    from muoneq.suite.cli import main as cli

    sys.exit(cli(["demo", *sys.argv[1:]]))  # mistakes as one line, as every muoneq command
