"""The suite's workloads (installed as ``muoneq.tasks``)."""
