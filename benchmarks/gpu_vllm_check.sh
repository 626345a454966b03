#!/usr/bin/env bash
# The vLLM rollout backend on one CUDA GPU (needs the `vllm` package: pip install 'anabranch[vllm]').
#   tests: tests/test_vllm_backend.py (after an in-place weight update the engine's greedy output is
#          the trainer's; sampling log-probs against the trainer's; the mismatch metric and TIS;
#          a LoRA policy synced as merged weights) and tests/test_vllm_engine_args.py.
#   train: the runs of benchmarks/gpu_check.sh with rollout.backend=vllm: a bf16 learning run
#          (reward and held-out accuracy should rise) and a fixed-length speed run, then the
#          throughput table of benchmarks/run_speed.py, to compare with gpu_check.sh's `generate` rows.
#
#   bash benchmarks/gpu_vllm_check.sh OUT_DIR [tests|learn|speed|train|all]   # train = learn + speed     # MODEL=... STEPS=... PYTHON=...
#
# Results and the command line of the last check are in docs/benchmarks.md ("GPU: the vLLM backend").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-vllm-check}
WHAT=${2:-all}
PY=${PYTHON:-python3}
MODEL=${MODEL:-packaged:smollm2-135m-instruct}
STEPS=${STEPS:-20} SPEED_STEPS=${SPEED_STEPS:-6}
PROMPTS=${PROMPTS:-32} N=${N:-8} TOKENS=${TOKENS:-128} MICRO=${MICRO:-64}
mkdir -p "$OUT"
LAUNCH=("$PY" -m accelerate.commands.launch --config_file configs/accelerate/single_gpu.yaml)
COMMON=(model.path="$MODEL" trainer.output_dir="$OUT/runs" trainer.progress=false rollout.backend=vllm)
SPEED=(rollout.prompts_per_step="$PROMPTS" rollout.n="$N" rollout.max_new_tokens="$TOKENS"
       rollout.min_new_tokens="$TOKENS" trainer.micro_batch_size="$MICRO" trainer.eval_before=false
       trainer.eval_after=false trainer.save_final=false trainer.steps="$SPEED_STEPS")
source benchmarks/run_logged.sh  # run NAME COMMAND...: logged to $OUT/NAME.log, keeps going on failure

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" -c "import torch, transformers, vllm; print('torch', torch.__version__, '| cuda', torch.version.cuda,
'| transformers', transformers.__version__, '| vllm', vllm.__version__)"
} 2>&1 | tee "$OUT/env.txt"

if [[ $WHAT == tests || $WHAT == all ]]; then
    run tests "$PY" -m pytest -q -p no:cacheprovider tests/test_vllm_backend.py tests/test_vllm_engine_args.py
    tail -n 3 "$OUT/tests.log"
fi
if [[ $WHAT == learn || $WHAT == train || $WHAT == all ]]; then
    # 1. Learning with the engine in bf16 (the trainer's autocast precision), fp32 master weights.
    run learn_vllm_bf16 "${LAUNCH[@]}" -m anabranch train "${COMMON[@]}" trainer.run_name=learn_vllm_bf16 \
        trainer.steps="$STEPS" rollout.prompts_per_step="$PROMPTS" rollout.n="$N" rollout.max_new_tokens=64 \
        trainer.micro_batch_size="$MICRO" trainer.eval_every=10
fi
if [[ $WHAT == speed || $WHAT == train || $WHAT == all ]]; then
    # 2-3. Throughput at fixed lengths (every completion exactly TOKENS tokens), with the engine's
    # CUDA graphs (the default) and without (rollout.vllm_cuda_graphs=false: eager decode steps).
    run speed_vllm_bf16 "${LAUNCH[@]}" -m anabranch train "${COMMON[@]}" trainer.run_name=speed_vllm_bf16 "${SPEED[@]}"
    run speed_vllm_bf16_eager "${LAUNCH[@]}" -m anabranch train "${COMMON[@]}" \
        trainer.run_name=speed_vllm_bf16_eager "${SPEED[@]}" rollout.vllm_cuda_graphs=false
fi
if [[ $WHAT != tests ]]; then
    "$PY" benchmarks/run_speed.py "$OUT"/runs/* | tee "$OUT/speed.md"
fi
exit $status
