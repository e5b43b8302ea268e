"""Documented commands run as a user types them: ``make`` targets in a clean environment, and
the one-line error ``muoneq`` must give."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without launcher variables a test run may have inherited."""
    drop = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK",
            "GROUP_RANK", "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def make(*args: str, env: dict | None = None, timeout: int = 300):
    return subprocess.run(["make", "-s", "-C", str(REPO), *args], capture_output=True,
                          text=True, timeout=timeout, env=env or clean_env())


def one_line_error(err: str) -> str:
    """The error line of ``muoneq`` (after any progress output), checked to be the only one."""
    lines = [line for line in err.splitlines() if line.startswith("muoneq: ")]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]
