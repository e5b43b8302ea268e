"""The public Muon implementations of ``muoneq bench`` (``muoneq[bench]``): each peer's step is
what its row claims, checked against an SVD of the same momentum; a peer that is not installed
gets one line. Their rows in a run beside ours: ``test_make_bench_quick``
(``tests/test_documented_commands.py``), and the gpu-check's peers part."""

import json
import math

import pytest
import torch
from torch import nn

from muoneq.newton_schulz import QUINTIC
from muoneq.suite.benchmarks import bench_step, peers

#: Each peer's momentum rule as its source writes it, transcribed here: after
#: ``M ← β·M + (1−β)·G``, the matrix its Newton–Schulz takes.
NESTEROV = {
    "heavyball Muon": lambda G, M, beta: G + M,  # heavyball's nesterov_ema
    "muon-optimizer SingleDeviceMuon": lambda G, M, beta: (1 - beta) * G + beta * M,
}
#: the quick GPT-2 set's shapes (compiled once per test process) and a conv filter
SHAPES = [(192, 64), (64, 256), (16, 8, 3, 3)]
LR, BETA, DECAY = 0.02, 0.95, 0.1
#: relative Frobenius distance of a bf16 Newton–Schulz to the exact polynomial (bf16 rounds at
#: 2^-8 = 3.9e-3 per operation; NS5 amplifies it to 1-3e-2 on these shapes)
BF16_NS = 4e-2


def svd_reference(U: torch.Tensor, coefficients) -> torch.Tensor:
    """The Newton–Schulz polynomial of the matrix ``U`` (float64) by its SVD: with
    ``U/‖U‖_F = P·diag(s)·Qᵀ``, each step maps every singular value ``s ← a·s + b·s³ + c·s⁵``
    and keeps ``P`` and ``Q``."""
    P, s, Qh = torch.linalg.svd(U / U.norm(), full_matrices=False)
    for a, b, c in coefficients:
        s = a * s + b * s**3 + c * s**5
    return P @ torch.diag(s) @ Qh


def test_every_peer_is_installed_here():
    """``make install`` installs the ``bench`` extra: the peers' rows run in CI."""
    found, missing = peers.installed()
    assert missing == []
    assert [peer.name for peer, _, _ in found] == list(NESTEROV)


@pytest.mark.slow
@pytest.mark.parametrize("peer", peers.PEERS, ids=lambda p: p.distribution)
def test_a_peer_steps_its_newton_schulz_of_its_momentum(peer):
    """Three steps of the peer as the benchmark builds it: each step's update, read back from
    the weights, is its Newton–Schulz schedule applied (by SVD, float64) to its momentum of the
    gradients so far, scaled by √max(1, m/n), within bf16's rounding; its decay is decoupled.
    A peer that takes matrices only gets the filter as a matrix, as in the benchmark."""
    gen = torch.Generator().manual_seed(0)
    shapes = [s[:1] + (math.prod(s[1:]),) if peer.flat else s for s in SHAPES]
    params = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
    opt = peer.build(peer.optimizer_class(), params,
                     {"lr": LR, "momentum": BETA, "weight_decay": DECAY})
    momenta = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    other = (QUINTIC,) * 5 if peer.coefficients != (QUINTIC,) * 5 \
        else peers.HEAVYBALL_COEFFICIENTS
    for step_grads in grads:
        before = [p.detach().double().clone() for p in params]
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
        for i, (p, g) in enumerate(zip(params, step_grads, strict=True)):
            G = g.double()
            momenta[i] = BETA * momenta[i] + (1 - BETA) * G
            U = NESTEROV[peer.name](G, momenta[i], BETA).reshape(len(G), -1)
            m, n = U.shape
            update = ((before[i] * (1 - LR * DECAY) - p.detach().double()).reshape(m, n)
                      / (LR * math.sqrt(max(1, m / n))))
            expected = svd_reference(U, peer.coefficients)
            error = ((update - expected).norm() / expected.norm()).item()
            assert error < BF16_NS, (peer.name, shapes[i], error)
            # the comparison tells schedules apart: the other schedule is far off
            wrong = svd_reference(U, other)
            assert ((update - wrong).norm() / wrong.norm()).item() > 3 * BF16_NS


def test_a_peer_not_installed_gets_one_line(tmp_path, monkeypatch, capsys):
    absent = peers.Peer("absent Muon", "no-such-distribution-muoneq", "nowhere.Muon",
                        peers.PEERS[0].build, peers.HEAVYBALL_COEFFICIENTS)
    broken = peers.Peer("broken Muon", "pytest", "pytest.NoSuchMuon", peers.PEERS[0].build,
                        peers.HEAVYBALL_COEFFICIENTS)
    monkeypatch.setattr(peers, "PEERS", (absent, broken))
    out = tmp_path / "bench.json"
    assert bench_step.main(["--quick", "--sets", "gpt2_block", "--repeats", "1", "--peers",
                            "only", "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    lines = [line for line in printed if line.startswith("[bench] ") and "Muon:" in line]
    assert lines == [
        "[bench] absent Muon: not installed, no row (pip install 'muoneq[bench]', or pip "
        "install no-such-distribution-muoneq)",
        f"[bench] broken Muon: pytest {pytest.__version__} is installed but pytest.NoSuchMuon "
        "does not import (AttributeError: module 'pytest' has no attribute 'NoSuchMuon'), no row"]
    result = json.loads(out.read_text())
    assert result["missing_peers"] == [line.removeprefix("[bench] ") for line in lines]
    assert list(result["sets"]["gpt2_block"]["contenders"]) == list(bench_step.PEERS_ONLY_KEEP)
    assert f"Not run: {result['missing_peers'][0]}." in printed
