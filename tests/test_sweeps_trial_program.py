"""A small, real trial program for the sweep tests, honouring the trial contract.

Run as ``python tests/test_sweeps_trial_program.py optimizer=muon_nes optimizer.lr=0.02
seed=0 run.dir=DIR [steps=40] [sleep_s=0] [fail_first=false] [config_error=false]``: it fits a
two-hidden-layer MLP student to a fixed random teacher with ``muoneq.build_optimizer`` for a few
dozen steps (real processes, real optimization), logs ``val_loss`` by global step to
TensorBoard under the run folder and writes ``metrics.json`` as its very last act. Each start
appends a line to ``starts.log`` so tests can count how often a run folder was executed. With
``fail_first=true`` the first attempt in a folder exits with status 3 half way; with
``config_error=true`` every attempt exits at once with status 2, as ``muoneq`` does for a
config error.

As a test module it checks that the program does optimize.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

PROGRAM = Path(__file__).resolve()


def _parse(argv: list[str]) -> dict[str, str]:
    out = {}
    for word in argv:
        key, sep, value = word.partition("=")
        if not sep:
            raise SystemExit(f"expected key=value, got {word!r}")
        out[key] = value
    return out


def main(argv: list[str]) -> int:
    args = _parse(argv)
    run_dir = Path(args.pop("run.dir"))
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "starts.log").open("a") as fh:
        fh.write(f"{time.time()}\n")

    import torch
    from torch import nn
    from torch.utils.tensorboard import SummaryWriter

    import muoneq

    name = args.pop("optimizer")
    seed = int(args.pop("seed", "0"))
    steps = int(args.pop("steps", "40"))
    sleep_s = float(args.pop("sleep_s", "0"))
    fail_first = args.pop("fail_first", "false") == "true"
    if args.pop("config_error", "false") == "true":
        print("muoneq: config_error=true; this run is told to fail as a config error")
        return 2
    hparams = {k.split(".", 1)[1]: v for k, v in args.items() if k.startswith("optimizer.")}
    unknown = sorted(k for k in args if not k.startswith("optimizer."))
    if unknown:
        raise SystemExit(f"unknown overrides {unknown}")
    casts = {"lr": float, "momentum": float, "ns_steps": int, "weight_decay": float}
    hparams = {k: casts.get(k, str)(v) for k, v in hparams.items()}
    if name not in ("sgd",) and not muoneq.OPTIMIZERS[name].hybrid:
        hparams.pop("momentum", None)

    torch.manual_seed(1234)  # the task (teacher, data) is the same for every run
    teacher = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    x_train, x_val = torch.randn(512, 16), torch.randn(256, 16)
    with torch.no_grad():
        y_train, y_val = teacher(x_train), teacher(x_val)
    torch.manual_seed(seed)  # the student's initialization depends on the seed
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 1))
    if muoneq.OPTIMIZERS[name].hybrid:
        hparams.setdefault("ns_dtype", "float32")
    opt = muoneq.build_optimizer(name, model, **hparams)
    writer = SummaryWriter(str(run_dir / "tb"))
    start, step_times = time.time(), []
    val = float("nan")
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        batch = torch.randint(0, 512, (64,))
        loss = nn.functional.mse_loss(model(x_train[batch]), y_train[batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
        step_times.append(time.perf_counter() - t0)
        with torch.no_grad():
            val = nn.functional.mse_loss(model(x_val), y_val).item()
        writer.add_scalar("train_loss", loss.item(), step)
        writer.add_scalar("val_loss", val, step)
        if step % 10 == 0:
            writer.flush()
        if fail_first and step == steps // 2 and not (run_dir / "failed_once").exists():
            (run_dir / "failed_once").write_text("")
            return 3
        time.sleep(sleep_s)
    writer.close()
    metrics = {"val_loss": val, "step_time_s": sum(step_times) / len(step_times),
               "peak_mem_gb": 0.0, "wall_s": time.time() - start}
    (run_dir / "metrics.json").write_text(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def test_trial_program_trains_and_honours_the_contract(tmp_path):
    """The program used by the sweep tests is a real optimization: the loss falls."""
    run_dir = tmp_path / "run"
    assert main(["optimizer=muoneq_nes", "optimizer.lr=0.02", "optimizer.momentum=0.9",
                 "seed=0", f"run.dir={run_dir}"]) == 0  # in-process: the sweep tests spawn it
    metrics = json.loads((run_dir / "metrics.json").read_text())
    from muoneq.suite.sweeps.events import ScalarReader

    curve = ScalarReader(run_dir).scalars("val_loss")
    assert sorted(curve) == list(range(1, 41))
    assert metrics["val_loss"] == curve[40]
    assert curve[40] < 0.5 * curve[1]
    assert (run_dir / "starts.log").read_text().count("\n") == 1
