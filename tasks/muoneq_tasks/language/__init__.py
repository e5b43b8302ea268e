"""Language workloads: the ``language`` task, GPT-2 and LLaMA-2 pretraining on token shards
(models, tokenizers, token shards and their loaders).

``TASK`` is what the ``muoneq.tasks`` entry point ``language`` names; this module imports no
Lightning (the builder does, when a run is built)."""

from muoneq.suite.runtime.tasks import TaskSpec
from muoneq_tasks.language.config import LanguageTaskConfig


def build(cfg):
    """The run's module and data module: :func:`muoneq_tasks.language.task.build`."""
    from muoneq_tasks.language.task import build

    return build(cfg)


def metrics(cfg) -> tuple[str, ...]:
    """What :class:`muoneq_tasks.language.module.LanguageModule` adds to ``metrics.json``
    (``perf/mfu`` only where the devices' peak FLOPs are known: ``task.peak_tflops``, or a GPU
    it knows)."""
    return ("train/loss", "val/loss", "val/ppl", "val/tokens", "best_val_loss", "best_val_ppl",
            "perf/tokens_per_s", "perf/mfu", "non_embedding_parameters", "tokens",
            "tokens_per_step", "flops_per_token", "tokens_per_s", "mfu")


def check_data(cfg) -> None:
    """The shards' sizes against what the run reads:
    :func:`muoneq_tasks.language.data.check_split_sizes`."""
    from muoneq_tasks.language.data import check_split_sizes

    check_split_sizes(cfg.task.data)


TASK = TaskSpec(LanguageTaskConfig, build, "GPT-2 / LLaMA-2 pretraining on token shards: "
                "validation perplexity", metrics, check_data)
