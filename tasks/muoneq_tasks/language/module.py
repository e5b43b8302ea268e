"""The language task's LightningModule: next-token loss, exact validation perplexity, MFU."""

from __future__ import annotations

import math

import torch

from muoneq.suite.runtime import TaskModule
from muoneq.suite.runtime.accelerators import device_peak_tflops
from muoneq.suite.runtime.callbacks import StepStats
from muoneq_tasks.language.base import CausalLM, lm_loss
from muoneq_tasks.language.data import perplexity


class LanguageModule(TaskModule):
    """Causal language modelling with one optimizer (built from the run's optimizer config).

    * Global batch: ``task.data.batch_size`` sequences per optimizer step, reached by
      Lightning's gradient accumulation over micro-batches of ``micro_batch_size`` per process;
      ``setup`` derives ``trainer.accumulate_grad_batches`` from the number of processes.
      Lightning divides each micro-batch loss by the accumulation count, so gradients are
      averaged, never summed.
    * Validation every ``val_every_n_steps`` optimizer steps (and, by the runtime, on the final
      weights): the summed token losses and token counts of all processes are all-reduced, so
      ``val/loss`` is the mean over exactly the validation budget and ``val/ppl =
      exp(val/loss)``, whatever the number of processes.
    * Throughput: ``perf/tokens_per_s`` and ``perf/mfu`` (model FLOPs per token × tokens/s over
      the devices' peak) per optimizer step; their run means go to ``metrics.json``.
    """

    monitor = "val/loss"
    monitor_mode = "min"
    paper_metric = "val/ppl"
    hparam_metrics = ("val/ppl", "best_val_ppl")

    def __init__(self, model: CausalLM, *, seq_len: int, batch_size: int, micro_batch_size: int,
                 val_every_n_steps: int, peak_tflops: float | None = None, **kwargs):
        super().__init__(model, **kwargs)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.micro_batch_size = micro_batch_size
        self.val_every_n_steps = val_every_n_steps
        self.peak_tflops = peak_tflops
        self.tokens_per_step = batch_size * seq_len
        self.flops_per_token = model.flops_per_token(seq_len)
        self.best_val_loss = math.inf
        self._throughput_logged_at: int | None = None  # the global step of the last perf/ values
        self._val_totals: torch.Tensor | None = None

    def fsdp_units(self):
        return list(self.model.blocks)

    # ------------------------------------------------------------------ set-up
    def setup(self, stage: str) -> None:
        """Derive gradient accumulation and the validation interval (in micro-batches) from
        the global batch and the number of processes."""
        if stage != "fit":
            return
        trainer = self.trainer
        per_pass = self.micro_batch_size * trainer.world_size
        if self.batch_size % per_pass:
            raise ValueError(
                f"task.data.batch_size={self.batch_size} is not a multiple of "
                f"task.data.micro_batch_size × processes = {self.micro_batch_size} × "
                f"{trainer.world_size}"
            )
        accumulation = self.batch_size // per_pass
        if trainer.accumulate_grad_batches not in (1, accumulation):
            raise ValueError(
                f"trainer.accumulate_grad_batches={trainer.accumulate_grad_batches}: leave it at "
                f"1; the language task sets it ({accumulation}) from task.data.batch_size"
            )
        if trainer.val_check_interval not in (1.0, None):
            raise ValueError("trainer.val_check_interval: leave it unset; the language task "
                             "validates every task.val_every_n_steps optimizer steps")
        trainer.accumulate_grad_batches = accumulation
        trainer.val_check_interval = self.val_every_n_steps * accumulation
        trainer.check_val_every_n_epoch = None

    # ------------------------------------------------------------------ training
    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = lm_loss(self(inputs), targets)
        if self.logs_step():
            self.log("train/loss", loss, prog_bar=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        # the time of a step StepStats has just logged (it logs on the steps whose values are
        # kept, reading the device's timing there; its hook runs before this one)
        logged = self._step_stats().logged
        if logged is None or logged[0] == self._throughput_logged_at:
            return
        self._throughput_logged_at = logged[0]
        tokens_per_s = self.tokens_per_step / logged[1]
        metrics = {"perf/tokens_per_s": tokens_per_s}
        if (mfu := self.mfu(tokens_per_s)) is not None:
            metrics["perf/mfu"] = mfu
        self.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)

    def mfu(self, tokens_per_s: float, device: torch.device | None = None) -> float | None:
        """Model FLOPs utilization of all processes at ``tokens_per_s`` on ``device`` (default:
        the module's; None: peak unknown)."""
        peak = self.peak_tflops or device_peak_tflops(device or self.device)
        if peak is None:
            return None
        return self.flops_per_token * tokens_per_s / (peak * 1e12 * self.trainer.world_size)

    # ------------------------------------------------------------------ validation
    def on_validation_epoch_start(self) -> None:
        dtype = torch.float32 if self.device.type == "mps" else torch.float64
        self._val_totals = torch.zeros(2, dtype=dtype, device=self.device)

    def validation_step(self, batch, batch_idx):
        inputs, targets = batch
        loss_sum = lm_loss(self(inputs), targets, reduction="sum")
        self._val_totals += torch.stack((loss_sum.to(self._val_totals.dtype),
                                         self._val_totals.new_tensor(targets.numel())))

    def on_validation_epoch_end(self) -> None:
        loss_sum, tokens = self.trainer.strategy.reduce(self._val_totals, reduce_op="sum").tolist()
        mean = loss_sum / tokens
        if not self.trainer.sanity_checking:
            self.best_val_loss = min(self.best_val_loss, mean)
        values = {"val/loss": mean, "val/ppl": perplexity(mean), "val/tokens": tokens}
        if math.isfinite(self.best_val_loss):
            values["best_val_ppl"] = perplexity(self.best_val_loss)
        # identical on every process already; sync_dist only keeps Lightning from warning
        self.log_dict(values, prog_bar=True, sync_dist=True)

    # ------------------------------------------------------------------ checkpoint and report
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["language"] = {"best_val_loss": self.best_val_loss}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.best_val_loss = checkpoint.get("language", {}).get("best_val_loss", math.inf)

    def _step_stats(self) -> StepStats:
        return next(cb for cb in self.trainer.callbacks if isinstance(cb, StepStats))

    def final_metrics(self) -> dict:
        # the device training ran on: by now the module is back on the CPU
        stats = self._step_stats()
        step_time = stats.summary()["step_time_s"]
        tokens_per_s = self.tokens_per_step / step_time if step_time == step_time else None
        best = self.best_val_loss
        return {
            **super().final_metrics(),
            "non_embedding_parameters": self.model.num_params(non_embedding=True),
            "tokens": self.trainer.global_step * self.tokens_per_step,
            "tokens_per_step": self.tokens_per_step,
            "flops_per_token": self.flops_per_token,
            "tokens_per_s": tokens_per_s,
            "mfu": self.mfu(tokens_per_s, stats.device) if tokens_per_s else None,
            "best_val_loss": best if math.isfinite(best) else None,
            "best_val_ppl": perplexity(best) if math.isfinite(best) else None,
        }
