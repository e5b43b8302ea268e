"""The public Muon implementations a user would otherwise install, as rows of ``muoneq bench``
(``pip install "muoneq[bench]"`` installs them).

Each peer is built from its package's public class with its own defaults, given the
benchmark's hyper-parameters (lr, momentum, decoupled weight decay; Nesterov where the class
has a switch), and stepped on the same matrices, in the same process, as every other row. What
each one's step computes (read from its source, and checked against an SVD of the same momentum
in ``tests/test_bench_peers.py``), for a gradient ``G`` and momentum ``M``:

* **heavyball** (``heavyball.Muon``): ``M ← β·M + (1−β)·G``, ``U = G + M`` (``nesterov_ema``);
  Newton–Schulz on ``U`` reshaped to a matrix (conv filters flattened), normalized by its
  Frobenius norm, cast to bf16 with stochastic rounding, 5 steps of its own per-step
  coefficients (:data:`HEAVYBALL_COEFFICIENTS`, not Muon's quintic); the result scaled by
  ``√max(1, m/n)``; ``W ← (1−ηλ)·W − η·O``. Its functions are ``torch.compile``'d on first
  use (its default ``heavyball.utils.compile_mode``, per shape: the first step of a new shape
  compiles, which the benchmark's warm-up step absorbs). It sets ``p.grad`` to None after a
  step.
* **muon-optimizer** (the original Muon repository's package, module ``muon``;
  ``muon.SingleDeviceMuon``, since ``muon.Muon`` needs a process group):
  ``M ← β·M + (1−β)·G``, ``U = (1−β)·G + β·M`` (Nesterov), written into ``p.grad``;
  Newton–Schulz in bf16, 5 quintic steps (:data:`muoneq.newton_schulz.QUINTIC`, as
  ``torch.optim.Muon``), one matrix at a time; scaled by ``√max(1, m/n)``;
  ``W ← (1−ηλ)·W − η·O``. Its step fails on a conv filter (it flattens the update but adds it
  to the 4-D weight), so, as ``torch.optim.Muon``, it is given filters as matrices.

Both run Newton–Schulz in bf16 whatever the device (``torch.optim.Muon`` too), and both change
or clear ``p.grad`` in their step: the benchmark gives them a copy of the set's gradients before
every step, outside the timing.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from muoneq.functional import lr_scale
from muoneq.newton_schulz import QUINTIC

#: The per-step ``(a, b, c)`` of heavyball's ``zeropower_via_newtonschulz5`` (heavyball 3.x).
HEAVYBALL_COEFFICIENTS = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)


@dataclass(frozen=True)
class Peer:
    """A public Muon implementation: its row's name, the distribution that ships it, its
    class as ``module.attribute``, how it is built from the benchmark's hyper-parameters, the
    Newton–Schulz schedule it runs (the accuracy reference), the scale its update applies
    to the orthogonalized direction of an m×n matrix, and whether it needs 2-D parameters."""

    name: str
    distribution: str
    target: str
    build: Callable[[type, list[Tensor], dict], torch.optim.Optimizer]
    coefficients: tuple[tuple[float, float, float], ...]
    #: steps matrices only: conv filters are given to it as ``(out, in·kh·kw)`` matrices
    flat: bool = False
    #: the lr multiplier of an m×n update (both peers: ``√max(1, m/n)``, Keller Jordan's)
    lr_adjust: str = "spectral"

    def scale(self, shape: tuple[int, int]) -> float:
        return lr_scale(shape, self.lr_adjust)

    def version(self) -> str | None:
        """The installed version of its distribution, or None when it is not installed."""
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return None

    def optimizer_class(self) -> type:
        module, attribute = self.target.rsplit(".", 1)
        return getattr(importlib.import_module(module), attribute)


PEERS = (
    Peer("heavyball Muon", "heavyball", "heavyball.Muon",
         lambda cls, params, hp: cls(params, lr=hp["lr"], betas=(hp["momentum"], 0.99),
                                     weight_decay=hp["weight_decay"], nesterov=True),
         HEAVYBALL_COEFFICIENTS),
    Peer("muon-optimizer SingleDeviceMuon", "muon-optimizer", "muon.SingleDeviceMuon",
         lambda cls, params, hp: cls(params, lr=hp["lr"], momentum=hp["momentum"],
                                     weight_decay=hp["weight_decay"]),
         (QUINTIC,) * 5, flat=True),
)


def installed() -> tuple[list[tuple[Peer, str, type]], list[str]]:
    """``(found, missing)``: the peers of :data:`PEERS` installed here, each with its version
    and its optimizer class, and one line for each that is not (or whose class does not
    import), saying why."""
    found, missing = [], []
    for peer in PEERS:
        version = peer.version()
        if version is None:
            missing.append(f"{peer.name}: not installed, no row (pip install "
                           f"'muoneq[bench]', or pip install {peer.distribution})")
            continue
        try:
            found.append((peer, version, peer.optimizer_class()))
        except (ImportError, AttributeError) as err:
            missing.append(f"{peer.name}: {peer.distribution} {version} is installed but "
                           f"{peer.target} does not import ({type(err).__name__}: {err}), no row")
    return found, missing
