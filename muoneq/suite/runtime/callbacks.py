"""Callbacks of every run: step time and peak memory (:class:`StepStats`), the lr of every
optimizer step (:class:`StepLearningRate`), plain log lines for logs that are not a terminal
(:class:`LogLines`), and the two ways a run stops early: divergence (:class:`Divergence`) and
SIGINT/SIGTERM (:class:`Interruption`), both raising :class:`Stop`.

None of them reads a value back from the device on every step (``.item()``, ``bool`` of a
tensor, a synchronization): the step time and the divergence check are kept on the device and
read at the steps whose values are logged (:func:`at_log_boundary`), so the host queues the
next step's work while the device runs this one."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.utilities import rank_zero_only

from muoneq.suite.machine import device_name, load_average
from muoneq.suite.runtime.accelerators import durations, peak_memory, reset_peak_memory, timestamp


def at_log_boundary(trainer) -> bool:
    """Whether the optimizer step in progress is one whose step values Lightning writes to the
    loggers (every ``trainer.log_every_n_steps`` steps, and on a step that stops the fit) or the
    fit's last (whose values ``metrics.json`` keeps): where the runtime reads values back from
    the device."""
    # the step in progress as Lightning's logger connector counts it (1-based)
    step = trainer.fit_loop.epoch_loop._batches_that_stepped + 1
    last = step >= trainer.estimated_stepping_batches
    return last or trainer._logger_connector.should_update_logs


def logs_this_step(trainer) -> bool:
    """Whether a per-step value of the optimizer step in progress is kept anywhere: on a log
    boundary (:func:`at_log_boundary`), and on every step when a progress bar shows it. On other
    steps a ``self.log`` is thrown away, yet costs milliseconds (it copies Lightning's result
    collection): more than a small model's whole step on a GPU. The runtime and the tasks log
    per-step values only on these steps (see :meth:`muoneq.suite.runtime.TaskModule.logs_step`);
    the values kept are the same."""
    return trainer.progress_bar_callback is not None or at_log_boundary(trainer)


class StepStats(L.Callback):
    """Time of every optimizer step and the peak memory, logged as ``perf/step_time_s`` and
    ``perf/peak_memory_gb`` on the steps whose values are kept (:func:`logs_this_step`).

    A step is timed from the start of its first micro-batch to the end of its last one (data
    loading of the first micro-batch and validation are outside). On an accelerator both ends
    are timing events on the device's stream, recorded without waiting for the device and read
    at the steps that log (:func:`logs_this_step`) and when the figures are asked for: a step's
    time runs from when the device reaches its first micro-batch's work (or finishes the work
    queued before it, if later) to when it finishes its last, so the host keeps queueing work
    while the device computes, and the times of consecutive steps add up to the device's time.
    On a CPU they are wall-clock times. The first step of every session (warm-up, cudnn
    autotuning, compilation) is not counted. Totals are kept in checkpoints, so a resumed run
    reports figures for all of its training, not just the last session. What the times were
    measured on goes with them: the device, torch's CPU threads, the machine's cores and its
    1-minute load average at the timed steps (mean and max: a load above the cores means other
    work shared them).

    Every figure is read from :attr:`device`, the device training started on: after ``fit``,
    Lightning's teardown has moved the module back to the CPU, so that its ``device`` would
    report host memory for a GPU run.
    """

    #: the totals kept in checkpoints (a checkpoint of an earlier version lacks the loads)
    TOTALS = {"steps": 0, "seconds": 0.0, "train_seconds": 0.0, "load_sum": 0.0,
              "load_samples": 0, "load_max": None}

    def __init__(self) -> None:
        #: the device this session trains on, captured when training starts (None: not yet)
        self.device: torch.device | None = None
        self.step_times: list[float] = []  # this session's counted steps, read so far
        self.loads: list[float] = []  # the load average at each counted step
        self.previous = dict(self.TOTALS)
        #: the global step and seconds of the last step whose time was logged
        self.logged: tuple[int, float] | None = None
        self._unread: list[tuple] = []  # counted steps' (start, end) timestamps, not read yet
        self._step_start = None  # the timestamp of the step in progress
        self._step_at_start = 0
        self._session_first_step: int | None = None
        self._train_start = time.perf_counter()

    # ------------------------------------------------------------------ timing
    def on_train_start(self, trainer, pl_module) -> None:
        self.device = pl_module.device
        reset_peak_memory(self.device)
        self._train_start = time.perf_counter()
        self._session_first_step = trainer.global_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._step_start is None:  # first micro-batch of an optimizer step
            self._step_start = timestamp(self.device)
            self._step_at_start = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._step_start is None or trainer.global_step == self._step_at_start:
            return  # more micro-batches to accumulate before the optimizer steps
        start, end, self._step_start = self._step_start, timestamp(self.device), None
        counted = self._step_at_start > self._session_first_step
        if counted:
            self._unread.append((start, end))
            if (load := load_average()) is not None:
                self.loads.append(load)
        if logs_this_step(trainer):
            self._read()
            elapsed = self.step_times[-1] if counted else durations([(start, end)])[0]
            self.logged = (trainer.global_step, elapsed)
            peak, _ = peak_memory(self.device)
            pl_module.log_dict(
                {"perf/step_time_s": elapsed, "perf/peak_memory_gb": peak / 2**30},
                on_step=True, on_epoch=False, rank_zero_only=True,
            )

    def _read(self) -> None:
        """Read the times of the counted steps not read yet (on an accelerator: waits for the
        last one to end)."""
        self.step_times += durations(self._unread)
        self._unread.clear()

    # ------------------------------------------------------------------ results
    def summary(self) -> dict:
        """Mean and median step time, peak memory (of :attr:`device`; the process's on a
        session that trained nothing) and training wall-clock of the whole run."""
        totals = self.state_dict()
        steps, seconds = totals["steps"], totals["seconds"]
        peak, kind = peak_memory(self.device or torch.device("cpu"))
        return {
            "step_time_s": seconds / steps if steps else math.nan,
            "step_time_median_s": (
                statistics.median(self.step_times) if self.step_times else math.nan
            ),
            "timed_steps": steps,
            "peak_memory_gb": peak / 2**30,
            "peak_memory_kind": kind,
            "train_seconds": totals["train_seconds"],
            "device": device_name(self.device or torch.device("cpu")),
            "threads": torch.get_num_threads(),
            "cores": os.cpu_count(),
            "load_avg": (totals["load_sum"] / totals["load_samples"] if totals["load_samples"]
                         else math.nan),
            "load_max": math.nan if totals["load_max"] is None else totals["load_max"],
        }

    def _train_seconds(self) -> float:
        return time.perf_counter() - self._train_start

    def state_dict(self) -> dict:
        self._read()
        p = self.previous
        return {
            "steps": p["steps"] + len(self.step_times),
            "seconds": p["seconds"] + sum(self.step_times),
            "train_seconds": p["train_seconds"] + self._train_seconds(),
            "load_sum": p["load_sum"] + sum(self.loads),
            "load_samples": p["load_samples"] + len(self.loads),
            "load_max": max((v for v in (p["load_max"], *self.loads) if v is not None),
                            default=None),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.previous = {**self.TOTALS, **state_dict}


class StepLearningRate(LearningRateMonitor):
    """Lightning's ``LearningRateMonitor`` by step, once per optimizer step: under gradient
    accumulation it would log the same lr at the same step for every micro-batch."""

    def __init__(self) -> None:
        super().__init__(logging_interval="step")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:  # the step's first micro-batch
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)


class LastValidation(L.Callback):
    """The optimizer step of the last validation (kept in checkpoints), so that a run whose
    budget ends between validations is validated once more on its final weights."""

    def __init__(self) -> None:
        self.step = -1

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            self.step = trainer.global_step

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = state_dict["step"]


class LogLines(L.Callback):
    """One plain line every ``log_every_n_steps`` steps and after every validation (rank 0),
    for logs written to files (SLURM, nohup), where a progress bar is unreadable. ``step k``
    is the global step after the k-th optimizer step, with that step's loss and lr (the
    values TensorBoard shows at k)."""

    def __init__(self, every_n_steps: int) -> None:
        self.every_n_steps = every_n_steps
        self._last_time = time.perf_counter()
        self._last_step = 0
        self._lr = math.nan

    @rank_zero_only
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # the lr this optimizer step uses (the scheduler moves on before on_train_batch_end)
        self._lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else math.nan

    @staticmethod
    def _format(metrics: dict, prefix: str) -> str:
        parts = []
        for key in sorted(metrics):
            if key.startswith(prefix):
                value = float(metrics[key])
                parts.append(f"{key} {value:.4g}")
        return "  ".join(parts)

    @rank_zero_only
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._last_step or step % self.every_n_steps:
            return
        now = time.perf_counter()
        rate = (now - self._last_time) / max(1, step - self._last_step)
        self._last_time, self._last_step = now, step
        total = trainer.estimated_stepping_batches
        metrics = self._format(trainer.callback_metrics, "train/")
        print(
            f"epoch {trainer.current_epoch}  step {step}/{total}  {metrics}  lr {self._lr:.3g}  "
            f"{rate:.3f} s/step",
            flush=True,
        )

    @rank_zero_only
    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        metrics = self._format(trainer.callback_metrics, "val/")
        print(f"epoch {trainer.current_epoch}  step {trainer.global_step}  {metrics}", flush=True)

    def on_train_start(self, trainer, pl_module) -> None:
        self._last_step = trainer.global_step
        self._last_time = time.perf_counter()


class Stop(Exception):
    """Raised by a callback to end ``fit`` at once (on every rank: the callbacks decide
    together); :func:`muoneq.suite.runtime.train` turns it into the run's outcome."""

    def __init__(self, step: int, what: str, checkpoint: Path | None = None,
                 signum: int | None = None) -> None:
        super().__init__(what)
        self.step, self.what, self.checkpoint, self.signum = step, what, checkpoint, signum


class StopNow(BaseException):
    """Raised by :class:`Interruption` on a second Ctrl-C: stop at once, saving nothing. A
    ``BaseException``, as ``KeyboardInterrupt`` is, so that no ``except Exception`` on the way
    catches it; not a ``KeyboardInterrupt``, which Lightning ends with ``sys.exit(1)`` and a
    message of its own (a stopped run would look failed, not interrupted)."""


def _any_rank(trainer, flag: bool) -> bool:
    """Whether ``flag`` holds on any process (a collective: every rank calls it at the same
    point, so that all of them stop together; on the device, so it waits for the device)."""
    return bool(trainer.strategy.reduce_boolean_decision(flag, all=False))


class _AtStepEnd(L.Callback):
    """Calls :meth:`step_end` after the last micro-batch of every optimizer step."""

    _step_at_start = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step_at_start = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self._step_at_start:  # else: more micro-batches to go
            self.step_end(trainer)

    def step_end(self, trainer) -> None:
        raise NotImplementedError


class Divergence(_AtStepEnd):
    """Stop the run when its training loss or its validation ``monitor`` is NaN or infinite
    more than ``patience`` times in a row (optimizer steps and validations;
    ``trainer.divergence_patience``, 0: the first).

    The loss of every micro-batch is checked on its device, and so is the count of non-finite
    steps in a row, with the step and the loss where it first exceeded ``patience``: nothing is
    read back per step. The processes read and share that record at the steps whose values are
    logged (:func:`at_log_boundary`: every ``trainer.log_every_n_steps`` steps and the last),
    before a validation, before any checkpoint is written and when training ends; the validation
    ``monitor`` after each validation. A run that diverges between two of these trains on to the
    next (on weights that are not finite), then ends with :class:`Stop` naming the step where the
    count exceeded ``patience``: nothing more is validated or saved."""

    def __init__(self, patience: int, monitor: str | None) -> None:
        self.patience, self.monitor = patience, monitor
        self.in_a_row = 0  # as of the last read
        self._bad = self._loss = None  # the micro-batches of the step in progress
        #: on the device since the last read: non-finite steps in a row, whether and at which
        #: step (and loss) the count first exceeded the patience
        self._record: dict[str, torch.Tensor] | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None:
            loss = loss.detach()
            bad = ~torch.isfinite(loss)
            # the step's first non-finite loss, for the message (kept on the device: no sync)
            self._loss = loss if self._bad is None else torch.where(self._bad, self._loss, loss)
            self._bad = bad if self._bad is None else self._bad | bad
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def step_end(self, trainer) -> None:
        bad, loss, self._bad, self._loss = self._bad, self._loss, None, None
        if bad is not None:
            self._count(bad, loss, trainer.global_step)
        if at_log_boundary(trainer):
            self.read(trainer)

    def _count(self, bad: torch.Tensor, loss: torch.Tensor, step: int) -> None:
        """Update the record with one step, on the device (float32: steps are exact to 2²⁴)."""
        r = self._record
        if r is None:
            zero = torch.zeros((), device=bad.device)
            r = {"in_a_row": zero + self.in_a_row, "tripped": zero, "step": zero, "loss": zero}
        in_a_row = torch.where(bad, r["in_a_row"] + 1, 0)
        first = (in_a_row > self.patience) & (r["tripped"] == 0)
        self._record = {
            "in_a_row": in_a_row, "tripped": torch.where(first, 1.0, r["tripped"]),
            "step": torch.where(first, float(step), r["step"]),
            "loss": torch.where(first, loss.float(), r["loss"])}

    def read(self, trainer) -> None:
        """Read the record of every process (one gather; all processes call this at the same
        points) and stop if any exceeded the patience: at the earliest step where one did."""
        r, self._record = self._record, None
        keys = ("tripped", "step", "loss", "in_a_row")
        if r is None:
            r = {"tripped": 0.0, "step": 0.0, "loss": 0.0, "in_a_row": float(self.in_a_row)}
        record = torch.stack([torch.as_tensor(r[k], device=trainer.strategy.root_device)
                              for k in keys])
        rows = [dict(zip(keys, row, strict=True))
                for row in trainer.strategy.all_gather(record).reshape(-1, len(keys)).tolist()]
        self.in_a_row = int(max(row["in_a_row"] for row in rows))
        if tripped := [row for row in rows if row["tripped"]]:
            first = min(tripped, key=lambda row: row["step"])
            raise Stop(int(first["step"]), f"the training loss is not finite ({first['loss']})")

    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            self.read(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.state.fn == "fit":
            self.read(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self.read(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit" or self.monitor is None:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            return
        if not _any_rank(trainer, not math.isfinite(float(value))):
            self.in_a_row = 0
            return
        self.in_a_row += 1
        if self.in_a_row > self.patience:
            raise Stop(trainer.global_step, f"{self.monitor} is not finite ({float(value)})")


class Interruption(_AtStepEnd):
    """SIGINT (Ctrl-C) or SIGTERM (what SLURM sends before a kill) during a run: it ends with
    :class:`Stop` and a checkpoint to continue from, so that ``resume=auto`` loses nothing, and
    an interrupted run never counts as finished.

    While training, the current optimizer step is finished and ``last-step<N>.ckpt`` is saved for
    it (``save``, the resume point's saver). After the last step (the final validation and test,
    :meth:`after_training`), the evaluation runs to its end, the last step is saved and the run
    stops instead of writing ``metrics.json``. The processes decide together (at the end of every
    optimizer step, and once after the last one), so a signal that reaches one rank stops all of
    them at the same step. A second Ctrl-C stops at once, saving nothing (:class:`StopNow`).

    The handlers are installed for the block of :meth:`installed` (``train``: the whole session).
    Lightning installs its own SIGTERM handler whenever ``fit``, ``validate`` or ``test`` begins
    (it would end the run at the next batch with a ``SystemExit`` of status 0 and no checkpoint),
    so ours take over again when training, a validation or a test starts (Lightning restores the
    handlers it found when each ends); used without :meth:`installed`, they act while training.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, save) -> None:
        self.save = save
        self.signum: int | None = None
        #: a gloo group of all processes, for the per-step decision: on the host, so that it
        #: never waits for the device (made at the first decision, by every process at once)
        self._group = None

    def _handle(self, signum, frame) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise StopNow  # the second Ctrl-C
        self.signum = signum

    def _take_over(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                signal.signal(s, self._handle)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The handlers for the block (the previous ones restored after it)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.getsignal(s) for s in self.SIGNALS}
        self.signum = None
        self._take_over()
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def on_train_start(self, trainer, pl_module) -> None:
        self._take_over()

    def on_validation_start(self, trainer, pl_module) -> None:
        self._take_over()

    def on_test_start(self, trainer, pl_module) -> None:
        self._take_over()

    def _signalled(self, trainer) -> bool:
        """Whether a signal reached any process (every process asks at the same points)."""
        if trainer.world_size == 1 or not torch.distributed.is_initialized():
            return self.signum is not None
        if self._group is None:
            self._group = torch.distributed.new_group(backend="gloo")
        flag = torch.tensor([self.signum is not None], dtype=torch.int32)
        torch.distributed.all_reduce(flag, torch.distributed.ReduceOp.MAX, group=self._group)
        return flag[0].item() == 1  # a host tensor: nothing waits for the device

    def _stop(self, trainer, when: str = "") -> None:
        """:class:`Stop` with a saved checkpoint when a signal reached any rank."""
        if self._signalled(trainer):
            checkpoint = self.save(trainer)
            name = signal.Signals(self.signum).name if self.signum else "a signal on another rank"
            raise Stop(trainer.global_step, f"stopped by {name}{when}", checkpoint,
                       self.signum or signal.SIGTERM)

    def step_end(self, trainer) -> None:
        self._stop(trainer)

    def after_training(self, trainer) -> None:
        """Once the final validation and test are done: stop if a signal came meanwhile (the
        last step is saved, so that the run continues with its evaluation)."""
        self._stop(trainer, " during its final validation or test")
