"""Split a model's parameters between the matrix (Muon-type) path and the AdamW path.

The paper's rule (Appendix "Pretraining on C4"): "All 2D weight matrices except embeddings
are optimized with the corresponding Muon-type optimizer, while 1D parameters and
embeddings are optimized with AdamW." Following Keller Jordan's advice the output head and
the input layer (first convolution, patch embedding) also go to AdamW by default; both are
configurable, since the paper's CIFAR-10 recipe puts every linear map (stem and classifier
included) on the Muon path.

"A matrix" means a linear map, read as ``(out, in·…)`` whatever its storage
(:mod:`muoneq.layout`). Each parameter is decided by the first rule that applies
(:data:`RULES` lists them; :func:`describe_routing` prints the decision for every tensor):

* by **module type**: ``nn.Embedding`` → AdamW; ``nn.Linear``, ``nn.Bilinear``, convolutions,
  ``nn.MultiheadAttention``'s projections, RNN weights → matrix; transposed convolutions and
  ``transformers``' ``Conv1D`` → matrix stored ``(in, out)``; ``transformers`` MoE expert
  banks (``gate_up_proj``, ``down_proj``) → one matrix per expert;
* the **output head**: ``get_output_embeddings()`` of a ``transformers`` model,
  ``get_classifier()`` of a timm model, a linear map named like a head (``lm_head``, ``head``,
  ``fc``, ``classifier``, ``score``…), the last linear map inside a module named like one
  (torchvision's ``classifier[-1]`` and ``heads.head``, timm's ``head.fc``), the last linear
  map of an ``nn.Sequential`` model — tied to an embedding or not;
* the **input layer**: the first linear map when it is a convolution (CNN stems; the
  patch embeddings of ViTs, Swins and ConvNeXts), any linear map under a ``patch_embed*``
  module;
* **parameters that are not linear maps** (registered directly on another module): at most one
  dimension above 1 (class/register/mask tokens ``(1, 1, D)``, LayerScale ``(C, 1, 1)``),
  position embeddings (``pos_embed``, ``position_embeddings``, ``pos_embedding``),
  relative-position bias tables and ``rel_pos_*``, learned tokens and latents, biases → AdamW;
  any other ≥2-D parameter (a router, a custom layer's weight) → matrix, read as
  ``(dim 0, the rest)`` unless ``transposed``/``stacked`` say otherwise.

Fused projections (Q, K and V in one weight; gate and up in one weight) are orthogonalized
whole by default, as the paper's authors ran them; ``split_fused=True`` splits the known fused
layouts (HF GPT-2's ``c_attn``, timm's ``attn.qkv`` and ``kv``, our GPT's ``c_attn``,
``nn.MultiheadAttention``'s ``in_proj_weight``, ``qkv_proj``/``Wqkv`` with the model's head
counts, ``gate_up_proj``, ``w12``, timm's ``GluMlp.fc1``, concatenated MoE ``gate_up_proj``,
LSTM/GRU gates) into blocks equilibrated and orthogonalized separately. Interleaved layouts
(GPT-NeoX's and Falcon's ``query_key_value``, GPT-OSS's experts) are not split.
"""

from __future__ import annotations

import fnmatch
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from torch import Tensor, nn

from muoneq.layout import MatrixLayout

#: Last components of module names treated as the output head.
DEFAULT_HEAD_NAMES = ("lm_head", "head", "classifier", "fc", "output", "score", "heads",
                      "head_dist", "last_linear")
#: Head names that may be containers (``nn.Sequential``, a classifier head module): their last
#: linear map is the head. Others (``output``, ``fc``) count only as linear maps themselves
#: (BERT's ``layer.N.output`` is a block's sub-module, not a head).
_CONTAINER_HEADS = ("head", "heads", "classifier")

#: Every rule, as :func:`describe_routing` names it.
RULES = {
    "frozen": "requires_grad=False: not optimized",
    "adamw_names": "name matches adamw_names",
    "vector": "0-D/1-D tensor",
    "embedding": "embedding (nn.Embedding)",
    "head": "output head",
    "input": "input layer",
    "linear": "linear map",
    "experts": "MoE expert bank, one matrix per expert",
    "not_a_map": "not a linear map",
    "free": "≥2-D parameter of another module, read as (dim 0, the rest)",
}

#: The rules whose parameters ``param_groups(no_decay=True)`` exempts from weight decay.
NO_DECAY = ("vector", "embedding", "not_a_map")

#: Names of parameters registered directly on a module that hold no linear map (lower case,
#: searched in the last name component).
_NOT_A_MAP = (
    (re.compile(r"pos_?embed|position_?embed|absolute_pos"), "position embedding"),
    (re.compile(r"relative_position|bias_table|^rel_pos"), "relative-position bias"),
    (re.compile(r"tokens?$|^latents?$|query_embed"), "learned token"),
    (re.compile(r"layer_?scale|^gamma|^ls\d|scale$"), "per-channel scale"),
    (re.compile(r"bias$"), "bias"),
)

#: ``transformers`` expert banks without the ``@use_experts_implementation`` attributes:
#: class name → stored transposed ``(experts, in, out)``.
_EXPERT_CLASSES = {"Llama4TextExperts": True, "JetMoeParallelExperts": False}
#: Fused Q/K/V weights by the last component of their module's name: split as (heads, kv_heads,
#: kv_heads)·head_dim when the attention module says its head counts, else in equal thirds.
_FUSED_QKV = ("qkv", "c_attn", "qkv_proj", "wqkv")
#: Fused gate+up weights (two equal halves along the outputs).
_FUSED_GATE_UP = ("gate_up_proj", "w12")
#: Fused K/V (two equal halves).
_FUSED_KV = ("kv",)
_INTERLEAVED = ("query_key_value",)


@dataclass
class Route:
    """Where one parameter goes and why."""

    name: str
    param: Tensor
    path: str  # "matrix", "adamw" or "frozen"
    rule: str  # a key of RULES
    detail: str = ""  # what the rule found (module type, head name, ...)
    layout: dict = field(default_factory=dict)  # non-default layout group keys
    also: list[str] = field(default_factory=list)  # other names of a shared (tied) tensor

    @property
    def seen_as(self) -> str:
        if self.path != "matrix":
            return "element-wise" if self.path == "adamw" else "—"
        return MatrixLayout(tuple(self.param.shape), **self.layout).describe()


# ----------------------------------------------------------------------------- module types
def _is_conv1d(module: nn.Module) -> bool:
    """``transformers.pytorch_utils.Conv1D`` (stored ``(in, out)``), without importing it."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers")


def _linear_map(module: nn.Module) -> str | None:
    """The kind of linear map ``module``'s weights are, ``None`` if it is none."""
    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        return "transposed"
    if isinstance(module, nn.modules.conv._ConvNd):
        return "conv"
    if isinstance(module, (nn.Linear, nn.Bilinear, nn.MultiheadAttention, nn.RNNBase)):
        return "linear"
    if _is_conv1d(module):
        return "transposed"
    return None


def _experts(module: nn.Module) -> bool | None:
    """Whether ``module`` is a ``transformers`` expert bank: its ``is_transposed``, else None."""
    if hasattr(module, "is_transposed") and hasattr(module, "has_gate"):
        return bool(module.is_transposed)
    return _EXPERT_CLASSES.get(type(module).__name__)


# ----------------------------------------------------------------------------- heads, inputs
def _head_modules(model: nn.Module, head_names: tuple[str, ...]) -> dict[int, str]:
    """``id(module) → why`` for every module that is (part of) the output head."""
    if not head_names:
        return {}
    heads: dict[int, str] = {}
    for module in model.modules():
        for api in ("get_output_embeddings", "get_classifier"):  # transformers, timm
            getter = getattr(module, api, None)
            if callable(getter):
                try:
                    found = getter()
                except (AttributeError, NotImplementedError, TypeError):
                    found = None
                # timm's distilled models return (head, head_dist)
                for head in found if isinstance(found, (tuple, list)) else (found,):
                    if isinstance(head, nn.Module) and _linear_map(head):
                        heads.setdefault(id(head), f"{api}() of {type(module).__name__}")
    named = dict(model.named_modules())
    for name, module in named.items():
        last = name.rsplit(".", 1)[-1]
        if last not in head_names:
            continue
        if _linear_map(module):
            heads.setdefault(id(module), f"named {last!r}")
        elif last in _CONTAINER_HEADS and not any(part.isdigit() for part in name.split(".")):
            maps = [m for m in module.modules() if _linear_map(m)]
            if maps:
                heads.setdefault(id(maps[-1]), f"last layer of {last!r}")
    if isinstance(model, nn.Sequential):
        maps = [m for m in model.modules() if _linear_map(m)]
        if maps:
            heads.setdefault(id(maps[-1]), "last layer of an nn.Sequential model")
    return heads


def _input_modules(model: nn.Module) -> dict[int, str]:
    """``id(module) → why`` for the input layer: the first linear map if it is a convolution,
    and linear maps under a ``patch_embed*`` module."""
    inputs: dict[int, str] = {}
    first = True
    for name, module in model.named_modules():
        if _linear_map(module) is None:
            continue
        if first and isinstance(module, nn.modules.conv._ConvNd):
            inputs[id(module)] = "first conv"
        first = False
        if any(part.startswith("patch_embed") for part in name.lower().split(".")):
            inputs.setdefault(id(module), "patch embedding")
    return inputs


# ----------------------------------------------------------------------------- fused layouts
def _head_counts(owner: nn.Module) -> tuple[int, int, int] | None:
    """(heads, kv_heads, head_dim) of an attention module, from its attributes or config."""
    config = getattr(owner, "config", None)

    def read(*names):
        for name in names:
            for source in (owner, config):
                value = getattr(source, name, None)
                if isinstance(value, int) and value > 0:
                    return value
        return None

    heads = read("num_heads", "num_attention_heads", "n_heads", "n_head")
    head_dim = read("head_dim")
    if heads is None or head_dim is None:
        return None
    return heads, read("num_key_value_heads", "num_kv_heads", "kv_n_heads") or heads, head_dim


def _fused_splits(name: str, module: nn.Module, parent: nn.Module | None,
                  out: int) -> tuple[tuple[int, ...] | None, str]:
    """The blocks of a known fused weight (``None``: not fused, or not split) and what it is."""
    if isinstance(module, nn.MultiheadAttention):
        return ((out // 3,) * 3, "fused Q/K/V") if name.endswith("in_proj_weight") else (None, "")
    if isinstance(module, nn.RNNBase):
        gates = {"LSTM": 4, "GRU": 3}.get(module.mode, 1)
        if gates > 1 and re.search(r"weight_(ih|hh)_l\d+", name):
            return (out // gates,) * gates, f"fused {module.mode} gates"
        return None, ""
    if _experts(module) is not None:
        if "gate" not in name.rsplit(".", 1)[-1] or not getattr(module, "has_gate", True):
            return None, ""
        if not getattr(module, "is_concatenated", True):
            return None, "fused gate/up, interleaved: not split"
        return (out // 2,) * 2, "fused gate/up"
    module_name = name.rsplit(".", 2)[-2].lower() if name.count(".") else ""
    if module_name in _FUSED_QKV:
        counts = _head_counts(parent) if parent is not None else None
        if counts is None:
            return ((out // 3,) * 3, "fused Q/K/V") if out % 3 == 0 else (None, "")
        heads, kv, dim = counts
        if (heads + 2 * kv) * dim == out:
            return (heads * dim, kv * dim, kv * dim), "fused Q/K/V"
        if 2 * kv * dim == out:
            return (kv * dim,) * 2, "fused K/V"
        return None, "fused, layout unknown: not split"
    if module_name in _FUSED_KV and out % 2 == 0:
        return (out // 2,) * 2, "fused K/V"
    gated = module_name in _FUSED_GATE_UP or (
        module_name == "fc1" and type(parent).__name__ in ("GluMlp", "SwiGLUPacked"))
    if gated and out % 2 == 0:
        return (out // 2,) * 2, "fused gate/up"
    if module_name in _INTERLEAVED:
        return None, "fused, interleaved: not split"
    return None, ""


# ----------------------------------------------------------------------------- the routes
def _matches(patterns: Iterable, name: str, p: Tensor) -> bool:
    return any(pattern is p if isinstance(pattern, Tensor)
               else fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def route(
    model: nn.Module,
    *,
    head_names: Iterable[str] = DEFAULT_HEAD_NAMES,
    adamw_first_conv: bool = True,
    adamw_names: Iterable[str] = (),
    transposed: Iterable[str | Tensor] = (),
    stacked: Iterable[str | Tensor] = (),
    splits: Mapping[str, Iterable[int]] | None = None,
    split_fused: bool = False,
) -> list[Route]:
    """The decision for every parameter of ``model`` (see :func:`param_groups`): each is
    classified by the first rule that applies (:func:`_classify`), then a matrix takes the
    caller's layout overrides and its fused blocks (:func:`_apply_layout`); last, every option
    must have matched a matrix and every layout must fit its tensor (:func:`_check_routes`)."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"param_groups: expected the model (an nn.Module), got {type(model).__name__}: "
            "pass the model itself, param_groups(model) (its layers decide the routing), or "
            "hand your own groups of model.named_parameters() to the optimizer"
        )
    adamw_names = tuple(adamw_names)
    transposed, stacked = list(transposed), list(stacked)
    splits = {k: tuple(v) for k, v in (splits or {}).items()}
    heads = _head_modules(model, tuple(head_names))
    inputs = _input_modules(model) if adamw_first_conv else {}
    owners = _owners(model)
    routes: list[Route] = []
    for name, p in model.named_parameters():
        entries = owners[id(p)]
        r = _classify(name, p, entries, heads, inputs, adamw_names)
        if r.path == "matrix":
            _, _, module, parent = next(e for e in entries if e[0] == name)
            _apply_layout(r, module, parent, transposed, stacked, splits, split_fused)
        routes.append(r)
    _check_routes(routes, transposed, stacked, splits)
    return routes


#: One name under which a module holds a parameter: (full name, name on the module, the
#: module, its parent).
_Owner = tuple[str, str, nn.Module, nn.Module | None]


def _owners(model: nn.Module) -> dict[int, list[_Owner]]:
    """``id(parameter) → every name it is held under`` (a tied tensor has several)."""
    owners: dict[int, list[_Owner]] = {}
    parents: dict[str, nn.Module] = {}
    for module_name, module in model.named_modules():
        parents[module_name] = module
        parent = parents.get(module_name.rsplit(".", 1)[0]) if "." in module_name else (
            model if module_name else None)
        for pname, p in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            owners.setdefault(id(p), []).append((full, pname, module, parent))
    return owners


def _classify(name: str, p: Tensor, entries: list[_Owner], heads: dict[int, str],
              inputs: dict[int, str], adamw_names: tuple[str, ...]) -> Route:
    """The first rule of :data:`RULES` that applies to ``p``, with what it found: a pure
    reading of the model, before any layout option."""
    r = Route(name, p, "adamw", "", also=[full for full, *_ in entries if full != name])
    modules = [module for _, _, module, _ in entries]
    _, pname, module, _ = next(e for e in entries if e[0] == name)
    if not p.requires_grad:
        r.path, r.rule = "frozen", "frozen"
    elif any(s in name for s in adamw_names):
        r.rule = "adamw_names"
    elif p.ndim < 2:
        r.rule = "vector"
    elif any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for m in modules):
        r.rule = "embedding"
        tied = [full for full, _, m, _ in entries if id(m) in heads or _linear_map(m)]
        r.detail = f"tied to {', '.join(tied)}" if tied else ""
    elif any(id(m) in heads for m in modules):
        r.rule, r.detail = "head", next(heads[id(m)] for m in modules if id(m) in heads)
    elif any(id(m) in inputs for m in modules):
        r.rule, r.detail = "input", next(inputs[id(m)] for m in modules if id(m) in inputs)
    else:
        _classify_weight(r, pname, module)
    return r


def _classify_weight(r: Route, pname: str, module: nn.Module) -> None:
    """The rules for a ≥2-D trainable tensor outside embeddings, head and input layer: a
    linear map, an expert bank, a parameter that is no map, or a free matrix."""
    kind = _linear_map(module)
    if kind is not None:
        r.path, r.rule, r.detail = "matrix", "linear", _describe_module(module)
        if kind == "transposed":
            r.layout["transposed"] = True
            r.detail += ", stored (in, out)"
    elif (bank := _experts(module)) is not None and not pname.endswith("bias"):
        r.path, r.rule, r.detail = "matrix", "experts", type(module).__name__
        r.layout["batch_dims"] = 1
        if bank:
            r.layout["transposed"] = True
            r.detail += ", stored (experts, in, out)"
    elif (what := next((w for rx, w in _NOT_A_MAP if rx.search(pname.lower())), None)):
        r.rule, r.detail = "not_a_map", what
    elif sum(size > 1 for size in r.param.shape) <= 1:
        r.rule, r.detail = "not_a_map", "at most one dimension above 1"
    else:
        r.path, r.rule, r.detail = "matrix", "free", type(module).__name__


def _apply_layout(r: Route, module: nn.Module, parent: nn.Module | None,
                  transposed: list, stacked: list, splits: dict[str, tuple[int, ...]],
                  split_fused: bool) -> None:
    """A matrix's ``transposed=``/``stacked=`` overrides, then its blocks: the caller's
    ``splits=`` first, else a known fused layout (split only with ``split_fused``)."""
    if _matches(transposed, r.name, r.param):
        r.layout["transposed"] = True
        r.detail += ", transposed= override"
    if _matches(stacked, r.name, r.param):
        r.layout["batch_dims"] = 1
        r.detail += ", stacked= override"
    out = MatrixLayout(tuple(r.param.shape), **r.layout).matrix[0]
    explicit = [v for k, v in splits.items() if fnmatch.fnmatchcase(r.name, k)]
    blocks, what = _fused_splits(r.name, module, parent, out)
    if explicit:
        r.layout["splits"] = explicit[0]
        r.detail += f", splits={list(explicit[0])}"
    elif what and blocks and split_fused:
        r.layout["splits"] = blocks
        r.detail += f", {what}: split"
    elif what:
        r.detail += f", {what}" + ("" if blocks is None else " (whole; split_fused=True "
                                                             "splits it)")


def _check_routes(routes: list[Route], transposed: list, stacked: list,
                  splits: dict[str, tuple[int, ...]]) -> None:
    """Every ``transposed``/``stacked``/``splits`` pattern matched a matrix-path parameter,
    and every matrix's layout fits its tensor."""
    for option, patterns in (("transposed", transposed), ("stacked", stacked),
                             ("splits", list(splits))):
        for pattern in patterns:
            if not any(r.path == "matrix" and _matches([pattern], r.name, r.param)
                       for r in routes):
                shown = pattern if isinstance(pattern, str) else f"a tensor of shape "\
                    f"{tuple(pattern.shape)}"
                raise ValueError(f"{option}: {shown!r} matches no parameter on the matrix path")
    for r in routes:
        if r.path == "matrix":
            MatrixLayout(tuple(r.param.shape), **r.layout).check()


def _describe_module(module: nn.Module) -> str:
    name = type(module).__name__
    return "transformers Conv1D" if _is_conv1d(module) else name


# ----------------------------------------------------------------------------- groups
def _layout_tag(layout: dict) -> str:
    parts = [k for k in ("transposed",) if layout.get(k)]
    if layout.get("batch_dims"):
        parts.append("experts")
    if layout.get("splits"):
        parts.append("split")
    return "_".join(parts)


def param_groups(
    model: nn.Module,
    *,
    head_names: Iterable[str] = DEFAULT_HEAD_NAMES,
    adamw_first_conv: bool = True,
    adamw_names: Iterable[str] = (),
    transposed: Iterable[str | Tensor] = (),
    stacked: Iterable[str | Tensor] = (),
    splits: Mapping[str, Iterable[int]] | None = None,
    split_fused: bool = False,
    no_decay: bool = False,
    summary: bool | Callable[[str], None] = False,
    muon_hparams: dict | None = None,
    adamw_hparams: dict | None = None,
    **hparams,
) -> list[dict]:
    """The matrix groups, then the AdamW group, of ``model`` for :class:`muoneq.MuonEq` and
    the baselines (rules in the module docstring; :func:`describe_routing` shows every decision).

    Args:
        head_names: last name components of the output head (``()``: no head on AdamW).
        adamw_first_conv: put the input layer (first conv, patch embedding) on AdamW.
        adamw_names: substrings of parameter names sent to AdamW.
        transposed: names (``fnmatch`` patterns such as ``"blocks.*.proj.weight"``) or
            tensors of matrix-path parameters stored ``(in, out, …)``, for custom layers.
        stacked: names or tensors whose first dimension indexes separate matrices (expert
            banks ``(experts, out, in)``).
        splits: ``{pattern: row counts}``: blocks of fused weights along their outputs (in the
            ``(out, in)`` view), each equilibrated and orthogonalized on its own.
        split_fused: split the known fused layouts (Q/K/V, gate/up; module docstring).
        no_decay: exempt 0-D/1-D tensors (biases, norm weights), embeddings and the other
            parameters that are not linear maps (position embeddings, learned tokens) from
            weight decay: they form a last AdamW group with ``weight_decay=0`` (what nanoGPT,
            HF Trainer and timm do). Off by default: the paper decays every parameter.
        summary: print the per-tensor table and the totals (or pass a callable such as
            ``logger.info``).
        muon_hparams, adamw_hparams: set on the matrix groups / the AdamW group only.
        hparams: set on every group (for example ``lr``, ``weight_decay``).

    Parameters stored the plain way form the first matrix group; each other stored layout
    (:mod:`muoneq.layout`: transposed, expert banks, splits) a group of its own with the keys
    ``transposed``, ``batch_dims`` and ``splits``. A ``name`` among the matrix hparams names
    the first matrix group; the others get it suffixed with their layout (``muon_transposed``).
    With ``no_decay`` the exempt parameters form a last group (``weight_decay=0``, named
    ``<adamw name>_no_decay`` when the AdamW hparams name their group). Empty groups are left
    out. A ``UserWarning`` names each route that looks wrong and the option that changes it
    (:func:`doubtful_routes`: a matrix with a dimension of 1, a model ending in a linear map
    that no head rule found).
    """
    routes = route(model, head_names=head_names, adamw_first_conv=adamw_first_conv,
                   adamw_names=adamw_names, transposed=transposed, stacked=stacked,
                   splits=splits, split_fused=split_fused)
    for text in doubtful_routes(routes, tuple(head_names)):
        warnings.warn(text, UserWarning, stacklevel=2)
    muon = {**hparams, **(muon_hparams or {})}
    layouts: dict[tuple, list[Tensor]] = {(): []}
    for r in routes:
        if r.path == "matrix":
            layouts.setdefault(tuple(sorted(r.layout.items())), []).append(r.param)
    groups, names = [], set()
    for key, params in layouts.items():
        if not params:
            continue
        layout = dict(key)
        group = {"params": params, "use_muon": True, **muon, **layout}
        if "name" in muon and groups:  # the first matrix group keeps the name
            base = f"{muon['name']}_{_layout_tag(layout) or 'plain'}"
            group["name"], i = base, 1
            while group["name"] in names:
                i += 1
                group["name"] = f"{base}{i}"
        names.add(group.get("name"))
        groups.append(group)
    adamw = {**hparams, **(adamw_hparams or {})}
    exempt = [r.param for r in routes if no_decay and r.path == "adamw" and r.rule in NO_DECAY]
    other = [r.param for r in routes if r.path == "adamw" and r.rule not in
             (NO_DECAY if no_decay else ())]
    if other:
        groups.append({"params": other, "use_muon": False, **adamw})
    if exempt:
        named = {"name": f"{adamw['name']}_no_decay"} if "name" in adamw else {}
        groups.append({"params": exempt, "use_muon": False, **adamw, **named,
                       "weight_decay": 0.0})
    if summary:
        emit = summary if callable(summary) else print
        emit(format_routes(routes) + "\n" + describe_groups(groups))
    return groups


def doubtful_routes(routes: list[Route], head_names: tuple[str, ...]) -> list[str]:
    """What :func:`param_groups` warns about, each with the option that routes it otherwise:

    * a matrix-path tensor seen as a matrix with a dimension of 1 (a learned position table
      ``(1, 32, 64)`` read as ``(1, 2048)``): orthogonalizing it only normalizes it, the
      update of a vector (it is no linear map: AdamW's, by ``adamw_names``);
    * no output head found while ``head_names`` asks for one, and the model ends with a
      linear map (a custom classifier ``net.4``; a backbone ending in a norm does not): that
      map goes to the matrix path, which the paper keeps for hidden layers."""
    out = []
    for r in routes:
        if r.path != "matrix":
            continue
        layout = MatrixLayout(tuple(r.param.shape), **r.layout)
        if any(1 in block for block in layout.blocks):
            out.append(f"param_groups: {r.name} {tuple(r.param.shape)} is on the matrix path as "
                       f"{layout.describe()}, with a dimension of 1: orthogonalizing it only "
                       f"normalizes it; if it is no linear map (a position table, a learned "
                       f"token, a scale), send it to AdamW with adamw_names=[{r.name!r}]")
    # the weight of the module that holds the model's last parameters, in module order
    owner = routes[-1].name.rpartition(".")[0] if routes else None
    last = next((r for r in routes if r.name.rpartition(".")[0] == owner
                 and r.path == "matrix" and r.rule == "linear"), None)
    if head_names and last is not None and not any(r.rule == "head" for r in routes):
        out.append(f"param_groups: no output head found (no module named "
                   f"{', '.join(head_names[:4])}…, no get_output_embeddings() or "
                   f"get_classifier()): the last linear map, {last.name} "
                   f"{tuple(last.param.shape)}, is on the matrix path; if it is the model's "
                   f"head, send it to AdamW with adamw_names=[{last.name!r}] (or name its "
                   "module in head_names); head_names=() keeps every linear map on the matrix "
                   "path without this warning")
    return out


def describe_routing(model: nn.Module, **routing) -> str:
    """The per-tensor table of :func:`param_groups`' decisions for ``model`` (same keywords):
    name, stored shape, the matrices the optimizer sees, path and rule."""
    return format_routes(route(model, **routing))


def format_routes(routes: list[Route]) -> str:
    rows = [("parameter", "stored", "optimizer sees", "path", "rule")]
    for r in routes:
        rule = RULES[r.rule] + (f": {r.detail}" if r.detail else "")
        name = r.name + (f" (= {', '.join(r.also)})" if r.also else "")
        rows.append((name, str(tuple(r.param.shape)), r.seen_as, r.path, rule))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  "
             + row[4] for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(line.rstrip() for line in lines)


def describe_groups(groups: list[dict]) -> str:
    """One line per path: tensor and parameter counts."""
    totals: dict[str, list[int]] = {}
    for group in groups:
        path = "matrix (Muon-type)" if group.get("use_muon", True) else "AdamW"
        entry = totals.setdefault(path, [0, 0])
        entry[0] += len(group["params"])
        entry[1] += sum(p.numel() for p in group["params"])
    return "\n".join(f"{path:>18}: {n:4d} tensors, {size:,} parameters"
                     for path, (n, size) in totals.items())

