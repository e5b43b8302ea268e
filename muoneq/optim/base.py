"""The base of every optimizer here: checked hyper-parameters and the ``torch.optim`` contract.

An optimizer writes its constructor as ``torch.optim`` does, each keyword argument with its type
and default, and hands ``defaults = dict(...)`` to the base; its class declares how each
hyper-parameter (a key of ``defaults``, and so of every param group) is checked::

    class MarsAdamW(OptimizerBase):
        hyperparameters = {"lr": Hyper(nonnegative), "betas": Hyper(betas), ...}

        def __init__(self, params, *, lr: float | Tensor = 3e-3, ..., **misspelled: Never):
            refuse_unknown(type(self), misspelled)
            super().__init__(params, dict(lr=lr, betas=betas, ...))

From that table it gets validation of every group (at construction and in ``add_param_group``,
which leaves no half-added group behind) and a warning for a misspelled group key;
:func:`refuse_unknown` gives a misspelled constructor keyword a "did you mean" over every
accepted name (:func:`signature`). The matrix optimizers share most of their keywords
(:class:`muoneq.optim.hybrid.Shared`), declared once.

The rest of the contract, as PyTorch's own generic optimizer tests check it: the step
evaluates the closure with gradients enabled, skips parameters without a gradient, refuses
sparse gradients, re-creates state that was reset, and reads a tensor learning rate once
per group; copies (``deepcopy``, pickle) keep the constructor's options; state dicts of older
versions load (``added_keys``, numeric ``step``) and are matched to the parameters by name
where both sides name them.
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
    """How one hyper-parameter is checked, and where it applies: ``when`` names a group key that
    must be true for the check to run (``"use_muon"``: only in matrix groups)."""

    check: Check
    when: str | None = None


def signature(cls: type) -> inspect.Signature:
    """What ``cls(params, ...)`` accepts, every keyword with its default: the keyword-only
    parameters of the constructors along its bases, and where one takes ``**shared:
    Unpack[Shared]`` the shared keywords with the class's defaults
    (:meth:`muoneq.optim.hybrid.HybridOrthogonalOptimizer.shared_keywords`). Any other class:
    ``inspect.signature``."""
    found = inspect.signature(cls)
    if not (isinstance(cls, type) and issubclass(cls, OptimizerBase)):
        return found
    keywords = {name: inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                        annotation=annotation)
                for name, (annotation, default) in cls.shared_keywords().items()}
    for klass in cls.__mro__:
        if "__init__" in klass.__dict__ and issubclass(klass, OptimizerBase):
            for p in inspect.signature(klass.__init__).parameters.values():
                if p.kind is p.KEYWORD_ONLY:
                    keywords.setdefault(p.name, p)
    params = inspect.Parameter("params", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                               annotation="ParamsT")
    return inspect.Signature([params, *keywords.values()])


def refuse_unknown(cls: type, given: dict[str, Any]) -> None:
    """A ``TypeError`` for a keyword ``cls`` does not accept, with what was most likely meant
    and every accepted name (:func:`signature`); nothing when ``given`` is empty."""
    if not given:
        return
    accepted = list(signature(cls).parameters)[1:]
    unknown = next(iter(given))
    hint = closest(unknown, accepted)
    raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {unknown!r}"
                    + (f"; did you mean {hint!r}?" if hint else "")
                    + f" (allowed: {', '.join(accepted)})")


class OptimizerBase(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` with checked hyper-parameters (module docstring)."""

    #: name → :class:`Hyper`: every key of ``defaults`` (a subclass writes its whole table,
    #: its base's merged in: ``{**Base.hyperparameters, ...}``)
    hyperparameters: ClassVar[dict[str, Hyper]] = {}
    #: Group keys introduced after state dicts were first written (name → the value that
    #: reproduces the older behaviour): a state dict without them loads with these values.
    added_keys: ClassVar[dict[str, Any]] = {}

    @classmethod
    def shared_keywords(cls) -> dict[str, tuple[Any, Any]]:
        """Keywords a constructor takes through ``**shared`` (name → annotation, default)."""
        return {}

    def __init__(self, params: Iterable[Tensor] | Iterable[dict], defaults: dict[str, Any]):
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

    def _check_values(self, group: dict, values: dict | None = None) -> None:
        """Run each hyper-parameter's check on ``group`` and write the canonical value back
        (with ``values``: on those of its keys, read from ``group`` by the caller, and into
        ``values``)."""
        values = group if values is None else values
        for key, hyper in self.hyperparameters.items():
            if key in values and (hyper.when is None or group[hyper.when]):
                values[key] = hyper.check(key, values[key], group)

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

    def load_state_dict(self, state_dict: dict) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``, but where the saved groups and this
        optimizer's both name their parameters (``param_names``, from ``named_parameters()``)
        each state goes to the parameter of its name, whatever the order; names that differ
        are refused (:func:`matched_by_name`)."""
        super().load_state_dict(matched_by_name(state_dict, self.param_groups))

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



def matched_by_name(state_dict: dict, param_groups: list[dict]) -> dict:
    """``state_dict`` with each saved group's parameters reordered to match the names of the
    corresponding group of ``param_groups`` (torch matches by position only, so same-shape
    parameters listed in another order would swap their state); unchanged where either side
    does not name its parameters. A group whose names differ is a ``ValueError`` naming one."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups) or not all(
            "param_names" in saved and "param_names" in group
            for saved, group in zip(saved_groups, param_groups, strict=True)):
        return state_dict  # torch's own checks (group counts, names on one side) apply
    matched = []
    for index, (saved, group) in enumerate(zip(saved_groups, param_groups, strict=True)):
        ids = dict(zip(saved["param_names"], saved["params"], strict=True))
        names = list(group["param_names"])
        if set(ids) != set(names) or len(ids) != len(saved["params"]):
            missing = sorted(set(names) - set(ids)) or sorted(set(ids) - set(names))
            raise ValueError(
                f"load_state_dict: param group {index} holds parameters the saved state does "
                f"not name alike (first differing name: {(missing or names)[0]!r}); a state "
                "dict loads into an optimizer over the same named parameters"
            )
        matched.append({**saved, "params": [ids[name] for name in names],
                        "param_names": names})
    return {**state_dict, "param_groups": matched}
