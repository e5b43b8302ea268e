"""Writes the modules this process holds when it starts, sorted, to ``run.dir``'s
``modules.json`` (``python -m tests.helpers.modules_seen run.dir=DIR``): a trial forked by a warm
server holds what the server imported."""

import json
import sys
from pathlib import Path

if __name__ == "__main__":
    seen = sorted(sys.modules)
    run_dir = Path(sys.argv[1].partition("=")[2])
    (run_dir / "modules.json").write_text(json.dumps(seen))
