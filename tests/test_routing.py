"""param_groups follows the paper's rule; build_optimizer builds each name with its preset."""

import warnings

import pytest
import torch
from torch import nn

from muoneq import MuonEq, build_optimizer, describe_routing, param_groups
from muoneq.registry import OPTIMIZERS
from muoneq.routing import route


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


# ----------------------------------------------------------------------------- what is a matrix
def routes_by_name(model, **kwargs):
    return {r.name: r for r in route(model, **kwargs)}


class TinyViT(nn.Module):
    """The parameters a ViT holds besides its linear maps (timm and torchvision names)."""

    def __init__(self):
        super().__init__()
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Linear(12, 8)  # a linear patch embedding
        self.cls_token = nn.Parameter(torch.zeros(1, 1, 8))
        self.reg_token = nn.Parameter(torch.zeros(1, 4, 8))
        self.pos_embed = nn.Parameter(torch.zeros(1, 5, 8))
        self.blocks = nn.ModuleList([nn.Module()])
        attn = self.blocks[0].attn = nn.Module()
        attn.qkv = nn.Linear(8, 24)
        attn.relative_position_bias_table = nn.Parameter(torch.zeros(9, 2))
        self.blocks[0].layer_scale = nn.Parameter(torch.ones(8, 1, 1))
        self.blocks[0].output = nn.Sequential(nn.Linear(8, 8))  # BERT-style block output
        self.blocks[0].gate = nn.Parameter(torch.zeros(3, 8))  # a router: a linear map
        self.heads = nn.Sequential()
        self.heads.head = nn.Linear(8, 10)


def test_tensors_that_are_not_linear_maps_go_to_adamw_by_name_and_shape():
    routes = routes_by_name(TinyViT())
    expected = {
        "cls_token": ("adamw", "learned token"),
        "reg_token": ("adamw", "learned token"),
        "pos_embed": ("adamw", "position embedding"),
        "patch_embed.proj.weight": ("adamw", "patch embedding"),
        "blocks.0.attn.qkv.weight": ("matrix", "Linear"),
        "blocks.0.attn.relative_position_bias_table": ("adamw", "relative-position bias"),
        "blocks.0.layer_scale": ("adamw", "per-channel scale"),
        "blocks.0.output.0.weight": ("matrix", "Linear"),
        "blocks.0.gate": ("matrix", "Module"),
        "heads.head.weight": ("adamw", "last layer of 'heads'"),
    }
    for name, (path, detail) in expected.items():
        assert (routes[name].path, routes[name].detail.split(",")[0]) == (path, detail), name


@pytest.mark.parametrize("shape", [(1, 1, 8), (8, 1, 1), (1, 8)])
def test_a_parameter_with_one_dimension_above_one_is_a_vector(shape):
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(shape))
    r = route(model)[0]
    assert (r.path, r.detail) == ("adamw", "at most one dimension above 1")


def test_the_head_of_an_nn_sequential_model_is_its_last_linear_map():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Flatten(),
                          nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    routes = routes_by_name(model)
    assert [n for n, r in routes.items() if r.path == "matrix"] == ["2.weight", "4.weight"]
    assert routes["6.weight"].rule == "head" and routes["0.weight"].rule == "input"


def test_the_head_inside_a_classifier_container_is_its_last_linear_map():
    model = nn.Module()
    model.features = nn.Conv2d(3, 4, 3)
    model.classifier = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    routes = routes_by_name(model)
    assert routes["classifier.0.weight"].path == "matrix"
    assert routes["classifier.2.weight"].rule == "head"
    assert routes_by_name(model, head_names=())["classifier.2.weight"].path == "matrix"


def test_the_first_conv_rule_needs_the_conv_to_be_the_first_linear_map():
    """A depthwise conv inside a block (Mamba-style) is no stem."""
    model = nn.Module()
    model.embed = nn.Embedding(10, 8)
    model.in_proj = nn.Linear(8, 8)
    model.conv1d = nn.Conv1d(8, 8, 3, groups=8)
    routes = routes_by_name(model)
    assert routes["conv1d.weight"].path == "matrix"
    assert routes["embed.weight"].rule == "embedding"


def test_transposed_convolutions_are_read_as_out_by_in():
    model = nn.Module()
    model.stem = nn.Conv2d(3, 4, 1)
    model.up = nn.ConvTranspose2d(4, 6, 3)  # stored (in=4, out=6, 3, 3)
    r = routes_by_name(model)["up.weight"]
    assert (r.path, r.layout, r.seen_as) == ("matrix", {"transposed": True}, "(6, 36)")


def test_fused_projections_are_split_only_on_request():
    model = nn.Module()
    model.attn = nn.MultiheadAttention(8, 2)
    model.rnn = nn.GRU(4, 8)
    model.block = nn.Module()
    model.block.qkv = nn.Linear(8, 24)
    model.block.mlp = nn.Module()
    model.block.mlp.gate_up_proj = nn.Linear(8, 32)
    whole = routes_by_name(model)
    assert all("splits" not in r.layout for r in whole.values())
    assert "split_fused=True splits it" in whole["block.qkv.weight"].detail
    split = routes_by_name(model, split_fused=True)
    assert split["attn.in_proj_weight"].seen_as == "3×(8, 8)"
    assert split["rnn.weight_ih_l0"].seen_as == "3×(8, 4)"
    assert split["rnn.weight_hh_l0"].seen_as == "3×(8, 8)"
    assert split["block.qkv.weight"].seen_as == "3×(8, 8)"
    assert split["block.mlp.gate_up_proj.weight"].seen_as == "2×(16, 8)"
    assert split["attn.out_proj.weight"].seen_as == "(8, 8)"


def test_grouped_query_qkv_is_split_by_the_modules_head_counts():
    model = nn.Module()
    model.self_attn = nn.Module()
    model.self_attn.num_heads, model.self_attn.num_key_value_heads = 4, 1
    model.self_attn.head_dim = 2
    model.self_attn.qkv_proj = nn.Linear(8, 12)  # 4·2 + 2·1·2 outputs
    r = routes_by_name(model, split_fused=True)["self_attn.qkv_proj.weight"]
    assert r.layout["splits"] == (8, 2, 2)


def test_overrides_for_custom_layers():
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.w_in_out = nn.Parameter(torch.randn(4, 6))  # used as x @ w: (in, out)
            self.bank = nn.Parameter(torch.randn(3, 5, 4))  # three (out, in) matrices
            self.fused = nn.Parameter(torch.randn(9, 4))

    model = nn.Module()
    model.layer = Custom()
    routes = routes_by_name(model, transposed=["*.w_in_out"], stacked=[model.layer.bank],
                            splits={"layer.fused": [3, 6]})
    assert routes["layer.w_in_out"].seen_as == "(6, 4)"
    assert routes["layer.bank"].seen_as == "3×(5, 4)"
    assert routes["layer.fused"].seen_as == "(3, 4) + (6, 4)"
    with pytest.raises(ValueError, match=r"^transposed: '\*\.nothing' matches no parameter"):
        route(model, transposed=["*.nothing"])
    with pytest.raises(ValueError, match=r"^splits: \[4, 4\] must add up to the 9 outputs"):
        route(model, splits={"layer.fused": [4, 4]})


@pytest.mark.filterwarnings("ignore:param_groups. no output head found")  # a toy model
def test_layouts_become_named_groups_the_optimizer_checks():
    model = nn.Module()
    model.a = nn.Linear(4, 4)
    model.b = nn.Linear(4, 12)
    model.c = nn.Parameter(torch.randn(4, 6))
    groups = param_groups(model, transposed=["c"], splits={"b.weight": [4, 8]},
                          muon_hparams={"name": "muon"}, adamw_hparams={"name": "adamw"})
    assert [(g["name"], len(g["params"])) for g in groups] == [
        ("muon", 1), ("muon_transposed", 1), ("muon_split", 1), ("adamw", 2)]
    assert groups[1]["transposed"] is True and groups[2]["splits"] == (4, 8)
    opt = MuonEq(groups, lr=0.01)
    assert [g["splits"] for g in opt.param_groups] == [None, None, (4, 8), None]


@pytest.mark.filterwarnings("ignore:param_groups. no output head found")  # a toy model
def test_describe_prints_one_row_per_tensor_with_its_rule(capsys):
    model = TinyLM(tied=True)
    param_groups(model, summary=True, split_fused=True)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["parameter", "stored", "optimizer", "sees", "path", "rule"]
    row = next(line for line in lines if line.startswith("embed_tokens.weight"))
    assert "(= lm_head.weight)" in row and "tied to lm_head.weight" in row
    row = next(line for line in lines if line.startswith("blocks.0.attn.weight"))
    assert row.split()[1:5] == ["(24,", "8)", "(24,", "8)"] and "linear map: Linear" in row
    assert "matrix (Muon-type):    4 tensors, 896 parameters" in out
    assert describe_routing(model, split_fused=True) in out


@pytest.mark.parametrize("given", ["parameters", "named_parameters", "list"])
def test_parameters_instead_of_the_model_get_a_one_line_error(given):
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    params = {"parameters": model.parameters(), "named_parameters": model.named_parameters(),
              "list": list(model.parameters())}[given]
    with pytest.raises(TypeError) as caught:
        param_groups(params)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("param_groups: expected the model (an nn.Module), got ")
    assert "param_groups(model)" in message and "model.named_parameters()" in message


def test_no_decay_exempts_biases_norms_and_embeddings_in_one_call():
    model = TinyLM()
    default = param_groups(model, weight_decay=0.1, adamw_hparams={"name": "adamw"})
    assert [g.get("weight_decay") for g in default] == [0.1, 0.1]  # the paper: decay everything
    matrix, adamw, exempt = param_groups(model, weight_decay=0.1, no_decay=True,
                                         adamw_hparams={"name": "adamw"})
    assert names(model, matrix) == names(model, default[0])  # matrices keep their decay
    assert matrix["weight_decay"] == adamw["weight_decay"] == 0.1
    assert names(model, adamw) == ["lm_head.weight"]  # the head is a linear map: decayed
    assert exempt["weight_decay"] == 0.0 and exempt["use_muon"] is False
    assert exempt["name"] == "adamw_no_decay"
    assert names(model, exempt) == sorted(
        ["embed_tokens.weight", *(f"blocks.{i}.{k}.{w}" for i in range(2)
                                  for k, w in (("norm", "weight"), ("norm", "bias"),
                                               ("attn", "bias"), ("mlp", "bias")))])
    # the groups build and step: with zero gradients only weight decay moves a tensor
    opt = MuonEq(param_groups(model, lr=0.1, weight_decay=0.5, no_decay=True))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    after = dict(model.named_parameters())
    assert torch.equal(after["blocks.0.norm.weight"], before["blocks.0.norm.weight"])
    assert torch.equal(after["embed_tokens.weight"], before["embed_tokens.weight"])
    for decayed in ("lm_head.weight", "blocks.0.attn.weight"):
        assert torch.equal(after[decayed], before[decayed] * (1 - 0.1 * 0.5))


def test_no_decay_exempts_position_embeddings_and_tokens():
    routes = routes_by_name(TinyViT())
    exempt, = [g for g in param_groups(TinyViT(), no_decay=True) if g.get("weight_decay") == 0]
    assert len(exempt["params"]) == sum(
        r.rule in ("vector", "embedding", "not_a_map") for r in routes.values())


def test_a_custom_position_tensor_and_head_are_warned_about_with_their_option():
    """A learned position table ``(1, 32, 64)`` would be orthogonalized as a ``(1, 2048)``
    "matrix", and a custom head ``net.4`` (no name param_groups knows) as a hidden layer: each
    gets a warning naming the option that sends it to AdamW, and that option silences it."""
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = nn.Parameter(torch.zeros(1, 32, 64))
            self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                                     nn.Linear(64, 10))

    with pytest.warns(UserWarning) as caught:
        groups = param_groups(Custom())
    texts = [str(w.message) for w in caught]
    assert len(texts) == 2, texts
    assert texts[0].startswith("param_groups: pos (1, 32, 64) is on the matrix path as "
                               "(1, 2048), with a dimension of 1")
    assert "adamw_names=['pos']" in texts[0]
    assert "the last linear map, net.4.weight (10, 64), is on the matrix path" in texts[1]
    assert "adamw_names=['net.4.weight']" in texts[1]
    assert sum(len(g["params"]) for g in groups if g["use_muon"]) == 4  # pos and net.{0,2,4}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        groups = param_groups(Custom(), adamw_names=["pos", "net.4.weight"])
    assert sum(len(g["params"]) for g in groups if g["use_muon"]) == 2
