"""Language workloads: the ``language`` task, GPT-2 and LLaMA-2 pretraining on token shards
(models, tokenizers, token shards and their loaders).

``TASK`` is what the ``muoneq.tasks`` entry point ``language`` names; this module imports no
Lightning (the builder does, when a run is built)."""

from muoneq.suite.runtime.tasks import TaskCommand, TaskSpec
from muoneq_tasks.language.config import LanguageTaskConfig


def build(cfg):
    """The run's module and data module: :func:`muoneq_tasks.language.task.build`."""
    from muoneq_tasks.language.task import build

    return build(cfg)


def metrics(cfg) -> tuple[str, ...]:
    """What :class:`muoneq_tasks.language.module.LanguageModule` adds to ``metrics.json`` with a
    value on this machine (``perf/mfu`` and ``mfu`` only where the devices' peak FLOPs can be
    known: :func:`measures_mfu`)."""
    mfu = ("perf/mfu", "mfu") if measures_mfu(cfg) else ()
    return ("train/loss", "val/loss", "val/ppl", "val/tokens", "best_val_loss", "best_val_ppl",
            "perf/tokens_per_s", "non_embedding_parameters", "tokens", "tokens_per_step",
            "flops_per_token", "tokens_per_s", *mfu)


def measures_mfu(cfg) -> bool:
    """Whether a run of ``cfg`` on this machine has a peak FLOP/s to divide by: the config's
    ``task.peak_tflops``, or CUDA GPUs (the module knows common NVIDIA GPUs by name; an unknown
    one writes ``null``, which a sweep reports as a missing objective). None on a CPU."""
    if cfg.task.peak_tflops is not None:
        return True
    accelerator = getattr(cfg.trainer.accelerator, "value", cfg.trainer.accelerator)
    if accelerator in ("cuda", "gpu"):
        return True
    if accelerator == "auto":
        import torch

        return torch.cuda.is_available()
    return False


def check_data(cfg) -> None:
    """The shards' sizes against what the run reads:
    :func:`muoneq_tasks.language.data.check_split_sizes`."""
    from muoneq_tasks.language.data import check_split_sizes

    check_split_sizes(cfg.task.data)


def synthetic_data(cfg, folder):
    """Uniform random token shards for the run ``cfg``: :func:`.shards.write_synthetic`."""
    from muoneq_tasks.language.shards import write_synthetic

    return write_synthetic(cfg, folder)


def mini_data(folder):
    """Python's pydoc topics as byte shards: :func:`.mini.mini_data`."""
    from muoneq_tasks.language.mini import mini_data

    return mini_data(folder)


TASK = TaskSpec(
    LanguageTaskConfig, build, "GPT-2 / LLaMA-2 pretraining on token shards: validation "
    "perplexity", metrics, synthetic_data, check_data=check_data,
    commands={"data": TaskCommand(
        "muoneq_tasks.language.prepare",
        "tokenize a corpus (FineWeb, C4, local files) into token shards")},
    lean_imports=True, mini_data=mini_data,
)
