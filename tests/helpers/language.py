"""Small corpora written by the tests in every supported file format, and a tiny tokenizer."""

import base64
import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from muoneq.suite.cli import main as cli

FORMATS = ("jsonl", "json.gz", "parquet", "txt")


_WORDS = {
    "det": ["the", "a", "every", "no"],
    "adj": ["red", "quiet", "old", "bright", "small"],
    "noun": ["cat", "ship", "king", "river", "stone", "bird"],
    "verb": ["sees", "follows", "carries", "finds"],
}


def make_documents(n: int, seed: int = 0) -> list[str]:
    """``n`` documents of a few sentences from a small grammar (learnable in a few steps)."""
    rng = np.random.default_rng(seed)

    def pick(kind):
        return _WORDS[kind][rng.integers(len(_WORDS[kind]))]

    docs = []
    for _ in range(n):
        pattern = ("det", "adj", "noun", "verb", "det", "noun")
        sentences = [" ".join(pick(k) for k in pattern) + "." for _ in range(rng.integers(1, 4))]
        docs.append(" ".join(sentences).capitalize())
    return docs


def write_corpus(folder, fmt: str, docs: list[str], name: str = "corpus"):
    """Write ``docs`` as ``fmt`` (one record / paragraph per document); return the path."""
    path = folder / f"{name}.{fmt}"
    if fmt == "jsonl":
        rows = (json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs))
        path.write_text("".join(rows))
    elif fmt == "json.gz":
        with gzip.open(path, "wt") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    elif fmt == "parquet":
        pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}), path)
    elif fmt == "txt":
        path.write_text("\n\n".join(docs))
    else:
        raise ValueError(fmt)
    return path


def tiny_tiktoken_file(path):
    """A byte-level BPE with a few merges, in tiktoken's file format (base64 token, rank)."""
    ranks = {bytes([i]): i for i in range(256)}
    for merge in (b"th", b"he", b"the", b" t", b" the"):
        ranks[merge] = len(ranks)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return path


def tiny_hf_tokenizer_file(path):
    """A small SentencePiece-style Unigram tokenizer with T5's special tokens (``<pad>`` 0,
    ``</s>`` 1, ``<unk>`` 2), trained here and saved in the ``tokenizer.json`` format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=80, special_tokens=["<pad>", "</s>", "<unk>"],
                                      unk_token="<unk>")
    tok.train_from_iterator(make_documents(200, seed=1) + ["< / s >"], trainer)
    tok.save(str(path))
    return path


@pytest.fixture(name="shards")
def language_shards(tmp_path_factory):
    """Byte-token shards of a small corpus; a test module imports it to use ``shards``."""
    folder = tmp_path_factory.mktemp("lang")
    corpus = write_corpus(folder, "jsonl", make_documents(1500))
    assert cli(["data", "--source", str(corpus), "--out", str(folder / "shards"),
                "--tokenizer", "byte", "--val-tokens", "1024", "--workers", "1"]) == 0
    return folder / "shards"


def tiny_args(shards, run_dir, *extra) -> list[str]:
    """Command-line overrides of a tiny LLaMA run on ``shards`` (byte tokens)."""
    return [
        "experiment=llama_tiny_shakespeare", f"task.data.dir={shards}",
        "task.data.tokenizer=byte", "task.data.seq_len=32", "task.data.batch_size=8",
        "task.data.micro_batch_size=4", "task.data.val_tokens=1024", "task.val_every_n_steps=10",
        "trainer.max_steps=30", "schedule.total_steps=30", "schedule.warmup_steps=3",
        "trainer.progress=quiet", f"run.dir={run_dir}", *extra,
    ]
