"""Fault injection on sweeps: a journal cut mid-record (at every byte of its last record), a
journal appended onto a cut record, a malformed sweep file, a full disk in a worker thread, a
trial that diverged, Ctrl-C on a running sweep."""

from __future__ import annotations

import errno
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from muoneq.suite.errors import DiskFull
from muoneq.suite.sweeps import Driver, SweepError, launch, load_sweep
from muoneq.suite.sweeps.storage import JournalError, open_storage
from muoneq.suite.sweeps.trial_record import TrialRecord
from muoneq.suite.sweeps.verdict import judge
from tests.helpers.commands import clean_env
from tests.helpers.sweeps import OBJECTIVE, load, options, write_sweep


def trials_of(storage) -> list[tuple]:
    study = optuna.load_study(study_name="s", storage=storage)
    return [(t.number, t.state, t.params, t.values, t.user_attrs) for t in study.get_trials()]


@pytest.fixture(scope="module")
def journal(tmp_path_factory) -> tuple[bytes, int]:
    """A study's journal (3 trials; the last record completes the third) and the offset where
    its last record starts."""
    path = tmp_path_factory.mktemp("journal") / "optuna.journal"
    study = optuna.create_study(study_name="s",
                                storage=JournalStorage(JournalFileBackend(str(path))))
    for i in range(3):
        trial = study.ask({"lr": optuna.distributions.FloatDistribution(1e-4, 1, log=True)})
        trial.set_user_attr("run_key", f"lr={trial.params['lr']:.3g}")
        study.tell(trial, 0.1 * i)
    data = path.read_bytes()
    return data, data.rstrip(b"\n").rfind(b"\n") + 1


def test_a_journal_cut_at_any_byte_of_its_last_record_is_repaired(journal, tmp_path, capsys):
    data, start = journal
    path = tmp_path / "optuna.journal"
    path.write_bytes(data[:start])
    before = trials_of(open_storage(f"journal:{path}", tmp_path))  # without the last record
    path.write_bytes(data)
    whole = trials_of(open_storage(f"journal:{path}", tmp_path))
    assert before != whole and whole[-1][1] == TrialState.COMPLETE
    capsys.readouterr()
    for cut in range(start, len(data)):
        path.write_bytes(data[:cut])
        storage = open_storage(f"journal:{path}", tmp_path)
        err = capsys.readouterr().err
        if cut == start:  # a cut between records: nothing to repair
            assert err == ""
        else:
            assert err == (f"muoneq: note: {path}: dropped a last record cut short by a crash or "
                           f"a full disk ({cut - start} bytes, an operation that never "
                           "completed)\n"), cut
        assert path.read_bytes() == data[:start], cut
        assert trials_of(storage) == before, cut
    # the repaired study goes on: the next driver's records are read back
    study = optuna.load_study(study_name="s", storage=storage)
    study.tell(study.ask(), 1.0)
    assert len(trials_of(open_storage(f"journal:{path}", tmp_path))) == len(before) + 1


def test_a_cut_record_that_was_appended_onto_is_refused_with_the_fix(journal, tmp_path):
    data, start = journal
    path = tmp_path / "optuna.journal"
    last = data[start:]
    path.write_bytes(data[:start] + last[:25] + last)  # the old behaviour: appended onto a cut
    with pytest.raises(JournalError) as err:
        open_storage(f"journal:{path}", tmp_path)
    line = data[:start].count(b"\n") + 1
    message = str(err.value)
    assert message.startswith(f"{path}: line {line} is not a whole Optuna journal record")
    command = message.split("remove that line to recover every other record: ")[1]
    assert command == f"sed -i '{line}d' {shlex.quote(str(path))}"
    subprocess.run(shlex.split(command), check=True)
    assert trials_of(open_storage(f"journal:{path}", tmp_path))[:-1] == trials_of(
        JournalStorage(JournalFileBackend(str(_write(tmp_path / "ref", data))))
    )[:-1]


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_a_malformed_sweep_file_is_one_line(tmp_path, capsys):
    from muoneq.suite.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("study: x\ngrid:\n  - optimizer: [muon\n    lr: 1\n")
    with pytest.raises(SweepError) as err:
        load_sweep(bad)
    assert str(err.value).startswith(f"{bad}: line 4, column 7: did not find expected ',' or ']'")
    assert "not valid YAML" in str(err.value)
    assert main(["sweep", str(bad), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"muoneq: {bad}: line 4") and err.count("\n") == 1
    assert "Traceback" not in err


def test_a_full_disk_in_a_worker_thread_stops_the_sweep_with_one_line(tmp_path, monkeypatch):
    spec = load_sweep(write_sweep(tmp_path / "s.yaml", seeds=[0]))

    def no_space(argv, run_dir, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(run_dir / launch.LOG_NAME))

    monkeypatch.setattr(launch, "run_process", no_space)
    with pytest.raises(DiskFull) as err:
        Driver(spec, options(tmp_path, workers=2)).run()
    message = str(err.value)
    assert message.startswith("no space left on the disk holding ")
    assert f"/{launch.LOG_NAME} (" in message and message.endswith(
        "then run the same sweep command to continue")


def test_a_trial_that_diverged_is_recorded_as_diverged():
    metrics = {"status": "diverged", "diverged_at_step": 7, "val/ppl": None,
               "diverged": "the training loss is not finite (nan)"}
    verdict = judge([launch.Outcome("complete", metrics, returncode=3)], [0], "val/ppl")
    assert (verdict.state, verdict.outcome) == (TrialState.FAIL, "diverged")
    assert verdict.message == "diverged at step 7: the training loss is not finite (nan)"
    # a best value from before the divergence does not make it a result
    metrics["best"] = 3.2
    assert judge([launch.Outcome("complete", metrics)], [0], "best").outcome == "diverged"


def test_a_finished_run_without_a_number_for_the_objective_is_not_a_divergence():
    """MFU where no peak FLOP/s is known: null, which no retry changes (it was "diverged")."""
    metrics = {"status": "finished", "mfu": None, "val/ppl": 5.0, "git_commit": "abc"}
    verdict = judge([launch.Outcome("complete", metrics, returncode=0)], [0], "mfu")
    assert (verdict.state, verdict.outcome) == (TrialState.FAIL, "config_error")
    assert verdict.missing_metric  # logged as "not retried: fix objective.metric"
    assert verdict.message == ("metrics.json has 'mfu' = null (objective.metric: not measured "
                               "by this run, or not finite); it has numbers for: val/ppl")


def test_of_two_racing_claims_exactly_one_goes_on(tmp_path):
    """Two drivers claim the same run; each wrote its claim before looking, but only the
    lower-numbered one saw the other's (the case that ran a run twice on PostgreSQL)."""
    import threading

    driver = Driver(load_sweep(write_sweep(tmp_path / "s.yaml", seeds=[0])), options(tmp_path))
    ledger, study, key = driver.ledger, driver.study, "a run"
    first, second = study.ask(), study.ask()
    for trial in (first, second):
        ledger.write(trial.number, TrialRecord(run_key=key))
    assert ledger.duplicate_of(second.number, key) == first.number  # the later one sees it
    # ... or it did not, and went on
    ledger.write(second.number, TrialRecord(driver="the other driver"))
    assert ledger.duplicate_of(first.number, key) == second.number
    # undecided: the earlier claim waits for the later one's decision (here: it skips)
    third, fourth = study.ask(), study.ask()
    for trial in (third, fourth):
        ledger.write(trial.number, TrialRecord(run_key="another run"))
    decide = threading.Timer(0.5, ledger.write, (fourth.number, TrialRecord(outcome="skipped")))
    decide.start()
    assert ledger.duplicate_of(third.number, "another run") is None
    decide.join()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs the objective program (a pid that was reaped may be
    reused by an unrelated process)."""
    try:
        return str(OBJECTIVE) in Path(f"/proc/{pid}/cmdline").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_for(condition, process: subprocess.Popen, what: str, log: Path,
              limit_s: float = 120) -> None:
    """Wait until ``condition()`` holds (checked every 0.1 s); fail, naming ``what`` and the
    sweep's log, when the sweep exits first or after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"waiting for {what}: the sweep exited with {process.returncode}\n"
                        f"{log.read_text()[-3000:]}")
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_ctrl_c_stops_every_trial_which_saves_and_the_sweep_says_how_to_continue(tmp_path,
                                                                                 workers):
    """Ctrl-C in the terminal of a real ``muoneq sweep`` while its trial processes run: each
    trial gets SIGTERM (and saves), the driver waits for them, exits 130 and prints the command
    that continues; no trial process outlives it (on Python 3.11 and 3.12 a KeyboardInterrupt
    in the driver's join let it exit at once while its trials trained on)."""
    optimizers = ["muon_nes", "muoneq_nes"][:workers]
    path = write_sweep(tmp_path / "s.yaml", seeds=[0], overrides=["steps=20", "sleep_s=600"],
                       grid=[{"optimizer": optimizers, "optimizer.lr": [0.02]}])
    runs = tmp_path / "runs"
    argv = ["sweep", str(path), "--workers", str(workers), "--runs-dir", str(runs)]
    log = tmp_path / "sweep.log"
    with log.open("w") as out:
        # its own process group, as a shell's foreground job: the terminal's SIGINT reaches
        # every process of it (the trials run in sessions of their own)
        sweep = subprocess.Popen([sys.executable, "-m", "muoneq", *argv], stdout=out,
                                 stderr=subprocess.STDOUT, env=clean_env(),
                                 start_new_session=True)
    pid_files = [runs / "tiny" / "trials" / f"optimizer={name},optimizer.lr=0.02" / "seed0" / "pid"
                 for name in optimizers]
    pids: list[int] = []
    try:
        _wait_for(lambda: all(p.is_file() and p.read_text() for p in pid_files), sweep,
                  "the trials to start", log)
        pids[:] = [int(p.read_text()) for p in pid_files]
        os.killpg(sweep.pid, signal.SIGINT)
        sweep.wait(timeout=300)
        assert sweep.returncode == 130, log.read_text()[-3000:]
        assert [_alive(pid) for pid in pids] == [False] * workers
        for p in pid_files:
            assert (p.parent / "checkpoint").read_text() == "SIGTERM"
        lines = log.read_text().splitlines()
        continued = [line for line in lines if "continue with: " in line]
        assert len(continued) == 1, lines
        words = shlex.split(continued[0].split("continue with: ")[1])
        assert Path(words[0]).name == "muoneq" and words[1:] == argv
        # each trial's message is one line (trials_dataframe, the dashboard), its log in trial.log
        messages = {t.user_attrs["message"] for t in load(tmp_path).trials}
        assert messages == {"the sweep was interrupted; the process exited with status 143"}
    finally:  # the trials of a failed test are stopped here (those it found)
        pids = pids or [int(p.read_text()) for p in pid_files if p.is_file() and p.read_text()]
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
            sweep.wait()
