#!/usr/bin/env bash
# The GPU check on a bare GPU machine that reaches no package registry (docs/performance.md "GPU check").
#
#   here:  make gpu-wheels                      # = PYTHON=.venv/bin/python gpu_machine.sh wheels
#   there: bash benchmarks/gpu_machine.sh check [muoneq gpu-check flags, e.g. --part-timeout 300]
#
# `wheels` downloads Python 3.12 x86-64 wheels of the packages the machines' image lacks, at
# the versions installed in this checkout's .venv (the set the test suite ran), into .whl/.
# `check` installs them into $SITE (on PYTHONPATH), installs this checkout with
# `pip install --no-deps -e .` and runs `muoneq gpu-check` (each part under its own time
# limit); with $OUT set (the device tool's output folder) the results file and its summary are
# copied there after every part; a copy of the checkout without .git must name its commit with
# MUONEQ_GIT_COMMIT=<hash> (refused otherwise: the record would name none).
#
# The image has Python 3.12, torch, torchvision, lightning, torchmetrics, tensorboard, tiktoken,
# tokenizers, matplotlib, triton, numpy, PyYAML, tqdm, MarkupSafe, pytest, hypothesis, pyarrow,
# setuptools and wheel; of the project's needs it lacks omegaconf and optuna with optuna's
# alembic, SQLAlchemy, Mako and colorlog, and the bench extra's peers, heavyball (its
# opt-einsum is there) and muon-optimizer. (`datasets` is left out: only `muoneq data`'s Hub
# sources use it, the machine reaches no network, and the GPU tests tokenize a local file.)
set -euo pipefail
cd "$(dirname "$0")/.."

MISSING=(omegaconf optuna alembic sqlalchemy mako colorlog heavyball muon-optimizer)
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/site}

case "${1:-}" in
wheels)
    specs=$("$PYTHON" -c 'import sys; from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1:]))' "${MISSING[@]}")
    rm -rf "$WHEELS"
    # shellcheck disable=SC2086  # one argument per requirement
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$WHEELS" $specs
    ls -1 "$WHEELS"
    echo "$(du -sh "$WHEELS" | cut -f1) in $WHEELS: carry it (run's carry=[\"$WHEELS\"], 64 MiB a call)"
    ;;
check)
    shift
    if [ -z "${MUONEQ_GIT_COMMIT:-}" ] && [ "$(git rev-parse --show-toplevel 2>/dev/null)" != "$PWD" ]; then
        echo "gpu_machine.sh: this copy is no git checkout of its own, so the results would name no commit; run it as MUONEQ_GIT_COMMIT=<git rev-parse HEAD where it was copied from> bash benchmarks/gpu_machine.sh check" >&2
        exit 2
    fi
    shopt -s nullglob
    wheels=("$WHEELS"/*.whl)
    if [ ${#wheels[@]} -eq 0 ]; then
        echo "gpu_machine.sh: no wheels in $WHEELS/; run make gpu-wheels where pip works and carry $WHEELS" >&2
        exit 2
    fi
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "${wheels[@]}"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    # no registry there: build the editable install with the image's setuptools
    "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation -e .
    exec "$PYTHON" -m muoneq gpu-check ${OUT:+--copy-to "$OUT"} "$@"
    ;;
*)
    echo "usage: gpu_machine.sh wheels | check [muoneq gpu-check flags]" >&2
    exit 2
    ;;
esac
