"""What a newcomer follows: from ``MuonEq.step`` to the first matrix product of a default CPU
step in at most 4 of the project's frames in at most 3 files, and ``ns_steps`` from the
constructor to the Newton–Schulz iteration without a ``locals()`` or a partial's keywords."""

from __future__ import annotations

import ast
import pathlib
import traceback

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import muoneq
from muoneq import MuonEq

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
