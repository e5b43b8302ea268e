"""Small real-format data and tiny-run overrides for the runtime tests.

``TINY_RUNS`` maps a task name to a function ``(tmp_path) -> overrides`` that writes small data
in the task's real on-disk format and returns the command-line overrides that make a run of
that task take seconds on a CPU. tests/test_runtime_train.py runs every
``conf/experiment/*.yaml`` with it: a new task adds its entry here.
"""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path

import lightning as L
import numpy as np


def cifar_arrays(n_train: int = 32, n_test: int = 20, seed: int = 0) -> dict[str, np.ndarray]:
    """Images whose class is visible (a class-dependent mean colour plus noise), so that a
    tiny network can learn something; uint8 HWC as CIFAR ships them."""
    rng = np.random.default_rng(seed)
    palette = rng.integers(30, 225, size=(10, 3))

    def make(n):
        labels = rng.integers(0, 10, n)
        noise = rng.normal(0, 25, size=(n, 32, 32, 3))
        images = np.clip(palette[labels][:, None, None, :] + noise, 0, 255).astype(np.uint8)
        return images, labels.astype(np.int64)

    x_train, y_train = make(n_train)
    x_test, y_test = make(n_test)
    return {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}


def write_cifar_npz(path: Path, **kwargs) -> Path:
    np.savez(path, **cifar_arrays(**kwargs))
    return path


def write_cifar_batches(root: Path, arrays: dict[str, np.ndarray], n_batches: int = 5) -> dict:
    """torchvision's ``cifar-10-batches-py`` layout (pickled dicts, rows of 3072 CHW bytes).

    Returns ``{file name: md5}`` for patching torchvision's integrity table."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)

    def dump(name, images, labels):
        rows = images.transpose(0, 3, 1, 2).reshape(len(images), -1)
        with open(folder / name, "wb") as f:
            pickle.dump({"data": rows, "labels": [int(v) for v in labels]}, f, protocol=2)

    chunks = np.array_split(np.arange(len(arrays["y_train"])), n_batches)
    for i, idx in enumerate(chunks, 1):
        dump(f"data_batch_{i}", arrays["x_train"][idx], arrays["y_train"][idx])
    dump("test_batch", arrays["x_test"], arrays["y_test"])
    names = [f"class{i}" for i in range(10)]
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": names}, f, protocol=2)
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def tiny_cifar10(tmp_path: Path) -> list[str]:
    data = write_cifar_npz(tmp_path / "cifar.npz", n_train=32, n_test=20)
    return [
        f"task.data.root={data}", "task.model.width=4", "task.model.blocks=[1]",
        "task.data.batch_size=8", "task.data.eval_batch_size=10", "trainer=cpu",
        "trainer.progress=quiet",
    ]


TINY_RUNS = {"cifar10": tiny_cifar10}


def tiny(tmp_path: Path, *extra: str) -> list[str]:
    """The CIFAR-10 recipe on :func:`tiny_cifar10`'s data, with ``extra`` overrides."""
    return ["experiment=cifar10_resnet18", *tiny_cifar10(tmp_path), *extra]


class Losses(L.Callback):
    """Training loss of every optimizer step."""

    def __init__(self) -> None:
        self.by_step: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.by_step[trainer.global_step] = float(outputs["loss"])


class StopAt(L.Callback):
    """Crash the run at a given optimizer step (as a failure or a kill would)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("stopped by the test")


def tiny_language(tmp_path: Path) -> list[str]:
    """Token shards of a small grammar corpus, tokenized with a tiny byte-level BPE."""
    from muoneq.suite.cli import main as cli
    from tests.helpers.language import make_documents, tiny_tiktoken_file, write_corpus

    corpus = write_corpus(tmp_path, "txt", make_documents(200))
    tokenizer = tiny_tiktoken_file(tmp_path / "tiny.tiktoken")
    shards = tmp_path / "shards"
    assert cli(["data", "--source", str(corpus), "--out", str(shards), "--tokenizer",
                str(tokenizer), "--val-tokens", "128", "--shard-tokens", "4000",
                "--workers", "1"]) == 0
    return [
        f"task.data.dir={shards}", f"task.data.tokenizer={tokenizer}", "task.data.seq_len=32",
        "task.data.batch_size=4", "task.data.micro_batch_size=2", "task.data.val_tokens=64",
        "task.data.num_workers=0", "task.model.size=tiny", "trainer=cpu",
        "trainer.precision=32-true", "trainer.progress=quiet",
    ]


TINY_RUNS["language"] = tiny_language
