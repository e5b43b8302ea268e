"""docs/sweeps.md's sweep-file reference is the schema: every key of ``SweepSpec`` (and of the
sections it embeds) has one row with its type and default, and no row names anything else."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from omegaconf import MISSING

from muoneq.suite.sweeps import report_spec, spec

REPO = Path(__file__).resolve().parents[1]
#: the schema's sections, by the name their fields' types give them
SECTIONS = {cls.__name__: cls for module in (spec, report_spec) for cls in vars(module).values()
            if isinstance(cls, type) and dataclasses.is_dataclass(cls)}


def default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if value == MISSING:
        return "required"
    if dataclasses.is_dataclass(value):
        return "its keys' defaults"
    if value is None or isinstance(value, bool):
        text = {None: "null", True: "true", False: "false"}[value]
    else:
        text = repr(value) if isinstance(value, str) and not value else str(value)
    return f"`{text}`"


def schema_rows(cls=spec.SweepSpec, prefix: str = ""):
    """``(key, type, default)`` of every field, sections' fields after their own row: a list's
    items as ``key[].field``, a mapping's values as ``key.<name>.field``."""
    for f in dataclasses.fields(cls):
        key, kind = prefix + f.name, str(f.type)
        yield key, kind.replace(" | ", " or "), default_text(f)
        inner = re.findall(r"[A-Z]\w+", kind)
        for name in inner:
            if name in SECTIONS:
                sep = "[]." if kind.startswith("list[") else (
                    ".<name>." if kind.startswith("dict[") else ".")
                yield from schema_rows(SECTIONS[name], key + sep)


def documented_rows() -> list[tuple[str, str, str]]:
    text = (REPO / "docs" / "sweeps.md").read_text()
    section = text.split("## Sweep-file reference", 1)[1].split("\n## ", 1)[0]
    return [(m[0], m[1], m[2]) for m in re.findall(
        r"^\| `([^`]+)` \| (.+?) \| (.+?) \| .+ \|$", section, re.MULTILINE)]


def test_the_reference_has_every_key_with_its_type_and_default():
    assert documented_rows() == list(schema_rows())


def test_the_reference_s_examples_are_sweep_files():
    """Every YAML example of the reference loads as a sweep file (with a study, an experiment,
    an objective and an lr × momentum grid added where the example shows a section only)."""
    import yaml

    from muoneq.suite.sweeps.spec import spec_from_dict

    text = (REPO / "docs" / "sweeps.md").read_text()
    section = text.split("## Sweep-file reference", 1)[1].split("\n## ", 1)[0]
    examples = re.findall(r"```yaml\n(.*?)```", section, re.S)
    assert len(examples) >= 3
    for example in examples:
        data = {"study": "x", "experiment": "cifar10_resnet18",
                "objective": {"metric": "test/acc"}, **yaml.safe_load(example)}
        if "grid" not in data and "search" not in data:
            data["grid"] = [{"optimizer.lr": [0.1, 0.2], "optimizer.momentum": [0.9, 0.95]}]
        spec_from_dict(data, source="docs/sweeps.md")
