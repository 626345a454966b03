#!/usr/bin/env bash
# The research-catalog methods on one CUDA GPU: short bf16 learning runs (configs/accelerate/
# single_gpu.yaml) of each objective, advantage shaping, regularizer and reward added with the
# catalog (docs/research_coverage.md), next to plain GRPO on the same workload, then the table of
# benchmarks/run_speed.py. Each run is independent; PARALLEL of them share the GPU at once (a 135M
# model leaves an H100 mostly idle: the step is bound by the host), so read the s/step column as
# "under PARALLEL-fold sharing", not as a speed benchmark.
#
#   bash benchmarks/gpu_methods_check.sh OUT_DIR [NAME...]   # MODEL=... STEPS=... PARALLEL=... PYTHON=...
#
# Results and the command line of the last check are in docs/benchmarks.md ("GPU: the catalog methods").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-methods-check}; shift || true
PY=${PYTHON:-python3}
MODEL=${MODEL:-packaged:smollm2-135m-instruct}
STEPS=${STEPS:-16} PARALLEL=${PARALLEL:-4}
PROMPTS=${PROMPTS:-32} N=${N:-8} TOKENS=${TOKENS:-64} MICRO=${MICRO:-64} EVAL=${EVAL:-64}
DEVICE_ARGS=${DEVICE_ARGS:-}  # e.g. "trainer.device=cpu" to dry-run this script without a GPU
LAUNCH=(${LAUNCH:-"$PY" -m accelerate.commands.launch --config_file configs/accelerate/single_gpu.yaml})
mkdir -p "$OUT"
COMMON=(model.path="$MODEL" trainer.output_dir="$OUT/runs" trainer.progress=false trainer.steps="$STEPS"
        rollout.prompts_per_step="$PROMPTS" rollout.n="$N" rollout.max_new_tokens="$TOKENS"
        trainer.micro_batch_size="$MICRO" task.eval_size="$EVAL" trainer.save_final=false $DEVICE_ARGS)

# Each run's overrides, separated by ';'.
declare -A RUNS=(
    [grpo]="algorithm.name=grpo"
    [ngrpo]="algorithm.name=ngrpo;algorithm.clip_ratio_low=0.16;algorithm.clip_ratio_high=0.24;algorithm.dynamic_sampling=false"
    [ace]="algorithm.name=ace"
    [fdpg_js]="algorithm.name=fdpg;algorithm.kl_coef=0;algorithm.fdpg.divergence=js"
    [lp_reg]="algorithm.lp_reg_coef=1.0"
    [dsdr]="algorithm.dsdr_global_coef=0.1;algorithm.dsdr_local_coef=0.01;algorithm.dsdr_similarity=ngram"
    [ucas]="algorithm.ucas=true"
    [progrpo]="algorithm.progrpo_alpha=0.1"
    [dph_js]="algorithm.dph.coef=0.1;algorithm.dph.buffer_prompts=32"
    [rlpr]="reward.functions=[rlpr, math_verify*0]"
    [noisy_verifier]="algorithm.name=dr_grpo;reward.functions=[{name: noisy_verifier, params: {reward: math_verify, false_positive_rate: 0.1, false_negative_rate: 0.2}}, math_verify*0]"
    [mixture_dump]="task.mixture=[{name: basic_arithmetic}, {name: 'reasoning_gym:chain_sum'}];task.curriculum=dump"
    [rover]="algorithm.name=rover;algorithm.ppo_epochs=2"
    [hpt]="algorithm.hpt.enabled=true"
    [pairing]="task.pairing=true;task.pairing_pairs=1;task.pairing_samples=8"
)
ORDER=(grpo ngrpo ace fdpg_js lp_reg dsdr ucas progrpo dph_js rlpr noisy_verifier mixture_dump rover hpt pairing)
(( $# )) && ORDER=("$@")

{
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" -c "import torch, transformers, accelerate; print('torch', torch.__version__, '| cuda', torch.version.cuda,
'| transformers', transformers.__version__, '| accelerate', accelerate.__version__)"
} 2>&1 | tee "$OUT/env.txt"
# Convert the packaged GGUF once, before runs that would race to write the same cache folder.
"$PY" -c "from anabranch.models.loading import resolve_model_path as r; print('model:', r('$MODEL'))" || exit 1

status=0
pids=() names=()
wait_one() {  # reap the oldest running job, report it
    local pid=${pids[0]} name=${names[0]}
    pids=("${pids[@]:1}") names=("${names[@]:1}")
    if wait "$pid"; then echo "   $name ok"; else echo "   $name FAILED; last lines:"; tail -n 30 "$OUT/$name.log"; status=1; fi
}
for name in "${ORDER[@]}"; do
    [[ -n ${RUNS[$name]+x} ]] || { echo "unknown run $name (known: ${ORDER[*]})"; exit 2; }
    (( ${#pids[@]} >= PARALLEL )) && wait_one
    echo "== $name: ${RUNS[$name]}"
    IFS=';' read -ra extra <<<"${RUNS[$name]}"
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "${LAUNCH[@]}" -m anabranch train "${COMMON[@]}" trainer.run_name="$name" \
        "${extra[@]}" >"$OUT/$name.log" 2>&1 &
    pids+=($!) names+=("$name")
done
while (( ${#pids[@]} )); do wait_one; done

dirs=(); for name in "${ORDER[@]}"; do [[ -d $OUT/runs/$name ]] && dirs+=("$OUT/runs/$name"); done
(( ${#dirs[@]} )) && "$PY" benchmarks/run_speed.py "${dirs[@]}" | tee "$OUT/speed.md"
exit $status
