"""The ``muoneq`` command (also ``python -m muoneq``): one sub-command per job.

Sub-commands are imported lazily so that ``muoneq --help`` stays fast and a missing optional
dependency of one job never breaks another. Each entry names a ``main(argv) -> int``. The
suite's own are :data:`COMMANDS`; a task brings its own through the task registry
(:attr:`muoneq.suite.runtime.tasks.TaskSpec.commands`, e.g. the language task's ``muoneq data``):
the suite never imports a workload by name.

The commands are the experiment suite's: without its packages (``pip install "muoneq[suite]"``)
a command says so in one line, naming the missing module.

Expected mistakes (:class:`muoneq.suite.errors.UserError`) are printed as one line,
``muoneq: <what>; <how to fix>``, with exit status 2 (a full disk 4, a divergence 3, a signal
130/143), and so is a file or folder the user may not read or write, or a read-only disk
(:func:`muoneq.suite.files.no_access`), and Ctrl-C where a command has no handler of its own
(``muoneq: <command> interrupted (Ctrl-C)``, status 130); ``--debug`` (anywhere on the
command line) or ``MUONEQ_DEBUG=1`` shows their traceback instead.
"""

from __future__ import annotations

import importlib
import os
import shlex
import shutil
import sys
from pathlib import Path

from muoneq.suite.errors import Interrupted, UserError, format_error
from muoneq.suite.files import NO_ACCESS, no_access

#: What installs every command's dependencies (the library alone needs torch and numpy).
SUITE_INSTALL = 'pip install "muoneq[suite]"'

#: sub-command → (module, one-line description). Modules expose ``main(argv: list[str]) -> int``.
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": (
        "muoneq.suite.benchmarks.bench_step",
        "time one optimizer step vs torch.optim.Muon on GPT-2/LLaMA/ResNet matrix sets",
    ),
    "bench-trial": (
        "muoneq.suite.benchmarks.bench_trial",
        "what a sweep's trial pays besides its steps: phases of a demo trial, loop overhead",
    ),
    "demo": (
        "muoneq.suite.demo",
        "the main job: a miniature of the paper's ablation, offline on a CPU (make demo)",
    ),
    "gpu-check": (
        "muoneq.suite.benchmarks.gpu_check",
        "check every GPU path and record it in benchmarks/results/<device>.json",
    ),
    "spectra": (
        "muoneq.suite.spectra.cli",
        "Newton–Schulz geometry study on synthetic matrices (paper Figure 1)",
    ),
    "sweep": (
        "muoneq.suite.sweeps.cli",
        "run or continue an Optuna study of trial processes (sweeps/*.yaml)",
    ),
    "report": (
        "muoneq.suite.report.cli",
        "tables, heatmaps and plots of a study (runs/<study> or a sweep file)",
    ),
    "train": (
        "muoneq.suite.runtime.cli",
        "train one run: muoneq train experiment=cifar10_resnet18 optimizer=muoneq_nes seed=1",
    ),
}


def all_commands() -> tuple[dict[str, tuple[str, str]], list[str]]:
    """The suite's commands and those the tasks bring, name → (module, description), and a line
    for each task that cannot be loaded."""
    from muoneq.suite.runtime.tasks import task_commands

    commands, broken = task_commands()
    brought = {name: (c.module, c.description) for name, (_, c) in commands.items()}
    if clash := sorted(brought.keys() & COMMANDS.keys()):
        raise ValueError(f"a task brings the command(s) {clash}, which the suite has")
    return {**COMMANDS, **brought}, broken
def program(name: str = "muoneq", module: str | None = None) -> str:
    """How to type the console script ``name`` of this Python environment (``muoneq``,
    ``tensorboard``) so that it runs as printed: its bare name when the ``PATH`` finds this very
    script (an activated environment), else its path (``.venv/bin/tensorboard`` from the
    checkout), else ``python -m module`` with this interpreter (default module: ``name``)."""
    script = Path(sys.executable).parent / name
    if not script.is_file():
        return shlex.join([sys.executable, "-m", module or name])
    found = shutil.which(name)
    if found is not None and Path(found).resolve() == script.resolve():
        return name
    try:
        return str(script.relative_to(Path.cwd()))
    except ValueError:
        return str(script)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("MUONEQ_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    commands, broken = COMMANDS, []
    if not (argv and argv[0] in COMMANDS):  # the suite's own load no task
        try:
            commands, broken = all_commands()
        except ModuleNotFoundError as err:  # without the suite, no task loads
            broken = [f"the tasks' commands need the module {err.name!r}, which is not "
                      f"installed; install the experiment suite: {SUITE_INSTALL}"]
        except ValueError as err:
            print(f"muoneq: {err}", file=sys.stderr)
            return 2
    notes = "".join(f"\nmuoneq: note: {line}" for line in broken)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print("usage: muoneq [--debug] <command> [args...]\n\ncommands:")
        for name, (_, text) in sorted(commands.items()):
            print(f"  {name:<10} {text}")
        if notes:
            print(notes.lstrip("\n"), file=sys.stderr)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in commands:
        print(f"muoneq: unknown command {name!r}; known: {', '.join(sorted(commands))}{notes}",
              file=sys.stderr)
        return 2
    module = commands[name][0]
    try:
        return int(importlib.import_module(module).main(rest) or 0)
    except KeyboardInterrupt:  # Ctrl-C where the command handles no signal of its own
        if debug:
            raise
        sys.stderr.write(f"muoneq: {name} interrupted (Ctrl-C)\n")
        return Interrupted.exit_code
    except (UserError, OSError) as err:
        if debug or not (isinstance(err, UserError) or err.errno in NO_ACCESS):
            raise
        err = err if isinstance(err, UserError) else no_access(err)
        # one write: the processes of a distributed run share the stream, and print() writes
        # the newline apart, so that their lines could run together
        sys.stderr.write(format_error(err) + "\n")
        return err.exit_code
    except ModuleNotFoundError as err:
        # a module of this package or of the command's own is a broken installation
        own = {"muoneq", module.partition(".")[0]}
        if debug or err.name is None or err.name.partition(".")[0] in own:
            raise
        print(f"muoneq: {name} needs the module {err.name!r}, which is not installed; install "
              f"the experiment suite: {SUITE_INSTALL}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
