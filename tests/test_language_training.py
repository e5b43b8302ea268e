"""Tiny GPT and LLaMA learn with MuonEq from text written in every supported file format."""

import pytest
import torch
from torch.utils.data import DataLoader

from muoneq import MuonEq, param_groups
from muoneq.suite.cli import main as cli
from muoneq_tasks.language.base import lm_loss, pad_vocab
from muoneq_tasks.language.data import (
    PackedSequences,
    SequenceSampler,
    TokenStream,
    validation_sequences,
)
from muoneq_tasks.language.models import build_model
from muoneq_tasks.language.shards import find_shards
from muoneq_tasks.language.tokenizer import load_tokenizer
from tests.helpers.language import FORMATS, make_documents, tiny_tiktoken_file, write_corpus

pytestmark = pytest.mark.usefixtures("one_thread")

T = 32


def val_loss(model, val) -> float:
    with torch.no_grad():
        x, y = zip(*(val[i] for i in range(len(val))), strict=True)
        return lm_loss(model(torch.stack(x)), torch.stack(y)).item()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_tiny_model_learns(tmp_path, fmt, arch):
    corpus = write_corpus(tmp_path, fmt, make_documents(400))
    tokenizer_file = str(tiny_tiktoken_file(tmp_path / "tiny.tiktoken"))
    assert cli(["data", "--source", str(corpus), "--out", str(tmp_path / "shards"),
                "--tokenizer", tokenizer_file, "--val-tokens", str(8 * T),
                "--shard-tokens", "4000", "--workers", "1"]) == 0
    train = PackedSequences(TokenStream(find_shards(tmp_path / "shards", "train")), T)
    val = validation_sequences(TokenStream(find_shards(tmp_path / "shards", "val")), T, 8 * T)
    vocab = pad_vocab(load_tokenizer(tokenizer_file).n_vocab)
    model = build_model(arch, "tiny", vocab_size=vocab, max_seq_len=T)
    optimizer = MuonEq(param_groups(model, lr=2e-2, weight_decay=0.0), ns_dtype=torch.float32)
    loader = DataLoader(train, batch_size=8, sampler=SequenceSampler(len(train), 8, seed=0))

    before = val_loss(model, val)
    steps = 0
    while steps < 40:
        for x, y in loader:
            loss = lm_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
            if steps == 40:
                break
    after = val_loss(model, val)
    assert before > 5.0  # ≈ ln(320) at initialization
    assert after < 0.6 * before, (before, after)
