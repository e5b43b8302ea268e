"""``make miniatures``: run every paper study's miniature as a user would (``make NAME MINI=1``,
one after another, from this checkout) and record how long each took and what it printed.

Writes ``benchmarks/results/miniatures.json`` and ``miniatures.md`` (or ``--out``), a row per
miniature, replaced when it is measured again: its wall-clock seconds, its runs, the machine (CPU,
cores, the 1-minute load average before and after: a load above the cores means other jobs
shared them and the time is the machine's as much as the miniature's), the date and commit, and
the first table or figure of its report. docs/reproduce.md links the record; the times there
are never typed by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def shown(report_dir: Path) -> str:
    """What the report shows first: its first table (Markdown), else its first figure's name."""
    tables = sorted(report_dir.glob("table_*.md"))
    if tables:
        return tables[0].read_text().split("\n\n")[0].strip()
    figures = sorted(p.name for p in report_dir.glob("*.png") if not p.name.startswith("optuna"))
    return ", ".join(figures)


def run(name: str, runs_dir: Path) -> dict:
    """``make NAME MINI=1`` timed from nothing: its study folder, the one this command wrote
    the last time, is removed first (the runs of a study already there would not run again)."""
    shutil.rmtree(runs_dir / f"{name}-mini", ignore_errors=True)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(["make", "-s", "-C", str(REPO), name, "MINI=1",
                           f"ARGS=--runs-dir {runs_dir}"], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    counted = re.search(r"study \S+: (\d+)/(\d+) runs done", done.stdout)
    study = runs_dir / f"{name}-mini"
    return {"name": name, "command": f"make {name} MINI=1", "seconds": round(seconds, 1),
            "exit_code": done.returncode, "runs": int(counted.group(1)) if counted else None,
            "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
            "report": str(study / "report" / "report.md"),
            "shows": shown(study / "report") if done.returncode == 0 else done.stderr[-2000:]}


def markdown(record: dict) -> str:
    lines = ["# Miniatures: `make NAME MINI=1`\n",
             "Written by `make miniatures` (docs/reproduce.md); each row by the run that measured "
             "it.\n",
             "| command | time | runs | machine | load before → after | date, commit | exit |",
             "|---|--:|--:|---|---|---|--:|"]
    for m in record["miniatures"]:
        minutes, seconds = divmod(round(m["seconds"]), 60)
        lines.append(f"| `{m['command']}` | {minutes} min {seconds:02d} s | {m['runs']} | "
                     f"{m['cpu']}, {m['cores']} cores | {m['load_before']} → "
                     f"{m['load_after']} | {m['date']}, {m['commit']} | {m['exit_code']} |")
    busy = [m["name"] for m in record["miniatures"]
            if max(m["load_before"], m["load_after"]) > 1.1 * m["cores"]]
    if busy:
        lines.append(f"\nThe machine was busy (a load over its cores) around {', '.join(busy)}: "
                     "those times are the machine's as much as the miniature's.")
    for m in record["miniatures"]:
        lines += [f"\n## {m['name']}\n", m["shows"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="the sweeps (default: every shipped one)")
    p.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "miniatures",
                   help="where the studies go (default runs/miniatures: this command's own, "
                        "each study removed before it runs again)")
    p.add_argument("--out", type=Path, default=RESULTS / "miniatures",
                   help="record path without suffix (default benchmarks/results/miniatures)")
    args = p.parse_args(argv)
    names = args.names or sorted(p.stem for p in (REPO / "sweeps").glob("*.yaml"))
    import torch

    from muoneq.suite.machine import device_name
    from muoneq.suite.runtime.record import git_commit, git_dirty

    path = args.out.with_suffix(".json")
    record = json.loads(path.read_text()) if path.is_file() else {"miniatures": []}
    for m in record["miniatures"]:  # a record of one run for all: its machine, date, commit
        for key in ("date", "commit", "cpu", "cores"):
            m.setdefault(key, record.get(key))
    for name in names:
        print(f"make {name} MINI=1 …", flush=True)
        entry = {**run(name, args.runs_dir.resolve()),
                 "date": datetime.now(UTC).isoformat(timespec="seconds"),
                 "commit": f"{(git_commit() or '?')[:10]}{' (dirty)' if git_dirty() else ''}",
                 "cpu": device_name(torch.device("cpu")), "cores": os.cpu_count()}
        # a miniature measured again replaces its row; the others keep theirs
        record["miniatures"] = sorted([m for m in record["miniatures"] if m["name"] != name]
                                      + [entry], key=lambda m: m["name"])
        print(f"  {entry['seconds']} s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(record))
    print(f"written to {args.out}.json and .md")
    return 0 if all(m["exit_code"] == 0 for m in record["miniatures"]) else 1


if __name__ == "__main__":
    sys.exit(main())
