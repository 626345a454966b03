import torch

from anabranch.config import RolloutConfig
from anabranch.models.logprobs import response_forward
from anabranch.rollout.base import response_mask_from_eos


def test_response_mask_through_first_eos():
    ids = torch.tensor([[5, 6, 2, 7, 2], [5, 6, 7, 8, 9], [2, 0, 0, 0, 0]])
    mask, truncated = response_mask_from_eos(ids, [2])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert truncated.tolist() == [False, True, False]


def test_response_log_probs_match_a_full_log_softmax_and_ignore_left_padding(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompt, resp = [11, 12, 13], [14, 15, 16, 17]
    ids = torch.tensor([prompt + resp])
    out = response_forward(model, ids, torch.ones_like(ids), len(resp), entropy=True)
    logits = model(ids).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(resp)[:, None]).squeeze(-1)
    assert torch.allclose(out.log_probs[0], ref, atol=1e-5)
    ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    assert torch.allclose(out.entropy[0], ent, atol=1e-5)
    # The same sequence left-padded by two tokens gives the same log-probs.
    pad = 0
    ids2 = torch.tensor([[pad, pad] + prompt + resp])
    mask2 = torch.tensor([[0, 0] + [1] * 7])
    out2 = response_forward(model, ids2, mask2, len(resp))
    assert torch.allclose(out2.log_probs, out.log_probs, atol=1e-5)


def test_hf_backend_groups_and_greedy_is_deterministic(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from anabranch.rollout.hf_generate import HFGenerateBackend

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    be = HFGenerateBackend(model, tok, RolloutConfig(max_new_tokens=6))
    ro = be.generate(["ab", "abcdef"], n=3)
    assert ro.group_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert ro.response_ids.shape[0] == 6 and ro.response_ids.shape[1] <= 6
    assert ro.input_ids.shape == ro.attention_mask.shape
    g1 = be.generate(["ab", "abcdef"], n=1, greedy=True)
    g2 = be.generate(["ab", "abcdef"], n=1, greedy=True)
    assert g1.completions == g2.completions
    # Log-probs recomputed by the trainer agree with the tokens the sampler emitted being likely.
    out = response_forward(model, ro.input_ids, ro.attention_mask, ro.response_ids.shape[1])
    assert torch.isfinite(out.log_probs[ro.response_mask.bool()]).all()
