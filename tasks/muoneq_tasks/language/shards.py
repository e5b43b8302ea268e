"""Token shards in the llm.c / modded-nanogpt format, so existing pre-tokenized FineWeb works.

A shard is a 1,024-byte header of 256 little-endian int32 — ``[20240520, 1, n_tokens, 0, …]``
(magic, version, token count) — followed by ``n_tokens`` little-endian uint16 token ids.
Documents are prefixed with ``<|endoftext|>``. Files are named ``<prefix>_<split>_<NNNNNN>.bin``
(``fineweb_val_000000.bin``, ``fineweb_train_000001.bin``…). Written by hand because it is a
fixed binary layout that numpy reads directly; no library owns it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from muoneq.suite.errors import DataError, UserError
from muoneq.suite.files import atomic_open, atomic_write

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")
SPLITS = ("train", "val")


class ShardError(UserError, ValueError):
    """A file that is not a valid token shard (the message names the file and the defect)."""


PREPARE_AGAIN = "prepare the shards again with `muoneq data` (it re-writes a bad shard)"


def shard_name(prefix: str, split: str, index: int) -> str:
    if split not in SPLITS:
        raise ValueError(f"split: unknown {split!r}; allowed: {', '.join(SPLITS)}")
    return f"{prefix}_{split}_{index:06d}.bin"


def write_shard(path: str | Path, tokens) -> Path:
    """Write ``tokens`` (ids < 65,536) as one shard, atomically: the file either appears whole
    or not at all, so an interrupted preparation never leaves a truncated shard behind."""
    path = Path(path)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ValueError(f"{path}: token ids must lie in [0, 65535] to fit uint16 shards")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (MAGIC, VERSION, tokens.size)
    with atomic_open(path, "wb", fsync=True) as f:
        f.write(header.tobytes())
        f.write(tokens.astype(TOKEN_DTYPE, copy=False).tobytes())
    return path


def write_synthetic(cfg, folder: str | Path) -> list[str]:
    """Uniform random token ids below ``task.data.vocab_size`` as one training shard, enough
    for ``trainer.max_steps`` steps of the global batch (and one more), and one validation
    shard of ``task.data.val_tokens``; the overrides that point the run ``cfg`` at them."""
    data, steps = cfg.task.data, cfg.trainer.max_steps
    if not data.vocab_size:
        raise ValueError("task.data.vocab_size: set it to make synthetic tokens (no tokenizer "
                         "is read for them)")
    if steps is None or steps < 1:
        raise ValueError(f"trainer.max_steps={steps}: synthetic tokens need a step budget")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    train = ((steps + 1) * data.batch_size + 1) * data.seq_len + 1
    write_shard(folder / shard_name("synthetic", "train", 1),
                rng.integers(0, data.vocab_size, train))
    write_shard(folder / shard_name("synthetic", "val", 0),
                rng.integers(0, data.vocab_size, data.val_tokens + 1))
    return [f"task.data.dir={folder}"]


def read_header(path: str | Path) -> int:
    """Validate the shard at ``path`` and return its token count (raises :class:`ShardError`)."""
    path = Path(path)
    if not path.is_file():
        raise ShardError(f"{path}: no such shard file; {PREPARE_AGAIN}")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ShardError(f"{path}: {size} bytes, shorter than the {HEADER_BYTES}-byte header; "
                         f"{PREPARE_AGAIN}")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    magic, version, n_tokens = (int(v) for v in header[:3])
    if magic != MAGIC:
        raise ShardError(f"{path}: wrong magic number {magic} (expected {MAGIC}), not a token "
                         f"shard; remove it from the folder, or {PREPARE_AGAIN}")
    if version != VERSION:
        raise ShardError(
            f"{path}: unsupported version {version} (expected {VERSION}: uint16 tokens); "
            f"{PREPARE_AGAIN}"
        )
    expected = HEADER_BYTES + TOKEN_DTYPE.itemsize * n_tokens
    if n_tokens < 0 or size != expected:
        raise ShardError(
            f"{path}: header promises {n_tokens} tokens ({expected} bytes) but the file has "
            f"{size} bytes, so it is truncated or corrupt; {PREPARE_AGAIN}"
        )
    return n_tokens


def open_shard(path: str | Path) -> np.memmap:
    """The tokens of a validated shard, memory-mapped read-only (nothing is loaded)."""
    n_tokens = read_header(path)
    if n_tokens == 0:
        return np.zeros(0, dtype=TOKEN_DTYPE)
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(n_tokens,))


#: Per-folder cache of each shard's largest token id (``check_vocabulary``), keyed by file name
#: and valid while the file's size and modification time are unchanged.
MAX_ID_CACHE = ".token_max.json"


def max_token_id(path: str | Path) -> int:
    """The largest token id of a validated shard (-1 when empty): one pass over the file, then
    remembered in its folder's :data:`MAX_ID_CACHE` (when the folder is writable), so a run
    reads each shard for this once."""
    path = Path(path)
    stat = path.stat()
    stamp = [stat.st_size, stat.st_mtime_ns]
    cache_path = path.parent / MAX_ID_CACHE
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    entry = cache.get(path.name) if isinstance(cache, dict) else None
    if isinstance(entry, list) and entry[:2] == stamp:
        return int(entry[2])
    tokens = open_shard(path)
    largest = int(tokens.max()) if tokens.size else -1
    cache = {**(cache if isinstance(cache, dict) else {}), path.name: [*stamp, largest]}
    try:
        atomic_write(cache_path, json.dumps(cache))
    except OSError:  # a read-only data folder only means reading the shard again next time
        pass
    return largest


def check_vocabulary(files, vocab_size: int, tokenizer: str) -> None:
    """Raise :class:`ShardError` naming the first shard holding a token id ``≥ vocab_size``
    (shards written with another tokenizer: the embedding would fail, or silently read another
    row)."""
    for path in files:
        largest = max_token_id(path)
        if largest >= vocab_size:
            raise ShardError(
                f"{path}: holds token id {largest}, outside the vocabulary of "
                f"task.data.tokenizer={tokenizer} ({vocab_size} ids); the shards were written "
                "with another tokenizer: pass that one as task.data.tokenizer, or "
                f"{PREPARE_AGAIN}")


def find_shards(source: str | Path, split: str) -> list[Path]:
    """The shards of ``split`` in order: every ``*_<split>_<digits>.bin`` under a directory, or
    the files matching a glob pattern (``/data/fineweb10B/fineweb_train_*.bin``)."""
    if split not in SPLITS:
        raise ValueError(f"split: unknown {split!r}; allowed: {', '.join(SPLITS)}")
    source = Path(source).expanduser()
    if source.is_dir():
        pattern = re.compile(rf".*_{split}_\d+\.bin")
        files = sorted(p for p in source.iterdir() if pattern.fullmatch(p.name))
    else:
        files = sorted(source.parent.glob(source.name))
    if not files:
        raise DataError(
            f"no {split} shards at {source} (expected files named *_{split}_000000.bin); "
            "prepare them with `muoneq data` (make data-fineweb, make data-c4, or "
            "make train-llama-tiny TEXT=file.txt), or point task.data.dir at a folder of "
            "llm.c/modded-nanogpt shards"
        )
    return files
