"""The files a run wrote in its ``checkpoints/`` and ``tensorboard/``, so that cleaning removes
exactly those.

Those folders may be links to folders others write too (a scratch disk, a shared folder of
TensorBoard logs), where a file named as a run names its files may be another run's or the
user's. ``<run folder>/.written`` lists, one a line and relative to the run folder, every file
the run creates there, each listed *before* it is created: a kill between the two leaves a name
listed with no file (nothing to remove), never a file of the run unlisted. A checkpoint is listed
with its ``.sha256`` and the temporary files of both (:func:`muoneq.suite.files.temporary_path`).
TensorBoard's writer names its event files itself (time, host, process), so they are listed by a
pattern, ``tensorboard/events.out.tfevents.*.<session>``: each session gives its event files a
suffix of its own (:class:`muoneq.suite.runtime.trainer.GlobalStepLogger`). Lightning's
``tensorboard/hparams.yaml`` and the spectral monitor's ``tensorboard/spectra.csv`` (with its
temporary file) are listed too.

Cleaning (:mod:`muoneq.suite.runtime.run_folder`) removes what the list names and nothing else.
"""

from __future__ import annotations

from pathlib import Path

WRITTEN_NAME = ".written"


class Written:
    """The list of what the run in ``run_dir`` wrote (module docstring)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / WRITTEN_NAME

    def exists(self) -> bool:
        """Whether the run keeps the list (a run folder made before it existed does not)."""
        return self.path.is_file()

    def names(self) -> list[str]:
        """The listed names and patterns, relative to the run folder."""
        try:
            return self.path.read_text().splitlines()
        except FileNotFoundError:
            return []

    def record(self, folder: str, *names: str) -> None:
        """List the files ``names`` of the run's ``folder`` (``checkpoints``, ``tensorboard``)
        before they are written; names listed already are skipped."""
        listed = set(self.names())
        new = [f"{folder}/{name}" for name in dict.fromkeys(names)]
        new = [line for line in new if line not in listed]
        if new:
            with open(self.path, "a") as f:
                f.write("".join(f"{line}\n" for line in new))

    def wrote(self, folder: str, name: str) -> bool:
        """Whether the run wrote ``folder/name`` (listed, or a run folder made before the list,
        whose files are known by their names only)."""
        return not self.exists() or f"{folder}/{name}" in self.names()

    def files(self) -> list[Path]:
        """The listed files (a distributed checkpoint: a folder) that exist, through the run
        folder's links."""
        return sorted({p for name in self.names() for p in self.run_dir.glob(name)
                       if p.exists() or p.is_symlink()})

    def forget(self) -> None:
        """Start the list over (once what it names was removed)."""
        self.path.unlink(missing_ok=True)
