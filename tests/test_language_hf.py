"""The language task on any Hugging Face causal LM: ``task.model.arch=hf``, built from a local
config.json or a transformers model type at one of the suite's sizes, trained end to end, and
sharded by decoder layer under FSDP2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from muoneq.suite.cli import main as cli
from muoneq.suite.runtime import ConfigError, compose, train
from muoneq_tasks.language.models import build_model
from tests.helpers.language import language_shards, tiny_args  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

#: A Qwen2-style config.json as published (its own vocabulary and token ids, bf16), tiny sizes.
QWEN_LIKE = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 48,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 4096,
    "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}


@pytest.fixture
def qwen_config(tmp_path):
    folder = tmp_path / "qwen-like"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN_LIKE))
    return folder


def test_a_config_json_builds_with_the_shards_vocabulary_in_float32(qwen_config):
    model = build_model("hf", None, vocab_size=320, max_seq_len=64, config=str(qwen_config),
                        model_type=None, overrides={})
    hf = model.hf
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    assert hf.config.hidden_size == 48 and hf.config.vocab_size == 320
    assert hf.config.eos_token_id is None and hf.config.pad_token_id is None
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert hf.lm_head.weight is hf.model.embed_tokens.weight  # tied, as the config says
    assert [type(b).__name__ for b in model.blocks] == ["Qwen2DecoderLayer"] * 2
    assert model(torch.randint(0, 320, (2, 16))).shape == (2, 16, 320)
    assert model.width == 48 and model.n_layer == 2
    n = model.num_params(non_embedding=True)
    assert model.flops_per_token(16) == 6 * n + 12 * 2 * 48 * 16


def test_a_model_type_takes_the_suites_sizes_and_overrides():
    model = build_model("hf", "tiny", vocab_size=256, max_seq_len=32, config=None,
                        model_type="mistral", overrides={"num_key_value_heads": 2})
    cfg = model.hf.config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
            cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 172, 2, 4, 2)
    assert type(model.hf).__name__ == "MistralForCausalLM"


@pytest.mark.parametrize(("extra", "message"), [
    ([], r"^task.model.hf_config / task.model.hf_model_type: arch=hf needs exactly one"),
    (["task.model.hf_model_type=qwen"], r"^task.model.hf_model_type: 'qwen' is not a causal-LM "
                                        r"model type of transformers; did you mean qwen3"),
    (["task.model.hf_model_type=qwen2", "task.model.size=7b"],
     r"^task.model.size: unknown '7b' for arch=hf with hf_model_type; allowed: tiny, 60m"),
    (["task.model.hf_config=/nowhere"], r"^task.model.size: leave it null with "),
    (["task.model.hf_config=/nowhere", "task.model.size=null"],
     r"^task.model.hf_config: no config.json at /nowhere"),
    (["task.model.hf_model_type=qwen2", "task.model.hf_overrides.hiden_size=8"],
     r"^task.model.hf_overrides: 'hiden_size' is not a key of the qwen2 config; did you mean "
     r"'hidden_size'\?"),
    (["task.model.hf_model_type=qwen2", "task.model.hf_overrides.max_position_embeddings=16"],
     r"^task.data.seq_len=128 exceeds the model's max_position_embeddings=16"),
])
def test_hf_config_errors_are_one_line_and_name_the_field(extra, message):
    with pytest.raises(ConfigError, match=message):
        compose(["experiment=llama_tiny_shakespeare", "task.model.arch=hf", *extra])


def test_hf_keys_belong_to_arch_hf():
    with pytest.raises(ConfigError, match=r"^task.model.hf_model_type: only for arch=hf"):
        compose(["experiment=llama_tiny_shakespeare", "task.model.hf_model_type=qwen2"])


@pytest.mark.slow
def test_a_phi3_style_model_trains_with_fused_splits_through_the_cli(shards, tmp_path):
    """A Phi-3-style model (fused Q/K/V and gate/up) at the suite's tiny size, the fused blocks
    split (``optimizer.split_fused=true``); the run folder says where each tensor went."""
    args = tiny_args(shards, tmp_path / "run", "task.model.arch=hf",
                     "task.model.hf_model_type=phi3", "task.model.size=tiny",
                     "optimizer.split_fused=true", "trainer.max_steps=12",
                     "schedule.total_steps=12", "task.val_every_n_steps=6")
    assert cli(["train", *args]) == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["global_step"] == 12
    rows = (tmp_path / "run" / "routing.txt").read_text().splitlines()
    qkv = next(r for r in rows if r.startswith("hf.model.layers.0.self_attn.qkv_proj.weight"))
    assert "3×(64, 64)" in qkv and "fused Q/K/V: split" in qkv
    head = next(r for r in rows if r.startswith("hf.lm_head.weight"))
    assert "adamw" in head and "output head" in head
    assert metrics["best_val_loss"] < 0.8 * torch.log(torch.tensor(257.0)).item()


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_shards_the_decoder_layers_and_ends_where_one_process_does(shards, qwen_config,
                                                                        tmp_path):
    common = [f"task.model.hf_config={qwen_config}", "task.model.arch=hf",
              "task.model.size=null", "trainer.max_steps=4", "schedule.total_steps=4",
              "task.val_every_n_steps=4", "optimizer.ns_dtype=float32",
              "trainer.precision=32-true"]
    args = tiny_args(shards, tmp_path / "fsdp2", *common, "trainer=fsdp2",
                     "trainer.accelerator=cpu", "trainer.devices=2",
                     "trainer.checkpoint_every_n_steps=2")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "muoneq", "train", *args], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    sharded = json.loads((tmp_path / "fsdp2" / "metrics.json").read_text())
    # the distributed checkpoint (a folder of every rank's file) has checksums for every file
    from muoneq.suite.runtime import checkpoints

    folder, damaged = checkpoints.resume_point(tmp_path / "fsdp2")
    listed = checkpoints.checksum_path(folder).read_text().split()[1::2]
    assert folder.is_dir() and not damaged
    assert sorted(listed) == sorted(str(f.relative_to(folder.parent))
                                    for f in folder.rglob("*") if f.is_file())
    one = train(compose(tiny_args(shards, tmp_path / "one", *common, "trainer=cpu")))
    assert sharded["world_size"] == 2
    assert sharded["val/loss"] == pytest.approx(one["val/loss"], rel=1e-4)
