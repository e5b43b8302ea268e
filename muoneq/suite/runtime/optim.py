"""The ``optimizer`` section of a run config: a typed schema per optimizer name, and the model's
single optimizer built from it (``muoneq.build_optimizer`` + ``muoneq.param_groups``).

The schema of a name is derived from its constructor's signature
(:func:`muoneq.optim.signature`) in :data:`muoneq.registry.OPTIMIZERS`, so every registered
optimizer, including ones added later, is configurable with exactly the keys it accepts:
``optimizer.lr``, ``optimizer.momentum``, ``optimizer.mode``, ``optimizer.ns_steps``, ... An
unknown key or a wrong type is an error that names the key. Orthogonalized (hybrid) optimizers
also take the routing keys:

* ``routing``: ``default`` — :func:`muoneq.param_groups`'s rule (embeddings, output head, first
  conv and 0-D/1-D tensors to AdamW; the paper's LLM recipe and Keller Jordan's advice);
  ``all_matrices`` — every tensor with ≥ 2 dims on the matrix path, only 0-D/1-D tensors on
  AdamW (the paper's CIFAR-10 recipe, stem conv and classifier included);
* ``adamw_names``: extra substrings of parameter names sent to AdamW;
* ``split_fused``: equilibrate and orthogonalize the blocks of fused projections separately
  (Q/K/V in one weight, gate and up in one weight; off by default, as the paper's authors ran
  them; :func:`muoneq.param_groups`);
* ``no_decay``: no weight decay on biases, norms, embeddings and the other tensors that are not
  linear maps (nanoGPT's, HF Trainer's and timm's habit; off by default: the paper decays every
  parameter).
"""

from __future__ import annotations

import dataclasses
import inspect
from enum import Enum
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn

from muoneq.newton_schulz import canonical_backend, resolve_dtype
from muoneq.optim import signature
from muoneq.registry import OPTIMIZERS, build_optimizer
from muoneq.routing import describe_routing, param_groups


class Routing(Enum):
    default = "default"
    all_matrices = "all_matrices"


#: Keyword arguments of :func:`muoneq.param_groups` for each routing preset.
ROUTING_PRESETS: dict[Routing, dict] = {
    Routing.default: {},
    Routing.all_matrices: {"head_names": (), "adamw_first_conv": False},
}

#: Keys of the optimizer section that are not constructor arguments.
RUNTIME_KEYS = ("name", "routing", "adamw_names", "split_fused", "no_decay")


def _schema_field(annotation: Any, default: Any) -> tuple[Any, dataclasses.Field]:
    """Type and default of one constructor argument, from its default value and annotation.

    Annotations may be strings (``from __future__ import annotations``) or unions with
    ``Tensor`` (torch.optim): only the names of the basic types in them are used.
    """
    ann = str(annotation)
    if default is inspect.Parameter.empty:
        return Any, dataclasses.field(default=None)
    if isinstance(default, torch.dtype):
        return str, dataclasses.field(default=str(default).removeprefix("torch."))
    if isinstance(default, bool):
        return bool, dataclasses.field(default=default)
    if isinstance(default, (int, float)):
        typ = float if "float" in ann or isinstance(default, float) else int
        return typ, dataclasses.field(default=typ(default))
    if isinstance(default, str):
        # a name (``ns_dtype: str | torch.dtype``: a config writes a dtype by its name), else
        # whatever the constructor takes (``ns_coefficients``: a name or tuples)
        members = {m.strip() for m in ann.split("|")} - {"torch.dtype"}
        typ = str if members <= {"str", "<class 'str'>"} else Any
        return typ, dataclasses.field(default=default)
    if isinstance(default, (tuple, list)):
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in default)
        typ = list[float] if numeric else list[Any]
        value = [float(v) for v in default] if numeric else list(default)
        return typ, dataclasses.field(default_factory=lambda: list(value))
    if default is None:
        for name, typ in (("bool", bool), ("float", float), ("int", int)):
            if name in ann:
                return typ | None, dataclasses.field(default=None)
        return Any, dataclasses.field(default=None)
    return Any, dataclasses.field(default=default)


def optimizer_schema(name: str) -> type:
    """A dataclass with the keys optimizer ``name`` accepts, defaulting to its preset."""
    if name not in OPTIMIZERS:
        raise ValueError(
            f"optimizer.name: unknown optimizer {name!r}; known: {', '.join(sorted(OPTIMIZERS))}"
        )
    spec = OPTIMIZERS[name]
    fields: list[tuple] = [("name", str, dataclasses.field(default=name))]
    parameters = list(signature(spec.factory).parameters.values())[1:]  # skip params
    for p in parameters:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        typ, fld = _schema_field(p.annotation, spec.preset.get(p.name, p.default))
        fields.append((p.name, typ, fld))
    if spec.hybrid:
        fields.append(("routing", Routing, dataclasses.field(default=Routing.default)))
        fields.append(("adamw_names", list[str], dataclasses.field(default_factory=list)))
        fields.append(("split_fused", bool, dataclasses.field(default=False)))
        fields.append(("no_decay", bool, dataclasses.field(default=False)))
    return dataclasses.make_dataclass(f"OptimizerConfig_{name}", fields)


def _plain(value: Any) -> Any:
    """OmegaConf containers to Python values; lists become tuples (``betas=(0.9, 0.95)``)."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=True, enum_to_str=False)
    if isinstance(value, list):
        return tuple(_plain(v) for v in value)
    return value


def optimizer_hparams(cfg: DictConfig | dict) -> dict:
    """The constructor keyword arguments of an optimizer section (routing keys removed)."""
    items = cfg.items() if isinstance(cfg, dict) else ((k, cfg[k]) for k in cfg)
    return {k: _plain(v) for k, v in items if k not in RUNTIME_KEYS}


def routing_options(cfg: DictConfig | dict) -> dict:
    """Keyword arguments of :func:`muoneq.param_groups` for a hybrid optimizer's section."""
    routing = cfg.get("routing", Routing.default)
    routing = Routing[routing] if isinstance(routing, str) else routing
    return {"adamw_names": tuple(cfg.get("adamw_names", ())),
            "split_fused": bool(cfg.get("split_fused", False)), **ROUTING_PRESETS[routing]}


def routing_table(model: nn.Module, cfg: DictConfig | dict) -> str | None:
    """Where each tensor goes under the section's routing (:func:`muoneq.describe_routing`);
    ``None`` for element-wise optimizers, which take every tensor alike."""
    name = cfg["name"]
    if not (name in OPTIMIZERS and OPTIMIZERS[name].hybrid):
        return None
    return describe_routing(model, **routing_options(cfg))


def build_optimizer_from_config(model: nn.Module, cfg: DictConfig | dict) -> torch.optim.Optimizer:
    """Build the one optimizer of ``model`` described by an optimizer section.

    Hybrid optimizers get :func:`muoneq.param_groups` with the section's routing preset
    (matrix path / AdamW path); element-wise ones (``sgd``, ``adamw``) take every parameter.
    Param groups are named by their path, ``muon`` and ``adamw`` (element-wise: the optimizer's
    name), which names their lr curves in TensorBoard (``lr/muon``, ``lr/adamw``).
    """
    name = cfg["name"]
    hparams = optimizer_hparams(cfg)
    if name in OPTIMIZERS and OPTIMIZERS[name].hybrid:
        groups = param_groups(model, muon_hparams={"name": "muon"},
                              adamw_hparams={"name": "adamw"},
                              no_decay=bool(cfg.get("no_decay", False)), **routing_options(cfg))
        return build_optimizer(name, groups, **hparams)
    return build_optimizer(name, [{"params": list(model.parameters()), "name": name}], **hparams)


def _triton(cfg: DictConfig | dict) -> bool:
    try:
        return canonical_backend(cfg.get("ns_backend", "torch")) == "triton"
    except ValueError:
        return False  # said by the optimizer, which names the allowed values


def check_optimizer_config(cfg: DictConfig) -> None:
    """Build the optimizer once on a tiny model so that a bad value fails before any data
    is loaded. Raises ``ValueError`` with the optimizer's own message (which names the key).
    The tiny model lives on the CPU, so ``ns_backend="triton"``, whose kernels need the run's
    device, is built as ``"torch"`` here and checked by :func:`check_ns_backend`."""
    probe = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    built = {**{key: cfg[key] for key in cfg}, "ns_backend": "torch"} if _triton(cfg) else cfg
    try:
        build_optimizer_from_config(probe, built)
    except (ValueError, TypeError) as err:
        message = str(err)
        key = message.split(":", 1)[0]
        if key in cfg:
            raise ValueError(f"optimizer.{message}") from None
        raise ValueError(f"optimizer ({cfg['name']}): {message}") from None


def check_ns_backend(cfg: DictConfig, device: torch.device) -> None:
    """``ns_backend="triton"`` on the run's ``device``: its kernels need triton, a CUDA GPU (or
    Triton's interpreter) and a Newton–Schulz dtype they take. Raises ``ValueError`` naming the
    key (:func:`muoneq.suite.runtime.trainer.build_trainer`: before the run folder is written,
    instead of the optimizer's error in the middle of ``fit``)."""
    if not _triton(cfg):
        return
    try:
        from muoneq import ns_triton

        ns_triton.check_tensor(torch.empty(0, device=device, dtype=resolve_dtype(
            cfg.get("ns_dtype", "auto"), device)))
    except ImportError:
        raise ValueError("optimizer.ns_backend=triton: triton is not installed (pip install "
                         "triton); or use optimizer.ns_backend=torch") from None
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"optimizer.{err}; or use optimizer.ns_backend=torch") from None
