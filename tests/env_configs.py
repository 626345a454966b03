"""Config overrides the tests load from dicts: the number_guess environment's base and the dict-to-override
conversion (``{"rollout.n": 4, "reward.functions": [...]}`` → ``["rollout.n=4", 'reward.functions=[...]']``); the
short number_guess trainer runs' overrides and their scripted guessing policy; ``Scripted`` (tests/scripted_backend.py:
an episode's k-th action after k user messages) re-exported for the environment tests that import it from here."""

from __future__ import annotations

import json

import scripted_backend
from anabranch import load_config

Scripted = scripted_backend.Scripted  # re-exported: the environment tests import it from here

# number_guess episodes scored by the environment: its return is the reward, its solved flag only logged.
ENV_BASE = {"task.name": "number_guess", "rollout.environment": "number_guess",
            "reward.functions": [{"name": "env_return"}, {"name": "env_solved", "weight": 0}]}


def override_strings(over: dict) -> list[str]:
    """``key=value`` override strings: a string value as it is (YAML), anything else as JSON."""
    return [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in over.items()]


def load_with(**over):
    """``load_config`` of the packaged defaults with ``over`` (dotted keys: ``load_with(**{"rollout.n": 4})``)."""
    return load_config(None, override_strings(over))


def number_guess_overrides(**extra) -> dict:
    """``tiny_overrides`` extras (test_train_e2e: values written with ``str``) of a two-step number_guess run in
    [1, 4] on the tiny model: 8 games, 2 prompts x 4 episodes a step, at most 3 turns, no eval unless ``extra``
    sets ``trainer.eval_after``; ``extra`` (the method's keys) is added last."""
    return {"task.name": ENV_BASE["task.name"], "task.path": "", "task.params": json.dumps({"lo": 1, "hi": 4}),
            "task.train_size": 8, "task.eval_size": 2, "task.instruction": "''",
            "trainer.steps": 2, "trainer.eval_before": False, "trainer.eval_after": False, "rollout.n": 4,
            "rollout.max_new_tokens": 60, "rollout.prompts_per_step": 2,
            "rollout.environment": ENV_BASE["rollout.environment"], "rollout.max_env_turns": 3,
            "reward.functions": json.dumps(ENV_BASE["reward.functions"]), **extra}


def scripted_guesses(monkeypatch) -> None:
    """Patch ``HFGenerateBackend.continue_ids`` so each action is one sampled token mapped to a guess in [1, 4] +
    EOS: the tiny model's random policy seldom writes a number, and the trainer recomputes the log-probs of the
    tokens it is given, so the episodes still train."""
    from anabranch.rollout.hf_generate import HFGenerateBackend

    orig = HFGenerateBackend.continue_ids

    def guess(self, seqs, max_new, stop=(), greedy=False, seed=None):
        tok = self.tokenizer
        digit = lambda i: tok.convert_tokens_to_ids(str(1 + i % 4))  # noqa: E731 - a guess in [1, 4]
        return [([digit(ids[0]), tok.eos_token_id], None) for ids, _ in orig(self, seqs, [1] * len(seqs), stop,
                                                                              greedy, seed)]

    monkeypatch.setattr(HFGenerateBackend, "continue_ids", guess)
