"""What one optimizer step dispatches: aten operations and the tensors they allocate, counted
below autograd with a ``TorchDispatchMode`` (what a GPU runs as kernels and what the CPU pays in
dispatch), and on CPU the allocator's own record from the profiler."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class Dispatched(TorchDispatchMode):
    """Counts every aten operation dispatched while active (``ops``, by name) and the tensors
    they return in storage none of their arguments had (``allocated``: new tensors, not views
    or ``out=`` results)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.allocated: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "profiler":  # torch.optim's step hook, not the step's own work
            self.ops[func.overloadpacket.__name__] += 1
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}
        result = func(*args, **kwargs)
        for t in tree_leaves(result):
            if (isinstance(t, torch.Tensor) and t.numel()
                    and t.untyped_storage().data_ptr() not in given):
                self.allocated.append(str(func))
        return result

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def dispatched(fn: Callable[[], object]) -> Dispatched:
    """Run ``fn`` under a :class:`Dispatched` and return it."""
    with Dispatched() as seen:
        fn()
    return seen


def cpu_allocations(fn: Callable[[], object]) -> list[int]:
    """Bytes of every allocation the CPU allocator made while ``fn`` ran (profiler record)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [e.nbytes() for e in prof.profiler.kineto_results.events()
            if e.name() == "[memory]" and e.nbytes() > 0]
