"""The report's account of a study's plan: whether each family's optimum is bracketed and which
values bracketing added, or the path a coordinate descent took (:mod:`muoneq.suite.sweeps.plan`)."""

from __future__ import annotations

from muoneq.suite.sweeps.spec import Point, format_value


def _values(values: list) -> str:
    return ", ".join(format_value(v) for v in values) or "—"


def to_markdown(said: dict | None) -> str:
    """Markdown tables of a published plan (:meth:`muoneq.suite.sweeps.plan.Plan.to_dict`); empty
    for a study without one."""
    if not said or not (said["families"] or said["path"]):
        return ""
    parts = []
    if said["families"]:
        lines = ["| family | axis | values run | added by bracketing | best | bracketed |",
                 "|:--|:--|:--|:--|--:|:--|"]
        for f in said["families"]:
            for s in f["axes"]:
                best = (f["best"] or {}).get(s["axis"])
                if f["state"] in ("running", "no result"):
                    verdict = "waiting for runs" if f["state"] == "running" else "no result"
                elif s["edge"] is None:
                    verdict = "yes"
                else:
                    verdict = f"**no**: best at the {s['edge']} edge; {s['stopped']}"
                lines.append(f"| {f['label']} | {s['axis']} ({s['scale']}) | "
                             f"{_values(s['values'])} | {_values(s['added'])} | "
                             f"{format_value(best) if best is not None else '—'} | {verdict} |")
        parts.append("\n## Bracketing\n\nEach family (a grid block's points that agree on "
                     "every axis not bracketed) at its best point by the mean over seeds; a "
                     "value on an edge of its grid is not known to be the optimum.\n\n"
                     + "\n".join(lines) + "\n")
    if said["path"]:
        lines = ["| step | moved on | point | objective (mean over seeds) |", "|--:|:--|:--|--:|"]
        for i, step in enumerate(said["path"]):
            point = Point(tuple(step["point"].items())).key
            value = "—" if step["value"] is None else f"{step['value']:.4g}"
            lines.append(f"| {i} | {step['axis'] or 'start'} | {point} | {value} |")
        parts.append(f"\n## Coordinate descent ({said['state']})\n\n" + "\n".join(lines) + "\n")
    return "".join(parts)
