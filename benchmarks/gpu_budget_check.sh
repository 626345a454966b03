#!/usr/bin/env bash
# The measured micro-batch budget on one CUDA GPU (trainer.micro_batch_tokens=-1, the default;
# trainer/gpu_budget.py) against fixed rows: the same fixed-length GRPO workload with rows of 16 (the
# GPU default before), rows of 64 (benchmarks/gpu_check.sh's setting) and auto, one run after the
# other, then a learning run with auto to compare with gpu_check.sh's learn_bf16.
#
#   bash benchmarks/gpu_budget_check.sh OUT_DIR      # MODEL=... STEPS=... PYTHON=...
#
# Results and the command line of the last check are in docs/benchmarks.md ("GPU: a measured micro-batch budget").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-budget-check}
PY=${PYTHON:-python3}
MODEL=${MODEL:-packaged:smollm2-135m-instruct}
STEPS=${STEPS:-20} SPEED_STEPS=${SPEED_STEPS:-8}
PROMPTS=${PROMPTS:-32} N=${N:-8} TOKENS=${TOKENS:-128}
mkdir -p "$OUT"
LAUNCH=("$PY" -m accelerate.commands.launch --config_file configs/accelerate/single_gpu.yaml)
COMMON=(model.path="$MODEL" trainer.output_dir="$OUT/runs" trainer.progress=false rollout.prompts_per_step="$PROMPTS"
        rollout.n="$N")
SPEED=(rollout.max_new_tokens="$TOKENS" rollout.min_new_tokens="$TOKENS" trainer.eval_before=false
       trainer.eval_after=false trainer.save_final=false trainer.steps="$SPEED_STEPS")
source benchmarks/run_logged.sh  # run NAME COMMAND...: logged to $OUT/NAME.log, keeps going on failure

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$OUT/env.txt"
"$PY" -c "from anabranch.models.loading import resolve_model_path as r; print('model:', r('$MODEL'))" || exit 1
run rows16 "${LAUNCH[@]}" -m anabranch train "${COMMON[@]}" trainer.run_name=rows16 "${SPEED[@]}" \
    trainer.micro_batch_tokens=0 trainer.micro_batch_size=16
run rows64 "${LAUNCH[@]}" -m anabranch train "${COMMON[@]}" trainer.run_name=rows64 "${SPEED[@]}" \
    trainer.micro_batch_tokens=0 trainer.micro_batch_size=64
run auto "${LAUNCH[@]}" -m anabranch train "${COMMON[@]}" trainer.run_name=auto "${SPEED[@]}"
run learn_auto "${LAUNCH[@]}" -m anabranch train "${COMMON[@]}" trainer.run_name=learn_auto trainer.steps="$STEPS" \
    rollout.max_new_tokens=64 trainer.eval_every=10

"$PY" benchmarks/run_speed.py --skip 3 "$OUT"/runs/{rows16,rows64,auto} | tee "$OUT/speed.md"
"$PY" benchmarks/run_speed.py "$OUT"/runs/learn_auto | tee -a "$OUT/speed.md"
for r in rows16 rows64 auto learn_auto; do  # the update's own time and the budget, step by step
    "$PY" - "$OUT/runs/$r/metrics.jsonl" "$r" <<'PY' | tee -a "$OUT/speed.md"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"time/step_s"' in l]
fmt = lambda k: " ".join(f"{r.get(k, float('nan')):.3g}" for r in rows)
print(sys.argv[2], "| forward_backward_s:", fmt("time/forward_backward_s"), "| micro_batches:", fmt("micro_batches"),
      "| budget:", fmt("update/micro_batch_tokens"), "| largest:", fmt("update/max_micro_batch_tokens"),
      "| gpu_peak_gib:", fmt("memory/gpu_peak_gib"))
PY
done
exit $status
