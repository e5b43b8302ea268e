"""MuonEq on the models users bring: Hugging Face Transformers, timm and torchvision.

Every model is built from a tiny config (no hub access, no weights). For each, the routing is
asserted tensor by tensor — path and the matrices the optimizer sees — and one training step
must move every trainable tensor. ``transformers.Trainer`` takes the optimizer both ways its
documentation gives: ``optimizers=(optimizer, scheduler)`` and a ``create_optimizer`` override.
"""

from __future__ import annotations

import pytest
import timm
import torch
import torchvision
import transformers
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from muoneq import MuonEq, param_groups
from muoneq.routing import route

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                    max_position_embeddings=64, pad_token_id=None, bos_token_id=None,
                    eos_token_id=None)


def causal_lm(model_type: str, **sizes) -> nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **sizes))


def seen(model, **routing) -> dict[str, tuple[str, str]]:
    """``name → (path, what the optimizer sees)`` for every ≥2-D tensor; 0-D/1-D tensors
    must all be on AdamW."""
    table = {}
    for r in route(model, **routing):
        if r.param.ndim < 2:
            assert r.path == "adamw", r.name
        else:
            table[r.name] = (r.path, r.seen_as)
    return table


def one_step_moves_everything(model, loss_fn, **routing) -> MuonEq:
    """One MuonEq step: the loss is finite and every tensor with a gradient changes (one
    Newton–Schulz step in float32: this checks what moves, and bf16 matmuls are slow on CPUs)."""
    opt = MuonEq(param_groups(model, lr=0.02, **routing), mode="R", ns_dtype="float32",
                 ns_steps=1)
    loss = loss_fn(model)
    assert torch.isfinite(loss)
    loss.backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    for name, p in model.named_parameters():
        if p.grad is not None and p.grad.any():  # zero-initialized layers block some
            assert not torch.equal(before[name], p), name
    return opt


def lm_loss(model):
    tokens = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    return model(input_ids=tokens, labels=tokens).loss


def image_loss(model, size=32):
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    return nn.functional.cross_entropy(model(x), torch.tensor([1, 3]))


# ----------------------------------------------------------------------------- orientation
class ConvOneDNet(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layer = layer
        self.lm_head = nn.Linear(12, 10)


@pytest.mark.parametrize("mode, lr_adjust", [("R", "rms"), ("RC", "spectral"),
                                             ("C", "spectral_unclamped")])
@pytest.mark.parametrize("batching", ["per_matrix", "stacked"])
def test_hf_conv1d_gets_exactly_the_update_of_the_same_nn_linear(mode, lr_adjust, batching):
    """transformers' Conv1D stores (in, out): routed through param_groups it is updated as the
    (out, in) matrix — DiagPre's rows are output neurons, the shape factor reads (12, 8)."""
    torch.manual_seed(0)
    conv = ConvOneDNet(Conv1D(nf=12, nx=8))
    linear = ConvOneDNet(nn.Linear(8, 12))
    with torch.no_grad():
        linear.layer.weight.copy_(conv.layer.weight.T)
    make = lambda model: MuonEq(param_groups(model, lr=0.05), mode=mode,  # noqa: E731
                                lr_adjust=lr_adjust, batching=batching)
    opts = make(conv), make(linear)
    assert opts[0].param_groups[0]["transposed"] is True
    assert opts[1].param_groups[0]["transposed"] is False
    for step in range(3):
        grad = torch.randn(12, 8, generator=torch.Generator().manual_seed(step))
        conv.layer.weight.grad = grad.T.contiguous()
        linear.layer.weight.grad = grad
        for opt in opts:
            opt.step()
    assert torch.equal(conv.layer.weight, linear.layer.weight.T)
    # what happened before: the stored (in, out) tensor normalized per input feature
    stored = ConvOneDNet(Conv1D(nf=12, nx=8))
    with torch.no_grad():
        stored.layer.weight.copy_(linear.layer.weight.T)
    naive = MuonEq([stored.layer.weight], lr=0.05, mode=mode, lr_adjust=lr_adjust)
    stored.layer.weight.grad = torch.ones(8, 12)
    linear.layer.weight.grad = torch.ones(12, 8)
    naive.step()
    opts[1].step()
    assert not torch.equal(stored.layer.weight, linear.layer.weight.T)


# ----------------------------------------------------------------------------- transformers
def test_hf_gpt2_tied_head_conv1d_and_fused_c_attn():
    model = causal_lm("gpt2", n_embd=32, n_layer=1, n_head=4, vocab_size=96, n_positions=64)
    expected = {
        "transformer.wte.weight": ("adamw", "element-wise"),  # tied to lm_head
        "transformer.wpe.weight": ("adamw", "element-wise"),
        "transformer.h.0.attn.c_attn.weight": ("matrix", "(96, 32)"),
        "transformer.h.0.attn.c_proj.weight": ("matrix", "(32, 32)"),
        "transformer.h.0.mlp.c_fc.weight": ("matrix", "(128, 32)"),
        "transformer.h.0.mlp.c_proj.weight": ("matrix", "(32, 128)"),
    }
    assert seen(model) == expected
    split = seen(model, split_fused=True)
    assert split["transformer.h.0.attn.c_attn.weight"] == ("matrix", "3×(32, 32)")
    assert {k: v for k, v in split.items() if "c_attn" not in k} == {
        k: v for k, v in expected.items() if "c_attn" not in k}
    one_step_moves_everything(model, lm_loss, split_fused=True)


def test_hf_llama_untied_head():
    model = causal_lm("llama", **TINY_DECODER)
    layer = "model.layers.0."
    assert seen(model) == {
        "model.embed_tokens.weight": ("adamw", "element-wise"),
        layer + "self_attn.q_proj.weight": ("matrix", "(32, 32)"),
        layer + "self_attn.k_proj.weight": ("matrix", "(16, 32)"),
        layer + "self_attn.v_proj.weight": ("matrix", "(16, 32)"),
        layer + "self_attn.o_proj.weight": ("matrix", "(32, 32)"),
        layer + "mlp.gate_proj.weight": ("matrix", "(64, 32)"),
        layer + "mlp.up_proj.weight": ("matrix", "(64, 32)"),
        layer + "mlp.down_proj.weight": ("matrix", "(32, 64)"),
        "lm_head.weight": ("adamw", "element-wise"),
    }
    one_step_moves_everything(model, lm_loss)


def test_hf_phi3_fused_qkv_with_grouped_query_heads_and_gate_up():
    model = causal_lm("phi3", **TINY_DECODER)
    layer = "model.layers.0."
    expected = {
        "model.embed_tokens.weight": ("adamw", "element-wise"),
        layer + "self_attn.o_proj.weight": ("matrix", "(32, 32)"),
        layer + "self_attn.qkv_proj.weight": ("matrix", "(32, 32) + (16, 32) + (16, 32)"),
        layer + "mlp.gate_up_proj.weight": ("matrix", "2×(64, 32)"),
        layer + "mlp.down_proj.weight": ("matrix", "(32, 64)"),
        "lm_head.weight": ("adamw", "element-wise"),
    }
    assert seen(model, split_fused=True) == expected
    one_step_moves_everything(model, lm_loss, split_fused=True)


def test_hf_mixtral_expert_banks_are_one_matrix_per_expert():
    model = causal_lm("mixtral", **TINY_DECODER, num_local_experts=3, num_experts_per_tok=2)
    layer = "model.layers.0."
    table = seen(model, split_fused=True)
    assert table[layer + "mlp.experts.gate_up_proj"] == ("matrix", "6×(64, 32)")
    assert table[layer + "mlp.experts.down_proj"] == ("matrix", "3×(32, 64)")
    assert table[layer + "mlp.gate.weight"] == ("matrix", "(3, 32)")  # the router
    assert table["lm_head.weight"] == ("adamw", "element-wise")
    one_step_moves_everything(model, lm_loss, split_fused=True)


def test_hf_sequence_classifier_score_head():
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen2", **TINY_DECODER, num_labels=3)
    model = transformers.AutoModelForSequenceClassification.from_config(config)
    config.pad_token_id = 0
    table = seen(model)
    assert table["score.weight"] == ("adamw", "element-wise")
    assert table["model.layers.0.self_attn.q_proj.weight"] == ("matrix", "(32, 32)")


# ----------------------------------------------------------------------------- timm
def test_timm_resnet():
    torch.manual_seed(0)
    model = timm.create_model("resnet10t", num_classes=4)
    table = seen(model)
    assert table["conv1.0.weight"] == ("adamw", "element-wise")  # the stem's first conv
    assert table["conv1.3.weight"] == ("matrix", "(32, 216)")
    assert table["fc.weight"] == ("adamw", "element-wise")
    assert all(path == "matrix" for name, (path, _) in table.items()
               if name not in ("conv1.0.weight", "fc.weight"))
    one_step_moves_everything(model, image_loss)


def test_timm_vit_tokens_positions_patch_embedding_and_qkv():
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", num_classes=4, img_size=32, patch_size=8,
                              depth=1, reg_tokens=2)
    assert seen(model, split_fused=True) == {
        "cls_token": ("adamw", "element-wise"),
        "reg_token": ("adamw", "element-wise"),
        "pos_embed": ("adamw", "element-wise"),
        "patch_embed.proj.weight": ("adamw", "element-wise"),
        "blocks.0.attn.qkv.weight": ("matrix", "3×(192, 192)"),
        "blocks.0.attn.proj.weight": ("matrix", "(192, 192)"),
        "blocks.0.mlp.fc1.weight": ("matrix", "(768, 192)"),
        "blocks.0.mlp.fc2.weight": ("matrix", "(192, 768)"),
        "head.weight": ("adamw", "element-wise"),
    }
    one_step_moves_everything(model, image_loss, split_fused=True)


def test_timm_convnext_stem_depthwise_and_head_fc():
    torch.manual_seed(0)
    model = timm.create_model("convnext_atto", num_classes=4, depths=(1, 1, 1, 1))
    table = seen(model)
    assert table["stem.0.weight"] == ("adamw", "element-wise")
    assert table["stages.0.blocks.0.conv_dw.weight"] == ("matrix", "(40, 49)")
    assert table["stages.0.blocks.0.mlp.fc1.weight"] == ("matrix", "(160, 40)")
    assert table["stages.1.downsample.1.weight"] == ("matrix", "(80, 160)")
    assert table["head.fc.weight"] == ("adamw", "element-wise")
    one_step_moves_everything(model, image_loss)


# ----------------------------------------------------------------------------- torchvision
def test_torchvision_resnet():
    torch.manual_seed(0)
    model = torchvision.models.ResNet(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1],
                                      num_classes=4)
    table = seen(model)
    assert table.pop("conv1.weight") == ("adamw", "element-wise")
    assert table.pop("fc.weight") == ("adamw", "element-wise")
    assert table["layer1.0.conv1.weight"] == ("matrix", "(64, 576)")
    assert table["layer2.0.downsample.0.weight"] == ("matrix", "(128, 64)")
    assert all(path == "matrix" for path, _ in table.values())
    one_step_moves_everything(model, image_loss)


def test_torchvision_vit_class_token_positions_and_multihead_attention():
    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=1,
                                                 num_heads=2, hidden_dim=16, mlp_dim=32,
                                                 num_classes=4)
    layer = "encoder.layers.encoder_layer_0."
    assert seen(model, split_fused=True) == {
        "class_token": ("adamw", "element-wise"),
        "conv_proj.weight": ("adamw", "element-wise"),
        "encoder.pos_embedding": ("adamw", "element-wise"),
        layer + "self_attention.in_proj_weight": ("matrix", "3×(16, 16)"),
        layer + "self_attention.out_proj.weight": ("matrix", "(16, 16)"),
        layer + "mlp.0.weight": ("matrix", "(32, 16)"),
        layer + "mlp.3.weight": ("matrix", "(16, 32)"),
        "heads.head.weight": ("adamw", "element-wise"),
    }
    nn.init.normal_(model.heads.head.weight, std=0.02)  # zeros: no gradient would reach back
    one_step_moves_everything(model, image_loss, split_fused=True)


def test_torchvision_convnext_layer_scale_and_classifier():
    torch.manual_seed(0)
    model = torchvision.models.convnext_tiny(num_classes=4)
    table = seen(model)
    assert table["features.1.0.layer_scale"] == ("adamw", "element-wise")  # (96, 1, 1)
    assert table["features.0.0.weight"] == ("adamw", "element-wise")
    assert table["classifier.2.weight"] == ("adamw", "element-wise")
    assert table["features.1.0.block.3.weight"] == ("matrix", "(384, 96)")


# ----------------------------------------------------------------------------- Trainer
def _tiny_trainer_inputs(tmp_path):
    model = causal_lm("llama", **TINY_DECODER)
    gen = torch.Generator().manual_seed(2)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 96, (8, 8),
                                                                      generator=gen)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, use_cpu=True,
        report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
        learning_rate=0.02, max_grad_norm=1.0)
    return model, data, args


def _assert_muoneq_trained(trainer, model, before):
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's
    assert isinstance(optimizer, MuonEq)
    assert trainer.state.global_step == 2
    q = model.model.layers[0].self_attn.q_proj.weight
    assert optimizer.state[q]["momentum_buffer"].abs().sum() > 0
    assert not torch.equal(before, q)


@pytest.mark.slow
def test_trainer_takes_muoneq_through_optimizers(tmp_path):
    model, data, args = _tiny_trainer_inputs(tmp_path)
    opt = MuonEq(param_groups(model, lr=0.02), mode="R")
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / 4)
    before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   optimizers=(opt, schedule))
    trainer.train()
    _assert_muoneq_trained(trainer, model, before)
    assert [g["lr"] for g in opt.param_groups] == [0.02 * 0.5] * 2  # the schedule ran twice


@pytest.mark.slow
def test_trainer_takes_muoneq_through_a_create_optimizer_override(tmp_path):
    class MuonEqTrainer(transformers.Trainer):
        def create_optimizer(self, model=None):
            if self.optimizer is None:
                self.optimizer = MuonEq(param_groups(self.model, lr=self.args.learning_rate,
                                                     weight_decay=self.args.weight_decay))
            return self.optimizer

    model, data, args = _tiny_trainer_inputs(tmp_path)
    before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    trainer = MuonEqTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    _assert_muoneq_trained(trainer, model, before)
