"""The small shared helpers of rollout/base.py: right_padded, pad_id, cut_at_eos, Rollout.prompt_tokens."""

from types import SimpleNamespace

import torch

from anabranch.rollout.base import Rollout, cut_at_eos, left_padded, pad_id, right_padded


def test_right_padded_places_each_sequence_at_the_left():
    ids, mask = right_padded([[5, 6, 7], [8], []], pad=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0], [0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    assert ids.dtype == torch.long and mask.dtype == torch.long


def test_right_padded_pad_value_and_min_width():
    ids, mask = right_padded([[], []], pad=9)  # all empty: still one (masked) column
    assert ids.tolist() == [[9], [9]] and mask.tolist() == [[0], [0]]
    ids, mask = right_padded([[], []], pad=9, min_width=0)
    assert tuple(ids.shape) == (2, 0)
    ids, _ = right_padded([[1]], pad=9, min_width=3)
    assert ids.tolist() == [[1, 9, 9]]


def test_right_padded_mirrors_left_padded():
    seqs = [[3, 4], [5, 6, 7]]
    l_ids, l_mask = left_padded(seqs, pad=2)
    r_ids, r_mask = right_padded(seqs, pad=2)
    assert l_ids.tolist() == [[2, 3, 4], [5, 6, 7]]
    assert r_ids.tolist() == [[3, 4, 2], [5, 6, 7]]
    assert r_mask.tolist() == [[1, 1, 0], [1, 1, 1]] and l_mask.tolist() == [[0, 1, 1], [1, 1, 1]]


def test_pad_id_prefers_the_tokenizer_pad_then_the_fallback():
    assert pad_id(SimpleNamespace(pad_token_id=3), 7) == 3
    assert pad_id(SimpleNamespace(pad_token_id=0), 7) == 0  # 0 is a pad id, not a missing one
    assert pad_id(SimpleNamespace(pad_token_id=None), 7) == 7
    assert pad_id(SimpleNamespace(pad_token_id=None)) is None


def test_cut_at_eos_keeps_through_the_first_eos():
    assert cut_at_eos([4, 5, 2, 6, 2], [2]) == ([4, 5, 2], True)
    assert cut_at_eos([4, 9, 5, 2], {2, 9}) == ([4, 9], True)  # any stop id; the first one wins
    assert cut_at_eos([2, 4], [2]) == ([2], True)
    assert cut_at_eos([4, 5, 6], [2]) == ([4, 5, 6], False)
    assert cut_at_eos([], [2]) == ([], False)


def test_prompt_tokens_drops_the_left_padding():
    ro = Rollout(prompt_ids=torch.tensor([[0, 0, 5, 6], [7, 8, 9, 1]]),
                 prompt_mask=torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]),
                 response_ids=torch.zeros(2, 1, dtype=torch.long), response_mask=torch.ones(2, 1, dtype=torch.long),
                 group_index=torch.tensor([0, 1]), prompts=["a", "b"], completions=["", ""],
                 truncated=torch.zeros(2, dtype=torch.bool))
    assert ro.prompt_tokens(0) == [5, 6]
    assert ro.prompt_tokens(1) == [7, 8, 9, 1]
