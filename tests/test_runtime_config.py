"""Config composition from conf/, typed validation and the errors users see."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from muoneq.registry import OPTIMIZERS
from muoneq.suite.runtime.config import ConfigError, compose, conf_dir
from muoneq.suite.runtime.optim import build_optimizer_from_config, optimizer_schema
from muoneq.suite.runtime.tasks import task_names as registered_tasks

CONF = conf_dir()
PAPER = ("experiment=cifar10_resnet18",)


def test_experiment_pins_the_paper_cifar_table():
    expected = {  # Table 7 (+ weight decay of the script)
        "sgd": {"lr": 5e-2, "momentum": 0.9, "weight_decay": 1e-4},
        "adamw": {"lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 1e-4},
        "muon": {"lr": 5e-2, "momentum": 0.9, "nesterov": False, "mode": "none"},
        "muon_nes": {"lr": 5e-2, "momentum": 0.9, "nesterov": True, "mode": "none"},
        "muoneq_nes": {"lr": 5e-2, "momentum": 0.9, "nesterov": True, "mode": "R", "eps": 1e-8,
                       "adamw_betas": [0.9, 0.95], "lr_adjust": "none"},
    }
    for name, values in expected.items():
        cfg = compose([*PAPER, f"optimizer={name}"])
        assert cfg.optimizer.name == name
        for key, value in values.items():
            assert cfg.optimizer[key] == value, (name, key)
        assert cfg.task.data.batch_size == 128 and cfg.trainer.max_epochs == 100
        assert cfg.schedule.warmup_steps == 0 and cfg.schedule.name.value == "cosine"
        if OPTIMIZERS[name].hybrid:
            assert cfg.optimizer.routing.value == "all_matrices"
    assert compose(PAPER).optimizer.name == "muoneq_nes"  # the experiment's default


def test_precedence_command_line_over_experiment_over_group_files():
    cfg = compose([*PAPER, "optimizer=muoneq_nes", "optimizer.lr=0.01", "optimizer.mode=RC",
                   "trainer.devices=4", "seed=2"])
    assert cfg.optimizer.lr == 0.01 and cfg.optimizer.mode == "RC"
    assert cfg.trainer.devices == 4 and cfg.seed == 2
    assert cfg.optimizer.ns_steps == 5  # from conf/optimizer/muoneq_nes.yaml
    assert cfg.run.name.startswith("cifar10_resnet18-muoneq_nes-seed2-")
    assert "optimizer.mode=RC" in cfg.run.name  # runs differing by overrides do not collide
    assert compose([*PAPER, "run.dir=/x/y"]).run.dir == "/x/y"
    # without the experiment, the optimizer file's paper defaults (LLaMA2-130M table) apply
    plain = compose(["task=cifar10", "optimizer=muoneq_nes", "trainer.max_steps=10"])
    assert plain.optimizer.lr == 3e-3 and plain.optimizer.momentum == 0.95
    assert plain.optimizer.lr_adjust == "rms" and plain.optimizer.routing.value == "default"


def test_trainer_cpu_under_a_bf16_experiment_says_so_once(capsys):
    """``trainer=cpu`` keeps the experiment's ``bf16-mixed`` (the experiment file overrides the
    trainer file): a note says so and how to train in float32; none when the command line sets
    the precision, and one per cache (a sweep composing many points)."""
    cfg = compose(["experiment=gpt2_small_fineweb", "trainer=cpu"])
    assert cfg.trainer.precision == "bf16-mixed"
    out = capsys.readouterr().out
    assert ("muoneq: note: trainer.precision=bf16-mixed (from experiment gpt2_small_fineweb) on "
            "a CPU" in out and "add trainer.precision=32-true" in out)
    compose(["experiment=gpt2_small_fineweb", "trainer=cpu", "trainer.precision=bf16-mixed"])
    compose(["experiment=gpt2_small_fineweb", "trainer=cpu", "trainer.precision=32-true"])
    compose(["experiment=cifar10_resnet18", "trainer=cpu"])
    assert "note: trainer.precision" not in capsys.readouterr().out
    cache: dict = {}
    for lr in (1e-3, 2e-3):
        compose(["experiment=gpt2_small_fineweb", "trainer=cpu", f"optimizer.lr={lr}"],
                cache=cache)
    assert capsys.readouterr().out.count("note: trainer.precision") == 1


def test_config_file_outside_conf(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("defaults: {task: cifar10, optimizer: adamw}\ntrainer: {max_steps: 7}\n")
    cfg = compose([f"experiment={path}"])
    assert cfg.optimizer.name == "adamw" and cfg.trainer.max_steps == 7
    assert cfg.run.name.startswith("mine-adamw-seed0")


@pytest.mark.parametrize("path", sorted((CONF / "optimizer").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_optimizer_file_composes_and_builds(path):
    cfg = compose(["task=cifar10", f"optimizer={path.stem}", "trainer.max_steps=1"])
    assert cfg.optimizer.name in OPTIMIZERS
    # every key of the file reaches the optimizer unchanged
    for key, value in OmegaConf.load(path).items():
        assert OmegaConf.to_container(cfg.optimizer, enum_to_str=True)[key] == value, key
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = build_optimizer_from_config(model, cfg.optimizer)
    assert isinstance(opt, OPTIMIZERS[cfg.optimizer.name].factory)
    assert opt.param_groups[0]["lr"] == cfg.optimizer.lr


def test_no_decay_exempts_vectors_and_embeddings_from_weight_decay():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8),
                                torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    groups = {}
    for flag in ("false", "true"):
        cfg = compose(["task=cifar10", "optimizer=muoneq_nes", "trainer.max_steps=1",
                       f"optimizer.no_decay={flag}"])
        opt = build_optimizer_from_config(model, cfg.optimizer)
        groups[flag] = {g["name"]: (len(g["params"]), g["weight_decay"])
                        for g in opt.param_groups}
    assert groups["false"] == {"muon": (1, 0.1), "adamw": (6, 0.1)}  # the paper's setting
    assert groups["true"] == {"muon": (1, 0.1), "adamw": (1, 0.1), "adamw_no_decay": (5, 0.0)}


def test_every_registered_optimizer_and_task_has_a_file():
    assert {p.stem for p in (CONF / "optimizer").glob("*.yaml")} >= set(OPTIMIZERS)
    task_names = {OmegaConf.load(p).get("name", p.stem) for p in (CONF / "task").glob("*.yaml")}
    assert task_names >= set(registered_tasks())


def test_schema_types_come_from_the_signature():
    schema = OmegaConf.structured(optimizer_schema("sgd"))
    assert OmegaConf.get_type(schema, "momentum") is float  # default 0 but annotated float
    merged = OmegaConf.merge(schema, OmegaConf.from_dotlist(["momentum=1"]))  # int accepted
    assert merged.momentum == 1.0 and isinstance(merged.momentum, float)
    muoneq = OmegaConf.structured(optimizer_schema("muoneq"))
    assert muoneq.ns_dtype == "auto" and muoneq.mode == "R" and muoneq.nesterov is False
    assert "routing" in muoneq and "routing" not in schema  # routing only for hybrid methods


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["optimizer.lrr=1"], ["optimizer.lrr", "Did you mean: 'lr'", "allowed keys:", "momentum"]),
        (["task.data.bs=3"], ["task.data.bs", "batch_size", "root"]),
        (["trainer.max_epoch=3"], ["trainer.max_epoch", "max_epochs"]),
        (["optimizer.lr=abc"], ["optimizer.lr", "'abc'"]),
        (["task.data.batch_size=1.5"], ["task.data.batch_size", "1.5"]),
        (["optimizer=adamx"], ["optimizer=adamx", "did you mean 'adamw'", "muoneq_nes"]),
        (["optimizer.mode=X"], ["optimizer.mode", "'X'", "R", "RC"]),
        (["optimizer.momentum=1.5"], ["optimizer.momentum", "1.5"]),
        (["optimizer.ns_dtype=float8"], ["optimizer.ns_dtype", "auto, float64", "bfloat16"]),
        (["optimizer.ns_steps=0"], ["optimizer.ns_steps: expected an integer ≥ 1, got 0"]),
        (["trainer.strategy=dp"], ["trainer.strategy", "'dp'", "ddp", "fsdp2"]),
        (["trainer.precision=bf17"], ["trainer.precision", "bf16-mixed"]),
        (["trainer.devices=two"], ["trainer.devices", "'two'"]),
        (["resume=sometimes"], ["resume", "auto", "never"]),
        (["optimizer=sgd", "optimizer.routing=default"], ["optimizer.routing", "nesterov"]),
        (["optimizer=sgd", "optimizer.lr=-1"], ["optimizer (sgd)", "learning rate"]),
        (["task.model.width=0"], ["task.model.width", "≥ 1"]),
        (["trainer.max_epochs=null"], ["trainer.max_epochs", "max_steps"]),
        (["trainer.max_epochs=-1", "trainer.max_steps=-1"],  # was a traceback once it ran
         ["trainer.max_epochs=-1 / trainer.max_steps=-1", "set at least one", "-1 and null"]),
        (["trainer.max_steps=0"], ["trainer.max_steps=0", "trains nothing", "≥ 1"]),
        (["trainer.max_steps=-2"], ["trainer.max_steps=-2", "≥ 1", "-1"]),
        (["trainer.max_epochs=0"], ["trainer.max_epochs=0", "trains nothing"]),
        (["trainer.limit_train_batches=0"], ["trainer.limit_train_batches=0", "trains nothing"]),
        (["seed=-1"], ["seed=-1", "[0, 4294967295]"]),
        (["seed=4294967296"], ["seed=4294967296", "[0, 4294967295]"]),
        ([f"run.name={'a' * 300}"], ["run.name", "300 bytes", "at most 255"]),
        (["optimizer.name=adamw"], ["optimizer=<file>"]),
        (["oops"], ["'oops'", "key=value"]),
    ],
)
def test_config_errors_name_the_key_and_the_allowed_values(args, needles):
    with pytest.raises(ConfigError) as err:
        compose([*PAPER, *args])
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_group_errors(tmp_path):
    with pytest.raises(ConfigError, match="no task chosen.*cifar10_resnet18"):
        compose(["optimizer=adamw", "trainer.max_steps=1"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("defaults: {model: x}\n")
    with pytest.raises(ConfigError, match="defaults.model: unknown group; allowed: task"):
        compose([f"experiment={bad}"])
    bad.write_text("task: {name: cifar10}\ntrainr: {max_steps: 1}\n")
    with pytest.raises(ConfigError, match=f"{bad}: trainr: .*allowed keys:.*trainer"):
        compose([f"experiment={bad}", "task=cifar10"])


def test_cli_reports_config_errors_as_one_line_and_debug_shows_the_traceback(capsys,
                                                                               monkeypatch):
    from muoneq.suite.cli import main

    assert main(["train", *PAPER, "optimizer.lrr=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("muoneq: ") and err.count("\n") == 1 and "Traceback" not in err
    what, fix = err.split("; ", 1)
    assert "optimizer.lrr" in what and "allowed keys: " in fix and "lr" in fix
    with pytest.raises(ConfigError, match="optimizer.lrr"):  # --debug: the exception itself
        main(["train", *PAPER, "optimizer.lrr=1", "--debug"])
    monkeypatch.setenv("MUONEQ_DEBUG", "1")
    with pytest.raises(ConfigError):
        main(["train", *PAPER, "optimizer.lrr=1"])
    monkeypatch.delenv("MUONEQ_DEBUG")
    assert main(["train", *PAPER, "--print-config", "optimizer=sgd"]) == 0
    out = capsys.readouterr().out
    assert "name: sgd" in out and "max_epochs: 100" in out
    assert main(["train", "--help"]) == 0
    assert "cifar10_resnet18" in capsys.readouterr().out


def test_default_run_names_are_unique_and_shell_safe():
    def name(*args):
        return compose([*PAPER, *args]).run.name

    assert name("seed=1") == "cifar10_resnet18-muoneq_nes-seed1"
    assert name("optimizer=sgd") == "cifar10_resnet18-sgd-seed0"
    long_root = "/data/" + "x" * 190
    a = name(f"task.data.root={long_root}/a.npz", "task.data.train_subset=512")
    b = name(f"task.data.root={long_root}/b.npz", "task.data.train_subset=51")
    assert a != b and len(a) < 120  # they differ after character 200: the hash tells them apart
    assert a.startswith("cifar10_resnet18-muoneq_nes-seed0-task.data.root=_data_xxx")
    odd = name("spectra.modules=['*conv*']", "task.model.blocks=[1,1]")
    assert re.fullmatch(r"[A-Za-z0-9_.=-]+", odd), odd
    # one setting, however it is written: the resolved value names the run
    assert name("optimizer.lr=5e-2", "optimizer.mode=RC") == name("optimizer.mode=RC",
                                                                  "optimizer.lr=0.05")
    assert name("optimizer.lr=0.5") != name("optimizer.lr=0.05")
    assert name("trainer=cpu") != name()  # a group choice is a setting too
    # keys that cannot change the result do not make another run
    assert name("trainer.progress=quiet", "trainer.log_every_n_steps=7", "resume=auto",
                "task.data.num_workers=3") == name()


def test_conf_dir_env(tmp_path, monkeypatch):
    monkeypatch.setenv("MUONEQ_CONF_DIR", str(tmp_path))
    assert conf_dir() == Path(tmp_path)
