"""A training process's C allocator: freed tensor memory kept for the next step, not returned.

A training step on a CPU allocates and frees the same activations and gradients every step
(megabytes each). glibc's ``malloc`` hands such blocks back to the kernel when they are freed
(``munmap`` above its mmap threshold, a heap trimmed past its trim threshold), so the next step
takes them again page by page: hundreds of page faults and milliseconds of kernel time per
step of the demo's tiny LLaMA (``getrusage`` counts them). :func:`keep_freed_memory` raises both
thresholds with ``mallopt`` so that the process keeps what it freed for its next step: the step
stops faulting and its numbers do not change (only where the bytes live). It costs at most
:data:`TRIM_THRESHOLD` bytes of memory the process keeps after it frees them.

PyTorch's CPU performance guides recommend preloading jemalloc or tcmalloc for the same reason;
neither ships with Python or its wheels, and a preload must be set before the interpreter starts
(a warm trial is forked from a server that started long before), so this sets glibc's own
options, which a running process can change. Elsewhere (another C library, or not Linux) it
does nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys

#: ``mallopt`` parameters (glibc's ``malloc.h``).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
#: Blocks below this come from the heap, whose freed memory is reused (glibc's largest value on
#: 64-bit systems: ``HEAP_MAX_SIZE / 2``).
MMAP_THRESHOLD = 32 << 20
#: Free memory at the top of the heap kept rather than returned to the kernel.
TRIM_THRESHOLD = 64 << 20
#: Extra memory the heap grows by when it grows, so that growing is rare.
TOP_PAD = 16 << 20


def keep_freed_memory() -> bool:
    """Set this process's glibc ``malloc`` to keep freed memory (module docstring); False where
    the C library is not glibc (nothing is changed)."""
    if not sys.platform.startswith("linux") or not _glibc():
        return False
    libc = ctypes.CDLL(None)  # the process's own symbols: its C library's mallopt
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
                (M_TOP_PAD, TOP_PAD))
    return all(libc.mallopt(option, value) == 1 for option, value in settings)


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError):  # not a name this system knows: not glibc
        return False
