"""Tokenizers for the token pipeline: any tiktoken encoding, a local ``.tiktoken`` file, or bytes.

``load_tokenizer(name)``:

* a tiktoken encoding name (``"gpt2"``, the default of the suite, or ``"r50k_base"``,
  ``"cl100k_base"``…) through ``tiktoken.get_encoding``. Offline, point ``TIKTOKEN_CACHE_DIR``
  at a folder holding tiktoken's cache (tiktoken checks the files' hashes);
* a path to a ``.tiktoken`` file (one ``base64-token rank`` per line, as tiktoken publishes
  them) for clusters without a network: ``<|endoftext|>`` gets the next free id, and the
  pre-tokenizer regex is GPT-2's unless ``pattern`` says otherwise;
* ``"byte"``: UTF-8 bytes (ids 0–255) plus ``<|endoftext|>`` = 256, for tiny offline runs.

Text is encoded as ordinary text: a literal ``<|endoftext|>`` inside a document is not
turned into the special token, so documents cannot forge boundaries.
"""

from __future__ import annotations

from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from tiktoken_ext.openai_public import r50k_pat_str

ENDOFTEXT = "<|endoftext|>"


class ByteTokenizer:
    """UTF-8 bytes as tokens 0–255 and ``<|endoftext|>`` as 256 (vocabulary 257)."""

    name = "byte"
    n_vocab = 257
    eot = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class TiktokenTokenizer:
    """A ``tiktoken.Encoding`` with the interface of the pipeline (``eot``, ``n_vocab``…)."""

    def __init__(self, encoding: tiktoken.Encoding, name: str):
        if ENDOFTEXT not in encoding.special_tokens_set:
            raise ValueError(f"tokenizer {name!r} has no {ENDOFTEXT} token to separate documents")
        self.encoding = encoding
        self.name = name
        self.n_vocab = encoding.n_vocab
        self.eot = encoding.encode_single_token(ENDOFTEXT)

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def decode(self, ids) -> str:
        return self.encoding.decode(list(ids))


Tokenizer = ByteTokenizer | TiktokenTokenizer


def load_tokenizer(name: str = "gpt2", pattern: str | None = None) -> Tokenizer:
    """Load the tokenizer called ``name`` (see the module docstring for the accepted forms)."""
    if name == "byte":
        return ByteTokenizer()
    path = Path(name).expanduser()
    if name.endswith(".tiktoken") or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer: no such .tiktoken file: {path}")
        ranks = load_tiktoken_bpe(str(path))
        encoding = tiktoken.Encoding(
            path.stem,
            pat_str=pattern or r50k_pat_str,
            mergeable_ranks=ranks,
            special_tokens={ENDOFTEXT: len(ranks)},
        )
        return TiktokenTokenizer(encoding, str(path))
    if pattern is not None:
        raise ValueError("tokenizer: `pattern` applies to .tiktoken files, not to named encodings")
    if name not in tiktoken.list_encoding_names():
        raise ValueError(
            f"tokenizer: unknown name {name!r}; allowed: 'byte', a path to a .tiktoken file, or "
            f"a tiktoken encoding ({', '.join(tiktoken.list_encoding_names())})"
        )
    try:
        encoding = tiktoken.get_encoding(name)
    except Exception as err:  # tiktoken raises whatever its HTTP client raises when offline
        raise RuntimeError(
            f"tokenizer: could not load tiktoken encoding {name!r} ({type(err).__name__}: {err}). "
            "Offline, set TIKTOKEN_CACHE_DIR to a folder holding tiktoken's cache, or pass the "
            "path of a local .tiktoken file instead of the name."
        ) from err
    return TiktokenTokenizer(encoding, name)
