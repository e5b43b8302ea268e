"""Tokenizers for the token pipeline: any tiktoken encoding, a local ``.tiktoken`` file, or bytes.

``load_tokenizer(name)``:

* a tiktoken encoding name (``"gpt2"``, the default of the suite, or ``"r50k_base"``,
  ``"cl100k_base"``…) through ``tiktoken.get_encoding``. Offline, point ``TIKTOKEN_CACHE_DIR``
  at a folder holding tiktoken's cache (tiktoken checks the files' hashes);
* a path to a ``.tiktoken`` file (one ``base64-token rank`` per line, as tiktoken publishes
  them) for clusters without a network: ``<|endoftext|>`` gets the next free id, and the
  pre-tokenizer regex is GPT-2's unless ``pattern`` says otherwise;
* a Hugging Face tokenizer: a path to a ``tokenizer.json`` file, or ``"hf:<repo>"``
  (``"hf:google-t5/t5-base"``: T5's 32k SentencePiece vocabulary, the one of the paper's
  LLaMA runs) through the ``tokenizers`` library; documents are separated by its
  end-of-text token (the first of :data:`SEPARATORS` in its vocabulary);
* ``"byte"``: UTF-8 bytes (ids 0–255) plus ``<|endoftext|>`` = 256, for tiny offline runs.

Text is encoded as ordinary text: a literal special token (``<|endoftext|>``, ``</s>``…)
inside a document is not turned into the special token, so documents cannot forge
boundaries, and no special token is added around a document.
"""

from __future__ import annotations

from pathlib import Path

import tiktoken
import tokenizers
from tiktoken.load import load_tiktoken_bpe
from tiktoken_ext.openai_public import r50k_pat_str

from muoneq.suite.errors import DataError, UserError

ENDOFTEXT = "<|endoftext|>"
#: Document separators looked up, in this order, in a Hugging Face tokenizer's vocabulary.
SEPARATORS = (ENDOFTEXT, "</s>", "<|end_of_text|>", "<eos>")


class TokenizerUnavailable(UserError, RuntimeError):
    """A named tokenizer whose files cannot be fetched (offline): the message says how to give
    them locally."""


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


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` with the interface of the pipeline."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, name: str):
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        separator = next((t for t in SEPARATORS if t in vocab), None)
        if separator is None:
            raise ValueError(
                f"tokenizer {name!r} has none of the document separators "
                f"{', '.join(SEPARATORS)} in its vocabulary"
            )
        self.tokenizer = tokenizer
        self.name = name
        self.n_vocab = max(vocab.values()) + 1  # rows the embedding needs
        self.separator = separator
        self.eot = vocab[separator]

    def encode(self, text: str) -> list[int]:
        ids = self._encode(text)
        if self.eot not in ids:
            return ids
        # A literal separator in the text. Hugging Face tokenizers map it to the special token
        # (added-token matching, and SentencePiece vocabularies hold "</s>" as a piece), so
        # encode each occurrence one character at a time: it stays text.
        chunks = text.split(self.separator)
        ids = self._encode(chunks[0])
        for chunk in chunks[1:]:
            for char in self.separator:
                ids += self._encode(char)
            ids += self._encode(chunk)
        return ids

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids if text else []

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


Tokenizer = ByteTokenizer | TiktokenTokenizer | HFTokenizer


def load_tokenizer(name: str = "gpt2", pattern: str | None = None) -> Tokenizer:
    """Load the tokenizer called ``name`` (see the module docstring for the accepted forms)."""
    if name == "byte":
        return ByteTokenizer()
    if name.startswith("hf:"):
        return _from_hub(name.removeprefix("hf:"))
    path = Path(name).expanduser()
    if name.endswith(".json"):
        if not path.is_file():
            raise DataError(f"tokenizer: no such tokenizer.json file: {path}; check the path")
        return HFTokenizer(tokenizers.Tokenizer.from_file(str(path)), str(path))
    if name.endswith(".tiktoken") or path.is_file():
        if not path.is_file():
            raise DataError(f"tokenizer: no such .tiktoken file: {path}; check the path")
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
            f"tokenizer: unknown name {name!r}; allowed: 'byte', a path to a .tiktoken file or "
            "a tokenizer.json, 'hf:<repo>' (e.g. hf:google-t5/t5-base), or a tiktoken encoding "
            f"({', '.join(tiktoken.list_encoding_names())})"
        )
    try:
        encoding = tiktoken.get_encoding(name)
    except Exception as err:  # tiktoken raises whatever its HTTP client raises when offline
        raise TokenizerUnavailable(
            f"tokenizer: could not load tiktoken encoding {name!r} ({type(err).__name__}: {err}); "
            "offline, set TIKTOKEN_CACHE_DIR to a folder holding tiktoken's cache, or pass the "
            "path of a local .tiktoken file instead of the name"
        ) from err
    return TiktokenTokenizer(encoding, name)


def _from_hub(repo: str) -> HFTokenizer:
    """The ``tokenizer.json`` of a Hugging Face Hub repository (downloaded, or from the cache)."""
    if not repo:
        raise ValueError("tokenizer: 'hf:' needs a repository, e.g. hf:google-t5/t5-base")
    try:
        tokenizer = tokenizers.Tokenizer.from_pretrained(repo)
    except Exception as err:  # the hub client raises its own HTTP and offline errors
        raise TokenizerUnavailable(
            f"tokenizer: could not load the tokenizer.json of {repo!r} from the Hugging Face Hub "
            f"({type(err).__name__}: {err}); offline, download that file elsewhere and pass its "
            "path instead (a name ending in .json)"
        ) from err
    return HFTokenizer(tokenizer, f"hf:{repo}")
