"""A trial program whose objective is a known function of its hyper-parameters (no training).

Run as ``python tests/helpers/sweep_objective_program.py optimizer.lr=0.02 [optimizer.momentum=0.9]
[opt_lr=0.3] [opt_momentum=0.8] [sleep_s=0] [fail_first=false] [config_error=false]
[metric=val_loss] seed=0 run.dir=DIR``: it writes ``metrics.json`` with ``val_loss = log2(lr /
opt_lr)² + ((momentum − opt_momentum) / 0.05)² + 0.001·seed`` (the momentum term only when a
momentum is given; under the key ``metric``), so the optimum of every sweep over it is known,
and it starts in a blink (no torch): the driver tests use it where they test the driver's
bookkeeping, not a training run. Other ``key=value`` words
(e.g. ``optimizer=muon``) are accepted and ignored. Each start appends a line to
``starts.log``, so tests can count how often a run folder was executed. With
``fail_first=true`` the first attempt in a folder exits with status 3 (leaving
``failed_once``); with ``config_error=true`` every attempt exits at once with status 2, as
``muoneq`` does for a config error; with ``disk_full=true``, with status 4 and the line
``muoneq train`` prints for a full disk; with ``block_first=true`` the first attempt in a folder
(leaving ``blocked_once``) sleeps until it is killed. It writes its process id to ``pid``, its
``OMP_NUM_THREADS`` to ``threads`` and, when torch is already imported (a warm trial: its server
imported it), torch's CPU threads to ``torch_threads`` when it starts, and on SIGTERM writes
``checkpoint`` (as ``muoneq train`` saves its step) and exits with status 143. Run as a module
(``python -m tests.helpers.sweep_objective_program``) it can be forked by a warm server
(``launch.warm: true``).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from pathlib import Path


def objective(args: dict[str, str]) -> float:
    lr = float(args["optimizer.lr"])
    value = math.log2(lr / float(args.get("opt_lr", "0.3"))) ** 2
    if "optimizer.momentum" in args:
        m, m_opt = float(args["optimizer.momentum"]), float(args.get("opt_momentum", "0.8"))
        value += ((m - m_opt) / 0.05) ** 2
    return value + 0.001 * int(args.get("seed", "0"))


def main(argv: list[str]) -> int:
    args = dict(word.split("=", 1) for word in argv)
    run_dir = Path(args["run.dir"])
    run_dir.mkdir(parents=True, exist_ok=True)

    def save_and_exit(signum, frame):
        (run_dir / "checkpoint").write_text(signal.Signals(signum).name)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, save_and_exit)
    (run_dir / "pid").write_text(str(os.getpid()))
    (run_dir / "threads").write_text(os.environ.get("OMP_NUM_THREADS", "unset"))
    torch = sys.modules.get("torch")
    if torch is not None:
        (run_dir / "torch_threads").write_text(str(torch.get_num_threads()))
    with (run_dir / "starts.log").open("a") as fh:
        fh.write(f"{time.time()}\n")
    if args.get("config_error") == "true":
        print("muoneq: config_error=true; this run is told to fail as a config error")
        return 2
    if args.get("disk_full") == "true":
        print(f"muoneq: no space left on the disk holding {run_dir}/checkpoints/last-step"
              "000000004.ckpt (0.00 GiB free); free space there (old runs, checkpoints) or write "
              "to a larger disk; then continue the run with resume=auto", file=sys.stderr)
        return 4
    if args.get("block_first") == "true" and not (run_dir / "blocked_once").exists():
        (run_dir / "blocked_once").write_text("")
        time.sleep(3600)
    time.sleep(float(args.get("sleep_s", "0")))
    if args.get("fail_first") == "true" and not (run_dir / "failed_once").exists():
        (run_dir / "failed_once").write_text("")
        return 3
    (run_dir / "metrics.json").write_text(json.dumps({args.get("metric", "val_loss"):
                                                      objective(args)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
