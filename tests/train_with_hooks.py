"""``python tests/train_with_hooks.py train key=value ...``: the anabranch command line with test
hooks chosen by the HOOK environment variable, so that tests can kill or signal a real training
process at a known moment. Not a test module (no test_ prefix)."""

import os
import sys
import time

import anabranch.trainer.checkpoint as checkpoint
import anabranch.trainer.loop as loop
from anabranch.cli import main

HOOK = os.environ.get("HOOK", "")

if HOOK == "hang_in_second_checkpoint":
    # Hang after writing the model files of the second checkpoint, before its trainer state.
    save_hf, calls = checkpoint.save_hf, [0]

    def hanging_save_hf(model, tokenizer, path, state_dict=None):
        save_hf(model, tokenizer, path, state_dict=state_dict)
        calls[0] += 1
        if calls[0] == 2:
            print("WRITING-CHECKPOINT", flush=True)
            time.sleep(600)

    checkpoint.save_hf = hanging_save_hf

elif HOOK.startswith("slow_update:"):
    # Each policy update announces itself and then takes the given number of seconds longer.
    delay, update, calls = float(HOOK.split(":")[1]), loop.policy_update, [0]

    def slow_update(*args, **kwargs):
        calls[0] += 1
        print(f"UPDATE {calls[0]}", flush=True)
        time.sleep(delay)
        return update(*args, **kwargs)

    loop.policy_update = slow_update

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
