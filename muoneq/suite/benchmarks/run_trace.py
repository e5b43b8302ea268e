"""A trace of one training run: when it set up, trained, validated and tested, step by step.

:class:`RunTrace` is a Lightning callback that records wall-clock times (``time.time()``, so that
a parent process can line them up with its own; the device synchronized at every mark) and,
on request, the micro-batches of one optimizer step and the first batch of each evaluation
stage, as the model received them, for timing the same work without Lightning
(:mod:`muoneq.suite.benchmarks.bench_trial`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import lightning as L
import torch

from muoneq.suite.runtime.accelerators import synchronize


@dataclass
class Evaluation:
    """One validation or test pass: its stage, whether it ran inside ``fit``, its batches."""

    stage: str
    in_fit: bool
    start: float
    end: float = float("nan")
    batches: int = 0

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Captured:
    """Batches kept for timing: the micro-batches of the second optimizer step (the first one
    warms up) and the first batch of each evaluation stage."""

    micro_batches: list = field(default_factory=list)
    evaluation: dict[str, object] = field(default_factory=dict)


def _detached(batch):
    if isinstance(batch, torch.Tensor):
        return batch.detach().clone()
    if isinstance(batch, list | tuple):
        return type(batch)(_detached(b) for b in batch)
    return batch


class RunTrace(L.Callback):
    """Marks of a run (see the module docstring): ``marks`` by name (``setup``: the data module
    is set up; ``train_start``, ``train_end``), ``steps`` (start and end of every optimizer step,
    first micro-batch to last), ``evaluations`` (:class:`Evaluation`), and with ``capture``
    the batches of :class:`Captured`."""

    def __init__(self, capture: bool = False) -> None:
        self.capture = capture
        self.marks: dict[str, float] = {}
        self.steps: list[tuple[float, float]] = []
        self.evaluations: list[Evaluation] = []
        self.captured = Captured()
        self._device = torch.device("cpu")
        self._step_start: float | None = None
        self._step_at_start = 0

    def _now(self) -> float:
        synchronize(self._device)
        return time.time()

    def setup(self, trainer, pl_module, stage) -> None:
        self.marks.setdefault("setup", time.time())

    def on_train_start(self, trainer, pl_module) -> None:
        self._device = pl_module.device
        self.marks["train_start"] = self._now()

    def on_train_end(self, trainer, pl_module) -> None:
        self.marks["train_end"] = self._now()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._step_start is None:  # the step's first micro-batch
            self._step_start = self._now()
            self._step_at_start = trainer.global_step
        if self.capture and len(self.steps) == 1:
            self.captured.micro_batches.append(_detached(batch))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._step_start is not None and trainer.global_step != self._step_at_start:
            self.steps.append((self._step_start, self._now()))
            self._step_start = None

    # ------------------------------------------------------------------ evaluations
    def _start(self, trainer, pl_module, stage: str) -> None:
        self._device = pl_module.device
        in_fit = trainer.state.fn == "fit" and not trainer.sanity_checking
        self.evaluations.append(Evaluation(stage, in_fit, self._now()))

    def _batch(self, stage: str, batch) -> None:
        self.evaluations[-1].batches += 1
        if self.capture and stage not in self.captured.evaluation:
            self.captured.evaluation[stage] = _detached(batch)

    def _end(self) -> None:
        self.evaluations[-1].end = self._now()

    def on_validation_start(self, trainer, pl_module) -> None:
        self._start(trainer, pl_module, "validation")

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx,
                                  dataloader_idx=0) -> None:
        self._batch("validation", batch)

    def on_validation_end(self, trainer, pl_module) -> None:
        self._end()

    def on_test_start(self, trainer, pl_module) -> None:
        self._start(trainer, pl_module, "test")

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._batch("test", batch)

    def on_test_end(self, trainer, pl_module) -> None:
        self._end()

    # ------------------------------------------------------------------ summaries
    def step_seconds(self) -> list[float]:
        return [end - start for start, end in self.steps]

    def evaluation_seconds(self, *, in_fit: bool | None = None, after: float = -float("inf"),
                           stage: str | None = None) -> float:
        """Seconds of the evaluations that started after ``after`` (all, those inside ``fit``
        or those after it, of one stage or all)."""
        return sum(e.seconds for e in self.evaluations
                   if e.start >= after and (in_fit is None or e.in_fit == in_fit)
                   and (stage is None or e.stage == stage))

    def to_dict(self) -> dict:
        return {"marks": self.marks, "steps": self.steps,
                "evaluations": [vars(e) for e in self.evaluations]}
