"""What a sweep's trial pays besides its optimizer steps: ``muoneq bench-trial``
(``make bench-trial``).

Three parts, each printed as a table and written to ``benchmarks/results/trial_cpu.json`` and
``trial_cpu.md`` (their runs under ``runs/bench``):

1. ``phases``: one trial of ``make demo`` (its first run: a tiny LLaMA, 100 steps, validated
   every 5) run as the sweep runs it (:func:`muoneq.suite.sweeps.launch.trial_command`: the
   same arguments and environment, a process of its own) and traced from inside
   (:class:`~muoneq.suite.benchmarks.run_trace.RunTrace`): process start (the interpreter's),
   imports, config, model build, trainer and run folder, data set-up, the rest of the set-up,
   the first batch, the first step, the other steps, the validations, the rest of the training
   loop, what follows the fit (final validation, test, ``metrics.json``) and the process's exit.
   ``warm``: the same trial forked by a warm server (:mod:`muoneq.suite.sweeps.warm`, as
   ``make demo`` runs its trials), traced the same way (process start: from the request to the
   fork to its first statement), and what the server's start took (once per sweep).
2. ``study``: a study of six 2-step trials of the demo's model (two with ``--quick``), run as
   its ``muoneq sweep`` command with one worker, warm (``launch.warm=true``) and spawned
   (``launch.warm=false``): its wall time per trial, the trial's fixed cost as a user pays it
   (driver, preflight, server, imports, exit), beside a cold ``import torch`` (a new process,
   three times before and three after the studies: their median), and the warm server's module
   count and import time (the driver's log).
3. ``loop``: per workload (``llama``: that demo trial; ``resnet``: the CIFAR-10 recipe's
   ResNet-18 at width 8 on 2,560 synthetic images, one epoch, its test pass on 512), in this
   process, the run through :func:`muoneq.suite.runtime.train` with a trace and, between its own
   steps, the same work without Lightning (:func:`paired_trace`): the *raw step* (forward,
   backward, gradient clipping when the run clips, ``optimizer.step()`` and ``zero_grad`` on the
   micro-batches of the run's second step, as the model received them) and the *raw evaluation
   step* (the task's validation or test step on its first batch, in inference mode), medians.
   The figures:

   * ``loop_factor``: the training loop's time after its first step, validations left out,
     over (its steps × the raw step): what Lightning, the callbacks, logging and the data path
     add to a step;
   * ``step_factor``: the median traced step (first micro-batch to last) over the raw step:
     the part of that added inside the step;
   * ``eval_factor``: the time of every validation and test pass over (their batches × the
     raw evaluation step);
   * ``epoch_factor``: the fit's time after its first step, validations included, over (its
     steps × the raw step): the loop's time per step against the bare steps, as a user sees it.

The machine is named with its load average when the part started and ended: figures measured
under load are slower and noisier, ratios less so (both sides of each are measured in one
process, step by step in turn). ``--quick`` shrinks both parts to a smoke run (its figures say
so).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

#: Runs of ``loop``, by workload: the recipe, the overrides that shrink it, and with ``--quick``.
WORKLOADS = {
    "llama": ("the demo's trial (tiny LLaMA, pydoc topics as bytes)", [], [
        "trainer.max_steps=10"]),
    "resnet": ("ResNet-18 recipe at width 8, synthetic CIFAR-shaped images, one epoch", [
        "experiment=cifar10_resnet18", "trainer=cpu", "trainer.max_epochs=1",
        "trainer.progress=quiet", "task.model.width=8", "task.data.train_subset=2560"], [
        "task.model.width=4", "task.data.train_subset=640"]),
}
#: The child process of ``phases``: its first statement reads the clock.
CHILD = ("import time; started = time.time(); "
         "from muoneq.suite.benchmarks.bench_trial import traced_trial; traced_trial(started)")
#: The same, as a module a warm server forks (:mod:`~muoneq.suite.benchmarks.trial_child`).
WARM_CHILD = "muoneq.suite.benchmarks.trial_child"
#: The first phase of a trial: from its start to its first statement.
PROCESS_START = "process start"
#: The parts, in order.
PARTS = ("phases", "warm", "study", "loop")
#: Trials of the ``study`` part (``--quick``: the second), each a point of its grid.
STUDY_TRIALS = (6, 2)
#: The driver's line of a ready warm server (:class:`muoneq.suite.sweeps.launch.Launcher`).
SERVER_READY = re.compile(r"warm server ready \(pid \d+\): (\d+) modules imported, ([\d.]+) s "
                          r"after its start")


def load() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


# ----------------------------------------------------------------------------- the demo trial
def demo_trial(folder: Path, quick: bool) -> tuple[list[str], dict[str, str]]:
    """The ``muoneq train`` arguments and the environment of the demo's first run, as its sweep
    launches it, with its data (written once) and run folder under ``folder``."""
    from muoneq.suite.demo import demo_sweep, prepare_text
    from muoneq.suite.sweeps.launch import trial_command
    from muoneq.suite.sweeps.spec import spec_from_dict

    data = folder / "demo_data"
    prepare_text(data)
    sweep = demo_sweep(data)
    if quick:
        sweep["overrides"] = [*sweep["overrides"], *WORKLOADS["llama"][2]]
    spec = spec_from_dict(sweep, source="muoneq bench-trial")
    point, seed = spec.points()[0], spec.seeds[0]
    argv, env, _ = trial_command(spec, point, seed, folder / "demo_run", study_dir=folder)
    train_at = argv.index("train")
    if argv[train_at - 2:train_at] != ["-m", "muoneq"]:
        raise RuntimeError(f"the demo's trial command is not `python -m muoneq train`: {argv}")
    return argv[train_at + 1:], env


def traced_trial(started: float) -> None:
    """The child of ``phases``: ``muoneq train <argv>`` as the command runs it, with marks;
    writes them as JSON to ``sys.argv[1]``."""
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    marks = {"started": started}
    import torch._dynamo  # noqa: F401  (the config's optimizer check imports it: torch.optim)

    from muoneq.suite.runtime import cli
    from muoneq.suite.runtime.tasks import TASKS, get_task

    marks["cli_imported"] = time.time()
    cfg = cli.compose(argv)
    marks["composed"] = time.time()
    train = cli.load_train(cfg)
    from muoneq.suite.benchmarks.run_trace import RunTrace

    marks["imported"] = time.time()
    spec = get_task(cfg.task.name)

    def build(run_cfg):
        module, datamodule = spec.build(run_cfg)
        marks["built"] = time.time()
        setup = datamodule.setup

        def timed_setup(stage):
            marks.setdefault("data_setup_start", time.time())
            setup(stage)
            marks.setdefault("data_setup_end", time.time())

        datamodule.setup = timed_setup
        return module, datamodule

    TASKS[cfg.task.name] = dataclasses.replace(spec, build=build)
    trace = RunTrace()
    train(cfg, callbacks=[trace], argv=argv)
    marks["returned"] = time.time()
    out.write_text(json.dumps({"marks": marks, "trace": trace.to_dict()}))


def phase_table(spawned: float, exited: float, traced: dict) -> dict[str, float]:
    """Seconds of each phase of the traced trial, in order (they add up to its wall time)."""
    m, t = traced["marks"], traced["trace"]
    steps = t["steps"]
    first_start, first_end = steps[0]
    evals = [e for e in t["evaluations"] if e["in_fit"] and e["start"] >= first_end]
    after = [e for e in t["evaluations"] if not e["in_fit"]]
    later_steps = sum(end - start for start, end in steps[1:])
    validations = sum(e["end"] - e["start"] for e in evals)
    train_end = t["marks"]["train_end"]
    after_evals = sum(e["end"] - e["start"] for e in after)
    return {
        PROCESS_START: m["started"] - spawned,
        "imports": (m["cli_imported"] - m["started"]) + (m["imported"] - m["composed"]),
        "config": m["composed"] - m["cli_imported"],
        "model build": m["built"] - m["imported"],
        "trainer and run folder": m["data_setup_start"] - m["built"],
        "data set-up": m["data_setup_end"] - m["data_setup_start"],
        "optimizer and the rest of set-up": t["marks"]["train_start"] - m["data_setup_end"],
        "first batch": first_start - t["marks"]["train_start"],
        "first step": first_end - first_start,
        f"other {len(steps) - 1} steps": later_steps,
        f"{len(evals)} validations": validations,
        "rest of the training loop": train_end - first_end - later_steps - validations,
        "final validation and test": after_evals,
        "metrics.json and the rest after the fit": m["returned"] - train_end - after_evals,
        "exit": exited - m["returned"],
    }


def part_phases(folder: Path, quick: bool) -> dict:
    """Run the demo's first trial in a process of its own, traced (see the module docstring)."""
    argv, env = demo_trial(folder, quick)
    out = folder / "phases.json"
    _remove_run(_run_dir(argv))
    before = load()
    spawned = time.time()
    done = subprocess.run([sys.executable, "-c", CHILD, str(out), *argv], env=env,
                          capture_output=True, text=True)
    exited = time.time()
    if done.returncode != 0:
        raise RuntimeError(f"the traced trial failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return {"load_before": before, "load_after": load(),
            **_phases(spawned, exited, json.loads(out.read_text())), "argv": argv,
            "threads_env": env.get("OMP_NUM_THREADS")}


def part_warm(folder: Path, quick: bool) -> dict:
    """The same trial forked by a warm server, as the demo's sweep starts its trials."""
    import fcntl
    import threading

    from muoneq.suite.sweeps import launch, warm

    argv, env = demo_trial(folder, quick)
    out = folder / "phases_warm.json"
    run_dir = _run_dir(argv)
    _remove_run(run_dir)
    before = load()
    server = warm.Server(warm.RUNTIME_MODULE, env, folder / warm.SERVER_LOG)
    server.start()
    server.keep_log()
    try:
        server.wait_ready(threading.Event())
        ready = time.monotonic() - server.started
        run_dir.mkdir(parents=True)
        lock = os.open(run_dir / launch.LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with (folder / "trial_warm.log").open("wb") as log:
                spawned = time.time()
                trial = server.fork([sys.executable, "-m", WARM_CHILD, str(out), *argv],
                                    WARM_CHILD, env, log.fileno(), lock)
                code = trial.wait()
                exited = time.time()
        finally:
            os.close(lock)
    finally:
        server.close()
    if code != 0:
        raise RuntimeError(f"the traced warm trial failed ({code}): see {log.name}")
    return {"load_before": before, "load_after": load(), "server_ready_s": ready,
            "server_modules": server.modules,
            **_phases(spawned, exited, json.loads(out.read_text()))}


def cold_import_torch() -> float:
    """Seconds from the start of a new interpreter to its exit after ``import torch``."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - started


def part_study(folder: Path, quick: bool) -> dict:
    """A study of 2-step trials, warm and spawned, beside a cold ``import torch`` (see the
    module docstring)."""
    import yaml

    from muoneq.suite.demo import demo_sweep, prepare_text

    data = folder / "demo_data"
    prepare_text(data)
    trials = STUDY_TRIALS[quick]
    before = load()
    torch_s = [cold_import_torch() for _ in range(3)]
    result: dict = {"trials": trials}
    for choice, name in (("true", "warm"), ("false", "spawned")):
        sweep = demo_sweep(data)
        for key in ("bracket", "report"):
            sweep.pop(key)
        sweep.update(study=f"bench-study-{name}", seeds=[0],
                     overrides=[*sweep["overrides"], "trainer.max_steps=2"],
                     grid=[{"optimizer": ["adamw"],
                            "optimizer.lr": [round(1e-3 * (i + 1), 4) for i in range(trials)]}],
                     launch={**sweep["launch"], "warm": choice})
        path = folder / f"study_{name}.yaml"
        path.write_text(yaml.safe_dump(sweep, sort_keys=False))
        runs = folder / "study_runs"
        if (runs / sweep["study"]).is_dir():  # this benchmark's own study of an earlier call
            shutil.rmtree(runs / sweep["study"])
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "muoneq", "sweep", str(path), "--runs-dir",
                               str(runs)], capture_output=True, text=True)
        wall = time.perf_counter() - started
        if done.returncode != 0:
            raise RuntimeError(f"the {name} study failed ({done.returncode}):\n"
                               f"{done.stderr[-3000:]}")
        ready = SERVER_READY.search(done.stderr + done.stdout)
        result[name] = {"wall_s": wall, "per_trial_s": wall / trials,
                        **({"server_modules": int(ready[1]), "server_import_s": float(ready[2])}
                           if ready else {})}
    torch_s += [cold_import_torch() for _ in range(3)]
    result.update(import_torch_s=statistics.median(torch_s), import_torch_all_s=torch_s,
                  load_before=before, load_after=load())
    for name in ("warm", "spawned"):
        result[name]["per_import_torch"] = result[name]["per_trial_s"] / result["import_torch_s"]
    return result


def _run_dir(argv: list[str]) -> Path:
    return Path(next(a.partition("=")[2] for a in argv if a.startswith("run.dir=")))


def _phases(spawned: float, exited: float, traced: dict) -> dict:
    return {"wall_s": exited - spawned,
            "to_first_step_s": traced["trace"]["steps"][0][1] - spawned,
            "phases_s": phase_table(spawned, exited, traced)}


def _remove_run(run_dir: Path) -> None:
    """Remove the benchmark's own run folder of an earlier call (a run folder it made: it holds
    the ``config.yaml`` every run writes), so that the trial trains again."""
    import shutil

    if run_dir.is_dir() and (run_dir / "config.yaml").is_file():
        shutil.rmtree(run_dir)


# ----------------------------------------------------------------------------- the loop tax
class RawSteps:
    """The run's work without Lightning, on a fresh build of its module (the global random
    state left as it was): :meth:`step`, forward and backward of every micro-batch (loss divided
    by their count, as Lightning does), gradient clipping when the run clips,
    ``optimizer.step()`` and ``zero_grad``; :meth:`evaluate`, the task's validation or test step
    on one batch in inference mode."""

    def __init__(self, cfg) -> None:
        import torch

        from muoneq.suite.runtime.optim import build_optimizer_from_config
        from muoneq.suite.runtime.tasks import get_task

        with torch.random.fork_rng():
            self.module, _ = get_task(cfg.task.name).build(cfg)
        self.optimizer = build_optimizer_from_config(self.module.model,
                                                     self.module.optimizer_config)
        self.clip = cfg.trainer.gradient_clip_val
        self.started: set[str] = set()

    def step(self, micro_batches: list) -> None:
        import torch

        self.module.train()
        for i, batch in enumerate(micro_batches):
            loss = self.module.training_step(batch, i)
            (loss / len(micro_batches)).backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def evaluate(self, stage: str, batch) -> None:
        import torch

        self.module.eval()
        if stage not in self.started:
            getattr(self.module, f"on_{stage}_epoch_start")()
            self.started.add(stage)
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*self.log.*")  # no trainer: not kept
            getattr(self.module, f"{stage}_step")(batch, 0)


def paired_trace(cfg):
    """A :class:`~muoneq.suite.benchmarks.run_trace.RunTrace` that times the same work without
    Lightning (:class:`RawSteps`) between the run's own: one raw step next to every optimizer
    step from the third on (the second one's micro-batches are the raw step's; before odd steps,
    after even ones), and after every
    validation or test pass one raw evaluation step per batch of it (at most 4), so that both
    sides of each ratio meet the same load. Their time (``paused``) is taken out of the run's."""
    from muoneq.suite.benchmarks.run_trace import RunTrace

    class PairedTrace(RunTrace):
        def __init__(self) -> None:
            super().__init__(capture=True)
            self.raw = RawSteps(cfg)
            self.raw_step_s: list[float] = []
            self.raw_eval_s: dict[str, list[float]] = {}
            self.paused: list[tuple[float, float]] = []

        def _timed(self, fn) -> float:
            start = self._now()
            fn()
            end = self._now()
            self.paused.append((start, end))
            return end - start

        def _raw_step(self) -> None:
            micro = self.captured.micro_batches
            self.raw_step_s.append(self._timed(lambda: self.raw.step(micro)))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            # before every odd step from the third on, after every even one: neither side
            # always follows the other
            if self._step_start is None and len(self.steps) >= 2 and len(self.steps) % 2:
                self._raw_step()
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            done = len(self.steps)
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            if len(self.steps) > done >= 2 and done % 2 == 0:
                self._raw_step()

        def _end(self) -> None:
            super()._end()
            last = self.evaluations[-1]
            batch = self.captured.evaluation.get(last.stage)
            if batch is not None:
                times = self.raw_eval_s.setdefault(last.stage, [])
                for _ in range(min(last.batches, 4)):
                    times.append(self._timed(lambda: self.raw.evaluate(last.stage, batch)))

        def paused_between(self, start: float, end: float) -> float:
            return sum(b - a for a, b in self.paused if a >= start and b <= end)

    return PairedTrace()


def loop_figures(trace) -> dict:
    """The factors of the module docstring from a run's :func:`paired_trace`: ``step_factor``
    from medians (a typical step), the others from totals over means of the raw steps (both
    include what the load took from them: they met it in turn)."""
    steps = trace.step_seconds()
    first_end = trace.steps[0][1]
    window = trace.marks["train_end"] - first_end - trace.paused_between(
        first_end, trace.marks["train_end"])
    in_fit = trace.evaluation_seconds(in_fit=True, after=first_end)
    raw = statistics.fmean(trace.raw_step_s)
    raw_eval = {stage: statistics.fmean(t) for stage, t in trace.raw_eval_s.items()}
    bare = (len(steps) - 1) * raw
    eval_bare = sum(e.batches * raw_eval[e.stage] for e in trace.evaluations)
    traced = statistics.median(steps[2:] or steps)
    return {
        "steps": len(steps), "raw_steps": len(trace.raw_step_s),
        "raw_step_ms": statistics.median(trace.raw_step_s) * 1e3, "raw_step_ms_mean": raw * 1e3,
        "raw_eval_ms_mean": {k: v * 1e3 for k, v in raw_eval.items()},
        "step_ms_median": traced * 1e3, "step_ms_mean": statistics.fmean(steps[1:]) * 1e3,
        "loop_s": window - in_fit, "validation_in_fit_s": in_fit,
        "evaluations": len(trace.evaluations),
        "eval_batches": sum(e.batches for e in trace.evaluations),
        "eval_s": trace.evaluation_seconds(),
        "loop_factor": (window - in_fit) / bare,
        "step_factor": traced / statistics.median(trace.raw_step_s),
        "eval_factor": trace.evaluation_seconds() / eval_bare if eval_bare else None,
        "epoch_factor": window / bare,
    }


def part_loop(workload: str, folder: Path, quick: bool) -> dict:
    """One workload's run, traced, with its raw steps in between (see the module docstring)."""
    from muoneq.suite.benchmarks.gpu_check import with_synthetic_data
    from muoneq.suite.runtime import cli

    what, overrides, smaller = WORKLOADS[workload]
    run_dir = folder / f"loop_{workload}"
    _remove_run(run_dir)
    before = load()
    if workload == "llama":
        argv, _ = demo_trial(folder, quick)
        cfg = cli.compose([*[a for a in argv if not a.startswith("run.dir=")],
                           f"run.dir={run_dir}"])
    else:
        cfg = with_synthetic_data([*overrides, *(smaller if quick else []),
                                   f"run.dir={run_dir}"], folder / f"{workload}_data")
    train = cli.load_train(cfg)
    trace = paired_trace(cfg)
    train(cfg, callbacks=[trace])
    return {"workload": what, "load_before": before, "load_after": load(),
            **loop_figures(trace)}


# ----------------------------------------------------------------------------- output
def tables(result: dict) -> str:
    """The results as Markdown."""
    smoke = " (QUICK RUN: smoke values)" if result["quick"] else ""
    lines = [f"{result['device']}, torch {result['torch']}, {result['threads']} thread(s) in "
             f"the loop part; load averages (1/5/15 min) given per part{smoke}", ""]
    runs = {name: result[part] for name, part in (("spawned", "phases"), ("warm", "warm"))
            if part in result}
    if runs:
        lines += ["**One demo trial, as its sweep runs it**: spawned as its command, or forked "
                  "by a warm server", ""]
        for name, r in runs.items():
            server = (f"; the server was ready {r['server_ready_s']:.1f} s after its start, "
                      f"{r['server_modules']:,} modules imported (once per sweep)"
                      if "server_ready_s" in r else "")
            lines.append(f"- {name}: {r['wall_s']:.1f} s in all, {r['to_first_step_s']:.1f} s "
                         f"to the end of its first step; load {r['load_before']} → "
                         f"{r['load_after']}{server}")
        names = list(next(iter(runs.values()))["phases_s"])
        lines += ["", "| phase | " + " | ".join(f"{n} s | share" for n in runs) + " |",
                  "|---|" + "---:|---:|" * len(runs)]
        totals = {n: sum(r["phases_s"].values()) for n, r in runs.items()}
        for i, phase in enumerate(names):
            cells = []
            for n, r in runs.items():
                s = list(r["phases_s"].values())[i]
                cells.append(f"{s:.2f} | {s / totals[n]:.0%}")
            lines.append(f"| {phase} | " + " | ".join(cells) + " |")
        lines.append("")
    study = result.get("study")
    if study:
        lines += [f"**A study of {study['trials']} trials of 2 steps** (`muoneq sweep`, one "
                  "worker) beside a cold `import torch` (a new process: "
                  f"{study['import_torch_s']:.2f} s, the median of six, three before and three "
                  f"after; load {study['load_before']} → {study['load_after']})", "",
                  "| trials | study s | per trial s | per trial / import torch | warm server |",
                  "|---|---:|---:|---:|---|"]
        for name in ("warm", "spawned"):
            r = study[name]
            server = (f"{r['server_modules']:,} modules, imported in {r['server_import_s']:.1f} s"
                      if "server_modules" in r else "–")
            lines.append(f"| {name} | {r['wall_s']:.1f} | {r['per_trial_s']:.2f} | "
                         f"{r['per_import_torch']:.2f}× | {server} |")
        lines.append("")
    loops = result.get("loop", {})
    if loops:
        lines += ["**The training loop's overhead** (× the same work without Lightning)", "",
                  "| workload | steps | raw step ms | traced step ms | step | loop | "
                  "evaluations | epoch | load |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for name, r in loops.items():
            ev = "–" if r["eval_factor"] is None else (
                f"{r['eval_factor']:.2f}× ({r['eval_batches']} batches)")
            lines.append(
                f"| {name}: {r['workload']} | {r['steps']} | {r['raw_step_ms']:.1f} | "
                f"{r['step_ms_median']:.1f} | {r['step_factor']:.2f}× | {r['loop_factor']:.2f}× | "
                f"{ev} | {r['epoch_factor']:.2f}× | {r['load_before']} → {r['load_after']} |")
        lines += ["", "step: median traced step over the raw step; loop: the training loop "
                  "after its first step, validations left out, over steps × raw step; "
                  "evaluations: validation and test passes over batches × raw evaluation step; "
                  "epoch: the fit after its first step, validations included, over steps × raw "
                  "step."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="muoneq bench-trial",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated: {', '.join(PARTS)}")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"of the loop part, comma-separated: {', '.join(WORKLOADS)}")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the loop part (default 1, as the demo's trials)")
    parser.add_argument("--quick", action="store_true", help="smoke run: fewer steps, smaller")
    parser.add_argument("--out", type=Path, default=Path("runs/bench"),
                        help="folder of the benchmark's runs (default runs/bench)")
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"),
                        help="folder of trial_cpu.json and trial_cpu.md (default "
                             "benchmarks/results; with --quick: --out, smoke values are not "
                             "results)")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not parts or set(parts) - set(PARTS):
        parser.error(f"--parts: allowed: {', '.join(PARTS)}; got {args.parts!r}")
    if not workloads or set(workloads) - set(WORKLOADS):
        parser.error(f"--workloads: allowed: {', '.join(WORKLOADS)}; got {args.workloads!r}")
    if args.threads < 1:
        parser.error("--threads: must be ≥ 1")

    import torch

    from muoneq.suite import code_version
    from muoneq.suite.benchmarks.bench_step import device_name

    torch.set_num_threads(args.threads)
    folder = args.out / ("trial_quick" if args.quick else "trial")
    folder.mkdir(parents=True, exist_ok=True)
    version = code_version.taken()
    result = {"device": device_name(torch.device("cpu")),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "threads": args.threads, "torch": torch.__version__, "quick": args.quick,
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "commit": version.commit, "dirty": version.dirty, "cpus": os.cpu_count()}
    if "phases" in parts:
        result["phases"] = part_phases(folder, args.quick)
    if "warm" in parts:
        result["warm"] = part_warm(folder, args.quick)
    if "study" in parts:
        result["study"] = part_study(folder, args.quick)
    if "loop" in parts:
        result["loop"] = {w: part_loop(w, folder, args.quick) for w in workloads}
    path = args.out / "trial_cpu_quick.json" if args.quick else args.results / "trial_cpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    text = tables(result)
    path.with_suffix(".md").write_text(
        f"# make bench-trial\n\n{result['date']}, commit "
        f"{code_version.short_commit(result['commit'], result['dirty'])}; "
        f"{text}\n")
    print(text)
    print(f"\nwritten: {path} and {path.with_suffix('.md').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
