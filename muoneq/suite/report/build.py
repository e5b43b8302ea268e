"""Write every artifact a study's ``report:`` section asks for into ``<study>/report/``."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from optuna.trial import TrialState

from muoneq.suite.report import machine, optuna_views, paired, speedup
from muoneq.suite.report import plan_tables as plan_report
from muoneq.suite.report.figures import (
    Palette,
    heatmaps,
    learning_curves,
    line_plot,
    robustness_markdown,
)
from muoneq.suite.report.records import StudyData
from muoneq.suite.report.tables import Table, build_table, to_latex, to_markdown
from muoneq.suite.sweeps.report_spec import HeatmapSpec, LineSpec, TableSpec
from muoneq.suite.sweeps.spec import SweepError


@dataclass
class Report:
    out_dir: Path
    markdown: str  #: everything as one Markdown document (also written to report.md)
    tables: list[Table] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)


def write_report(data: StudyData, out_dir: Path | None = None, tensorboard: bool = True) -> Report:
    """Tables (Markdown + LaTeX) with their paired differences and speedups, heatmaps +
    robustness, line plots and learning curves.

    With ``tensorboard``, figures and tables also go to ``<out_dir>/tensorboard`` as images
    and text, replacing those of an earlier report. Without a ``report:`` section, one table of
    the objective at each setting's best learning rate (if there is an ``optimizer.lr`` axis)
    is written.
    """
    why = nothing_to_report(data)
    if why is not None:
        raise SweepError(f"study {data.spec.study!r} {why}")
    out_dir = Path(out_dir or data.study_dir / "report")
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = None
    if tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        shutil.rmtree(out_dir / "tensorboard", ignore_errors=True)  # this report replaces it
        writer = SummaryWriter(str(out_dir / "tensorboard"))
    rep = data.spec.report
    tables = rep.tables or ([] if rep.heatmaps or rep.lines else [
        TableSpec(name="table", select=[a for a in ("optimizer.lr",) if a in data.axes])])
    report = Report(out_dir, "")
    # the grid as written first (its order), then whatever bracketing or a search added
    points = [p.as_dict() for p in data.spec.points()] + [{a: r.get(a) for a in data.axes}
                                                          for r in data.runs]
    palette = Palette(points)  # one colour per method in every figure
    parts = [_header(data), _plan_section(data, report, writer)]
    parts += [_table_section(data, tspec, points, palette, report, writer) for tspec in tables]
    parts += [_heatmap_section(data, hspec, report, writer) for hspec in rep.heatmaps]
    parts += [_line_section(data, lspec, palette, report, writer) for lspec in rep.lines]
    if rep.curves is not None:
        parts.append(_curve_section(data, palette, report, writer))
    views = optuna_views.write_views(data, out_dir, writer, palette)
    if views is not None:
        report.files += views.files
        parts.append(optuna_views.to_markdown(views))
    if writer is not None:
        writer.close()
    report.markdown = "".join(parts)
    (out_dir / "report.md").write_text(report.markdown)
    report.files.append(out_dir / "report.md")
    return report


def nothing_to_report(data: StudyData) -> str | None:
    """Why no table or figure of the study would hold a value (no finished run yet, or every
    finished run diverged), with what to do; None when there is something to report."""
    if not data.runs:
        return ("has no finished run yet; wait for its first run to finish (muoneq sweep … "
                "--status counts them)")
    if any(run.get("_status") != "diverged" for run in data.runs):
        return None
    first = data.runs[0]
    example = (f" ({first['_run_dir']} at step {first['diverged_at_step']}: {first['diverged']})"
               if first.get("diverged") else "")
    return (f"has {len(data.runs)} finished runs and every one diverged{example}, so no table "
            "or figure would hold a value; run it again with lower learning rates (the grid "
            "extended below its lowest optimizer.lr) or a larger trainer.divergence_patience")


def _header(data: StudyData) -> str:
    """The study's name, description, what its runs trained, number of runs and objective."""
    spec = data.spec
    ran = what_ran(data.runs)
    parts = [f"# {spec.study}\n", f"{spec.description}\n" if spec.description else "",
             f"\n{ran}\n" if ran else "",
             f"\n{len(data.runs)} finished runs; objective {data.objective} "
             f"({data.direction}).\n"]
    pruned = sum(t.state == TrialState.PRUNED for t in data.trials)
    if pruned:
        parts.append(f"\n{pruned} trial{'s were' if pruned > 1 else ' was'} pruned (stopped "
                     "early by Optuna's pruner, prune:), left out of the tables.\n")
    if data.duplicates:
        parts.append(f"\nWarning: trials {data.duplicates} repeat a finished run; ignored.\n")
    return "".join(parts)


#: the model's settings a report names, of ``task.model`` in a run's config.yaml
MODEL_KEYS = ("arch", "size", "blocks", "width")


def _count(n: float) -> str:
    """``41k``, ``2.6B``: a token count as the paper writes its budgets."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:g}"


def what_ran(runs: list[dict]) -> str:
    """One line saying what the study's runs trained, read from what they wrote (so that a
    miniature's report says "40 steps, 41k tokens of a tiny GPT-2 in float32 on a CPU", and a
    paper-scale one its budget): each run's steps and tokens (``metrics.json``; a range when
    runs differ), and the first run's model, precision, device and data (``config.yaml``)."""
    from muoneq.suite.runtime import record

    if not runs:
        return ""

    def span(key: str, show) -> str | None:
        values = sorted({r[key] for r in runs if isinstance(r.get(key), int | float)})
        if not values:
            return None
        return show(values[0]) if len(values) == 1 else f"{show(values[0])}–{show(values[-1])}"

    steps, tokens = span("global_step", lambda v: f"{v:,}"), span("tokens", _count)
    budget = ", ".join(x for x in (steps and f"{steps} optimizer steps",
                                   tokens and f"{tokens} tokens") if x)
    try:
        config = record.read_record(Path(runs[0]["_run_dir"])) or {}
    except (OSError, ValueError):
        config = {}
    task, trainer = config.get("task") or {}, config.get("trainer") or {}
    model = " ".join(f"{k}={v}" for k, v in (task.get("model") or {}).items()
                     if k in MODEL_KEYS and v is not None)
    data = task.get("data") or {}
    where = data.get("dir") or data.get("root")
    parts = [f"Each run: {budget}" if budget else "Each run",
             f"of {task.get('name', 'its task')} ({model})" if model else "",
             f"in {trainer['precision']}" if trainer.get("precision") else "",
             f"on {runs[0]['device']}" if runs[0].get("device") else "",
             f"(trainer.accelerator={trainer['accelerator']})" if trainer.get("accelerator")
             else "", f"reading {where}" if where else ""]
    if parts[1:] == [""] * (len(parts) - 1) and not budget:
        return ""  # runs that recorded neither (no `muoneq train`)
    return " ".join(p for p in parts if p) + "."


def _plan_section(data: StudyData, report: Report, writer) -> str:
    """What the study's plan ran (``plan.md``), when it has one."""
    plan_md = plan_report.to_markdown(data.plan)
    if plan_md:
        (report.out_dir / "plan.md").write_text(plan_md.lstrip())
        report.files.append(report.out_dir / "plan.md")
        if writer is not None:
            writer.add_text("plan", plan_md)
    return plan_md


def _table_section(data: StudyData, tspec: TableSpec, points: list[dict], palette: Palette,
                   report: Report, writer) -> str:
    """One table (Markdown, LaTeX) with its paired differences and speedups."""
    out_dir = report.out_dir
    table = build_table(data.runs, tspec, data.axes, data.objective, data.direction, points,
                        search=data.spec.kind == "tpe")
    found = paired.comparisons(table) if tspec.deltas else []
    md = (to_markdown(table) + paired.to_markdown(table, found)
          + machine.timing_note(data.runs, [m.key for m in table.metrics]))
    figures = []
    if found and tspec.speedup is not None:
        speedups = speedup.speedups(found, table.metrics[0].key, tspec.speedup, out_dir,
                                    tspec.name, writer, palette)
        md += speedup.to_markdown(speedups, tspec.speedup)
        figures = [s.path for s in speedups if s.path is not None]
        report.files += [*figures, out_dir / f"speedup_{tspec.name}.csv"]
    texts = {"md": md, "tex": to_latex(table)}
    if found:
        texts["paired.tex"] = paired.to_latex(table, found)
    for suffix, text in texts.items():
        path = out_dir / f"table_{tspec.name}.{suffix}"
        path.write_text(text)
        report.files.append(path)
    if writer is not None:
        writer.add_text(f"table/{tspec.name}", md)
    report.tables.append(table)
    return f"\n## Table: {tspec.name}\n\n{md}" + "".join(
        f"\n![{path.stem}]({path.name})\n" for path in figures)


def _heatmap_section(data: StudyData, hspec: HeatmapSpec, report: Report, writer) -> str:
    """One heatmap's panels and the robustness summary (``robustness.md``, ``.png``)."""
    out_dir = report.out_dir
    metric = hspec.metric or data.objective
    direction = data.direction if metric == data.objective else "minimize"
    panels = heatmaps(data.runs, hspec, data.axes, metric, direction, out_dir, writer)
    if not panels:
        return ""
    report.files += [panels[0].path, *(p.csv for p in panels)]
    md = robustness_markdown(panels, hspec, metric, direction)
    (out_dir / "robustness.md").write_text(md)
    report.files += [out_dir / "robustness.md", out_dir / "robustness.png"]
    return (f"\n## Heatmaps ({hspec.x} × {hspec.y}) and robustness\n\n{md}"
            f"\n![heatmaps]({panels[0].path.name})\n\n![robustness](robustness.png)\n")


def _line_section(data: StudyData, lspec: LineSpec, palette: Palette, report: Report,
                  writer) -> str:
    """One line plot."""
    _, path = line_plot(data.runs, lspec, data.axes, data.objective, data.direction,
                        report.out_dir, writer, palette)
    report.files.append(path)
    return f"\n## {lspec.name}\n\n![{lspec.name}]({path.name})\n"


def _why_no_curve(data: StudyData, tag: str) -> str:
    """Why no run logged ``tag``, read from the first run: runs shorter than
    ``trainer.log_every_n_steps`` (no training scalar is logged before it), or the tags it did
    log (a misspelled tag)."""
    from muoneq.suite.runtime import record
    from muoneq.suite.sweeps.events import ScalarReader

    run = data.runs[0]
    try:
        config = record.read_record(Path(run["_run_dir"])) or {}
    except (OSError, ValueError):
        config = {}
    every = (config.get("trainer") or {}).get("log_every_n_steps")
    steps = run.get("global_step")
    if isinstance(every, int) and isinstance(steps, int) and steps < every:
        return (f": its runs ran {steps} steps, and a run logs its training scalars every "
                f"trainer.log_every_n_steps={every} steps; run them with a smaller one (e.g. "
                f"--override trainer.log_every_n_steps={max(1, steps // 10)})")
    logged = ScalarReader(run["_run_dir"]).tags()
    return f" (the first run logged: {', '.join(logged) or 'no scalar'})"


def _curve_section(data: StudyData, palette: Palette, report: Report, writer) -> str:
    """The learning curves of every requested TensorBoard tag."""
    spec = data.spec.report.curves
    curves = learning_curves(data.runs, spec, data.axes, data.objective, data.direction,
                             report.out_dir, writer, palette)
    parts = []
    for tag in spec.tags:
        if tag not in curves:
            why = _why_no_curve(data, tag)
            parts.append(f"\nNo run logged the TensorBoard scalar {tag!r}{why}.\n")
            continue
        path = curves[tag].path
        report.files.append(path)
        parts.append(f"\n![{path.stem}]({path.name})\n")
    return "".join(parts)
