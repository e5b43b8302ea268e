"""What ``muoneq bench`` prints says what it is: column headers name their statistic, quick runs
say their timings are smoke values, FLOP and thread counts read right."""

import pytest
import torch

from muoneq.suite.benchmarks.bench_step import device_label, sig3, table
from muoneq.suite.machine import device_name


def row(ms: float, vs_torch: float, vs_muon: float, ns_dtype: str = "bfloat16") -> dict:
    return {"ns_dtype": ns_dtype, "ms": ms, "vs_torch": vs_torch, "vs_muon": vs_muon,
            "gflops": 0.4, "of_matmul": 0.5,
            "peak_extra_mb": 0.15, "state_bytes": 393216, "err_gaussian": 1.45e-2,
            "x_torch_gaussian": 1.0, "err_decay": 9.3e-2, "x_torch_decay": 1.0}


def result(quick: bool) -> dict:
    # the contradiction of issue 11: 24 ms against 18 ms, yet a per-repeat median ratio of 1.000
    return {"repeats": 3, "quick": quick, "sets": {"gpt2_small": {
        "matrices": 8, "parameters": 98304, "ns_gflop": 0.14680064, "matmul_gflops": 0.842,
        "contenders": {"torch.optim.Muon": row(18.0, 1.0, 0.75),
                       "Muon (ours)": row(24.0, 1.0, 1.0),
                       "MuonEq-R": row(20.0, 0.8, 0.8, "float32")},
        "ddp_split": {"2": {"max_share_over_ideal": 1.0, "within_bound": True}},
        "workspace": {"contender": "MuonEq-R", "default_mb": 38.3, "chunks": 33,
                      "torch_peak_extra_mb": 22.5, "over_torch": 1.702},
    }}}


def test_headers_name_the_statistic_of_every_column():
    text = table(result(quick=False))
    header = next(line for line in text.splitlines() if line.startswith("| contender"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns[1] == "NS dtype"
    assert columns[2] == "ms/step, median of 3"
    assert columns[3] == "× torch, median of per-repeat ratios"
    assert columns[4] == "× Muon (ours), median of per-repeat ratios"
    assert "| MuonEq-R | float32 | 20.0 |" in text
    assert "need not equal the ratio of the two ms medians" in text
    assert "smoke" not in text
    assert ("Default workspace of the stacked step (MuonEq-R): 38.3 MiB in 33 chunks, 1.70× "
            "torch.optim.Muon's peak extra memory (22.5 MiB)") in text


def test_quick_output_says_its_timings_are_smoke_values():
    text = table(result(quick=True))
    assert text.splitlines()[0].startswith("QUICK RUN: miniature matrix sets, 3 repeats: the "
                                           "timings are smoke values")
    assert "**gpt2_small** (quick: smoke values)" in text


def test_small_flop_counts_are_not_rounded_to_zero():
    # GPT-2's quick set: 2 blocks of (192,64), (64,64), (256,64), (64,256); NS5 does
    # 5·(4m²n + 2m³) FLOPs per matrix (m ≤ n): 2·5·(3,670,016 + 1,572,864 + 2·4,718,592)
    text = table(result(quick=True))
    assert "0.147 GFLOP of NS5 per step; bf16 matmul 0.842 GFLOP/s" in text


@pytest.mark.parametrize("threads, words", [(1, "1 thread"), (2, "2 threads")])
def test_the_cpu_label_counts_threads_in_words(threads, words):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        label = device_label(torch.device("cpu"))
    finally:
        torch.set_num_threads(before)
    assert label == f"{device_name(torch.device('cpu'))} (CPU, {words})"
    assert "thread" not in device_name(torch.device("cpu"))


@pytest.mark.parametrize("value, text", [
    (0.0, "0"), (0.014680064, "0.0147"), (0.14680064, "0.147"), (1.4680064, "1.47"),
    (14.680064, "14.7"), (146.80064, "147"), (1468.0064, "1468"), (-0.25, "-0.250"),
])
def test_three_significant_digits(value, text):
    assert sig3(value) == text



def test_bench_says_when_the_machine_was_busy():
    """As a report's timing note does: a load over the cores makes the times the machine's
    (``make bench`` records the loads: tests/test_documented_commands.py)."""
    from muoneq.suite.benchmarks.bench_step import busy_note

    assert busy_note([1.0, 2.2], 2) == ""  # within 10 % of the cores
    assert busy_note([1.9, 9.7], 2).startswith(
        "\nThe machine was busy: a 1-minute load of 1.9 to 9.7 on 2 cores (over 10% above")
