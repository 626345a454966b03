"""The ``generate`` backend prefills each prompt once for its n samples (models/shared_prefix.py):
the decoder really sees one row per prompt, and the tokens are those of the unshared prefill."""

import pytest
import torch

from anabranch.config import RolloutConfig
from anabranch.models.logprobs import position_ids_from_mask
from anabranch.models.shared_prefix import shared_prompt_cache
from anabranch.rollout.hf_generate import HFGenerateBackend

PROMPTS = ["ab", "abcdef", "abcd"]  # different lengths: left padding inside the batch


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    return HFGenerateBackend(model, tok, RolloutConfig(max_new_tokens=6, min_new_tokens=6))


def _decoder_calls(backend, **generate_kw):
    """The rollout and the (rows, tokens) of every decoder call it made."""
    calls = []

    def record(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        calls.append(tuple(ids.shape) if ids is not None else None)

    handle = backend.model.get_decoder().register_forward_pre_hook(record, with_kwargs=True)
    try:
        ro = backend.generate(PROMPTS, **generate_kw)
    finally:
        handle.remove()
    return ro, calls


@pytest.mark.parametrize("greedy", [True, False])
def test_each_prompt_is_prefilled_once_and_the_tokens_are_unchanged(backend, greedy):
    width = backend.tokenizer(PROMPTS, return_tensors="pt", padding=True)["input_ids"].shape[1]
    backend.share_prompt_prefix = False
    torch.manual_seed(0)
    plain, plain_calls = _decoder_calls(backend, n=4, greedy=greedy)
    backend.share_prompt_prefix = True
    torch.manual_seed(0)
    shared, shared_calls = _decoder_calls(backend, n=4, greedy=greedy)
    assert plain_calls[0] == (12, width)  # every row's whole prompt
    assert shared_calls[0] == (3, width - 1)  # one row per prompt, all but its last token
    assert shared_calls[1:] == [(12, 1)] * 6  # then the prompts' last token and 5 sampled ones
    assert torch.equal(plain.response_ids, shared.response_ids)
    assert plain.completions == shared.completions


def test_the_shared_cache_equals_the_rows_own_prefill(backend):
    from transformers import DynamicCache

    enc = backend.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"].repeat_interleave(2, 0), enc["attention_mask"].repeat_interleave(2, 0)
    model = backend.model.eval()
    cache = shared_prompt_cache(model, ids, mask)
    own = DynamicCache(config=model.config)
    with torch.no_grad():
        model.get_decoder()(input_ids=ids[:, :-1], attention_mask=mask[:, :-1],
                            position_ids=position_ids_from_mask(mask[:, :-1]), past_key_values=own, use_cache=True)
    real = mask[:, :-1].bool()  # padded positions are masked out whatever they hold
    for a, b in zip(cache.layers, own.layers):
        assert a.keys.shape == b.keys.shape == (6, model.config.num_key_value_heads, ids.shape[1] - 1,
                                                a.keys.shape[-1])
        assert torch.allclose(a.keys.transpose(1, 2)[real], b.keys.transpose(1, 2)[real], atol=1e-5)
        assert torch.allclose(a.values.transpose(1, 2)[real], b.values.transpose(1, 2)[real], atol=1e-5)
    # Nothing to share: one sample per prompt; or right padding (the last column is not every row's last token).
    assert shared_prompt_cache(model, enc["input_ids"], enc["attention_mask"]) is None
    assert shared_prompt_cache(model, ids, mask.flip(-1)) is None
