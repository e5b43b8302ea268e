"""``make gpu-check`` (``muoneq gpu-check``) and the script that runs it on a bare GPU machine:
the CPU smoke run through the Makefile, the results file, the optimizer timer, merging and
the targets' verdicts."""

import base64
import hashlib
import importlib
import json
import math
import os
import subprocess
import sys
import time
import zipfile
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from muoneq.suite.benchmarks import gpu_check
from muoneq.suite.machine import device_name
from tests.helpers.dispatch import dispatched

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def cpu_results(folder: Path) -> dict:
    path = folder / f"{gpu_check.device_slug(device_name(CPU))}-quick.json"
    return json.loads(path.read_text())


@pytest.mark.slow
def test_make_gpu_check_quick_on_cpu_runs_every_part(tmp_path):
    done = subprocess.run(["make", "gpu-check", "DEVICE=cpu", "QUICK=1", f"OUT={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = cpu_results(tmp_path)
    parts = record["parts"]
    assert record["device"] == device_name(CPU) and record["device_type"] == "cpu"
    assert record["quick"] and record["git_commit"]
    assert {name: p["status"] for name, p in parts.items()} == {
        "tests": "skipped", "bench": "ok", "peers": "ok", "gpt2": "ok", "llama130m": "ok",
        "resnet": "ok", "fsdp2": "ok"}

    # 1: every gpu test was collected and skipped for want of CUDA
    assert parts["tests"]["skipped"] > 0 and parts["tests"]["passed"] == 0
    assert "CUDA" in parts["tests"]["reason"]
    # 2: the bench's GPT-2 quick set, NS5 FLOPs counted by hand (see test_bench_output.py)
    bench = parts["bench"]["result"]["sets"]["gpt2_small"]
    assert bench["ns_gflop"] == pytest.approx(0.14680064, rel=1e-12)
    assert record["muoneq_r_over_torch_muon_gpt2_small"] == bench["contenders"]["MuonEq-R"][
        "vs_torch"] > 0
    assert parts["bench"]["result"]["peers"] == {}  # the peers have their own part
    assert parts["bench"]["auto"] == {"reason": "auto is torch off a CUDA GPU with Triton (no "
                                      "timing)", "sets": {}}
    # 2b: the public Muon implementations beside torch.optim.Muon, our Muon and MuonEq-R
    peers = parts["peers"]["result"]
    rows = peers["sets"]["gpt2_small"]["contenders"]
    assert list(rows) == ["torch.optim.Muon", "Muon (ours)", "MuonEq-R", "MuonEq-R (stacked)",
                          "heavyball Muon", "muon-optimizer SingleDeviceMuon"]
    assert peers["missing_peers"] == []
    fastest = record["fastest_peer_gpt2_small"]
    assert record["fastest_peer_over_torch_muon_gpt2_small"] == rows[fastest]["vs_torch"]
    assert record["muoneq_r_over_fastest_peer_gpt2_small"] == pytest.approx(
        rows["MuonEq-R"]["ms"] / rows[fastest]["ms"])  # one repeat: its ratio
    # 3, 4: GPT-2 and LLaMA: MFU against the float32 matmul rate measured on this CPU, the
    # optimizer's share of the step from the timed optimizer steps
    for part, key, arch in (("gpt2", "gpt2_small", "gpt2"), ("llama130m", "llama2_130m", "llama")):
        language = parts[part]
        peak, eager = language["settings"]["peak"], language["runs"]["eager"]
        assert language["settings"]["arch"] == arch
        assert not peak["datasheet"] and "float32" in peak["source"]
        assert language["runs"]["compiled"]["status"] == "skipped"
        assert language["fastest"] == record[f"{key}_run"] == "eager"
        assert record[f"{key}_mfu_eager"] == pytest.approx(
            eager["flops_per_token"] * eager["tokens_per_s"] / (peak["tflops"] * 1e12))
        assert 0 < record[f"{key}_mfu_eager"] < 1 and record[f"{key}_mfu_compiled"] is None
        assert record[f"{key}_optimizer_share"] == pytest.approx(
            eager["optimizer_step_ms"] / 1e3 / eager["step_s"])
        assert 0 < record[f"{key}_optimizer_share"] < 1
        assert math.isfinite(eager["val_loss"])
    # 5: one CIFAR epoch of 256 images at batch 128, and where a step goes
    resnet = parts["resnet"]
    assert resnet["steps"] == 2 and resnet["settings"]["channels_last"]
    assert resnet["settings"]["train_images"] == 256 and record["resnet18_cifar10_epoch_s"] > 0
    breakdown = resnet["breakdown"]
    assert breakdown["kernels_kind"] == "top-level CPU operator calls"
    assert breakdown["optimizer"] == "muoneq_nes" and record["resnet18_optimizer_kernels"] > 0
    assert record["resnet18_optimizer_share"] == pytest.approx(
        breakdown["optimizer_step_ms"] / breakdown["step_ms"])
    assert record["resnet18_loop_overhead"] == pytest.approx(
        resnet["epoch_step_ms"] / breakdown["step_ms"])
    # 6: two FSDP2 steps
    assert parts["fsdp2"]["settings"]["steps"] == 2 and record["llama1b_fsdp2"] == "ok"

    summary = (tmp_path / f"{record['device_slug']}-quick.md").read_text()
    assert "QUICK RUN" in summary and "smoke value" in summary
    assert "A CPU run is not compared with them" in summary
    # one table of every figure, each with its target (or "none set") and no verdict on a CPU
    table = [line for line in summary.splitlines() if line.startswith("| ")]
    shares = [line for line in table if "optimizer's share of a ResNet-18" in line]
    assert shares == [f"| optimizer's share of a ResNet-18 training step | ≤ 20% | "
                      f"{record['resnet18_optimizer_share'] * 100:.3g}% | — |"]
    targets = [line.split(" | ")[1] for line in table]  # "what | target | value | verdict"
    assert len([t for t in targets if t == "none set" or t.startswith(("≤", "≥"))]) \
        == len(gpu_check.FIGURES)
    # the bench's own output says what its columns are and that these are smoke values
    assert "× torch, median of per-repeat ratios" in done.stdout
    assert "the timings are smoke values" in done.stdout


def probe_wheel(folder: Path) -> Path:
    """A one-module pure-Python wheel (PEP 427 layout) standing in for the carried wheels."""
    files = {"gpu_check_probe.py": b"VALUE = 1\n",
             "gpu_check_probe-1.0.dist-info/METADATA":
                 b"Metadata-Version: 2.1\nName: gpu-check-probe\nVersion: 1.0\n",
             "gpu_check_probe-1.0.dist-info/WHEEL":
                 b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    def digest(data: bytes) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    record = [f"{name},sha256={digest(data)},{len(data)}" for name, data in files.items()]
    files["gpu_check_probe-1.0.dist-info/RECORD"] = (
        "\n".join([*record, "gpu_check_probe-1.0.dist-info/RECORD,,"]) + "\n").encode()
    folder.mkdir()
    path = folder / "gpu_check_probe-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
    return path


def run_script(*args, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "benchmarks/gpu_machine.sh", *args], cwd=REPO, text=True,
                          capture_output=True, timeout=600,
                          env={**os.environ, "PYTHON": sys.executable, **env})


@pytest.mark.slow
def test_gpu_machine_script_installs_the_wheels_and_the_project_then_runs_the_check(tmp_path):
    probe_wheel(tmp_path / "whl")
    done = run_script("check", "--device", "cpu", "--quick", "--parts", "fsdp2",
                      "--out", str(tmp_path / "results"), WHEELS=str(tmp_path / "whl"),
                      SITE=str(tmp_path / "site"), OUT=str(tmp_path / "out"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "gpu_check_probe.py").is_file()
    copied = cpu_results(tmp_path / "out")  # --copy-to $OUT
    assert copied == cpu_results(tmp_path / "results")
    assert list(copied["parts"]) == ["fsdp2"] and copied["parts"]["fsdp2"]["status"] == "ok"


def test_gpu_machine_script_without_wheels_says_what_to_do(tmp_path):
    (tmp_path / "whl").mkdir()
    done = run_script("check", WHEELS=str(tmp_path / "whl"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"gpu_machine.sh: no wheels in {tmp_path / 'whl'}/; run make gpu-wheels where pip "
        f"works and carry {tmp_path / 'whl'}"]
    assert run_script("wheel").returncode == 2


@pytest.mark.parametrize("argv, field", [
    (["--device", "cpu"], "only --quick runs"), (["--device", "tpu", "--quick"], "--device"),
    (["--device", "cpu", "--quick", "--parts", "bench,gp2"], "--parts: unknown ['gp2']"),
    (["--device", "cpu", "--quick", "--part-timeout", "0"],
     "--part-timeout: expected seconds > 0, auto or none, got '0'"),
    (["--device", "cpu", "--quick", "--part-timeout", "ten"], "got 'ten'"),
])
def test_bad_arguments_are_refused_with_one_line(argv, field, capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(argv)
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("muoneq gpu-check: error:") and field in error


def test_optimizer_timer_leaves_out_the_closure_lightning_runs_inside_step(monkeypatch):
    """Lightning runs the last micro-batch's forward and backward inside ``optimizer.step``
    (as its closure): only what follows the closure is the optimizer's time."""
    clock = [0.0]
    monkeypatch.setattr(gpu_check.time, "perf_counter", lambda: clock[0])

    class Slow(torch.optim.Optimizer):
        # no super().step(): once any SGD exists, torch has wrapped SGD.step with the hooks
        # too, and a nested call would fire them twice
        def step(self, closure=None):
            loss = closure() if closure is not None else None
            clock[0] += 0.25  # the optimizer's own work
            return loss

    def closure():
        clock[0] += 100.0  # forward and backward
        return torch.tensor(1.0)

    p = nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    opt = Slow([p], {})
    timer = gpu_check.OptimizerStepTimer()
    timer.on_train_start(SimpleNamespace(optimizers=[opt]), SimpleNamespace(device=CPU))
    opt.step(closure)
    opt.step(closure=closure)
    opt.step()
    assert timer.seconds == [0.25, 0.25, 0.25]
    assert timer.median() == 0.25  # the first (warm-up) step left out


def bench_row(vs_torch: float, vs_muon: float = 1.0, x_torch: float = 1.0) -> dict:
    return {"ms": 10.0, "vs_torch": vs_torch, "vs_muon": vs_muon, "gflops": 1.0,
            "of_matmul": 0.5, "peak_extra_mb": 1.0, "state_bytes": 2**20, "err_gaussian": 0.01,
            "x_torch_gaussian": x_torch, "err_decay": 0.05, "x_torch_decay": 1.0}


def cuda_record() -> dict:
    part = {"seconds": 1.0, "date": "2026-11-23T10:00:00+00:00", "git_commit": "abc"}
    rows = {"torch.optim.Muon": bench_row(1.0), "Muon (ours)": bench_row(0.6),
            "MuonEq-R": bench_row(0.62, 1.01, 1.4), "MuonEq-R (compiled)": bench_row(0.45)}
    rows["MuonEq-R"]["peak_extra_mb"] = 3.0
    bench = {"repeats": 7, "quick": False, "sets": {"gpt2_small": {
        "matrices": 48, "parameters": 84934656, "ns_gflop": 1520.0, "matmul_gflops": 7.0e5,
        "contenders": rows, "ddp_split": {}}}}
    compiled = {"status": "ok", "mfu": 0.30, "optimizer_share": 0.012, "tokens_per_s": 1e5,
                "step_s": 5.0}
    eager = {**compiled, "mfu": 0.25, "optimizer_share": 0.011, "step_s": 6.0}
    breakdown = {"forward_backward_ms": 6.4, "optimizer_step_ms": 8.8, "step_ms": 15.0,
                 "optimizer_kernels": 631, "optimizer_share": 8.8 / 15.0}
    return {"device": "NVIDIA H100 80GB HBM3", "device_type": "cuda", "quick": False,
            "parts": {"bench": {**part, "status": "ok", "command": "muoneq bench", "result": bench},
                      "gpt2": {**part, "status": "ok", "fastest": "compiled",
                               "runs": {"eager": eager, "compiled": compiled}},
                      "resnet": {**part, "status": "ok", "breakdown": breakdown,
                                 "loop_overhead": 22.8 / 15.0, "epoch_s": 8.9}}}


def test_headline_figures_and_verdicts_against_the_targets():
    record = cuda_record()
    record.update(gpu_check.headline(record["parts"]))
    assert record["muoneq_r_over_torch_muon_gpt2_small"] == 0.62
    assert record["fastest_muoneq_r_variant_gpt2_small"] == "MuonEq-R (compiled)"
    assert record["gpt2_small_mfu_compiled"] == 0.30 and record["gpt2_small_mfu_eager"] == 0.25
    assert record["gpt2_small_optimizer_share"] == 0.012  # the faster run's
    assert record["llama2_130m_mfu_compiled"] is None and record["llama1b_fsdp2"] is None
    rows = {what: (target, measured, verdict)
            for what, target, measured, verdict in gpu_check.target_rows(record)}
    assert len(rows) == len(gpu_check.FIGURES)
    expected = {  # (target, measured, verdict)
        "MuonEq-R step over torch.optim.Muon's, GPT-2-small set":
            ("≤ 0.23×", "0.62×", "missed by 170%"),
        "MuonEq-R step over our plain Muon's, GPT-2-small set": ("≤ 1.03×", "1.01×", "met"),
        "MuonEq-R bf16 NS5 error over torch's (worst input), GPT-2-small set":
            ("≤ 1.5×", "1.4×", "met"),
        "MuonEq-R peak extra memory over torch.optim.Muon's, GPT-2-small set":
            ("≤ 2×", "3×", "missed by 50%"),
        "MuonEq-R step over torch.optim.Muon's, LLaMA2-130M set":
            ("≤ 0.16×", "not measured", "—"),
        "GPT2-small training MFU, compiled": ("≥ 50%", "30%", "missed by 40%"),
        "GPT2-small training MFU, eager": ("none set", "25%", "—"),
        "optimizer's share of a GPT2-small step (faster run)": ("≤ 1%", "1.2%", "missed by 20%"),
        "optimizer's share of a ResNet-18 training step": ("≤ 20%", "58.7%", "missed by 193%"),
        "ResNet-18 training epoch's time per step over the whole step's":
            ("≤ 1.1×", "1.52×", "missed by 38%"),
        "kernels of one ResNet-18 optimizer.step() (CPU: top-level operator calls)":
            ("none set", "631", "—"),
        "ResNet-18 forward and backward, batch 128": ("none set", "6.40 ms", "—"),
    }
    assert {what: rows[what] for what in expected} == expected


def test_parts_not_rerun_are_kept_from_the_same_device_and_mode(tmp_path):
    path = tmp_path / "nvidia-h100-80gb-hbm3.json"
    path.write_text(json.dumps(cuda_record()))
    kept = gpu_check.earlier_parts(path, "NVIDIA H100 80GB HBM3", False, ["gpt2"])
    assert list(kept) == ["bench", "resnet"]
    assert gpu_check.earlier_parts(path, "NVIDIA H200", False, ["gpt2"]) == {}
    assert gpu_check.earlier_parts(path, "NVIDIA H100 80GB HBM3", True, ["gpt2"]) == {}
    assert gpu_check.earlier_parts(tmp_path / "none.json", "x", False, []) == {}


def test_device_slug_is_a_file_name():
    assert gpu_check.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert (gpu_check.device_slug("Intel(R) Xeon(R) Platinum 8480+")
            == "intel-r-xeon-r-platinum-8480")


def test_a_failed_part_is_recorded_the_next_runs_and_a_killed_one_stays_started(
        tmp_path, monkeypatch, capsys):
    def broken(check):
        raise RuntimeError("no kernel image is available\nfor execution on the device")

    def killed(check):
        raise KeyboardInterrupt

    def skipped(check):
        return {"status": "skipped", "reason": "stand-in"}

    parts = {"tests": broken, "bench": skipped, "gpt2": killed}
    monkeypatch.setattr(gpu_check, "PARTS", parts)
    argv = ["--device", "cpu", "--quick", "--out", str(tmp_path)]
    with pytest.raises(KeyboardInterrupt):
        gpu_check.main([*argv, "--parts", "tests,bench,gpt2"])
    record = cpu_results(tmp_path)
    assert record["parts"]["tests"]["status"] == "failed"
    assert record["parts"]["tests"]["error"] == (
        "RuntimeError: no kernel image is available for execution on the device")
    assert "Traceback" in record["parts"]["tests"]["traceback"]
    assert record["parts"]["bench"]["status"] == "skipped"
    assert record["parts"]["gpt2"]["status"] == "started"
    summary = (tmp_path / f"{record['device_slug']}-quick.md").read_text()
    assert "| gpt2 | started: did not finish (the process was killed or crashed) |" in summary

    # a run of some parts keeps the others; its exit status is that of the parts it ran
    monkeypatch.setattr(gpu_check, "PARTS", {**parts, "gpt2": skipped})
    assert gpu_check.main([*argv, "--parts", "gpt2"]) == 0
    record = cpu_results(tmp_path)
    assert {k: p["status"] for k, p in record["parts"].items()} == {
        "tests": "failed", "bench": "skipped", "gpt2": "skipped"}
    capsys.readouterr()
    assert gpu_check.main([*argv, "--parts", "tests"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "muoneq gpu-check: failed parts: tests (see above and ")


HANGS = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(600)
"""

#: What a part's own process does (``muoneq gpu-check --parts X --out DIR``), quickly: record
#: the part as done in the results file.
RECORDS = """
import json, sys
path, part = sys.argv[1], sys.argv[2]
record = json.load(open(path))
record["parts"][part] = {"status": "ok", "stand_in": True, "seconds": 0.1}
json.dump(record, open(path, "w"))
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "zombie" not in state


def test_a_part_that_hangs_is_stopped_at_its_limit_and_the_next_part_runs(tmp_path, monkeypatch):
    pid_file = tmp_path / "grandchild.pid"
    real = gpu_check.part_command
    assert real("bench", CPU, True, tmp_path) == [
        sys.executable, "-m", "muoneq", "gpu-check", "--device", "cpu", "--quick", "--parts",
        "bench", "--part-timeout", "none", "--out", str(tmp_path)]
    args, device, parts = gpu_check.parse(real("bench", CPU, True, tmp_path)[4:])
    assert (device, parts, args.quick, args.out) == (CPU, ["bench"], True, str(tmp_path))
    assert gpu_check.part_limits(args.part_timeout, args.quick) is None  # in its own process

    def command(part, device, quick, out):
        if part == "gpt2":  # hangs, and so does the process it starts
            return [sys.executable, "-c", HANGS, str(pid_file)]
        path = gpu_check.results_path(out, device, quick)
        return [sys.executable, "-c", RECORDS, str(path), part]

    monkeypatch.setattr(gpu_check, "part_command", command)
    argv = ["--device", "cpu", "--quick", "--parts", "gpt2,tests", "--part-timeout", "2",
            "--out", str(tmp_path / "out"), "--copy-to", str(tmp_path / "copy")]
    assert gpu_check.main(argv) == 1
    record = cpu_results(tmp_path / "out")
    assert record == cpu_results(tmp_path / "copy")
    hung, after = record["parts"]["gpt2"], record["parts"]["tests"]
    assert hung["status"] == "timed out" and 2 <= hung["seconds"] < 60
    assert hung["reason"] == "stopped at its limit of 2 s (--part-timeout)"
    assert after["status"] == "ok" and after["stand_in"] and after["git_commit"]
    for _ in range(50):  # the part's own child went with it
        if not alive(int(pid_file.read_text())):
            break
        time.sleep(0.1)
    assert not alive(int(pid_file.read_text()))
    summary = (tmp_path / "out" / f"{record['device_slug']}-quick.md").read_text()
    assert "| gpt2 | timed out: stopped at its limit of 2 s (--part-timeout) |" in summary


def test_a_full_run_limits_every_part_within_ten_minutes():
    limits = gpu_check.part_limits("auto", quick=False)
    assert limits == gpu_check.PART_LIMITS and set(limits) == set(gpu_check.PARTS)
    assert sum(limits.values()) <= 600
    assert gpu_check.part_limits("auto", quick=True) is None  # the CPU smoke run: in process
    assert gpu_check.part_limits("none", quick=False) is None
    assert gpu_check.part_limits("30", quick=True) == dict.fromkeys(gpu_check.PARTS, 30.0)


def test_gpu_machine_script_refuses_a_copy_that_would_name_no_commit(tmp_path):
    """A copy without its own ``.git`` (what a lent machine gets) must be told its commit."""
    (tmp_path / "benchmarks").mkdir()
    script = tmp_path / "benchmarks" / "gpu_machine.sh"
    script.write_text((REPO / "benchmarks" / "gpu_machine.sh").read_text())
    env = {k: v for k, v in os.environ.items() if k != "MUONEQ_GIT_COMMIT"}
    done = subprocess.run(["bash", str(script), "check"], text=True, capture_output=True,
                          timeout=60, env=env)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "gpu_machine.sh: this copy is no git checkout of its own, so the results would name no "
        "commit; run it as MUONEQ_GIT_COMMIT=<git rev-parse HEAD where it was copied from> "
        "bash benchmarks/gpu_machine.sh check"]
    # with the commit named, it goes on (to the wheels it lacks here)
    done = subprocess.run(["bash", str(script), "check"], text=True, capture_output=True,
                          timeout=60, env={**env, "MUONEQ_GIT_COMMIT": "43ad865"})
    assert done.returncode == 2 and "no wheels in .whl/" in done.stderr


def test_auto_choices_are_recorded_with_both_backends_timed(kernels):
    """What ``ns_backend="auto"`` chose per shape, and the timing of both backends, here with
    the kernels in Triton's interpreter standing in for the GPU's."""
    bench = {"quick": True, "sets": {"gpt2_block": {"contenders": {gpu_check.AUTO_ROW: {
        "ns_backends": {"64x64": "torch", "192x64": "triton"}}}}}}
    check = gpu_check.Check(CPU, True, Path("unused"))
    choices = gpu_check.backend_choices(bench, check)["gpt2_block"]
    assert [(key, c["chose"], c["matrices"]) for key, c in choices.items()] == [
        ("64x64", "torch", 1), ("192x64", "triton", 1)]
    for c in choices.values():
        assert c["torch_ms"] > 0 and c["triton_ms"] > 0 and c["distance"] < 2e-2
    lines = gpu_check.auto_lines({"reason": "why", "sets": {"gpt2_block": choices}})
    assert lines[1] == '`ns_backend="auto"`: why.'
    assert lines[-1].startswith("| gpt2_block | 192x64 | 1 | triton | ")


def test_the_fastest_peer_and_our_step_over_it_by_repeat():
    def row(vs_torch, times):
        return {"vs_torch": vs_torch, "times_ms": times}

    rows = {"torch.optim.Muon": row(1.0, [10, 10, 10]), "Muon (ours)": row(0.5, [5, 5, 5]),
            "MuonEq-R": row(0.5, [5, 6, 4]), "heavyball Muon": row(0.8, [8, 8, 8]),
            "muon-optimizer SingleDeviceMuon": row(1.4, [14, 14, 14])}
    part = {"result": {"sets": {"gpt2_small": {"contenders": rows}},
                       "peers": {"heavyball Muon": "heavyball 3.0",
                                 "muon-optimizer SingleDeviceMuon": "muon-optimizer 0.1"}}}
    assert gpu_check.peer_figures(part) == {
        "fastest_peer_gpt2_small": "heavyball Muon",
        "fastest_peer_over_torch_muon_gpt2_small": 0.8,
        "muoneq_r_over_fastest_peer_gpt2_small": 0.625}  # the median of 5/8, 6/8, 4/8


def test_the_backends_are_timed_on_buffers_allocated_before_the_clock(kernels, monkeypatch):
    """Each timed run of :func:`gpu_check.backend_timings` is ``auto``'s timing
    (:func:`muoneq.newton_schulz.wall_time` around one run), and torch's runs allocate nothing:
    the stack and the buffers exist before the clock starts (Triton's interpreter copies
    arrays of its own, which a compiled kernel does not)."""
    newton_schulz = importlib.import_module("muoneq.newton_schulz")  # not the function
    allocated = []

    def time_once(run, device):
        assert device == CPU
        allocated.append(dispatched(run).allocated)
        return 1e-3

    monkeypatch.setattr(newton_schulz, "wall_time", time_once)
    check = gpu_check.Check(CPU, True, Path("unused"))
    found = gpu_check.backend_timings((16, 48), Counter({(16, 48): 3}), check)
    assert found["matrices"] == 3 and found["torch_ms"] == found["triton_ms"] == 1.0
    assert found["distance"] < 2e-2
    assert allocated[:5] == [[]] * 5 and len(allocated) == 10
