"""``muoneq train [group=file ...] [key=value ...]``: compose a config and run it."""

from __future__ import annotations

import sys

from omegaconf import OmegaConf

from muoneq.runtime.config import GROUPS, ConfigError, compose, conf_dir

USAGE = """\
usage: muoneq train [--print-config] [GROUP=FILE ...] [KEY=VALUE ...]

Compose a run config from conf/ and train it. Examples:
  muoneq train experiment=cifar10_resnet18 optimizer=muoneq_nes seed=1
  muoneq train experiment=cifar10_resnet18 optimizer=muoneq_nes optimizer.mode=RC \\
      optimizer.lr=5e-2 trainer.devices=4 trainer.strategy=ddp run.dir=runs/rc-seed1
  muoneq train experiment=cifar10_resnet18 resume=auto run.dir=runs/rc-seed1

GROUP=FILE picks conf/GROUP/FILE.yaml (or a path to a .yaml file); KEY=VALUE overrides any
key of the composed config (dotted: optimizer.lr, task.data.root, trainer.max_epochs, ...).
--print-config prints the composed config and exits.
"""


def _available() -> str:
    root = conf_dir()
    lines = [f"config folder: {root}"]
    for group in GROUPS:
        names = sorted(p.stem for p in (root / group).glob("*.yaml"))
        lines.append(f"  {group:<10} {', '.join(names) or '(none)'}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    argv = list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE + "\n" + _available())
        return 0
    print_only = "--print-config" in argv
    args = [a for a in argv if a != "--print-config"]
    try:
        cfg = compose(args)
    except ConfigError as err:
        print(f"muoneq train: config error: {err}", file=sys.stderr)
        return 2
    if print_only:
        print(OmegaConf.to_yaml(cfg, resolve=True))
        return 0

    from muoneq.runtime.run import RunFolderError, train  # heavy imports only when training

    try:
        metrics = train(cfg, argv=args)
    except RunFolderError as err:
        print(f"muoneq train: {err}", file=sys.stderr)
        return 2
    from lightning.pytorch.utilities import rank_zero_only

    if rank_zero_only.rank != 0:
        return 0
    shown = {k: metrics.get(k) for k in ("best", "final", "step_time_s", "wall_clock_s")}
    shown |= {k: v for k, v in metrics.items() if k.startswith("test/")}
    print("muoneq train: finished " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else
                                                 f"{k}={v}" for k, v in shown.items()))
    return 0
