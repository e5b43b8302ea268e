"""The language task's data for miniatures (``make demo``, ``muoneq sweep NAME --mini``): real
text that ships with every Python, the English documentation topics of ``pydoc_data.topics``
(~465 kB, one document per topic), tokenized to UTF-8 bytes (vocabulary 257) into token shards
by ``muoneq data``, with a validation split of :data:`VAL_TOKENS` tokens."""

from __future__ import annotations

import json
from pathlib import Path

from muoneq.suite.errors import UserError
from muoneq.suite.runtime.tasks import MiniData
from muoneq_tasks.language.prepare import PROGRESS_FILE
from muoneq_tasks.language.prepare import main as prepare

VAL_TOKENS = 16_384
DESCRIPTION = ("Python's pydoc topics (pydoc_data.topics: the documentation every Python "
               "ships, 465 kB) as UTF-8 bytes")


def mini_data(folder: Path) -> MiniData:
    """Shards of the pydoc topics in ``folder`` (skipped when already there: ``muoneq data``
    resumes), and the overrides that read them."""
    import pydoc_data.topics

    folder = Path(folder)
    if not (folder / PROGRESS_FILE).exists():
        text = folder / "pydoc_topics.jsonl"
        folder.mkdir(parents=True, exist_ok=True)
        with text.open("w") as fh:
            for name in sorted(pydoc_data.topics.topics):
                fh.write(json.dumps({"text": pydoc_data.topics.topics[name]}) + "\n")
        code = prepare(["--source", str(text), "--out", str(folder), "--tokenizer", "byte",
                        "--val-tokens", str(VAL_TOKENS), "--workers", "1"])
        if code:
            raise UserError(f"muoneq data failed with status {code} on {text}")
    return MiniData([f"task.data.dir={folder}", "task.data.tokenizer=byte"], DESCRIPTION)
