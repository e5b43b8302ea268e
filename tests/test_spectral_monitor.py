"""SpectralMonitor: measures the optimizer's own pre-NS momentum, at the configured steps only,
without changing the training trajectory."""

from __future__ import annotations

import atexit
import csv
from collections import defaultdict

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from muoneq import MuonEq, param_groups
from muoneq.diagnostics import stable_rank
from muoneq.suite.spectra import SpectralMonitor
from tests.helpers.ports import free_port


class RecordingMuonEq(MuonEq):
    """MuonEq that keeps a copy of every M̃ it feeds to DiagPre (the reference for the monitor),
    by parameter, each matrix of a stack in its order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.inputs = defaultdict(list)
        self.pending = defaultdict(dict)  # a step's blocks of a parameter, by block index

    def prepare(self, M, segment, group, out):
        layout = segment.layout
        splits = len(layout.rows)
        for j, p in enumerate(segment.params):  # rows: parameters, then experts, of one split
            for expert in range(layout.count):
                block = M[j * layout.count + expert].detach().clone()
                self.pending[p][expert * splits + segment.split] = block
            if len(self.pending[p]) == len(layout.blocks):  # in the layout's order
                self.inputs[p] += [self.pending[p][b] for b in range(len(layout.blocks))]
                self.pending[p].clear()
        return M


class Tiny(pl.LightningModule):
    """Conv stem (AdamW), a conv and a hidden Linear (Muon), a Linear head (AdamW)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(2, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 6, 3, padding=1)
        self.hidden = nn.Linear(6 * 16, 10)
        self.head = nn.Linear(10, 3)
        self.losses: list[torch.Tensor] = []

    def forward(self, x):
        x = torch.tanh(self.conv2(torch.tanh(self.stem(x))))
        return self.head(torch.tanh(self.hidden(x.flatten(1))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return RecordingMuonEq(param_groups(self, lr=0.05), momentum=0.9, nesterov=True,
                               mode="R", ns_dtype=torch.float32, weight_decay=0.01)


def _data(n: int = 40) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 2, 4, 4, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)


def _leave_process_group() -> None:
    """At the exit of a ``ddp_spawn`` process (which imports this module to unpickle ``Tiny``):
    a gloo process group left to the interpreter's exit can abort it after a finished fit."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


atexit.register(_leave_process_group)


def _fit(tmp_path, callbacks=(), logger=False, devices=1, **trainer_kwargs) -> Tiny:
    model = Tiny()
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, default_root_dir=tmp_path, logger=logger,
        callbacks=list(callbacks), enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, **trainer_kwargs,
    )
    trainer.fit(model, _data())
    return model


def _rows(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_monitor_keeps_the_trajectory_and_measures_the_optimizers_own_input(tmp_path):
    kwargs = dict(max_steps=20, gradient_clip_val=0.05)  # clipping acts after Lightning's hook
    plain = _fit(tmp_path / "plain", **kwargs)
    monitor = SpectralMonitor(modules=["conv2", "hidden", "head"])
    logger = TensorBoardLogger(tmp_path / "tb", name="run")
    watched = _fit(tmp_path / "watched", [monitor], logger, **kwargs)

    assert torch.equal(torch.stack(plain.losses), torch.stack(watched.losses))
    for a, b in zip(plain.parameters(), watched.parameters(), strict=True):
        assert torch.equal(a, b)

    assert monitor.target_steps == {1, 2, 10, 20}  # 1%, 10%, 50%, 100% of 20 steps
    rows = _rows(monitor.csv_path)
    assert monitor.csv_path.parent == tmp_path / "tb" / "run" / "version_0"
    assert sorted({int(r["step"]) for r in rows}) == [1, 2, 10, 20]
    assert {r["module"] for r in rows} == {"conv2", "hidden"}  # head is on AdamW: skipped
    assert len(rows) == 4 * 2 * 4
    assert {(r["module"], r["m"], r["n"]) for r in rows} == {("conv2", "6", "36"),
                                                             ("hidden", "10", "96")}

    # The monitored matrix is the optimizer's M̃ (after clipping) at that very step.
    opt = watched.trainer.optimizers[0]
    for module in ("conv2", "hidden"):
        weight = getattr(watched, module).weight
        for r in rows:
            if r["module"] == module and r["mode"] == "none":
                m_tilde = opt.inputs[weight][int(r["step"]) - 1]
                expected = stable_rank(m_tilde).item()
                assert float(r["stable_rank"]) == pytest.approx(expected, rel=1e-12)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(monitor.csv_path.parent)).Reload()
    tags = events.Tags()
    assert "spectra/hidden/RC/condition_number" in tags["scalars"]
    assert [e.step for e in events.Scalars("spectra/conv2/R/ns_rel_error")] == [1, 2, 10, 20]
    assert "spectra/ns_error_curves" in tags["images"]
    # TensorBoard's Images tab shows it 350 pixels wide: 10-point text drawn at matplotlib's
    # 100 dpi is then at least 10 pixels tall (a 5.6-inch figure showed it 8.7)
    (image,) = events.Images("spectra/ns_error_curves")[-1:]
    assert 10 / 72 * 100 * 350 / image.width >= 10, image.width


def test_fires_on_optimizer_steps_under_gradient_accumulation(tmp_path):
    monitor = SpectralMonitor(modules=["hid*"], fractions=(0.3, 1.0), modes=("none", "RC"),
                              log_figures=False)
    _fit(tmp_path, [monitor], max_steps=10, accumulate_grad_batches=2)
    rows = _rows(monitor.csv_path)
    assert monitor.csv_path.parent == tmp_path
    assert [(r["step"], r["mode"]) for r in rows] == [("3", "none"), ("3", "RC"),
                                                      ("10", "none"), ("10", "RC")]
    assert [r["fraction"] for r in rows[::2]] == ["0.3", "1.0"]


def test_resuming_from_a_checkpoint_measures_later_steps_once(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(ckpt_path=None):
        monitor = SpectralMonitor(modules=["hidden"], steps=[2, 12, 20], modes=("RC",),
                                  log_figures=False)
        every10 = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=10,
                                  save_top_k=-1, filename="{step}")
        model, trainer = Tiny(), pl.Trainer(
            accelerator="cpu", devices=1, default_root_dir=tmp_path, logger=False,
            callbacks=[monitor, every10], enable_progress_bar=False,
            enable_model_summary=False, max_steps=20,
        )
        trainer.fit(model, _data(), ckpt_path=ckpt_path)
        return _rows(monitor.csv_path)

    first = run()
    resumed = run(ckpt_path=tmp_path / "ckpt" / "step=10.ckpt")
    assert [r["step"] for r in resumed] == ["2", "12", "20"]
    assert resumed == first  # the same trajectory, each step measured once


class Experts(nn.Module):
    """A ``transformers`` MoE expert bank as :func:`muoneq.param_groups` recognizes it: fused
    gate/up ``(experts, 2f, d)`` and down ``(experts, d, f)``."""

    is_transposed, has_gate, is_concatenated = False, True, True

    def __init__(self, experts: int, d: int, f: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * f, d) / d**0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, d, f) / f**0.5)

    def forward(self, x):
        gate, up = torch.einsum("bd,efd->bef", x, self.gate_up_proj).chunk(2, dim=-1)
        return torch.einsum("bef,edf->bd", F.silu(gate) * up, self.down_proj)


class Stored(Tiny):
    """Weights stored other than (out, in): HF GPT-2's ``Conv1D`` (transposed), a fused Q/K/V
    ``Conv1D`` (transposed and split in three), an expert bank (one matrix per expert, gate/up
    split in two)."""

    def __init__(self):
        from transformers.pytorch_utils import Conv1D

        pl.LightningModule.__init__(self)
        torch.manual_seed(0)
        self.attn = nn.Module()
        self.attn.c_attn = Conv1D(nf=3 * 8, nx=6)  # stored (6, 24): Q, K, V of (8, 6) each
        self.mlp = nn.Module()
        self.mlp.c_fc = Conv1D(nf=12, nx=8)  # stored (8, 12): the matrix is (12, 8)
        self.experts = Experts(2, 12, 5)
        self.head = nn.Linear(12, 3)
        self.losses = []

    def forward(self, x):
        q, k, v = self.attn.c_attn(x.flatten(1)[:, :6]).chunk(3, dim=-1)
        h = torch.tanh(self.mlp.c_fc(torch.tanh(q + k * v)))
        return self.head(torch.tanh(self.experts(h)))

    def configure_optimizers(self):
        return RecordingMuonEq(param_groups(self, lr=0.05, split_fused=True), momentum=0.9,
                               nesterov=True, mode="R", weight_decay=0.01)


def test_transposed_banked_and_fused_weights_are_measured_as_the_optimizer_sees_them(tmp_path):
    """Block by block, each row's metrics are those of the very matrix the optimizer fed to
    DiagPre at that step (recorded inside the optimizer), in its (out, in) orientation."""
    from muoneq.diagnostics import error_decomposition
    from muoneq.suite.spectra.monitor import METRICS

    monitor = SpectralMonitor(modules=["attn.c_attn", "mlp.c_fc", "experts"], steps=[1, 3],
                              modes=("none", "R", "C"), log_figures=False)
    model = Stored()
    trainer = pl.Trainer(accelerator="cpu", max_steps=3, default_root_dir=tmp_path,
                         logger=TensorBoardLogger(tmp_path / "tb", name="run"),
                         callbacks=[monitor], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(model, _data())
    rows = _rows(monitor.csv_path)

    shapes = {(r["module"], int(r["block"])): (int(r["m"]), int(r["n"])) for r in rows}
    assert shapes == {
        **{("attn.c_attn", b): (8, 6) for b in range(3)},  # Q, K, V of the (24, 6) matrix
        ("mlp.c_fc", 0): (12, 8),  # (out, in), not the stored (8, 12)
        **{("experts.gate_up_proj", b): (5, 12) for b in range(4)},  # 2 experts × gate, up
        **{("experts.down_proj", b): (12, 5) for b in range(2)},
    }
    assert len(rows) == 2 * len(shapes) * 3

    opt = trainer.optimizers[0]
    params = {"attn.c_attn": model.attn.c_attn.weight, "mlp.c_fc": model.mlp.c_fc.weight,
              "experts.gate_up_proj": model.experts.gate_up_proj,
              "experts.down_proj": model.experts.down_proj}
    for r in rows:
        blocks = sum(1 for module, _ in shapes if module == r["module"])
        seen = opt.inputs[params[r["module"]]]  # blocks in the optimizer's order, step by step
        assert len(seen) == 3 * blocks
        fed = seen[(int(r["step"]) - 1) * blocks + int(r["block"])]
        expected = error_decomposition(fed.double(), r["mode"], 5, "quintic", torch.float64,
                                       1e-8)[r["mode"]]
        for metric in METRICS:
            name = {"ns_error": "finite_step_error", "ns_rel_error": "relative_error"}.get(
                metric, metric)
            assert float(r[metric]) == pytest.approx(float(getattr(expected, name)),
                                                     rel=1e-12), (r["module"], metric)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = EventAccumulator(str(monitor.csv_path.parent)).Reload().Tags()["scalars"]
    assert "spectra/attn.c_attn/block2/R/condition_number" in tags
    assert "spectra/mlp.c_fc/C/stable_rank" in tags


def test_default_fractions_and_explicit_steps():
    monitor = SpectralMonitor()
    assert monitor.resolve_steps(1000) == {10, 100, 500, 1000}
    assert monitor.resolve_steps(7) == {1, 4, 7}
    assert SpectralMonitor(steps=[5, 2]).resolve_steps(1000) == {2, 5}


@pytest.mark.parametrize("kwargs,field", [
    (dict(fractions=(0.0, 0.5)), "fractions"),
    (dict(fractions=(1.5,)), "fractions"),
    (dict(steps=[0]), "steps"),
    (dict(modules="hidden"), "modules"),
    (dict(modes=("R", "diag")), "mode"),
    (dict(ns_dtype="int8"), "ns_dtype"),
    (dict(ns_coefficients="cubic"), "ns_coefficients"),
])
def test_bad_configuration_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SpectralMonitor(**kwargs)


def test_patterns_that_select_nothing_are_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"modules: \['head', 'stem'\] selects no matrix weight"):
        _fit(tmp_path, [SpectralMonitor(modules=["head", "stem"])], max_steps=2)


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_only_rank_zero_measures_and_writes(tmp_path):
    monitor = SpectralMonitor(modules=["hidden"], steps=[2, 5], modes=("none", "R"),
                              log_figures=False)
    _fit(tmp_path, [monitor], max_steps=5, strategy="ddp_spawn", devices=2)
    rows = _rows(tmp_path / "spectra.csv")
    assert [(r["step"], r["module"], r["mode"]) for r in rows] == [
        ("2", "hidden", "none"), ("2", "hidden", "R"), ("5", "hidden", "none"), ("5", "hidden", "R")
    ]


FSDP2_SCRIPT = """
import sys
import lightning.pytorch as pl
import torch
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader
from muoneq import MuonEq, param_groups
from muoneq.suite.spectra import SpectralMonitor

def data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)) for _ in range(4)]

class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(),
                                       torch.nn.Linear(10, 4))

    def configure_model(self):
        if self.device_mesh is not None:
            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net[0], self.net[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, xy, _):
        return torch.nn.functional.mse_loss(self.net(xy[0][0]), xy[1][0])

    def configure_optimizers(self):
        return MuonEq(param_groups(self.net, lr=0.05), ns_dtype=torch.float32)

devices = int(sys.argv[2])
strategy = (pl.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
            if devices == 2 else "auto")
torch.set_num_threads(1)
monitor = SpectralMonitor(modules=["net.0"], steps=[2, 4], modes=("none", "RC"),
                          log_figures=False)
trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=4,
                     logger=False, default_root_dir=sys.argv[1], callbacks=[monitor],
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, use_distributed_sampler=False)
trainer.fit(Module(), DataLoader(data(), batch_size=1))
if torch.distributed.is_initialized():  # gloo's threads can abort the interpreter's exit
    torch.distributed.destroy_process_group()
"""


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_shards_are_gathered_and_match_one_process(tmp_path):
    """Row-sharded DTensor gradients and momentum (ModelParallelStrategy, 2 CPU ranks): the
    monitor gathers whole matrices and measures what a single process measures."""
    import os
    import subprocess
    import sys

    script = tmp_path / "fit.py"
    script.write_text(FSDP2_SCRIPT)
    results = {}
    for devices in (1, 2):
        port = free_port()
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        out = tmp_path / f"run{devices}"
        done = subprocess.run([sys.executable, str(script), str(out), str(devices)], env=env,
                              capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        results[devices] = _rows(out / "spectra.csv")
    single, sharded = results[1], results[2]
    assert [(r["step"], r["m"], r["n"], r["mode"]) for r in sharded] == [
        ("2", "10", "6", "none"), ("2", "10", "6", "RC"), ("4", "10", "6", "none"),
        ("4", "10", "6", "RC")]
    for a, b in zip(single, sharded, strict=True):
        for key in ("stable_rank", "condition_number", "ns_rel_error", "bias"):
            assert float(b[key]) == pytest.approx(float(a[key]), rel=1e-4, abs=1e-6)
