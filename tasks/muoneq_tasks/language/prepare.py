"""``muoneq data``: tokenize a corpus once into train/validation token shards.

Hub sources stream through Hugging Face ``datasets``; local files are read by
:mod:`.local_files`, which gives the same documents without importing ``datasets``:

* ``fineweb``: ``HuggingFaceFW/fineweb``, config ``sample-100BT`` (any sample config with
  ``--hf-config``); it has no validation split, so the first documents of the stream, just
  over ``--val-tokens`` tokens, become the validation split (as modded-nanogpt's shard 0);
* ``c4``: ``allenai/c4``, config ``en``, train split for training and its ``validation`` split
  for validation;
* ``hf:<owner/name>`` with ``--hf-config``/``--split``/``--val-split`` for any other Hub dataset;
* local files or glob patterns: JSON lines (``.jsonl``/``.json``, optionally ``.gz``), parquet,
  or plain text (``.txt``: one document per paragraph by default, ``--text-sample-by``);
  ``--val-source`` gives separate validation files.

Documents are tokenized in worker processes (``--workers``) and written, each prefixed with
``<|endoftext|>``, into shards of ``--shard-tokens`` tokens (:mod:`.shards`). ``--tokens`` caps
the training tokens. Progress is recorded in ``<out>/prepare.json`` after every shard, so a
re-run skips the finished shards and continues where the last one ended; raising ``--tokens``
later extends the same folder.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import closing
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from muoneq.suite.errors import UserError
from muoneq.suite.files import atomic_write
from muoneq_tasks.language.local_files import (
    FILE_FORMATS,
    TEXT_SAMPLE_BY,
    file_format,
    missing_column,
    read_documents,
)
from muoneq_tasks.language.shards import ShardError, read_header, shard_name, write_shard
from muoneq_tasks.language.tokenizer import load_tokenizer

#: Hub presets: repository, config, training split, validation split (None: carve from train).
PRESETS = {
    "fineweb": ("HuggingFaceFW/fineweb", "sample-100BT", "train", None),
    "c4": ("allenai/c4", "en", "train", "validation"),
}
PROGRESS_FILE = "prepare.json"
DEFAULT_VAL_TOKENS = 10_485_760


@dataclass(frozen=True)
class Source:
    """A stream of documents: a Hub dataset (``builder`` = repository) or local files
    (``builder`` = their format, :data:`.local_files.FILE_FORMATS`)."""

    builder: str
    config: str | None = None
    split: str = "train"
    data_files: tuple[str, ...] = ()
    text_field: str = "text"
    text_sample_by: str = "paragraph"

    def documents(self, skip: int = 0) -> Iterator[str]:
        """The documents' texts in a fixed order, from the ``skip``-th on."""
        if self.data_files:
            texts = read_documents(self.data_files, self.builder, self.text_field,
                                   self.text_sample_by)
            return islice(texts, skip, None)
        return self._hub_documents(skip)

    def _hub_documents(self, skip: int) -> Iterator[str]:
        import datasets  # imported here: heavy, and only the Hub sources need it

        stream = datasets.load_dataset(self.builder, self.config, streaming=True,
                                       split=self.split)
        if skip:
            stream = stream.skip(skip)
        for row in stream:
            if self.text_field not in row:
                raise missing_column(self.describe(), self.text_field, row)
            yield row[self.text_field]

    def describe(self) -> str:
        if self.data_files:
            return f"{self.builder} files {', '.join(self.data_files)}"
        return f"{self.builder} ({self.config or 'default'}, split {self.split})"


def local_source(patterns: Iterable[str], text_field: str, text_sample_by: str) -> Source:
    """A :class:`Source` over local files (globs expanded, sorted); one format per source."""
    files: list[str] = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern)))
        if not matches:
            raise FileNotFoundError(f"--source: no file matches {pattern!r}")
        files.extend(os.path.abspath(m) for m in matches)
    formats = set()
    for f in files:
        if (fmt := file_format(f)) is None:
            raise ValueError(f"--source: cannot tell the format of {f}; "
                             f"allowed suffixes: {', '.join(FILE_FORMATS)}")
        formats.add(fmt)
    if len(formats) > 1:
        raise ValueError(f"--source: mixes formats {sorted(formats)}; give one format at a time")
    if text_sample_by not in TEXT_SAMPLE_BY:
        raise ValueError(f"--text-sample-by: {text_sample_by!r}; "
                         f"allowed: {', '.join(TEXT_SAMPLE_BY)}")
    return Source(formats.pop(), data_files=tuple(files), text_field=text_field,
                  text_sample_by=text_sample_by)


def resolve_sources(args: argparse.Namespace) -> tuple[Source, Source | None]:
    """(training source, separate validation source or None to carve it from the training one)."""
    if args.val_source:
        val = local_source(args.val_source, args.text_field, args.text_sample_by)
    else:
        val = None
    first = args.source[0]
    if len(args.source) == 1 and (first in PRESETS or first.startswith("hf:")):
        if first in PRESETS:
            repo, config, split, val_split = PRESETS[first]
        else:
            repo, config, split, val_split = first[3:], None, "train", None
        config = args.hf_config or config
        split = args.split or split
        val_split = args.val_split or val_split
        train = Source(repo, config, split, text_field=args.text_field)
        if val is None and val_split:
            val = Source(repo, config, val_split, text_field=args.text_field)
        return train, val
    return local_source(args.source, args.text_field, args.text_sample_by), val


# --- tokenization in worker processes -------------------------------------------------------

_worker_tokenizer = None


def _init_worker(tokenizer_name: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(tokenizer_name)


def _encode(tokenizer, text: str) -> np.ndarray:
    return np.array([tokenizer.eot, *tokenizer.encode(text)], dtype=np.uint16)


def _encode_chunk(texts: list[str]) -> list[np.ndarray]:
    return [_encode(_worker_tokenizer, t) for t in texts]


def tokenize_documents(texts: Iterator[str], tokenizer_name: str, workers: int,
                       chunk_docs: int = 256) -> Iterator[np.ndarray]:
    """EOT-prefixed uint16 token arrays of ``texts``, in order, tokenized by ``workers``
    processes (at most ``2·workers`` chunks in flight, so memory stays bounded)."""
    if workers <= 1:
        tokenizer = load_tokenizer(tokenizer_name)
        for text in texts:
            yield _encode(tokenizer, text)
        return
    pool = ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(tokenizer_name,))
    try:
        pending: deque = deque()
        while chunk := list(islice(texts, chunk_docs)):
            pending.append(pool.submit(_encode_chunk, chunk))
            if len(pending) >= 2 * workers:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# --- shard writing with resumable progress ---------------------------------------------------


class Preparation:
    """Writes the validation, then the training shards of one output folder, resumably.

    ``prepare.json`` holds the settings (a re-run with different ones is refused) and, per
    split, the finished shards with the stream position (document index, tokens of that
    document already written) where each one ends.
    """

    def __init__(self, out: Path, settings: dict, workers: int):
        self.out = out
        self.settings = json.loads(json.dumps(settings))  # as stored: tuples become lists
        self.workers = workers
        self.progress_path = out / PROGRESS_FILE
        self.state = self._load_state()

    def _load_state(self) -> dict:
        if not self.progress_path.exists():
            return {"settings": self.settings, "val": None, "train": {"shards": []}}
        state = json.loads(self.progress_path.read_text())
        fixed = {k: v for k, v in self.settings.items() if k != "tokens"}
        before = {k: state["settings"].get(k) for k in fixed}
        if before != fixed:
            diff = {k: (before[k], fixed[k]) for k in fixed if before[k] != fixed[k]}
            raise ValueError(
                f"{self.out} was prepared with other settings {diff} (before, now); "
                "use another --out or delete the folder"
            )
        state["settings"] = self.settings
        return state

    def _save(self) -> None:
        atomic_write(self.progress_path, json.dumps(self.state, indent=1))

    def _path(self, split: str, index: int) -> Path:
        return self.out / shard_name(self.settings["prefix"], split, index)

    def _intact(self, split: str, index: int, tokens: int) -> bool:
        try:
            return read_header(self._path(split, index)) == tokens
        except ShardError:
            return False

    def _write(self, split: str, index: int, tokens: np.ndarray) -> None:
        write_shard(self._path(split, index), tokens)

    def _remove_from(self, split: str, index: int) -> None:
        """Delete the shards of ``split`` from ``index`` on (left by an interrupted run and not
        recorded), so that the folder holds exactly the recorded shards."""
        for path in self.out.glob(f"{self.settings['prefix']}_{split}_*.bin"):
            if int(path.stem.rsplit("_", 1)[1]) >= index:
                path.unlink()

    def run_val(self, source: Source, separate: bool) -> int:
        """Write the validation split: whole documents from the start of ``source`` until they
        hold more than ``val_tokens`` tokens. Returns the documents used (when carved from the
        training stream, training starts after them)."""
        done = self.state["val"]
        if done and all(self._intact("val", i, n) for i, n in enumerate(done["shards"])):
            return 0 if separate else done["docs"]
        budget, shard_tokens = self.settings["val_tokens"], self.settings["shard_tokens"]
        self._remove_from("val", 0)
        docs, pieces, n = 0, [], 0
        stream = tokenize_documents(source.documents(), self.settings["tokenizer"], self.workers)
        with closing(stream), tqdm(total=budget, unit="tok", unit_scale=True, desc="val",
                                   dynamic_ncols=True) as bar:
            for doc in stream:
                pieces.append(doc)
                docs += 1
                n += doc.size
                bar.update(doc.size)
                if n > budget:
                    break
        if n <= budget:
            raise ValueError(
                f"{source.describe()} holds only {n} tokens; the validation split needs more "
                f"than --val-tokens={budget}"
            )
        tokens = np.concatenate(pieces)
        sizes = []
        for index, start in enumerate(range(0, n, shard_tokens)):
            self._write("val", index, tokens[start:start + shard_tokens])
            sizes.append(min(shard_tokens, n - start))
        self.state["val"] = {"shards": sizes, "docs": docs, "tokens": n}
        self._save()
        return 0 if separate else docs

    def run_train(self, source: Source, first_doc: int) -> None:
        """Write training shards from document ``first_doc`` of ``source`` up to the budget."""
        budget, shard_tokens = self.settings["tokens"], self.settings["shard_tokens"]
        shards = self.state["train"]["shards"]
        keep = 0  # shards are redone from the first missing or corrupt one
        while keep < len(shards) and self._intact("train", keep, shards[keep]["tokens"]):
            keep += 1
        del shards[keep:]
        self._remove_from("train", keep)
        written = self._written(shards)
        if shards and (shards[-1].get("exhausted") or (budget is not None and written >= budget)):
            return  # finished before
        if shards and shards[-1]["tokens"] < shard_tokens:  # the budget was raised: redo the
            written -= shards.pop()["tokens"]  # partial last shard as a full one
        doc_index, offset = first_doc, 0
        if shards:
            doc_index, offset = shards[-1]["end_doc"], shards[-1]["end_offset"]
        buf = np.empty(shard_tokens, dtype=np.uint16)
        fill = 0

        def flush(end_doc: int, end_offset: int, exhausted: bool = False) -> None:
            nonlocal fill
            self._write("train", len(shards), buf[:fill])
            shards.append({"tokens": fill, "end_doc": end_doc, "end_offset": end_offset})
            if exhausted:
                shards[-1]["exhausted"] = True
            self._save()
            fill = 0

        texts = source.documents(skip=doc_index)
        docs = tokenize_documents(texts, self.settings["tokenizer"], self.workers)
        with closing(docs), tqdm(total=budget, initial=written, unit="tok", unit_scale=True,
                                 desc="train", dynamic_ncols=True) as bar:
            for doc in docs:
                pos, offset = offset, 0
                while pos < doc.size:
                    take = min(doc.size - pos, shard_tokens - fill)
                    if budget is not None:
                        take = min(take, budget - written)
                    buf[fill:fill + take] = doc[pos:pos + take]
                    fill, pos, written = fill + take, pos + take, written + take
                    bar.update(take)
                    reached = budget is not None and written >= budget
                    if fill == shard_tokens or reached:
                        flush(*((doc_index, pos) if pos < doc.size else (doc_index + 1, 0)))
                        if reached:
                            return
                doc_index += 1
        if fill:
            flush(doc_index, 0, exhausted=True)
        elif shards:
            shards[-1]["exhausted"] = True
            self._save()
        else:
            raise ValueError(
                f"{source.describe()}: no training documents after the validation split"
            )

    @staticmethod
    def _written(shards: list[dict]) -> int:
        return sum(s["tokens"] for s in shards)


def parse_count(text: str) -> int:
    """``"10.5B"`` → 10_500_000_000; also ``K``/``M``/``T`` suffixes, ``1e9`` and ``10_000``."""
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
    text = text.strip().replace("_", "").replace(",", "")
    factor = scale.get(text[-1:].upper(), 1)
    number = text[:-1] if factor > 1 else text
    try:
        value = float(number) * factor
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 10.5B)") from None
    if value <= 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"token count must be a positive integer, got {text!r}")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="muoneq data",
        description="Tokenize a corpus into llm.c/modded-nanogpt token shards (train and val).",
    )
    p.add_argument("--source", nargs="+", required=True,
                   help="fineweb | c4 | hf:<owner/name> | local files or globs "
                        "(.jsonl/.json[.gz], .parquet, .txt)")
    p.add_argument("--out", required=True, type=Path, help="output folder of the shards")
    p.add_argument("--tokens", type=parse_count, default=None,
                   help="training-token budget, e.g. 10.5B (default: the whole source)")
    p.add_argument("--val-tokens", type=parse_count, default=DEFAULT_VAL_TOKENS,
                   help="validation split: whole documents until more than this many tokens "
                        f"(default {DEFAULT_VAL_TOKENS:,}, the evaluation budget)")
    p.add_argument("--val-source", nargs="+", default=None,
                   help="separate local validation files (default: the source's validation "
                        "split, else the first documents of the source)")
    p.add_argument("--tokenizer", default="gpt2",
                   help="tiktoken encoding name, path to a .tiktoken file, or 'byte'")
    p.add_argument("--shard-tokens", type=parse_count, default=100_000_000,
                   help="tokens per shard (default 100M, as modded-nanogpt)")
    p.add_argument("--prefix", default=None,
                   help="shard file prefix (default: fineweb, c4, else data)")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="tokenizer processes (1: tokenize in this process)")
    p.add_argument("--hf-config", default=None, help="Hub dataset config (fineweb: sample-10BT…)")
    p.add_argument("--split", default=None, help="Hub training split (default train)")
    p.add_argument("--val-split", default=None, help="Hub validation split (c4: validation)")
    p.add_argument("--text-field", default="text", help="column holding the document text")
    p.add_argument("--text-sample-by", default="paragraph", choices=TEXT_SAMPLE_BY,
                   help="plain-text files: one document per paragraph, line, or file")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        return prepare(args)
    except UserError:
        raise
    except ConnectionError as err:
        raise UserError(
            f"{err}; no network? Copy the dataset's files (e.g. `hf download "
            "HuggingFaceFW/fineweb --repo-type dataset --include 'sample/100BT/*'`) and pass "
            "them as --source files") from err
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        # bad sources, names and values of the command line (their messages name the option)
        raise UserError(str(err)) from err


def prepare(args: argparse.Namespace) -> int:
    """Run the preparation described by the parsed command line."""
    train_source, val_source = resolve_sources(args)
    tokenizer = load_tokenizer(args.tokenizer)  # fail early (name, cache, file) before streaming
    if tokenizer.n_vocab > 2**16:
        raise ValueError(
            f"--tokenizer {args.tokenizer!r}: vocabulary {tokenizer.n_vocab} does not fit "
            "uint16 shards"
        )
    prefix = args.prefix or (args.source[0] if args.source[0] in PRESETS else "data")
    settings = {
        "train_source": asdict(train_source),
        "val_source": asdict(val_source) if val_source else None,
        "tokenizer": args.tokenizer,
        "vocab_size": tokenizer.n_vocab,
        "eot": tokenizer.eot,
        "shard_tokens": args.shard_tokens,
        "val_tokens": args.val_tokens,
        "prefix": prefix,
        "tokens": args.tokens,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    prep = Preparation(args.out, settings, args.workers)
    first_doc = prep.run_val(val_source or train_source, separate=val_source is not None)
    prep.run_train(train_source, first_doc)
    state = prep.state
    print(
        f"{args.out}: val {state['val']['tokens']:,} tokens in {len(state['val']['shards'])} "
        f"shard(s); train {Preparation._written(state['train']['shards']):,} tokens in "
        f"{len(state['train']['shards'])} shard(s); tokenizer {args.tokenizer} "
        f"(vocab {tokenizer.n_vocab}, eot {tokenizer.eot})"
    )
    return 0
