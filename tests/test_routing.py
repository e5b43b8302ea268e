"""param_groups follows the paper's rule; build_optimizer builds each name with its preset."""

import pytest
import torch
from torch import nn

from muoneq import MuonEq, build_optimizer, param_groups
from muoneq.registry import OPTIMIZERS


class TinyLM(nn.Module):
    def __init__(self, tied=False):
        super().__init__()
        self.embed_tokens = nn.Embedding(50, 8)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {"norm": nn.LayerNorm(8), "attn": nn.Linear(8, 24), "mlp": nn.Linear(8, 32)}
            )
            for _ in range(2)
        )
        self.lm_head = nn.Linear(8, 50, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight


class TinyConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3)
        self.body = nn.Conv2d(8, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 10)


def names(model, group):
    ids = {id(p) for p in group["params"]}
    return sorted(n for n, p in model.named_parameters() if id(p) in ids)


def test_language_model_routing():
    model = TinyLM()
    matrix, adamw = param_groups(model, lr=2e-3)
    hidden = [f"blocks.{i}.{k}.weight" for i in range(2) for k in ("attn", "mlp")]
    assert names(model, matrix) == hidden
    assert "embed_tokens.weight" in names(model, adamw)
    assert "lm_head.weight" in names(model, adamw)
    assert all(p.ndim < 2 for n, p in model.named_parameters() if "norm" in n or "bias" in n)
    assert matrix["use_muon"] is True and adamw["use_muon"] is False
    assert matrix["lr"] == adamw["lr"] == 2e-3


def test_a_head_tied_to_the_embedding_goes_to_adamw_once():
    model = TinyLM(tied=True)
    matrix, adamw = param_groups(model, head_names=())
    assert model.lm_head.weight in [p for p in adamw["params"]]
    all_params = matrix["params"] + adamw["params"]
    assert len({id(p) for p in all_params}) == len(all_params) == len(list(model.parameters()))


def test_conv_routing_is_configurable():
    model = TinyConvNet()
    matrix, adamw = param_groups(model)
    assert names(model, matrix) == ["body.weight"]
    assert {"stem.weight", "fc.weight"} <= set(names(model, adamw))
    matrix, _ = param_groups(model, head_names=(), adamw_first_conv=False)
    assert names(model, matrix) == ["body.weight", "fc.weight", "stem.weight"]


def test_per_path_hyper_parameters_and_summary(capsys):
    model = TinyLM()
    matrix, adamw = param_groups(model, lr=1e-3, muon_hparams={"mode": "RC"},
                                 adamw_hparams={"weight_decay": 0.0}, summary=True)
    assert matrix["mode"] == "RC" and "mode" not in adamw
    assert adamw["weight_decay"] == 0.0
    out = capsys.readouterr().out
    assert "4 tensors, 896 parameters" in out  # 2 blocks x (8x24 + 8x32)
    MuonEq(param_groups(model))  # groups are accepted as they are


@pytest.mark.parametrize(
    ("name", "mode", "nesterov"),
    [("muon", "none", False), ("muon_nes", "none", True), ("muoneq", "R", False),
     ("muoneq_nes", "R", True)],
)
def test_muon_family_presets(name, mode, nesterov):
    opt = build_optimizer(name, TinyLM(), lr=1e-3)
    assert isinstance(opt, MuonEq)
    group = opt.param_groups[0]
    assert (group["mode"], group["nesterov"], group["use_muon"]) == (mode, nesterov, True)
    assert opt.param_groups[1]["use_muon"] is False


def test_presets_can_be_overridden_for_ablations():
    opt = build_optimizer("muoneq_nes", TinyLM(), mode="rc")
    assert opt.param_groups[0]["mode"] == "RC"


def test_elementwise_optimizers_take_every_parameter():
    model = TinyLM()
    opt = build_optimizer("adamw", model, lr=1e-3)
    assert isinstance(opt, torch.optim.AdamW)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    assert isinstance(build_optimizer("SGD", model, lr=0.1, momentum=0.9), torch.optim.SGD)


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="muoneq_nes") as err:
        build_optimizer("lion", TinyLM())
    assert "lion" in str(err.value)


def test_every_registered_name_builds_and_steps():
    for name in OPTIMIZERS:
        model = TinyLM()
        opt = build_optimizer(name, model, lr=1e-3)
        tokens = torch.randint(0, 50, (4, 6))
        h = model.embed_tokens(tokens)
        for block in model.blocks:
            h = block["norm"](h)
            h = h + block["attn"](h)[..., :8] + block["mlp"](h)[..., :8]
        loss = nn.functional.cross_entropy(model.lm_head(h).flatten(0, 1), tokens.flatten())
        loss.backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        changed = [not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)]
        assert all(changed), name
