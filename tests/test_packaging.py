"""Two layers, two install targets (README "Install", docs/architecture.md).

* the library (``pip install muoneq``) needs torch and numpy only: importing it, stepping an
  optimizer and computing the diagnostics' metrics work with every suite package blocked;
* the import rule: no module of ``muoneq/`` outside ``muoneq/suite/`` imports the suite, the
  workloads (``muoneq_tasks``) or anything but the standard library, torch and numpy;
* the suite's commands without the suite say so in one line, naming the extra;
* composing a config never imports Lightning;
* a task is found through the ``muoneq.tasks`` entry points, a third-party one included;
* the wheel built from the repository holds every package, config and sweep file, declares
  torch and numpy as its only base requirements, and, installed beside the suite's packages,
  runs ``muoneq train --print-config`` and ``muoneq sweep <name> --dry-run`` from an empty
  folder with no environment variable.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

from muoneq.suite.folders import suite_folder
from muoneq.suite.report import load_study_data
from muoneq.suite.runtime import ConfigError, compose, conf_dir
from muoneq.suite.runtime.tasks import (
    ENTRY_POINT_GROUP,
    TaskSpec,
    get_task,
    register_task,
    task_names,
)
from muoneq.suite.sweeps import SweepError, load_sweep

ROOT = Path(__file__).resolve().parents[1]
#: (folder, package): where each installed package's source lies in the repository
SOURCE_ROOTS = ((ROOT, "muoneq"), (ROOT / "tasks", "muoneq_tasks"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: The suite extra's packages (and what they bring), blocked to stand for a library-only install.
SUITE_MODULES = ("lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics", "optuna",
                 "omegaconf", "yaml", "tensorboard", "matplotlib", "torchvision", "tiktoken",
                 "tokenizers", "datasets", "sqlalchemy", "psycopg")
#: Raises ImportError for every module of SUITE_MODULES, as if they were not installed.
BLOCKER = textwrap.dedent(f"""
    import sys

    class BlockSuite:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in {SUITE_MODULES!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, BlockSuite())
""")


def python(code: str, *, cwd: Path = ROOT, env: dict | None = None,
           executable: str = sys.executable) -> subprocess.CompletedProcess:
    return subprocess.run([executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env)


# ------------------------------------------------------------------------------------- layers
def test_every_package_folder_is_installed():
    """Every folder of muoneq/ and tasks/ holding an ``__init__.py`` is a listed package; conf/
    and sweeps/ are package data."""
    config = PYPROJECT["tool"]["setuptools"]
    found = {".".join(init.parent.relative_to(root).parts)
             for root, top in SOURCE_ROOTS for init in (root / top).rglob("__init__.py")}
    assert found - set(config["packages"]) == set(), "add these to [tool.setuptools] packages"
    assert config["package-dir"] == {"muoneq_tasks": "tasks/muoneq_tasks",
                                     "muoneq.suite.shipped.conf": "conf",
                                     "muoneq.suite.shipped.sweeps": "sweeps"}


def imported_modules(path: Path) -> set[str]:
    """Every module an ``import`` statement of ``path`` names, at any depth (relative ones
    resolved)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            names.add(".".join(filter(None, (base, node.module))))
    return names


def test_the_library_never_imports_the_suite():
    """The import rule of the two layers: a module of muoneq/ outside muoneq/suite/ imports the
    standard library, torch, numpy and the library only, and imports nothing by name at run time
    (so that this check sees every import). ``muoneq/__main__.py`` is the ``python -m muoneq``
    entry point of the suite's command: run, never imported by the library. The Triton kernels
    (``muoneq/ns_triton.py``, imported only for ``ns_backend="triton"``/``"auto"``) also import
    triton, which torch's Linux wheels bring."""
    library = [p for p in (ROOT / "muoneq").rglob("*.py")
               if p.relative_to(ROOT / "muoneq").parts[0] != "suite" and p.name != "__main__.py"]
    assert len(library) >= 20
    allowed = set(sys.stdlib_module_names) | {"torch", "numpy", "muoneq"}
    for path in library:
        own = allowed | ({"triton"} if path.name == "ns_triton.py" else set())
        for name in imported_modules(path):
            where = f"{path.relative_to(ROOT)} imports {name}"
            assert name.partition(".")[0] in own, where + ": the library needs torch only"
            assert not name.startswith("muoneq.suite"), where + ": the library never imports " \
                                                                "the suite"
        text = path.read_text()
        assert "import_module(" not in text and "__import__(" not in text, path


def run_time_imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports when it runs, at any depth (a function's
    imports too; ``if TYPE_CHECKING:`` blocks, which never run, left out), ``from package import
    module`` as that module."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree)
                   if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
                   for n in ast.walk(block)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(filter(None, (base, node.module)))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found & modules


def test_no_import_circle_in_the_sweeps():
    """muoneq.suite.sweeps' modules import each other in one direction (a warm server imports
    warm.py, which must pull nothing of the sweep with it)."""
    folder = ROOT / "muoneq" / "suite" / "sweeps"
    names = {p: ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
             for p in folder.glob("*.py")}
    graph = {names[p]: run_time_imports(p, set(names.values())) - {names[p]} for p in names}
    visiting: list[str] = []

    def visit(module: str, done: set[str]) -> None:
        if module in visiting:
            raise AssertionError("import circle: " + " → ".join(
                [*visiting[visiting.index(module):], module]))
        if module in done:
            return
        visiting.append(module)
        for imported in sorted(graph[module]):
            visit(imported, done)
        visiting.pop()
        done.add(module)

    done: set[str] = set()
    for module in sorted(graph):
        visit(module, done)
    assert graph["muoneq.suite.sweeps.warm"] == set()


def test_the_suite_reaches_the_workloads_through_the_task_registry():
    """The import rule's other direction: no module of muoneq/suite/ imports a workload
    (``muoneq_tasks``), by an import statement or by a module path it imports at run time; it
    reaches them by task name (``muoneq.suite.runtime.tasks``: a task's builder, its synthetic
    data, the commands it brings), as it reaches a third-party task."""
    suite = sorted((ROOT / "muoneq" / "suite").rglob("*.py"))
    assert len(suite) >= 40
    module_path = re.compile(r"muoneq_tasks(\.\w+)*(:\w+)?")
    for path in suite:
        tree = ast.parse(path.read_text(), str(path))
        for name in imported_modules(path):
            assert name.partition(".")[0] != "muoneq_tasks", \
                f"{path.relative_to(ROOT)} imports {name}: reach it through the task registry"
        named = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                 and isinstance(node.value, str) and module_path.fullmatch(node.value)]
        assert not named, f"{path.relative_to(ROOT)} names {named}: reach it through the " \
                          "task registry"


def test_the_library_needs_no_suite_package():
    code = BLOCKER + textwrap.dedent("""
        import json
        import torch
        import muoneq
        from muoneq import build_optimizer, muoneq_update
        from muoneq.diagnostics import error_decomposition, stable_rank

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        before = model[0].weight.detach().clone()
        opt = build_optimizer("muoneq_nes", model, lr=0.01)
        model(torch.randn(5, 8)).square().sum().backward()
        opt.step()
        moved = not torch.equal(before, model[0].weight)
        update = muoneq_update(torch.randn(6, 4), torch.zeros(6, 4), ns_dtype=torch.float32)
        metrics = [float(stable_rank(update)), sorted(error_decomposition(torch.randn(6, 4)))]
        suite = sorted(m for m in sys.modules
                       if m.split(".")[0] == "muoneq_tasks" or m.startswith("muoneq.suite"))
        print(json.dumps({"moved": moved, "metrics": metrics, "suite": suite}))
    """)
    done = python(code)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["moved"] and result["suite"] == []
    assert result["metrics"][0] > 0 and result["metrics"][1] == ["C", "R", "RC", "none"]


def test_a_suite_command_without_the_suite_names_the_extra():
    code = BLOCKER + textwrap.dedent("""
        from muoneq.suite.cli import main
        assert main(["--help"]) == 0
        sys.exit(main(["train", "experiment=cifar10_resnet18", "--print-config"]))
    """)
    done = python(code)
    assert done.returncode == 2, done.stderr[-3000:]
    install = r'which is not installed; install the experiment suite: pip install "muoneq\[suite\]"'
    assert re.fullmatch(  # --help, then train
        rf"muoneq: note: the tasks' commands need the module '(omegaconf|yaml)', {install}\n"
        rf"muoneq: train needs the module '(omegaconf|yaml)', {install}\n", done.stderr), \
        done.stderr
    assert "usage: muoneq" in done.stdout


def test_composing_a_config_imports_no_lightning():
    code = textwrap.dedent("""
        import sys
        from muoneq.suite.cli import main
        assert main(["train", "experiment=cifar10_resnet18", "--print-config"]) == 0
        assert main(["train", "experiment=llama130m_c4", "--print-config"]) == 0
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "torchvision")))
    """)
    done = python(code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "[]"


# ---------------------------------------------------------------------------------- task plugins
def test_the_suite_declares_its_tasks_as_entry_points():
    declared = PYPROJECT["project"]["entry-points"][ENTRY_POINT_GROUP]
    assert set(declared) == {"cifar10", "language"} <= set(task_names())
    for name, target in declared.items():
        module, attr = target.split(":")
        assert get_task(name) is getattr(__import__(module, fromlist=[attr]), attr)


PLUGIN = '''
"""A workload of another distribution: a config dataclass, a builder and a command."""
from dataclasses import dataclass, field

from muoneq.suite.runtime import TaskSpec
from muoneq.suite.runtime.tasks import TaskCommand


@dataclass
class ToyData:
    rows: int = 64


@dataclass
class ToyConfig:
    name: str = "toy"
    width: int = 3
    data: ToyData = field(default_factory=ToyData)

    def __post_init__(self):
        if self.width < 1:
            raise ValueError(f"task.width: must be >= 1, got {self.width}")


def build(cfg):
    raise NotImplementedError("this test only composes configs")


TASK = TaskSpec(ToyConfig, build, "a third-party toy task",
                commands={"toy-count": TaskCommand("toy_plugin.count", "count the arguments")})
'''
#: The module of the command the toy task brings.
PLUGIN_COMMAND = '''
def main(argv):
    print(f"toy-count: {len(argv)} arguments")
    return 3
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A distribution ``toy-plugin`` on ``sys.path`` whose ``muoneq.tasks`` entry points are
    ``toy = "toy_plugin:TASK"`` and one that cannot be imported, as ``pip install`` of such a
    package leaves them."""
    site = tmp_path / "site"
    (site / "toy_plugin").mkdir(parents=True)
    (site / "toy_plugin" / "__init__.py").write_text(PLUGIN)
    (site / "toy_plugin" / "count.py").write_text(PLUGIN_COMMAND)
    info = site / "toy_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\ntoy = toy_plugin:TASK\nbroken = no_such_module:TASK\n")
    (tmp_path / "toy.yaml").write_text("name: toy\nwidth: 5\n")
    monkeypatch.syspath_prepend(str(site))
    yield site
    from muoneq.suite.runtime.tasks import TASKS

    TASKS.pop("toy", None)


def test_a_third_party_task_is_found_through_its_entry_point(plugin, tmp_path):
    assert "toy" in task_names()
    spec = get_task("toy")
    assert spec.description == "a third-party toy task"
    with pytest.raises(ValueError, match="task name 'toy' is already registered"):
        register_task("toy", spec)
    with pytest.raises(ValueError, match="unknown task 'toyy'; known: .*cifar10.*toy"):
        get_task("toyy")
    with pytest.raises(ValueError, match=r"task 'broken' \(no_such_module:TASK\) cannot be "
                       "imported: No module named 'no_such_module'; reinstall the package"):
        get_task("broken")
    # the `muoneq` command composes its config as a built-in task's: typed by its dataclass
    env = {**os.environ, "PYTHONPATH": str(plugin)}
    command = [sys.executable, "-m", "muoneq", "train", f"task={tmp_path / 'toy.yaml'}",
               "trainer.max_steps=10", "--print-config"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"task:\n  name: toy\n  width: 5\n  data:\n    rows: 64\n", done.stdout)
    with pytest.raises(ConfigError, match="task.width: must be >= 1, got 0"):
        compose([f"task={tmp_path / 'toy.yaml'}", "trainer.max_steps=10", "task.width=0"])
    # the command it brings is a `muoneq` command (the broken task's absence noted, not fatal)
    done = subprocess.run([sys.executable, "-m", "muoneq", "toy-count", "a", "b"], cwd=tmp_path,
                          capture_output=True, text=True, env=env)
    assert (done.returncode, done.stdout) == (3, "toy-count: 2 arguments\n"), done.stderr
    done = subprocess.run([sys.executable, "-m", "muoneq", "--help"], cwd=tmp_path,
                          capture_output=True, text=True, env=env)
    assert "  toy-count  count the arguments\n" in done.stdout
    assert "  data       tokenize a corpus" in done.stdout
    assert "muoneq: note: task.name: task 'broken' (no_such_module:TASK) cannot be imported" \
        in done.stderr


def test_register_task_adds_a_workload_of_the_running_program():
    from dataclasses import dataclass

    @dataclass
    class Inline:
        name: str = "inline"

    spec = TaskSpec(Inline, build=lambda cfg: (None, None))
    register_task("inline", spec)
    try:
        assert get_task("inline") is spec and "inline" in task_names()
        with pytest.raises(ValueError, match="already registered"):
            register_task("cifar10", spec)  # the name of an entry point
    finally:
        from muoneq.suite.runtime.tasks import TASKS

        TASKS.pop("inline")


# --------------------------------------------------------------------------------- shipped files
def test_sweeps_and_reports_take_the_name_of_a_shipped_sweep(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no sweeps/ here
    assert load_sweep("ablation-cifar10") == load_sweep(ROOT / "sweeps" / "ablation-cifar10.yaml")
    assert load_sweep("ksweep-gpt2.yaml").study == "ksweep-gpt2"
    with pytest.raises(SweepError, match="sweep file not found: ablation-cifar11; give a path to "
                       "a sweep file or the name of one muoneq ships: ablation-cifar10, "
                       "ablation-gpt2, "):
        load_sweep("ablation-cifar11")
    with pytest.raises(SweepError, match="no study at runs/ablation-cifar10/optuna.journal"):
        load_study_data("ablation-cifar10")  # found by name; the study is not run yet
    with pytest.raises(SweepError, match="x: neither a sweep file, a study folder nor the name"):
        load_study_data("x")


def test_conf_dir_is_the_shipped_conf_unless_muoneq_conf_dir_names_another(tmp_path,
                                                                          monkeypatch):
    monkeypatch.delenv("MUONEQ_CONF_DIR", raising=False)
    assert conf_dir() == suite_folder("conf") == ROOT / "conf"  # a checkout: its own folders
    assert suite_folder("sweeps") == ROOT / "sweeps"
    monkeypatch.setenv("MUONEQ_CONF_DIR", str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="config folder .*none does not exist; point "
                       "MUONEQ_CONF_DIR at a folder of configs"):
        compose(["experiment=cifar10_resnet18"])


# ----------------------------------------------------------------------------------------- wheel
def requirement_names(metadata: str, extra: str | None) -> set[str]:
    """Distribution names of the wheel's ``Requires-Dist`` lines for ``extra`` (None: base)."""
    names = set()
    for line in re.findall(r"^Requires-Dist: (.*)$", metadata, re.M):
        marker = re.search(r'extra == "([^"]+)"', line)
        if (marker.group(1) if marker else None) == extra:
            names.add(re.match(r"[A-Za-z0-9_.-]+", line).group(0).lower())
    return names


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of a copy of the repository (what a clean clone builds), offline."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    skip = shutil.ignore_patterns(".git", ".venv", "runs", "build", "*.egg-info", "__pycache__",
                                  ".pytest_cache", ".ruff_cache", "data", ".whl")
    shutil.copytree(ROOT, source, ignore=skip)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                           "--no-build-isolation", "--no-index", "-w", str(tmp / "dist"),
                           str(source)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = (tmp / "dist").glob("muoneq-*.whl")
    return built


@pytest.mark.slow
def test_the_wheel_holds_the_library_the_suite_and_its_files(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = archive.read(metadata).decode()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entry_points = archive.read(entry_points).decode()
    assert requirement_names(metadata, None) == {"torch", "numpy"}
    # the license as an SPDX expression (PEP 639): setuptools ≥ 77 prints a deprecation banner
    # at every build of a project whose license is a TOML table
    assert "\nLicense-Expression: Apache-2.0\n" in metadata
    assert {"lightning", "omegaconf", "optuna", "torchvision"} <= requirement_names(
        metadata, "suite")
    code = {str(p.relative_to(root)) for root, top in SOURCE_ROOTS
            for p in (root / top).rglob("*.py")}
    data = {f"muoneq/suite/shipped/{p.relative_to(ROOT)}" for top in ("conf", "sweeps")
            for p in (ROOT / top).rglob("*.yaml")}
    assert code | data <= names, sorted((code | data) - names)
    assert (f"[{ENTRY_POINT_GROUP}]\ncifar10 = muoneq_tasks.vision:TASK\n"
            "language = muoneq_tasks.language:TASK") in entry_points


@pytest.mark.slow
def test_the_installed_wheel_trains_and_sweeps_from_an_empty_folder(wheel, tmp_path):
    """The wheel installed (``--no-deps``) in a fresh venv that sees this environment's
    packages through a ``.pth`` file (the suite extra, installed), run from an empty folder."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    bin_dir = venv / "bin"
    site = subprocess.run([bin_dir / "python", "-c", "import sysconfig; "
                           "print(sysconfig.get_paths()['purelib'])"], capture_output=True,
                          text=True, check=True).stdout.strip()
    Path(site, "suite_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), "install",
                    "-q", "--no-deps", "--no-index", str(wheel)], check=True, timeout=300)
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MUONEQ_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(bin_dir / "muoneq"), *argv], cwd=empty, capture_output=True,
                              text=True, env=env, timeout=300)

    where = python("import muoneq, muoneq_tasks; print(muoneq.__file__); "
                   "print(muoneq_tasks.__file__)",
                   cwd=empty, env=env, executable=str(bin_dir / "python"))
    assert where.stdout.split() == [f"{site}/muoneq/__init__.py",
                                    f"{site}/muoneq_tasks/__init__.py"]
    done = run("train", "experiment=cifar10_resnet18", "--print-config")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "  name: cifar10\n" in done.stdout and "  name: muoneq_nes\n" in done.stdout
    listing = run("train", "--help").stdout
    assert f"config folder: {site}/muoneq/suite/shipped/conf" in listing
    assert re.search(r"experiment +cifar10_resnet18, gpt2_small_fineweb", listing)
    sweep = run("sweep", "ablation-cifar10", "--dry-run", "--set", "seeds=[0]")
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    assert ("checked: 25 training configs compose and type-check as `muoneq train` (every "
            "value of every axis, once in each config shape)") in sweep.stdout
    assert sorted(p.name for p in empty.iterdir()) == []
