"""Split a model's parameters between the matrix (Muon-type) path and the AdamW path.

The paper's rule (Appendix "Pretraining on C4"): "All 2D weight matrices except embeddings
are optimized with the corresponding Muon-type optimizer, while 1D parameters and
embeddings are optimized with AdamW." Following Keller Jordan's advice the output head and
the first convolution also go to AdamW by default; both are configurable, since the paper's
CIFAR-10 recipe puts every ≥2-D tensor (stem and classifier included) on the Muon path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import Tensor, nn

#: Last components of module names treated as the output head.
DEFAULT_HEAD_NAMES = ("lm_head", "head", "classifier", "fc", "output")


def _first_conv(model: nn.Module) -> nn.Module | None:
    for module in model.modules():
        if isinstance(module, nn.modules.conv._ConvNd):
            return module
    return None


def param_groups(
    model: nn.Module,
    *,
    head_names: Iterable[str] = DEFAULT_HEAD_NAMES,
    adamw_first_conv: bool = True,
    adamw_names: Iterable[str] = (),
    summary: bool | Callable[[str], None] = False,
    muon_hparams: dict | None = None,
    adamw_hparams: dict | None = None,
    **hparams,
) -> list[dict]:
    """Return ``[matrix_group, adamw_group]`` for :class:`muoneq.MuonEq` and the baselines.

    A parameter goes to AdamW when it has fewer than 2 dimensions, belongs to an
    ``nn.Embedding`` (a Linear tied to an embedding included), belongs to a module whose
    last name component is in ``head_names``, is the first convolution's weight
    (``adamw_first_conv``), or its full name contains one of ``adamw_names``. Everything
    else (hidden matrices and conv filters) goes to the matrix path.

    ``hparams`` are set on both groups (for example ``lr``, ``weight_decay``);
    ``muon_hparams``/``adamw_hparams`` on one group only. ``summary=True`` prints how many
    tensors and parameters went each way (or pass a callable such as ``logger.info``).
    Empty groups are left out.
    """
    head_names = tuple(head_names)
    adamw_names = tuple(adamw_names)
    to_adamw: set[int] = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) or (name and name.rsplit(".", 1)[-1] in head_names):
            to_adamw.update(id(p) for p in module.parameters(recurse=False))
    if adamw_first_conv and (conv := _first_conv(model)) is not None:
        to_adamw.add(id(conv.weight))

    matrix: list[Tensor] = []
    other: list[Tensor] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        goes_adamw = p.ndim < 2 or id(p) in to_adamw or any(s in name for s in adamw_names)
        (other if goes_adamw else matrix).append(p)

    groups = []
    if matrix:
        groups.append({"params": matrix, "use_muon": True, **hparams, **(muon_hparams or {})})
    if other:
        groups.append({"params": other, "use_muon": False, **hparams, **(adamw_hparams or {})})
    if summary:
        emit = summary if callable(summary) else print
        emit(describe_groups(groups))
    return groups


def describe_groups(groups: list[dict]) -> str:
    """One line per path: tensor and parameter counts."""
    lines = []
    for group in groups:
        path = "matrix (Muon-type)" if group.get("use_muon", True) else "AdamW"
        n_tensors = len(group["params"])
        n_params = sum(p.numel() for p in group["params"])
        lines.append(f"{path:>18}: {n_tensors:4d} tensors, {n_params:,} parameters")
    return "\n".join(lines)
