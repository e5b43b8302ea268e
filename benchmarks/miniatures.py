"""``make miniatures``: run every paper study's miniature as a user would (``make NAME MINI=1``,
one after another, from this checkout), the demo (``make demo``) and the Figure 1 study's quick
run (``make figure-ns-geometry QUICK=1``), and record how long each took and what it printed.

Writes ``benchmarks/results/miniatures.json`` and ``miniatures.md`` (or ``--out``), a row per
command, replaced when it is measured again: its wall-clock seconds, its training runs, the
machine (CPU, cores, the 1-minute load average before and after: a load above the cores means
other jobs shared them and the time is the machine's as much as the command's), the date and
commit, and what it printed: a miniature's first table (else its first figure's name), the
demo's whole table with its paired differences and speedups, the Figure 1 study's summary. The
README and docs/reproduce.md link the record; the times there are never typed by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


@dataclass(frozen=True)
class Command:
    """One recorded command: ``make`` with ``args`` as a user types it, and ``where``, the flag
    that puts what it writes, ``folder``, under this command's runs folder."""

    name: str
    args: tuple[str, ...]
    folder: str
    where: str

    @property
    def line(self) -> str:
        return " ".join(("make", self.name, *self.args))


#: the commands beside the sweeps' miniatures (``make NAME MINI=1``, <study>-mini)
OTHERS = {"demo": Command("demo", (), "demo", "--runs-dir {runs}"),
          "figure-ns-geometry": Command("figure-ns-geometry", ("QUICK=1",), "ns_geometry_quick",
                                        "--fresh --out {runs}/ns_geometry_quick")}


def command(name: str) -> Command:
    return OTHERS.get(name) or Command(name, ("MINI=1",), f"{name}-mini", "--runs-dir {runs}")


def shown(name: str, folder: Path) -> str:
    """What the command printed: the Figure 1 study's summary, the demo's table file (its
    table, paired differences and speedups), or a miniature's first table (Markdown), else its
    first figure's name."""
    if name == "figure-ns-geometry":
        return (folder / "summary.md").read_text().strip()
    tables = sorted((folder / "report").glob("table_*.md"))
    if tables:
        text = tables[0].read_text().strip()
        return text if name == "demo" else text.split("\n\n")[0].strip()
    figures = sorted(p.name for p in (folder / "report").glob("*.png")
                     if not p.name.startswith("optuna"))
    return ", ".join(figures)


def run(name: str, runs_dir: Path) -> dict:
    """The command timed from nothing: its folder, the one this command wrote the last time,
    is removed first (the runs of a study already there would not run again)."""
    cmd = command(name)
    folder = runs_dir / cmd.folder
    shutil.rmtree(folder, ignore_errors=True)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(["make", "-s", "-C", str(REPO), cmd.name, *cmd.args,
                           f"ARGS={cmd.where.format(runs=runs_dir)}"],
                          capture_output=True, text=True)
    seconds = time.perf_counter() - start
    runs = sum(json.loads(p.read_text()).get("status") == "finished"
               for p in folder.glob("trials/*/seed*/metrics.json"))
    return {"name": name, "command": cmd.line, "seconds": round(seconds, 1),
            "exit_code": done.returncode, "runs": runs,
            "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
            "shows": shown(name, folder) if done.returncode == 0 else done.stderr[-2000:]}


def markdown(record: dict) -> str:
    lines = ["# Miniatures, the demo and the Figure 1 study\n",
             "Written by `make miniatures` (docs/reproduce.md); each row by the run that measured "
             "it, from an empty folder (data preparation and report included). Training runs: "
             "those the command finished.\n",
             "| command | time | training runs | machine | load before → after | date, commit "
             "| exit |",
             "|---|--:|--:|---|---|---|--:|"]
    for m in record["miniatures"]:
        minutes, seconds = divmod(round(m["seconds"]), 60)
        lines.append(f"| `{m['command']}` | {minutes} min {seconds:02d} s | {m['runs'] or '—'} | "
                     f"{m['cpu']}, {m['cores']} cores | {m['load_before']} → "
                     f"{m['load_after']} | {m['date']}, {m['commit']} | {m['exit_code']} |")
    from muoneq.suite.report.machine import is_busy

    busy = [m["name"] for m in record["miniatures"]
            if is_busy(max(m["load_before"], m["load_after"]), m["cores"])]
    if busy:
        lines.append(f"\nThe machine was busy (a load over its cores) around {', '.join(busy)}: "
                     "those times are the machine's as much as the command's.")
    for m in record["miniatures"]:
        lines += [f"\n## {m['name']}\n", f"`{m['command']}` printed:\n", m["shows"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*",
                   help="sweeps, demo or figure-ns-geometry (default: every shipped sweep, "
                        "then the demo and the Figure 1 study)")
    p.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "miniatures",
                   help="where the commands write (default runs/miniatures: this command's "
                        "own, each command's folder removed before it runs again)")
    p.add_argument("--out", type=Path, default=RESULTS / "miniatures",
                   help="record path without suffix (default benchmarks/results/miniatures)")
    args = p.parse_args(argv)
    order = [*sorted(p.stem for p in (REPO / "sweeps").glob("*.yaml")), *OTHERS]
    unknown = sorted(set(args.names) - set(order))
    if unknown:
        p.error(f"no miniature named {', '.join(unknown)}; choose from {', '.join(order)}")
    names = args.names or order
    import torch

    from muoneq.suite import code_version
    from muoneq.suite.machine import device_name

    # the code every command runs: the checkout as it is now, before this writes its record
    version = code_version.current()
    code = code_version.short_commit(version.commit, version.dirty)
    path = args.out.with_suffix(".json")
    record = json.loads(path.read_text()) if path.is_file() else {"miniatures": []}
    for name in names:
        print(f"{command(name).line} …", flush=True)
        entry = {**run(name, args.runs_dir.resolve()),
                 "date": datetime.now(UTC).isoformat(timespec="seconds"),
                 "commit": code,
                 "cpu": device_name(torch.device("cpu")), "cores": os.cpu_count()}
        # a command measured again replaces its row; the others keep theirs
        record["miniatures"] = sorted([m for m in record["miniatures"] if m["name"] != name]
                                      + [entry], key=lambda m: order.index(m["name"]))
        print(f"  {entry['seconds']} s", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")  # after each: a kill loses one
        args.out.with_suffix(".md").write_text(markdown(record))
    print(f"written to {args.out}.json and .md")
    return 0 if all(m["exit_code"] == 0 for m in record["miniatures"]) else 1


if __name__ == "__main__":
    sys.exit(main())
