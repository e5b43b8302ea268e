"""A real full disk for the fault tests: a small tmpfs mounted in a mount namespace of the test's
own (``unshare --user --map-root-user --mount``, which needs no privileges where the kernel lets
users make namespaces), so that nothing outside the commands run on it sees the mount, and it goes
away with them. Where the machine allows no such namespace the tests that need one are skipped,
saying why: faking ``ENOSPC`` in Python would not exercise what a real disk does (torch's zip
writer, TensorBoard's writer thread, Optuna's journal each meet it their own way)."""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

#: ``sh -c`` prologue: mount a tmpfs of ``$1`` bytes at ``$2``, then fill it all but ``$3``
#: bytes (tmpfs counts whole pages), then run the rest of the script.
_PROLOGUE = ('mount -t tmpfs -o "size=$1" tmpfs "$2" || exit 97\n'
             'fill=$(( $1 - $3 ))\n'
             'if [ "$fill" -gt 0 ]; then head -c "$fill" /dev/zero > "$2/.filler" || exit 98; fi\n')


@functools.cache
def unavailable() -> str | None:
    """Why no small tmpfs can be mounted here (None: it can)."""
    if shutil.which("unshare") is None:
        return "no unshare command (util-linux) on this machine"
    with tempfile.TemporaryDirectory() as folder:
        probe = subprocess.run(
            ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
             'mount -t tmpfs -o size=64k tmpfs "$0"', folder],
            capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        return ("this machine lets no user mount a tmpfs in a namespace of its own "
                f"(unshare --user --map-root-user --mount: {probe.stderr.strip()[:200]})")
    return None


def run(mountpoint: Path, script: str, *, size: int = 1 << 20, free: int,
        timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    """Run the shell ``script`` (``$DISK``: the mount point) with a tmpfs of ``size`` bytes
    mounted at ``mountpoint`` (an empty folder) and filled up to leave ``free`` bytes (its
    ``.filler`` file; ``rm "$DISK/.filler"`` frees them). Skips the test where it cannot."""
    why = unavailable()
    if why is not None:
        pytest.skip(why)
    done = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
         _PROLOGUE + 'export DISK="$2"\n' + script, "sh", str(size), str(mountpoint), str(free)],
        capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode not in (97, 98), done.stderr  # the disk itself could not be made
    return done
