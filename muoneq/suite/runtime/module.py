"""The LightningModule base of every workload.

A task subclasses :class:`TaskModule`, passes its network, and writes ``training_step`` /
``validation_step`` / ``test_step``. The base class supplies the rest, identically for every
task: the single optimizer (``configure_optimizers`` from the ``optimizer`` config: name,
hyper-parameters and routing preset), the step-wise LR schedule, FSDP2 sharding under
``ModelParallelStrategy`` and optional ``torch.compile``.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from muoneq.suite.files import atomic_write
from muoneq.suite.runtime.callbacks import logs_this_step
from muoneq.suite.runtime.optim import build_optimizer_from_config, routing_table
from muoneq.suite.runtime.schedule import build_scheduler, schedule_warnings

#: In the run folder: where each tensor went (matrix path or AdamW) and why.
ROUTING_FILE = "routing.txt"


def compiles(setting: bool | str, device: torch.device) -> bool:
    """Whether a run of ``trainer.compile=setting`` on ``device`` compiles its network. ``auto``
    compiles on CUDA with Triton installed (Inductor's GPU code generator), where
    ``torch.compile`` pays (``make gpu-check`` records the recipes' tokens/s eager and
    compiled) and a sweep's trials share the compiled kernels
    (:mod:`muoneq.suite.sweeps.launch`); elsewhere it runs eager: on a CPU compiling costs more
    than the short runs it would speed up, and NPUs and Apple GPUs lack Inductor's code
    generation."""
    if setting == "auto":
        return device.type == "cuda" and importlib.util.find_spec("triton") is not None
    return bool(setting)


def _as_dict(cfg: DictConfig | Mapping) -> dict:
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    return dict(cfg)


class TaskModule(L.LightningModule):
    """Base LightningModule: ``self.model`` is the network; the optimizer comes from config.

    Args:
        model: the network. Build it before the module (with the run's seed set) so that every
            optimizer of a seed starts from the same weights.
        optimizer: the run's ``optimizer`` section (``name``, hyper-parameters, ``routing``).
        schedule: the run's ``schedule`` section (``name``, ``interval``, ``warmup_steps``,
            ``min_lr_ratio``, ``total_steps``).
        compile: wrap the network's forward in ``torch.compile``: True, False or ``"auto"``
            (:func:`compiles`: on CUDA only).

    Class attributes a task sets:
        monitor, monitor_mode: the validation metric that picks the ``best`` checkpoint and is
            reported as ``best`` / ``final`` in ``metrics.json`` (``"max"`` or ``"min"``);
            ``monitor = None``: the task has no validation set, so nothing is validated or
            selected during training.
        paper_metric: the metric the paper reports for the task (``muoneq train`` prints it
            first when a run ends).
        hparam_metrics: test metrics declared in TensorBoard's HParams view.
    """

    monitor: str | None = "val/loss"
    monitor_mode: str = "min"
    paper_metric: str | None = None
    hparam_metrics: tuple[str, ...] = ()

    def __init__(
        self, model: nn.Module, *, optimizer: DictConfig | Mapping,
        schedule: DictConfig | Mapping, compile: bool | str = False,
    ):
        super().__init__()
        if self.monitor_mode not in ("min", "max"):
            raise ValueError(f"monitor_mode: expected 'min' or 'max', got {self.monitor_mode!r}")
        self.model = model
        self.optimizer_config = _as_dict(optimizer)
        self.schedule_config = _as_dict(schedule)
        self.compile = compile
        # The compiled wrapper shares the network's parameters; kept out of the module tree so
        # that checkpoints have the same keys with and without compilation.
        object.__setattr__(self, "_compiled", None)

    def forward(self, *args, **kwargs):
        network = self.model if self._compiled is None else self._compiled
        return network(*args, **kwargs)

    # ------------------------------------------------------------------ model set-up
    def fsdp_units(self) -> list[nn.Module]:
        """Sub-modules FSDP2 shards one by one (e.g. transformer blocks) before the root."""
        return []

    def configure_model(self) -> None:
        """FSDP2 sharding under ``ModelParallelStrategy`` (``trainer.strategy=fsdp2``), then
        ``torch.compile`` when asked (:func:`compiles`, on the device the run trains on). Lightning
        may call this more than once (fit, then test)."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if self.device_mesh is not None and not isinstance(self.model, FSDPModule):
            mesh = self.device_mesh["data_parallel"]
            for unit in self.fsdp_units():
                fully_shard(unit, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        if self._compiled is None and compiles(self.compile, self.trainer.strategy.root_device):
            object.__setattr__(self, "_compiled", torch.compile(self.model))

    # ------------------------------------------------------------------ optimization
    def configure_optimizers(self):
        """The model's single optimizer and its LR schedule (by step, or by epoch); the run
        folder gets ``routing.txt``, the path and matrix view of every tensor."""
        optimizer = build_optimizer_from_config(self.model, self.optimizer_config)
        table = routing_table(self.model, self.optimizer_config)
        if table is not None and self.trainer.is_global_zero:
            atomic_write(Path(self.trainer.default_root_dir) / ROUTING_FILE, table + "\n")
        schedule = self.schedule_config
        interval = schedule.get("interval", "step")
        scheduler = build_scheduler(
            optimizer, name=schedule["name"], warmup_steps=schedule["warmup_steps"],
            total_steps=schedule.get("total_steps") or (
                self._budget_epochs if interval == "epoch" else self._budget_steps),
            min_lr_ratio=schedule["min_lr_ratio"],
        )
        return {
            "optimizer": optimizer,
            # "lr" + the groups' names: TensorBoard tags lr/muon and lr/adamw
            "lr_scheduler": {"scheduler": scheduler, "interval": interval, "frequency": 1,
                             "name": "lr"},
        }

    def on_train_start(self) -> None:
        """Warn (once, on rank 0) about a schedule that makes no sense for this run's length."""
        s = self.schedule_config
        interval = s.get("interval", "step")
        try:
            budget = self._budget_epochs() if interval == "epoch" else self._budget_steps()
        except ValueError:
            return  # no known length: the schedule's own total_steps is all there is
        problems = schedule_warnings(
            name=s["name"], interval=interval, warmup_steps=s["warmup_steps"],
            total_steps=s.get("total_steps"), budget=budget, min_lr_ratio=s["min_lr_ratio"])
        if self.trainer.is_global_zero:
            for text in problems:
                print(f"muoneq: warning: {text}", file=sys.stderr, flush=True)

    def _budget_epochs(self) -> int:
        """Epochs of the whole run (``schedule.interval=epoch``)."""
        epochs = self.trainer.max_epochs
        if epochs is None or epochs < 1:
            raise ValueError(
                "schedule.interval=epoch: set trainer.max_epochs or schedule.total_steps (in "
                "epochs)"
            )
        return int(epochs)

    def _budget_steps(self) -> int:
        """Optimizer steps of the whole run (``max_steps``, or ``max_epochs`` × batches)."""
        total = self.trainer.estimated_stepping_batches
        if total == float("inf"):
            raise ValueError(
                "schedule.total_steps: the training data has no length; set "
                "schedule.total_steps or trainer.max_steps"
            )
        return int(total)

    # ------------------------------------------------------------------ reporting
    def logs_step(self) -> bool:
        """Whether a per-step value (``self.log`` in ``training_step`` or a training batch hook)
        of the optimizer step in progress is kept: log, and compute what is only logged, when
        this is True (:func:`muoneq.suite.runtime.callbacks.logs_this_step`); False for a step
        called without a trainer."""
        try:
            trainer = self.trainer
        except RuntimeError:  # not attached to a Trainer: nothing is kept
            return False
        return logs_this_step(trainer)

    def final_metrics(self) -> dict:
        """Figures added to ``metrics.json`` (tasks extend this, e.g. with tokens seen)."""
        return {"parameters": sum(p.numel() for p in self.model.parameters())}
