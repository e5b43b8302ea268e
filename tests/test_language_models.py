"""GPT-2 and LLaMA-2 models: shapes, parameter counts, FLOPs, routing, RoPE, causality."""

import math

import pytest
import torch
import torch.nn.functional as F

from muoneq import MuonEq, param_groups
from muoneq_tasks.language.base import pad_vocab
from muoneq_tasks.language.llama import apply_rotary, rotary_cos_sin
from muoneq_tasks.language.models import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


def llama_params(V, d, i, L):
    """Closed form: per layer q,k,v,o (4d²), gate/up/down (3di), two RMSNorm weights (2d);
    embedding and untied head (2Vd) and the final norm (d)."""
    return L * (4 * d * d + 3 * d * i + 2 * d) + 2 * V * d + d


def gpt_params(V, P, d, L, tied=True):
    """Closed form: per layer 12d² weights + 13d biases/LayerNorm; wte, wpe, ln_f (2d)."""
    return V * d + P * d + L * (12 * d * d + 13 * d) + 2 * d + (0 if tied else V * d)


@pytest.mark.parametrize(
    "size, dims, published",
    [("60m", (512, 1376, 8), 58.1e6), ("130m", (768, 2048, 12), 134.1e6),
     ("350m", (1024, 2736, 24), 368.0e6), ("1b", (2048, 5461, 24), 1339.1e6)],
)
def test_llama_sizes_on_meta_device(size, dims, published):
    with torch.device("meta"):
        model = build_model("llama", size, vocab_size=32000, max_seq_len=4096)
    assert all(p.is_meta for p in model.parameters())
    assert model.num_params() == llama_params(32000, *dims)
    # GaLore's / the paper's LLaMA configs (vocabulary 32000) at 0.1M precision
    assert abs(model.num_params() - published) < 0.05e6


def test_gpt2_small_parameter_count():
    assert pad_vocab(50257) == 50304
    with torch.device("meta"):
        tied = build_model("gpt2", "small", vocab_size=50304, max_seq_len=1024)
        untied = build_model("gpt2", "small", vocab_size=50304, max_seq_len=1024,
                             tie_embeddings=False)
    assert tied.num_params() == gpt_params(50304, 1024, 768, 12) == 124_475_904  # nanoGPT 124.47M
    assert untied.num_params() == gpt_params(50304, 1024, 768, 12, tied=False)
    assert tied.lm_head.weight is tied.wte.weight


def test_flops_per_token_follows_palm():
    with torch.device("meta"):
        model = build_model("llama", "130m", vocab_size=32000, max_seq_len=4096)
    non_embedding = llama_params(32000, 768, 2048, 12) - 32000 * 768
    assert model.num_params(non_embedding=True) == non_embedding
    assert model.flops_per_token(4096) == 6 * non_embedding + 12 * 12 * 768 * 4096
    with torch.device("meta"):
        gpt = build_model("gpt2", "small", vocab_size=50304, max_seq_len=1024)
    # tied: the shared matrix does the head's matmul and stays in N; wpe (a lookup) does not
    assert gpt.num_params(non_embedding=True) == gpt_params(50304, 1024, 768, 12) - 1024 * 768


@pytest.mark.parametrize("arch, tie", [("gpt2", True), ("gpt2", False), ("llama", None)])
def test_forward_backward_shapes_and_routing(arch, tie):
    extra = {} if tie is None else {"tie_embeddings": tie}
    model = build_model(arch, "tiny", vocab_size=97, max_seq_len=32, **extra)
    idx = torch.randint(0, 97, (3, 32))
    logits = model(idx)
    assert logits.shape == (3, 32, 97)
    F.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())

    muon, adamw = param_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    muon_names = {names[id(p)] for p in muon["params"]}
    adamw_names = {names[id(p)] for p in adamw["params"]}
    # embeddings, the head and every 1-D tensor to AdamW; every hidden matrix to the Muon path
    assert all(p.ndim == 2 for p in muon["params"])
    assert not any(k in n for n in muon_names for k in ("wte", "wpe", "embed", "lm_head"))
    embed = {"gpt2": {"wte.weight", "wpe.weight"}, "llama": {"embed_tokens.weight"}}[arch]
    assert embed <= adamw_names
    if arch == "llama" or not tie:
        assert "lm_head.weight" in adamw_names
    hidden = {n for n, p in model.named_parameters() if p.ndim == 2 and "blocks" in n}
    assert muon_names == hidden


def test_rotary_matches_complex_reference():
    """RoPE (RoFormer eq. 34) as complex multiplication in float64, pairs (j, j + d/2)."""
    T, d, theta = 7, 8, 10000.0
    x = torch.randn(1, 2, T, d, dtype=torch.float64)
    cos, sin = rotary_cos_sin(T, d, theta, "cpu")
    ours = apply_rotary(x, cos.double(), sin.double())
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * freqs
    z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * torch.polar(torch.ones_like(angles),
                                                                       angles)
    reference = torch.cat((z.real, z.imag), dim=-1)
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_causal(arch):
    model = build_model(arch, "tiny", vocab_size=50, max_seq_len=16)
    idx = torch.randint(0, 50, (1, 16))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 50
    torch.testing.assert_close(model(idx)[:, :10], model(changed)[:, :10])


def test_init_std():
    model = build_model("llama", "tiny", vocab_size=5000, max_seq_len=16)
    assert model.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.05)
    gpt = build_model("gpt2", "tiny", vocab_size=5000, max_seq_len=16)
    proj = gpt.blocks[0].mlp.c_proj.weight
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(2 * 2), rel=0.1)


def test_unknown_size_and_field_errors():
    with pytest.raises(ValueError, match="model.size.*allowed: tiny, 60m, 130m, 350m, 1b"):
        build_model("llama", "7b", vocab_size=10, max_seq_len=8)
    with pytest.raises(ValueError, match="model.arch"):
        build_model("mamba", "tiny", vocab_size=10, max_seq_len=8)
    with pytest.raises(ValueError, match="unknown field"):
        build_model("llama", "tiny", vocab_size=10, max_seq_len=8, tie_embeddings=True)
    with pytest.raises(ValueError, match="max_seq_len"):
        build_model("gpt2", "tiny", vocab_size=10, max_seq_len=8)(torch.zeros(1, 9, dtype=int))


def test_muoneq_steps_a_model():
    model = build_model("llama", "tiny", vocab_size=40, max_seq_len=16)
    opt = MuonEq(param_groups(model, lr=1e-2), ns_dtype=torch.float32)
    idx = torch.randint(0, 40, (2, 16))
    before = [p.detach().clone() for p in model.parameters()]
    F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
