"""`muoneq data`: every file format, validation carve-out, parallel workers, resume, errors."""

import gzip
import json
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import muoneq_tasks.language.local_files as prepare_files
import muoneq_tasks.language.prepare as prepare
from muoneq.suite.cli import main as cli
from muoneq_tasks.language.shards import find_shards, open_shard
from tests.helpers.language import FORMATS, make_documents, tiny_hf_tokenizer_file, write_corpus


def byte_tokens(docs):
    """Independent expectation: each document as <|endoftext|> (256) then its UTF-8 bytes."""
    return np.concatenate([[256, *d.encode("utf-8")] for d in docs]) if docs else np.zeros(0)


def split_tokens(out, split):
    return np.concatenate([np.asarray(open_shard(p)) for p in find_shards(out, split)])


def run(out, source, *extra, tokens=None, val_tokens=300, shard_tokens=1000, workers=1):
    argv = ["data", "--source", *map(str, source), "--out", str(out), "--tokenizer", "byte",
            "--val-tokens", str(val_tokens), "--shard-tokens", str(shard_tokens),
            "--workers", str(workers), *extra]
    if tokens is not None:
        argv += ["--tokens", str(tokens)]
    return cli(argv)


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_gives_the_documents_in_order(tmp_path, fmt, monkeypatch):
    """Local files never import ``datasets`` (only the Hub sources need it; a GPU machine
    without a registry has none)."""
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets: ModuleNotFoundError
    docs = make_documents(120)
    path = write_corpus(tmp_path, fmt, docs)
    assert run(tmp_path / "out", [path]) == 0
    sizes = np.cumsum([1 + len(d.encode()) for d in docs])
    n_val = int(np.searchsorted(sizes, 300, side="right")) + 1  # whole docs, > 300 tokens
    np.testing.assert_array_equal(split_tokens(tmp_path / "out", "val"), byte_tokens(docs[:n_val]))
    np.testing.assert_array_equal(split_tokens(tmp_path / "out", "train"),
                                  byte_tokens(docs[n_val:]))
    shards = find_shards(tmp_path / "out", "train")
    assert all(len(open_shard(p)) == 1000 for p in shards[:-1])
    assert [p.name for p in shards][0] == "data_train_000000.bin"


def test_parallel_workers_match_one_process(tmp_path):
    path = write_corpus(tmp_path, "jsonl", make_documents(2000))
    run(tmp_path / "one", [path], workers=1, shard_tokens=20000)
    run(tmp_path / "two", [path], workers=2, shard_tokens=20000)
    for split in ("val", "train"):
        a, b = find_shards(tmp_path / "one", split), find_shards(tmp_path / "two", split)
        assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]


def test_a_hugging_face_tokenizer_makes_the_shards(tmp_path):
    from tokenizers import Tokenizer

    tokenizer = tiny_hf_tokenizer_file(tmp_path / "tokenizer.json")
    docs = make_documents(300)
    path = write_corpus(tmp_path, "jsonl", docs)
    argv = ["data", "--source", str(path), "--out", str(tmp_path / "out"), "--tokenizer",
            str(tokenizer), "--val-tokens", "200", "--shard-tokens", "1000", "--workers", "2"]
    assert cli(argv) == 0
    raw = Tokenizer.from_file(str(tokenizer))
    expected = np.concatenate([[1, *raw.encode(d, add_special_tokens=False).ids] for d in docs])
    got = np.concatenate([split_tokens(tmp_path / "out", s) for s in ("val", "train")])
    np.testing.assert_array_equal(got, expected)
    settings = json.loads((tmp_path / "out" / "prepare.json").read_text())["settings"]
    assert settings["vocab_size"] == raw.get_vocab_size()


def test_budget_separate_val_and_sample_by(tmp_path):
    docs, val_docs = make_documents(100, seed=1), make_documents(40, seed=2)
    train, val = write_corpus(tmp_path, "txt", docs), write_corpus(tmp_path, "jsonl", val_docs)
    assert run(tmp_path / "out", [train], "--val-source", str(val), tokens=2500) == 0
    np.testing.assert_array_equal(split_tokens(tmp_path / "out", "train"),
                                  byte_tokens(docs)[:2500])
    got_val = split_tokens(tmp_path / "out", "val")
    assert got_val.size > 300 and got_val[0] == 256
    np.testing.assert_array_equal(got_val, byte_tokens(val_docs)[: got_val.size])
    # a whole text file as one document
    run(tmp_path / "whole", [train], "--text-sample-by", "document", "--val-source", str(val))
    np.testing.assert_array_equal(split_tokens(tmp_path / "whole", "train"),
                                  byte_tokens(["\n\n".join(docs)]))


def test_killed_run_resumes_and_skips_finished_shards(tmp_path, monkeypatch):
    path = write_corpus(tmp_path, "parquet", make_documents(300))
    run(tmp_path / "ref", [path], tokens=9000)
    reference = [p.read_bytes() for p in find_shards(tmp_path / "ref", "train")]
    assert len(reference) == 9

    real_write, calls = prepare.write_shard, []

    def dying_write(p, tokens):
        calls.append(p.name)
        if len(calls) == 5:  # val shard + 3 train shards written, then the process "dies"
            raise KeyboardInterrupt
        return real_write(p, tokens)

    monkeypatch.setattr(prepare, "write_shard", dying_write)
    assert run(tmp_path / "out", [path], tokens=9000) == 130  # one line, as Ctrl-C would
    monkeypatch.setattr(prepare, "write_shard", real_write)
    done = find_shards(tmp_path / "out", "train")
    assert len(done) == 3
    stamps = [p.stat().st_mtime_ns for p in done]

    stale = real_write(tmp_path / "out" / "data_train_000042.bin", [1, 2, 3])  # unrecorded
    calls.clear()
    monkeypatch.setattr(prepare, "write_shard", lambda p, t: (calls.append(p.name),
                                                             real_write(p, t))[1])
    assert run(tmp_path / "out", [path], tokens=9000) == 0
    assert calls == [f"data_train_{i:06d}.bin" for i in range(3, 9)]  # val and 0–2 skipped
    assert not stale.exists()
    assert [p.stat().st_mtime_ns for p in find_shards(tmp_path / "out", "train")[:3]] == stamps
    assert [p.read_bytes() for p in find_shards(tmp_path / "out", "train")] == reference

    # a corrupt shard is redone (from it on); a finished folder is left alone
    bad = find_shards(tmp_path / "out", "train")[6]
    bad.write_bytes(bad.read_bytes()[:-10])
    calls.clear()
    assert run(tmp_path / "out", [path], tokens=9000) == 0
    assert calls == ["data_train_000006.bin", "data_train_000007.bin", "data_train_000008.bin"]
    calls.clear()
    assert run(tmp_path / "out", [path], tokens=9000) == 0
    assert calls == []
    assert [p.read_bytes() for p in find_shards(tmp_path / "out", "train")] == reference


def test_raising_the_budget_extends_the_folder(tmp_path):
    path = write_corpus(tmp_path, "jsonl", make_documents(300))
    run(tmp_path / "ref", [path], tokens=7300)
    run(tmp_path / "out", [path], tokens=2500)
    run(tmp_path / "out", [path], tokens=7300)
    ref, out = (find_shards(tmp_path / d, "train") for d in ("ref", "out"))
    assert [p.read_bytes() for p in out] == [p.read_bytes() for p in ref]
    state = json.loads((tmp_path / "out" / "prepare.json").read_text())
    assert sum(s["tokens"] for s in state["train"]["shards"]) == 7300


def test_errors(tmp_path, capsys):
    path = write_corpus(tmp_path, "jsonl", make_documents(50))
    assert run(tmp_path / "out", [path]) == 0
    assert run(tmp_path / "out", [path], shard_tokens=500) == 2
    err = capsys.readouterr().err.splitlines()[-1]  # after the progress bars
    assert err.startswith("muoneq: ") and "other settings" in err
    bad = tmp_path / "notes.csv"
    bad.write_text("a,b")
    assert run(tmp_path / "x", [bad]) == 2
    assert "cannot tell the format" in capsys.readouterr().err
    assert run(tmp_path / "x", [tmp_path / "missing*.jsonl"]) == 2
    assert "no file matches" in capsys.readouterr().err
    assert run(tmp_path / "y", [path], "--text-field", "body") == 2
    assert "no column 'body'; columns: text, id" in capsys.readouterr().err
    assert run(tmp_path / "z", [path], val_tokens=10**6) == 2
    assert "validation split needs more" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run(tmp_path / "z", [path], tokens="lots")
    assert prepare.parse_count("10.5B") == 10_500_000_000
    assert prepare.parse_count("10_485_760") == 10_485_760
    assert prepare.parse_count("1e6") == 1_000_000


TRICKY_TEXT = ("First paragraph,\r\nline two.\r\n\r\nSecond\n\n\nthird after three newlines\n"
               "\n\n\n\nafter four\rold mac line\n\n  \n\nspaces-only paragraph above\n\n"
               "ünïcödé ✓\n\n")


def tricky_corpora(folder):
    """(files, format, sample_by) in every shape the local reader handles: universal newlines,
    runs of blank lines, a trailing blank line, gzip, a JSON array, blank JSON lines, several
    parquet row groups, two files in order."""
    (folder / "a.txt").write_bytes(TRICKY_TEXT.encode())
    (folder / "b.txt").write_text("last file\nno final newline")
    with gzip.open(folder / "c.txt.gz", "wt", encoding="utf-8") as f:
        f.write(TRICKY_TEXT)
    (folder / "d.jsonl").write_text(
        '{"text": "one", "n": 1}\n\n{"text": "two\\n\\nlines", "n": 2}\n')
    (folder / "e.json").write_text('[{"text": "array one"},\n {"text": "array two"}]\n')
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(50)]}), folder / "f.parquet",
                   row_group_size=7)
    texts = [str(folder / n) for n in ("a.txt", "b.txt")]
    cases = [(texts, "text", by) for by in ("paragraph", "line", "document")]
    cases += [([str(folder / "c.txt.gz")], "text", "paragraph"),
              ([str(folder / "d.jsonl"), str(folder / "e.json")], "json", "paragraph"),
              ([str(folder / "f.parquet")], "parquet", "paragraph")]
    return cases


def test_local_files_give_the_documents_datasets_gives(tmp_path, monkeypatch):
    """The reference: ``datasets``' own builders, streaming the same files."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(prepare_files, "CHUNK_CHARS", 5)  # paragraphs across chunk boundaries
    for files, fmt, sample_by in tricky_corpora(tmp_path):
        source = prepare.Source(fmt, data_files=tuple(files), text_sample_by=sample_by)
        extra = {"sample_by": sample_by, "keep_linebreaks": True} if fmt == "text" else {}
        stream = datasets.load_dataset(fmt, data_files=files, split="train", streaming=True,
                                       **extra)
        expected = [row["text"] for row in stream]
        assert list(source.documents()) == expected, (fmt, sample_by)
        assert list(source.documents(skip=3)) == expected[3:]


def test_hub_presets_stream_through_datasets(tmp_path, monkeypatch):
    """fineweb / c4 go through datasets.load_dataset(..., streaming=True) (stubbed: no network)."""
    import datasets

    calls = []
    corpus = {"train": make_documents(200, seed=3), "validation": make_documents(60, seed=4)}

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append((path, name, kwargs["split"], kwargs["streaming"]))
        docs = corpus[kwargs["split"]]
        return datasets.IterableDataset.from_generator(
            lambda: ({"text": d, "url": "x"} for d in docs))

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert run(tmp_path / "c4", ["c4"], shard_tokens=2000) == 0
    assert calls[0] == ("allenai/c4", "en", "validation", True)
    assert calls[1] == ("allenai/c4", "en", "train", True)
    np.testing.assert_array_equal(split_tokens(tmp_path / "c4", "train"),
                                  byte_tokens(corpus["train"]))
    assert find_shards(tmp_path / "c4", "train")[0].name == "c4_train_000000.bin"

    calls.clear()
    assert run(tmp_path / "fw", ["fineweb"], "--hf-config", "sample-10BT", tokens=3000) == 0
    assert calls == [("HuggingFaceFW/fineweb", "sample-10BT", "train", True)] * 2
    val = split_tokens(tmp_path / "fw", "val")
    train = split_tokens(tmp_path / "fw", "train")
    # no validation split on the Hub: the first documents are carved out, training follows them
    np.testing.assert_array_equal(np.concatenate([val, train]),
                                  byte_tokens(corpus["train"])[: val.size + 3000])
