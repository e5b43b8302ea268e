"""``muoneq spectra``: run the synthetic Newton–Schulz geometry study (the paper's
Figure 1).

    muoneq spectra --quick                 # small sizes, 2 seeds: minutes on a laptop's CPU
    muoneq spectra                         # the paper's sizes 1024/4096 (GPU or many cores)
    muoneq spectra --sizes 256x1024 --kappas 10,1e3 --ranges 100 --seeds 3 --out runs/mine

Writes ``summary.csv``, ``curves.csv``, ``summary.md``, ``figures/*.png`` and ``tensorboard/``
into the run folder and resumes there after an interruption.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from muoneq.newton_schulz import DTYPES, NAMED_COEFFICIENTS
from muoneq.suite.errors import UserError
from muoneq.suite.spectra.ns_geometry_study import (
    FAMILIES,
    FULL_SIZES,
    QUICK_SIZES,
    StudyConfig,
    run_study,
    summary_table,
    write_outputs,
)


def _sizes(text: str) -> tuple[tuple[int, int], ...]:
    try:
        pairs = tuple(tuple(int(v) for v in item.lower().split("x")) for item in text.split(","))
    except ValueError:
        pairs = ()
    if not pairs or any(len(p) != 2 for p in pairs):
        raise argparse.ArgumentTypeError(f"expected sizes like 1024x4096,512x512, got {text!r}")
    return pairs


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers like 10,100,1e3, got {text!r}"
        ) from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="muoneq spectra",
        description="Finite-step Newton–Schulz error, condition numbers and the error "
        "decomposition of none/R/C/RC on synthetic matrices (the paper's Figure 1).",
    )
    p.add_argument("--quick", action="store_true",
                   help=f"small sizes {'/'.join(f'{m}x{n}' for m, n in QUICK_SIZES)} "
                   "and 2 seeds (minutes on a laptop's CPU)")
    p.add_argument("--out", help="run folder (default runs/ns_geometry, or "
                   "runs/ns_geometry_quick with --quick); an existing one is resumed")
    p.add_argument("--fresh", action="store_true", help="discard earlier results in --out")
    p.add_argument("--sizes", type=_sizes, help="m×n shapes, e.g. 1024x1024,1024x4096 "
                   f"(default {','.join(f'{m}x{n}' for m, n in FULL_SIZES)})")
    p.add_argument("--kappas", type=_floats, help="condition numbers κ of the rotation-invariant "
                   "family (default 10,100,1000)")
    p.add_argument("--ranges", type=_floats, help="scale ranges ρ of the scale-imbalanced family "
                   "(default 10,100,1000)")
    p.add_argument("--families", type=_names, help=f"subset of {','.join(FAMILIES)}")
    p.add_argument("--seeds", type=int, help="matrices per setting (default 1; 2 with --quick)")
    p.add_argument("--steps", type=int, help="NS steps of the error curves (default 10)")
    p.add_argument("--report-step", type=int, help="the K of the summary columns (default 5)")
    p.add_argument("--coefficients", choices=NAMED_COEFFICIENTS, help="NS coefficient schedule "
                   "(default quintic)")
    p.add_argument("--ns-dtype", choices=tuple(DTYPES), help="dtype of the NS iteration "
                   "(default float64; SVDs are always float64)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, … (default: cuda if "
                   "available)")
    return p


def config_from_args(args: argparse.Namespace) -> StudyConfig:
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    overrides = dict(
        sizes=args.sizes or (QUICK_SIZES if args.quick else None),
        kappas=args.kappas, scale_ranges=args.ranges, families=args.families,
        seeds=args.seeds or (2 if args.quick else None), steps=args.steps,
        report_step=args.report_step, coefficients=args.coefficients, ns_dtype=args.ns_dtype,
    )
    fields = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(StudyConfig(device=device), **fields)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
        out = args.out or ("runs/ns_geometry_quick" if args.quick else "runs/ns_geometry")
        print(f"muoneq spectra: {len(list(config.cases()))} matrices × {len(config.modes)} "
              f"normalizations on {config.device}, results in {out}")
        result = run_study(config, out, fresh=args.fresh)
    except ValueError as err:  # a bad study setting (the message names the option)
        raise UserError(f"muoneq spectra: {err}") from err
    paths = write_outputs(result, config, out)
    print("\n" + summary_table(result, config) + "\n")
    print("figures:\n" + "\n".join(f"  {p}" for p in paths))
    print(f"TensorBoard: tensorboard --logdir {out}/tensorboard")
    return 0
