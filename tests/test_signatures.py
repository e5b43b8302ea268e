"""Every optimizer's constructor is written as ``torch.optim`` writes one: its own keywords in its
source with their types and defaults, handed to the base as ``defaults = dict(...)``; the
keywords every matrix optimizer shares declared once (``Shared``, read by IDEs and type checkers
through ``**shared: Unpack[Shared]``); the group defaults are the signature's."""

from __future__ import annotations

import ast
import inspect
import pathlib
import textwrap

import pytest
import torch
from torch import nn

import muoneq
from muoneq.optim import signature
from muoneq.optim.base import OptimizerBase
from muoneq.optim.hybrid import OPTIONS, SHARED_DEFAULTS, HybridOrthogonalOptimizer, Shared
from muoneq.registry import OPTIMIZERS

OURS = sorted({spec.factory for spec in OPTIMIZERS.values()
               if isinstance(spec.factory, type) and issubclass(spec.factory, OptimizerBase)},
              key=lambda cls: cls.__name__)
MATRIX = [c for c in OURS if issubclass(c, HybridOrthogonalOptimizer)]


def constructor(cls: type) -> ast.FunctionDef:
    """The ``__init__`` written in ``cls``'s own source."""
    assert "__init__" in cls.__dict__, f"{cls.__name__} inherits its constructor"
    (tree,) = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__))).body
    return tree


def built(cls: type, **kwargs) -> OptimizerBase:
    return cls([nn.Parameter(torch.randn(3, 4))], **kwargs)


@pytest.mark.parametrize("cls", OURS, ids=lambda cls: cls.__name__)
def test_the_constructor_names_its_own_keywords_and_the_shared_ones_once(cls):
    """``def __init__(self, params, *, <own keywords with annotation and default>,
    **shared: Unpack[Shared])`` (MarsAdamW, which shares nothing: ``**misspelled: Never``), and
    ``super().__init__(params, dict(...))``: the defaults as ``torch.optim`` writes them."""
    tree = constructor(cls)
    args = tree.args
    assert [a.arg for a in args.args] == ["self", "params"] and args.vararg is None
    shared = issubclass(cls, HybridOrthogonalOptimizer)
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        assert arg.annotation is not None and default is not None, arg.arg
        assert not (shared and arg.arg in Shared.__annotations__), f"{arg.arg} is shared"
    assert ast.unparse(args.kwarg.annotation) == ("Unpack[Shared]" if shared else "Never")
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and ast.unparse(n.func) == "super().__init__"]
    assert len(calls) == 1 and ast.unparse(calls[0].args[1]).startswith("dict(")


def test_no_constructor_captures_its_locals():
    """A static reader follows every keyword from the signature to its use: no ``locals()``."""
    for path in pathlib.Path(muoneq.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Call)
                    and ast.unparse(n.func) == "locals"], path


def test_the_shared_keywords_have_one_default_each():
    assert set(SHARED_DEFAULTS) == set(Shared.__annotations__)
    assert set(OPTIONS) < set(Shared.__annotations__)


@pytest.mark.parametrize("cls", OURS, ids=lambda cls: cls.__name__)
def test_the_group_defaults_are_the_signatures(cls):
    """Every keyword's default (``signature``, the shared ones with the class's own defaults)
    is the group default, but for the options a copy keeps; the group keys that are no
    keyword (``use_muon``, the layout keys) default to the plain ``(out, in·…)`` matrix."""
    real = dict(list(signature(cls).parameters.items())[1:])
    opt = built(cls)
    options = opt._options()
    for name, p in real.items():
        if name in options:
            assert options[name] == p.default or name == "ns_backend", name
        else:
            assert opt.defaults[name] == p.default, name
    extra = set(opt.defaults) - set(real)
    assert extra == ({"use_muon", "transposed", "batch_dims", "splits"}
                     if issubclass(cls, HybridOrthogonalOptimizer) else set())
    assert set(opt.hyperparameters) == set(opt.defaults)


def test_a_methods_own_default_of_a_shared_keyword_is_in_its_signature():
    mousse = signature(OPTIMIZERS["mousse"].factory).parameters
    assert mousse["nesterov"].default is False
    assert mousse["lr_adjust"].default == "spectral_unclamped"
    assert signature(muoneq.MuonEq).parameters["nesterov"].default is True


@pytest.mark.parametrize("cls", OURS, ids=lambda cls: cls.__name__)
def test_every_numeric_argument_reaches_the_group(cls):
    """A value passed for any numeric argument is the group's (no argument is dropped on the
    way to the base class)."""
    changed = {}
    for name, p in list(signature(cls).parameters.items())[1:]:
        if isinstance(p.default, bool) or not isinstance(p.default, (int, float)):
            continue
        changed[name] = p.default - 1 if isinstance(p.default, int) and p.default > 1 \
            else p.default / 2
    assert changed
    group = built(cls, **changed).param_groups[0]
    assert {k: group[k] for k in changed} == changed


def test_a_subclass_without_a_constructor_takes_its_bases():
    class Scaled(HybridOrthogonalOptimizer):
        pass

    assert signature(Scaled) == signature(HybridOrthogonalOptimizer)
    assert built(Scaled, lr=0.5).defaults["lr"] == 0.5
    with pytest.raises(TypeError, match="'lrr'; did you mean 'lr'"):
        built(Scaled, lrr=0.5)


def test_a_subclass_that_hands_its_arguments_on_keeps_its_bases_defaults_and_keywords():
    """``__init__(self, *args, **kwargs)`` that calls its base's, a common way to extend."""

    class Counting(muoneq.MuonEq):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.calls = 0

    opt = built(Counting, batching="stacked", mode="RC")
    assert opt.defaults["mode"] == "RC" and opt.defaults["eps"] == 1e-8
    assert opt.batching == "stacked" and opt.calls == 0
    assert signature(Counting) == signature(muoneq.MuonEq)
    with pytest.raises(TypeError, match="'compil'; did you mean 'compile'"):
        built(Counting, compil=True)
