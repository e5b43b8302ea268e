"""Token shards (llm.c / modded-nanogpt format) and tokenizers."""

import struct

import numpy as np
import pytest
import tiktoken

from muoneq_tasks.language.shards import (
    ShardError,
    find_shards,
    open_shard,
    read_header,
    shard_name,
    write_shard,
)
from muoneq_tasks.language.tokenizer import load_tokenizer
from tests.helpers.language import tiny_hf_tokenizer_file, tiny_tiktoken_file


def llmc_shard(path, tokens, magic=20240520, version=1, n=None):
    """An independent writer: struct-packed header as llm.c's Python scripts write it."""
    header = struct.pack("<256i", magic, version, len(tokens) if n is None else n, *([0] * 253))
    path.write_bytes(header + np.asarray(tokens, dtype="<u2").tobytes())
    return path


def test_round_trip_and_reading_foreign_shards(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 65536, size=1000)
    path = write_shard(tmp_path / shard_name("fineweb", "train", 3), tokens)
    assert path.name == "fineweb_train_000003.bin"
    assert path.stat().st_size == 1024 + 2 * 1000
    assert read_header(path) == 1000
    mapped = open_shard(path)
    assert isinstance(mapped, np.memmap)
    np.testing.assert_array_equal(mapped, tokens)
    # our writer agrees byte for byte with an independent one, and we read theirs
    other = llmc_shard(tmp_path / "other.bin", tokens)
    assert other.read_bytes() == path.read_bytes()
    assert not list(tmp_path.glob("*.tmp"))


def test_errors_name_the_file(tmp_path):
    tokens = np.arange(100)
    bad_magic = llmc_shard(tmp_path / "magic.bin", tokens, magic=20240801)
    with pytest.raises(ShardError, match=r"magic\.bin.*wrong magic number 20240801"):
        read_header(bad_magic)
    bad_version = llmc_shard(tmp_path / "version.bin", tokens, version=2)
    with pytest.raises(ShardError, match=r"version\.bin.*unsupported version 2"):
        open_shard(bad_version)
    truncated = write_shard(tmp_path / "cut.bin", tokens)
    truncated.write_bytes(truncated.read_bytes()[:-7])
    with pytest.raises(ShardError, match=r"cut\.bin.*promises 100 tokens.*truncated"):
        open_shard(truncated)
    lying = llmc_shard(tmp_path / "lying.bin", tokens, n=5000)
    with pytest.raises(ShardError, match=r"lying\.bin.*promises 5000"):
        read_header(lying)
    stub = tmp_path / "stub.bin"
    stub.write_bytes(b"\x00" * 100)
    with pytest.raises(ShardError, match=r"stub\.bin.*shorter than the 1024-byte header"):
        read_header(stub)
    with pytest.raises(ValueError, match="uint16"):
        write_shard(tmp_path / "big.bin", [70000])


def test_find_shards(tmp_path):
    for split, i in [("val", 0), ("train", 2), ("train", 1), ("train", 10)]:
        write_shard(tmp_path / shard_name("fw", split, i), [1, 2])
    (tmp_path / "notes_train.txt").write_text("x")
    assert [p.name for p in find_shards(tmp_path, "train")] == [
        "fw_train_000001.bin", "fw_train_000002.bin", "fw_train_000010.bin"]
    assert [p.name for p in find_shards(tmp_path / "fw_val_*.bin", "val")] == ["fw_val_000000.bin"]
    with pytest.raises(FileNotFoundError, match="muoneq data"):
        find_shards(tmp_path / "empty_dir_glob_*.bin", "train")
    with pytest.raises(ValueError, match="allowed: train, val"):
        find_shards(tmp_path, "test")


def test_tokenizers(tmp_path):
    byte = load_tokenizer("byte")
    assert byte.encode("hé") == [104, 195, 169] and byte.eot == 256 and byte.n_vocab == 257
    assert byte.decode(byte.encode("hé") + [256]) == "hé"

    tok = load_tokenizer(str(tiny_tiktoken_file(tmp_path / "tiny.tiktoken")))
    assert tok.eot == 261 and tok.n_vocab == 262
    ids = tok.encode("the theme <|endoftext|>")
    assert tok.decode(ids) == "the theme <|endoftext|>"
    assert 261 not in ids  # a literal special token in a document stays ordinary text
    assert ids[:2] == [258, 260]  # "the", " the" merged

    with pytest.raises(ValueError, match="allowed: 'byte'.*gpt2"):
        load_tokenizer("no-such-encoding")
    with pytest.raises(FileNotFoundError, match="missing.tiktoken"):
        load_tokenizer(str(tmp_path / "missing.tiktoken"))


def test_hugging_face_tokenizer_json(tmp_path, monkeypatch):
    from tokenizers import Tokenizer
    from tokenizers.models import Unigram

    path = tiny_hf_tokenizer_file(tmp_path / "tokenizer.json")
    tok = load_tokenizer(str(path))
    raw = Tokenizer.from_file(str(path))
    assert tok.eot == raw.token_to_id("</s>") == 1
    assert tok.n_vocab == raw.get_vocab_size()
    text = "The red cat sees a ship."
    assert tok.encode(text) == raw.encode(text, add_special_tokens=False).ids
    assert tok.decode(tok.encode(text)) == text
    forged = tok.encode("A ship. </s> The king")
    assert tok.eot not in forged and raw.token_to_id("<unk>") not in forged[:3]

    def offline(repo):
        raise ConnectionError(f"no network for {repo}")

    monkeypatch.setattr(Tokenizer, "from_pretrained", staticmethod(offline))
    with pytest.raises(RuntimeError, match="google-t5/t5-base.*path"):
        load_tokenizer("hf:google-t5/t5-base")
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_tokenizer(str(tmp_path / "missing.json"))
    Tokenizer(Unigram([("a", -1.0), ("b", -2.0)])).save(str(tmp_path / "bare.json"))
    with pytest.raises(ValueError, match="document separators"):
        load_tokenizer(str(tmp_path / "bare.json"))


def test_named_encoding_through_tiktoken(monkeypatch):
    """A named encoding goes through tiktoken.get_encoding (stubbed: no network in tests)."""
    ranks = {bytes([i]): i for i in range(256)}
    fake = tiktoken.Encoding("fake", pat_str=r"\S+|\s+", mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 256})
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: fake)
    tok = load_tokenizer("gpt2")
    assert tok.name == "gpt2" and tok.eot == 256

    def offline(name):
        raise ConnectionError("no network")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(RuntimeError, match="TIKTOKEN_CACHE_DIR"):
        load_tokenizer("gpt2")


def test_token_ids_are_checked_against_the_vocabulary_once(tmp_path, monkeypatch):
    from muoneq_tasks.language import shards

    path = write_shard(tmp_path / shard_name("x", "train", 0), [5, 300, 7])
    assert shards.max_token_id(path) == 300
    monkeypatch.setattr(shards, "open_shard", lambda p: pytest.fail("read again"))
    assert shards.max_token_id(path) == 300  # from the folder's cache
    shards.check_vocabulary([path], 301, "byte")
    with pytest.raises(ShardError) as err:
        shards.check_vocabulary([path], 257, "byte")
    assert str(err.value).startswith(
        f"{path}: holds token id 300, outside the vocabulary of task.data.tokenizer=byte "
        "(257 ids); the shards were written with another tokenizer")
    monkeypatch.undo()
    write_shard(path, [1, 2])  # rewritten: the cache entry no longer applies
    assert shards.max_token_id(path) == 2


def test_training_on_shards_of_another_vocabulary_is_one_line(tmp_path, capsys):
    from muoneq.suite.cli import main
    from tests.helpers.runtime import tiny_language

    args = tiny_language(tmp_path)
    shard = sorted((tmp_path / "shards").glob("*_train_*.bin"))[-1]
    tokens = np.array(open_shard(shard))
    tokens[len(tokens) // 2] = 60000  # a GPT-2 id, far outside the tiny BPE's vocabulary
    write_shard(shard, tokens)
    capsys.readouterr()
    assert main(["train", "experiment=llama_tiny_shakespeare", *args, "trainer.max_steps=1",
                 f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("muoneq: ")]
    assert line.startswith(f"muoneq: {shard}: holds token id 60000, outside the vocabulary of "
                           "task.data.tokenizer=") and "Traceback" not in err
