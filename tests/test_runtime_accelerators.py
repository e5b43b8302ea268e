"""Accelerators and strategies of the trainer factory, the Ascend NPU wiring included."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

import lightning as L
import pytest
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import DDPStrategy

from muoneq.suite.runtime import ConfigError, build_trainer, compose
from muoneq.suite.runtime.accelerators import NPUAccelerator, peak_memory
from muoneq.suite.runtime.config import SUITE_TRAINER_KEYS, TrainerConfig
from muoneq.suite.runtime.trainer import FSDP2Strategy, build_strategy

BASE = ["task=cifar10", "trainer.max_steps=1"]


def test_npu_is_registered_and_explains_a_missing_torch_npu(tmp_path):
    assert AcceleratorRegistry["npu"]["accelerator"] is NPUAccelerator
    if NPUAccelerator.is_available():
        pytest.skip("torch_npu is installed here")
    cfg = compose([*BASE, "trainer=npu"])
    with pytest.raises(ConfigError, match=r"torch_npu.*not installed; .*pip install torch-npu"):
        build_trainer(cfg, tmp_path, monitor="val/acc", monitor_mode="max")


def test_strategies(tmp_path):
    assert build_strategy(compose([*BASE, "trainer=cpu"]).trainer) == "auto"
    ddp = build_strategy(compose([*BASE, "trainer.strategy=ddp"]).trainer)
    assert isinstance(ddp, DDPStrategy) and ddp._process_group_backend is None  # gloo/nccl
    fsdp = build_strategy(compose([*BASE, "trainer=fsdp2"]).trainer)
    assert isinstance(fsdp, FSDP2Strategy)
    with pytest.raises(ValueError, match="strategy=single runs on one device"):
        build_strategy(compose([*BASE, "trainer=cpu", "trainer.devices=2"]).trainer)
    trainer = build_trainer(compose([*BASE, "trainer=cpu"]), tmp_path, monitor="val/loss",
                            monitor_mode="min")
    assert trainer.num_devices == 1 and trainer.accelerator.__class__.__name__ == "CPUAccelerator"


def test_every_trainer_key_is_a_lightning_argument_or_the_suites_own(tmp_path):
    lightning_arguments = inspect.signature(L.Trainer.__init__).parameters
    keys = [f.name for f in dataclasses.fields(TrainerConfig)]
    assert [k for k in keys if k not in lightning_arguments] == list(SUITE_TRAINER_KEYS)
    # passed through as written: values Lightning keeps as attributes of the trainer
    cfg = compose([*BASE, "trainer=cpu", "trainer.max_epochs=3", "trainer.max_steps=7",
                   "trainer.accumulate_grad_batches=2", "trainer.gradient_clip_val=0.5",
                   "trainer.log_every_n_steps=5", "trainer.check_val_every_n_epoch=2"])
    trainer = build_trainer(cfg, tmp_path, monitor="val/loss", monitor_mode="min")
    assert (trainer.max_epochs, trainer.max_steps, trainer.accumulate_grad_batches,
            trainer.gradient_clip_val, trainer.log_every_n_steps,
            trainer.check_val_every_n_epoch) == (3, 7, 2, 0.5, 5, 2)


# A stand-in for torch_npu: registers the "npu" device name and the torch.npu calls Lightning
# makes while building a trainer. Run in a subprocess (the device rename is process-wide).
FAKE_TORCH_NPU = """
import sys, types, torch
torch.utils.rename_privateuse1_backend("npu")
torch.npu = types.SimpleNamespace(device_count=lambda: 2, is_available=lambda: True,
                                  set_device=lambda d: None, empty_cache=lambda: None)
sys.modules["torch_npu"] = types.ModuleType("torch_npu")
from muoneq.suite.runtime import ConfigError, build_trainer, compose
for trainer_file in ("npu", "fsdp2"):
    args = ["task=cifar10", "trainer.max_steps=1", f"trainer={trainer_file}",
            "trainer.accelerator=npu", "trainer.devices=2"]
    t = build_trainer(compose(args), sys.argv[1], monitor="val/acc", monitor_mode="max")
    print(trainer_file, type(t.accelerator).__name__, type(t.strategy).__name__,
          t.strategy._process_group_backend, [str(d) for d in t.strategy.parallel_devices],
          type(t.precision_plugin).__name__, t.precision_plugin.device)
"""


@pytest.mark.slow
def test_npu_trainer_uses_hccl_and_npu_autocast(tmp_path):
    done = subprocess.run([sys.executable, "-c", FAKE_TORCH_NPU, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()[-2:]
    devices = "['npu:0', 'npu:1'] MixedPrecision npu"
    assert lines[0] == f"npu NPUAccelerator DDPStrategy hccl {devices}"
    assert lines[1] == f"fsdp2 NPUAccelerator FSDP2Strategy hccl {devices}"


def test_peak_memory_on_cpu_is_the_process_rss():
    import torch

    value, kind = peak_memory(torch.device("cpu"))
    assert kind == "host_rss" and value > 10 * 2**20
