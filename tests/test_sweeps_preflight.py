"""One preflight for a sweep (muoneq.suite.sweeps.validate.preflight), run by ``--dry-run`` and by
every start alike: a misspelled objective or report metric stops it before any run, with the
closest key and the numeric keys the task writes, and so does one that is text or not measured
on this machine; a changed objective is refused by ``--dry-run`` as by the real run; ``--status``
and ``--dry-run`` create nothing; an unknown sweep key is one line with a did-you-mean, a list
set without brackets one saying how to write it; ``make report`` skips a study without results
and reports the others; a validation split smaller than ``task.data.val_tokens`` is one line
before any run.
"""

from __future__ import annotations

import json

import optuna
import pytest
import yaml

from muoneq.suite.cli import main
from muoneq.suite.runtime import compose
from muoneq.suite.runtime.metrics import metric_keys
from muoneq.suite.sweeps import Driver, load_sweep
from muoneq.suite.sweeps.spec import spec_to_dict
from muoneq.suite.sweeps.storage import open_storage
from tests.helpers.commands import make, one_line_error
from tests.helpers.language import language_shards, tiny_args  # noqa: F401 (a fixture)
from tests.helpers.report import add_trial
from tests.helpers.sweeps import REPO, load, options, write_sweep

GPT2 = str(REPO / "sweeps" / "ablation-gpt2.yaml")


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_misspelled_objective_stops_the_sweep_before_any_run(tmp_path, capsys, dry_run):
    runs = tmp_path / "runs"
    code = main(["sweep", GPT2, "--runs-dir", str(runs), "--set", "objective.metric=val/pplx",
                 *(["--dry-run"] if dry_run else [])])
    err = one_line_error(capsys.readouterr().err)
    assert code == 2 and not runs.exists()
    assert err.startswith("muoneq: objective.metric='val/pplx' is not a key of the metrics.json "
                          "a run of point 'optimizer=adamw optimizer.lr=0.0005' writes on this "
                          "machine (task language); did you mean 'val/ppl'?; its numeric keys: ")
    assert "val/loss, val/ppl, val/tokens" in err


@pytest.mark.parametrize(("metric", "what"), [
    ("git_commit", "is text, not a number, in"),
    ("mfu", "is not a key of"),  # null on a CPU: no peak FLOP/s to divide by
])
def test_an_objective_without_a_number_on_this_machine_stops_the_sweep(tmp_path, capsys, metric,
                                                                      what):
    """Before any run, naming the keys that are numbers here (a CPU-only run: no MFU)."""
    runs = tmp_path / "runs"
    code = main(["sweep", GPT2, "--runs-dir", str(runs), "--set", f"objective.metric={metric}",
                 "--override", "trainer.accelerator=cpu", "--dry-run"])
    err = one_line_error(capsys.readouterr().err)
    assert code == 2 and not runs.exists()
    assert err.startswith(f"muoneq: objective.metric={metric!r} {what} the metrics.json "), err
    numbers = err.split("its numeric keys: ")[1].split(", ")
    assert "val/ppl" in numbers and "step_time_s" in numbers
    assert not {"git_commit", "run_dir", "status", "mfu", "perf/mfu"} & set(numbers)


def test_a_misspelled_report_metric_stops_the_sweep(tmp_path, capsys):
    sweep = yaml.safe_load((REPO / "sweeps" / "ablation-cifar10.yaml").read_text())
    sweep["report"]["tables"][0]["metrics"][1]["key"] = "step_time"
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(sweep))
    assert main(["sweep", str(path), "--runs-dir", str(tmp_path / "runs"), "--dry-run"]) == 2
    err = one_line_error(capsys.readouterr().err)
    assert "report.tables[ablation].metrics.key='step_time' is not a key" in err
    assert "did you mean 'step_time_s'?" in err and "(task cifar10)" in err


def test_declared_keys_follow_the_config():
    """A CIFAR-10 run has validation keys only with a validation split (the keys a run really
    writes are checked against these in tests/test_runtime_train.py)."""
    plain = metric_keys(compose(["experiment=cifar10_resnet18"]))
    split = metric_keys(compose(["experiment=cifar10_resnet18", "task.data.val_size=100"]))
    assert "val/acc" not in plain and "test/acc" in plain
    assert set(split) - set(plain) == {"val/acc", "val/loss"}
    # MFU only where a peak FLOP/s is known: CUDA GPUs, or task.peak_tflops
    tiny = ["experiment=llama_tiny_shakespeare", "trainer.accelerator=cpu"]
    cpu, peak = metric_keys(compose(tiny)), metric_keys(compose([*tiny, "task.peak_tflops=1"]))
    gpu = metric_keys(compose(["experiment=gpt2_small_fineweb"]))  # trainer=gpu
    assert "mfu" not in cpu and {"mfu", "perf/mfu"} <= set(peak) & set(gpu)


def test_dry_run_and_status_create_nothing_and_refuse_a_changed_objective(tmp_path, capsys):
    sweep = write_sweep(tmp_path / "s.yaml", seeds=[0])
    runs = tmp_path / "runs"
    base = ["sweep", str(sweep), "--runs-dir", str(runs)]
    assert main([*base, "--status"]) == 0
    assert "study tiny (journal:" in capsys.readouterr().out and not runs.exists()
    assert main([*base, "--dry-run"]) == 0 and not runs.exists()
    capsys.readouterr()
    assert Driver(load_sweep(sweep), options(tmp_path)).run().exit_code == 0
    assert main([*base, "--status"]) == 0
    assert "2/2 runs done" in capsys.readouterr().out
    for extra in (["--dry-run"], []):
        assert main([*base, "--set", "objective.metric=loss", *extra]) == 2
        err = one_line_error(capsys.readouterr().err)
        assert "was created with other objective" in err
    assert len(load(tmp_path).trials) == 2  # nothing more ran


def test_metrics_json_without_the_objective_lists_its_keys(tmp_path, caplog):
    sweep = write_sweep(tmp_path / "s.yaml", seeds=[0], objective={"metric": "val_los"},
                        grid=[{"optimizer": ["muon_nes"], "optimizer.lr": [0.1]}])
    Driver(load_sweep(sweep), options(tmp_path)).run()
    (t,) = load(tmp_path).trials
    assert t.user_attrs["message"] == "metrics.json has no 'val_los' (objective.metric); it " \
                                      "has numbers for: val_loss"
    assert "metrics.json has no 'val_los'" in caplog.text
    run_dir = tmp_path / "runs" / "tiny" / t.user_attrs["run_dirs"][0]
    assert "it has numbers for: val_loss" in (run_dir / "trial.log").read_text()


@pytest.mark.parametrize(("setting", "expected"), [
    ("workers=3", "unknown key 'workers'; workers is an option of the command: --workers; "
                  "allowed keys: bracket, description,"),
    ("objective.metrc=x", "unknown key 'objective.metrc'; did you mean 'metric'?; allowed keys "
                          "of objective: direction, metric"),
    ("bracket.axs=[x]", "unknown key 'bracket.axs'; did you mean 'axes'?; allowed keys of "
                        "bracket: axes, bounds, max_extensions, scale"),
    # a list written without brackets, or not as YAML: how lists are written
    ("seeds=0,1", "seeds is a list; write a list in brackets, quoted for the shell: "
                  "--set 'seeds=[0,1]'"),
    ("seeds=[0, 1", "the value is not valid YAML (did not find expected ',' or ']'); write a "
                    "list in brackets, quoted for the shell: --set 'seeds=[0, 1]'"),
])
def test_a_set_mistake_is_one_line_with_a_did_you_mean(capsys, setting, expected):
    assert main(["sweep", GPT2, "--set", setting, "--dry-run"]) == 2
    err = one_line_error(capsys.readouterr().err)
    assert f"with --set {setting}: {expected}" in err and "full_key" not in err


@pytest.mark.slow
def test_make_report_skips_a_study_without_results_and_reports_the_others(tmp_path):
    runs = tmp_path / "runs"
    sweep = write_sweep(tmp_path / "s.yaml", seeds=[0])
    Driver(load_sweep(sweep), options(tmp_path)).run()
    empty = load_sweep(sweep)
    empty.study = "empty"
    study = optuna.create_study(study_name="empty", storage=open_storage(None, runs / "empty"))
    study.set_user_attr("spec", spec_to_dict(empty))
    add_trial(study, ({"optimizer": "muon_nes", "optimizer.lr": 0.02},
                      "optimizer=muon_nes optimizer.lr=0.02"), 0, None, outcome="failed",
              state=optuna.trial.TrialState.FAIL)
    done = make("report", f"RUNS={runs}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"muoneq report: skipped study empty ({runs / 'empty'}): it has no finished run " \
        "yet" in done.stdout
    assert (runs / "tiny" / "report" / "report.md").is_file()
    assert not (runs / "empty" / "report").exists()
    assert json.loads((runs / "tiny" / "trials").joinpath(
        "optimizer=muon_nes,optimizer.lr=0.02", "seed0", "metrics.json").read_text())


@pytest.mark.parametrize("dry_run", [True, False])
def test_grid_values_that_would_share_a_run_folder_are_refused(tmp_path, capsys, dry_run):
    """A data path a/b and the value a_b map to one folder name: the second point could never
    run, and the preflight was silent."""
    sweep = write_sweep(tmp_path / "s.yaml", seeds=[0], grid=[
        {"optimizer.lr": [0.02], "data": ["a/b", "a_b"]}])
    runs = tmp_path / "runs"
    assert main(["sweep", str(sweep), "--runs-dir", str(runs),
                 *(["--dry-run"] if dry_run else [])]) == 2
    err = one_line_error(capsys.readouterr().err)
    assert err == ("muoneq: points 'optimizer.lr=0.02 data=a/b' and 'optimizer.lr=0.02 data=a_b' "
                   "would share the run folder trials/optimizer.lr=0.02,data=a_b/ (their values "
                   "differ only in characters a folder name cannot hold), so the second could "
                   "never run; change one of the values (a symbolic link or a copy of the file "
                   "under another name, say)")
    assert not runs.exists()


def test_the_preflight_composes_each_value_of_each_config_shape_once(tmp_path):
    """Every point of a 1,000-point grid used to be composed (31 s): each config shape is now
    composed with every value of every axis once, which still finds a bad value wherever it
    sits in the grid."""
    from muoneq.suite.sweeps.spec import SweepError
    from muoneq.suite.sweeps.validate import check_trials

    def grid(momenta):
        return [{"optimizer": ["muoneq_nes"], "optimizer.lr": [0.01 * (i + 1) for i in range(10)],
                 "optimizer.momentum": momenta,
                 "optimizer.weight_decay": [0.01 * i for i in range(10)]},
                {"optimizer": ["adamw"], "optimizer.lr": [0.001, 0.002]}]

    def sweep(momenta) -> object:
        return load_sweep(write_sweep(tmp_path / "s.yaml", seeds=[0, 1], grid=grid(momenta),
                                      experiment="cifar10_resnet18",
                                      objective={"metric": "test/acc", "direction": "maximize"},
                                      overrides=[], launch={}))

    momenta = [0.8 + 0.01 * i for i in range(10)]
    spec = sweep(momenta)
    assert len(spec.points()) == 1002
    assert check_trials(spec, tmp_path / "runs" / "tiny") == (1 + 9 + 9 + 9) + (1 + 1)
    with pytest.raises(SweepError, match=r"point 'optimizer=muoneq_nes optimizer\.lr=0\.01 "
                                         r"optimizer\.momentum=1\.5 .* is not a valid training"):
        check_trials(sweep([*momenta[:-1], 1.5]), tmp_path / "runs" / "tiny")
def test_a_validation_split_smaller_than_val_tokens_is_one_line_before_any_run(
        shards, tmp_path, capsys):
    """A data error: ``--dry-run`` and the sweep stop before any run, with the line the run
    itself would give (exit 2, which a sweep never retries), from the shards' headers."""
    from muoneq_tasks.language.shards import find_shards, read_header

    val = find_shards(shards, "val")
    tokens = sum(read_header(f) for f in val)
    budget = (tokens // 32 + 1) * 32  # the next multiple of seq_len 32 past the split
    overrides = [a for a in tiny_args(shards, "unused") if not a.startswith("run.dir=")]
    path = tmp_path / "small-val.yaml"
    path.write_text(yaml.safe_dump({
        "study": "small-val", "experiment": "llama_tiny_shakespeare",
        "overrides": [*overrides[1:], f"task.data.val_tokens={budget}"], "seeds": [0],
        "grid": [{"optimizer": ["muon_nes"], "optimizer.lr": [0.02]}],
        "objective": {"metric": "val/ppl", "direction": "minimize"}}))
    expected = (f"task.data.val_tokens={budget} needs {budget + 1} tokens of the validation "
                f"split, which has {tokens} ({val[0]}); lower task.data.val_tokens to "
                f"{(tokens - 1) // 32 * 32} or less, or prepare a larger validation split")
    runs = tmp_path / "runs"
    for extra in (["--dry-run"], []):
        assert main(["sweep", str(path), "--runs-dir", str(runs), *extra]) == 2
        err = one_line_error(capsys.readouterr().err)
        assert err.startswith("muoneq: point 'optimizer=muon_nes optimizer.lr=0.02': "
                              + expected), err
    assert not runs.exists()
    # the run itself, had it started: the same line, status 2
    assert main(["train", *tiny_args(shards, tmp_path / "run",
                                     f"task.data.val_tokens={budget}")]) == 2
    assert one_line_error(capsys.readouterr().err).startswith("muoneq: " + expected)
