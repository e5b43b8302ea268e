"""Benchmarks of the optimizer step (``muoneq bench``) and the GPU check (``muoneq gpu-check``).

The repository's top-level ``benchmarks/`` folder holds what is not installed code: the script
for a GPU machine without a registry (``gpu_machine.sh``) and the results files it writes."""
