"""The base of every optimizer here: declared hyper-parameters and the ``torch.optim`` contract.

A subclass declares its hyper-parameters once, each with its default and its check::

    class NorMuon(HybridOrthogonalOptimizer):
        hyperparameters = {"beta2": Hyper(0.95, decay), "eps": Hyper(1e-10, nonnegative)}

and gets, from that one table: a keyword-only constructor signature (``help()``, IDEs that read
``__signature__`` and the suite's config schema see it), the defaults of its param groups,
validation of every group (at construction and in ``add_param_group``, which leaves no
half-added group behind), and a "did you mean" warning for a misspelled group key.

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


@dataclasses.dataclass(frozen=True)
class Hyper:
    """One hyper-parameter: default, check, and where it applies.

    ``when``: a group key that must be true for the check to run (``"use_muon"``: only in
    matrix groups). ``argument=False``: a param-group key only, not a constructor argument.
    ``annotation``: the type shown in the signature (the suite's config schema reads it).
    """

    default: Any
    check: Check
    when: str | None = None
    argument: bool = True
    annotation: Any = inspect.Parameter.empty

    def with_default(self, default: Any) -> Hyper:
        return dataclasses.replace(self, default=default)


class OptimizerBase(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` with declared hyper-parameters (module docstring)."""

    #: name → :class:`Hyper`; a subclass's table extends (and may override) its bases'.
    hyperparameters: ClassVar[dict[str, Hyper]] = {}
    #: Group keys introduced after state dicts were first written (name → the value that
    #: reproduces the older behaviour): a state dict without them loads with these values. A
    #: subclass's table extends its bases'.
    added_keys: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        table, added = {}, {}
        for klass in reversed(cls.__mro__):
            table.update(klass.__dict__.get("hyperparameters", {}))
            added.update(klass.__dict__.get("added_keys", {}))
        cls.hyperparameters, cls.added_keys = table, added
        cls.__signature__ = _signature(cls)

    def __init__(self, params: Iterable[Tensor] | Iterable[dict], **hyperparameters):
        unknown = [k for k in hyperparameters
                   if k not in self.hyperparameters or not self.hyperparameters[k].argument]
        if unknown:
            allowed = list(inspect.signature(type(self)).parameters)[1:]  # all but params
            hint = closest(unknown[0], allowed)
            raise TypeError(
                f"{type(self).__name__}() got an unexpected keyword argument {unknown[0]!r}"
                + (f"; did you mean {hint!r}?" if hint else "")
                + f" (allowed: {', '.join(allowed)})"
            )
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


def _signature(cls: type) -> inspect.Signature:
    """``(params, *, <hyper-parameters>, <options of each __init__ in the MRO>)``."""
    parameters = [inspect.Parameter("params", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for name, hyper in cls.hyperparameters.items():
        if hyper.argument:
            parameters.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                                                default=hyper.default,
                                                annotation=hyper.annotation))
    seen = {p.name for p in parameters}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or not issubclass(klass, OptimizerBase):
            continue
        for p in inspect.signature(init).parameters.values():
            if p.kind is p.KEYWORD_ONLY and p.name not in seen:
                parameters.append(p)
                seen.add(p.name)
    return inspect.Signature(parameters)
