"""Every optimizer's constructor is written out in its source (what IDEs, type checkers and
``help()`` read), each default once, and it is where the param groups' defaults come from."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

import pytest
import torch
from torch import nn

from muoneq.optim.base import Hyper, OptimizerBase
from muoneq.optim.checks import nonnegative
from muoneq.optim.hybrid import DEFAULTS, HybridOrthogonalOptimizer
from muoneq.registry import OPTIMIZERS

OURS = sorted({spec.factory for spec in OPTIMIZERS.values()
               if isinstance(spec.factory, type) and issubclass(spec.factory, OptimizerBase)},
              key=lambda cls: cls.__name__)
SHARED = {f.name for f in dataclasses.fields(DEFAULTS)}


def constructor(cls: type) -> ast.FunctionDef:
    """The ``__init__`` written in ``cls``'s own source."""
    assert "__init__" in cls.__dict__, f"{cls.__name__} inherits its constructor"
    (tree,) = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__))).body
    return tree


def built(cls: type, **kwargs) -> OptimizerBase:
    return cls([nn.Parameter(torch.randn(3, 4))], **kwargs)


@pytest.mark.parametrize("cls", OURS, ids=lambda cls: cls.__name__)
def test_the_signature_is_written_in_the_source_with_types_and_defaults(cls):
    """``inspect.signature(cls)`` is the ``def __init__`` of the class's own source: every name a
    literal keyword-only parameter with an annotation and a default, no ``**kwargs``."""
    tree = constructor(cls).args
    real = inspect.signature(cls).parameters
    assert [a.arg for a in tree.args] == ["self", "params"]
    assert tree.vararg is None and tree.kwarg is None
    assert [a.arg for a in tree.kwonlyargs] == list(real)[1:]
    for arg, default in zip(tree.kwonlyargs, tree.kw_defaults, strict=True):
        assert arg.annotation is not None and default is not None, arg.arg
        assert real[arg.arg].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize("cls", OURS, ids=lambda cls: cls.__name__)
def test_the_group_defaults_are_the_signatures(cls):
    """Every hyper-parameter argument's default is the group default; the other arguments are
    the options a copy keeps; the group keys that are no argument declare their own."""
    real = inspect.signature(cls).parameters
    opt = built(cls)
    arguments = {k for k, h in cls.hyperparameters.items() if h.argument}
    for name in arguments:
        assert opt.defaults[name] == real[name].default, name
    assert arguments | set(opt._options()) == set(list(real)[1:])
    assert set(opt.defaults) - arguments == {k for k, h in cls.hyperparameters.items()
                                             if not h.argument}


@pytest.mark.parametrize("cls", OURS, ids=lambda cls: cls.__name__)
def test_every_numeric_argument_reaches_the_group(cls):
    """A value passed for any numeric argument is the group's (no argument is dropped on the
    way to the base class)."""
    real = inspect.signature(cls).parameters
    changed = {}
    for name, p in list(real.items())[1:]:
        if isinstance(p.default, bool) or not isinstance(p.default, (int, float)):
            continue
        changed[name] = p.default - 1 if isinstance(p.default, int) and p.default > 1 \
            else p.default / 2
    assert changed
    group = built(cls, **changed).param_groups[0]
    assert {k: group[k] for k in changed} == changed


@pytest.mark.parametrize("cls", [c for c in OURS if issubclass(c, HybridOrthogonalOptimizer)],
                         ids=lambda cls: cls.__name__)
def test_a_shared_default_is_written_once(cls):
    """A matrix optimizer names the shared defaults (``DEFAULTS.lr``); a literal default of a
    shared argument must differ from the shared one (a method's own, as Mousse's
    ``nesterov=False``), never repeat it."""
    tree = constructor(cls).args
    for arg, default in zip(tree.kwonlyargs, tree.kw_defaults, strict=True):
        if arg.arg not in SHARED:
            continue
        if isinstance(default, ast.Attribute):
            assert ast.unparse(default) == f"DEFAULTS.{arg.arg}", arg.arg
        else:
            assert ast.literal_eval(default) != getattr(DEFAULTS, arg.arg), arg.arg


def test_a_default_in_the_table_or_an_argument_missing_from_the_signature_is_refused():
    with pytest.raises(TypeError, match="written in its __init__'s signature"):
        type("Twice", (HybridOrthogonalOptimizer,),
             {"hyperparameters": {"gamma": Hyper(nonnegative, default=0.5)}})
    with pytest.raises(TypeError, match="'gamma' must be a keyword-only argument"):
        type("Missing", (HybridOrthogonalOptimizer,),
             {"hyperparameters": {"gamma": Hyper(nonnegative)}})


def test_a_subclass_without_a_constructor_takes_its_bases():
    class Scaled(HybridOrthogonalOptimizer):
        def _direction(self, p, m_tilde, state, group):
            return m_tilde

    assert inspect.signature(Scaled) == inspect.signature(HybridOrthogonalOptimizer)
    assert built(Scaled, lr=0.5).defaults["lr"] == 0.5
    with pytest.raises(TypeError, match="'lrr'; did you mean 'lr'"):
        built(Scaled, lrr=0.5)


def test_a_subclass_that_hands_its_arguments_on_keeps_its_bases_defaults_and_keywords():
    """``__init__(self, *args, **kwargs)`` that calls its base's, a common way to extend."""
    from muoneq import MuonEq

    class Counting(MuonEq):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.calls = 0

    opt = built(Counting, batching="stacked", mode="RC")
    assert opt.defaults["mode"] == "RC" and opt.defaults["eps"] == 1e-8
    assert opt.batching == "stacked" and opt.calls == 0
    with pytest.raises(TypeError, match="'compil'; did you mean 'compile'"):
        built(Counting, compil=True)
