"""What the ``generate`` backend returns: the Rollout's tensors, seeds and padding.

``eos_prone_policy`` (also used by tests/test_rollout_vllm_contract.py) is a tiny random Qwen2 whose
EOS row of the (tied) LM head is pushed towards the hidden states' mean direction, so that greedy
decoding stops at once on some prompts, later under ``min_new_tokens``, and never on others.
"""

import pytest
import torch

from anabranch.config import RolloutConfig
from anabranch.rollout.hf_generate import HFGenerateBackend

PROMPTS = ["1+1=", "abc", "The answer is", "7*8"]


def eos_prone_policy(folder, pad_is_eos: bool = False, alpha: float = 0.25):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from anabranch.models.tiny import build_tiny_model

    path = build_tiny_model(folder, arch="qwen2", hidden=128, layers=2, heads=2, kv_heads=1, intermediate=256,
                            seed=3)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.padding_side = "left"
    if pad_is_eos:  # as SmolLM2's tokenizer: pad = EOS = <|im_end|>
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        enc = tok(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
        h = model.model(**enc).last_hidden_state[enc["attention_mask"].bool()]
        model.get_output_embeddings().weight[tok.eos_token_id] += alpha * h.mean(0) / h.mean(0).norm()
    return model, tok


def check_rollout_contract(ro, tok, eos_ids, n, max_new, min_new=0):
    """The layout every backend returns (rollout/base.py)."""
    B = len(ro.prompts) * n
    assert ro.group_index.tolist() == [i for i in range(len(ro.prompts)) for _ in range(n)]
    assert ro.response_ids.shape[0] == ro.prompt_ids.shape[0] == B
    assert ro.prompt_mask[:, -1].all(), "prompts are left-padded"
    assert (ro.prompt_mask.cummax(1).values == ro.prompt_mask).all()  # 0…0 1…1
    assert (ro.prompt_ids[ro.prompt_mask == 0] == tok.pad_token_id).all()
    is_eos = torch.zeros_like(ro.response_ids, dtype=torch.bool)
    for e in eos_ids:
        is_eos |= ro.response_ids == e
    lengths = ro.response_mask.sum(-1)
    assert torch.equal(ro.response_lengths, lengths)
    for i in range(B):
        L = int(lengths[i])
        assert ro.response_mask[i, :L].all() and not ro.response_mask[i, L:].any(), "mask is 1…1 0…0"
        assert (ro.response_ids[i, L:] == tok.pad_token_id).all(), "right-padded with the pad id"
        masked_eos = is_eos[i, :L].nonzero().view(-1).tolist()
        if ro.truncated[i]:
            assert masked_eos == [] and L == max_new, "truncated: max_new_tokens without EOS"
        else:
            assert masked_eos == [L - 1], "the mask ends with (and includes) the first EOS"
        assert L >= min(min_new + 1, max_new), "EOS only after min_new_tokens"
        assert ro.completions[i] == tok.decode(ro.response_ids[i, :L], skip_special_tokens=True)
    assert ro.sample_log_probs is None or ro.sample_log_probs.shape == ro.response_ids.shape


@pytest.mark.parametrize("pad_is_eos", [False, True])
@pytest.mark.parametrize("min_new", [0, 3])
def test_rollout_tensors_follow_the_contract(tmp_path, pad_is_eos, min_new):
    model, tok = eos_prone_policy(tmp_path / "m", pad_is_eos=pad_is_eos)
    max_new = 12
    be = HFGenerateBackend(model, tok, RolloutConfig(max_new_tokens=max_new, min_new_tokens=min_new))
    greedy = be.generate(PROMPTS, 1, greedy=True)
    check_rollout_contract(greedy, tok, be.eos_ids, 1, max_new, min_new)
    # Both kinds of rows occur, and min_new_tokens moves the EOS: 3 prompts stop at once without it.
    assert greedy.truncated.any() and not greedy.truncated.all()
    stopped = greedy.response_lengths[~greedy.truncated]
    assert (stopped == 1).all() if min_new == 0 else (stopped > min_new).all()
    sampled = be.generate(PROMPTS, 3, seed=0)
    check_rollout_contract(sampled, tok, be.eos_ids, 3, max_new, min_new)


def test_seed_repeats_a_sampled_rollout_and_leaves_the_global_rng_alone(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    be = HFGenerateBackend(model, tok, RolloutConfig(max_new_tokens=8))
    state = torch.random.get_rng_state()
    first = be.generate(["ab", "abcdef"], 3, seed=5)
    assert torch.equal(torch.random.get_rng_state(), state)
    torch.manual_seed(123)  # the process's generator moved: the seeded call does not care
    assert be.generate(["ab", "abcdef"], 3, seed=5).response_ids.tolist() == first.response_ids.tolist()
    assert be.generate(["ab", "abcdef"], 3, seed=6).response_ids.tolist() != first.response_ids.tolist()


def test_prompts_are_left_padded_whatever_the_tokenizers_padding_side(tmp_path):
    """A right-padding tokenizer used to put pad tokens between a short prompt and its response."""
    model, tok = eos_prone_policy(tmp_path / "m", alpha=0.0)
    be = HFGenerateBackend(model, tok, RolloutConfig(max_new_tokens=6))
    alone = [be.generate([p], 1, greedy=True).response_ids[0].tolist() for p in ("1+1=", "The answer is")]
    tok.padding_side = "right"
    ro = be.generate(["1+1=", "The answer is"], 1, greedy=True)
    assert ro.prompt_mask[:, -1].all()
    assert ro.response_ids.tolist() == alone


def test_the_models_generation_config_does_not_change_the_sampling_distribution(tmp_path):
    """A model's generation_config.json (Qwen2.5-Instruct ships repetition_penalty=1.1, top_k=20, ...)
    used to add its repetition penalty / n-gram ban to rollout.*: samples from a policy that neither the
    trainer's log-probs nor the vLLM backend know."""
    model, tok = eos_prone_policy(tmp_path / "m", alpha=0.0)
    cfg = RolloutConfig(max_new_tokens=10, temperature=0.8)
    plain = HFGenerateBackend(model, tok, cfg)
    ref_greedy, ref_sampled = plain.generate(PROMPTS, 1, greedy=True), plain.generate(PROMPTS, 2, seed=4)
    assert any(len(set(r)) < len(r) for r in ref_greedy.response_ids.tolist())  # repeats for a penalty to bite
    g = model.generation_config
    g.do_sample, g.temperature, g.top_k, g.top_p = True, 0.3, 2, 0.5
    g.repetition_penalty, g.no_repeat_ngram_size, g.num_return_sequences = 3.0, 2, 3
    be = HFGenerateBackend(model, tok, cfg)
    assert be.generate(PROMPTS, 1, greedy=True).response_ids.tolist() == ref_greedy.response_ids.tolist()
    assert be.generate(PROMPTS, 2, seed=4).response_ids.tolist() == ref_sampled.response_ids.tolist()
