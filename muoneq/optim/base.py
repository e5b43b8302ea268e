"""The base of every optimizer here: declared hyper-parameters and the ``torch.optim`` contract.

An optimizer writes its constructor as ``torch.optim`` does, every hyper-parameter a
keyword-only argument with its type and default (the one place each default is written; IDEs,
type checkers, ``help()`` and the suite's config schema read it), and declares how each is
checked::

    class NorMuon(HybridOrthogonalOptimizer):
        hyperparameters = {"beta2": Hyper(decay, when="use_muon"), "eps": Hyper(nonnegative)}

        def __init__(self, params, *, lr: float = DEFAULTS.lr, ..., beta2: float = 0.95,
                     eps: float = 1e-10, ...):
            super().__init__(params, **arguments(locals()))

From the signature and that table it gets the defaults of its param groups, validation of
every group (at construction and in ``add_param_group``, which leaves no half-added group
behind), a "did you mean" error for a misspelled keyword and a warning for a misspelled group
key. A constructor argument without an entry in the table is an option of how, not what, is
computed (``batching``): not a group key.

The rest of the contract, as PyTorch's own generic optimizer tests check it: the step
evaluates the closure with gradients enabled, skips parameters without a gradient, refuses
sparse gradients, re-creates state that was reset, and reads a tensor learning rate once
per group; copies (``deepcopy``, pickle) keep the constructor's options; state dicts of older
versions load (``added_keys``, numeric ``step``).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor

from muoneq.optim.checks import Check, check_group_keys, closest, scalar, tensor_steps

#: ``Hyper.default`` of a constructor argument: its default is its signature's.
FROM_SIGNATURE: Any = inspect.Parameter.empty


@dataclasses.dataclass(frozen=True)
class Hyper:
    """How one hyper-parameter is checked, and where it applies.

    ``when``: a group key that must be true for the check to run (``"use_muon"``: only in
    matrix groups). A constructor argument's default is the one of its keyword-only parameter
    (filled in here by the class); a group key that is no constructor argument
    (``argument=False``: ``use_muon``, the layout keys) declares its ``default`` here.
    """

    check: Check
    when: str | None = None
    argument: bool = True
    default: Any = FROM_SIGNATURE


def arguments(frame: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments a constructor received, from its ``locals()`` taken before anything
    else: ``self``, ``params`` and the ``__class__`` cell dropped, a ``**`` dict merged in.
    A subclass's explicit constructor hands them on: ``super().__init__(params,
    **arguments(locals()))``."""
    values = {k: v for k, v in frame.items() if k not in ("self", "params", "__class__")}
    extra = values.pop("hyperparameters", {})
    return {**values, **extra}


class OptimizerBase(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` with declared hyper-parameters (module docstring)."""

    #: name → :class:`Hyper`; a subclass's table extends (and may override) its bases'.
    hyperparameters: ClassVar[dict[str, Hyper]] = {}
    #: Group keys introduced after state dicts were first written (name → the value that
    #: reproduces the older behaviour): a state dict without them loads with these values. A
    #: subclass's table extends its bases'.
    added_keys: ClassVar[dict[str, Any]] = {}
    #: the keywords the constructor accepts (its signature's), in order
    _keywords: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        written = [k for k, h in cls.__dict__.get("hyperparameters", {}).items()
                   if h.argument and h.default is not FROM_SIGNATURE]
        if written:
            raise TypeError(f"{cls.__name__}: the default of {written[0]!r} is written in its "
                            "__init__'s signature, not in the hyperparameters table")
        table, added = {}, {}
        for klass in reversed(cls.__mro__):
            table.update(klass.__dict__.get("hyperparameters", {}))
            added.update(klass.__dict__.get("added_keys", {}))
        cls.hyperparameters, cls.added_keys = _with_signature_defaults(cls, table), added
        cls._keywords = _accepted_keywords(cls)

    def __new__(cls, *args, **kwargs):
        # A misspelled keyword: Python's own TypeError names it; this one says what was meant
        # and lists every accepted name (the constructor runs only after this check).
        accepted = cls._keywords
        unknown = [k for k in kwargs if k not in accepted]
        if unknown:
            hint = closest(unknown[0], accepted)
            raise TypeError(
                f"{cls.__name__}() got an unexpected keyword argument {unknown[0]!r}"
                + (f"; did you mean {hint!r}?" if hint else "")
                + f" (allowed: {', '.join(accepted)})"
            )
        return super().__new__(cls)

    def __init__(self, params: Iterable[Tensor] | Iterable[dict], **hyperparameters):
        unknown = [k for k in hyperparameters
                   if k not in self.hyperparameters or not self.hyperparameters[k].argument]
        if unknown:  # a subclass handed on an option as a hyper-parameter
            raise TypeError(f"{type(self).__name__}: {unknown[0]!r} is no hyper-parameter "
                            "(declare its check in the class's hyperparameters table)")
        defaults = {k: hyperparameters.get(k, h.default) for k, h in self.hyperparameters.items()}
        # hyper-parameters first, as torch.optim checks them before it reads params
        self._check_values(dict(defaults))
        self._reset_caches()
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ param groups
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._validate(group)
        except ValueError:
            self.param_groups.pop()
            raise
        self._init_group(group)

    def _init_group(self, group: dict) -> None:
        """Create the state of a new group's parameters (:meth:`_init_state` for each)."""
        for p in group["params"]:
            self._init_state(p, group)

    def _validate(self, group: dict) -> None:
        """Check every hyper-parameter of ``group`` (canonical values are written back)."""
        check_group_keys(group, self.hyperparameters, type(self).__name__)
        self._check_values(group)

    def _check_values(self, group: dict) -> None:
        """Run each hyper-parameter's check on ``group`` and write the canonical value back."""
        for key, hyper in self.hyperparameters.items():
            if hyper.when is None or group[hyper.when]:
                group[key] = hyper.check(key, group[key], group)

    def _init_state(self, p: Tensor, group: dict) -> None:
        """Create ``p``'s state. Called for every parameter at construction (every rank then
        holds the same keys, as distributed checkpoints need) and again by the step for a
        parameter whose state was reset."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the step
    @staticmethod
    def _evaluate(closure: Callable[[], Any] | None):
        """Lightning's contract for ``optimizer.step(closure)``: run it with gradients enabled."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _groups_to_step(self) -> Iterator[tuple[dict, list[Tensor]]]:
        """``(group, params with a gradient)`` for each group with any: state that was reset
        is created again, and a tensor ``lr`` is read once (the yielded group is then a copy)."""
        for group in self.param_groups:
            prepared = self._group_to_step(group)
            if prepared is not None:
                yield prepared

    def _group_to_step(self, group: dict) -> tuple[dict, list[Tensor]] | None:
        """One group as :meth:`_groups_to_step` yields it, ``None`` when no parameter of it has
        a gradient (a ``capturable`` group keeps a tensor ``lr``: it is read on the device)."""
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return None
        if any(p.grad.is_sparse for p in params):
            raise self._sparse_error()
        for p in params:
            if not self.state[p]:  # reset by the user, or loaded without it
                self._init_state(p, group)
        if isinstance(group["lr"], Tensor) and not group.get("capturable"):
            group = {**group, "lr": scalar(group["lr"])}
        return group, params

    def _sparse_error(self) -> RuntimeError:
        return RuntimeError(f"{type(self).__name__} does not support sparse gradients")

    # ------------------------------------------------------------------ copies, loading
    def _reset_caches(self) -> None:
        """Rebuild per-process scratch (nothing here is state); called at construction and
        after a copy."""

    def _options(self) -> dict:
        """Constructor options that are not hyper-parameters (kept by copies)."""
        return {}

    def __getstate__(self) -> dict:
        # torch.optim pickles defaults, state and groups only: copies must also know the options
        return {**super().__getstate__(), **self._options()}

    def __setstate__(self, state: dict) -> None:
        # Called by unpickling and deepcopy, and by load_state_dict with the loaded groups:
        # keys added after a state dict was written get the values of the older behaviour
        # (as torch.optim does for its own new keys); older numeric steps become tensors.
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.added_keys.items():
                group.setdefault(key, value)
        tensor_steps(self.state)
        if "state" in state and "defaults" in state:  # a whole copy, not load_state_dict
            self._reset_caches()


def _with_signature_defaults(cls: type, table: dict[str, Hyper]) -> dict[str, Hyper]:
    """``table`` with each constructor argument's default read from ``cls``'s signature, where
    it is written (a subclass whose constructor only hands ``**kwargs`` on keeps its base's);
    a new argument the signature lacks (or has without a default) is an error of the class."""
    parameters = inspect.signature(cls).parameters
    derived = {}
    for name, hyper in table.items():
        parameter = parameters.get(name)
        if not hyper.argument or (parameter is None and hyper.default is not FROM_SIGNATURE):
            derived[name] = hyper
            continue
        if (parameter is None or parameter.kind is not parameter.KEYWORD_ONLY
                or parameter.default is parameter.empty):
            raise TypeError(f"{cls.__name__}: hyper-parameter {name!r} must be a keyword-only "
                            "argument of its __init__, with its default")
        derived[name] = dataclasses.replace(hyper, default=parameter.default)
    return derived


def _accepted_keywords(cls: type) -> tuple[str, ...]:
    """The keywords ``cls(params, ...)`` accepts: its signature's, and where it takes
    ``**kwargs`` on to its base, the base's and the hyper-parameters."""
    parameters = inspect.signature(cls).parameters.values()
    names = [p.name for p in parameters if p.name != "params"
             and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        for klass in cls.__mro__[1:]:
            names += [k for k in klass.__dict__.get("_keywords", ()) if k not in names]
        names += [k for k, h in cls.hyperparameters.items() if h.argument and k not in names]
    return tuple(names)
