"""Language workloads: the ``language`` task, GPT-2 and LLaMA-2 pretraining on token shards
(models, tokenizers, token shards and their loaders).

``TASK`` is what the ``muoneq.tasks`` entry point ``language`` names; this module imports no
Lightning (the builder does, when a run is built)."""

from muoneq.runtime.tasks import TaskSpec
from tasks.language.config import LanguageTaskConfig


def build(cfg):
    """The run's module and data module: :func:`tasks.language.task.build`."""
    from tasks.language.task import build

    return build(cfg)


TASK = TaskSpec(LanguageTaskConfig, build, "GPT-2 / LLaMA-2 pretraining on token shards: "
                "validation perplexity")
