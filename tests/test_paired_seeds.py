"""A seed fixes the initial weights and the data order whatever the optimizer, in every task:
the seed pairs of the report's paired differences (muoneq.suite.report.paired) differ only in the
optimizer."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf

from muoneq.suite.runtime import compose, conf_dir, train
from tests.helpers.runtime import TINY_RUNS

pytestmark = pytest.mark.usefixtures("one_thread")


def first_experiment_of_each_task() -> dict[str, str]:
    out: dict[str, str] = {}
    for path in sorted((conf_dir() / "experiment").glob("*.yaml")):
        task_file = OmegaConf.load(path).defaults.task
        task = OmegaConf.load(conf_dir() / "task" / f"{task_file}.yaml").get("name", task_file)
        out.setdefault(task, path.stem)
    return out


class FirstBatches(L.Callback):
    """The weights when training starts and the (inputs, targets) of the first micro-batches,
    as the training step receives them (after any augmentation on the device)."""

    def __init__(self, n: int) -> None:
        self.n, self.weights, self.batches = n, {}, []

    def on_train_start(self, trainer, pl_module) -> None:
        self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if len(self.batches) < self.n:
            self.batches.append([t.detach().clone() for t in batch])


@pytest.mark.slow
@pytest.mark.parametrize(("task", "experiment"), first_experiment_of_each_task().items())
def test_a_seed_fixes_weights_and_batches_for_every_optimizer(tmp_path, task, experiment):
    assert set(first_experiment_of_each_task()) == set(TINY_RUNS)  # every task is covered
    tiny = TINY_RUNS[task](tmp_path)
    seen = {}
    for optimizer, seed in (("adamw", 3), ("muoneq_nes", 3), ("muoneq_nes", 4)):
        recorder = FirstBatches(n=3)
        train(compose([f"experiment={experiment}", *tiny, f"optimizer={optimizer}",
                       f"seed={seed}", "trainer.max_epochs=null", "trainer.max_steps=3",
                       "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
                       f"run.dir={tmp_path / f'{optimizer}-{seed}'}"]),
              callbacks=[recorder])
        assert len(recorder.batches) == 3 and recorder.weights
        seen[optimizer, seed] = recorder

    def same(a: FirstBatches, b: FirstBatches) -> tuple[bool, bool]:
        weights = a.weights.keys() == b.weights.keys() and all(
            torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
        batches = all(torch.equal(x, y) for p, q in zip(a.batches, b.batches, strict=True)
                      for x, y in zip(p, q, strict=True))
        return weights, batches

    assert same(seen["adamw", 3], seen["muoneq_nes", 3]) == (True, True)
    assert same(seen["muoneq_nes", 3], seen["muoneq_nes", 4]) == (False, False)  # the control
