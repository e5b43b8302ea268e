import hashlib
import json
import os
import random
import sys
from pathlib import Path

import numpy
import threadpoolctl
import torch

from tests.helpers.fresh_view import _inits

args = dict(word.split("=", 1) for word in sys.argv[1:])
run_dir = Path(args["run.dir"])
run_dir.mkdir(parents=True, exist_ok=True)
HELD = (run_dir / "held.txt").open("w")  # never closed: the interpreter flushes it at its end
HELD.write("written, never flushed\n")
blas = [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]
view = {
    "package_inits": _inits.count,
    "main": [__name__, __spec__.name, Path(sys.argv[0]).name,
             sys.argv[1:] == [f"run.dir={run_dir}"]],
    "path0": os.path.abspath(sys.path[0]),
    "threads": [torch.get_num_threads(), *blas],
    "torch_seed": torch.initial_seed(),
    "draws": [torch.rand(1).item(), numpy.random.rand(), random.random()],
    "hash": hashlib.sha256(str(hash("muoneq")).encode()).hexdigest()[:8],
}
(run_dir / "view.json").write_text(json.dumps(view))
