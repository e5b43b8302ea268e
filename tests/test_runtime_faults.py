"""Fault injection on training runs: names that would leave runs/, folders that are not run
folders, damaged checkpoints, a full disk, divergence, SIGINT/SIGTERM, a damaged metrics.json.
Each case ends in one line and loses nothing."""

from __future__ import annotations

import errno
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import lightning as L
import pytest
import torch

from muoneq.suite.cli import main
from muoneq.suite.errors import DiskFull, Interrupted
from muoneq.suite.runtime import ConfigError, compose, train
from muoneq.suite.runtime import checkpoints as ckpts
from muoneq.suite.runtime.checkpoints import CheckpointError, ChecksummedCheckpointIO
from muoneq.suite.runtime.written import Written
from tests.helpers import small_disk
from tests.helpers.access import deny_access  # noqa: F401 (a fixture: deny)
from tests.helpers.runtime import TINY_RUNS, Losses, StopAt, tiny
from tests.helpers.sweeps import REPO, scalars

pytestmark = pytest.mark.usefixtures("one_thread")


def one_line(err: str, ranks: int = 1) -> str:
    """The one ``muoneq:`` line of ``err`` (every one of ``ranks`` processes prints its own)."""
    lines = [x for x in err.splitlines() if x.startswith("muoneq: ")]
    assert len(lines) == ranks and len(set(lines)) == 1 and "Traceback" not in err, err
    return lines[0]


def tree(folder: Path) -> dict[str, bytes]:
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*"))
            if f.is_file()}


# ----------------------------------------------------------------------------- run names
@pytest.mark.parametrize("name", ["..", ".", "../../x", "a/b", "x;rm", "$(id)", "a`b`"])
def test_a_run_name_is_one_folder_name(tmp_path, capsys, name):
    with pytest.raises(ConfigError, match=r"run\.name=.*one folder name"):
        compose(tiny(tmp_path, f"run.name={name}"))
    runs = f"run.root={tmp_path / 'runs'}"
    assert main(["train", *tiny(tmp_path, f"run.name={name}", runs)]) == 2
    assert "run.name=" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "x").exists()


def test_a_folder_muoneq_did_not_make_is_never_taken_over(tmp_path, capsys):
    """run.name=.. used to make a run take over a folder holding a config.yaml: its
    checkpoints/ and tensorboard/ deleted, its config.yaml overwritten."""
    mine = tmp_path / "project"
    (mine / "checkpoints").mkdir(parents=True)
    (mine / "checkpoints" / "model.pt").write_bytes(b"weights")
    (mine / "tensorboard").mkdir()
    (mine / "tensorboard" / "events").write_bytes(b"curves")
    (mine / "config.yaml").write_text("lr: 0.1\n")
    before = tree(mine)
    for extra in ([], ["resume=auto"]):
        assert main(["train", *tiny(tmp_path, f"run.dir={mine}", *extra)]) == 2
        line = one_line(capsys.readouterr().err)
        assert "config.yaml that muoneq train did not write" in line and str(mine) in line
    (mine / "config.yaml").unlink()  # no config.yaml, but folders of the same names
    assert main(["train", *tiny(tmp_path, f"run.dir={mine}")]) == 2
    assert "is not a run folder of muoneq train" in one_line(capsys.readouterr().err)
    del before["config.yaml"]
    assert tree(mine) == before
    # a file of the name a run writes (routing.txt) used to be overwritten without a word
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "routing.txt").write_text("my routing notes")
    assert main(["train", *tiny(tmp_path, f"run.dir={notes}")]) == 2
    assert one_line(capsys.readouterr().err) == (
        f"muoneq: {notes} holds routing.txt but no config.yaml, so it is not a run folder of "
        "muoneq train and is left alone; choose another run.dir or run.name")
    assert tree(notes) == {"routing.txt": b"my routing notes"}


# ----------------------------------------------------------------------------- one writer
def test_a_second_run_in_a_folder_being_written_is_refused_naming_the_writer(tmp_path, capsys):
    """Two runs with one run.name at once used to both exit 0, the second clearing the first's
    files as an "earlier attempt" while it ran, the folder ending with a mix of both."""
    from muoneq.suite.runtime import run_folder

    run = tmp_path / "runs" / "same"
    args = tiny(tmp_path, "trainer.max_epochs=1", f"run.root={tmp_path / 'runs'}", "run.name=same")
    with run_folder.hold(run, ["the", "first"]):  # a live run writes the folder
        before = tree(run)
        assert main(["train", *args]) == 2
        line = one_line(capsys.readouterr().err)
        assert line.startswith(f"muoneq: {run} is being written by process {os.getpid()} on ")
        assert "muoneq train the first" in line and "a run folder has one writer" in line
        assert tree(run) == before
    assert not (run / run_folder.LOCK_NAME).exists() and not run.exists()  # made for it: gone
    assert main(["train", *args]) == 0
    assert not (run / run_folder.LOCK_NAME).exists()  # released with the run


def test_a_lock_left_by_a_dead_run_is_taken_over(tmp_path, capsys):
    from muoneq.suite.runtime import run_folder

    run = tmp_path / "run"
    run.mkdir()
    left = {"pid": 999999, "host": "node7", "started": "2026-01-01T00:00:00+00:00",
            "command": "muoneq train killed"}
    (run / run_folder.LOCK_NAME).write_text(json.dumps(left))  # its holder was SIGKILLed
    assert main(["train", *tiny(tmp_path, "trainer.max_epochs=1", f"run.dir={run}")]) == 0
    out = capsys.readouterr().out
    assert (f"muoneq: note: {run / run_folder.LOCK_NAME} was left by process 999999 on node7 "
            "(since 2026-01-01T00:00:00+00:00: muoneq train killed), which ended without "
            "releasing it (killed?); this run takes it over") in out
    assert json.loads((run / "metrics.json").read_text())["status"] == "finished"


@pytest.mark.slow
def test_two_processes_in_one_run_folder(tmp_path):
    """Real processes: while one trains, a second with other settings is refused naming it;
    once the first is killed, a third continues it, taking its lock over."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = f"run.root={tmp_path / 'runs'}"
    args = tiny(tmp_path, "trainer.max_epochs=20", runs, "run.name=same")
    first = subprocess.Popen(
        [sys.executable, "-m", "muoneq", "train", *args, "trainer.progress=log",
         "trainer.log_every_n_steps=1"], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True)
    for line in first.stdout:
        if line.startswith("epoch ") and int(line.split()[3].split("/")[0]) >= 5:
            break  # it has trained 5 steps: the epoch-1 checkpoint is written
    first.send_signal(signal.SIGSTOP)  # it stays mid-run (holding its lock) while we look
    second = subprocess.run([sys.executable, "-m", "muoneq", "train", *args,
                             "optimizer.lr=0.5"], env=env, capture_output=True, text=True,
                            timeout=300)
    assert second.returncode == 2, second.stderr[-2000:]
    assert f"is being written by process {first.pid} on " in one_line(second.stderr)
    first.kill()
    first.communicate(timeout=60)
    third = subprocess.run([sys.executable, "-m", "muoneq", "train", *args, "resume=auto"],
                           env=env, capture_output=True, text=True, timeout=600)
    assert third.returncode == 0, third.stderr[-2000:]
    assert f"was left by process {first.pid} on " in third.stdout
    assert "resuming" in third.stdout
    record = (tmp_path / "runs" / "same" / "config.yaml").read_text()
    assert "lr: 0.5" not in record


# ----------------------------------------------------------------------------- paths
def test_a_links_target_loses_only_the_files_the_run_wrote(tmp_path, capsys):
    """checkpoints/ and tensorboard/ as links to shared folders (a cluster habit): starting over
    after an attempt that left no checkpoint used to delete there, by their names, what muoneq
    never wrote: a user's .cache.tmp/ with its contents, a .notes.tmp, an orphan .sha256,
    another host's TensorBoard event file."""
    run, scratch, logs = tmp_path / "run", tmp_path / "scratch", tmp_path / "logs"
    (scratch / "data").mkdir(parents=True)
    (scratch / "data" / "corpus.txt").write_text("mine")
    (scratch / ".cache.tmp").mkdir()
    (scratch / ".cache.tmp" / "blob").write_text("mine")
    (scratch / ".notes.tmp").write_text("mine")
    (scratch / "best.ckpt.sha256").write_text(f"{'0' * 64}  best.ckpt\n")  # its file moved away
    run.mkdir()
    (run / "checkpoints").symlink_to(scratch)
    args = tiny(tmp_path, "trainer.max_epochs=1", f"run.dir={run}")
    with pytest.raises(RuntimeError, match="stopped by the test"):
        train(compose(args), callbacks=[StopAt(2)])  # before the first (end of epoch) checkpoint
    (run / "tensorboard").rename(logs)  # the curves moved to a shared folder of logs
    (run / "tensorboard").symlink_to(logs)
    attempt = {p.name for p in logs.glob("events.out.tfevents.*")}
    other = logs / "events.out.tfevents.1790000000.node7.4242.0"
    other.write_bytes(b"another host's curves")
    users = tree(scratch)
    capsys.readouterr()
    assert main(["train", *args, "resume=auto"]) == 0
    out = capsys.readouterr().out
    assert (f"muoneq: note: {run / 'checkpoints'} is a symbolic link: the run writes to "
            f"{scratch} (and removes there only the files it wrote)") in out
    assert "starting over" in out
    after = tree(scratch)
    assert {name: after[name] for name in users} == users
    assert other.read_bytes() == b"another host's curves"
    assert not attempt & {p.name for p in logs.iterdir()}  # the attempt's curves: gone
    assert sorted(p.name for p in scratch.iterdir()) == [
        ".cache.tmp", ".notes.tmp", "best.ckpt.sha256", "data", "last-step000000004.ckpt",
        "last-step000000004.ckpt.sha256"]


def test_every_file_a_run_writes_in_its_linked_folders_is_listed(tmp_path, capsys):
    """.written listed the checkpoints and event files but not hparams.yaml (Lightning's
    logger) nor spectra.csv (the spectral monitor), so an attempt that started over left them in
    a link's target, and Lightning, which writes hparams.yaml only where there is none, kept the
    earlier attempt's."""
    run, scratch, logs = tmp_path / "run", tmp_path / "scratch", tmp_path / "logs"
    for folder in (scratch, logs):
        folder.mkdir()
    run.mkdir()
    (run / "checkpoints").symlink_to(scratch)
    (run / "tensorboard").symlink_to(logs)
    args = tiny(tmp_path, "trainer.max_epochs=1", f"run.dir={run}", "spectra.enabled=true",
                "spectra.steps=[1]", "spectra.log_figures=false")

    def unlisted() -> set[str]:
        listed = {p.name for p in Written(run).files()}
        return {p.name for folder in (scratch, logs) for p in folder.iterdir()} - listed

    with pytest.raises(RuntimeError, match="stopped by the test"):
        train(compose(args), callbacks=[StopAt(2)])  # before the first (end of epoch) checkpoint
    assert {"hparams.yaml", "spectra.csv"} <= {p.name for p in logs.iterdir()}
    assert unlisted() == set()
    (logs / "hparams.yaml").write_text("the: earlier attempt\n")
    capsys.readouterr()
    assert main(["train", *args, "resume=auto"]) == 0
    assert "starting over" in capsys.readouterr().out
    assert unlisted() == set()
    assert "the: earlier attempt" not in (logs / "hparams.yaml").read_text()


@pytest.mark.parametrize("folder", ["checkpoints", "tensorboard"])
def test_two_runs_whose_folders_link_to_one_folder_are_refused_together(tmp_path, capsys,
                                                                        folder):
    """Two runs whose checkpoints/ link to one scratch folder, started together, used to both
    exit 0: the folder ended with one run's best.ckpt and last-step…ckpt, and the other run's
    folder handed out its weights. The one-writer lock covers where the files really go. A new
    run whose tensorboard/ was a link used to be refused as "not a run folder", where a
    checkpoints/ link worked: both work alike."""
    from muoneq.suite.runtime import run_folder

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    first, second = tmp_path / "first", tmp_path / "second"
    for run in (first, second):
        run.mkdir()
        (run / folder).symlink_to(scratch)
    args = tiny(tmp_path, "trainer.max_epochs=1", f"run.dir={second}")
    with run_folder.hold(first, ["the", "first"]):  # a live run writes there
        before = tree(tmp_path)
        assert main(["train", *args]) == 2
        line = one_line(capsys.readouterr().err)
        assert line.startswith(f"muoneq: {scratch}, where {second / folder} leads, is "
                               f"being written by process {os.getpid()} on ")
        assert line.endswith(f"muoneq train the first), and runs that wrote one folder at once "
                             f"would mix their files; link {folder}/ to a folder of its own, "
                             "or wait for that run to end (or stop it)")
        assert tree(tmp_path) == before
    assert not (scratch / run_folder.LOCK_NAME).exists()  # released with the first run
    assert main(["train", *args]) == 0
    assert not (scratch / run_folder.LOCK_NAME).exists()
    written = {"checkpoints": "last-step000000004.ckpt", "tensorboard": "hparams.yaml"}[folder]
    assert (scratch / written).is_file()  # the run's files went where its link leads


def test_a_run_folder_that_links_out_of_the_runs_root_is_refused(tmp_path, capsys):
    runs, outside = tmp_path / "runs", tmp_path / "outside"
    runs.mkdir()
    outside.mkdir()
    (runs / "x").symlink_to(outside)
    args = tiny(tmp_path, "trainer.max_epochs=1")
    assert main(["train", *args, f"run.root={runs}", "run.name=x"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line == (f"muoneq: {runs / 'x'} is a symbolic link to {outside}, so a run named "
                    f"run.name=x would be written outside run.root={runs}; pass "
                    f"run.dir={runs / 'x'} to write there through the link, or remove the link")
    assert list(outside.iterdir()) == []
    assert main(["train", *args, f"run.dir={runs / 'x'}"]) == 0  # asked for: followed, said
    assert f"{runs / 'x'} is a symbolic link: the run writes to {outside}" in (
        capsys.readouterr().out)
    assert (outside / "metrics.json").is_file()


def _make_bad(bad: Path, kind: str) -> None:
    if kind == "file":
        bad.write_text("not a folder")
    elif kind == "dangling link":
        bad.symlink_to(bad.parent / "nowhere")
    else:
        bad.symlink_to(bad.parent / "loop")
        (bad.parent / "loop").symlink_to(bad)


@pytest.mark.parametrize("kind", ["file", "dangling link", "link loop"])
@pytest.mark.parametrize("where", ["run.root", "checkpoints"])
def test_a_run_root_or_checkpoints_that_is_no_folder_is_one_line(tmp_path, capsys, kind, where):
    if where == "run.root":
        bad = tmp_path / "runs"
        args, run = [f"run.root={bad}", "run.name=x"], bad / "x"
    else:
        run = tmp_path / "run"
        run.mkdir()
        args, bad = [f"run.dir={run}"], run / "checkpoints"
    _make_bad(bad, kind)
    assert main(["train", *tiny(tmp_path, "trainer.max_epochs=1", *args)]) == 2
    line = one_line(capsys.readouterr().err)
    what = {"file": "is a file, not a folder",
            "dangling link": f"is a symbolic link to {bad.parent / 'nowhere'}, which does not "
                             "exist",
            "link loop": "is a loop of symbolic links"}[kind]
    assert line.startswith(f"muoneq: {bad} {what}, so the run folder {run} cannot be written; ")
    keys = {"run.root": "run.root / run.name", "checkpoints": "run.dir"}[where]
    assert line.endswith(f", or choose another run folder ({keys})")
    assert not (bad.parent / "nowhere").exists()


def test_the_triton_backend_on_a_cpu_is_one_line_before_the_run_folder_is_written(
        tmp_path, capsys, monkeypatch):
    """optimizer.ns_backend=triton on a CPU (without Triton's interpreter) used to be a
    traceback, raised while the config was composed: no machine could even compose it, GPU
    machines included (the composition's check builds the optimizer on a CPU model)."""
    from muoneq import ns_triton

    monkeypatch.setattr(ns_triton, "_interpreted", lambda: False)  # as without TRITON_INTERPRET
    run = tmp_path / "run"
    args = tiny(tmp_path, "trainer.max_epochs=1", f"run.dir={run}", "optimizer.ns_backend=triton")
    assert compose(args).optimizer.ns_backend == "triton"  # composes anywhere
    assert main(["train", *args]) == 2
    assert one_line(capsys.readouterr().err) == (
        "muoneq: optimizer.ns_backend='triton': the kernels run on CUDA tensors, got cpu; set "
        "TRITON_INTERPRET=1 before importing muoneq to run them on CPU (slowly, for tests); or "
        "use optimizer.ns_backend=torch")
    assert not run.exists()


def test_a_setting_lightning_rejects_once_it_has_the_data_is_one_line(tmp_path, capsys):
    """trainer.limit_train_batches=0.00001 (of 4 batches: none) used to be Lightning's
    traceback, raised once fit had the data."""
    args = tiny(tmp_path, "trainer.max_epochs=1", f"run.dir={tmp_path / 'run'}",
                "trainer.limit_train_batches=0.00001")
    assert main(["train", *args]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("muoneq: trainer: You requested to check 1e-05 of the "
                           "`train_dataloader` but 1e-05 * 4 < 1")
    assert line.endswith("; fix that trainer setting")
    fixed = [a for a in args if not a.startswith("trainer.limit_train_batches")]
    assert main(["train", *fixed]) == 0  # the folder it left is no obstacle


def test_a_metrics_file_cut_by_a_kill_is_removed_on_resume(tmp_path, capsys):
    run = tmp_path / "run"
    args = tiny(tmp_path, "trainer.max_epochs=2", f"run.dir={run}")
    with pytest.raises(RuntimeError, match="stopped by the test"):
        train(compose(args), callbacks=[StopAt(5)])
    left = [run / ".metrics.json.31337.tmp", run / ".config.yaml.31337.tmp"]  # a SIGKILL's
    for path in left:
        path.write_text("{\"status\": \"fini")
    (run / "mine.tmp").write_text("not ours")
    assert main(["train", *args, "resume=auto"]) == 0
    assert not any(p.exists() for p in left) and (run / "mine.tmp").is_file()


@pytest.mark.parametrize("what", ["experiment file", "config.yaml", "metrics.json",
                                  "checkpoint checksum", "checkpoint", "read-only run.root"])
def test_a_file_or_folder_out_of_reach_is_one_line(tmp_path, capsys, deny, what):
    """An unreadable file or a read-only runs folder used to end in a traceback (or, for an
    unreadable config.yaml, in "not a run folder of muoneq train")."""
    experiment = tmp_path / "experiment.yaml"
    experiment.write_text((REPO / "conf" / "experiment" / "cifar10_resnet18.yaml").read_text())
    runs = tmp_path / "runs"
    args = [*tiny(tmp_path, "trainer.max_epochs=2", f"run.root={runs}", "run.name=x"),
            f"experiment={experiment}"]
    run = runs / "x"
    if what in ("config.yaml", "metrics.json"):
        assert main(["train", *args]) == 0
    elif what.startswith("checkpoint"):
        with pytest.raises(RuntimeError, match="stopped by the test"):
            train(compose(args), callbacks=[StopAt(6)])
    else:
        runs.mkdir()
    path = {"experiment file": experiment, "config.yaml": run / "config.yaml",
            "metrics.json": run / "metrics.json", "read-only run.root": runs,
            "checkpoint checksum": run / "checkpoints" / "last-step000000004.ckpt.sha256",
            "checkpoint": run / "checkpoints" / "last-step000000004.ckpt"}[what]
    deny(path)
    before = listing(tmp_path)
    capsys.readouterr()
    assert main(["train", *args, "resume=auto"]) == 2
    line = one_line(capsys.readouterr().err)
    where = path if what != "read-only run.root" else run
    assert line == (f"muoneq: {where}: permission denied (Permission denied); give your user "
                    "access to it (ls -l, chmod, chown), or choose another file or folder")
    assert listing(tmp_path) == before


def listing(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file's size and modification time (what changes when it is written)."""
    return {str(f.relative_to(folder)): (f.stat().st_size, f.stat().st_mtime_ns)
            for f in sorted(folder.rglob("*")) if f.is_file()}


# ----------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run: 3 epochs of 4 steps, every step's loss."""
    tmp = tmp_path_factory.mktemp("reference")
    torch.set_num_threads(1)
    losses = Losses()
    train(compose(tiny(tmp, "trainer.max_epochs=3", f"run.dir={tmp / 'run'}")), callbacks=[losses])
    return tmp, losses.by_step


def flip_a_tensor_byte(checkpoint: Path) -> None:
    """Flip one byte inside a tensor of the archive (the zip stays valid)."""
    with zipfile.ZipFile(checkpoint) as archive:
        info = max(archive.infolist(), key=lambda i: i.file_size)  # the largest tensor
        offset = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
        offset += info.file_size // 2
    data = bytearray(checkpoint.read_bytes())
    data[offset] ^= 0xFF
    checkpoint.write_bytes(bytes(data))


@pytest.mark.parametrize("checksums", [True, False], ids=["sha256", "crc32-only"])
def test_a_damaged_checkpoint_is_named_kept_and_skipped(reference, tmp_path, capsys, checksums):
    data_dir, reference_losses = reference
    run = tmp_path / "run"
    args = tiny(data_dir, "trainer.max_epochs=3", f"run.dir={run}",
                "trainer.checkpoint_every_n_steps=3")
    with pytest.raises(RuntimeError, match="stopped by the test"):
        train(compose(args), callbacks=[StopAt(8)])
    folder = run / "checkpoints"
    six = folder / "last-step000000006.ckpt"
    assert (folder / "last-step000000006.ckpt.sha256").read_text().split() == [
        ckpts._sha256(six), six.name]  # sha256sum's format
    saved = {p.name: p.read_bytes() for p in folder.glob("last-step000000006.ckpt*")}
    with pytest.raises(RuntimeError, match="stopped by the test"):
        train(compose([*args, "resume=auto"]), callbacks=[StopAt(11)])
    assert [p.name for _, p in ckpts.last_checkpoints(run)] == ["last-step000000009.ckpt"]
    # a kill between step 9's rename and the pruning of step 6 leaves both
    for name, data in saved.items():
        (folder / name).write_bytes(data)
    nine = folder / "last-step000000009.ckpt"
    flip_a_tensor_byte(nine)
    cut = folder / ".last-step000000010.ckpt.31337.tmp"  # a write a kill cut short
    Written(run).record("checkpoints", cut.name)  # listed before it was written, as a run does
    cut.write_bytes(b"a write cut short by a kill")
    damaged = nine.read_bytes()
    if not checksums:  # a checkpoint written before the checksums: torch's CRC-32s
        for p in folder.glob("*.sha256"):
            p.unlink()
    capsys.readouterr()

    losses = Losses()
    metrics = train(compose([*args, "resume=auto"]), callbacks=[losses])
    out = capsys.readouterr().out
    assert f"muoneq: note: {nine} is damaged (" in out
    assert "kept as last-step000000009.ckpt.damaged and the run resumes from " \
           "last-step000000006.ckpt" in out
    assert min(losses.by_step) == 7 and metrics["global_step"] == 12
    for step, loss in losses.by_step.items():
        assert loss == reference_losses[step], step
    assert (folder / "last-step000000009.ckpt.damaged").read_bytes() == damaged
    # the older resume points are pruned once a newer one is complete; the damaged one stays
    assert sorted(p.name for p in folder.iterdir()) == sorted([
        "last-step000000012.ckpt",
        "last-step000000012.ckpt.sha256", "last-step000000009.ckpt.damaged",
        *(["last-step000000009.ckpt.sha256.damaged"] if checksums else [])])


def stopped_at_step_7(data_dir: Path, run: Path, *extra: str) -> tuple[Path, list[str]]:
    """A run of 3 epochs (12 steps) saving every 2 steps, crashed at step 7: its checkpoints
    folder (step 6) and its arguments."""
    args = tiny(data_dir, "trainer.max_epochs=3", f"run.dir={run}",
                "trainer.checkpoint_every_n_steps=2", *extra)
    with pytest.raises(RuntimeError, match="stopped by the test"):
        train(compose(args), callbacks=[StopAt(7)])
    return run / "checkpoints", args


def test_a_checkpoint_of_another_run_or_of_another_step_is_refused(reference, tmp_path,
                                                                  capsys):
    """Another run's checkpoint (a valid checksum) placed in checkpoints/ used to resume
    silently, as did a checkpoint renamed to another step."""
    data_dir, _ = reference
    folder, args = stopped_at_step_7(data_dir, tmp_path / "mine")
    six, eight = folder / "last-step000000006.ckpt", folder / "last-step000000008.ckpt"
    six.rename(eight)  # this run's step 6, renamed
    ckpts.checksum_path(six).unlink()
    ckpts.checksum_path(eight).write_text(f"{ckpts._sha256(eight)}  {eight.name}\n")
    before = tree(tmp_path / "mine")
    capsys.readouterr()
    assert main(["train", *args, "resume=auto"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"muoneq: {eight} holds step 6, not the step 8 its name says")
    assert "move it out of checkpoints/ to resume from the previous checkpoint" in line
    assert tree(tmp_path / "mine") == before  # refused before anything was written

    other, _ = stopped_at_step_7(data_dir, tmp_path / "other", "optimizer.lr=0.01")
    for name in (eight.name, f"{eight.name}.sha256"):
        (folder / name).unlink()
    for name in (six.name, f"{six.name}.sha256"):
        (folder / name).write_bytes((other / name).read_bytes())
    assert main(["train", *args, "resume=auto"]) == 2
    assert one_line(capsys.readouterr().err).startswith(
        f"muoneq: {six} is a checkpoint of another run (fingerprint ")


def test_an_unstamped_checkpoint_is_refused_by_a_run_that_stamps(reference, tmp_path, capsys):
    """Another run's checkpoint without a stamp (a valid checksum, the right step) used to
    resume silently — the identity check was skipped for checkpoints without one — and the run
    finished on the other run's weights."""

    data_dir, _ = reference
    folder, args = stopped_at_step_7(data_dir, tmp_path / "mine")
    other, _ = stopped_at_step_7(data_dir, tmp_path / "other", "optimizer.lr=0.01")
    six = folder / "last-step000000006.ckpt"
    saved = torch.load(other / six.name, map_location="cpu", weights_only=False)
    del saved[ckpts.STAMP_KEY]  # as an older version wrote it
    torch.save(saved, six)
    ckpts.checksum_path(six).write_text(f"{ckpts._sha256(six)}  {six.name}\n")
    before = tree(tmp_path / "mine")
    capsys.readouterr()
    assert main(["train", *args, "resume=auto"]) == 2
    assert one_line(capsys.readouterr().err) == (
        f"muoneq: {six} carries no stamp of its run, and every checkpoint this run saves has "
        "one (config.yaml says stamped_checkpoints: true): another run saved it, or a version "
        "of muoneq that stamped none, and it was copied in; move it out of checkpoints/ to "
        "resume from the previous checkpoint, or start the run again in another folder "
        "(another run.dir or run.name)")
    assert tree(tmp_path / "mine") == before


def _unstamped(source: Path, target: Path) -> None:
    """Write the checkpoint ``source`` without its stamp (as a version that stamped none wrote
    it) to ``target``, with a valid checksum."""
    saved = torch.load(source, map_location="cpu", weights_only=False)
    saved.pop(ckpts.STAMP_KEY, None)
    torch.save(saved, target)
    ckpts.checksum_path(target).write_text(f"{ckpts._sha256(target)}  {target.name}\n")


def test_an_unstamped_checkpoint_of_another_run_is_refused_by_an_older_run(reference, tmp_path,
                                                                          capsys):
    """A run folder written by a version that stamped no checkpoint (its config.yaml without
    stamped_checkpoints) resumed silently from another run's unstamped checkpoint (val/ppl
    20.94 instead of 27.80, exit 0). What can be checked without a stamp is: the optimizer's
    hyper-parameters against the config, the weights' shapes, the step against the budget and
    the checkpoints the run resumed from; its own unstamped checkpoint still resumes."""
    import yaml

    data_dir, _ = reference
    folder, args = stopped_at_step_7(data_dir, tmp_path / "mine")
    config = tmp_path / "mine" / "config.yaml"
    record = yaml.safe_load(config.read_text())
    del record["provenance"]["stamped_checkpoints"]
    config.write_text(yaml.safe_dump(record))
    six = folder / "last-step000000006.ckpt"
    own = tmp_path / "own.ckpt"
    _unstamped(six, own)
    how = ": another run saved it; move it out of checkpoints/ to resume from the previous "
    others = {
        "lr": ("optimizer.lr=0.01", 7, "its optimizer's param group 'muon' was saved with "
                                       "lr=0.01, where this run's config gives 0.05"),
        "width": ("task.model.width=8", 7, "its weight model.conv1.weight has the shape "
                                           "[8, 3, 3, 3], where this run's model has [4, 3, 3, 3]"),
        "longer": ("trainer.max_epochs=6", 19, "it holds epoch 4, past this run's "
                                               "trainer.max_epochs=3"),
    }
    for name, (override, stop, why) in others.items():
        other = tmp_path / name
        args_other = tiny(data_dir, "trainer.max_epochs=3", f"run.dir={other}",
                          "trainer.checkpoint_every_n_steps=2", override)
        with pytest.raises(RuntimeError, match="stopped by the test"):
            train(compose(args_other), callbacks=[StopAt(stop)])
        for path in folder.glob("last-step*"):
            path.unlink()
        (theirs,) = (other / "checkpoints").glob("last-step*.ckpt")
        planted = folder / theirs.name
        _unstamped(theirs, planted)
        before = tree(tmp_path / "mine")
        capsys.readouterr()
        assert main(["train", *args, "resume=auto"]) == 2, name
        assert one_line(capsys.readouterr().err) == (
            f"muoneq: {planted} carries no stamp of its run (the run was started by a version of "
            f"muoneq that stamped none), and {why}{how}checkpoint, or start the run again in "
            "another folder (another run.dir or run.name)")
        assert tree(tmp_path / "mine") == before
    for path in folder.glob("last-step*"):
        path.unlink()
    _unstamped(own, six)
    # its own checkpoint of step 6, where config.yaml says a session resumed from step 8
    record["provenance"]["resumed"] = [{"from_checkpoint": "last-step000000008.ckpt"}]
    config.write_text(yaml.safe_dump(record))
    assert main(["train", *args, "resume=auto"]) == 2
    assert "and it holds step 6, before step 8, which this run already resumed from (its " \
           "config.yaml): another run saved it" in one_line(capsys.readouterr().err)
    record["provenance"]["resumed"] = []
    config.write_text(yaml.safe_dump(record))
    assert main(["train", *args, "resume=auto"]) == 0  # its own unstamped checkpoint
    assert "resuming" in capsys.readouterr().out


def test_a_best_checkpoint_is_removed_once_a_session_without_save_best_beats_it(tmp_path,
                                                                               capsys):
    """A run resumed with trainer.save_best=false used to keep the best.ckpt of its first
    session (step 3) while metrics.json said the best was at a later step."""
    run = tmp_path / "run"
    args = [*TINY_RUNS["language"](tmp_path), "experiment=llama_tiny_shakespeare",
            "task.val_every_n_steps=3", "trainer.max_steps=8", "schedule.warmup_steps=0",
            "trainer.checkpoint_every_n_steps=2", f"run.dir={run}"]
    with pytest.raises(RuntimeError, match="stopped by the test"):
        train(compose(args), callbacks=[StopAt(5)])  # validated at step 3, saved at step 4
    best = run / "checkpoints" / "best.ckpt"
    assert torch.load(best, map_location="cpu", weights_only=False)["global_step"] == 3
    capsys.readouterr()
    metrics = train(compose([*args, "resume=auto", "trainer.save_best=false"]))
    losses = scalars(run)["val/loss"]
    best_step = min(losses, key=lambda point: point[1])[0]
    assert best_step > 3 and metrics["best"] == pytest.approx(min(v for _, v in losses))
    assert not best.exists() and not ckpts.checksum_path(best).exists()
    assert (f"muoneq: note: {best} removed: it held an earlier best of the run, and val/loss "
            "is better at step 6, which trainer.save_best=false does not save"
            ) in capsys.readouterr().out


def test_a_resume_on_changed_data_is_refused_unless_accepted(tmp_path, capsys):
    """A paused run whose shard folder was extended with `muoneq data --tokens` (as the docs
    describe) used to resume silently, ending on neither data's result."""
    import yaml

    from tests.helpers.language import make_documents, tiny_tiktoken_file, write_corpus

    corpus = write_corpus(tmp_path, "txt", make_documents(400))
    tokenizer = tiny_tiktoken_file(tmp_path / "tiny.tiktoken")
    shards = tmp_path / "shards"

    def prepare(tokens: int) -> None:
        assert main(["data", "--source", str(corpus), "--out", str(shards), "--tokenizer",
                     str(tokenizer), "--val-tokens", "128", "--shard-tokens", "2000",
                     "--tokens", str(tokens), "--workers", "1"]) == 0

    prepare(3000)
    run = tmp_path / "run"
    args = ["experiment=llama_tiny_shakespeare", f"task.data.dir={shards}",
            f"task.data.tokenizer={tokenizer}", "task.data.seq_len=32", "task.data.batch_size=4",
            "task.data.micro_batch_size=2", "task.data.val_tokens=64", "task.model.size=tiny",
            "task.val_every_n_steps=3", "trainer.max_steps=6", "schedule.warmup_steps=0",
            "trainer.checkpoint_every_n_steps=2", "trainer.progress=quiet", f"run.dir={run}"]
    with pytest.raises(RuntimeError, match="stopped by the test"):
        train(compose(args), callbacks=[StopAt(3)])
    prepare(6000)  # more training tokens in the same folder
    capsys.readouterr()
    assert main(["train", *args, "resume=auto"]) == 2
    err = capsys.readouterr().err
    line = one_line(err)
    assert line == (f"muoneq: {run}: the data changed since last-step000000002.ckpt was saved "
                    "(below), so resuming would train the rest of the run on other data than "
                    "its start; restore the data, or continue on the new data knowingly with "
                    "run.accept_changed_data=true (its config.yaml records the session), or "
                    "start the run again in another folder")
    details = [x.strip() for x in err.splitlines()[1:]]
    assert details[0].startswith("prepare.json: ") and " → " in details[0]
    assert details[1:] == ["train: data_train_000001.bin 3024 → 5024 bytes",
                           "train: data_train_000002.bin added (5024 bytes)"]
    assert main(["train", *args, "resume=auto", "run.accept_changed_data=true"]) == 0
    assert (f"muoneq: note: {run} continues on changed data (run.accept_changed_data=true): "
            "prepare.json: ") in capsys.readouterr().out
    session = yaml.safe_load((run / "config.yaml").read_text())["provenance"]["resumed"][-1]
    assert "run.accept_changed_data: false → true" in session["changed"]
    assert main(["train", *args, "resume=auto"]) == 0  # finished: its result is read back


def stopped_at_step_3(data_dir: Path, tmp_path: Path) -> tuple[Path, list[str], Path]:
    """A run of one epoch (4 steps) saving every 2 steps, crashed at step 3: its folder, its
    arguments and its one checkpoint (step 2)."""
    run = tmp_path / "run"
    args = tiny(data_dir, "trainer.max_epochs=1", f"run.dir={run}",
                "trainer.checkpoint_every_n_steps=2")
    with pytest.raises(RuntimeError, match="stopped by the test"):
        train(compose(args), callbacks=[StopAt(3)])
    return run, args, run / "checkpoints" / "last-step000000002.ckpt"


def test_every_damaged_checkpoint_is_kept_when_the_run_starts_over(reference, tmp_path, capsys):
    run, args, two = stopped_at_step_3(reference[0], tmp_path)
    two.write_bytes(two.read_bytes()[:-100])  # cut short
    assert main(["train", *args]) == 2  # resume=never still refuses a folder with checkpoints
    assert "pass resume=auto" in one_line(capsys.readouterr().err)
    assert main(["train", *args, "resume=auto"]) == 0
    out = capsys.readouterr().out
    assert "no intact checkpoint is left: the run starts over" in out
    assert (run / "checkpoints" / "last-step000000002.ckpt.damaged").is_file()
    assert json.loads((run / "metrics.json").read_text())["global_step"] == 4


@pytest.mark.parametrize("content", ["", "0123abcd  last-step000000002.ckpt\n"],
                         ids=["empty", "malformed"])
def test_an_empty_or_malformed_checksum_file_is_a_damaged_checkpoint(reference, tmp_path, capsys,
                                                                    content):
    """A power cut during the checksum's write left it empty: the flipped bit it would have
    caught loaded silently, and the run finished with wrong weights."""
    run, args, two = stopped_at_step_3(reference[0], tmp_path)
    flip_a_tensor_byte(two)
    ckpts.checksum_path(two).write_text(content)
    what = "empty" if not content else "malformed"
    assert ckpts.damage(two).startswith(f"its checksum file {two.name}.sha256 is {what} (")
    capsys.readouterr()
    assert main(["train", *args, "resume=auto"]) == 0
    out = capsys.readouterr().out
    assert f"muoneq: note: {two} is damaged (its checksum file" in out
    assert "no intact checkpoint is left: the run starts over" in out
    assert (run / "checkpoints" / "last-step000000002.ckpt.damaged").is_file()


def test_a_checksum_file_in_sha256sums_binary_mode_is_read(tmp_path):
    """A .sha256 made by hand with `sha256sum -b` (`<hash> *<name>`) used to be called
    malformed, and its intact checkpoint set aside as damaged."""
    target = tmp_path / "last-step000000001.ckpt"
    ChecksummedCheckpointIO().save_checkpoint({"w": torch.ones(3)}, target)
    listed = subprocess.run(["sha256sum", "-b", target.name], cwd=tmp_path, check=True,
                            capture_output=True, text=True).stdout
    assert listed.endswith(f" *{target.name}\n")
    ckpts.checksum_path(target).write_text(listed)
    assert ckpts.damage(target) is None
    flip_a_tensor_byte(target)
    assert ckpts.damage(target) == (f"the SHA-256 of {target.name} differs from the one in "
                                    f"{target.name}.sha256")


def test_the_checksum_is_on_the_disk_before_the_checkpoint_counts(tmp_path, monkeypatch):
    """The checksum file is synced and renamed into place, and that rename synced, before the
    checkpoint's own rename makes it a resume point."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    target = tmp_path / "last-step000000001.ckpt"
    ChecksummedCheckpointIO().save_checkpoint({"w": torch.ones(3)}, target)
    sums = str(ckpts.checksum_path(target))
    sums_synced = next(i for i, (kind, path) in enumerate(events)
                       if kind == "fsync" and path.endswith(".tmp") and ".sha256." in path)
    sums_renamed = events.index(("replace", sums))
    folder_synced = events.index(("fsync", str(tmp_path)), sums_renamed)
    assert sums_synced < sums_renamed < folder_synced < events.index(("replace", str(target)))
    assert ckpts.damage(target) is None


def test_checkpoint_io_writes_in_place_and_leaves_nothing_on_failure(tmp_path, monkeypatch):
    io = ChecksummedCheckpointIO()
    target = tmp_path / "best.ckpt"
    # no temporary file under $TMPDIR: the rename stays on the checkpoint's file system
    monkeypatch.setenv("TMPDIR", str(tmp_path / "no-such-folder"))
    monkeypatch.setattr("tempfile.tempdir", None)
    io.save_checkpoint({"w": torch.arange(10.0)}, target)
    old = target.read_bytes()
    assert torch.equal(io.load_checkpoint(target)["w"], torch.arange(10.0))

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpts._HashingWriter, "write", full)
    with pytest.raises(DiskFull, match=r"no space left on the disk holding .*best\.ckpt"):
        io.save_checkpoint({"w": torch.zeros(10)}, target)
    assert target.read_bytes() == old and ckpts.damage(target) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.ckpt", "best.ckpt.sha256"]


def test_a_checkpoint_that_cannot_be_loaded_is_one_line(tmp_path):
    path = tmp_path / "x.ckpt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02garbage")
    with pytest.raises(CheckpointError) as err:
        ChecksummedCheckpointIO().load_checkpoint(path)
    assert str(err.value).startswith(f"{path} cannot be loaded (")
    assert "weights_only" not in str(err.value) and "\n" not in str(err.value)


def test_a_full_disk_while_training_is_one_line_and_resumable(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    args = tiny(tmp_path, "trainer.max_epochs=2", f"run.dir={run}")
    real_init, real_write = ckpts._HashingWriter.__init__, ckpts._HashingWriter.write
    opened = []

    def counting_init(self, file):
        opened.append(file.name)
        real_init(self, file)

    def fills_up(self, data):
        if len(opened) > 1:  # the second checkpoint (step 8) does not fit
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, data)

    monkeypatch.setattr(ckpts._HashingWriter, "__init__", counting_init)
    monkeypatch.setattr(ckpts._HashingWriter, "write", fills_up)
    assert main(["train", *args]) == 4
    line = one_line(capsys.readouterr().err)
    assert line.startswith("muoneq: no space left on the disk holding "
                           f"{run / 'checkpoints' / 'last-step000000008.ckpt'} (")
    assert line.endswith("GiB free); free space there (old runs, checkpoints) or write to a "
                         "larger disk; then continue the run with resume=auto")
    assert not list(run.rglob("*.tmp")) and ckpts.resume_point(run) == (
        run / "checkpoints" / "last-step000000004.ckpt", [])
    monkeypatch.setattr(ckpts._HashingWriter, "write", real_write)
    assert main(["train", *args, "resume=auto"]) == 0
    assert "resuming" in capsys.readouterr().out


def _on_small_disk(tmp_path: Path, disk: Path, args: list[str], *, free: int,
                   resume: bool = True) -> list[tuple[int, str, list[str]]]:
    """Run ``muoneq train args`` with ``disk`` a tmpfs filled to leave ``free`` bytes (and, with
    ``resume``, again with ``resume=auto`` once the disk has room); each run's status, stderr
    and what ``disk`` held after it."""
    command = shlex.join([sys.executable, "-m", "muoneq", "train", *args])
    runs = [f"{command} > /dev/null 2> {tmp_path}/0.err; echo \"status $?\"",
            'ls -A "$DISK" | grep -v "^.filler$" | tr "\\n" " "; echo']
    if resume:
        runs += ['rm "$DISK/.filler"',
                 f"{command} resume=auto > /dev/null 2> {tmp_path}/1.err; echo \"status $?\"",
                 'ls -A "$DISK" | tr "\\n" " "; echo']
    done = small_disk.run(disk, "\n".join(runs), free=free,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == 2 + 2 * resume, done.stdout + done.stderr
    return [(int(lines[2 * i].split()[1]), (tmp_path / f"{i}.err").read_text(),
             lines[2 * i + 1].split()) for i in range(1 + resume)]


@pytest.mark.slow
def test_a_real_full_disk_during_a_checkpoint_is_one_line_exit_4_and_resumable(tmp_path):
    """checkpoints/ on a scratch disk that fills up (a real tmpfs with 8 KiB left, a checkpoint
    is ~21 KiB) used to end in a traceback and exit 1 — torch's zip writer replaces the ENOSPC
    with "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos" — which a
    sweep retried as a failure."""
    run, disk = tmp_path / "run", tmp_path / "scratch"
    run.mkdir()
    disk.mkdir()
    (run / "checkpoints").symlink_to(disk)
    args = tiny(tmp_path, "trainer.max_epochs=2", f"run.dir={run}", "task.model.width=32")
    (status, err, left), (again, err_again, kept) = _on_small_disk(tmp_path, disk, args,
                                                                   free=65536)
    assert status == 4, err[-3000:]
    line = one_line(err)
    assert line.startswith("muoneq: no space left on the disk holding "
                           f"{disk / 'last-step000000004.ckpt'} (0.00 GiB free); ")  # where it is
    assert line.endswith("; then continue the run with resume=auto")
    assert left == []  # nothing half-written stays
    assert again == 0, err_again[-3000:]
    assert kept == ["last-step000000008.ckpt", "last-step000000008.ckpt.sha256"]


@pytest.mark.slow
def test_a_real_full_disk_while_the_tensorboard_file_is_created_is_one_line_exit_4(tmp_path):
    """tensorboard/ on a disk that is full (a real tmpfs) used to end in two tracebacks —
    TensorBoard's writer thread's, then the run's — and exit 1."""
    run, disk = tmp_path / "run", tmp_path / "logs"
    args = tiny(tmp_path, "trainer.max_epochs=1", f"run.dir={run}")
    with pytest.raises(RuntimeError, match="stopped by the test"):
        train(compose(args), callbacks=[StopAt(2)])  # an attempt that left no checkpoint
    shutil.rmtree(run / "tensorboard")
    disk.mkdir()
    (run / "tensorboard").symlink_to(disk)  # the curves go to a disk of their own
    [(status, err, left)] = _on_small_disk(  # the lock file's page: the run holds the folder
        tmp_path, disk, args, free=4096, resume=False)
    assert status == 4, err[-3000:]
    line = one_line(err)  # and no thread's traceback
    assert line.startswith(f"muoneq: no space left on the disk holding {run / 'tensorboard'}")
    assert line.endswith(" GiB free); free space there (old runs, checkpoints) or write to a "
                         "larger disk; then continue the run with resume=auto")
    assert all(name.startswith("events.out.tfevents.") for name in left)  # created, then full


# ----------------------------------------------------------------------------- results
def test_a_damaged_metrics_json_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    args = tiny(tmp_path, "trainer.max_epochs=1", f"run.dir={run}")
    assert main(["train", *args]) == 0
    text = (run / "metrics.json").read_text()
    (run / "metrics.json").write_text(text[: len(text) // 2])
    capsys.readouterr()
    assert main(["train", *args, "resume=auto"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"muoneq: {run / 'metrics.json'} is damaged (JSONDecodeError")
    assert "delete it and run again with resume=auto" in line


@pytest.mark.parametrize("patience", [0, 2])
def test_divergence_stops_the_run_and_says_so(tmp_path, capsys, patience):
    run = tmp_path / "run"
    common = ["trainer.max_epochs=3", "optimizer.lr=1e30"]
    args = tiny(tmp_path, *common, f"run.dir={run}", f"trainer.divergence_patience={patience}")
    # where the loss stops being finite, from a run that is not stopped
    probe = Losses()
    train(compose(tiny(tmp_path, *common, f"run.dir={tmp_path / 'probe'}",
                       "trainer.divergence_patience=null")), callbacks=[probe])
    first = min(s for s, v in probe.by_step.items() if not torch.isfinite(torch.tensor(v)))
    assert all(not torch.isfinite(torch.tensor(v)) for s, v in probe.by_step.items() if s > first)

    assert main(["train", *args]) == 3
    line = one_line(capsys.readouterr().err)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["status"] == "diverged" and metrics["final"] is None
    assert metrics["diverged_at_step"] == first + patience < 12
    # read at the next step that logs, validates or saves a checkpoint: here the epoch's end,
    # where the last checkpoint is saved (4 steps an epoch; logging every 50)
    assert metrics["global_step"] == -(-(first + patience) // 4) * 4
    assert metrics["diverged"].startswith("the training loss is not finite (")
    assert line == (f"muoneq: {run} diverged at step {first + patience}: {metrics['diverged']}; "
                    "its metrics.json says \"status\": \"diverged\" (lower optimizer.lr, or "
                    "raise trainer.divergence_patience to tolerate isolated non-finite values)")
    assert not ckpts.last_checkpoints(run)  # no non-finite weights saved as a resume point
    # resume=auto reads the verdict back: the same line and status, nothing trained
    before = tree(run)
    assert main(["train", *args, "resume=auto"]) == 3
    assert one_line(capsys.readouterr().err) == line and tree(run) == before


def test_a_non_finite_validation_metric_stops_the_run():
    from types import SimpleNamespace

    from muoneq.suite.runtime.callbacks import Divergence, Stop

    trainer = SimpleNamespace(
        sanity_checking=False, state=SimpleNamespace(fn="fit"), global_step=7,
        callback_metrics={"val/loss": torch.tensor(float("inf"))},
        strategy=SimpleNamespace(reduce_boolean_decision=lambda flag, all: flag))
    guard = Divergence(patience=1, monitor="val/loss")
    guard.on_validation_end(trainer, None)  # tolerated once
    with pytest.raises(Stop) as stop:
        guard.on_validation_end(trainer, None)
    assert (stop.value.step, stop.value.what) == (7, "val/loss is not finite (inf)")
    trainer.callback_metrics["val/loss"] = torch.tensor(2.0)
    guard.on_validation_end(trainer, None)
    assert guard.in_a_row == 0  # "in a row": a finite value starts the count again


def test_divergence_can_be_switched_off(tmp_path):
    metrics = train(compose(tiny(tmp_path, "trainer.max_epochs=1", f"run.dir={tmp_path / 'r'}",
                                 "optimizer.lr=1e30", "trainer.divergence_patience=null")))
    assert metrics["status"] == "finished" and metrics["global_step"] == 4
    with pytest.raises(ConfigError, match=r"trainer\.divergence_patience: must be ≥ 0"):
        compose(tiny(tmp_path, "trainer.divergence_patience=-1"))


# ----------------------------------------------------------------------------- signals
def signal_mid_run(args: list[str], tmp_path: Path, signum: int, *, group: bool = False):
    """Run ``muoneq train args`` (logging every step), send ``signum`` once it has done 6
    steps (to its whole process group with ``group``, as SLURM does); return the last step it
    printed, its exit status, its one-line message and the step that message names."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = (tmp_path / "stderr.txt").open("w+")
    process = subprocess.Popen([sys.executable, "-m", "muoneq", "train", *args,
                                "trainer.progress=log", "trainer.log_every_n_steps=1"],
                               env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                               start_new_session=group)
    seen = 0
    for line in process.stdout:
        if line.startswith("epoch ") and " step " in line:
            seen = int(line.split()[3].split("/")[0])
            if seen >= 6:
                break
    if group:
        os.killpg(process.pid, signum)
    else:
        process.send_signal(signum)
    process.communicate(timeout=120)
    log.seek(0)
    err = log.read()
    assert process.returncode == 128 + signum, err[-2000:]
    name = signal.Signals(signum).name
    line = one_line("\n".join(x for x in err.splitlines() if f"stopped by {name}" in x
                               or "Traceback" in x))  # other ranks: "a signal on another rank"
    step = int(line.split(" after step ")[1].split(",")[0])
    assert seen <= step < seen + 5  # the step it was at (a few more may have run meanwhile)
    return line, step


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_saves_the_current_step_and_says_how_to_continue(tmp_path, signum):
    """A real process gets SIGINT (Ctrl-C) or SIGTERM (SLURM) mid-epoch: it saves the step it
    is at, exits 130/143 with the command that continues it, and that command continues the
    uninterrupted run's trajectory exactly."""
    epochs = 20  # 80 steps, long enough to be signalled mid-run
    args = tiny(tmp_path, f"trainer.max_epochs={epochs}", f"run.dir={tmp_path / 'run'}")
    line, step = signal_mid_run(args, tmp_path, signum)
    assert (tmp_path / "run" / "checkpoints" / f"last-step{step:09d}.ckpt").is_file()
    command = line.split("continue it with: ")[1]
    words = shlex.split(command)
    assert words[:2] == ["muoneq", "train"] and words[-1] == "resume=auto"
    assert not (tmp_path / "run" / "metrics.json").exists()

    losses = Losses()
    train(compose(words[2:]), callbacks=[losses])
    assert min(losses.by_step) == step + 1  # nothing redone: at most the current step lost
    reference = Losses()
    train(compose(tiny(tmp_path, f"trainer.max_epochs={epochs}", f"run.dir={tmp_path / 'ref'}",
                       "trainer.progress=quiet")), callbacks=[reference])
    for s, loss in losses.by_step.items():
        assert loss == reference.by_step[s], s


class SignalAt(L.Callback):
    """Send ``signum`` to this process when the first batch of an evaluation starts (``fn``:
    fit, validate or test) at optimizer step ``step``."""

    def __init__(self, signum: int, fn: str, step: int) -> None:
        self.signum, self.fn, self.step, self.sent = signum, fn, step, False

    def _send(self, trainer) -> None:
        if not self.sent and trainer.state.fn == self.fn and trainer.global_step == self.step:
            self.sent = True
            os.kill(os.getpid(), self.signum)

    def on_validation_batch_start(self, trainer, *args) -> None:
        self._send(trainer)

    def on_test_batch_start(self, trainer, *args) -> None:
        self._send(trainer)


@pytest.fixture(scope="module")
def finished_runs(tmp_path_factory):
    """Uninterrupted runs of 3 and 4 steps with a validation set (3 steps per epoch)."""
    tmp = tmp_path_factory.mktemp("finished")
    torch.set_num_threads(1)
    return tmp, {steps: train(compose(tiny(tmp, "task.data.val_size=8",
                                           f"trainer.max_steps={steps}",
                                           f"run.dir={tmp / str(steps)}")))
                 for steps in (3, 4)}


@pytest.mark.parametrize(("signum", "fn", "steps"), [
    (signal.SIGTERM, "fit", 3), (signal.SIGTERM, "validate", 4), (signal.SIGTERM, "test", 4),
    (signal.SIGINT, "validate", 4)],
    ids=["SIGTERM-last-validation-of-the-fit", "SIGTERM-final-validation", "SIGTERM-test",
         "SIGINT-final-validation"])
def test_a_signal_after_the_last_step_is_an_interruption(finished_runs, tmp_path, signum, fn,
                                                         steps):
    """SIGTERM during the final validation used to exit 0 with no metrics.json and no message
    (Lightning's SIGTERM handler ends with a SystemExit of status 0): a scheduler counted an
    unfinished run as done."""
    data_dir, reference = finished_runs
    run = tmp_path / "run"
    args = tiny(data_dir, "task.data.val_size=8", f"trainer.max_steps={steps}",
                f"run.dir={run}")
    with pytest.raises(Interrupted) as err:
        train(compose(args), callbacks=[SignalAt(signum, fn, steps)])
    assert err.value.exit_code == 128 + signum
    assert (f"training of {run} stopped by {signal.Signals(signum).name} during its final "
            f"validation or test after step {steps}, saved as "
            f"checkpoints/last-step{steps:09d}.ckpt; continue it with: ") in str(err.value)
    assert not (run / "metrics.json").exists()
    metrics = train(compose([*args, "resume=auto"]))  # the evaluation is done again
    for key in ("final", "best", "test/acc", "global_step"):
        assert metrics[key] == reference[steps][key], key


class CtrlCTwice(L.Callback):
    """Ctrl-C pressed twice at optimizer step ``step`` (the first handled before the second)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGINT)  # Python runs the handler as kill returns
            os.kill(os.getpid(), signal.SIGINT)


def test_a_second_ctrl_c_stops_at_once_with_130_and_how_to_continue(tmp_path, capsys):
    """A second Ctrl-C used to raise KeyboardInterrupt, which Lightning ends with its own
    message and sys.exit(1): a stopped run looked failed."""
    run = tmp_path / "run"
    args = tiny(tmp_path, "trainer.max_epochs=3", f"run.dir={run}")
    with pytest.raises(Interrupted) as err:
        train(compose(args), callbacks=[CtrlCTwice(5)], argv=args)
    assert err.value.exit_code == 130
    assert str(err.value) == (
        f"training of {run} stopped at once by a second SIGINT (Ctrl-C) at step 5, before the "
        "step could be saved; continue it from its last checkpoint with: "
        f"{shlex.join(['muoneq', 'train', *args, 'resume=auto'])}")
    assert "Detected KeyboardInterrupt" not in capsys.readouterr().out
    assert not (run / "metrics.json").exists() and ckpts.resume_point(run) == (
        run / "checkpoints" / "last-step000000004.ckpt", [])
    assert train(compose([*args, "resume=auto"]))["global_step"] == 12


def test_a_distributed_checkpoint_folder_is_checked_file_by_file(tmp_path):
    folder = tmp_path / "checkpoints" / "last-step000000004.ckpt"
    folder.mkdir(parents=True)
    for name in ("__0_0.distcp", "__1_0.distcp", "meta.pt", ".metadata"):
        (folder / name).write_bytes(name.encode() * 100)
    ckpts.record_folder_checksums(folder)
    assert ckpts.damage(folder) is None
    shard = folder / "__1_0.distcp"
    shard.write_bytes(b"X" + shard.read_bytes()[1:])
    assert ckpts.damage(folder) == (
        "the SHA-256 of last-step000000004.ckpt/__1_0.distcp differs from the one in "
        "last-step000000004.ckpt.sha256")
    shard.unlink()
    assert ckpts.damage(folder) == "last-step000000004.ckpt/__1_0.distcp is missing"


@pytest.mark.slow
def test_sigterm_to_every_process_with_loader_workers_still_saves(tmp_path):
    """SLURM signals every process of a job, the loader workers too: they keep serving until
    the main process has finished its step and saved it."""
    args = tiny(tmp_path, "trainer.max_epochs=20", f"run.dir={tmp_path / 'run'}",
                "task.data.num_workers=2")
    _, step = signal_mid_run(args, tmp_path, signal.SIGTERM, group=True)
    assert ckpts.resume_point(tmp_path / "run") == (
        tmp_path / "run" / "checkpoints" / f"last-step{step:09d}.ckpt", [])


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ddp_processes_stop_together(tmp_path):
    """Divergence and a signal that reaches rank 0 only stop both processes at the same step
    (the callbacks decide together), with the same outcome as one process."""
    ddp = ["trainer.accelerator=cpu", "trainer.devices=2", "trainer.strategy=ddp"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = tmp_path / "diverged"
    done = subprocess.run([sys.executable, "-m", "muoneq", "train",
                           *tiny(tmp_path, *ddp, "trainer.max_epochs=4", f"run.dir={run}",
                                 "optimizer.lr=1e30")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stderr[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["status"] == "diverged" and metrics["world_size"] == 2
    line = one_line(done.stderr, ranks=2)
    assert f"diverged at step {metrics['diverged_at_step']}: " in line

    args = tiny(tmp_path, *ddp, "trainer.max_epochs=40", f"run.dir={tmp_path / 'run'}")
    _, step = signal_mid_run(args, tmp_path, signal.SIGTERM)  # to rank 0 only
    assert ckpts.resume_point(tmp_path / "run") == (
        tmp_path / "run" / "checkpoints" / f"last-step{step:09d}.ckpt", [])
