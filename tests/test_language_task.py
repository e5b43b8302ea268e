"""The `language` task in the runtime: recipes, a run end to end, accumulation, resume."""

import json
import math

import lightning as L
import pytest
import torch

from muoneq.suite.runtime import compose, train
from tests.helpers.language import (  # noqa: F401 (a fixture)
    language_shards,
    make_documents,
    tiny_args,
    write_corpus,
)
from tests.helpers.sweeps import scalars

pytestmark = pytest.mark.usefixtures("one_thread")

#: The paper's appendix tables (LLaMA2 130M/350M/1B on C4, GPT2-small on FineWeb).
PAPER = {
    "llama130m_c4": dict(arch="llama", size="130m", batch=128, warmup=500, tokens=10.5e9, lrs={
        "adamw": 5e-3, "mars_adamw": 3e-3, "muon": 3e-3, "muon_nes": 3e-3, "muoneq": 3e-3,
        "muoneq_nes": 3e-3}),
    "llama350m_c4": dict(arch="llama", size="350m", batch=256, warmup=500, tokens=21.0e9, lrs={
        "adamw": 1.5e-3, "mars_adamw": 2e-3, "muon": 1.5e-3, "muon_nes": 2e-3, "muoneq": 2e-3,
        "muoneq_nes": 2e-3}),
    "llama1b_c4": dict(arch="llama", size="1b", batch=512, warmup=1000, tokens=21.0e9, lrs={
        name: (5e-4, 8e-4) for name in ("adamw", "mars_adamw", "muon", "muon_nes", "muoneq",
                                         "muoneq_nes")}),
    "gpt2_small_fineweb": dict(arch="gpt2", size="small", batch=128, warmup=1000, tokens=10.5e9,
                               steps=20000, lrs={
        "adamw": 2e-3, "adamuon": 5e-3, "muon_plus": 5e-3, "mousse": 2e-3, "muon_nes": 2e-3,
        "muoneq_nes": 2e-3}),
}


@pytest.mark.parametrize("experiment", PAPER)
def test_recipes_pin_the_paper_tables(experiment):
    paper = PAPER[experiment]
    for optimizer, lr in paper["lrs"].items():
        cfg = compose([f"experiment={experiment}", f"optimizer={optimizer}"])
        task, opt, trainer = cfg.task, cfg.optimizer, cfg.trainer
        assert (task.name, task.model.arch, task.model.size) == ("language", paper["arch"],
                                                                 paper["size"])
        assert task.data.seq_len == 4096 and task.data.batch_size == paper["batch"]
        assert task.data.val_tokens == 10_485_760
        # the paper's tokenizers: GPT-2's BPE on FineWeb, T5's SentencePiece on C4
        assert task.data.tokenizer == ("gpt2" if paper["arch"] == "gpt2"
                                       else "hf:google-t5/t5-base")
        tokens = trainer.max_steps * task.data.batch_size * task.data.seq_len
        assert abs(tokens - paper["tokens"]) / paper["tokens"] < 0.005  # "10.5B" / "21.0B"
        if "steps" in paper:
            assert trainer.max_steps == paper["steps"]
        assert opt.lr in (lr if isinstance(lr, tuple) else (lr,))
        assert opt.weight_decay == 0.1
        if "betas" in opt:
            assert list(opt.betas) == [0.9, 0.95]
        else:
            assert opt.momentum == 0.95 and list(opt.adamw_betas) == [0.9, 0.95]
        if optimizer.startswith("muoneq"):
            assert opt.mode == "R" and opt.eps == 1e-8
        assert cfg.schedule.name.value == "cosine"
        assert cfg.schedule.warmup_steps == paper["warmup"]
        assert trainer.precision == "bf16-mixed" and trainer.gradient_clip_val == 1.0


def tiny(shards, run_dir, *extra):
    return compose(tiny_args(shards, run_dir, *extra))


@pytest.mark.slow
def test_tiny_run_end_to_end(shards, tmp_path):
    metrics = train(tiny(shards, tmp_path / "run", "trainer.max_steps=25",
                         "schedule.total_steps=25", "trainer.log_every_n_steps=1"))
    assert metrics["val/tokens"] == 1024  # exactly the validation budget
    assert metrics["global_step"] == 25
    assert metrics["tokens"] == 25 * 8 * 32 and metrics["tokens_per_step"] == 256
    curves = scalars(tmp_path / "run")
    validations = curves["val/ppl"]
    # every 10 steps and on the final weights, at the global step (no NaN point before)
    assert [step for step, _ in validations] == [10, 20, 25]
    # the running best is in TensorBoard too, and the lr of step k is logged at k
    best_curve = curves["best_val_ppl"]
    assert [s for s, _ in best_curve] == [10, 20, 25]
    assert [v for _, v in best_curve] == pytest.approx(
        [min(v for _, v in validations[:i + 1]) for i in range(3)])
    lrs = curves["lr/muon"]
    assert [s for s, _ in lrs] == list(range(1, 26)) and curves["lr/adamw"]
    assert [s for s, _ in curves["train/loss"]][:2] == [1, 2]
    assert validations[0][1] > validations[1][1] > validations[2][1]  # perplexity falls
    assert metrics["val/ppl"] == pytest.approx(validations[-1][1])
    # the final weights are the best: best.ckpt holds them, not step 20's
    best = torch.load(tmp_path / "run" / "checkpoints" / "best.ckpt", weights_only=False)
    assert best["global_step"] == 25
    assert curves["perf/tokens_per_s"]
    assert metrics["best_val_ppl"] == pytest.approx(math.exp(metrics["best_val_loss"]))
    assert metrics["best_val_loss"] == pytest.approx(metrics["best"])
    assert metrics["best"] < 0.6 * math.log(257)  # from ≈ ln(vocab) at initialization
    assert metrics["tokens_per_s"] > 0 and metrics["flops_per_token"] > 0
    assert (tmp_path / "run" / "metrics.json").is_file()


class Crash(L.Callback):
    class Error(RuntimeError):
        pass

    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            raise Crash.Error(f"simulated crash at step {self.step}")


@pytest.mark.slow
def test_resumed_run_matches_an_uninterrupted_one(shards, tmp_path):
    extra = ["trainer.checkpoint_every_n_steps=4", "optimizer.ns_dtype=float32"]
    straight = train(tiny(shards, tmp_path / "a", *extra))
    with pytest.raises(Crash.Error):
        train(tiny(shards, tmp_path / "b", *extra), callbacks=[Crash(step=6)])  # after ckpt 4
    resumed = train(tiny(shards, tmp_path / "b", "resume=auto", *extra))
    assert resumed["global_step"] == straight["global_step"] == 30
    assert resumed["final"] == straight["final"]  # same batches, same trajectory
    assert resumed["best"] == straight["best"]


def final_weights(cfg, tmp_path):
    from muoneq.suite.runtime.run import find_resume_checkpoint

    train(cfg)
    ckpt = torch.load(find_resume_checkpoint(tmp_path), map_location="cpu", weights_only=False)
    return ckpt["state_dict"], ckpt["loops"]


@pytest.mark.slow
def test_accumulation_averages_micro_batches(shards, tmp_path):
    """8 sequences per step as 2 × 4 accumulated equal 1 × 8 (averaged, not summed)."""
    common = ["trainer.max_steps=3", "schedule.total_steps=3", "optimizer.ns_dtype=float32",
              "trainer.checkpoint_every_n_steps=3"]
    one, _ = final_weights(tiny(shards, tmp_path / "one", "task.data.micro_batch_size=8",
                                *common), tmp_path / "one")
    acc, loops = final_weights(tiny(shards, tmp_path / "acc", "task.data.micro_batch_size=2",
                                    *common), tmp_path / "acc")
    assert loops["fit_loop"]["epoch_loop.batch_progress"]["total"]["processed"] == 12  # 3 × 4
    for name in one:
        torch.testing.assert_close(acc[name], one[name], rtol=1e-4, atol=1e-5)


def test_config_errors(shards, tmp_path):
    from muoneq.suite.runtime import ConfigError

    with pytest.raises(ConfigError, match="multiple of task.data.seq_len"):
        tiny(shards, tmp_path, "task.data.val_tokens=1000")
    with pytest.raises(ConfigError, match="task.model.size.*allowed: tiny, 60m, 130m"):
        tiny(shards, tmp_path, "task.model.size=7b")
    with pytest.raises(ConfigError, match="multiple of task.data.micro_batch_size"):
        tiny(shards, tmp_path, "task.data.micro_batch_size=3")
    with pytest.raises(ConfigError, match="tie_embeddings"):
        tiny(shards, tmp_path, "task.model.tie_embeddings=true")
    with pytest.raises(ConfigError, match="tokenizer=gpt2 does not match .* written with byte; "
                                          "pass task.data.tokenizer=byte"):
        train(tiny(shards, tmp_path / "x", "task.data.tokenizer=gpt2"))
    info = json.loads((shards / "prepare.json").read_text())
    assert info["settings"]["vocab_size"] == 257
