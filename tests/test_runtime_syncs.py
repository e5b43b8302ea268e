"""The training loop reads nothing back from the device per step: the step statistics, the
divergence check and the interruption check of ``muoneq train``'s loop wait for the device only
at the steps whose values are logged (every ``trainer.log_every_n_steps`` steps and the last).

Counted on a CPU over a real short run that believes it trains on CUDA (the runtime's callbacks
capture ``cuda:0``; torch.cuda's timing events and synchronization are stubbed): every call of
``Tensor.item``, ``bool``/``float``/``int`` of a tensor, ``tolist``, ``cpu``, ``numpy``,
``torch.cuda.synchronize`` and a CUDA event's ``synchronize`` made from the runtime's loop code
(a frame of ``callbacks.py``, ``module.py``, ``trainer.py`` or ``metrics.py`` of
``muoneq/suite/runtime`` on the stack), by the optimizer step in progress."""

from __future__ import annotations

import collections
import functools
import json
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

import muoneq.suite.runtime as runtime
from muoneq.suite.runtime import compose, train
from tests.helpers.gpu import FakeEvent, TrainsOnFakeCuda, stub_cuda
from tests.helpers.runtime import tiny_language

LOOP_FILES = {str(Path(runtime.__file__).parent / name)
              for name in ("callbacks.py", "module.py", "trainer.py", "metrics.py")}
READS = ("item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy")
STEPS, LOG_EVERY = 12, 4


class StepInProgress(L.Callback):
    """The optimizer step the training loop is in (1-based, as Lightning's logging counts it
    from the first micro-batch's hooks to the last one's), None outside training."""

    def __init__(self) -> None:
        self.trainer: L.Trainer | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.trainer = trainer

    def on_train_end(self, trainer, pl_module) -> None:
        self.trainer = None

    @property
    def step(self) -> int | None:
        if self.trainer is None:
            return None
        return self.trainer.fit_loop.epoch_loop._batches_that_stepped + 1


def loop_frame() -> str | None:
    """``file:line`` of the innermost frame of the loop's files on the stack, if any."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename in LOOP_FILES:
            return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def counting(monkeypatch, where: StepInProgress) -> dict[int, list[str]]:
    """Patch every host read and synchronization to be counted by step (see the module)."""
    reads = collections.defaultdict(list)

    def counted(name, original):
        @functools.wraps(original)
        def read(*args, **kwargs):
            if where.step is not None and (site := loop_frame()) is not None:
                reads[where.step].append(f"{name} at {site}")
            return original(*args, **kwargs)
        return read

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counted(f"Tensor.{name}",
                                                        getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.cuda, "synchronize",
                        counted("torch.cuda.synchronize", torch.cuda.synchronize))
    monkeypatch.setattr(FakeEvent, "synchronize",
                        counted("Event.synchronize", FakeEvent.synchronize))
    return reads


@pytest.mark.parametrize("progress", ["quiet", "log"])
def test_the_loop_waits_for_the_device_only_where_it_logs(tmp_path, monkeypatch, progress):
    syncs = []
    stub_cuda(monkeypatch, syncs)
    where = StepInProgress()
    reads = counting(monkeypatch, where)
    cfg = compose(["experiment=llama_tiny_shakespeare", *tiny_language(tmp_path),
                   f"trainer.max_steps={STEPS}", f"schedule.total_steps={STEPS}",
                   f"trainer.log_every_n_steps={LOG_EVERY}", f"trainer.progress={progress}",
                   "task.val_every_n_steps=100", f"run.dir={tmp_path / 'run'}"])
    metrics = train(cfg, callbacks=[TrainsOnFakeCuda(), where])
    assert metrics["status"] == "finished" and metrics["global_step"] == STEPS

    logged = set(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    per_step = {step: reads.get(step, []) for step in range(1, STEPS + 1)}
    assert {step: r for step, r in per_step.items() if step not in logged and r} == {}
    # where it logs: the step times (one wait for all the steps since the last), the
    # divergence record (one read), Lightning's logging of the lr and the console line's values
    for step in logged:
        kinds = collections.Counter(read.split(" at ")[0] for read in per_step[step])
        assert kinds["Event.synchronize"] == 1 and kinds["Tensor.tolist"] == 1, per_step[step]
        assert sum(kinds.values()) <= 3 + 2 * (progress == "log"), per_step[step]

    # what was read there is what a synchronized loop measured: every step after the first
    # timed (the first is warm-up), and the step times of the logged steps
    written = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert written["timed_steps"] == STEPS - 1 and written["step_time_s"] > 0
    assert written["tokens_per_s"] == pytest.approx(4 * 32 / written["step_time_s"])
    assert "sync" not in syncs
