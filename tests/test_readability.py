"""What a newcomer follows: from ``MuonEq.step`` to the first matrix product of a default CPU
step in at most 4 of the project's frames in at most 3 files, and ``ns_steps`` from the
constructor to the Newton–Schulz iteration without a ``locals()`` or a partial's keywords."""

from __future__ import annotations

import ast
import inspect
import pathlib
import textwrap
import traceback

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import muoneq
from muoneq import MuonEq
from muoneq.functional import step_stacks
from muoneq.newton_schulz import MatrixIteration, StackIteration, ns_settings, resolve_schedule
from muoneq.optim.hybrid import HybridOrthogonalOptimizer, Shared

PACKAGE = pathlib.Path(muoneq.__file__).parent


class FirstProduct(TorchDispatchMode):
    """The project's frames on the stack when the first matrix product is dispatched."""

    def __init__(self):
        super().__init__()
        self.frames = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.frames is None and name in ("mm", "bmm", "addmm", "baddbmm"):
            self.frames = [f for f in traceback.extract_stack()
                           if pathlib.Path(f.filename).is_relative_to(PACKAGE)]
        return func(*args, **(kwargs or {}))


def test_a_default_cpu_step_reaches_its_first_matmul_in_four_frames_of_three_files():
    params = [nn.Parameter(torch.randn(12, 8)), nn.Parameter(torch.randn(8, 20))]
    for p in params:
        p.grad = torch.randn(p.shape)
    opt = MuonEq(params)  # the defaults: per matrix on a CPU
    opt.step()  # the plan is made at the first step
    with FirstProduct() as seen:
        opt.step()
    names = [f"{pathlib.Path(f.filename).name}:{f.name}" for f in seen.frames]
    assert names[0] == "hybrid.py:step", names
    assert len(names) <= 4 and len({n.split(":")[0] for n in names}) <= 3, names


def test_ns_steps_reaches_the_iteration_in_plain_sight():
    """No ``locals()`` capture and no ``functools.partial``'s ``.keywords`` read anywhere in
    the library: every setting travels by name, in frozen records a static reader follows."""
    for path in PACKAGE.rglob("*.py"):
        if "suite" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                assert ast.unparse(node.func) != "locals", path
            if isinstance(node, ast.Attribute):
                assert node.attr != "keywords", path


#: ``ns_steps`` from the constructor to the iteration, as a reader follows it: each hop a
#: function, a call it makes and the argument that carries the setting on (as written).
NS_STEPS_HOPS = [
    (MuonEq.__init__, "super().__init__", "**shared"),
    (HybridOrthogonalOptimizer.__init__, "dict", "ns_steps=given['ns_steps']"),
    (HybridOrthogonalOptimizer.__init__, "super().__init__", "defaults"),  # the param groups
    (HybridOrthogonalOptimizer._stack_settings, "ns_settings", "values['ns_steps']"),
    (ns_settings, "resolve_schedule", "steps"),
    (resolve_schedule, "NSSchedule", "(QUINTIC,) * ns_steps"),
    (HybridOrthogonalOptimizer.step, "dict", "ns=settings.ns"),
    (HybridOrthogonalOptimizer.step, "step_stacks", "**arguments"),
    (step_stacks, "chunk.iteration.iterate", "ns.schedule.coefficients"),
    (StackIteration.iterate, "newton_schulz_step", "a"),
    (MatrixIteration.iterate, "newton_schulz_step", "a"),
]


def passes(function, callee: str, argument: str) -> bool:
    """``function``'s source calls ``callee`` with ``argument`` among its arguments."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return any(ast.unparse(call.func) == callee
               and argument in [ast.unparse(a) for a in (*call.args, *call.keywords)]
               for call in ast.walk(tree) if isinstance(call, ast.Call))


def test_a_static_walk_of_ns_steps_from_the_constructor_reaches_the_iteration():
    """Read, not run: ``ns_steps`` is a shared keyword (``Shared``), goes into the groups'
    defaults, into the group's frozen ``NSSettings`` (its schedule: one ``(a, b, c)`` per step),
    which the step hands ``step_stacks``, whose chunk's iteration loops over those
    coefficients calling the Newton–Schulz step."""
    assert "ns_steps" in Shared.__annotations__
    for function, callee, argument in NS_STEPS_HOPS:
        assert passes(function, callee, argument), (function.__qualname__, callee, argument)
    for iteration in (StackIteration, MatrixIteration):
        loops = [ast.unparse(node.iter) for node in ast.walk(ast.parse(textwrap.dedent(
            inspect.getsource(iteration.iterate)))) if isinstance(node, ast.For)]
        assert loops[0] in ("coefficients", "enumerate(coefficients)"), loops
