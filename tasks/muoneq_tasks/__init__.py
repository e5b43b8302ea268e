"""The suite's workloads: one package per task, each declaring its ``TASK`` (a
:class:`muoneq.suite.runtime.TaskSpec`), found through the ``muoneq.tasks`` entry points of
``pyproject.toml`` (docs/architecture.md)."""
