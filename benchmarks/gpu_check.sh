#!/usr/bin/env bash
# The GPU path, checked on one CUDA GPU: short GRPO runs through accelerate with bf16 autocast
# (configs/accelerate/single_gpu.yaml), the same workload in fp32, gradient checkpointing with LoRA,
# and FSDP2 (configs/accelerate/fsdp2.yaml with one process) whose HF export is then loaded and
# sampled by plain transformers. Prints a throughput table (benchmarks/run_speed.py).
#
#   bash benchmarks/gpu_check.sh OUT_DIR            # MODEL=... STEPS=... PYTHON=... to change
#
# Results and the command line of the last check are in docs/benchmarks.md ("GPU").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-check}
PY=${PYTHON:-python3}
MODEL=${MODEL:-packaged:smollm2-135m-instruct}
STEPS=${STEPS:-20}          # the learning run
SPEED_STEPS=${SPEED_STEPS:-6}
PROMPTS=${PROMPTS:-32} N=${N:-8} TOKENS=${TOKENS:-128} MICRO=${MICRO:-64}
DEVICE_ARGS=${DEVICE_ARGS:-}  # e.g. "trainer.device=cpu" to dry-run this script without a GPU
mkdir -p "$OUT"
LAUNCH=("$PY" -m accelerate.commands.launch)
COMMON=(model.path="$MODEL" trainer.output_dir="$OUT/runs" trainer.progress=false $DEVICE_ARGS)
# 32 prompts x 8 samples per step; the speed runs fix every completion at 128 tokens (min = max).
SPEED=(rollout.prompts_per_step="$PROMPTS" rollout.n="$N" rollout.max_new_tokens="$TOKENS"
       rollout.min_new_tokens="$TOKENS" trainer.micro_batch_size="$MICRO" trainer.eval_before=false trainer.eval_after=false trainer.save_final=false
       trainer.steps="$SPEED_STEPS")
source benchmarks/run_logged.sh  # run NAME COMMAND...: logged to $OUT/NAME.log, keeps going on failure

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" -c "import torch, transformers, accelerate, peft; print('torch', torch.__version__, '| cuda', torch.version.cuda,
'| transformers', transformers.__version__, '| accelerate', accelerate.__version__, '| peft', peft.__version__)"
} 2>&1 | tee "$OUT/env.txt"

# 1. Learning, bf16 autocast (fp32 master weights): reward and held-out accuracy should rise.
run learn_bf16 "${LAUNCH[@]}" --config_file configs/accelerate/single_gpu.yaml -m anabranch train "${COMMON[@]}" \
    trainer.run_name=learn_bf16 trainer.steps="$STEPS" rollout.prompts_per_step="$PROMPTS" rollout.n="$N" \
    rollout.max_new_tokens=64 trainer.micro_batch_size="$MICRO" trainer.eval_every=10
# 2-3. Throughput at fixed lengths, bf16 autocast against plain fp32.
run speed_bf16 "${LAUNCH[@]}" --config_file configs/accelerate/single_gpu.yaml -m anabranch train "${COMMON[@]}" \
    trainer.run_name=speed_bf16 "${SPEED[@]}"
run speed_fp32 "$PY" -m anabranch train "${COMMON[@]}" trainer.run_name=speed_fp32 "${SPEED[@]}"
# 4. Gradient checkpointing + LoRA adapters, bf16.
run gc_lora_bf16 "${LAUNCH[@]}" --config_file configs/accelerate/single_gpu.yaml -m anabranch train "${COMMON[@]}" \
    trainer.run_name=gc_lora_bf16 "${SPEED[@]}" trainer.steps=3 model.gradient_checkpointing=true model.lora.r=16 \
    trainer.save_final=true
# 5. FSDP2 (one process): sharded parameters (DTensors), full-state export at the end.
run fsdp2_bf16 "${LAUNCH[@]}" --config_file configs/accelerate/fsdp2.yaml --num_processes 1 -m anabranch train \
    "${COMMON[@]}" trainer.run_name=fsdp2_bf16 "${SPEED[@]}" trainer.steps=3 trainer.save_final=true
for name in gc_lora_bf16 fsdp2_bf16; do
    run "load_$name" "$PY" - "$OUT/runs/$name/final" <<'EOF'
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path = sys.argv[1]
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda" if torch.cuda.is_available() else "cpu")
ids = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True,
                              return_tensors="pt", return_dict=True).to(model.device)
out = model.generate(**ids, max_new_tokens=16, do_sample=False)
print(type(model).__name__, sum(p.numel() for p in model.parameters()), "parameters;",
      repr(tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)))
EOF
    tail -n 1 "$OUT/load_$name.log"
done

"$PY" benchmarks/run_speed.py "$OUT"/runs/* | tee "$OUT/speed.md"
exit $status
