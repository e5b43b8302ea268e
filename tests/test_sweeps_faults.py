"""Fault injection on sweeps: a journal cut mid-record (at every byte of its last record), a
journal appended onto a cut record or holding a line that is no record, a malformed sweep file,
a full disk, files out of reach, a damaged trial.json, a trial that diverged, another machine's
clock, Ctrl-C on a running sweep."""

from __future__ import annotations

import errno
import json
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
from muoneq.suite.sweeps import Driver, SweepError, launch, load_sweep, warm
from muoneq.suite.sweeps.storage import JournalError, open_storage
from muoneq.suite.sweeps.trial_record import TrialRecord
from muoneq.suite.sweeps.verdict import judge
from tests.helpers import small_disk
from tests.helpers.access import deny_access  # noqa: F401 (a fixture: deny)
from tests.helpers.commands import clean_env, one_line_error
from tests.helpers.sweeps import OBJECTIVE, WARM_LAUNCH, load, options, write_sweep


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


def test_a_cut_record_that_was_appended_onto_is_repaired_keeping_a_copy(journal, tmp_path,
                                                                       capsys):
    """Older versions appended the next record onto a cut one: the line is dropped and the
    whole record at its end kept, so the study reads back whole (it used to be refused with a
    `sed` command that removed that record too)."""
    data, start = journal
    path = tmp_path / "optuna.journal"
    last = data[start:]
    damaged = data[:start] + last[:25] + last
    path.write_bytes(damaged)
    storage = open_storage(f"journal:{path}", tmp_path)
    assert path.read_bytes() == data
    assert trials_of(storage) == trials_of(
        JournalStorage(JournalFileBackend(str(_write(tmp_path / "ref", data)))))
    copies = list(tmp_path.glob("optuna.journal.damaged-*"))
    assert len(copies) == 1 and copies[0].read_bytes() == damaged
    line = data[:start].count(b"\n") + 1
    assert capsys.readouterr().err == (
        f"muoneq: note: {path}: dropped line {line}, not a whole Optuna journal record (a write "
        "cut short, then appended onto, or other text), keeping the whole record at the end of "
        f"1; the journal as it was is kept as {copies[0].name}\n")


@pytest.mark.parametrize("garbage", [b'{"hello": 1}', b"[1, 2]", b"7", b"null", b"not json"])
def test_a_line_that_is_not_an_optuna_record_is_dropped_keeping_a_copy(journal, tmp_path,
                                                                       capsys, garbage):
    """A line of valid JSON that is no Optuna record used to end in a traceback."""
    data, start = journal
    path = tmp_path / "optuna.journal"
    path.write_bytes(data[:start] + garbage + b"\n" + data[start:])
    storage = open_storage(f"journal:{path}", tmp_path)
    assert path.read_bytes() == data
    assert len(trials_of(storage)) == 3
    err, line = capsys.readouterr().err, data[:start].count(b"\n") + 1
    assert err.startswith(f"muoneq: note: {path}: dropped line {line}, not a whole Optuna "
                          "journal record") and err.count("\n") == 1
    assert [p.read_bytes() for p in tmp_path.glob("optuna.journal.damaged-*")] == [
        data[:start] + garbage + b"\n" + data[start:]]


def test_a_record_optuna_cannot_apply_is_one_line(journal, tmp_path):
    data, start = journal
    path = tmp_path / "optuna.journal"
    path.write_bytes(data + b'{"op_code": 6, "worker_id": "w"}\n')  # no trial, no state
    with pytest.raises(JournalError) as err:
        open_storage(f"journal:{path}", tmp_path)
    assert str(err.value).startswith(f"{path}: Optuna cannot read its records (KeyError: ")
    assert str(err.value).endswith("restore it from a backup, or move it away to start the "
                                   "study again")


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


@pytest.mark.parametrize(("content", "words"), [
    (b"- study: x\n- grid: []\n", "the file holds a list at its top level, and a sweep file is "
                                  "a mapping of its fields"),
    (b"7\n", "the file holds a number at its top level, and a sweep file is a mapping of its "
             "fields"),  # was a traceback: OmegaConf takes no one-value document
    (b"study: caf\xe9\n", "byte 10 is not UTF-8 (invalid continuation byte), so the file is "
                          "not a sweep file (YAML in UTF-8); save it as UTF-8")],
    ids=["top-level list", "bare number", "not UTF-8"])
def test_a_sweep_file_that_is_no_mapping_or_not_utf8_is_one_line(tmp_path, capsys, content,
                                                                 words):
    from muoneq.suite.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_bytes(content)
    assert main(["sweep", str(bad), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"muoneq: {bad}: {words}") and err.count("\n") == 1


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
def test_a_study_name_longer_than_a_folder_name_is_one_line(tmp_path, capsys, dry_run):
    """A 300-character study name used to be a traceback (the study folder's name is too long
    for the file system), even with --dry-run."""
    from muoneq.suite.cli import main

    sweep = write_sweep(tmp_path / "s.yaml", study="s" * 300)
    runs = tmp_path / "runs"
    assert main(["sweep", str(sweep), "--runs-dir", str(runs),
                 *(["--dry-run"] if dry_run else [])]) == 2
    assert one_line_error(capsys.readouterr().err) == (
        f"muoneq: {sweep}: study={'s' * 40}… is 300 bytes, and a folder name holds at most 255; "
        "choose a shorter study name")
    assert not runs.exists()


@pytest.mark.parametrize("what", ["sweep file", "journal", "a run's metrics.json",
                                  "read-only runs folder"])
def test_a_file_or_folder_out_of_reach_stops_the_sweep_with_one_line(tmp_path, capsys, deny,
                                                                     what):
    from muoneq.suite.cli import main

    sweep = write_sweep(tmp_path / "s.yaml", seeds=[0])
    runs = tmp_path / "runs"
    run = load_sweep(sweep).points()[0].run_dir(runs / "tiny", 0)
    if what in ("journal", "a run's metrics.json"):
        assert Driver(load_sweep(sweep), options(tmp_path)).run().exit_code == 0
    else:
        runs.mkdir()
    path = {"sweep file": sweep, "journal": runs / "tiny" / "optuna.journal",
            "a run's metrics.json": run / "metrics.json", "read-only runs folder": runs}[what]
    if what == "a run's metrics.json":  # a finished run the driver reads again
        (runs / "tiny" / "optuna.journal").unlink()
    deny(path)
    capsys.readouterr()
    assert main(["sweep", str(sweep), "--runs-dir", str(runs)]) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("muoneq: ")]
    where = runs / "tiny" if what == "read-only runs folder" else path
    assert lines == [f"muoneq: {where}: permission denied (Permission denied); give your user "
                     "access to it (ls -l, chmod, chown), or choose another file or folder"]
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


def test_liveness_of_another_machine_never_compares_the_two_clocks(tmp_path):
    """A driver whose clock ran an hour ahead of another's declared every live trial of the
    other "driver and process gone", failed and re-queued them: liveness compared a heartbeat
    written by one clock with the time of another."""
    driver = Driver(load_sweep(write_sweep(tmp_path / "s.yaml", seeds=[0])), options(tmp_path))
    ledger, study = driver.ledger, driver.study
    stale = driver.spec.retry.stale_after_s
    now = [1000.0]
    ledger.clock = lambda: now[0]
    trial = study.ask()
    beat = time.time() - 3600  # the other machine's clock is an hour behind
    ledger.write(trial.number, TrialRecord(run_key="a run", driver="node2:7:abc", host="node2",
                                           heartbeat=beat))

    def alive() -> bool:
        frozen = study.get_trials(deepcopy=False)[trial.number]
        return ledger.owner_alive(frozen)

    assert alive()  # its heartbeat is new to this driver
    now[0] += stale - 1
    assert alive()
    now[0] += 1
    assert not alive()  # stale_after_s of this driver's clock without a new heartbeat
    ledger.write(trial.number, TrialRecord(heartbeat=beat + 30))  # it beats: alive again
    assert alive()
    now[0] += stale - 1
    assert alive()
    now[0] += 1
    assert not alive()
    survey = ledger.survey()
    assert [t.number for t in survey.runs["a run"].orphans] == [trial.number]


def test_a_damaged_trial_json_fails_its_trial_with_one_line_naming_it(tmp_path):
    """A cut trial.json used to crash the worker thread with a JSONDecodeError naming no file,
    the trial left RUNNING and then "out of retries" with nothing in its log."""
    spec = load_sweep(write_sweep(tmp_path / "s.yaml", seeds=[0]))
    study_dir = tmp_path / "runs" / "tiny"
    first, second = spec.points()
    run_dir = first.run_dir(study_dir, 0)
    run_dir.mkdir(parents=True)
    (run_dir / launch.RECORD_NAME).write_text('{"fingerprint": {"experi')  # a cut write
    summary = Driver(spec, options(tmp_path)).run()
    assert (summary.done, summary.exhausted) == (1, [f"{first.key} | seed=0"])
    trials = optuna.load_study(study_name="tiny",
                               storage=open_storage(None, study_dir)).get_trials()
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert len(failed) == 1 and failed[0].user_attrs["outcome"] == "config_error"
    message = failed[0].user_attrs["message"]
    assert message.startswith(f"{run_dir / launch.RECORD_NAME} is damaged or unreadable "
                              "(JSONDecodeError: ") and "\n" not in message
    assert message.endswith("restore it, or delete that run folder to run its point again")
    assert launch.log_tail(run_dir).endswith(f"failed: {message}")
    assert (second.run_dir(study_dir, 0) / "metrics.json").is_file()


def test_a_run_that_found_the_disk_full_stops_the_sweep_at_once(tmp_path, capsys):
    """A trial that exits with the full-disk status (4) used to be retried, and every other run
    started, each meeting the same disk."""
    from muoneq.suite.cli import main

    sweep = write_sweep(tmp_path / "s.yaml", seeds=[0], overrides=["steps=20", "disk_full=true"])
    runs = tmp_path / "runs"
    assert main(["sweep", str(sweep), "--runs-dir", str(runs), "--poll", "0.2"]) == 4
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if x.startswith("muoneq: ")]
    first = load_sweep(sweep).points()[0]
    run_dir = first.run_dir(runs / "tiny", 0)
    assert line == [f"muoneq: trial 0 ({first.key} | seed=0): no space left on the disk holding "
                    f"{run_dir}/checkpoints/last-step000000004.ckpt (0.00 GiB free); free space "
                    "there (old runs, checkpoints) or write to a larger disk; then run the same "
                    "sweep command to continue (the run resumes from its last checkpoint)"]
    starts = sorted(runs.rglob("starts.log"))
    assert starts == [run_dir / "starts.log"] and len(starts[0].read_text().splitlines()) == 1
    trial = optuna.load_study(study_name="tiny",
                              storage=open_storage(None, runs / "tiny")).get_trials()[0]
    assert trial.user_attrs["outcome"] == "disk_full"  # not a failure: no retry used up
@pytest.mark.parametrize("free", [0, 8192], ids=["creating-the-study", "mid-sweep"])
def test_a_real_full_disk_under_the_journal_stops_the_sweep_with_one_line_naming_it(tmp_path,
                                                                                  free):
    """A journal on a disk of its own (--storage journal:…, here a real tmpfs) that fills up
    used to be a traceback while the study was created, and mid-sweep a line naming the runs
    folder's disk, with its free space, instead of the journal's."""
    sweep = write_sweep(tmp_path / "s.yaml", seeds=[0, 1])
    disk = tmp_path / "journal"
    disk.mkdir()
    command = shlex.join([sys.executable, "-m", "muoneq", "sweep", str(sweep), "--runs-dir",
                          str(tmp_path / "runs"), "--storage", f"journal:{disk}/optuna.journal",
                          "--poll", "0.2"])
    done = small_disk.run(disk, f'{command}; echo "status $?"', free=free, env=clean_env())
    assert done.stdout.splitlines()[-1] == "status 4", done.stdout + done.stderr
    assert one_line_error(done.stderr) == (
        f"muoneq: no space left on the disk holding {disk / 'optuna.journal'} (0.00 GiB free); "
        "free space there (old runs, checkpoints) or write to a larger disk; then run the same "
        "sweep command to continue")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs the objective program, spawned or forked by a warm
    server (a pid that was reaped may be reused by an unrelated process)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_text()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z" and (str(OBJECTIVE) in command or warm.SERVER_MAIN in command)


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
@pytest.mark.parametrize(("workers", "started"), [(1, "spawned"), (2, "spawned"), (2, "warm")])
def test_ctrl_c_stops_every_trial_which_saves_and_the_sweep_says_how_to_continue(
        tmp_path, workers, started, monkeypatch):
    """Ctrl-C in the terminal of a real ``muoneq sweep`` while its trial processes run: each
    trial gets SIGTERM (and saves), the driver waits for them, exits 130 and prints the command
    that continues; no trial process outlives it (on Python 3.11 and 3.12 a KeyboardInterrupt
    in the driver's join let it exit at once while its trials trained on), nor a warm server
    (its trials forked by it: ``launch.warm``)."""
    optimizers = ["muon_nes", "muoneq_nes"][:workers]
    launched = {"launch": WARM_LAUNCH} if started == "warm" else {}
    monkeypatch.chdir(Path(__file__).parents[1])  # the objective program runs as its module
    path = write_sweep(tmp_path / "s.yaml", seeds=[0], overrides=["steps=20", "sleep_s=600"],
                       grid=[{"optimizer": optimizers, "optimizer.lr": [0.02]}], **launched)
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
        records = [json.loads((p.parent / launch.RECORD_NAME).read_text()) for p in pid_files]
        assert [r["pid"] for r in records] == pids
        servers = {int(r["process"].split("pid ")[1].rstrip(")")) for r in records
                   if r["process"] != "spawned"}
        assert len(servers) == (started == "warm")
        pids += servers
        os.killpg(sweep.pid, signal.SIGINT)
        sweep.wait(timeout=300)
        assert sweep.returncode == 130, log.read_text()[-3000:]
        assert [_alive(pid) for pid in pids] == [False] * len(pids)
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



#: ``muoneq sweep`` whose preflight, once it starts, says so in the file argv[1] and then takes
#: as long as a long one (composing many configs, reading shards on a slow file system) would
HELD_PREFLIGHT = """
import os, sys, time
from pathlib import Path
from muoneq.suite.sweeps import validate
def held(*args, **kwargs):
    children = [c for t in Path("/proc/self/task").iterdir()
                for c in (t / "children").read_text().split()]
    Path(sys.argv[1] + ".part").write_text(" ".join(children))  # its warm server, if any
    os.replace(sys.argv[1] + ".part", sys.argv[1])
    time.sleep(600)
validate.check_trials = held
from muoneq.suite.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("started", ["spawned", "warm"])
def test_ctrl_c_during_the_preflight_is_one_line_and_exit_130(tmp_path, started, monkeypatch):
    """Ctrl-C in the terminal while the preflight checks the study, before the driver handles
    signals: one line, status 130, no traceback, nothing created, and no warm server left (it
    imports while the preflight runs, in a session of its own, out of the terminal's reach)."""
    monkeypatch.chdir(Path(__file__).parents[1])  # the objective program runs as its module
    path = write_sweep(tmp_path / "s.yaml", seeds=[0],
                       **({"launch": WARM_LAUNCH} if started == "warm" else {}))
    runs, held, log = tmp_path / "runs", tmp_path / "held", tmp_path / "sweep.log"
    with log.open("w") as out:
        sweep = subprocess.Popen(
            [sys.executable, "-c", HELD_PREFLIGHT, str(held), "sweep", str(path),
             "--runs-dir", str(runs)],
            stdout=out, stderr=subprocess.STDOUT, env=clean_env(), start_new_session=True)
    try:
        _wait_for(held.exists, sweep, "the preflight", log)
        children = [int(pid) for pid in held.read_text().split()]
        assert len(children) == (started == "warm")
        os.killpg(sweep.pid, signal.SIGINT)
        sweep.wait(timeout=120)
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
            sweep.wait()
    text = log.read_text()
    assert sweep.returncode == 130, text
    assert text.splitlines() == [
        "muoneq: sweep interrupted (Ctrl-C) while checking the study, before any trial "
        "started; run the same command to start it"], text
    assert not runs.exists()
    assert [_alive(pid) for pid in children] == [False] * len(children)


def test_ctrl_c_in_any_command_without_a_handler_is_one_line(monkeypatch, capsys):
    """``muoneq report`` (and every command that handles no signal itself) interrupted: one
    line and status 130; ``--debug`` keeps the traceback."""
    from muoneq.suite.cli import main
    from muoneq.suite.report import cli as report_cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(report_cli, "main", interrupted)
    assert main(["report", "runs/x"]) == 130
    assert capsys.readouterr().err == "muoneq: report interrupted (Ctrl-C)\n"
    with pytest.raises(KeyboardInterrupt):
        main(["--debug", "report", "runs/x"])


@pytest.mark.slow
def test_ctrl_c_stops_a_trial_adopted_from_a_driver_that_died(tmp_path):
    """A driver is killed while its trial runs; the next driver adopts the live trial; Ctrl-C on
    that driver stops the adopted trial too (SIGTERM: it saves), found by the process id and
    host its trial.json records, and tells it interrupted (no retry used up)."""
    import json
    import socket

    path = write_sweep(tmp_path / "s.yaml", seeds=[0], overrides=["steps=20", "sleep_s=600"],
                       grid=[{"optimizer": ["muon_nes"], "optimizer.lr": [0.02]}])
    runs = tmp_path / "runs"
    run_dir = runs / "tiny" / "trials" / "optimizer=muon_nes,optimizer.lr=0.02" / "seed0"
    argv = [sys.executable, "-m", "muoneq", "sweep", str(path), "--runs-dir", str(runs),
            "--poll", "0.2"]
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    drivers: list[subprocess.Popen] = []
    pid = None
    try:
        with first_log.open("w") as out:
            drivers.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                            env=clean_env(), start_new_session=True))
        _wait_for(lambda: (run_dir / "pid").is_file() and (run_dir / "pid").read_text(),
                  drivers[0], "the trial to start", first_log)
        pid = int((run_dir / "pid").read_text())
        _wait_for(lambda: "pid" in json.loads((run_dir / "trial.json").read_text()),
                  drivers[0], "trial.json to record the trial's process", first_log)
        record = json.loads((run_dir / "trial.json").read_text())
        assert (record["pid"], record["host"]) == (pid, socket.gethostname())
        drivers[0].kill()  # the driver alone: its trial runs on, in a session of its own
        drivers[0].wait()
        assert _alive(pid)
        with second_log.open("w") as out:
            drivers.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                            env=clean_env(), start_new_session=True))
        _wait_for(lambda: "adopting it" in second_log.read_text(), drivers[1],
                  "the second driver to adopt the trial", second_log)
        os.killpg(drivers[1].pid, signal.SIGINT)
        drivers[1].wait(timeout=300)
        assert drivers[1].returncode == 130, second_log.read_text()[-3000:]
        assert not _alive(pid)
        assert (run_dir / "checkpoint").read_text() == "SIGTERM"
        (trial,) = load(tmp_path).trials
        assert trial.user_attrs["outcome"] == "interrupted"
        assert trial.user_attrs["message"] == (
            f"the sweep was interrupted; its process {pid}, adopted from a driver that died, "
            "was stopped")
    finally:
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)
        for driver in drivers:
            if driver.poll() is None:
                os.killpg(driver.pid, signal.SIGKILL)
                driver.wait()


def test_an_interrupted_trial_is_one_short_line():
    """Ctrl-C on a sweep: each stopped trial's line says where it saved its step, not its run
    folder and the ~600-character command that continues it (the sweep continues it)."""
    run_dir = "runs/demo/trials/optimizer=muoneq_nes,optimizer.lr=0.04,optimizer.mode=RC/seed0"
    tail = ("Epoch 0: 12/100\n"
            f"muoneq: training of {run_dir} stopped by SIGTERM after step 12, saved as "
            "checkpoints/last-step000000012.ckpt; continue it with: " + "x " * 300)
    line = launch.stopped_message("interrupted", "the process exited with status 143", tail)
    assert line == ("the sweep was interrupted; the process exited with status 143: muoneq: "
                    "training stopped by SIGTERM after step 12, saved as "
                    "checkpoints/last-step000000012.ckpt")
