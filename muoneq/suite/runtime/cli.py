"""``muoneq train [group=file ...] [key=value ...]``: compose a config and run it."""

from __future__ import annotations

from omegaconf import OmegaConf

from muoneq.suite import code_version
from muoneq.suite.runtime.config import GROUPS, compose, conf_dir

USAGE = """\
usage: muoneq train [--print-config] [--debug] [GROUP=FILE ...] [KEY=VALUE ...]

Compose a run config from conf/ and train it. Examples:
  muoneq train experiment=cifar10_resnet18 optimizer=muoneq_nes seed=1
  muoneq train experiment=cifar10_resnet18 optimizer=muoneq_nes optimizer.mode=RC \\
      optimizer.lr=5e-2 trainer=ddp trainer.devices=4 run.dir=runs/rc-seed1
  muoneq train experiment=cifar10_resnet18 resume=auto run.dir=runs/rc-seed1

GROUP=FILE picks conf/GROUP/FILE.yaml (or a path to a .yaml file); KEY=VALUE overrides any
key of the composed config (dotted: optimizer.lr, task.data.root, trainer.max_epochs, ...).
--print-config prints the composed config and exits. resume=auto continues the run in the run
folder only if it was run with the same settings (keys that cannot change the result aside), and
says which keys differ otherwise. Mistakes are one line, `muoneq: <what>; <how to fix>` (exit 2);
--debug shows the traceback.

Exit status: 0 finished; 2 a mistake to fix (config, data, run folder, damaged file); 3 diverged
(NaN/inf loss or validation metric; metrics.json says "status": "diverged"); 4 disk full;
130 / 143 stopped by SIGINT (Ctrl-C) / SIGTERM after saving the current step (the message gives
the command that continues it).
"""


def _available() -> str:
    root = conf_dir()
    lines = [f"config folder: {root}"]
    for group in GROUPS:
        names = sorted(p.stem for p in (root / group).glob("*.yaml"))
        lines.append(f"  {group:<10} {', '.join(names) or '(none)'}")
    return "\n".join(lines)


def closing_line(metrics: dict) -> str:
    """What a finished run reports: the paper's metric for the task, then the monitored
    validation metric (best and final), step time and wall-clock, each named."""

    def show(value) -> str:
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    parts = []
    paper = metrics.get("paper_metric")
    if paper and metrics.get(paper) is not None:
        parts.append(f"{paper}={show(metrics[paper])}")
    if metrics.get("monitor"):
        parts.append(f"{metrics['monitor']} best={show(metrics.get('best'))} "
                     f"final={show(metrics.get('final'))}")
    parts += [f"{k}={show(metrics[k])}" for k in ("step_time_s", "wall_clock_s")
              if metrics.get(k) is not None]
    return f"muoneq train: finished {metrics.get('run_dir')}: " + "  ".join(parts)


def load_train(cfg):
    """:func:`muoneq.suite.runtime.run.train`, imported for the run ``cfg`` in a process set up
    to train: Lightning without the optional packages of torchmetrics when the run's task uses
    none of them (:mod:`muoneq.suite.runtime.lean_imports`), and a C allocator that keeps the
    memory a step frees for the next (:mod:`muoneq.suite.runtime.allocator`)."""
    from muoneq.suite.runtime.allocator import keep_freed_memory
    from muoneq.suite.runtime.lean_imports import import_lightning
    from muoneq.suite.runtime.tasks import get_task

    keep_freed_memory()
    import_lightning(get_task(cfg.task.name).lean_imports)
    from muoneq.suite.runtime.run import train

    return train


def main(argv: list[str]) -> int:
    argv = list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE + "\n" + _available())
        return 0
    print_only = "--print-config" in argv
    args = [a for a in argv if a != "--print-config"]
    cfg = compose(args)  # a ConfigError is shown by the muoneq command as one line
    if print_only:
        print(OmegaConf.to_yaml(cfg, resolve=True))
        return 0

    code_version.taken()  # the code this run records: before it imports the runtime
    train = load_train(cfg)  # heavy imports only when training
    import torch.distributed as dist
    from lightning.pytorch.utilities import rank_zero_only

    try:
        metrics = train(cfg, argv=args)
    finally:
        # a process group left to the interpreter's exit can abort it (gloo's threads:
        # "terminate called without an active exception"), failing a finished run
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if rank_zero_only.rank == 0:
        print(closing_line(metrics))
    return 0
