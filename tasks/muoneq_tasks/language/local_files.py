"""Documents of local corpus files (JSON lines, parquet, plain text) for ``muoneq data``.

Read here rather than through ``datasets``, which only the Hub sources need: it is a heavy import
and a machine that reaches no Hub has no use for it. Every format gives the documents, their
order and their boundaries that ``datasets.load_dataset(<format>, data_files=..., streaming=True)``
gives (``tests/test_language_prepare.py`` compares the two), so shards do not depend on which
reader made them:

* JSON (``.jsonl``/``.json``/``.ndjson``, optionally ``.gz``): one object per line (blank lines
  skipped), or one JSON array of objects;
* parquet: the rows of the file in order (pyarrow, a column at a time);
* plain text (``.txt``/``.text``, optionally ``.gz``), read as UTF-8 with universal newlines
  (``\\r\\n`` and ``\\r`` become ``\\n``): a document per paragraph (the pieces between blank
  lines, ``"\\n\\n"``, empty ones dropped), per line (line breaks kept) or per file.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator
from typing import IO

#: File suffix → format (the name of the ``datasets`` builder that reads it the same way).
FILE_FORMATS = {
    ".jsonl": "json", ".json": "json", ".ndjson": "json",
    ".jsonl.gz": "json", ".json.gz": "json", ".ndjson.gz": "json",
    ".parquet": "parquet",
    ".txt": "text", ".text": "text", ".txt.gz": "text",
}
TEXT_SAMPLE_BY = ("paragraph", "line", "document")
#: Characters read at a time from a text file split into paragraphs.
CHUNK_CHARS = 1 << 20


class MissingColumn(ValueError):
    """A source's rows lack the column holding the text."""


def file_format(path: str) -> str | None:
    """The format of ``path`` by its suffix (the longest that matches), or None."""
    suffix = next((s for s in sorted(FILE_FORMATS, key=len, reverse=True) if path.endswith(s)),
                  None)
    return None if suffix is None else FILE_FORMATS[suffix]


def _open_text(path: str) -> IO[str]:
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")  # noqa: SIM115  (closed by the caller's ``with``)


def missing_column(source: str, field: str, columns: Iterable[str]) -> MissingColumn:
    return MissingColumn(f"{source}: no column {field!r}; columns: {', '.join(columns)} (choose "
                         "one with --text-field)")


def _json_rows(path: str) -> Iterator[dict]:
    with _open_text(path) as f:
        lines = (line for line in f if line.strip())
        first = next(lines, None)
        if first is None:
            return
        if first.lstrip().startswith("["):  # one array of objects
            yield from json.loads("".join([first, *lines]))
            return
        yield json.loads(first)
        for line in lines:
            yield json.loads(line)


def _json_documents(path: str, field: str) -> Iterator[str]:
    for row in _json_rows(path):
        if field not in row:
            raise missing_column(path, field, row)
        yield row[field]


def _parquet_documents(path: str, field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as parquet:
        if field not in parquet.schema_arrow.names:
            raise missing_column(path, field, parquet.schema_arrow.names)
        for batch in parquet.iter_batches(columns=[field]):
            yield from batch.column(0).to_pylist()


def _text_documents(path: str, sample_by: str) -> Iterator[str]:
    with _open_text(path) as f:
        if sample_by == "document":
            yield f.read()
        elif sample_by == "line":
            yield from f
        else:  # paragraphs: the text split at "\n\n", read a chunk at a time
            rest = ""
            while chunk := f.read(CHUNK_CHARS):
                pieces = (rest + chunk).split("\n\n")
                rest = pieces.pop()  # may continue in the next chunk
                yield from (p for p in pieces if p)
            if rest:
                yield rest


def read_documents(files: Iterable[str], fmt: str, text_field: str = "text",
                   sample_by: str = "paragraph") -> Iterator[str]:
    """The documents of ``files`` (all of format ``fmt``), file after file."""
    for path in files:
        if fmt == "json":
            yield from _json_documents(path, text_field)
        elif fmt == "parquet":
            yield from _parquet_documents(path, text_field)
        elif fmt == "text":
            yield from _text_documents(path, sample_by)
        else:
            raise ValueError(f"unknown local format {fmt!r}; known: "
                             f"{', '.join(sorted(set(FILE_FORMATS.values())))}")
